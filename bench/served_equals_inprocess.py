"""The served model gives the in-process engine's text: k3_lm (its engine-core process) vs the
engine core driven in this process on the same checkpoint, device and dtype, greedy, detokenized
here (a check of the process seam, on a GPU or a CPU).

    python bench/served_equals_inprocess.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

PROMPTS = ["The capital of France is", "Count to five:", "Once upon a time", "A haiku about GPUs:"]


def served(url: str, prompt: str, n: int) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v2/models/k3_lm/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["text_output"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    from k3backend.detokenizer import detokenize_all
    from k3backend.engine.config import EngineConfig
    from k3backend.engine.core import EngineCore, run_requests
    from k3backend.engine.request import Request
    from k3backend.engine.runner import InProcessExecutor
    from k3backend.engine.sampling_params import SamplingParams
    from k3backend.presets import ensure_default_checkpoint
    from k3backend.serving.triton_io import resolve_device_dtype
    from k3backend.tokenizer import Tokenizer

    device, dtype = resolve_device_dtype("auto", "auto", "bench")
    if device.type == "cpu":
        import torch

        torch.set_num_threads(1)  # as k3_lm does for the toy model: the same GEMM blocking
    ckpt = ensure_default_checkpoint()
    tok = Tokenizer.from_dir(ckpt)
    cfg = EngineConfig(max_model_len=4096, gpu_memory_utilization=0.02)
    core = EngineCore(InProcessExecutor.load(ckpt, cfg, dtype=dtype, device=device), cfg)
    n = args.max_tokens
    params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
    outs = run_requests(core, [Request(p, tok.encode_text_input(p), params) for p in PROMPTS])
    same = 0
    for prompt, out in zip(PROMPTS, outs):
        a, b = served(args.url, prompt, n), detokenize_all(tok, out.token_ids)[0]
        same += a == b
        print(f"{'same' if a == b else 'DIFFERENT'}: {prompt!r}: served {a[:40]!r} in-process {b[:40]!r}")
    core.executor.close()
    print(f"served == in-process ({device}, {dtype}, greedy, {args.max_tokens} tokens): {same}/{len(PROMPTS)}")
    return 0 if same == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
