"""Triton kernels of the chunked KDA prefill (K3_LM §5.8): `kda_prefill`, mirroring `kda_ref.kda_prefill`.

The decode ops and the helpers shared with them live in `kernels/kda.py`; the conventions there hold
here (wrapper validates, kernel trusts; no host sync; int64 pool offsets; slot 0 never written).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from k3backend.kernels.kda import (
    _FLOATS, _INTERPRET, _acc, _acc_torch, _device_problem, _first, _kda_gate, _l2, _num_sms, _raise_if, _round,
    _shape_problem,
)
from k3backend.kernels.varlen import KDA_CHUNK, VarlenLayout, layout_problem, varlen_layout

# Three launches (fla's chunk_kda has the same split): `_kda_intra_kernel` per (chunk, head, 16-row block)
# builds the blocks of A_kk = −β_i Σ_d k_i k_j e^{Γ_i−Γ_j} and A_qk and the rows β e^Γ k, q e^Γ and
# k e^{Γ_last−Γ}; `_kda_solve_kernel` per (chunk, head) inverts I − A_kk blockwise and forms
# w = T(β e^Γ k), u = T(β v); `_kda_state_kernel` per (sequence, head, V-block) walks the sequence's
# chunks in order with the state in registers: v_new = u − wS, o = (q e^Γ)S + A_qk v_new,
# S ← e^{Γ_last} S + (k e^{Γ_last−Γ})ᵀ v_new. Every exponent is ≤ 0 (or bounded by the drop of Γ over
# 16 rows, checked per block, with an exact elementwise fallback), so no gate can overflow it.
# With a bf16 model (v bf16) the intermediates and the state's dot operands are bf16 and the A blocks
# tf32, as in fla / SGLang (§5.8 "Numerics"); with fp32 / fp64 everything stays in that dtype (fp32
# products as tf32x3).
# The intra kernel's re-reads of earlier blocks are cheaper than removing them: one program a (chunk,
# head) with [64, BKC] × [BKC, 16] products (each slice read once) ran 1.2-1.6× slower on an H100, its
# operands and reshapes going through shared memory (branch kda-intra-chunk).

BT: int = KDA_CHUNK  # chunk size (§5.8); the step's chunk table is built once, in kernels/varlen.py


@triton.jit
def _dot(a, b, DOT: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr, BITS: tl.constexpr):
    """a @ b with both operands rounded to DOT, accumulated in ACC. Under the interpreter (BITS) bf16
    operands multiply as fp32: its bf16 dot multiplies the raw bits (triton 3.9)."""
    a, b = _round(a, DOT, BITS), _round(b, DOT, BITS)
    if BITS and DOT == tl.bfloat16:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC, out_dtype=ACC)


@triton.jit
def _mm(a, b, ACC: tl.constexpr):
    """A small exact product (the inverse of I − A_kk): ACC operands, no tensor-core rounding."""
    return tl.dot(a.to(ACC), b.to(ACC), input_precision="ieee", out_dtype=ACC)


@triton.jit
def _gsum(g, t0, J, L, i_h, stride_g, o_k, m_k, K: tl.constexpr, ACC: tl.constexpr):
    """s_J: Σ of g over the valid rows of block J, for channels o_k."""
    r = J * 16 + tl.arange(0, 16)
    g_J = tl.load(g + (t0 + r)[:, None] * stride_g + i_h * K + o_k[None, :], mask=(r < L)[:, None] & m_k[None, :],
                  other=0).to(ACC)
    return tl.sum(g_J, axis=0)


@triton.jit
def _acc_block(acc0, acc1, acc2, acc3, x, J: tl.constexpr):
    """acc_J += x for a block index J known at compile time."""
    if J == 0:
        acc0 += x
    elif J == 1:
        acc1 += x
    elif J == 2:
        acc2 += x
    else:
        acc3 += x
    return acc0, acc1, acc2, acc3


@triton.jit
def _kda_intra_kernel(q, k, g, beta, chunk_seq, chunk_start, cu_seqlens, state_indices, Akk, Aqk, kb, qg, kg, gl,
                      stride_q, stride_k, stride_g, H: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr,
                      ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BITS: tl.constexpr):
    """Program (chunk c·4 + block I of 16 rows, head h): row block I of A_kk and A_qk (column blocks J ≤ I),
    and its rows of kb = β e^Γ k, qg = q e^Γ, kg = k e^{Γ_last−Γ}; block 0 also writes gl = e^{Γ_last}.
    Γ is relative to the chunk start and c_J is Γ at the end of block J−1 (c_0 = 0). Channels go in
    slices of BKC (A sums over them; everything else is per channel). A chunk's four blocks are adjacent
    programs, so their re-reads of each other's g and k hit L2 (H200, 96 heads at 8,192 tokens: 2,196 µs
    with the blocks as the grid's last axis, 1,958 so)."""
    i_c, i_s, i_h = (tl.program_id(0) // 4).to(tl.int64), tl.program_id(0) % 4, tl.program_id(1)
    seq = tl.load(chunk_seq + i_c)
    if seq < 0:
        return
    if tl.load(state_indices + seq) == 0:  # padding: the state kernel writes its zeros
        return
    t0 = tl.load(chunk_start + i_c)
    L = tl.minimum(tl.load(cu_seqlens + seq + 1).to(tl.int64) - t0, 64)
    if i_s * 16 >= L:
        return
    o16 = tl.arange(0, 16)
    r_I = i_s * 16 + o16
    m_rI = r_I < L
    b_I = tl.load(beta + (t0 + r_I) * H + i_h, mask=m_rI, other=0).to(ACC)
    kk0 = tl.zeros([16, 16], dtype=ACC)  # A_kk block (I, J), before the −β_i factor
    kk1, kk2, kk3 = kk0, kk0, kk0
    qk0, qk1, qk2, qk3 = kk0, kk0, kk0, kk0
    for k0 in range(0, K, BKC):
        o_k = k0 + tl.arange(0, BKC)
        m_k = o_k < K
        m_I = m_rI[:, None] & m_k[None, :]
        p_I = (t0 + r_I)[:, None]
        g_I = tl.load(g + p_I * stride_g + i_h * K + o_k[None, :], mask=m_I, other=0).to(ACC)
        k_I = tl.load(k + p_I * stride_k + i_h * K + o_k[None, :], mask=m_I, other=0).to(ACC)
        q_I = tl.load(q + p_I * stride_q + i_h * K + o_k[None, :], mask=m_I, other=0).to(ACC)
        cs_I = tl.cumsum(g_I, axis=0)  # Γ_i − c_I
        s_I = tl.sum(g_I, axis=0)
        ex_I = tl.exp(cs_I)  # ≤ 1
        lk, lq = k_I * ex_I, q_I * ex_I

        # blocks J < I, from J = I−1 down, with the reference point c_I between rows j and i:
        # e^{Γ_i−Γ_j} = e^{Γ_i−c_I}·e^{c_{J+1}−Γ_j}·e^{c_I−c_{J+1}}, every factor ≤ 1
        between = tl.zeros([BKC], dtype=ACC)  # c_I − c_{J+1}: Σ of s over blocks J+1..I−1 (≤ 0)
        for JB in tl.static_range(2, -1, -1):
            if JB < i_s:
                p_J = (t0 + JB * 16 + o16)[:, None]
                g_J = tl.load(g + p_J * stride_g + i_h * K + o_k[None, :], mask=m_k[None, :], other=0).to(ACC)
                k_J = tl.load(k + p_J * stride_k + i_h * K + o_k[None, :], mask=m_k[None, :], other=0).to(ACC)
                s_J = tl.sum(g_J, axis=0)
                rk = tl.trans(k_J * tl.exp(s_J[None, :] - tl.cumsum(g_J, axis=0) + between[None, :]))
                kk0, kk1, kk2, kk3 = _acc_block(kk0, kk1, kk2, kk3, _dot(lk, rk, ACC, PREC, ACC, BITS), JB)
                qk0, qk1, qk2, qk3 = _acc_block(qk0, qk1, qk2, qk3, _dot(lq, rk, ACC, PREC, ACC, BITS), JB)
                between += s_J
        c_I = between  # every block before I has been summed: c_I itself (no second pass over g)

        # block I itself: e^{Γ_i−c_I}·e^{c_I−Γ_j}, safe while Γ drops by < 80 over the block (always with
        # lb = −5); else exactly, column by column
        if tl.max(-s_I, axis=0) < 80.0:
            rk = tl.trans(k_I / ex_I)
            d_kk = _dot(lk, rk, ACC, PREC, ACC, BITS)
            d_qk = _dot(lq, rk, ACC, PREC, ACC, BITS)
        else:
            d_kk = tl.zeros([16, 16], dtype=ACC)
            d_qk = tl.zeros([16, 16], dtype=ACC)
            for j in range(16):
                row = (o16 == j)[:, None]
                k_j = tl.sum(tl.where(row, k_I, 0.0), axis=0)
                e = tl.exp(tl.minimum(cs_I - tl.sum(tl.where(row, cs_I, 0.0), axis=0)[None, :], 0.0))
                col = (o16 == j)[None, :]
                d_kk = tl.where(col, tl.sum(k_I * k_j[None, :] * e, axis=1)[:, None], d_kk)
                d_qk = tl.where(col, tl.sum(q_I * k_j[None, :] * e, axis=1)[:, None], d_qk)
        for jd in tl.static_range(4):
            if jd == i_s:
                kk0, kk1, kk2, kk3 = _acc_block(kk0, kk1, kk2, kk3, d_kk, jd)
                qk0, qk1, qk2, qk3 = _acc_block(qk0, qk1, qk2, qk3, d_qk, jd)

        # rows of block I: kb = β e^{c_I}(e^{Γ−c_I} k), qg = e^{c_I}(e^{Γ−c_I} q),
        # kg = k e^{(c_4−c_I)−(Γ−c_I)}
        tail = tl.zeros([BKC], dtype=ACC)  # Σ of s over the blocks after I
        for jt in range(i_s + 1, tl.cdiv(L, 16)):
            tail += _gsum(g, t0, jt, L, i_h, stride_g, o_k, m_k, K, ACC)
        e_c = tl.exp(c_I)[None, :]
        p_r = (t0 + r_I)[:, None] * (H * K) + i_h * K + o_k[None, :]
        tl.store(kb + p_r, _round(b_I[:, None] * lk * e_c, kb.dtype.element_ty, BITS), mask=m_I)
        tl.store(qg + p_r, _round(lq * e_c, qg.dtype.element_ty, BITS), mask=m_I)
        tl.store(kg + p_r, _round(k_I * tl.exp(s_I[None, :] - cs_I + tail[None, :]), kg.dtype.element_ty, BITS),
                 mask=m_I)
        if i_s == 0:
            tl.store(gl + (i_c * H + i_h) * K + o_k, tl.exp(s_I + tail), mask=m_k)

    # A_kk = −β_i·(…) strictly below the diagonal, A_qk on and below it
    strict = o16[:, None] > o16[None, :]
    for js in tl.static_range(4):
        if js <= i_s:
            if js == 0:
                a_kk, a_qk = kk0, qk0
            elif js == 1:
                a_kk, a_qk = kk1, qk1
            elif js == 2:
                a_kk, a_qk = kk2, qk2
            else:
                a_kk, a_qk = kk3, qk3
            c_J = js * 16 + o16
            p_A = (t0 + r_I)[:, None] * (H * 64) + i_h * 64 + c_J[None, :]
            if js == i_s:  # the diagonal block: strictly lower for A_kk, lower for A_qk
                m_A = m_rI[:, None] & (c_J < L)[None, :]
                a_kk = tl.where(strict, a_kk, 0.0)
                a_qk = tl.where(strict | (o16[:, None] == o16[None, :]), a_qk, 0.0)
            else:
                m_A = m_rI[:, None] & (c_J < 64)[None, :]
            tl.store(p_A + Akk, -b_I[:, None] * a_kk, mask=m_A)
            tl.store(p_A + Aqk, _round(a_qk, Aqk.dtype.element_ty, BITS), mask=m_A)


@triton.jit
def _a_block(t0, L, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr):
    """Offsets and mask of block (I, J) of a chunk's A_kk rows (T's after the solve)."""
    o16 = tl.arange(0, 16)
    rows, cols = I * 16 + o16, J * 16 + o16
    return (t0 + rows)[:, None] * (H * 64) + i_h * 64 + cols[None, :], (rows < L)[:, None] & (cols < L)[None, :]


@triton.jit
def _load_a(Akk, t0, L, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, ACC: tl.constexpr):
    p, m = _a_block(t0, L, i_h, I, J, H)
    return tl.load(Akk + p, mask=m, other=0).to(ACC)


@triton.jit
def _inv16(a, ACC: tl.constexpr):
    """(I − a)^{-1} for a strictly lower 16×16 a: (I + a)(I + a²)(I + a⁴)(I + a⁸), since a^16 = 0."""
    o16 = tl.arange(0, 16)
    eye = tl.where(o16[:, None] == o16[None, :], 1.0, 0.0).to(ACC)
    a2 = _mm(a, a, ACC)
    a4 = _mm(a2, a2, ACC)
    p = _mm(eye + a, eye + a2, ACC)
    p = _mm(p, eye + a4, ACC)
    return _mm(p, eye + _mm(a4, a4, ACC), ACC)


@triton.jit
def _store_t(Akk, t0, L, i_h, x, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr):
    """Block (I, J) of T over A_kk's, where `_load_a` read it."""
    p, m = _a_block(t0, L, i_h, I, J, H)
    tl.store(Akk + p, x, mask=m)


@triton.jit
def _store_wu(Akk, kb, v, beta, w, u, t0, L, i_h, stride_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BC: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BITS: tl.constexpr):
    """w = T kb and u = T (β v) for the chunk's rows, T read back whole ([64, 64], its blocks above the
    diagonal as zeros), BC columns at a time."""
    o64, o_c = tl.arange(0, 64), tl.arange(0, BC)
    m_r = o64 < L
    lower = (o64[None, :] // 16) <= (o64[:, None] // 16)  # block lower triangular (A_kk's other blocks: unset)
    p_r = (t0 + o64)[:, None]
    T = tl.load(Akk + p_r * (H * 64) + i_h * 64 + o64[None, :], mask=m_r[:, None] & m_r[None, :] & lower, other=0)
    b = tl.load(beta + (t0 + o64) * H + i_h, mask=m_r, other=0).to(ACC)
    for c0 in range(0, K, BC):
        m = m_r[:, None] & (c0 + o_c < K)[None, :]
        kb_c = tl.load(kb + p_r * (H * K) + i_h * K + c0 + o_c[None, :], mask=m, other=0)
        tl.store(w + p_r * (H * K) + i_h * K + c0 + o_c[None, :],
                 _round(_dot(T, kb_c, DOT, PREC, ACC, BITS), w.dtype.element_ty, BITS), mask=m)
    for c0 in range(0, V, BC):
        m = m_r[:, None] & (c0 + o_c < V)[None, :]
        v_c = tl.load(v + p_r * stride_v + i_h * V + c0 + o_c[None, :], mask=m, other=0).to(ACC)
        tl.store(u + p_r * (H * V) + i_h * V + c0 + o_c[None, :],
                 _round(_dot(T, b[:, None] * v_c, DOT, PREC, ACC, BITS), u.dtype.element_ty, BITS), mask=m)


@triton.jit
def _kda_solve_kernel(Akk, kb, v, beta, chunk_seq, chunk_start, cu_seqlens, state_indices, w, u, stride_v,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr,
                      DOT: tl.constexpr, PREC: tl.constexpr, BITS: tl.constexpr):
    """Program (chunk, head): T = (I − A_kk)^{-1} from its 16×16 blocks (block forward substitution),
    written over A_kk (nothing reads A_kk after this kernel), then w and u. T·diag(β) is folded into the
    operands (kb already carries β)."""
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    seq = tl.load(chunk_seq + i_c)
    if seq < 0:
        return
    if tl.load(state_indices + seq) == 0:  # padding
        return
    t0 = tl.load(chunk_start + i_c)
    L = tl.minimum(tl.load(cu_seqlens + seq + 1).to(tl.int64) - t0, 64)
    x00 = _inv16(_load_a(Akk, t0, L, i_h, 0, 0, H, ACC), ACC)
    x11 = _inv16(_load_a(Akk, t0, L, i_h, 1, 1, H, ACC), ACC)
    x22 = _inv16(_load_a(Akk, t0, L, i_h, 2, 2, H, ACC), ACC)
    x33 = _inv16(_load_a(Akk, t0, L, i_h, 3, 3, H, ACC), ACC)
    a10 = _load_a(Akk, t0, L, i_h, 1, 0, H, ACC)
    a21 = _load_a(Akk, t0, L, i_h, 2, 1, H, ACC)
    a32 = _load_a(Akk, t0, L, i_h, 3, 2, H, ACC)
    x10 = _mm(x11, _mm(a10, x00, ACC), ACC)  # T_IJ = T_II Σ_{J≤m<I} A_Im T_mJ
    x21 = _mm(x22, _mm(a21, x11, ACC), ACC)
    x32 = _mm(x33, _mm(a32, x22, ACC), ACC)
    a20 = _load_a(Akk, t0, L, i_h, 2, 0, H, ACC)
    a31 = _load_a(Akk, t0, L, i_h, 3, 1, H, ACC)
    x20 = _mm(x22, _mm(a20, x00, ACC) + _mm(a21, x10, ACC), ACC)
    x31 = _mm(x33, _mm(a31, x11, ACC) + _mm(a32, x21, ACC), ACC)
    a30 = _load_a(Akk, t0, L, i_h, 3, 0, H, ACC)
    x30 = _mm(x33, _mm(a30, x00, ACC) + _mm(a31, x10, ACC) + _mm(a32, x20, ACC), ACC)
    # T over A_kk's blocks, then back as one [64, 64] operand: four wide products instead of forty 16-row ones
    tl.debug_barrier()  # every thread has read its part of A_kk
    _store_t(Akk, t0, L, i_h, x00, 0, 0, H)
    _store_t(Akk, t0, L, i_h, x10, 1, 0, H)
    _store_t(Akk, t0, L, i_h, x11, 1, 1, H)
    _store_t(Akk, t0, L, i_h, x20, 2, 0, H)
    _store_t(Akk, t0, L, i_h, x21, 2, 1, H)
    _store_t(Akk, t0, L, i_h, x22, 2, 2, H)
    _store_t(Akk, t0, L, i_h, x30, 3, 0, H)
    _store_t(Akk, t0, L, i_h, x31, 3, 1, H)
    _store_t(Akk, t0, L, i_h, x32, 3, 2, H)
    _store_t(Akk, t0, L, i_h, x33, 3, 3, H)
    tl.debug_barrier()  # T is whole in memory before any thread reads it back
    _store_wu(Akk, kb, v, beta, w, u, t0, L, i_h, stride_v, H, K, V, BC, ACC, DOT, PREC, BITS)


@triton.jit
def _kda_state_kernel(w, u, qg, kg, Aqk, gl, S_pool, state_indices, has_initial_state, cu_seqlens, first_chunk,
                      chunk_snapshot, o, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, SNAP: tl.constexpr, TRANS: tl.constexpr, ACC: tl.constexpr,
                      DOT: tl.constexpr, PREC: tl.constexpr, BITS: tl.constexpr):
    """Program (V-block, sequence·head): the sequence's chunks in order, its K×BV state in registers.
    SNAP: after a chunk whose `chunk_snapshot` entry names a slot, the state is stored there too.
    TRANS: the walk transposed, Sᵀ [BV, BK] (`_state_step_t`): the same products with every register operand
    (the state, v_new) first, which wgmma takes from registers, and every loaded one second."""
    i_v, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = pid // H, pid % H
    slot = tl.load(state_indices + i_b).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_b).to(tl.int64), tl.load(cu_seqlens + i_b + 1).to(tl.int64)
    c0 = tl.load(first_chunk + i_b)
    o64, o_k, o_v = tl.arange(0, 64), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_S, m_S = _state_ptrs(S_pool, slot, i_h, o_k, o_v, m_k, m_v, H, K, V, TRANS)
    if slot == 0:  # padding (a graph's dummy places and padding sequence): zeros, nothing else
        for ic in range(0, tl.cdiv(eos - bos, 64)):
            p_v = (bos + ic * 64 + o64)[:, None] * (H * V) + i_h * V + o_v[None, :]
            tl.store(o + p_v, tl.zeros([64, BV], dtype=o.dtype.element_ty), mask=(bos + ic * 64 + o64 < eos)[:, None]
                     & m_v[None, :])
        return
    if TRANS:
        S = tl.zeros([BV, BK], dtype=ACC)
    else:
        S = tl.zeros([BK, BV], dtype=ACC)
    if tl.load(has_initial_state + i_b) != 0:
        S = tl.load(p_S, mask=m_S, other=0).to(ACC)
    causal = o64[:, None] >= o64[None, :]
    for ic in range(0, tl.cdiv(eos - bos, 64)):
        if TRANS:
            S = _state_step_t(S, w, u, qg, kg, Aqk, gl, o, bos + ic * 64, eos, c0 + ic, i_h, o64, o_k, o_v, m_k, m_v,
                              H, K, V, ACC, DOT, PREC, BITS)
        else:
            S = _state_step(S, w, u, qg, kg, Aqk, gl, o, bos + ic * 64, eos, c0 + ic, i_h, o64, o_k, o_v, m_k, m_v,
                            causal, H, K, V, ACC, DOT, PREC, BITS)
        if SNAP:
            dst = tl.load(chunk_snapshot + c0 + ic).to(tl.int64)
            if dst != 0:
                p_D, m_D = _state_ptrs(S_pool, dst, i_h, o_k, o_v, m_k, m_v, H, K, V, TRANS)
                tl.store(p_D, S.to(S_pool.dtype.element_ty), mask=m_D)
    p_S, m_S = _state_ptrs(S_pool, slot, i_h, o_k, o_v, m_k, m_v, H, K, V, TRANS)  # (not kept live over the walk)
    tl.store(p_S, S.to(S_pool.dtype.element_ty), mask=m_S)


@triton.jit
def _state_ptrs(S_pool, slot, i_h, o_k, o_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                TRANS: tl.constexpr):
    """Pointers and mask of head i_h's state block in pool slot `slot`: [BK, BV], or Sᵀ [BV, BK] (TRANS)."""
    base = S_pool + slot * (H * K * V) + i_h * (K * V)
    if TRANS:
        return base + o_v[:, None] + o_k[None, :] * V, m_v[:, None] & m_k[None, :]
    else:
        return base + o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def _state_step(S, w, u, qg, kg, Aqk, gl, o, t0, eos, c, i_h, o64, o_k, o_v, m_k, m_v, causal, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                BITS: tl.constexpr):
    """One chunk of the state walk (rows t0.., chunk c of the table): v_new = u − wS, o = (q e^Γ)S + A_qk v_new,
    S ← e^{Γ_last} S + (k e^{Γ_last−Γ})ᵀ v_new; returns S."""
    m_r = (t0 + o64 < eos)[:, None]
    p_k = (t0 + o64)[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_v = (t0 + o64)[:, None] * (H * V) + i_h * V + o_v[None, :]
    w_c = tl.load(w + p_k, mask=m_r & m_k[None, :], other=0)
    u_c = tl.load(u + p_v, mask=m_r & m_v[None, :], other=0).to(ACC)
    v_new = u_c - _dot(w_c, S, DOT, PREC, ACC, BITS)  # [64, BV]
    A = tl.load(Aqk + (t0 + o64)[:, None] * (H * 64) + i_h * 64 + o64[None, :], mask=m_r & causal, other=0)
    q_c = tl.load(qg + p_k, mask=m_r & m_k[None, :], other=0)
    o_c = _dot(q_c, S, DOT, PREC, ACC, BITS) + _dot(A, v_new, DOT, PREC, ACC, BITS)
    tl.store(o + p_v, o_c.to(o.dtype.element_ty), mask=m_r & m_v[None, :])
    k_c = tl.load(kg + p_k, mask=m_r & m_k[None, :], other=0)
    decay = tl.load(gl + (c * H + i_h) * K + o_k, mask=m_k, other=0).to(ACC)
    return S * decay[:, None] + _dot(tl.trans(k_c), v_new, DOT, PREC, ACC, BITS)


@triton.jit
def _state_step_t(S, w, u, qg, kg, Aqk, gl, o, t0, eos, c, i_h, o64, o_k, o_v, m_k, m_v, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                  BITS: tl.constexpr):
    """`_state_step` on Sᵀ [BV, BK]: v_newᵀ = uᵀ − Sᵀwᵀ, oᵀ = Sᵀ(q e^Γ)ᵀ + v_newᵀ A_qkᵀ,
    Sᵀ ← Sᵀ e^{Γ_last} + v_newᵀ (k e^{Γ_last−Γ}); returns Sᵀ."""
    m_r = (t0 + o64 < eos)[:, None]
    m_c = (t0 + o64 < eos)[None, :]  # the chunk's rows as columns
    p_k = (t0 + o64)[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_vt = (t0 + o64)[None, :] * (H * V) + i_h * V + o_v[:, None]  # [BV, 64]
    w_c = tl.load(w + p_k, mask=m_r & m_k[None, :], other=0)
    u_t = tl.load(u + p_vt, mask=m_c & m_v[:, None], other=0).to(ACC)
    v_new = u_t - _dot(S, tl.trans(w_c), DOT, PREC, ACC, BITS)  # [BV, 64]
    # A_qkᵀ [64 j, 64 i]: A_qk[i, j] for i >= j
    A_t = tl.load(Aqk + (t0 + o64)[None, :] * (H * 64) + i_h * 64 + o64[:, None],
                  mask=m_c & (o64[None, :] >= o64[:, None]), other=0)
    q_c = tl.load(qg + p_k, mask=m_r & m_k[None, :], other=0)
    o_t = _dot(S, tl.trans(q_c), DOT, PREC, ACC, BITS) + _dot(v_new, A_t, DOT, PREC, ACC, BITS)
    tl.store(o + p_vt, o_t.to(o.dtype.element_ty), mask=m_c & m_v[:, None])
    k_c = tl.load(kg + p_k, mask=m_r & m_k[None, :], other=0)
    decay = tl.load(gl + (c * H + i_h) * K + o_k, mask=m_k, other=0).to(ACC)
    return S * decay[None, :] + _dot(v_new, k_c, DOT, PREC, ACC, BITS)


@triton.jit(do_not_specialize=["T"])
def _kda_inputs_kernel(q, k, f, b, dt_bias, A_log, q_out, k_out, g_out, beta_out, T, s_q, s_k, s_f, s_b,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr,
                       USE_LOWER_BOUND: tl.constexpr, LOWER_BOUND: tl.constexpr, ACC: tl.constexpr):
    """Program (ROWS tokens, head h): their q̂, k̂, g and β, one read of each input row."""
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i_h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    m_t = t < T
    m = m_t[:, None] & (o_k < K)[None, :]
    t64 = t.to(tl.int64)
    col = i_h * K + o_k[None, :]
    out = t64[:, None] * (H * K) + col
    x = tl.load(q + t64[:, None] * s_q + col, mask=m, other=0).to(ACC)
    tl.store(q_out + out, _l2(x, 1e-6, ACC, 1) * tl.full([], SCALE, ACC), mask=m)
    x = tl.load(k + t64[:, None] * s_k + col, mask=m, other=0).to(ACC)
    tl.store(k_out + out, _l2(x, 1e-6, ACC, 1), mask=m)
    bias = tl.load(dt_bias + col, mask=(o_k < K)[None, :], other=0)
    g = _kda_gate(tl.load(f + t64[:, None] * s_f + col, mask=m, other=0), bias, tl.load(A_log + i_h),
                  USE_LOWER_BOUND, LOWER_BOUND, ACC)
    tl.store(g_out + out, g, mask=m)
    tl.store(beta_out + t64 * H + i_h, tl.sigmoid(tl.load(b + t64 * s_b + i_h, mask=m_t, other=0).to(ACC)), mask=m_t)


def _inputs_problem(q, k, f, b, dt_bias, A_log) -> str:
    if q.dim() != 3 or b.dim() != 2:
        return f"expected q, k, f [T, H, K] and b [T, H]; got q {list(q.shape)}, b {list(b.shape)}"
    T, H, K = q.shape
    rows = [n for n, t in (("q", q), ("k", k), ("f", f)) if t.stride(-1) != 1 or t.stride(-2) != K]
    return _first(
        _shape_problem("k", k, (T, H, K), (q.dtype,)),
        _shape_problem("f", f, (T, H, K), _FLOATS),
        _shape_problem("b", b, (T, H), _FLOATS),
        _shape_problem("dt_bias", dt_bias.reshape(-1), (H * K,), _FLOATS),
        _shape_problem("A_log", A_log, (H,), _FLOATS),
        "" if _acc_torch(q.dtype) == _acc_torch(dt_bias.dtype) else
        f"q {q.dtype} and dt_bias {dt_bias.dtype} have different accumulation dtypes",
        "" if K <= 256 else f"head dim K = {K}: more than 256",
        "" if not rows and b.stride(-1) == 1 else "q, k, f need contiguous [H, K] rows and b contiguous [H]",
        _device_problem(dt_bias, A_log) or _device_problem(q, k, f, b, dt_bias, contiguous=False),
    )


def kda_prefill_inputs_supports(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                                dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None,
                                scale: float) -> tuple[bool, str]:
    problem = _inputs_problem(q, k, f, b, dt_bias, A_log)
    return not problem, problem


def kda_prefill_inputs(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                       A_log: torch.Tensor, lower_bound: float | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kda_ref.kda_prefill_inputs` in one launch instead of about ten elementwise ones: the inputs may
    be row-strided slices (of the conv output, of the input GEMM's rows)."""
    _raise_if(_inputs_problem(q, k, f, b, dt_bias, A_log), "kda_prefill_inputs")
    T, H, K = q.shape
    acc = _acc_torch(dt_bias.dtype)
    q_out, k_out, g = (torch.empty(T, H, K, dtype=acc, device=q.device) for _ in range(3))
    beta = torch.empty(T, H, dtype=acc, device=q.device)
    if T:
        ROWS = 16
        _kda_inputs_kernel[(triton.cdiv(T, ROWS), H)](
            q, k, f, b, dt_bias, A_log, q_out, k_out, g, beta, T, q.stride(0), k.stride(0), f.stride(0), b.stride(0),
            H=H, K=K, BK=triton.next_power_of_2(K), ROWS=ROWS, SCALE=scale, USE_LOWER_BOUND=lower_bound is not None,
            LOWER_BOUND=0.0 if lower_bound is None else lower_bound, ACC=tl.float64 if acc == torch.float64
            else tl.float32, num_warps=4)
    return q_out, k_out, g, beta


def prefill_rule(K: int, V: int, B: int, H: int, NC: int, sms: int) -> dict[str, dict[str, int]]:
    """Launch keywords of the intra, solve and state kernels, a pure function of the shape (B: the
    sequences that do work, a graph's padding sequence left out; NC: the chunk table's length).
    Measured on the H200 (`bench/kernels_kda.py --tiles`, `small`, H 16, K = V = 128, µs):
    - intra BKC 64 (4,096 tokens 360 → 267 against 32; 32 again on 1 warp, below) and solve BC 64 (104 → 80);
    - both on 2 warps (the intra kernel since on 1, next bullet) from 1,024 chunk·heads (≥ 8 programs
      an SM), 4 below: 4,096 tokens intra 268 → 188, solve 82 → 64, H 96 at 8,192 tokens 3,127 → 2,202
      and 949 → 725; at one 256-token prompt 2 warps lose (21.5 → 23.9, 13.3 → 16.3), at 4 × 256 they
      tie for intra and lose for solve;
    - from 1,024 chunk·heads the intra kernel on 1 warp with BKC 32 (H100, its blocks adjacent in the grid:
      4,096 tokens 172.6 → 159.3, H 96 at 8,192 tokens 2,005.5 → 1,826.5, though it spills 128 B);
    - state, by where its programs (V blocks x sequences x heads) fall against the SMs:
      * long sequences (64 chunks or more) whose V blocks of 16, else 32, fit one wave: the transposed walk (TRANS,
        `_state_step_t`) on 8 warps in 3 stages (H100, 2026-12-07, against the plain walk on 4 warps, µs: H 12 at
        1 × 4,096 206 → 153, 1 × 8,192 401 → 299; H 16 182 → 159, 353 → 309; 2 × 4,096 in blocks of 32, H 12
        213 → 174, H 16 208 → 178; the plain walk on 8 warps lay between, 353 / 354 at 1 × 8,192). At 1,024-2,048
        tokens 8 warps lost or tied (H 12 1 × 1,024 38 → 46).
      * else within one wave: the plain walk in V blocks of 64 once B·H ≥ 64 (half the programs, each a wider
        MMA), else 32, 3 stages (4 × 1,024 tokens 70 → 64 against 1) on 4 warps. A mixed graph (4 chunk places and
        the padding sequence) counts B = 4 (µs, 1 × 256 real chunk 13.9 against 15.4 when the padding counted, 1 ×
        1,024 42.1 / 52.8, 2 × 512 23.7 / 31.4).
      * past one wave: the transposed walk in V blocks of 64, 2 stages, 4 warps: 104 KB of shared memory and 244
        registers, so 2 programs an SM hide the latency (the plain walk's 2 stages take 136 KB, one). Against the
        plain 1-stage launch (H100), µs: H 96 at 1 × 8,192 tokens 760 → 713 (and 727 → 700, 744 → 718), 4 × 2,048
        673 → 629; H 12 at 4 × 2,048 166 → 136; H 16 at 16 × 512 121 → 116, at 16 × 32 18.3 (the plain walk in 1
        / 2 stages 19.0 / 24.1)."""
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    small = max(BK, BV) <= 32
    big = NC * H >= 1024
    bv = min(64 if B * H >= 64 else 32, BV)
    wave = triton.cdiv(V, bv) * B * H <= sms
    narrow = next((b for b in (16, 32) if b <= BV and triton.cdiv(V, b) * B * H <= sms), 0) if NC >= 64 else 0
    if narrow:  # long sequences, one wave of narrow V blocks
        state = dict(BV=narrow, num_warps=8, num_stages=3, TRANS=True)
    elif wave:
        state = dict(BV=bv, num_warps=4, num_stages=3, TRANS=False)
    else:
        state = dict(BV=min(64, BV), num_warps=4, num_stages=2, TRANS=True)
    return {"intra": dict(BKC=16 if BK <= 32 else 32 if big else 64, num_warps=1 if big else 4),
            "solve": dict(BC=16 if small else 64, num_warps=2 if big else 4), "state": state}


def _prefill_problem(q, k, v, g, beta, S_pool, cu_seqlens, state_indices, has_initial_state, layout=None) -> str:
    if q.dim() != 3 or v.dim() != 3 or S_pool.dim() != 4:
        return (f"expected q [T, H, K], v [T, H, V], S_pool [N, H, K, V]; got q {list(q.shape)}, "
                f"v {list(v.shape)}, S_pool {list(S_pool.shape)}")
    T, H, K = q.shape
    V, B = v.shape[-1], state_indices.shape[0]
    acc = S_pool.dtype
    inner = [t for t in (q, k, v, g) if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]]
    return _first(
        _shape_problem("S_pool", S_pool, (S_pool.shape[0], H, K, V), (torch.float32, torch.float64)),
        _shape_problem("q", q, (T, H, K), (acc,)),
        _shape_problem("k", k, (T, H, K), (acc,)),
        _shape_problem("g", g, (T, H, K), (acc,)),
        _shape_problem("v", v, (T, H, V), _FLOATS),
        _shape_problem("beta", beta, (T, H), (acc,)),
        _shape_problem("cu_seqlens", cu_seqlens, (B + 1,), (torch.int32, torch.int64)),
        _shape_problem("state_indices", state_indices, (B,), (torch.int32, torch.int64)),
        _shape_problem("has_initial_state", has_initial_state, (B,), (torch.bool,)),
        "" if K <= 128 and V <= 128 else f"head dims K = {K}, V = {V}: more than 128",
        layout_problem(layout, T, B),
        "" if not inner else "q, k, v, g need contiguous [H, D] rows (got strides "
        + ", ".join(str(t.stride()) for t in inner) + ")",
        _device_problem(beta, S_pool, cu_seqlens, state_indices, has_initial_state)
        or _device_problem(q, k, v, g, beta, contiguous=False),
    )


def kda_prefill_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         S_pool: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                         has_initial_state: torch.Tensor, layout: VarlenLayout | None = None) -> tuple[bool, str]:
    problem = _prefill_problem(q, k, v, g, beta, S_pool, cu_seqlens, state_indices, has_initial_state, layout)
    return not problem, problem


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S_pool: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, layout: VarlenLayout | None = None) -> torch.Tensor:
    """`kda_ref.kda_prefill`: chunks of 64 (§5.8), three launches, no host sync. q, k, g and v may have
    a token stride (v is a view of the conv output); their [H, D] rows must be contiguous. `layout`:
    the step's chunk table (`varlen.varlen_layout` of cu_seqlens), built here when None; its prefix
    snapshots are stored as the walk passes them. A sequence on the null slot 0 is padding (a
    graph's dummy chunk places and padding sequence): its rows of o are zero and nothing else of it
    is computed."""
    _raise_if(_prefill_problem(q, k, v, g, beta, S_pool, cu_seqlens, state_indices, has_initial_state, layout),
              "kda_prefill")
    o, launches = _prefill_launches(q, k, v, g, beta, S_pool, cu_seqlens, state_indices, has_initial_state, layout)
    for launch in launches:
        launch.run()
    return o


class _Launch(NamedTuple):
    """One of kda_prefill's kernels over its buffers: `run()` launches it with the keywords `knobs`
    (tile, num_warps, num_stages) and writes `writes`."""

    name: str  # "intra", "solve", "state"
    run: Callable[[], object]
    knobs: dict[str, Any]
    writes: tuple[torch.Tensor, ...]


def _prefill_launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      S_pool: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                      has_initial_state: torch.Tensor, layout: VarlenLayout | None = None,
                      knobs: dict[str, dict[str, Any]] | None = None) -> tuple[torch.Tensor, list[_Launch]]:
    """kda_prefill's output and its three launches in order over fresh intermediates, not yet run (none
    when there is nothing to do); the arguments as kda_prefill's, unchecked. `knobs`: by kernel name,
    launch keywords that replace the rule's (`prefill_rule`): what
    bench/kernels_kda.py --tiles times, each kernel alone."""
    T, H, K = q.shape
    V, B = v.shape[-1], state_indices.shape[0]
    dev, acc = q.device, S_pool.dtype
    o = torch.empty(T, H, V, dtype=acc, device=dev)
    if T == 0 or B == 0:
        return o, []
    low = v.dtype in (torch.bfloat16, torch.float16)
    mid = torch.bfloat16 if low else acc  # dtype of the intermediates and of the state's dot operands
    ACC, DOT = _acc(S_pool), tl.bfloat16 if low else _acc(S_pool)
    # tensor-core precision of the big products: tf32 beside bf16 operands (fla's), tf32x3 for an fp32
    # model (ieee fp32 dots spill badly on sm_90), exact for fp64; the 16×16 inverse is always exact
    PREC = "tf32" if low else "tf32x3" if acc == torch.float32 else "ieee"
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    lay = layout if layout is not None else varlen_layout(cu_seqlens, T)
    chunk_seq, chunk_start, first_chunk, NC = lay.chunk_seq, lay.chunk_start, lay.first_chunk, lay.num_chunks
    Akk = torch.empty(T, H, BT, dtype=acc, device=dev)
    Aqk = torch.empty(T, H, BT, dtype=mid, device=dev)
    kb, qg, kg, w = (torch.empty(T, H, K, dtype=mid, device=dev) for _ in range(4))
    u = torch.empty(T, H, V, dtype=mid, device=dev)
    gl = torch.empty(NC, H, K, dtype=acc, device=dev)
    flags = dict(ACC=ACC, DOT=DOT, PREC=PREC, BITS=_INTERPRET)
    kn = prefill_rule(K, V, B - lay.padding_last, H, NC, _num_sms(dev))  # the padding does no work
    for name, over in (knobs or {}).items():
        kn[name] = {**kn[name], **over}
    BVS = kn["state"]["BV"]
    intra = lambda: _kda_intra_kernel[(NC * (BT // 16), H)](  # noqa: E731
        q=q, k=k, g=g, beta=beta, chunk_seq=chunk_seq, chunk_start=chunk_start, cu_seqlens=cu_seqlens,
        state_indices=state_indices, Akk=Akk, Aqk=Aqk, kb=kb, qg=qg, kg=kg, gl=gl, stride_q=q.stride(0),
        stride_k=k.stride(0), stride_g=g.stride(0),
        H=H, K=K, **kn["intra"], **flags)
    solve = lambda: _kda_solve_kernel[(NC, H)](  # noqa: E731
        Akk=Akk, kb=kb, v=v, beta=beta, chunk_seq=chunk_seq, chunk_start=chunk_start, cu_seqlens=cu_seqlens,
        state_indices=state_indices, w=w, u=u, stride_v=v.stride(0), H=H, K=K, V=V, **kn["solve"], **flags)
    state = lambda: _kda_state_kernel[(triton.cdiv(V, BVS), B * H)](  # noqa: E731
        w=w, u=u, qg=qg, kg=kg, Aqk=Aqk, gl=gl, S_pool=S_pool, state_indices=state_indices,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, first_chunk=first_chunk,
        chunk_snapshot=lay.chunk_snapshot if lay.chunk_snapshot is not None else first_chunk, o=o,
        H=H, K=K, V=V, BK=BK, SNAP=lay.chunk_snapshot is not None, **kn["state"], **flags)
    return o, [_Launch("intra", intra, kn["intra"], (Akk, Aqk, kb, qg, kg, gl)),
               _Launch("solve", solve, kn["solve"], (w, u, Akk)), _Launch("state", state, kn["state"], (o, S_pool))]
