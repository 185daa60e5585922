"""The fast `linear` for decode-sized batches: y = x·Wᵀ for a few rows, a Triton GEMV that streams the
weight once with all of a program's loads in flight (cuBLAS's GEMVs for these shapes run at 1.9-2.8 TB/s
on the H200). Larger batches decline to the reference (cuBLAS). fp32 accumulation, one rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl
from k3backend.kernels.norm import interpreting, to_dtype

MAX_ROWS = 2  # more rows: cuBLAS (the kernel repeats its reductions per row and falls behind)
MAX_WEIGHT_2 = 12 << 20  # at 2 rows, weights larger than this go to cuBLAS
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["N"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym, M: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """y[:, n-block] = bf(Σ_k fp32(x[m, k])·fp32(w[n, k])) for the M rows. Rows past N wrap (loads stay
    unmasked); the store masks them. PDL: the first weight step is loaded before waiting for the
    previous kernel (programmatic dependent launch), which overlaps it with that kernel's tail."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    pdl.enter(PDL)
    for k0 in range(0, K, BLOCK_K):
        wf = w.to(tl.float32)
        w_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=(offs_k < K - k0 - BLOCK_K)[None, :], other=0.0)  # the next step's, in flight
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
            acc += tl.where(rows[:, None] == m, tl.sum(wf * xm[None, :], axis=1)[None, :], 0.0)
    y = to_dtype(acc, y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], y, mask=(rows < M)[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    warps: int
    pdl: bool = False


def linear_config(M: int, N: int, K: int) -> LinearConfig:
    """4 rows a program and up to 1,024 values of K a step; at one row 2,048 and 8 warps where the
    programs would not fill 4 to an SM (more bytes in flight each)."""
    bk = 2048 if M == 1 and triton.cdiv(N, 4) <= 4 * 132 else 1024
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    return LinearConfig(4, bk, 8 if bk >= 2048 else 4)


def linear_supports(x: torch.Tensor, w: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernel takes this call (the reference runs it otherwise)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return False, "x [M, K] and w [N, K] expected"
    if not 0 < x.shape[0] <= MAX_ROWS:
        return False, f"M {x.shape[0]} outside 1..{MAX_ROWS} (cuBLAS takes larger batches)"
    if x.shape[0] > 1 and w.numel() > MAX_WEIGHT_2:
        return False, f"2 rows of a weight over {MAX_WEIGHT_2} values (cuBLAS is faster there)"
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        return False, f"dtypes {x.dtype}/{w.dtype}: bf16, fp16 or fp32, the same for both"
    if x.stride(1) != 1 or w.stride(1) != 1:
        return False, "x and w must be contiguous along K"
    return True, ""


def linear(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ -> [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    if cfg is None:
        cfg = dataclasses.replace(linear_config(M, N, K), pdl=pdl.enabled(x.device))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _linear_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, w, y, N, K, x.stride(0), w.stride(0), y.stride(0), M=M, BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=cfg.pdl, INTERPRET=interpreting(), num_warps=cfg.warps,
        launch_pdl=cfg.pdl)
    return y
