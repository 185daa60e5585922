"""Triton kernels of the KDA decode ops and the varlen conv (K3_LM §5), mirroring `kda_ref.py` name for name
and argument for argument; the chunked prefill is in `kda_chunk.py`, with the helpers here.

Imported lazily by `kernels/__init__.py` (this module needs triton). Each op `<op>(...)` takes exactly
its reference's arguments and keeps its rounding points; `<op>_supports(...) -> (ok, reason)` declines
what a kernel here cannot do, and the op itself raises `ValueError` on the same checks (the wrapper
validates, the kernel trusts). Grids are computed in Python from shapes only and nothing here reads a
device value on the host, so the decode ops can be captured in a CUDA graph; pools are indexed by
`state_indices` with int64 offsets (slots·H·K·V passes 2^31 at real sizes) and updated in place.
Rows whose slot is 0, the null slot padding rows point at, compute as usual but write no pool.

Arithmetic runs in fp32 (fp64 when the state pool is fp64, for the exact tests), as in the references:
the spec's "fp32" is the references' `acc_dtype`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl
from k3backend.kernels.varlen import VarlenLayout, layout_problem, varlen_layout

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as triton itself does
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_TILE = 128 * 128  # K·V elements of one head's state held in registers by one program
_MAX_RANK = 256  # f_a's width R that kda_decode_fused takes with f_b_weight
# kda_decode_fused computes bf(f_a·f_bᵀ) itself up to here; more rows: one GEMM first. On an H100 (`small`, MXFP4,
# decode replays, ms, the GEMV before -> in the kernel): B1 1.918 -> 1.912, B2 2.117 -> 2.095, but B4 2.661 -> 2.676
# and B8 3.211 -> 3.230 (each program reads its head's 32 KB of f_b; the GEMV reads it once).
F_B_MAX_ROWS = 2


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (a host-side property: no sync); 132 (H100/H200) elsewhere."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _acc(state: torch.Tensor) -> tl.dtype:
    return tl.float64 if state.dtype == torch.float64 else tl.float32


def _acc_torch(model_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _device_problem(*tensors: torch.Tensor, contiguous: bool = True) -> str:
    """'' when every tensor is on one device Triton can run on (and contiguous), else why not."""
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        return "tensors on different devices: " + ", ".join(sorted({str(t.device) for t in tensors}))
    if dev.type != "cuda" and not _INTERPRET:
        return f"tensors on {dev}, not a GPU (and TRITON_INTERPRET is not set)"
    if contiguous and not all(t.is_contiguous() for t in tensors):
        return "a non-contiguous input (" + ", ".join(_describe(t) for t in tensors if not t.is_contiguous()) + ")"
    return ""


def _rows_problem(**tensors: torch.Tensor) -> str:
    """'' when each tensor's rows (dim 0) are contiguous inside, whatever the row stride: slices of a
    wider GEMM output pass."""
    for name, t in tensors.items():
        inner = t[0] if t.shape[0] else t
        if t.dim() and t.shape[0] and not inner.is_contiguous():
            return f"{name}: the rows of {_describe(t)} are not contiguous inside (strides {list(t.stride())})"
    return ""


def _shape_problem(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> str:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        want = "|".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"{name}: expected {want} {list(shape)}, got {_describe(t)}"
    return ""


def _first(*problems: str) -> str:
    return next((p for p in problems if p), "")


def _raise_if(problem: str, op: str) -> None:
    if problem:
        raise ValueError(f"{op}: {problem}")


@triton.jit
def _round(x, dtype: tl.constexpr, BITS: tl.constexpr):
    """x rounded to `dtype`, to nearest even. BITS: do it on the fp32 bits (the triton 3.9 interpreter's
    fp32→bf16 cast truncates; the GPU's cvt.rn rounds, and equals this for every finite value)."""
    if BITS and dtype == tl.bfloat16:
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


# ---- kda_decode_fused: conv step, gate, beta, l2 norms, recurrence and gated norm, per head or per V-block --

@triton.jit
def _history_window(x_row, hist, c, m_c, C: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
    """The [BW, BC] window of raw rows x_{t−W+1..t} of channels `c` in the pool dtype: the W−1 history
    rows, then the current row x_t as row W−1."""
    o_w = tl.arange(0, BW)
    window = tl.load(hist + o_w[:, None] * C + c[None, :], mask=(o_w[:, None] < W - 1) & m_c[None, :], other=0)
    x = tl.load(x_row + c, mask=m_c, other=0)
    return tl.where(o_w[:, None] == W - 1, x.to(window.dtype)[None, :], window)


@triton.jit
def _conv_step(x_row, conv_weight, hist, c, m_c, C: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
               ACC: tl.constexpr, BITS: tl.constexpr):
    """One token of the §2.5 conv on channels `c`: (bf(silu(Σ_j w[c,j]·x_{t−W+1+j})) in ACC, the window)."""
    o_w = tl.arange(0, BW)
    window = _history_window(x_row, hist, c, m_c, C, W, BW)
    w = tl.load(conv_weight + c[None, :] * W + o_w[:, None], mask=(o_w[:, None] < W) & m_c[None, :], other=0)
    prod = w.to(ACC) * window.to(ACC)  # [BW, BC]
    y = tl.zeros([c.shape[0]], dtype=ACC)
    for j in tl.static_range(W):  # y = y + w_j·x_j in the reference's order (extracting a row adds zeros)
        y = y + tl.sum(tl.where(o_w[:, None] == j, prod, 0.0), axis=0)
    y = y / (1.0 + tl.exp(-y))  # silu as torch computes it
    return _round(y, x_row.dtype.element_ty, BITS).to(ACC), window


@triton.jit
def _store_history(hist, window, c, m_c, C: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
    """The new history: raw rows x_{t−W+2..t}, i.e. window rows 1..W−1 into pool rows 0..W−2."""
    o_w = tl.arange(0, BW)
    tl.store(hist + (o_w[:, None] - 1) * C + c[None, :], window,
             mask=(o_w[:, None] >= 1) & (o_w[:, None] < W) & m_c[None, :])


@triton.jit
def _l2(x, EPS: tl.constexpr, ACC: tl.constexpr, AXIS: tl.constexpr = 0):
    """§2.6: x·rsqrt(Σx² + eps), the sum over AXIS (a row, or the rows of a [tokens, K] block)."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) + tl.full([], EPS, ACC))


@triton.jit
def _kda_gate(f, dt_bias, A_log, USE_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr, ACC: tl.constexpr):
    """§5.3 log-decay from s = f + dt_bias: lb·σ(e^A·s), or −e^A·softplus(s) (threshold 20, §2.8)."""
    s = f.to(ACC) + dt_bias.to(ACC)
    A = tl.exp(A_log.to(ACC))
    if USE_LOWER_BOUND:
        g = tl.full([], LOWER_BOUND, ACC) * tl.sigmoid(A * s)
    else:
        g = -A * tl.where(s > 20.0, s, tl.log(1.0 + tl.exp(tl.minimum(s, 20.0))))
    return g


@triton.jit
def _gated_norm_store(p_y, o, z_row, o_norm_weight, o_v, m_v, V: tl.constexpr, EPS: tl.constexpr,
                      ACC: tl.constexpr, BITS: tl.constexpr):
    """§5.7 on one head's whole row o = bf(o) (in ACC): y = bf(o·rsqrt(mean o² + eps)·w·σ(z))."""
    r = tl.math.rsqrt(tl.sum(o * o, axis=0) / V + tl.full([], EPS, ACC))
    w_o = tl.load(o_norm_weight + o_v, mask=m_v, other=0).to(ACC)
    zz = tl.load(z_row + o_v, mask=m_v, other=0).to(ACC)
    tl.store(p_y, _round(o * r * w_o * tl.sigmoid(zz), p_y.dtype.element_ty, BITS), mask=m_v)


@triton.jit
def _low_rank_rows(a_row, w, o_k, m_k, R: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr):
    """Σ_r w[k, r]·a[r] over the rows o_k of w [·, R] (row-major), in ACC, 32 columns at a time (registers)."""
    CH: tl.constexpr = 32 if BR > 32 else BR
    acc = tl.zeros([BK], dtype=ACC)
    for r0 in tl.static_range(0, BR, CH):
        o_r = r0 + tl.arange(0, CH)
        m_r = o_r < R
        a = tl.load(a_row + o_r, mask=m_r, other=0).to(ACC)
        wt = tl.load(w + o_k[:, None] * R + o_r[None, :], mask=m_k[:, None] & m_r[None, :], other=0).to(ACC)
        acc += tl.sum(wt * a[None, :], axis=1)
    return acc


@triton.jit
def _kda_decode_fused_kernel(xqkv, conv_weight, conv_pool, f, f_b, dt_bias, A_log, b, z, o_norm_weight, S_pool,
                             state_indices, y, s_x, s_b, s_z, s_f, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             BW: tl.constexpr, NV: tl.constexpr, SPLIT: tl.constexpr, F_B: tl.constexpr,
                             R: tl.constexpr, BR: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                             LOWER_BOUND: tl.constexpr, SCALE: tl.constexpr, EPS: tl.constexpr, ACC: tl.constexpr,
                             BITS: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h, V-block i_v of NV): columns i_v·BV.. of one head's K×V state (only its own columns,
    so no other program reads or writes them). Not SPLIT (one block holds all of V): the gated norm
    over V and the head's conv-history update stay inside the program. SPLIT: the program writes
    bf(o) of its columns into y and reads the conv pool only; `_kda_decode_norm_kernel`, launched
    after it, does the norm and the history. s_x, s_b, s_z: the row strides of xqkv, b and z
    (slices of the layer's one input GEMM). F_B: f holds f_a's rows [B, R] (row stride s_f) and the program
    forms its head's gate pre-activation bf(f_a·f_bᵀ) [K] from f_b [H·K, R], a GEMV launch fewer a layer."""
    pdl.enter(PDL)
    pid = tl.program_id(0).to(tl.int64)  # one axis (a 2-D grid caps B·H at 65535): a head's blocks adjacent
    i_v, i_b, i_h = pid % NV, pid // NV // H, pid // NV % H
    C: tl.constexpr = 2 * H * K + H * V
    slot = tl.load(state_indices + i_b).to(tl.int64)
    live = slot != 0
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V

    # §5.2 conv on this head's q, k channels and this block's v channels (raw rows in, bf(silu(conv)) out);
    # every V-block recomputes q and k (a few hundred bytes from L2) rather than share them
    x_row, w_row, hist = xqkv + i_b * s_x, conv_weight, conv_pool + slot * ((W - 1) * C)
    c_q, c_k, c_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_h * V + o_v
    q, win_q = _conv_step(x_row, w_row, hist, c_q, m_k, C, W, BW, ACC, BITS)
    k, win_k = _conv_step(x_row, w_row, hist, c_k, m_k, C, W, BW, ACC, BITS)
    v, win_v = _conv_step(x_row, w_row, hist, c_v, m_v, C, W, BW, ACC, BITS)

    # §5.5 q = l2(q̃)·K^-½, k = l2(k̃) (kept unrounded); §5.3 gate; §5.4 beta
    q = _l2(q, 1e-6, ACC) * tl.full([], SCALE, ACC)
    k = _l2(k, 1e-6, ACC)
    if F_B:
        f_row = _round(_low_rank_rows(f + i_b * s_f, f_b + i_h * K * R, o_k, m_k, R, BR, BK, ACC),
                       xqkv.dtype.element_ty, BITS)
    else:
        f_row = tl.load(f + (i_b * H + i_h) * K + o_k, mask=m_k, other=0)
    bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0)
    g = _kda_gate(f_row, bias, tl.load(A_log + i_h), USE_LOWER_BOUND, LOWER_BOUND, ACC)
    beta = tl.sigmoid(tl.load(b + i_b * s_b + i_h).to(ACC))

    # §5.6: S ← diag(α)S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq after the update (each column on its own)
    p_S = S_pool + slot * (H * K * V) + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    m_S = m_k[:, None] & m_v[None, :]
    S = tl.load(p_S, mask=m_S, other=0, eviction_policy="evict_first").to(ACC)  # touched once a step
    S = S * tl.exp(g)[:, None]
    u = beta * (v - tl.sum(k[:, None] * S, axis=0))
    S = S + k[:, None] * u[None, :]
    o = tl.sum(q[:, None] * S, axis=0)
    if live:
        tl.store(p_S, S.to(S_pool.dtype.element_ty), mask=m_S, eviction_policy="evict_first")

    # out = bf(o); §5.7 needs the whole row: here, or in the norm launch from y
    p_y = y + (i_b * H + i_h) * V + o_v
    o = _round(o, p_y.dtype.element_ty, BITS)
    if SPLIT:
        tl.store(p_y, o, mask=m_v)
    else:
        _gated_norm_store(p_y, o.to(ACC), z + i_b * s_z + i_h * V, o_norm_weight, o_v, m_v, V, EPS, ACC, BITS)
        # the new conv history, once every thread has read the old one (the rows shift within the slot)
        tl.debug_barrier()
        if live:
            _store_history(hist, win_q, c_q, m_k, C, W, BW)
            _store_history(hist, win_k, c_k, m_k, C, W, BW)
            _store_history(hist, win_v, c_v, m_v, C, W, BW)


@triton.jit
def _kda_decode_norm_kernel(xqkv, conv_pool, z, o_norm_weight, state_indices, y, s_x, s_z, H: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, BW: tl.constexpr, EPS: tl.constexpr, ACC: tl.constexpr,
                            BITS: tl.constexpr, PDL: tl.constexpr):
    """Program (b, h) after the SPLIT launch: the gated norm of the head's row bf(o) in y, in place, and
    the head's q/k/v conv-history shift (every V-block of the first launch read the old q/k rows, so
    none of them may write; here one program owns the head's channels of the slot)."""
    pdl.enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    i_b, i_h = pid // H, pid % H
    C: tl.constexpr = 2 * H * K + H * V
    slot = tl.load(state_indices + i_b).to(tl.int64)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_y = y + (i_b * H + i_h) * V + o_v
    o = tl.load(p_y, mask=m_v, other=0).to(ACC)
    _gated_norm_store(p_y, o, z + i_b * s_z + i_h * V, o_norm_weight, o_v, m_v, V, EPS, ACC, BITS)

    x_row, hist = xqkv + i_b * s_x, conv_pool + slot * ((W - 1) * C)
    c_q, c_k, c_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_h * V + o_v
    win_q = _history_window(x_row, hist, c_q, m_k, C, W, BW)
    win_k = _history_window(x_row, hist, c_k, m_k, C, W, BW)
    win_v = _history_window(x_row, hist, c_v, m_v, C, W, BW)
    tl.debug_barrier()  # rows shift within the slot: every old row is read before any is written
    if slot != 0:
        _store_history(hist, win_q, c_q, m_k, C, W, BW)
        _store_history(hist, win_k, c_k, m_k, C, W, BW)
        _store_history(hist, win_v, c_v, m_v, C, W, BW)


def _decode_fused_problem(xqkv, conv_weight, conv_pool, f, dt_bias, A_log, lower_bound, b, z, o_norm_weight,
                          S_pool, state_indices, eps, f_b_weight=None) -> str:
    low = f_b_weight is not None
    if f.dim() != 2 + (not low) or z.dim() != 3 or xqkv.dim() != 2 or conv_weight.dim() != 2 or dt_bias.dim() != 1 \
            or (low and f_b_weight.dim() != 2) or not z.shape[1]:
        return (f"expected f {'[B, R]' if low else '[B, H, K]'}, z [B, H, V], xqkv [B, C], conv_weight [C, W], "
                f"dt_bias [H·K]{', f_b_weight [H·K, R]' if low else ''}; got f {list(f.shape)}, z {list(z.shape)}, "
                f"xqkv {list(xqkv.shape)}, conv_weight {list(conv_weight.shape)}, dt_bias {list(dt_bias.shape)}"
                + (f", f_b_weight {list(f_b_weight.shape)}" if low else ""))
    B, H, V = z.shape
    K = dt_bias.shape[0] // H if low else f.shape[2]
    C, W = 2 * H * K + H * V, conv_weight.shape[1]
    dt = xqkv.dtype
    acc = _acc_torch(dt)
    N = S_pool.shape[0]
    return _first(
        "" if dt in _FLOATS else f"xqkv: unsupported dtype {dt}",
        _shape_problem("xqkv", xqkv, (B, C), (dt,)),
        _shape_problem("conv_weight", conv_weight, (C, W), (acc,)),
        _shape_problem("conv_pool", conv_pool, (N, W - 1, C), (dt,)),
        _shape_problem("f", f, (B, f.shape[-1]) if low else (B, H, K), (dt,)),
        _shape_problem("f_b_weight", f_b_weight, (H * K, f.shape[-1]), (dt,)) if low else "",
        "" if not low or f.shape[-1] <= _MAX_RANK else f"f_a's width {f.shape[-1]} > {_MAX_RANK}",
        _shape_problem("dt_bias", dt_bias, (H * K,), (acc,)),
        _shape_problem("A_log", A_log, (H,), (acc,)),
        _shape_problem("b", b, (B, H), (dt,)),
        _shape_problem("z", z, (B, H, V), (dt,)),
        _shape_problem("o_norm_weight", o_norm_weight, (V,), (dt, acc)),
        _shape_problem("S_pool", S_pool, (N, H, K, V), (acc,)),
        _shape_problem("state_indices", state_indices, (B,), (torch.int32, torch.int64)),
        "" if W >= 2 else f"conv width {W} < 2",
        "" if triton.next_power_of_2(K) * triton.next_power_of_2(V) <= _MAX_TILE
        else f"state tile K×V = {K}×{V} is larger than one program holds ({_MAX_TILE} elements)",
        _rows_problem(xqkv=xqkv, b=b, z=z, **({"f": f} if low else {})),
        _device_problem(xqkv, b, z, conv_weight, conv_pool, f, dt_bias, A_log, o_norm_weight, S_pool, state_indices,
                        *([f_b_weight] if low else []), contiguous=False),
        _device_problem(conv_weight, conv_pool, dt_bias, A_log, o_norm_weight, S_pool, state_indices,
                        *([f_b_weight] if low else [f])),
    )


def decode_fused_plan(V: int) -> int:
    """The rule for the v_blocks of `kda_decode_fused`: 64 columns a block (K×64 fp32 = 32 KB, 4 warps).
    Measured on the H200 (bench/gpu_kda_decode.sh) at H 16, K = V = 128: the fastest of 1, 2, 4, 8
    blocks × 2, 4, 8 warps from B 64 to 256 (77-81 % of HBM, one block of 8 warps 49-51 %), within
    a microsecond of the fastest at B 1 and 16, and never slower than one block."""
    return max(1, triton.next_power_of_2(V) // 64)


def decode_fused_warps(K: int, V: int, v_blocks: int) -> int:
    """The rule for num_warps: 64 state values a thread (a whole 128×128 head 8 warps, as before the
    split; a 128×64 block 4)."""
    tile = triton.next_power_of_2(K) * (triton.next_power_of_2(V) // v_blocks)
    if v_blocks == 1:
        return 8 if tile >= 8192 else 4
    return max(1, min(8, tile // 2048))


def _plan_problem(V: int, v_blocks: int | None, num_warps: int | None) -> str:
    """'' when the explicit split and warps are ones the kernel runs."""
    if v_blocks is not None and (v_blocks < 1 or v_blocks & (v_blocks - 1) or v_blocks > triton.next_power_of_2(V)):
        return f"v_blocks = {v_blocks}: expected a power of two from 1 to {triton.next_power_of_2(V)}"
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps = {num_warps}: expected 1, 2, 4, 8 or 16"
    return ""


def kda_decode_fused_supports(xqkv: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor,
                              f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                              lower_bound: float | None, b: torch.Tensor, z: torch.Tensor,
                              o_norm_weight: torch.Tensor, S_pool: torch.Tensor, state_indices: torch.Tensor,
                              eps: float = 1e-5, f_b_weight: torch.Tensor | None = None) -> tuple[bool, str]:
    return decode_fused_split_supports(xqkv, conv_weight, conv_pool, f, dt_bias, A_log, lower_bound, b, z,
                                       o_norm_weight, S_pool, state_indices, eps, f_b_weight=f_b_weight)


def kda_decode_fused(xqkv: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor, f: torch.Tensor,
                     dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None, b: torch.Tensor,
                     z: torch.Tensor, o_norm_weight: torch.Tensor, S_pool: torch.Tensor, state_indices: torch.Tensor,
                     eps: float = 1e-5, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`kda_ref.kda_decode_fused` (the op's signature), split as `decode_fused_plan` says."""
    return decode_fused_split(xqkv, conv_weight, conv_pool, f, dt_bias, A_log, lower_bound, b, z, o_norm_weight,
                              S_pool, state_indices, eps, f_b_weight=f_b_weight)


def decode_fused_split_supports(xqkv: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor,
                                f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                                lower_bound: float | None, b: torch.Tensor, z: torch.Tensor,
                                o_norm_weight: torch.Tensor, S_pool: torch.Tensor, state_indices: torch.Tensor,
                                eps: float = 1e-5, *, v_blocks: int | None = None, num_warps: int | None = None,
                                f_b_weight: torch.Tensor | None = None) -> tuple[bool, str]:
    problem = _first(_plan_problem(z.shape[-1], v_blocks, num_warps),
                     _decode_fused_problem(xqkv, conv_weight, conv_pool, f, dt_bias, A_log, lower_bound, b, z,
                                           o_norm_weight, S_pool, state_indices, eps, f_b_weight))
    return not problem, problem


def decode_fused_split(xqkv: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor, f: torch.Tensor,
                       dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None, b: torch.Tensor,
                       z: torch.Tensor, o_norm_weight: torch.Tensor, S_pool: torch.Tensor, state_indices: torch.Tensor,
                       eps: float = 1e-5, *, v_blocks: int | None = None, num_warps: int | None = None,
                       f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`kda_decode_fused` with its split chosen by the caller (the bench and tests). v_blocks 1: one launch, one program per (sequence, head) holding the
    head's K×V state tile (read once, written once in place). v_blocks > 1: the state's V columns in
    that many blocks, one program each, writing bf(o); then a launch of B·H programs for the gated norm
    and the conv history. None (the model's calls): `decode_fused_plan` and `decode_fused_warps` choose.
    f_b_weight: f is f_a's rows; up to F_B_MAX_ROWS rows each program forms its head's bf(f_a·f_bᵀ), more rows
    take the `linear` op first (the GEMV or cuBLAS, as f_b_proj would: the weight read once, not once a row)."""
    _raise_if(_first(_plan_problem(z.shape[-1], v_blocks, num_warps),
                     _decode_fused_problem(xqkv, conv_weight, conv_pool, f, dt_bias, A_log, lower_bound, b, z,
                                           o_norm_weight, S_pool, state_indices, eps, f_b_weight)), "kda_decode_fused")
    B, H, V = z.shape
    K, W = dt_bias.shape[0] // H, conv_weight.shape[1]
    if f_b_weight is not None and B > F_B_MAX_ROWS:
        from k3backend import kernels  # the linear op's own choice of kernel (a cycle at import time)

        f, f_b_weight = kernels.linear(f, f_b_weight).view(B, H, K), None
    R = f.shape[-1] if f_b_weight is not None else 1
    y = torch.empty(B, H, V, dtype=xqkv.dtype, device=xqkv.device)
    if B == 0:
        return y
    v_blocks = v_blocks or decode_fused_plan(V)
    num_warps = num_warps or decode_fused_warps(K, V, v_blocks)
    BK, BV, BW = triton.next_power_of_2(K), triton.next_power_of_2(V) // v_blocks, triton.next_power_of_2(W)
    NV = triton.cdiv(V, BV)
    _kda_decode_fused_kernel[(B * H * NV,)](
        xqkv=xqkv, conv_weight=conv_weight, conv_pool=conv_pool, f=f, f_b=f if f_b_weight is None else f_b_weight,
        dt_bias=dt_bias, A_log=A_log, b=b, z=z, o_norm_weight=o_norm_weight, S_pool=S_pool,
        state_indices=state_indices, y=y, s_x=xqkv.stride(0), s_b=b.stride(0), s_z=z.stride(0), s_f=f.stride(0), H=H,
        K=K, V=V, W=W, BK=BK, BV=BV, BW=BW, NV=NV, SPLIT=NV > 1, F_B=f_b_weight is not None, R=R,
        BR=triton.next_power_of_2(R),
        USE_LOWER_BOUND=lower_bound is not None, LOWER_BOUND=float(lower_bound or 0.0), SCALE=K ** -0.5,
        EPS=float(eps), ACC=_acc(S_pool), BITS=_INTERPRET, **pdl.launch_args(xqkv.device), num_warps=num_warps)
    if NV > 1:  # stream order: every V-block has read the old conv history before this launch shifts it
        _kda_decode_norm_kernel[(B * H,)](
            xqkv=xqkv, conv_pool=conv_pool, z=z, o_norm_weight=o_norm_weight, state_indices=state_indices, y=y,
            s_x=xqkv.stride(0), s_z=z.stride(0), H=H, K=K, V=V, W=W, BK=BK, BV=triton.next_power_of_2(V), BW=BW,
            EPS=float(eps), ACC=_acc(S_pool), BITS=_INTERPRET, **pdl.launch_args(xqkv.device), num_warps=4)
    return y


# ---- kda_decode: the plain §5.6 step on prepared q, k, v, g, beta; one program per (sequence, head, V-block) --

@triton.jit
def _kda_decode_kernel(q, k, v, g, beta, S_pool, state_indices, o, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    i_v, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = pid // H, pid % H
    slot = tl.load(state_indices + i_b).to(tl.int64)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    row_k, row_v = (i_b * H + i_h) * K, (i_b * H + i_h) * V
    b_q = tl.load(q + row_k + o_k, mask=m_k, other=0).to(ACC)
    b_k = tl.load(k + row_k + o_k, mask=m_k, other=0).to(ACC)
    b_g = tl.load(g + row_k + o_k, mask=m_k, other=0).to(ACC)
    b_v = tl.load(v + row_v + o_v, mask=m_v, other=0).to(ACC)
    b_beta = tl.load(beta + i_b * H + i_h).to(ACC)
    p_S = S_pool + slot * (H * K * V) + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    m_S = m_k[:, None] & m_v[None, :]
    S = tl.load(p_S, mask=m_S, other=0, eviction_policy="evict_first").to(ACC) * tl.exp(b_g)[:, None]
    u = b_beta * (b_v - tl.sum(b_k[:, None] * S, axis=0))
    S = S + b_k[:, None] * u[None, :]
    tl.store(o + row_v + o_v, tl.sum(b_q[:, None] * S, axis=0).to(o.dtype.element_ty), mask=m_v)
    if slot != 0:
        tl.store(p_S, S.to(S_pool.dtype.element_ty), mask=m_S, eviction_policy="evict_first")


def _decode_problem(q, k, v, g, beta, S_pool, state_indices) -> str:
    if q.dim() != 3 or v.dim() != 3 or S_pool.dim() != 4:
        return (f"expected q [B, H, K], v [B, H, V], S_pool [N, H, K, V]; got q {list(q.shape)}, "
                f"v {list(v.shape)}, S_pool {list(S_pool.shape)}")
    B, H, K = q.shape
    V, N = v.shape[-1], S_pool.shape[0]
    return _first(
        _shape_problem("S_pool", S_pool, (N, H, K, V), (torch.float32, torch.float64)),
        _shape_problem("k", k, (B, H, K), _FLOATS),
        _shape_problem("g", g, (B, H, K), _FLOATS),
        _shape_problem("v", v, (B, H, V), _FLOATS),
        _shape_problem("beta", beta, (B, H), _FLOATS),
        _shape_problem("state_indices", state_indices, (B,), (torch.int32, torch.int64)),
        "" if triton.next_power_of_2(K) <= 256 else f"K = {K} > 256",
        _device_problem(q, k, v, g, beta, S_pool, state_indices),
    )


def kda_decode_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        S_pool: torch.Tensor, state_indices: torch.Tensor) -> tuple[bool, str]:
    problem = _decode_problem(q, k, v, g, beta, S_pool, state_indices)
    return not problem, problem


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S_pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """`kda_ref.kda_decode`: grid (V/BV, B·H), each program one K×BV tile of one head's state."""
    _raise_if(_decode_problem(q, k, v, g, beta, S_pool, state_indices), "kda_decode")
    B, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, H, V, dtype=S_pool.dtype, device=q.device)
    if B == 0:
        return o
    BK, BV = triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))
    _kda_decode_kernel[(triton.cdiv(V, BV), B * H)](
        q=q, k=k, v=v, g=g, beta=beta, S_pool=S_pool, state_indices=state_indices, o=o,
        H=H, K=K, V=V, BK=BK, BV=BV, ACC=_acc(S_pool), num_warps=4)
    return o


# ---- short_conv: varlen prefill conv (§2.5, §5.2) -------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _short_conv_kernel(x, weight, conv_pool, seq_ids, cu_seqlens, state_indices, has_initial_state, out, T, s_x,
                       C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr,
                       BITS: tl.constexpr):
    """Program (token block, channel block) of the flat batch; a token's taps before its sequence start
    come from its slot's history (zero without an initial state). Reads the pool only."""
    i_t, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    seq = tl.load(seq_ids + o_t, mask=m_t, other=0)
    bos = tl.load(cu_seqlens + seq, mask=m_t, other=0).to(tl.int64)
    slot = tl.load(state_indices + seq, mask=m_t, other=0).to(tl.int64)
    has = tl.load(has_initial_state + seq, mask=m_t, other=0) != 0
    m = m_t[:, None] & m_c[None, :]
    y = tl.zeros([BT, BC], dtype=ACC)
    for j in tl.static_range(W):  # y = y + w_j·x_{t−W+1+j}, the reference's order
        pos = o_t - (W - 1) + j
        inside = pos >= bos
        xv = tl.load(x + pos[:, None] * s_x + o_c[None, :], mask=m & inside[:, None], other=0)
        hist = conv_pool + slot[:, None] * ((W - 1) * C) + (pos - bos + (W - 1))[:, None] * C + o_c[None, :]
        hv = tl.load(hist, mask=m & (~inside & has)[:, None], other=0)
        w_j = tl.load(weight + o_c * W + j, mask=m_c, other=0).to(ACC)
        y = y + w_j[None, :] * tl.where(inside[:, None], xv.to(ACC), hv.to(ACC))
    y = y / (1.0 + tl.exp(-y))
    tl.store(out + o_t[:, None] * C + o_c[None, :], _round(y, out.dtype.element_ty, BITS), mask=m)


@triton.jit
def _short_conv_history_kernel(x, conv_pool, cu_seqlens, state_indices, has_initial_state, s_x, C: tl.constexpr,
                               W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """Program (sequence, channel block): its slot's history becomes the last W−1 raw rows of
    (history ++ chunk). Runs after `_short_conv_kernel`, which reads the old history."""
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    o_r, o_c = tl.arange(0, BW), i_c * BC + tl.arange(0, BC)
    has = tl.load(has_initial_state + i_n + o_r * 0) != 0  # [BW] copies: the interpreter mis-types scalar & block
    m = (o_r[:, None] < W - 1) & (o_c < C)[None, :]
    pos = eos - (W - 1) + o_r  # the flat token each new history row holds
    inside = pos >= bos
    hist = conv_pool + slot * ((W - 1) * C)
    xv = tl.load(x + pos[:, None] * s_x + o_c[None, :], mask=m & inside[:, None], other=0)
    hv = tl.load(hist + (pos - bos + (W - 1))[:, None] * C + o_c[None, :], mask=m & (~inside & has)[:, None],
                 other=0)
    new = tl.where(inside[:, None], xv.to(hv.dtype), hv)
    tl.debug_barrier()  # rows shift within the slot: every old row is read before any is written
    if slot != 0:
        tl.store(hist + o_r[:, None] * C + o_c[None, :], new, mask=m)


def _short_conv_problem(x, weight, conv_pool, cu_seqlens, state_indices, has_initial_state, layout=None) -> str:
    if x.dim() != 2 or weight.dim() != 2 or conv_pool.dim() != 3:
        return (f"expected x [T, C], weight [C, W], conv_pool [N, W-1, C]; got x {list(x.shape)}, "
                f"weight {list(weight.shape)}, conv_pool {list(conv_pool.shape)}")
    T, C = x.shape
    W, B = weight.shape[1], state_indices.shape[0]
    return _first(
        "" if x.dtype in _FLOATS else f"x: unsupported dtype {x.dtype}",
        _shape_problem("weight", weight, (C, W), _FLOATS),
        _shape_problem("conv_pool", conv_pool, (conv_pool.shape[0], W - 1, C), (x.dtype,)),
        _shape_problem("cu_seqlens", cu_seqlens, (B + 1,), (torch.int32, torch.int64)),
        _shape_problem("state_indices", state_indices, (B,), (torch.int32, torch.int64)),
        _shape_problem("has_initial_state", has_initial_state, (B,), (torch.bool,)),
        "" if W >= 2 else f"conv width {W} < 2",
        layout_problem(layout, T, B),
        _rows_problem(x=x),
        _device_problem(x, weight, conv_pool, cu_seqlens, state_indices, has_initial_state, contiguous=False),
        _device_problem(weight, conv_pool, cu_seqlens, state_indices, has_initial_state),
    )


def short_conv_supports(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                        state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                        layout: VarlenLayout | None = None) -> tuple[bool, str]:
    problem = _short_conv_problem(x, weight, conv_pool, cu_seqlens, state_indices, has_initial_state, layout)
    return not problem, problem


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, cu_seqlens: torch.Tensor,
               state_indices: torch.Tensor, has_initial_state: torch.Tensor,
               layout: VarlenLayout | None = None) -> torch.Tensor:
    """`kda_ref.short_conv` in two launches: the outputs (grid T/BT × C/BC, the sequence of each token
    from `layout.seq_ids`, built here when None), then each sequence's new history (grid B × C/BC)."""
    _raise_if(_short_conv_problem(x, weight, conv_pool, cu_seqlens, state_indices, has_initial_state, layout),
              "short_conv")
    T, C = x.shape
    W, B = weight.shape[1], state_indices.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0 or B == 0:
        return out
    seq_ids = (layout if layout is not None else varlen_layout(cu_seqlens, T)).seq_ids  # [T] int32
    BT, BC = 16, min(128, triton.next_power_of_2(C))  # 96 registers a thread: five programs per SM
    _short_conv_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
        x=x, weight=weight, conv_pool=conv_pool, seq_ids=seq_ids, cu_seqlens=cu_seqlens, state_indices=state_indices,
        has_initial_state=has_initial_state, out=out, T=T, s_x=x.stride(0), C=C, W=W, BT=BT, BC=BC,
        ACC=tl.float64 if weight.dtype == torch.float64 else tl.float32, BITS=_INTERPRET, num_warps=4)
    _short_conv_history_kernel[(B, triton.cdiv(C, BC))](
        x=x, conv_pool=conv_pool, cu_seqlens=cu_seqlens, state_indices=state_indices,
        has_initial_state=has_initial_state, s_x=x.stride(0), C=C, W=W, BW=triton.next_power_of_2(W), BC=BC, num_warps=4)
    return out
