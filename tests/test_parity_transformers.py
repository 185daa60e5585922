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
from k3backend.generate import full_forward
from tolerances import PARITY_FP32_ATOL, PARITY_FP64_ATOL

REFERENCE = Path(__file__).parent / "reference" / "hf_kimi_linear.py"
SEED = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh random weights and prompts every run


def run_reference(out: Path, n_prompts: int, length: int, v_head_dim: int = 16) -> tuple[Path, dict]:
    proc = subprocess.run([sys.executable, str(REFERENCE), str(out), str(SEED), str(n_prompts), str(length),
                           str(v_head_dim)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"reference failed (seed {SEED}):\n{proc.stderr[-4000:]}"
    return out, torch.load(out / "logits.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("hf_kimi_linear"), 3, 64)


def test_loads_transformers_save_pretrained_checkpoint(reference):
    out, _ = reference
    model = load_model(out / "ckpt", progress=False)
    assert model.cfg.model_type == "kimi_linear"
    assert model.cfg.text.first_k_dense_replace == 1  # derived from transformers' mlp_layer_types


def test_float64_logits_match_transformers(reference):
    out, ref = reference
    model = load_model(out / "ckpt", dtype=torch.float64, progress=False)
    for i, prompt in enumerate(ref["prompts"]):
        err = (full_forward(model, prompt) - ref["fp64"][i]).abs().max().item()
        print(f"seed {SEED} prompt {i}: float64 max |Δlogit| = {err:.3e}")
        assert err < PARITY_FP64_ATOL, f"seed {SEED} prompt {i}: {err}"


def test_float32_logits_match_transformers(reference):
    out, ref = reference
    model = load_model(out / "ckpt", dtype=torch.float32, progress=False)
    for i, prompt in enumerate(ref["prompts"]):
        ours = full_forward(model, prompt)
        err = (ours - ref["fp32"][i]).abs().max().item()
        err64 = (ours.double() - ref["fp64"][i]).abs().max().item()
        print(f"seed {SEED} prompt {i}: float32 max |Δlogit| vs transformers fp32 {err:.3e}, vs fp64 {err64:.3e}")
        assert err < PARITY_FP32_ATOL, f"seed {SEED} prompt {i}: {err}"


def test_kda_value_head_size_comes_from_v_proj(tmp_path):
    """K3_LM.md §13: transformers' KDA layers size values by linear_attn_config.head_dim (16) while
    its config.json also says v_head_dim 24 (the MLA value head); the v_proj shape decides."""
    out, ref = run_reference(tmp_path, 2, 32, v_head_dim=24)
    for dtype, key, atol in ((torch.float64, "fp64", PARITY_FP64_ATOL), (torch.float32, "fp32", PARITY_FP32_ATOL)):
        model = load_model(out / "ckpt", dtype=dtype, progress=False)
        text = model.cfg.text
        assert (text.v_head_dim, text.linear_attn_config.head_dim, text.kda_v_head_dim) == (24, 16, 16)
        for i, prompt in enumerate(ref["prompts"]):
            err = (full_forward(model, prompt) - ref[key][i]).abs().max().item()
            print(f"seed {SEED} v_head_dim 24 prompt {i}: {dtype} max |Δlogit| = {err:.3e}")
            assert err < atol, f"seed {SEED} prompt {i} {dtype}: {err}"
