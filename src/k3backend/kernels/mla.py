"""Triton MLA attention over the paged latent pool (K3_LM §6.3, §6.5): fast `mla_decode` and `mla_prefill`.

Same signatures and rounding points as `mla_ref`. Both ops run the absorbed form as an MQA over the
latent: every query row (token t, head h) carries q̂ = bf(q_nope·W_UK) [r] and q_pe [dr]; all rows of
a sequence read the same latent rows [c_kv ; k_pe] (one HBM read per tile for every head), and the
value is c_kv itself, so ô = bf(softmax(q̂·c_kvᵀ + q_pe·k_peᵀ)·c_kv) and o = bf(ô·W_UV). The two
GEMMs around the attention (q̂ and o) are torch bmm's in the model dtype (fp32 accumulation, one
rounding: the reference's rounding points). `mla_prefill` runs the expanded (MHA) form for a chunk
with no cached prefix, as the reference chooses, in a second flash kernel over bf(c_kv·W_kvbᵀ).

Kernel structure (flash-decoding): a program owns a tile of BLOCK_M query rows of one sequence and a
slice of its keys (split-KV), walks the block table BLOCK_N keys at a time with an online softmax,
and writes either the normalised output (one split) or an fp32 partial and its log-sum-exp for a
reduce kernel. The split count comes from shapes only (batch, block-table width, SM count), never
from tensor values, so a decode step can be captured as a CUDA graph; each sequence divides its own
context evenly among the splits, so short sequences in a wide table cost only empty programs.

Numerics: scores, softmax and accumulators are fp32. The probability matrix feeds the value GEMM as
two bf16 halves (p = p_hi + p_lo), so the tensor-core product keeps ~16 bits of p instead of the 8
of a single bf16 cast. The interpreter's bf16 `tl.dot` is wrong (it multiplies the raw bits), so
under TRITON_INTERPRET=1 (and for fp32 models) dots run on fp32 operands with ieee precision; its
fp32 -> bf16 cast truncates, so roundings go through `norm.to_dtype`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from k3backend.kernels import pdl
from k3backend.kernels.norm import interpreting, to_dtype
from k3backend.kernels.varlen import VarlenLayout, layout_problem, varlen_layout

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_RANK = 512  # kv_lora_rank: the [BLOCK_M, r] fp32 accumulator lives in registers
MAX_ROPE = 128
MAX_HEAD_DIM = 256


# ---- kernels ------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a·b with fp32 accumulation; F32_DOT: fp32 operands, ieee (fp32 models, the interpreter)."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _pv(v, p, acc, F32_DOT: tl.constexpr, SPLIT_P: tl.constexpr, INTERPRET: tl.constexpr,
        P_LEFT: tl.constexpr = False):
    """acc + v·p (or p·v with P_LEFT) for fp32 probabilities p and 16-bit values v: p enters the
    tensor-core product as two 16-bit halves p_hi + p_lo (~16 bits of p)."""
    if SPLIT_P:
        p_hi = to_dtype(p, v.dtype, INTERPRET)
        p_lo = to_dtype(p - p_hi.to(tl.float32), v.dtype, INTERPRET)
        if P_LEFT:
            acc = _dot(p_lo, v, _dot(p_hi, v, acc, F32_DOT), F32_DOT)
        else:
            acc = _dot(v, p_lo, _dot(v, p_hi, acc, F32_DOT), F32_DOT)
    else:  # fp32 values, or (tuning) p as a single 16-bit cast
        pc = p if v.dtype == tl.float32 else to_dtype(p, v.dtype, INTERPRET)
        if P_LEFT:
            acc = _dot(pc, v, acc, F32_DOT)
        else:
            acc = _dot(v, pc, acc, F32_DOT)
    return acc


@triton.jit
def _mask2(rows_ok, cols, n: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, cols] mask of a row-masked tile whose column block may be padded past n."""
    if n == BLOCK:
        mask = rows_ok[:, None] & (cols >= 0)[None, :]
    else:
        mask = rows_ok[:, None] & (cols < n)[None, :]
    return mask


@triton.jit
def _find_seq(tile_cu_ptr, pid, B, SEARCH: tl.constexpr):
    """The sequence b whose tiles [tile_cu[b], tile_cu[b+1]) hold tile `pid` (B when past the last)."""
    b = pid * 0
    for c0 in range(0, B, SEARCH):
        idx = c0 + tl.arange(0, SEARCH)
        ends = tl.load(tile_cu_ptr + 1 + idx, mask=idx < B, other=2147483647)
        b += tl.sum((ends <= pid).to(tl.int32), axis=0)
    return b


