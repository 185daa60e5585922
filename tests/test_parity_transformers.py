"""Logit parity with transformers' KimiLinearForCausalLM on a random Kimi-Linear config.

The reference runs in a subprocess (tests/reference/hf_kimi_linear.py) that hides triton from
transformers and saves the checkpoint with `save_pretrained`; we load those same files.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3backend import load_model
from tolerances import PARITY_FP32_ATOL, PARITY_FP64_ATOL

REFERENCE = Path(__file__).parent / "reference" / "hf_kimi_linear.py"
SEED = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh random weights and prompts every run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_kimi_linear")
    proc = subprocess.run([sys.executable, str(REFERENCE), str(out), str(SEED), "3", "64"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"reference failed (seed {SEED}):\n{proc.stderr[-4000:]}"
    return out, torch.load(out / "logits.pt")


def test_loads_transformers_save_pretrained_checkpoint(reference):
    out, _ = reference
    model = load_model(out / "ckpt", progress=False)
    assert model.cfg.model_type == "kimi_linear"
    assert model.cfg.text.first_k_dense_replace == 1  # derived from transformers' mlp_layer_types


def test_float64_logits_match_transformers(reference):
    out, ref = reference
    model = load_model(out / "ckpt", dtype=torch.float64, progress=False)
    for i, prompt in enumerate(ref["prompts"]):
        err = (model(prompt) - ref["fp64"][i]).abs().max().item()
        print(f"seed {SEED} prompt {i}: float64 max |Δlogit| = {err:.3e}")
        assert err < PARITY_FP64_ATOL, f"seed {SEED} prompt {i}: {err}"


def test_float32_logits_match_transformers(reference):
    out, ref = reference
    model = load_model(out / "ckpt", dtype=torch.float32, progress=False)
    for i, prompt in enumerate(ref["prompts"]):
        ours = model(prompt)
        err = (ours - ref["fp32"][i]).abs().max().item()
        err64 = (ours.double() - ref["fp64"][i]).abs().max().item()
        print(f"seed {SEED} prompt {i}: float32 max |Δlogit| vs transformers fp32 {err:.3e}, vs fp64 {err64:.3e}")
        assert err < PARITY_FP32_ATOL, f"seed {SEED} prompt {i}: {err}"
