"""Triton normalisations and small fusions (K3_LM §2.2-§2.7, §4.2, §6.2): the fast `rms_norm`, `gated_rms_norm`,
`attn_res_mix`, `attn_res_mix_norm` and MLA's `mla_latent`, with the references' signatures (KDA's q/k L2 norm is fused
into `kda_prefill_inputs`, kernels/kda_chunk.py). (The MLP's
act-and-mul is fused into its GEMM: `glu_linear` in kernels/moe.py.)

Every kernel is token-parallel and memory-bound: one read of each input row, fp32 arithmetic in the
reference's order, one rounding at the store. `to_dtype` is that rounding; the interpreter's own
fp32 -> bf16 cast truncates, so under TRITON_INTERPRET=1 it rounds to nearest even by bit arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_WIDTH = 16384  # one program holds a whole row (H 7168 -> 8192 lanes)
MAX_ROWS_MIXED = 16  # attn_res_mix candidates (K3: at most 9)
FP_FUSION = False  # no fma contraction: the references round every product and sum separately


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


@triton.jit
def _tanh(x):
    """tanh in fp32 without libdevice (which the interpreter lacks): odd Taylor series below 1/8,
    (1 − e)/(1 + e) with e = exp(−2|x|) above; a few fp32 ulps."""
    ax = tl.abs(x)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    e = tl.exp(-2.0 * ax)
    large = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.125, small, tl.where(x < 0.0, -large, large))


@triton.jit
def rms_normed(x, w, n, eps, AXIS: tl.constexpr):
    """x·(1/√(mean x² + eps))·w in fp32 (§2.2) over the n values along AXIS of x (1: rows of a [rows, D] tile,
    0: one row): the one expression of every norm kernel, so a norm fused into another kernel keeps its bits."""
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=AXIS) / n + eps)
    if AXIS == 1:
        y = x * r[:, None] * w[None, :]
    else:
        y = x * r * w
    return y


# ---- kernels: one program per BLOCK_ROWS rows of D values ----------------------------------------

@triton.jit(do_not_specialize=["n_rows", "s_x", "s_z"])
def _row_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, n_rows, s_x, s_z, s_y, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, KIND: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """KIND 0: rms_norm, x32·rsqrt(mean x32² + eps)·w32 (§2.2). 1: gated_rms_norm, ·σ(z32) (§2.7).
    One rounding, at the store."""
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = rms_normed(x, w, D, eps, 1)
    if KIND == 1:
        z = tl.load(z_ptr + r64 * s_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(z)
    tl.store(y_ptr + r64 * s_y + cols[None, :], to_dtype(y, y_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _attn_res_mix_kernel(
    rows, norm_w_ptr, proj_w_ptr, out_w_ptr, out_ptr, n_rows, s_r, s_o, eps, out_eps,
    H: tl.constexpr, BLOCK_H: tl.constexpr, NUM: tl.constexpr, BLOCK_J: tl.constexpr, CHUNK: tl.constexpr,
    NORM: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """§4.2 for one token: s_j = (r_j·cw)·rsqrt(mean r_j² + eps), p = softmax_j(s), bf(Σ_j p_j r_j) in order;
    NORM: then the RMSNorm of that bf16 mixture with out_w, out_eps (a second rounding, §4.9).
    `rows` is a tuple of NUM candidate pointers; each row is read twice (scores, then the mix). CHUNK > 0: the
    scores' sums run over [BLOCK_J, CHUNK] tiles of all rows at once, two reductions across the threads in all
    (a decode step's short chain of latencies); CHUNK 0: row by row, two each (fewer registers: many tokens)."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    jj = tl.arange(0, BLOCK_J)
    if CHUNK > 0:
        base = rows[0] + t * s_r + tl.zeros([BLOCK_J], tl.int64)  # row j's pointer in lane j (padding: masked)
        for j in tl.static_range(1, NUM):
            base = tl.where(jj == j, rows[j] + t * s_r, base)
        dots = tl.zeros([BLOCK_J, CHUNK], tl.float32)
        squares = tl.zeros([BLOCK_J, CHUNK], tl.float32)
        for c0 in tl.static_range(0, BLOCK_H, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            cw = tl.load(norm_w_ptr + c, mask=c < H, other=0.0).to(tl.float32) * \
                tl.load(proj_w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
            r = tl.load(base[:, None] + c[None, :], mask=(jj[:, None] < NUM) & (c < H)[None, :],
                        other=0.0).to(tl.float32)
            dots += r * cw[None, :]
            squares += r * r
        s = tl.sum(dots, axis=1) * (1.0 / tl.sqrt_rn(tl.sum(squares, axis=1) / H + eps))
        s = tl.where(jj < NUM, s, float("-inf"))
    else:
        cw = tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        s = tl.full([BLOCK_J], float("-inf"), tl.float32)
        for j in tl.static_range(NUM):
            r = tl.load(rows[j] + t * s_r + cols, mask=cmask, other=0.0).to(tl.float32)
            s_j = tl.sum(r * cw, axis=0) * (1.0 / tl.sqrt_rn(tl.sum(r * r, axis=0) / H + eps))
            s = tl.where(jj == j, s_j, s)
    e = tl.exp(s - tl.max(s, axis=0))
    p = e / tl.sum(e, axis=0)
    mix = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(NUM):  # volatile: re-read (from cache) rather than keep NUM rows live in registers
        r = tl.load(rows[j] + t * s_r + cols, mask=cmask, other=0.0, volatile=True).to(tl.float32)
        mix = mix + tl.sum(tl.where(jj == j, p, 0.0), axis=0) * r
    y = to_dtype(mix, rows[0].dtype.element_ty, INTERPRET)
    if NORM:
        m = y.to(tl.float32)
        w = tl.load(out_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = to_dtype(rms_normed(m, w, H, out_eps, 0), out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + t * s_o + cols, y, mask=cmask)


@triton.jit(do_not_specialize=["s_q", "s_l", "s_qo"])
def _mla_latent_kernel(
    q_ptr, qw_ptr, qo_ptr, lat_ptr, kvw_ptr, pool_ptr, slot_ptr, s_q, s_l, s_qo, q_eps, kv_eps,
    Q: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_Q: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """Token t: pool row slot[t] = [rms_norm(lat[t, :R]) ; lat[t, R:W]], rounded to lat's dtype then the pool's,
    NaN and Inf stored as 0 (`mla_ref.mla_write`); HAS_Q: qo[t] = rms_norm(q[t]). Each norm `rms_normed`, one
    rounding."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    raw = tl.load(lat_ptr + t * s_l + c, mask=c < W, other=0.0)
    x = tl.where(c < R, raw.to(tl.float32), 0.0)
    w = tl.load(kvw_ptr + c, mask=c < R, other=0.0).to(tl.float32)
    normed = to_dtype(rms_normed(x, w, R, kv_eps, 0), lat_ptr.dtype.element_ty, INTERPRET)
    row = to_dtype(tl.where(c < R, normed, raw).to(tl.float32), pool_ptr.dtype.element_ty, INTERPRET)
    row = tl.where(tl.abs(row.to(tl.float32)) < float("inf"), row, 0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # never negative; if one were, nothing is written before the pool
        tl.store(pool_ptr + slot * W + c, row, mask=c < W)
    if HAS_Q:
        cq = tl.arange(0, BLOCK_Q)
        xq = tl.load(q_ptr + t * s_q + cq, mask=cq < Q, other=0.0).to(tl.float32)
        wq = tl.load(qw_ptr + cq, mask=cq < Q, other=0.0).to(tl.float32)
        yq = to_dtype(rms_normed(xq, wq, Q, q_eps, 0), qo_ptr.dtype.element_ty, INTERPRET)
        tl.store(qo_ptr + t * s_qo + cq, yq, mask=cq < Q)


# ---- launchers and the ops (norm_ref signatures) --------------------------------------

DECODE_ROWS = 256  # at most this many rows: rows of 1,024 values or more one a program


def row_config(D: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) of the row kernels: whole rows, ~4K values per program; up to DECODE_ROWS
    rows of D >= 1,024, one row a program on at least 8 warps, more programs in flight. One H100, the routed
    experts' sum + latent norm (D 1,024, 6 slots) in graphs of 20 chained calls (2026-12-08), µs at 1 / 64 / 256
    rows: 4 rows on 4 warps 2.25 / 2.78 / 2.96, 1 row on 4 warps 1.56 / 1.64 / 1.98, on 8 warps 1.36 / 1.55 /
    1.98. Larger steps keep the 4K-value tiles (not measured against)."""
    block_d = triton.next_power_of_2(D)
    if rows <= DECODE_ROWS and block_d >= 1024:
        return block_d, 1, max(8, min(16, block_d // 1024))
    block_rows = max(1, min(64, 4096 // block_d))
    return block_d, block_rows, max(4, min(16, block_d * block_rows // 1024))


MIX_TILED_ROWS = 64  # the AttnRes mix's scores in tiles up to this many tokens, row by row above


def mix_warps(block_h: int, tokens: int) -> int:
    """num_warps of the AttnRes mix: 32 values of a row a thread (H 7168 -> 8 warps), and at least 8 where the
    scores run in tiles (bench/kernels.py --families norm --match mix_norm times the others beside the rule). One
    H100, mix + norm in CUDA graphs of 20 chained calls (2026-12-07), µs at 1 / 8 / 64 tokens, `small` (H 2048,
    5 rows) 4 warps 3.32 / 3.38 / 3.50, 8 warps 3.00 / 3.03 / 3.23, 16 warps 3.32 / 3.37 / 3.54; K3 (H 7168,
    9 rows) 11.4 / 11.7 / 12.7, 8.9 / 9.0 / 9.3, 10.5 / 10.5 / 11.0."""
    return max(8 if tokens <= MIX_TILED_ROWS else 4, min(16, block_h // 1024))


def mix_chunk(tokens: int, block_h: int, block_j: int, warps: int) -> int:
    """Columns of the AttnRes scores' [block_j, chunk] tiles (32 values of each tile a thread), 0 for row by row.
    On an H100 (bench/kernels.py --families norm --match mix, µs, rows -> tiles): `small` (H 2048, 5 rows) 1 token
    5 -> 4, 64 tokens 5 -> 5, 1,024 tokens 10 -> 12; K3 (H 7168, 9 rows) 1 and 64 tokens equal, 1,024 tokens
    74 -> 104, 16,384 1,165 -> 1,482; decode replays (`small`, MXFP4, gpu_ab) 1.0-1.5 % faster at batch 1-64."""
    return min(block_h, 32 * 32 * warps // block_j) if tokens <= MIX_TILED_ROWS else 0


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] as [n, D] with a unit last stride (a view where the strides allow, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def _row_norm(kind: int, x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    D = x.shape[-1]
    x2 = _as_rows(x)
    z2 = _as_rows(z) if z is not None else x2
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if out.numel():
        block_d, block_rows, warps = row_config(D, x2.shape[0])
        _row_norm_kernel[(triton.cdiv(x2.shape[0], block_rows),)](
            x2, z2, weight if weight is not None else x2, out, n_rows=x2.shape[0], s_x=x2.stride(0), s_z=z2.stride(0),
            s_y=out.stride(0), eps=eps, D=D, BLOCK_D=block_d, BLOCK_ROWS=block_rows, KIND=kind,
            INTERPRET=interpreting(), **pdl.launch_args(x.device), num_warps=warps, enable_fp_fusion=FP_FUSION)
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm_ref.rms_norm`: bf(x32·rsqrt(mean(x32²) + eps)·w32) over the last dim, in x's dtype."""
    return _row_norm(0, x, None, weight, eps, x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm_ref.gated_rms_norm`: per-row RMSNorm times σ(z), one rounding to o's dtype."""
    if z.shape != o.shape:
        raise ValueError(f"gated_rms_norm: z expected shape {list(o.shape)}, got {list(z.shape)}")
    return _row_norm(1, o, z, weight, eps, o.dtype)


def attn_res_mix(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm_ref.attn_res_mix`: the pre-norm softmax mixture of the candidate rows (§4.2), one rounding.

    rows: n+1 tensors [T, H] (bank rows in order, the current prefix last). One read per candidate
    from HBM; the mix re-reads each row from cache.
    """
    return _mix(rows, norm_w, proj_w, eps, None, 0.0)


def attn_res_mix_norm(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                      out_w: torch.Tensor, out_eps: float) -> torch.Tensor:
    """`norm_ref.attn_res_mix_norm`: rms_norm(attn_res_mix(...)) in one kernel, the mixture rounded
    to the model dtype before the norm as in the unfused path."""
    return _mix(rows, norm_w, proj_w, eps, out_w, out_eps)


def attn_res_mix_norm_with(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                           out_w: torch.Tensor, out_eps: float, warps: int) -> torch.Tensor:
    """`attn_res_mix_norm` on `warps` warps instead of `mix_warps`' (bench/kernels_norm.py compares them)."""
    return _mix(rows, norm_w, proj_w, eps, out_w, out_eps, warps)


def _mix(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
         out_w: torch.Tensor | None, out_eps: float, warps: int | None = None) -> torch.Tensor:
    first = rows[0]
    for j, r in enumerate(rows):
        if r.shape != first.shape or r.dtype != first.dtype:
            raise ValueError(f"attn_res_mix: rows[{j}] expected {first.dtype} {list(first.shape)}, "
                             f"got {r.dtype} {list(r.shape)}")
    H = first.shape[-1]
    flat = [_as_rows(r) for r in rows]
    if len({r.stride(0) for r in flat}) > 1:
        flat = [r.contiguous() for r in flat]
    out = torch.empty(flat[0].shape, dtype=first.dtype, device=first.device)
    if out.numel():
        T = flat[0].shape[0]
        block_h, block_j = triton.next_power_of_2(H), max(2, triton.next_power_of_2(len(rows)))
        warps = warps or mix_warps(block_h, T)
        _attn_res_mix_kernel[(T,)](
            tuple(flat), norm_w, proj_w.reshape(-1), norm_w if out_w is None else out_w, out,
            n_rows=T, s_r=flat[0].stride(0), s_o=out.stride(0), eps=eps, out_eps=out_eps, H=H,
            BLOCK_H=block_h, NUM=len(rows), BLOCK_J=block_j, CHUNK=mix_chunk(T, block_h, block_j, warps),
            NORM=out_w is not None, INTERPRET=interpreting(), **pdl.launch_args(out.device), num_warps=warps,
            enable_fp_fusion=FP_FUSION)
    return out.view(first.shape)


def mla_latent(q_a: torch.Tensor | None, q_norm_weight: torch.Tensor | None, q_eps: float, lat: torch.Tensor,
               kv_norm_weight: torch.Tensor, kv_eps: float, pool: torch.Tensor,
               slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """`mla_ref.mla_latent`: the pool rows and the q norm in one kernel, a program per token."""
    T, W = lat.shape
    R = kv_norm_weight.shape[0]
    q_out = None if q_a is None else torch.empty(q_a.shape, dtype=q_a.dtype, device=q_a.device)
    if T:
        Q = 1 if q_a is None else q_a.shape[1]
        block = max(triton.next_power_of_2(W), triton.next_power_of_2(Q))
        _mla_latent_kernel[(T,)](
            lat if q_a is None else q_a, kv_norm_weight if q_a is None else q_norm_weight,
            lat if q_out is None else q_out, lat, kv_norm_weight, pool, slot_mapping,
            s_q=0 if q_a is None else q_a.stride(0), s_l=lat.stride(0), s_qo=0 if q_out is None else q_out.stride(0),
            q_eps=float(q_eps), kv_eps=float(kv_eps), Q=Q, R=R, W=W, BLOCK_Q=triton.next_power_of_2(Q),
            BLOCK_W=triton.next_power_of_2(W), HAS_Q=q_a is not None, INTERPRET=interpreting(),
            **pdl.launch_args(lat.device), num_warps=max(4, min(16, block // 256)), enable_fp_fusion=FP_FUSION)
    return q_out


# ---- verifiers: (ok, reason); a decline runs the torch reference -----------------------------------

def _supports(*tensors: torch.Tensor, width: int, out_dtype: torch.dtype | None = None) -> tuple[bool, str]:
    if not interpreting() and not all(t.is_cuda for t in tensors):
        return False, "tensors not on a GPU (the kernels need CUDA, or TRITON_INTERPRET=1)"
    for dtype in (*(t.dtype for t in tensors), *([] if out_dtype is None else [out_dtype])):
        if dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {dtype}: the kernels take bfloat16, float16, float32"
    if width > MAX_WIDTH:
        return False, f"rows of {width} values > {MAX_WIDTH}"
    return True, ""


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    return _supports(x, weight, width=x.shape[-1])


def gated_rms_norm_supports(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    return _supports(o, z, weight, width=o.shape[-1])


def attn_res_mix_supports(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                          eps: float) -> tuple[bool, str]:
    if not 1 <= len(rows) <= MAX_ROWS_MIXED:
        return False, f"{len(rows)} candidate rows: the kernel takes 1..{MAX_ROWS_MIXED}"
    return _supports(*rows, norm_w, proj_w, width=rows[0].shape[-1])


def attn_res_mix_norm_supports(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                               out_w: torch.Tensor, out_eps: float) -> tuple[bool, str]:
    ok, why = attn_res_mix_supports(rows, norm_w, proj_w, eps)
    return _supports(out_w, width=0) if ok else (ok, why)


def mla_latent_supports(q_a: torch.Tensor | None, q_norm_weight: torch.Tensor | None, q_eps: float,
                        lat: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, pool: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[bool, str]:
    """Rows with a unit last stride, a contiguous pool of lat's width, int32/int64 slots, one per row."""
    W = lat.shape[-1]
    qs = () if q_a is None else (q_a, q_norm_weight)
    if lat.dim() != 2 or (q_a is not None and q_a.dim() != 2) or pool.shape[-1] != W or not pool.is_contiguous():
        return False, f"expected lat [T, r + dr] and a contiguous pool [.., {W}], got {list(lat.shape)}, " \
                      f"{list(pool.shape)}"
    if any(t.stride(-1) != 1 for t in (lat, kv_norm_weight, *qs)) or kv_norm_weight.shape[0] > W:
        return False, "lat, q_a and the norm weights: expected unit last strides, r <= r + dr"
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (lat.shape[0],):
        return False, f"slot_mapping: expected int32/int64 [{lat.shape[0]}], got {slot_mapping.dtype} " \
                      f"{list(slot_mapping.shape)}"
    if q_a is not None and (q_a.shape[0] != lat.shape[0] or q_norm_weight.shape != (q_a.shape[1],)):
        return False, f"q_a {list(q_a.shape)} and its norm weight {list(q_norm_weight.shape)} do not match lat's rows"
    return _supports(lat, kv_norm_weight, pool, *qs, width=max(W, 0 if q_a is None else q_a.shape[1]))