@triton.jit
def _masked_tile(pool_ptr, bt_row, start, kv_end, limit, s_blk, s_row, BLOCK_SIZE: tl.constexpr, R: tl.constexpr,
                 DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys start..start+BLOCK_N through the block table, rows past kv_end read as zeros:
    (c_kv [BLOCK_N, BLOCK_R], k_pe [BLOCK_N, BLOCK_DR], visible [BLOCK_N, rows])."""
    j = start + tl.arange(0, BLOCK_N)
    j_ok = j < kv_end
    blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
    base = blk * s_blk + (j % BLOCK_SIZE).to(tl.int64) * s_row
    cr = tl.arange(0, BLOCK_R)
    cp = tl.arange(0, BLOCK_DR)
    ckv = tl.load(pool_ptr + base[:, None] + cr[None, :], mask=_mask2(j_ok, cr, R, BLOCK_R), other=0.0)
    kpe = tl.load(pool_ptr + base[:, None] + R + cp[None, :], mask=_mask2(j_ok, cp, DR, BLOCK_DR), other=0.0)
    return ckv, kpe, (j[:, None] < limit[None, :]) & j_ok[:, None]


@triton.jit
def _latent_step(ckv, kpe, qT, qpeT, visible, m_i, l_i, accT, scale, F32_DOT: tl.constexpr, SPLIT_P: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """One key tile of the online softmax, transposed (keys x rows): the key tile is the MMA's M side,
    read from shared memory, and the few query rows its N side, so neither q̂ nor the [r, rows]
    accumulator needs per-warp copies. ckv [BLOCK_N, BLOCK_R], kpe [BLOCK_N, BLOCK_DR]; qT, qpeT the
    transposed queries; visible [BLOCK_N, BLOCK_M]."""
    sT = _dot(ckv, qT, tl.zeros([ckv.shape[0], qT.shape[1]], tl.float32), F32_DOT)
    sT = _dot(kpe, qpeT, sT, F32_DOT) * scale  # fp32 logits
    sT = tl.where(visible, sT, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sT, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    pT = tl.exp(sT - m_use[None, :])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(pT, axis=0)
    accT = _pv(tl.trans(ckv), pT, accT * alpha[None, :], F32_DOT, SPLIT_P, INTERPRET)
    return m_new, l_i, accT


# Every int that changes with the step's batch (sizes, and strides that are multiples of T or B) is
# left unspecialised, so a new batch size never recompiles (e.g. during CUDA-graph capture).
@triton.jit(do_not_specialize=["B", "N", "num_splits", "tiles_per_seq", "s_qh", "s_bt", "s_os", "s_oh", "s_ls"])
def _latent_attn_kernel(
    q_ptr, qpe_ptr, pool_ptr, ckv_desc, kpe_desc, bt_ptr, ctx_ptr, cu_ptr, tile_cu_ptr, pcu_ptr, out_ptr, lse_ptr,
    scale, B, N, num_splits, tiles_per_seq,
    s_qt, s_qh, s_pt, s_ph, s_blk, s_row, s_bt, s_os, s_ot, s_oh, s_ls, s_lt, s_lh,
    BLOCK_SIZE: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr, SKIP_FRESH: tl.constexpr,
    SPLIT: tl.constexpr, USE_TMA: tl.constexpr, F32_DOT: tl.constexpr, SPLIT_P: tl.constexpr,
    INTERPRET: tl.constexpr, SEARCH: tl.constexpr, PREFIX: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Rows (token t, head h) of one sequence, flattened t·N + h, against the sequence's latent rows.

    DECODE: one query token per sequence (row tile = pid % tiles_per_seq, token = b); otherwise the
    varlen chunks of `cu_ptr`, tiles found in `tile_cu_ptr`. Query token i of a chunk of length L
    sits at position ctx − L + i and sees keys j ≤ that position. SKIP_FRESH: chunks with no cached
    prefix, and (PREFIX) those whose prefix `pcu_ptr` expands, are left to the MHA kernel. SPLIT:
    write fp32 partials + lse at split = program_id(1).
    USE_TMA (BLOCK_N divides the pool's block size): key tiles are one slice of one pool block, loaded
    by TMA descriptors over the pool's [c_kv] and [k_pe] columns, the partial last one whole: its rows
    past the context get p = 0, which is exact only because the pool holds no NaN or Inf (`mla_write`).
    (Masked pointer loads for that tile miscompute on the GPU, triton 3.6: a 64 x 512 tile stored from
    registers to shared memory for wgmma gives wrong sums or an illegal address.) Without TMA no row
    past the context is read.
    """
    pdl.enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if DECODE:
        b = pid // tiles_per_seq
        m0 = (pid - b * tiles_per_seq) * BLOCK_M
        q_start = b
        L = 1
    else:
        b = _find_seq(tile_cu_ptr, pid, B, SEARCH)
        if b >= B:
            return
        m0 = (pid - tl.load(tile_cu_ptr + b)) * BLOCK_M
        q_start = tl.load(cu_ptr + b)
        L = tl.load(cu_ptr + b + 1) - q_start
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    prefix = ctx - L
    if SKIP_FRESH:
        width = tl.load(pcu_ptr + b + 1) - tl.load(pcu_ptr + b) if PREFIX else 0
        if prefix == width:
            return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < L * N
    tok = rows // N
    head = rows % N
    limit = prefix + tok + 1  # keys j < limit are visible to the row
    kv_hi = tl.minimum(ctx, prefix + (m0 + BLOCK_M - 1) // N + 1)
    chunk = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_end = tl.minimum(kv_hi, kv_lo + chunk)

    t = (q_start + tok).to(tl.int64)
    cr = tl.arange(0, BLOCK_R)
    cp = tl.arange(0, BLOCK_DR)
    qT = tl.load(q_ptr + (t * s_qt + head * s_qh)[None, :] + cr[:, None],
                 mask=row_ok[None, :] & (cr < R)[:, None], other=0.0)  # [BLOCK_R, BLOCK_M]
    qpeT = tl.load(qpe_ptr + (t * s_pt + head * s_ph)[None, :] + cp[:, None],
                   mask=row_ok[None, :] & (cp < DR)[:, None], other=0.0)  # [BLOCK_DR, BLOCK_M]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    accT = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    if USE_TMA:  # every tile by TMA, a partial last one too: its rows past kv_end are read, then masked
        for start in range(kv_lo, kv_end, BLOCK_N):
            row = (tl.load(bt_row + start // BLOCK_SIZE) * BLOCK_SIZE + start % BLOCK_SIZE).to(tl.int32)
            ckv = ckv_desc.load([row, 0])
            kpe = kpe_desc.load([row, 0])
            j = start + tl.arange(0, BLOCK_N)  # split ends are whole tiles or kv_hi, and limit <= kv_hi
            m_i, l_i, accT = _latent_step(ckv, kpe, qT, qpeT, j[:, None] < limit[None, :], m_i, l_i, accT, scale,
                                          F32_DOT, SPLIT_P, INTERPRET)
    else:
        for start in range(kv_lo, kv_end, BLOCK_N):
            ckv, kpe, visible = _masked_tile(pool_ptr, bt_row, start, kv_end, limit, s_blk, s_row, BLOCK_SIZE, R, DR,
                                             BLOCK_R, BLOCK_DR, BLOCK_N)
            m_i, l_i, accT = _latent_step(ckv, kpe, qT, qpeT, visible, m_i, l_i, accT, scale, F32_DOT, SPLIT_P,
                                          INTERPRET)

    has = l_i > 0.0
    oT = accT / tl.where(has, l_i, 1.0)[None, :]
    o_off = (t * s_ot + head * s_oh)[None, :] + cr[:, None]
    o_mask = row_ok[None, :] & (cr < R)[:, None]
    if SPLIT:  # a row that saw no key writes only its -inf lse: the reduce skips its partial
        sp = split.to(tl.int64)
        tl.store(out_ptr + sp * s_os + o_off, oT, mask=o_mask & has[None, :])
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + sp * s_ls + t * s_lt + head * s_lh, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, to_dtype(oT, out_ptr.dtype.element_ty, INTERPRET), mask=o_mask)


@triton.jit(do_not_specialize=["N", "num_splits", "s_os", "s_ls", "s_h"])
def _latent_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, N, num_splits,
    s_os, s_ot, s_oh, s_ls, s_lt, s_lh, s_t, s_h,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, h] = Σ_s exp(lse_s − M)·part_s / Σ_s exp(lse_s − M), rounded once; 0 when no key was seen.
    BLOCK_S splits a step, in one pass (small batches run ~100 splits, most of them empty)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    t = (pid // N).to(tl.int64)
    h = pid % N
    lse_row = lse_ptr + t * s_lt + h * s_lh
    part_row = part_ptr + t * s_ot + h * s_oh
    cs = tl.arange(0, BLOCK_S)
    cr = tl.arange(0, BLOCK_R)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):  # one pass, rescaled as the running max grows
        sp = (s0 + cs).to(tl.int64)
        lse = tl.load(lse_row + sp * s_ls, mask=sp < num_splits, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(lse > float("-inf"), tl.exp(lse - m_use), 0.0)  # empty splits' partials: never read
        part = tl.load(part_row + sp[:, None] * s_os + cr[None, :], mask=(w > 0.0)[:, None] & (cr < R)[None, :],
                       other=0.0)
        alpha = tl.exp(m - m_use)
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m = m_new
    o = acc / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + t * s_t + h * s_h + cr, to_dtype(o, out_ptr.dtype.element_ty, INTERPRET), mask=cr < R)


@triton.jit
def _mha_step(q, qpe, kn, v, kpe, visible, m_i, l_i, acc, scale, F32_DOT: tl.constexpr, SPLIT_P: tl.constexpr,
              INTERPRET: tl.constexpr):
    """One key tile of the expanded form's online softmax: kn [BLOCK_N, dn], v, kpe; visible [rows, keys]."""
    s = _dot(q, tl.trans(kn), tl.zeros([q.shape[0], kn.shape[0]], tl.float32), F32_DOT)
    s = _dot(qpe, tl.trans(kpe), s, F32_DOT) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _pv(v, p, acc * alpha[:, None], F32_DOT, SPLIT_P, INTERPRET, P_LEFT=True)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["B", "s_bt"])
def _mha_kernel(
    qn_ptr, qp_ptr, kv_ptr, kpe_ptr, cu_ptr, ctx_ptr, tile_cu_ptr, out_ptr, pool_ptr, bt_ptr, pcu_ptr, ws_ptr,
    scale, B, s_nt, s_nh, s_pt, s_ph, s_kt, s_kh, s_et, s_ot, s_oh, s_blk, s_row, s_bt, s_wt, s_wh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
    SPLIT_P: tl.constexpr, INTERPRET: tl.constexpr, SEARCH: tl.constexpr, PREFIX: tl.constexpr = False,
    R: tl.constexpr = 0, BLOCK_SIZE: tl.constexpr = 1,
):
    """Expanded form of one head over a chunk: causal flash attention with k = [k_nope_h ; k_pe],
    v = v_h from kv = bf(c_kv·W_kvbᵀ) [T, N, dn+dv] and k_pe [T, dr]. A fresh chunk (no cached
    prefix) sees its own rows; with PREFIX, a chunk whose prefix `pcu_ptr` gives workspace rows
    first sees all of its prefix there (`ws_ptr` [rows, N, dn+dv], `expand_prefix`), its k_pe read
    from the pool (`bt_ptr`, rows of R + dr). Other chunks are the absorbed kernel's."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = _find_seq(tile_cu_ptr, pid, B, SEARCH)
    if b >= B:
        return
    q_start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - q_start
    prefix = tl.load(ctx_ptr + b) - L
    p0 = tl.load(pcu_ptr + b) if PREFIX else 0
    if prefix != (tl.load(pcu_ptr + b + 1) - p0 if PREFIX else 0):
        return  # the absorbed kernel's chunk
    m0 = (pid - tl.load(tile_cu_ptr + b)) * BLOCK_M
    i = m0 + tl.arange(0, BLOCK_M)
    i_ok = i < L
    ti = (q_start + i).to(tl.int64)
    cn = tl.arange(0, BLOCK_DN)
    cp = tl.arange(0, BLOCK_DR)
    cv = tl.arange(0, BLOCK_DV)
    q = tl.load(qn_ptr + (ti * s_nt + h * s_nh)[:, None] + cn[None, :], mask=i_ok[:, None] & (cn < DN)[None, :],
                other=0.0)
    qpe = tl.load(qp_ptr + (ti * s_pt + h * s_ph)[:, None] + cp[None, :], mask=i_ok[:, None] & (cp < DR)[None, :],
                  other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if PREFIX:  # the cached prefix, every key visible to every row
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        for start in range(0, prefix, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < prefix
            w_row = ws_ptr + ((p0 + j).to(tl.int64) * s_wt + h * s_wh)[:, None]
            kn = tl.load(w_row + cn[None, :], mask=j_ok[:, None] & (cn < DN)[None, :], other=0.0)
            v = tl.load(w_row + DN + cv[None, :], mask=j_ok[:, None] & (cv < DV)[None, :], other=0.0)
            blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
            p_row = pool_ptr + (blk * s_blk + (j % BLOCK_SIZE).to(tl.int64) * s_row + R)[:, None]
            kpe = tl.load(p_row + cp[None, :], mask=j_ok[:, None] & (cp < DR)[None, :], other=0.0)
            m_i, l_i, acc = _mha_step(q, qpe, kn, v, kpe, (i >= 0)[:, None] & j_ok[None, :], m_i, l_i, acc, scale,
                                      F32_DOT, SPLIT_P, INTERPRET)
    kv_hi = tl.minimum(L, m0 + BLOCK_M)
    for start in range(0, kv_hi, BLOCK_N):  # the chunk's own rows, causally
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < kv_hi
        tj = (q_start + j).to(tl.int64)
        kv_row = kv_ptr + (tj * s_kt + h * s_kh)[:, None]
        kn = tl.load(kv_row + cn[None, :], mask=j_ok[:, None] & (cn < DN)[None, :], other=0.0)
        v = tl.load(kv_row + DN + cv[None, :], mask=j_ok[:, None] & (cv < DV)[None, :], other=0.0)
        kpe = tl.load(kpe_ptr + (tj * s_et)[:, None] + cp[None, :], mask=j_ok[:, None] & (cp < DR)[None, :],
                      other=0.0)
        m_i, l_i, acc = _mha_step(q, qpe, kn, v, kpe, (j[None, :] <= i[:, None]) & j_ok[None, :], m_i, l_i, acc,
                                  scale, F32_DOT, SPLIT_P, INTERPRET)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (ti * s_ot + h * s_oh)[:, None] + cv[None, :], to_dtype(o, out_ptr.dtype.element_ty, INTERPRET),
             mask=i_ok[:, None] & (cv < DV)[None, :])


@triton.jit(do_not_specialize=["B", "s_bt"])
def _expand_kernel(pool_ptr, bt_ptr, pcu_ptr, w_ptr, ws_ptr, B, s_blk, s_row, s_bt, s_wn, s_wt,
                   NOUT: tl.constexpr, R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEARCH: tl.constexpr, F32_DOT: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Workspace rows p < pcu[B]: ws[p] = bf(c_kv·W_kvbᵀ) of the latent row at position p − pcu[b] of
    the sequence b whose rows [pcu[b], pcu[b+1]) hold p. The grid covers the workspace's capacity;
    programs past the last row return at once."""
    m0 = tl.program_id(0) * BLOCK_M
    total = tl.load(pcu_ptr + B)
    if m0 >= total:
        return
    p = m0 + tl.arange(0, BLOCK_M)
    p_ok = p < total
    b = tl.zeros([BLOCK_M], tl.int32)  # how many sequences end at or before the row
    for c0 in range(0, B, SEARCH):
        idx = c0 + tl.arange(0, SEARCH)
        ends = tl.load(pcu_ptr + 1 + idx, mask=idx < B, other=2147483647)
        b += tl.sum((ends[None, :] <= p[:, None]).to(tl.int32), axis=1)
    b = tl.minimum(b, B - 1)
    j = p - tl.load(pcu_ptr + b, mask=p_ok, other=0)
    blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + j // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
    row = blk * s_blk + (j % BLOCK_SIZE).to(tl.int64) * s_row
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, R, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(pool_ptr + row[:, None] + k[None, :], mask=p_ok[:, None] & (k < R)[None, :], other=0.0)
        wT = tl.load(w_ptr + n[None, :].to(tl.int64) * s_wn + k[:, None], mask=(n < NOUT)[None, :] & (k < R)[:, None],
                     other=0.0)
        acc = _dot(a, wT, acc, F32_DOT)
    tl.store(ws_ptr + p[:, None].to(tl.int64) * s_wt + n[None, :], to_dtype(acc, ws_ptr.dtype.element_ty, INTERPRET),
             mask=p_ok[:, None] & (n < NOUT)[None, :])


# ---- launch configuration -----------------------------------------------------------------------

SEARCH = 128  # sequences compared per step of the tile -> sequence search
FP_FUSION = True  # a·b + c as one fma (explicit: triton 3.10 changes the default)


def _block(n: int) -> int:
    """A tl.arange / tl.dot width for a dimension of n: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def _dot_modes(dtype: torch.dtype) -> dict[str, bool]:
    """The F32_DOT, SPLIT_P and INTERPRET constexprs for a model dtype; see the module docstring."""
    interpret = interpreting()
    return {"F32_DOT": interpret or dtype == torch.float32, "SPLIT_P": dtype != torch.float32, "INTERPRET": interpret}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests exercise the reduce
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """Hopper or later (or the interpreter): TMA descriptors can be read (also kernels/moe.py)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


# Tile configurations: BLOCK_M query rows x BLOCK_N keys per step; "tma": load key tiles with TMA
# descriptors where the pool's layout allows (Hopper; BLOCK_N divides the block size); "ctas_per_sm":
# programs an SM for the split count (default 2); "p8" (for
# tuning only): p enters the value GEMM as one bf16 cast, not hi + lo (half the value MMAs). The shipped
# ones compile for sm_90a without spills under triton 3.6 and 3.9, but DECODE_TMA's 8 B under 3.6
# (tests/test_kernels_mla.py::test_configs_compile_for_hopper_without_spills).
def decode_config(num_heads: int, tma: bool = False) -> dict[str, int]:
    """Tile sizes of the latent kernel for decode: all heads of a sequence in one tile where they fit;
    tma: the pool's layout allows DECODE_TMA's descriptors (`tma_fits`)."""
    if num_heads <= 16 and tma:
        return dict(DECODE_TMA)
    if num_heads <= 16:
        # BLOCK_N 32 on 4 warps: 13-22 % faster than 64 on 8 at B64 ctx 384 / 1K / 4K and B256 ctx 384 (H200).
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "tma": False}
    return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "tma": False}


