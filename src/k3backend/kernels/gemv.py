"""The fast `linear` for decode-sized batches: y = x·Wᵀ for 1-8 rows, a Triton GEMV that streams the
weight once, a whole K step of it in flight, and loads its first step before waiting for the previous
kernel (kernels/pdl.py); for 9-64 rows, a tensor-core kernel that streams it the same way. cuBLAS's
kernels for these shapes run at 0.3-3 TB/s on the H200; where they are faster (`linear_config`), and
for larger batches, the reference (cuBLAS) runs. fp32 accumulation,
one rounding; the residual adds a layer ends with ride in the epilogue, each rounded as torch's add
rounds, so the sum is the reference's bit for bit and a decode step saves a kernel per add, and
MLA's output gate rides in the x loads (two elementwise kernels fewer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl
from k3backend.kernels.mla import _dot
from k3backend.kernels.norm import interpreting, to_dtype

MAX_ROWS = 8  # more rows: the tensor-core kernel (or cuBLAS)
MAX_DOT_ROWS = 64  # more rows: cuBLAS
MAX_ADDS = 2  # the MoE layer's end, bf(bf(up + shared) + Q), has two
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _x_tile(x_ptrs, g_ptrs, mask, GATE: tl.constexpr, INTERPRET: tl.constexpr):
    """A tile of x, times bf(σ(g)) and rounded where GATE (MLA's output gate, as torch rounds it)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if GATE:
        dt = x_ptrs.dtype.element_ty
        sg = to_dtype(tl.sigmoid(tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)), dt, INTERPRET)
        x = to_dtype(x.to(tl.float32) * sg.to(tl.float32), dt, INTERPRET)
    return x


@triton.jit
def _store(y, rows, offs_n, M, N, y_ptr, a0_ptr, a1_ptr, stride_ym, stride_a0, stride_a1, ADDS: tl.constexpr,
           INTERPRET: tl.constexpr):
    """y [rows, n-block] (rounded) + a0, then + a1, each add in fp32 rounded as torch's add of two tensors
    of y's dtype rounds; stored where the rows and columns exist."""
    out = (rows < M)[:, None] & (offs_n < N)[None, :]
    if ADDS >= 1:
        a = tl.load(a0_ptr + rows[:, None] * stride_a0 + offs_n[None, :], mask=out, other=0.0)
        y = to_dtype(y.to(tl.float32) + a.to(tl.float32), y_ptr.dtype.element_ty, INTERPRET)
    if ADDS >= 2:
        a = tl.load(a1_ptr + rows[:, None] * stride_a1 + offs_n[None, :], mask=out, other=0.0)
        y = to_dtype(y.to(tl.float32) + a.to(tl.float32), y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], y, mask=out)


