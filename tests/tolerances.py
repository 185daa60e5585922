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


# Fused MoE experts (kernels/moe.py) against moe_ref.experts in bf16: the same rounding points, so
# most elements are bit-equal; a different fp32 accumulation order in the two GEMMs (or the last bit
# of exp/tanh) flips a rounding of gu, h or y_e in rare elements, and that flip moves the output by
# about one bf16 ulp of the expert outputs. A missed or extra rounding point (e.g. HF's bf16 combine,
# K3_LM §7.4) changes far more elements than the fraction allowed here: seen 31% (HF combine) and
# 57% (gu not rounded) when the kernel was mutated so.
MOE_BF16_ULPS = 2.0  # max |Δ| in bf16 ulps of the row's largest |output|; seen 0.18
MOE_BF16_MISMATCH_FRACTION = 0.01  # elements allowed to differ at all; seen 1 in 37 K (interpreter vs CPU torch)
# The router GEMM's logits (kernels/moe.py: bf16 h times an fp32 weight split into three exact bf16 parts)
# against the fp64 GEMM of the same values, in units of the row's largest |logit|: an fp32 GEMM's
# accumulation error (seen 2.1e-7 under the interpreter; torch's fp32 F.linear 6.8e-7 on the same inputs).
# Two parts instead of three lose the weight's last 8 bits: seen 1.0e-5 to 1.9e-5.
ROUTER_LOGITS_REL = 2e-6
# A Triton kernel against its torch reference (tests/test_kernels_*.py under TRITON_INTERPRET, and
# bench/kernels_*.py --check on the GPU): the same formulas and rounding points, other reduction orders
# (tiles, online softmax, split-KV merge, warp reductions) and exp/rsqrt implementations, so a bf16
# result may differ in its last bit: rtol 2^-7 is at least one bf16 ulp of any value, atol covers
# results near zero whose bf16 inputs flipped a last bit (test data O(1)). Seen under the interpreter:
# KDA 0, MLA <= 1 ulp in ~0.1-1% of elements, norms <= 1 ulp; fp32 5e-7 (one KDA decode step, K = 12).
KERNEL: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.bfloat16: {"rtol": 2 ** -7, "atol": 2 ** -9},
}
# The chunked prefill kernel against the chunked reference. fp32: Γ is a cumulative sum up to ~320 whose
# fp32 rounding moves e^{Γ_i−Γ_j} by ~1e-5 in both (seen 2e-5 with steep gates). bf16 model: the
# intermediates (w, u, A_qk, q e^Γ, k e^{Γ_last−Γ}) and the state's dot operands are bf16, the A blocks
# tf32 on the GPU (§5.8 "Numerics", as SGLang and fla); seen 2.4e-3 max abs on O(1) outputs.
KERNEL_PREFILL: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2},
}
# Real sizes on the GPU (bench --check): relative Frobenius error of a bf16 output or an fp32 state
# after one op. fp32 accumulation orders differ (tl.sum trees, tensor-core tiles vs einsum), so a few
# bf16 last bits flip; the state is fp32 but is fed bf16 conv outputs, so it inherits those flips.
KERNEL_REL_BF16 = 8e-3

# End-to-end numerics (tests/test_numerics.py, bench/agreement.py): bf16 torch references against fp64 on
# the tiny preset, logits relative L2 over teacher-forced prompts and cached decode steps.
CONDITIONED_BF16_REL_L2 = 0.15  # presets.Conditioning; seen 0.077 prefill, 0.084 decode (4 x 128 + 32 steps)
DEFAULT_INIT_BF16_REL_L2 = 0.25  # the default init is chaotic: at least this; seen 0.46