# 64-key TMA tiles on 4 warps, one program an SM (254 registers, ~170 KB of shared memory), so `num_splits`
# fills half the slots. Against the 32-key pointer tiles (H100, bench/kernels_mla.py --decode-sweep, each with
# its splits, the reduce of two passes): B1 ctx 4K / 16K 1.11x / 1.23x, B16 1K 1.26x, B64 4K / 16K 1.29x / 1.27x,
# B256 4K 1.22x.
# The 32-key TMA tile spills under triton 3.6; this one 8 B there (0 under 3.9): decode's mask by column
# (j < kv_end) avoids that and ran 4-7 % slower at B64 4K / 16K (H100, side by side).
DECODE_TMA = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tma": True, "ctas_per_sm": 1}


REDUCE_SPLITS = 16  # split partials the reduce reads a step
PREFILL_LATENT = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "tma": False}
PREFILL_MHA = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
EXPAND = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
# A chunk of at least PREFIX_MIN_LEN tokens attends to its cached prefix in the expanded form: the
# prefix's latent rows up-projected once (bf(c_kv·W_kvbᵀ), `expand_prefix`) into a workspace of
# PREFIX_TOKENS rows, then flash attention over them and the chunk. Per key that costs ~2·r·N·(dn+dv)
# once plus N·(dn+dr+dv) per query row, against N·(2r+dr) per query row absorbed. On the H200 at 16
# heads (bench/kernels_mla.py --prefix-forms) the expanded form takes 0.91x / 1.53x / 3.97x the
# absorbed one's speed for 64 / 256 / 1,024-token chunks after 1,024 cached tokens, 0.75x / 2.06x /
# 6.93x after 7,168, with errors against fp32 no larger. Shorter chunks, and chunks past the
# workspace, stay absorbed. PREFIX_TOKENS 0 turns the expanded form off.
PREFIX_TOKENS = 16384
PREFIX_MIN_LEN = 128


