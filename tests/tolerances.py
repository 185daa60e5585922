"""Comparison tolerances, one entry per dtype (STYLE.md §3 habit 11).

`EXACT[dtype]` is for comparing our code against an independent reference that computes the same
function with the same rounding points (a transcription of K3_LM.md, or fla's naive references):
the only differences left are accumulation order and the algebraic form (chunked vs recurrent).

- float64: agreement to ~1e-10 means "the same math"; any real discrepancy (a wrong eps, a missing
  rounding-free term, a mis-ordered update) shows up orders of magnitude above it.
- float32: fp32 accumulation noise over recurrences of ~100 steps and a few GEMMs.
- bfloat16: the same rounding points give the same bits (used only where the GEMM accumulation
  order cannot change a bf16 result, or where the test says why it is stable).
"""

from __future__ import annotations

import torch

EXACT: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.bfloat16: {"rtol": 0.0, "atol": 0.0},
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for `torch.testing.assert_close` at `dtype`."""
    return EXACT[dtype]


# Whole-model tolerances used by test_decode.py and test_parity_transformers.py (max |Δlogit|).
# NOTE: these four names were restored after tests/tolerances.py was accidentally overwritten;
# the values were re-derived from measured errors (see the comments) and may differ from the
# original author's choice.
PATH_FP64_ATOL = 1e-9  # prefill (chunked KDA, MHA-form MLA) vs decode (recurrent, absorbed), float64
PATH_FP32_ATOL = 1e-3  # the same in float32
PARITY_FP64_ATOL = 1e-9  # ours vs transformers' KimiLinearForCausalLM, float64 (§13 reports ~1e-13)
PARITY_FP32_ATOL = 1e-3  # the same in float32