@triton.jit(do_not_specialize=["N"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, a0_ptr, a1_ptr, g_ptr, N, K, stride_xm, stride_wn, stride_ym, stride_a0,
                   stride_a1, stride_gm, M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ADDS: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """y[:, n-block] = bf(Σ_k fp32(x[m, k])·fp32(w[n, k])) for the M rows: products accumulate in an
    [M, BLOCK_N, BLOCK_K] fp32 tile, reduced once at the end (no reduction inside the K loop). Rows
    past N wrap (loads stay unmasked); the store masks them. With PDL the first weight step is loaded
    before waiting for the previous kernel, overlapping that kernel's tail. ADDS: then y = bf(y + a0),
    y = bf(y + a1) in fp32, as torch adds two tensors of y's dtype. GATE: x is bf(x · bf(σ(g))) first, as
    torch's sigmoid and product of two tensors of x's dtype round."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[None, :, None] * stride_wn + offs_k[None, None, :]  # [1, BN, BK]
    x_ptrs = x_ptr + rows[:, None, None] * stride_xm + offs_k[None, None, :]  # [BM, 1, BK]
    g_ptrs = g_ptr + rows[:, None, None] * stride_gm + offs_k[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    w = tl.load(w_ptrs, mask=(offs_k < K)[None, None, :], other=0.0)
    pdl.enter(PDL)
    for k0 in range(0, K, BLOCK_K):
        wf = w.to(tl.float32)
        w_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=(offs_k < K - k0 - BLOCK_K)[None, None, :], other=0.0)  # the next step's, in flight
        x = _x_tile(x_ptrs, g_ptrs, (rows < M)[:, None, None] & (offs_k < K - k0)[None, None, :], GATE, INTERPRET)
        acc += wf * x.to(tl.float32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    y = to_dtype(tl.sum(acc, axis=2), y_ptr.dtype.element_ty, INTERPRET)
    _store(y, rows, offs_n, M, N, y_ptr, a0_ptr, a1_ptr, stride_ym, stride_a0, stride_a1, ADDS, INTERPRET)


@triton.jit(do_not_specialize=["M", "N"])
def _linear_dot_kernel(x_ptr, w_ptr, y_ptr, a0_ptr, a1_ptr, g_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       stride_a0, stride_a1, stride_gm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ADDS: tl.constexpr, GATE: tl.constexpr,
                       PDL: tl.constexpr, INTERPRET: tl.constexpr):
    """`_linear_kernel` for 9-64 rows on the tensor cores: a program owns BLOCK_N weight rows and all M
    input rows (one [BLOCK_N, BLOCK_M] fp32 tile, the weight as the MMA's wide operand), so the epilogue's
    adds and the gate's rounding are the GEMV's; fp32 operands (and the interpreter's) multiply in ieee
    fp32. The first weight step is loaded before waiting for the previous kernel (as the GEMV's), the
    rest in a loop software-pipelined STAGES deep."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    g_ptrs = g_ptr + rows[:, None] * stride_gm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    F32 = INTERPRET or w_ptr.dtype.element_ty == tl.float32
    k_in = (offs_k < K)[None, :]
    w = tl.load(w_ptrs, mask=k_in, other=0.0)  # the first step's weights: before the wait
    pdl.enter(PDL)
    acc = _dot(w, tl.trans(_x_tile(x_ptrs, g_ptrs, (rows < M)[:, None] & k_in, GATE, INTERPRET)), acc, F32)
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    g_ptrs += BLOCK_K
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k_in = (offs_k < K - k0)[None, :]
        w = tl.load(w_ptrs, mask=k_in, other=0.0)
        acc = _dot(w, tl.trans(_x_tile(x_ptrs, g_ptrs, (rows < M)[:, None] & k_in, GATE, INTERPRET)), acc, F32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    y = to_dtype(tl.trans(acc), y_ptr.dtype.element_ty, INTERPRET)
    _store(y, rows, offs_n, M, N, y_ptr, a0_ptr, a1_ptr, stride_ym, stride_a0, stride_a1, ADDS, INTERPRET)


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    warps: int
    pdl: bool = False
    stages: int = 0  # > 0: the tensor-core kernel (9-64 rows), its K loop this many stages deep


def linear_config(M: int, N: int, K: int, gated: bool = False, adds: int = 0) -> LinearConfig | None:
    """1-8 rows, the GEMV: 4 rows a program, K steps of 1,024 / 512 / 256 at 1-2 / 3-4 / 5-8 rows (the
    fp32 tile is M·4·BK values). 9-64 rows, the tensor-core kernel: 16 weight rows a program, K steps of
    128, 4 stages, its first step before the PDL wait. None where cuBLAS was faster: for the GEMV
    (H200, `small`'s projections, graphs of 48 calls) weights of more than 4,096 rows at 2 rows, of more
    than 2,048 rows above 2, K beyond 2,048 at 5-8 rows (KDA's [8336, 2048] at 2 / 4 / 8 rows 12.4 /
    16.4 / 21.5 µs against 11.5-11.7); for the tensor cores (H100, `small`, a sweep of 13 tiles)
    weights of more than 8 M values at 9-16 rows (KDA's in-projection, the dense MLP's down), of more than
    4 M or a gate at 17-32 (the gate's σ is recomputed by every program: MLA's o at 32 rows 18.9 µs
    against 11.5), and at 33-64 rows all but N ≤ 2,048 with K ≤ 1,024 and adds, which cuBLAS runs as
    more kernels (the MoE's latent up-projection with its two: 6.1 µs against 8.2)."""
    if M <= MAX_ROWS:
        if (M == 2 and N > 4096) or (M > 2 and N > 2048) or (M > 4 and K > 2048):
            return None
        bk = 1024 if M <= 2 else 512 if M <= 4 else 256
        return LinearConfig(4, min(bk, max(16, triton.next_power_of_2(K))), 4)
    if M > MAX_DOT_ROWS or (gated and M > 16):
        return None
    if not (N * K <= 8 << 20 if M <= 16 else N * K <= 4 << 20 if M <= 32 else N <= 2048 and K <= 1024 and adds):
        return None
    return LinearConfig(16, min(128, max(16, triton.next_power_of_2(K))), 4, stages=4)


def linear_supports(x: torch.Tensor, w: torch.Tensor, adds: Sequence[torch.Tensor] = (),
                    gate: torch.Tensor | None = None) -> tuple[bool, str]:
    """Whether the kernel takes this call (the reference runs it otherwise)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return False, "x [M, K] and w [N, K] expected"
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    if M == 0 or linear_config(M, N, K, gate is not None, len(adds)) is None:
        return False, "a shape cuBLAS runs faster (linear_config: more than 64 rows, or a large weight)"  # logged once
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        return False, f"dtypes {x.dtype}/{w.dtype}: bf16, fp16 or fp32, the same for both"
    if M > MAX_ROWS and x.dtype == torch.float32:
        return False, "fp32 above 8 rows: cuBLAS (tensor cores have no fp32 products; the kernel's ieee form " \
                      "is for tests)"
    if x.stride(1) != 1 or w.stride(1) != 1:
        return False, "x and w must be contiguous along K"
    if len(adds) > MAX_ADDS:
        return False, f"more than {MAX_ADDS} adds"
    for a in adds:
        if a.shape != (x.shape[0], w.shape[0]) or a.dtype != x.dtype or a.stride(-1) != 1 or a.device != x.device:
            return False, f"an add must be an [M, N] tensor of x's dtype and device with unit column stride, got " \
                          f"{a.dtype} {list(a.shape)}"
    if gate is not None and (gate.shape != x.shape or gate.dtype != x.dtype or gate.stride(-1) != 1
                             or gate.device != x.device):
        return False, f"the gate must be like x, {x.dtype} {list(x.shape)} with unit stride along K, got " \
                      f"{gate.dtype} {list(gate.shape)}"
    return True, ""


def linear(x: torch.Tensor, w: torch.Tensor, adds: Sequence[torch.Tensor] = (),
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (⊙ σ(gate)) · w [N, K]ᵀ -> [M, N] in x's dtype, then each of adds in turn, with
    `linear_config`'s tiles."""
    cfg = linear_config(x.shape[0], w.shape[0], w.shape[1], gate is not None, len(adds))
    if cfg is None:
        raise ValueError(f"linear: {x.shape[0]} rows of a {list(w.shape)} weight are cuBLAS's (see linear_supports)")
    return linear_with(x, w, dataclasses.replace(cfg, pdl=pdl.enabled(x.device)), adds, gate)


def linear_with(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig, adds: Sequence[torch.Tensor] = (),
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with explicit tiles (the tests and sweeps)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    a0, a1 = (*adds, y, y)[:2]  # unused pointers: y, never read
    g = x if gate is None else gate
    if cfg.stages:
        _linear_dot_kernel[(triton.cdiv(N, cfg.block_n),)](
            x, w, y, a0, a1, g, M, N, K, x.stride(0), w.stride(0), y.stride(0), a0.stride(0), a1.stride(0),
            g.stride(0), BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            STAGES=cfg.stages, ADDS=len(adds), GATE=gate is not None, PDL=cfg.pdl,
            INTERPRET=interpreting(), num_warps=cfg.warps, launch_pdl=cfg.pdl)
        return y
    _linear_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, w, y, a0, a1, g, N, K, x.stride(0), w.stride(0), y.stride(0), a0.stride(0), a1.stride(0), g.stride(0),
        M=M, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ADDS=len(adds),
        GATE=gate is not None, PDL=cfg.pdl, INTERPRET=interpreting(), num_warps=cfg.warps, launch_pdl=cfg.pdl)
    return y