def tma_fits(pool: torch.Tensor, r: int, block_n: int) -> bool:
    """Whether TMA descriptors can read the pool's c_kv and k_pe columns in tiles of block_n rows."""
    bs, width, size = pool.shape[1], pool.shape[2], pool.element_size()
    return not (bs % block_n or (width * size) % 16 or (r * size) % 16 or pool.data_ptr() % 16
                or not pool.is_contiguous() or not has_tma(pool.device))


def decode_tiles(num_heads: int, pool: torch.Tensor, r: int) -> dict[str, int]:
    """`decode_config` for this pool: DECODE_TMA where its descriptors can read the pool."""
    return decode_config(num_heads, tma_fits(pool, r, DECODE_TMA["BLOCK_N"]))


def _descriptors(pool: torch.Tensor, r: int, dr: int, block_n: int) -> tuple | None:
    """TMA descriptors over the pool's c_kv and k_pe columns, viewed [num_blocks·block_size, r+dr]
    (tiles of BLOCK_N rows), or None where the layout does not allow them."""
    if not tma_fits(pool, r, block_n):
        return None
    width = pool.shape[2]
    flat = pool.view(-1, width)
    return (TensorDescriptor(flat, [flat.shape[0], r], [width, 1], [block_n, _block(r)]),
            TensorDescriptor(flat[:, r:], [flat.shape[0], dr], [width, 1], [block_n, _block(dr)]))


