"""Triton normalisations and small fusions (K3_LM §2.2-§2.7, §4.2): the fast `rms_norm`, `gated_rms_norm`,
`l2_norm`, `attn_res_mix`, `silu_and_mul`, `situ_and_mul` and `glu`, with the references' signatures.

Every kernel is token-parallel and memory-bound: one read of each input row, fp32 arithmetic in the
reference's order, one rounding at the store. `to_dtype` is that rounding; the interpreter's own
fp32 -> bf16 cast truncates, so under TRITON_INTERPRET=1 it rounds to nearest even by bit arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def to_dtype(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(dtype), rounding to nearest even (the interpreter's bf16 cast truncates: done by bits there)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


def interpreting() -> bool:
    """Whether kernels run in the Triton interpreter (TRITON_INTERPRET=1, read by triton at import)."""
    return bool(triton.knobs.runtime.interpret)
