"""k3_lm serving a checkpoint whose routed experts are MXFP4, as the K3 release stores them (K3_LM.md §7.7).

make-checkpoint --experts mxfp4 writes the tiny preset in the release's on-disk format; the server
keeps the experts packed and its greedy text equals the in-process model's on the same checkpoint.
"""

from __future__ import annotations

import json

import torch

from k3backend.checkpoint import load_model
from k3backend.detokenizer import detokenize_all
from k3backend.engine.sampling_params import SamplingParams
from k3backend.generate import generate
from k3backend.presets import make_checkpoint
from k3backend.tokenizer import Tokenizer
from k3client import http_post
from serverutil import repo_copy

PROMPTS = ["The capital of France is", "Count to five:"]


def test_served_mxfp4_checkpoint_gives_the_in_process_text(triton_server, tmp_path):
    ckpt = make_checkpoint("tiny", tmp_path / "tiny-mxfp4", experts="mxfp4")
    repo = repo_copy(tmp_path / "repo", k3_lm={"model_path": str(ckpt), "dtype": "float64"})
    srv = triton_server(repo, ["k3_lm"], ["--model-control-mode=explicit", "--load-model=k3_lm"], fresh=True)
    log = srv.log_path.read_text(errors="replace")
    assert "routed experts" in log and "as MXFP4" in log, "the load did not keep the experts packed"
    tok = Tokenizer.from_dir(ckpt)
    model = load_model(ckpt, dtype=torch.float64, progress=False)
    assert model.language_model.model.layers[1].mlp.experts.w13.dtype == torch.uint8
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        status, body = http_post(srv.http_url, "/v2/models/k3_lm/generate",
                                 {"text_input": prompt, "max_tokens": 16, "min_tokens": 16, "ignore_eos": True,
                                  "temperature": 0})
        assert status == 200, body
        ref = [s.token for s in generate(model, tok.encode_text_input(prompt), params)]
        assert json.loads(body)["text_output"] == detokenize_all(tok, ref)[0], prompt