def num_splits(tiles: int, max_kv: int, device: torch.device, ctas_per_sm: int = 2) -> int:
    """KV splits per query tile from shapes only: fill the GPU in whole waves (FA2's heuristic), each
    split at least 128 keys, at most 64 splits. `tiles`: query tiles in the grid; `max_kv`: keys the widest
    table holds."""
    slots = _sm_count(device) * ctas_per_sm
    if tiles >= 0.8 * slots:
        return 1
    most = max(1, min(64, -(-max_kv // 128)))  # B1 ctx 384 / 4K / 16K (H100): 64 splits beat 109 by 2-12 %
    eff = [(tiles * s / slots) / math.ceil(tiles * s / slots) for s in range(1, most + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def decode_splits(config: dict, B: int, N: int, max_kv: int, device: torch.device) -> int:
    """`num_splits` of a decode launch with `config`'s row tiles and programs an SM."""
    return num_splits(B * -(-N // config["BLOCK_M"]), max_kv, device, config.get("ctas_per_sm", 2))


def latent_attention(q_hat: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor, *, cu_seqlens: torch.Tensor | None,
                     splits: int, config: dict[str, int], skip_fresh: bool = False,
                     tiles: torch.Tensor | None = None, prefix_cu: torch.Tensor | None = None) -> torch.Tensor:
    """ô = bf(softmax(q̂·c_kvᵀ + q_pe·k_peᵀ)·c_kv) into `out` [T, N, r] (model dtype), in place.

    q_hat [T, N, r], q_pe [T, N, dr] (any strides, last dim contiguous); cu_seqlens None: decode
    (T = B, one query per sequence). Rows of the chunks `skip_fresh` leaves out are not written
    (one split) or written as zeros (several); with prefix_cu ([B+1], `VarlenLayout.expanded_prefix`)
    the chunks whose prefix it expands are left out too. tiles [B+1] int32: the step's tile offsets
    (`VarlenLayout.tile_offsets(N, BLOCK_M)`), computed here when None.
    """
    T, N, r = q_hat.shape
    B, dr = context_lens.shape[0], q_pe.shape[-1]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if cu_seqlens is None:
        tiles_per_seq = -(-N // bm)
        grid_m, tile_cu, cu = B * tiles_per_seq, context_lens, context_lens  # (cu, tile_cu unused)
    else:
        tiles_per_seq = 0
        tile_cu = tiles if tiles is not None else varlen_layout(cu_seqlens, T).tile_offsets(N, bm)
        grid_m, cu = -(-T * N // bm) + B, cu_seqlens
    if grid_m == 0:
        return out
    if splits > 1:
        part = torch.empty(splits, T, N, r, dtype=torch.float32, device=q_hat.device)
        # skipped chunks' partials are never written: their lse must read as "no key" in the reduce
        lse = torch.empty(splits, T, N, dtype=torch.float32, device=q_hat.device)
        if skip_fresh:
            lse.fill_(float("-inf"))
        dst, s_o, s_l = part, part.stride(), lse.stride()
    else:
        dst, lse, s_o, s_l = out, out, (0, *out.stride()[:2]), (0, 0, 0)
    descs = _descriptors(pool, r, dr, bn) if config.get("tma") else None
    _latent_attn_kernel[(grid_m, splits)](
        q_hat, q_pe, pool, *(descs or (pool, pool)), block_tables, context_lens, cu, tile_cu,
        prefix_cu if prefix_cu is not None else cu, dst, lse,
        scale=scale, B=B, N=N, num_splits=splits, tiles_per_seq=tiles_per_seq,
        s_qt=q_hat.stride(0), s_qh=q_hat.stride(1), s_pt=q_pe.stride(0), s_ph=q_pe.stride(1),
        s_blk=pool.stride(0), s_row=pool.stride(1), s_bt=block_tables.stride(0),
        s_os=s_o[0], s_ot=s_o[1], s_oh=s_o[2], s_ls=s_l[0], s_lt=s_l[1], s_lh=s_l[2],
        BLOCK_SIZE=pool.shape[1], R=r, DR=dr, BLOCK_R=_block(r), BLOCK_DR=_block(dr), BLOCK_M=bm, BLOCK_N=bn,
        DECODE=cu_seqlens is None, SKIP_FRESH=skip_fresh, SPLIT=splits > 1, USE_TMA=descs is not None,
        PREFIX=prefix_cu is not None,
        SEARCH=SEARCH, **{**_dot_modes(q_hat.dtype), **({"SPLIT_P": False} if config.get("p8") else {})},
        **pdl.launch_args(q_hat.device), num_warps=config["num_warps"], num_stages=config["num_stages"],
        enable_fp_fusion=FP_FUSION)
    if splits > 1:
        _latent_reduce_kernel[(T * N,)](
            part, lse, out, N=N, num_splits=splits, s_os=part.stride(0), s_ot=part.stride(1), s_oh=part.stride(2),
            s_ls=lse.stride(0), s_lt=lse.stride(1), s_lh=lse.stride(2), s_t=out.stride(0), s_h=out.stride(1),
            R=r, BLOCK_R=_block(r), BLOCK_S=REDUCE_SPLITS, INTERPRET=interpreting(), **pdl.launch_args(q_hat.device),
            num_warps=4, enable_fp_fusion=FP_FUSION)
    return out


def mha_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                  cu_seqlens: torch.Tensor, context_lens: torch.Tensor, dv: int, scale: float, out: torch.Tensor,
                  config: dict[str, int] = PREFILL_MHA, tiles: torch.Tensor | None = None,
                  prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal expanded-form attention of the fresh chunks into `out` [T, N, dv], in place.

    kv [T, N, dn+dv] = bf(c_kv·W_kvbᵀ) of each token's own latent row; k_pe [T, dr]. Rows of chunks
    with a cached prefix are not written, except, with prefix = (pool, block_tables, prefix_cu, ws),
    those whose prefix `expand_prefix` wrote into ws. tiles: as in `latent_attention`, one row per token.
    """
    T, N, dn = q_nope.shape
    B, dr = context_lens.shape[0], q_pe.shape[-1]
    bm = config["BLOCK_M"]
    tile_cu = tiles if tiles is not None else varlen_layout(cu_seqlens, T).tile_offsets(1, bm)
    grid_m = -(-T // bm) + B
    if T == 0:
        return out
    pool, bt, pcu, ws = prefix if prefix is not None else (kv, cu_seqlens[None], cu_seqlens, kv)
    _mha_kernel[(grid_m, N)](
        q_nope, q_pe, kv, k_pe, cu_seqlens, context_lens, tile_cu, out, pool, bt, pcu, ws, scale=scale, B=B,
        s_nt=q_nope.stride(0), s_nh=q_nope.stride(1), s_pt=q_pe.stride(0), s_ph=q_pe.stride(1),
        s_kt=kv.stride(0), s_kh=kv.stride(1), s_et=k_pe.stride(0), s_ot=out.stride(0), s_oh=out.stride(1),
        s_blk=pool.stride(0), s_row=pool.stride(1), s_bt=bt.stride(0), s_wt=ws.stride(0), s_wh=ws.stride(1),
        DN=dn, DR=dr, DV=dv, BLOCK_DN=_block(dn), BLOCK_DR=_block(dr), BLOCK_DV=_block(dv),
        BLOCK_M=bm, BLOCK_N=config["BLOCK_N"], SEARCH=SEARCH, **_dot_modes(q_nope.dtype),
        PREFIX=prefix is not None, R=pool.shape[-1] - dr, BLOCK_SIZE=pool.shape[1] if prefix is not None else 1,
        num_warps=config["num_warps"], num_stages=config["num_stages"], enable_fp_fusion=FP_FUSION)
    return out


def expand_prefix(pool: torch.Tensor, block_tables: torch.Tensor, prefix_cu: torch.Tensor, kv_b: torch.Tensor,
                  ws: torch.Tensor, config: dict[str, int] = EXPAND) -> torch.Tensor:
    """ws[p] = bf(c_kv·W_kvbᵀ) [N, dn+dv] of each cached prefix row that `prefix_cu` [B+1] gives workspace
    row p (`VarlenLayout.expanded_prefix`), in place; rows past prefix_cu[B] are not written. ws:
    [capacity, N, dn+dv]; kv_b [N·(dn+dv), r]. No host sync: the grid covers the capacity."""
    cap, N, d = ws.shape
    r = kv_b.shape[1]
    if cap == 0:
        return ws
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    _expand_kernel[(triton.cdiv(cap, bm), triton.cdiv(N * d, bn))](
        pool, block_tables, prefix_cu, kv_b, ws, prefix_cu.shape[0] - 1, pool.stride(0), pool.stride(1),
        block_tables.stride(0), kv_b.stride(0), ws.stride(0), NOUT=N * d, R=r, BLOCK_SIZE=pool.shape[1],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(config["BLOCK_K"], _block(r)), SEARCH=SEARCH,
        F32_DOT=_dot_modes(ws.dtype)["F32_DOT"], INTERPRET=interpreting(), num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    return ws


# ---- the ops (mla_ref signatures) ---------------------------------------------------------------

def _absorb(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """q̂ = bf(q_nope·W_UK) per head: [T, N, r] (a view of an [N, T, r] bmm output)."""
    return torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)


def _unabsorb(o_hat: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """o = bf(ô·W_UV) per head, heads concatenated: [T, N·dv]. o_hat: [T, N, r]."""
    T, N, _ = o_hat.shape
    return torch.bmm(o_hat.transpose(0, 1), w_vc).transpose(0, 1).reshape(T, N * w_vc.shape[-1])


def _empty_heads_major(T: int, N: int, r: int, like: torch.Tensor) -> torch.Tensor:
    """[T, N, r] laid out [N, T, r], so the bmm that reads it per head needs no copy."""
    return torch.empty(N, T, r, dtype=like.dtype, device=like.device).transpose(0, 1)


def _check(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor) -> None:
    """Shapes shared by both ops; raises ValueError naming the argument, expected against got."""
    T, N, dn = q_nope.shape
    r, dv, dr = w_kc.shape[-1], w_vc.shape[-1], q_pe.shape[-1]
    want = {"q_pe": (q_pe, (T, N, dr)), "pool": (pool, (pool.shape[0], pool.shape[1], r + dr)),
            "w_kc": (w_kc, (N, dn, r)), "w_vc": (w_vc, (N, r, dv)),
            "block_tables": (block_tables, (context_lens.shape[0], block_tables.shape[-1]))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected int32 or int64, got {t.dtype}")


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed attention of one new token per sequence over its paged context (`mla_ref.mla_decode`).

    q_nope [B, N, dn], q_pe [B, N, dr]; pool [num_blocks, block_size, r+dr]; block_tables [B, W]
    int32; context_lens [B] (≥ 1; padding rows: a table of zeros reads the null block). Returns
    [B, N·dv]. No host sync: the split count depends on B, W and the device only.
    """
    return decode(q_nope, q_pe, pool, block_tables, context_lens, w_kc, w_vc, scale)


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float, *,
           config: dict | None = None, splits: int | None = None) -> torch.Tensor:
    """`mla_decode` with the tile configuration and split count open (benchmarks, tuning)."""
    _check(q_nope, q_pe, pool, block_tables, context_lens, w_kc, w_vc)
    B, N, _ = q_nope.shape
    r = w_kc.shape[-1]
    if context_lens.shape[0] != B:
        raise ValueError(f"context_lens: expected shape [{B}] (one per query row), got {list(context_lens.shape)}")
    if B == 0:
        return q_nope.new_empty(0, N * w_vc.shape[-1])
    config = config or decode_tiles(N, pool, r)
    if splits is None:
        splits = decode_splits(config, B, N, block_tables.shape[1] * pool.shape[1], q_nope.device)
    o_hat = _empty_heads_major(B, N, r, q_nope)
    latent_attention(_absorb(q_nope, w_kc), q_pe, pool, block_tables, context_lens, scale, o_hat,
                     cu_seqlens=None, splits=splits, config=config)
    return _unabsorb(o_hat, w_vc)


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, cu_seqlens: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, kv_b: torch.Tensor, w_kc: torch.Tensor,
                w_vc: torch.Tensor, scale: float, layout: VarlenLayout | None = None) -> torch.Tensor:
    """Causal attention of varlen prefill chunks over their paged context (`mla_ref.mla_prefill`).

    A chunk that is its sequence's whole context runs the expanded form over bf(c_kv·W_kvbᵀ) of its
    own rows, and so does a chunk of at least PREFIX_MIN_LEN tokens over its cached prefix, up-projected
    into a workspace while the step's prefixes fit PREFIX_TOKENS rows; other chunks with a cached
    prefix run the absorbed form over the pool. Both kernels run (the choice is per sequence and known
    only on the device; each skips the other's chunks) and the rows are selected.
    Memory is O(T·N·r): no [N, T, S] scores. Returns [T, N·dv]. `layout`: the step's token
    positions, latent rows and tile offsets (`varlen.varlen_layout`), built here when None.
    """
    _check(q_nope, q_pe, pool, block_tables, context_lens, w_kc, w_vc)
    T, N, dn = q_nope.shape
    B, r, dv = context_lens.shape[0], w_kc.shape[-1], w_vc.shape[-1]
    if tuple(cu_seqlens.shape) != (B + 1,):
        raise ValueError(f"cu_seqlens: expected shape [{B + 1}], got {list(cu_seqlens.shape)}")
    if tuple(kv_b.shape) != (N * (dn + dv), r):
        raise ValueError(f"kv_b: expected shape [{N * (dn + dv)}, {r}], got {list(kv_b.shape)}")
    _raise_if_layout(layout, T, B)
    if T == 0:
        return q_nope.new_empty(0, N * dv)
    dev, bs = q_nope.device, pool.shape[1]
    if layout is None or layout.latent_rows is None:
        layout = varlen_layout(cu_seqlens, T, context_lens, block_tables, bs)
    lat = pool.view(-1, pool.shape[-1])[layout.latent_rows]  # [T, r+dr]: each token's own row
    kv = (lat[:, :r] @ kv_b.t()).view(T, N, dn + dv)  # bf(c_kv·W_kvbᵀ)
    prefix_cu, mha_rows = layout.expanded_prefix(PREFIX_TOKENS, PREFIX_MIN_LEN)
    prefix = None
    if PREFIX_TOKENS:
        ws = torch.empty(PREFIX_TOKENS, N, dn + dv, dtype=q_nope.dtype, device=dev)
        ws = expand_prefix(pool, block_tables, prefix_cu, kv_b, ws)
        prefix = (pool, block_tables, prefix_cu, ws)
    o_mha = mha_attention(q_nope, q_pe, kv, lat[:, r:], cu_seqlens, context_lens, dv, scale,
                          q_nope.new_empty(T, N, dv), tiles=layout.tile_offsets(1, PREFILL_MHA["BLOCK_M"]),
                          prefix=prefix)
    bm = PREFILL_LATENT["BLOCK_M"]
    splits = num_splits(-(-T * N // bm) + B, block_tables.shape[1] * bs, dev)
    o_hat = latent_attention(_absorb(q_nope, w_kc), q_pe, pool, block_tables, context_lens, scale,
                             _empty_heads_major(T, N, r, q_nope), cu_seqlens=cu_seqlens, splits=splits,
                             config=PREFILL_LATENT, skip_fresh=True, tiles=layout.tile_offsets(N, bm),
                             prefix_cu=prefix_cu if prefix else None)
    # the expanded form where the chunk is fresh or its prefix was expanded
    return torch.where(mha_rows[:, None], o_mha.view(T, N * dv), _unabsorb(o_hat, w_vc))


def _raise_if_layout(layout: VarlenLayout | None, T: int, B: int) -> None:
    problem = layout_problem(layout, T, B)
    if problem:
        raise ValueError(problem)


# ---- verifiers: (ok, reason); a decline runs the torch reference -----------------------------------

def _supports(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, w_kc: torch.Tensor,
              w_vc: torch.Tensor, *more: torch.Tensor) -> tuple[bool, str]:
    if not interpreting() and not all(t.is_cuda for t in (q_nope, q_pe, pool, w_kc, w_vc, *more)):
        return False, "tensors not on a GPU (the kernels need CUDA, or TRITON_INTERPRET=1)"
    if q_nope.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {q_nope.dtype}: the kernels take bfloat16, float16, float32"
    for name, t in (("q_pe", q_pe), ("pool", pool), ("w_kc", w_kc), ("w_vc", w_vc)):
        if t.dtype != q_nope.dtype:
            return False, f"{name} is {t.dtype}, q_nope {q_nope.dtype}"
    if not pool.is_contiguous():
        return False, "latent pool is not contiguous"
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        return False, "q_nope / q_pe: last dim not contiguous"
    if w_kc.shape[-1] > MAX_RANK or q_pe.shape[-1] > MAX_ROPE:
        return False, f"kv_lora_rank {w_kc.shape[-1]} > {MAX_RANK} or rope dim {q_pe.shape[-1]} > {MAX_ROPE}"
    return True, ""


def mla_decode_supports(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                        scale: float) -> tuple[bool, str]:
    return _supports(q_nope, q_pe, pool, w_kc, w_vc, block_tables, context_lens)


def mla_prefill_supports(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, cu_seqlens: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, kv_b: torch.Tensor,
                         w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float,
                         layout: VarlenLayout | None = None) -> tuple[bool, str]:
    ok, why = _supports(q_nope, q_pe, pool, w_kc, w_vc, cu_seqlens, block_tables, context_lens, kv_b)
    if ok and kv_b.dtype != q_nope.dtype:
        return False, f"kv_b is {kv_b.dtype}, q_nope {q_nope.dtype}"
    if ok and max(q_nope.shape[-1], w_vc.shape[-1]) > MAX_HEAD_DIM:
        return False, f"head dims {q_nope.shape[-1]}/{w_vc.shape[-1]} > {MAX_HEAD_DIM}"
    return ok, why
