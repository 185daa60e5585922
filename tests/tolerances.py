"""Comparison tolerances, one entry per dtype (STYLE.md §3 habit 11).

`EXACT[dtype]` is for comparing our code against an independent reference that computes the same
function with the same rounding points (a transcription of K3_LM.md, or fla's naive references):
the only differences left are accumulation order and the algebraic form (chunked vs recurrent).

- float64: agreement to ~1e-10 means "the same math"; any real discrepancy (a wrong eps, a missing
  rounding-free term, a mis-ordered update) shows up orders of magnitude above it.
- float32: fp32 accumulation noise over recurrences of ~100 steps and a few GEMMs.
- bfloat16: the same rounding points give the same bits. Where an fp32 GEMM feeds a bf16 rounding,
  a different accumulation order can flip a last bit in rare elements; such tests say so.
"""

from __future__ import annotations

import torch

EXACT: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.bfloat16: {"rtol": 0.0, "atol": 0.0},
}


# Elementwise scalar formulas in float64 where the test must resolve differences of ~e^-20 ≈ 2e-9
# (the softplus threshold, §2.8): a few ulps of values up to ~20·16.
SCALAR_FP64: dict[str, float] = {"rtol": 0.0, "atol": 1e-12}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for `torch.testing.assert_close` at `dtype`."""
    return EXACT[dtype]


# Whole-model tolerances (max |Δlogit|, logits O(5)) used by test_decode.py and test_parity_transformers.py.
PATH_FP64_ATOL = 1e-10  # prefill (chunked KDA, MHA-form MLA) vs decode (recurrent, absorbed), float64; seen 1.3e-12
PATH_FP32_ATOL = 2e-3  # the same in float32; seen 4.1e-4 (errors compound over 10 random layers)
PARITY_FP64_ATOL = 1e-10  # ours vs transformers' KimiLinearForCausalLM re-run in float64; seen 4e-14
PARITY_FP32_ATOL = 1e-3  # ours vs transformers in float32 (the bound); seen 4.6e-5


# Triton kernels against their torch reference (tests/test_kernels_mla.py, tests/test_kernels_norm.py,
# bench/kernels_*.py --check). Same rounding points, another fp32 accumulation order (tiles, online
# softmax, split-KV merge, warp reductions): a bf16 result may differ in its last bit. rtol 2^-7 is at
# least one bf16 ulp of any value; atol covers results near zero whose bf16 inputs flipped a last bit
# (test data O(1)). Seen under the interpreter: MLA ≤ 1 ulp in ~0.1-1% of elements, norms ≤ 1 ulp.
KERNEL_VS_REF: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2 ** -7, "atol": 2 ** -9},
}
