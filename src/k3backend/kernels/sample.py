"""Triton draw for the batched sampler: `race_draw` (kernels/sample_ref.py) in one pass over probs.

The reference materialises the [S, V] float64 uniforms of the splitmix64 counter hash (a dozen
int64 passes over the vocabulary) before its argmax; here each program hashes its block of token
ids in registers (uint64 arithmetic, the same bits), forms p / -log u in float32 to find its
block's winner, and in float64 only for that id (or for every id of a block where float32 cannot
tell: near ties, tiny ratios); a second, tiny argmax over the blocks' float64 maxima picks the
token. Ties go to the lowest id, as torch.argmax's do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from k3backend.kernels.moe import _GPU, _div, _exp
from k3backend.kernels.norm import interpreting

BLOCK = 2048  # token ids per program: 80 programs per row at V = 163,840
DRAW_WARPS = 4
U_SCALE = tl.constexpr(1.1102230246251565e-16)  # 2**-53: u = (m + 0.5) * U_SCALE
# The draw's float32 screen trusts a block's largest ratio where it beats the next by this factor
# (its error is below 2**-20) and is at least SCREEN_FLOOR (2**-120: ratios that are normal float32)
SCREEN_MARGIN = tl.constexpr(1.0000152587890625)  # 1 + 2**-16
SCREEN_FLOOR = tl.constexpr(7.52316384526264e-37)
SOFTMAX_BLOCK = 4096  # logits per program of the softmax's two passes


@triton.jit
def _uniform_bits(seed, step, col):
    """m of `sample_ref.counter_uniform` (u = (m + 0.5) * 2**-53): the splitmix64 hash, uint64 bits as there."""
    z = (seed + step * 0x632BE59BD9B4E019 + col.to(tl.uint64) * 0x9E3779B97F4A7C15) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z >> 11


@triton.jit
def _ratio(p, m):
    """p / -log u in float64, as the reference forms it."""
    return p.to(tl.float64) / -tl.log((m.to(tl.float64) + 0.5) * U_SCALE)


@triton.jit
def _ratio32(p, m):
    """_ratio in float32, within 2**-20 of it (relative) wherever it is a normal float32: -log u from u
    below 1/2, and above from 1 - u as float64 rounds u (m + 0.5 rounds to even there), kept exact by
    a Fast2Sum term, so u near 1 (-log u down to 2**-53) loses no digits."""
    lo = m < (1 << 52)
    w = ((1 << 53) - m - (m & 1)).to(tl.float32) * U_SCALE  # 1 - u, for m >= 2**52
    v = tl.where(lo, (m.to(tl.float32) + 0.5) * U_SCALE, 1.0 - w)
    d = tl.where(lo, 0.0, -w - (v - 1.0))  # (1 - w) - v, exact
    return p / -(tl.log(v) + d / v)


@triton.jit
def _race_kernel(p_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr, V, s_p, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    col = blk * BLOCK + i
    ok = col < V
    row = p_ptr + r.to(tl.int64) * s_p
    p = tl.load(row + col, mask=ok, other=0.0)
    seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + r).to(tl.uint64, bitcast=True)
    m = _uniform_bits(seed, step, col)
    # Screen in float32 (half the instructions of float64's log and division): where the block's
    # largest ratio beats every other by more than the screen's error, it is the float64 winner, and
    # only its own ratio is formed in float64. Blocks without one (near ties, ratios below float32's
    # normal range, NaN) take every ratio in float64; a block of zeros has its first id at 0.
    r32 = tl.where(ok, _ratio32(p, m), -1.0)
    best = tl.argmax(r32, axis=0, tie_break_left=True)
    top = tl.max(r32, axis=0)
    second = tl.max(tl.where(i == best, -1.0, r32), axis=0)
    clear = (top > second * SCREEN_MARGIN) & (top >= SCREEN_FLOOR) & (tl.sum((r32 != r32).to(tl.int32), 0) == 0)
    if tl.max(p, axis=0) == 0.0:
        val = tl.full((), 0.0, tl.float64)
        best = 0
    elif clear:
        val = _ratio(tl.load(row + blk * BLOCK + best), _uniform_bits(seed, step, blk * BLOCK + best))
    else:
        ratio = tl.where(ok, _ratio(p, m), -1.0)
        best = tl.argmax(ratio, axis=0, tie_break_left=True)
        val = tl.max(ratio, axis=0)
    tl.store(val_ptr + r * NB + blk, val)
    tl.store(idx_ptr + r * NB + blk, (blk * BLOCK + best).to(tl.int64))


def race_draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """ids [S] int64: argmax_i probs[s, i] / -log u[s, i] (`sample_ref.race_draw`)."""
    S, V = probs.shape
    if S == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    nb = triton.cdiv(V, BLOCK)
    vals = torch.empty(S, nb, dtype=torch.float64, device=probs.device)
    idx = torch.empty(S, nb, dtype=torch.int64, device=probs.device)
    _race_kernel[(S, nb)](probs, seeds, steps, vals, idx, V, probs.stride(0), nb, BLOCK=BLOCK, num_warps=DRAW_WARPS)
    return idx.gather(1, vals.argmax(1, keepdim=True))[:, 0]


# ---- softmax with temperature (`sample_ref.softmax_rows`) --------------------------------------------
#
# Two passes over the logits as they come (bf16 from the model: no float32 copy of them, no separate
# division): per block of a row its maximum m_b of z = x / t and Σ exp(z − m_b); then each program
# combines its row's blocks, M = max m_b and Σ = Σ_b s_b·exp(m_b − M), and writes exp(z − M) / Σ.
# Division and exp are torch's CUDA ones (IEEE division, libdevice expf); only the order of the sum
# differs from torch.softmax's, a few ulps. A row of -inf only gives NaN, as torch's does.

@triton.jit(do_not_specialize=["S"])
def _softmax_stats_kernel(x_ptr, t_ptr, stats_ptr, V, s_x, S, NB, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """stats[0, r, blk] = max z and stats[1, r, blk] = Σ exp(z − max z) over the block's logits."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * s_x + col, mask=col < V, other=float("-inf")).to(tl.float32)
    z = _div(x, tl.load(t_ptr + r), GPU)
    m = tl.max(z, 0)
    tl.store(stats_ptr + r * NB + blk, m)
    tl.store(stats_ptr + (S + r) * NB + blk, tl.sum(tl.where(z == float("-inf"), 0.0, _exp(z - m, GPU)), 0))


@triton.jit(do_not_specialize=["S"])
def _softmax_write_kernel(x_ptr, t_ptr, stats_ptr, out_ptr, V, s_x, s_o, S, NB, BLOCK: tl.constexpr,
                          NB_P2: tl.constexpr, GPU: tl.constexpr):
    """out[r, block] = exp(z − M) / Σ with the row's M and Σ from every block's stats."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    b = tl.arange(0, NB_P2)
    m_b = tl.load(stats_ptr + r * NB + b, mask=b < NB, other=float("-inf"))
    s_b = tl.load(stats_ptr + (S + r) * NB + b, mask=b < NB, other=0.0)
    m = tl.max(m_b, 0)
    total = tl.sum(tl.where(m_b == float("-inf"), 0.0, s_b * _exp(m_b - m, GPU)), 0)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * s_x + col, mask=col < V, other=0.0).to(tl.float32)
    p = _div(_exp(_div(x, tl.load(t_ptr + r), GPU) - m, GPU), total, GPU)
    tl.store(out_ptr + r.to(tl.int64) * s_o + col, p, mask=col < V)


def softmax_rows(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`sample_ref.softmax_rows` in two launches of S × ⌈V / SOFTMAX_BLOCK⌉ programs."""
    S, V = logits.shape
    out = torch.empty(S, V, dtype=torch.float32, device=logits.device)
    if S == 0 or V == 0:
        return out
    nb = triton.cdiv(V, SOFTMAX_BLOCK)
    stats = torch.empty(2, S, nb, dtype=torch.float32, device=logits.device)
    _softmax_stats_kernel[(S, nb)](logits, temperature, stats, V, logits.stride(0), S, nb, BLOCK=SOFTMAX_BLOCK,
                                   GPU=_GPU, num_warps=4)
    _softmax_write_kernel[(S, nb)](logits, temperature, stats, out, V, logits.stride(0), out.stride(0), S, nb,
                                   BLOCK=SOFTMAX_BLOCK, NB_P2=triton.next_power_of_2(nb), GPU=_GPU, num_warps=4)
    return out


def _off_gpu(*tensors: torch.Tensor) -> str:
    """Why the sampler's kernels cannot run where these tensors are ('' on a GPU, or under the interpreter)."""
    if not interpreting() and not all(t.is_cuda for t in tensors):
        return "tensors not on a GPU (the kernel needs CUDA, or TRITON_INTERPRET=1)"
    return ""


def softmax_rows_supports(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[bool, str]:
    if reason := _off_gpu(logits, temperature):
        return False, reason
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
            or logits.stride(-1) != 1:
        return False, f"logits must be a bf16, fp16 or fp32 [S, V] tensor with contiguous rows, got {logits.dtype} " \
                      f"{list(logits.shape)}"
    if temperature.shape != logits.shape[:1] or temperature.dtype != torch.float32 or temperature.stride(0) != 1:
        return False, f"temperature must be a contiguous float32 [S], got {temperature.dtype} {list(temperature.shape)}"
    return True, ""


def _declines(*tensors: torch.Tensor) -> str:
    """Why the sampler's kernels cannot take these tensors, the first being the probabilities ('' if they can)."""
    probs = tensors[0]
    if reason := _off_gpu(*tensors):
        return reason
    if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(-1) != 1:
        return f"probs must be a float32 [S, V] tensor with contiguous rows, got {probs.dtype} {list(probs.shape)}"
    return ""


def race_draw_supports(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> tuple[bool, str]:
    if reason := _declines(probs, seeds, steps):
        return False, reason
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        return False, f"seeds / steps must be int64, got {seeds.dtype} / {steps.dtype}"
    return True, ""


# ---- top-k / top-p cut without a sort (`sample_ref.top_k_top_p`) ------------------------------------
#
# A row's cut is a threshold v (a probability's float32 bits) and the number m of ids equal to v it
# keeps, lowest ids first. v is found a few bits at a time from the top: a pass adds up, per bucket
# of its bits, the ids and the mass (`mass_units`: integers in float64, so the atomic sums are exact
# in any order) of the ids that share the bits decided so far; the row's last program to finish
# (`_choose`) keeps the highest bucket whose ids, with all above it, still reach the target. Pass 1
# and later also list those ids' values, so passes 2 and on read only the ids still in play. Top-k
# searches by count, top-p by mass; a row with both first finds its top-k threshold (phase A), for
# the top-k's mass that top-p renormalises by.
#
# Row state, float64 [2 phases, S, 8]: the bits decided, the mass and count above them, the count of
# the last bucket chosen, phase B's mass target (phase A leaves it there), and phase B's cut in slots 5
# (threshold, -1 keeps every id) and 7 (ids equal to it kept). Kernels take the row count and pass
# index unspecialised: a batch of a new size must not compile anew.

NBITS = 30  # a probability in [0, 1] has float32 bits below 2**30 (1.0 is 0x3f800000)
# Bits each pass decides (2**w buckets). On the H200 at 64 rows ten 3-bit passes took 0.29-0.65 ms of
# device time; schedules with 6-8 bit passes once the lists shrink took up to 4x that on flat rows.
WIDTHS = (3,) * 10
CUT_BLOCK = 4096  # ids per program of a pass
CUT_TILE = 2048  # [buckets, ids] sums kept over a pass (16 a thread at 4 warps); 4096 spills
CUT_WARPS = 4
# The chunk loop's loads this many deep: a pass is bound by load latency, not by its instructions. On an
# H100 at 64 rows, top-p 0.9, the whole cut: peaky 306 -> 308 (1 stage) -> 288 us, flat 537 -> 461 -> 409
# (main's [ids, buckets] tiles at 3 stages: 342 / 578; blocks of 1,024 ids 549 / 661; 8 warps 367 / 503).
CUT_STAGES = 3
LIST_CHUNK = 1024  # ids per step of a pass's list write
WRITE_CHUNK = 1024  # ids per step of the tie count and the write
MASS_SCALE = tl.constexpr(4294967296.0)  # 2**sample_ref.MASS_BITS


@triton.jit
def _units(bits):
    """`sample_ref.mass_units` of float32 bits: an exact integer in float64."""
    return tl.floor(bits.to(tl.float32, bitcast=True).to(tl.float64) * MASS_SCALE)


@triton.jit
def _choose(tot, st, kp_ptr, r, i, S, V, PH: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
            RAN_A: tl.constexpr, P: tl.constexpr, D: tl.constexpr, FMAX: tl.constexpr):
    """Pass i's bucket for row r, from its totals, into the row state; after the last pass, the cut."""
    F: tl.constexpr = 1 << D
    f = tl.arange(0, F)
    at = tot + ((PH * P + i) * S + r) * 2 * FMAX
    m = tl.load(at + f, volatile=True)
    c = tl.load(at + FMAX + f, volatile=True)
    k = tl.minimum(tl.load(kp_ptr + r), V)
    top_p = tl.load(kp_ptr + S + r)
    row = st + (PH * S + r) * 8
    if (PH == 1) & FIRST:  # every id is in the first pass: the mass to renormalise by, unless top-k's
        target = tl.ceil(top_p * tl.sum(m, 0))
        if RAN_A:
            target = tl.where(k < V, tl.load(st + r * 8 + 4), target)
        tl.store(row + 4, target)
    target = tl.load(row + 4)
    # no mass to reach (every probability kept is below 2**-32, so none from a softmax): like the
    # reference, the top id alone, found by count
    massless = (PH == 1) & (top_p < 1.0) & (target <= 0)
    by_count = (PH == 0) | (top_p >= 1.0) | massless
    k = tl.where(massless, 1, k)
    above_m = tl.load(row + 1)
    above_c = tl.load(row + 2)
    reach = tl.where(by_count, above_c + tl.sum(c, 0) - tl.cumsum(c, 0) + c >= k,
                     above_m + tl.sum(m, 0) - tl.cumsum(m, 0) + m >= target)
    d = tl.max(tl.where(reach, f, 0), 0)
    above_m += tl.sum(tl.where(f > d, m, 0.0), 0)
    above_c += tl.sum(tl.where(f > d, c, 0.0), 0)
    v = (tl.load(row).to(tl.int32) << D) | d
    tl.store(row, v.to(tl.float64))
    tl.store(row + 1, above_m)
    tl.store(row + 2, above_c)
    tl.store(row + 3, tl.sum(tl.where(f == d, c, 0.0), 0))
    if LAST:
        if PH == 0:  # the top-k's mass: above its threshold, and the k - above_c ids equal to it it keeps
            tl.store(row + 4, tl.ceil(top_p * (above_m + (k - above_c) * _units(v))))
        else:  # target <= the mass of the ids >= v (of the top-k's), so kept never exceeds the ids equal to v it has
            q = tl.maximum(_units(v), 1.0).to(tl.int64)
            kept = ((target - above_m).to(tl.int64) + q - 1) // q
            kept = tl.where(by_count, (k - above_c).to(tl.int64), kept)
            tl.store(row + 5, tl.where(by_count & (k >= V), -1, v).to(tl.float64))
            tl.store(row + 7, kept.to(tl.float64))


@triton.jit
def _append(row, c_start, end, n, prefix, shift, dst, at, CHUNK: tl.constexpr):
    """The values of row[c_start : c_start + end] whose bits above `shift` are `prefix`, in id order, to dst[at:]."""
    for c0 in range(0, end, CHUNK):
        col = c_start + c0 + tl.arange(0, CHUNK)
        p = tl.load(row + col, mask=col < n, other=0.0)
        inside = (col < n) & ((p.to(tl.int32, bitcast=True) >> shift) == prefix)
        count = tl.sum(inside.to(tl.int32), 0)
        if count > 0:
            tl.store(dst + at + tl.cumsum(inside.to(tl.int32), 0) - 1, p, mask=inside)
            at += count


@triton.jit(do_not_specialize=["S", "i", "shift"])
def _cut_pass(src_ptr, s_src, len_ptr, dst_ptr, V, kp_ptr, tot, st, done_ptr, S, i, shift,
              PH: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, RAN_A: tl.constexpr,
              FROM_LIST: tl.constexpr, TO_LIST: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
              FMAX: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, LIST_CHUNK: tl.constexpr,
              STAGES: tl.constexpr):
    """Pass i of phase PH over a block of the row (or of the previous pass's list): per bucket of
    its D bits above `shift`, the mass and count of the ids that share the bits decided so far,
    added to the row's totals; with TO_LIST, those ids' values appended to this pass's list."""
    F: tl.constexpr = 1 << D
    r = tl.program_id(0)
    blk = tl.program_id(1)
    prefix = tl.load(st + (PH * S + r) * 8).to(tl.int32)
    n = V
    if FROM_LIST:
        n = tl.load(len_ptr + (PH * P + i - 1) * S + r)
    f = tl.arange(0, F)
    row = src_ptr + r.to(tl.int64) * s_src
    end = tl.minimum(BLOCK, n - blk * BLOCK)
    if end > 0:  # a block past the list's end skips the sums' setup and reduction (most blocks, late passes;
        # on an H100 at 64 rows, top-p 0.9, the cut took 221 / 355 us on peaky / flat rows, 288 / 409 without it)
        # [buckets, ids] sums kept per thread and reduced once at the end: each thread tests its own ids
        # against every bucket, with no exchange between threads per chunk; the loads are pipelined
        acc_m = tl.zeros([F, CHUNK], tl.float64)
        acc_c = tl.zeros([F, CHUNK], tl.int32)
        for c0 in tl.range(0, end, CHUNK, num_stages=STAGES):
            col = blk * BLOCK + c0 + tl.arange(0, CHUNK)
            ok = col < n
            bits = tl.load(row + col, mask=ok, other=0.0).to(tl.int32, bitcast=True)
            inside = ok & ((bits >> (shift + D)) == prefix)
            hit = tl.where(inside, (bits >> shift) & (F - 1), F)[None, :] == f[:, None]
            acc_m += tl.where(hit, _units(bits)[None, :], 0.0)
            acc_c += hit.to(tl.int32)
        mass = tl.sum(acc_m, 1)
        count = tl.sum(acc_c, 1)
        total = tl.sum(count, 0)
        if total > 0:
            at = tot + ((PH * P + i) * S + r) * 2 * FMAX
            tl.atomic_add(at + f, mass)
            tl.atomic_add(at + FMAX + f, count.to(tl.float64))
            if TO_LIST:  # the block's ids inside, at one reserved place (their second read hits L2)
                _append(row, blk * BLOCK, end, n, prefix, shift + D, dst_ptr + r.to(tl.int64) * V,
                        tl.atomic_add(len_ptr + (PH * P + i) * S + r, total), LIST_CHUNK)
    tl.debug_barrier()  # every thread's adds issued before the one count below releases them
    if tl.atomic_add(done_ptr + (PH * P + i) * S + r, 1) == tl.num_programs(1) - 1:  # acq_rel: sees every add
        _choose(tot, st, kp_ptr, r, i, S, V, PH, FIRST, LAST, RAN_A, P, D, FMAX)


@triton.jit(do_not_specialize=["S", "NB"])
def _cut_ties(prob_ptr, s_p, ties_ptr, V, st, S, NB, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Ids equal to the row's threshold in each block, where the cut keeps only some of them."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    row_st = st + (S + r) * 8
    v = tl.load(row_st + 5).to(tl.int32)
    ties = tl.full((), 0, tl.int32)
    if tl.load(row_st + 7) < tl.load(row_st + 3):
        row = prob_ptr + r.to(tl.int64) * s_p
        for c0 in range(0, BLOCK, CHUNK):
            col = blk * BLOCK + c0 + tl.arange(0, CHUNK)
            bits = tl.load(row + col, mask=col < V, other=0.0).to(tl.int32, bitcast=True)
            ties += tl.sum(((col < V) & (bits == v)).to(tl.int32), 0)
    tl.store(ties_ptr + r * NB + blk, ties)


@triton.jit(do_not_specialize=["S", "NB"])
def _cut_apply(prob_ptr, s_p, out_ptr, s_o, ties_ptr, V, st, S, NB,
               BLOCK: tl.constexpr, CHUNK: tl.constexpr, NB_P2: tl.constexpr):
    """Zeros past the row's cut: ids above the threshold stay, and of the ids equal to it the first m."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    v = tl.load(st + (S + r) * 8 + 5).to(tl.int32)
    m = tl.load(st + (S + r) * 8 + 7).to(tl.int32)
    nb = tl.arange(0, NB_P2)
    seen = tl.sum(tl.load(ties_ptr + r * NB + nb, mask=nb < blk, other=0), 0)  # equal ids in earlier blocks
    row = prob_ptr + r.to(tl.int64) * s_p
    out = out_ptr + r.to(tl.int64) * s_o
    for c0 in range(0, BLOCK, CHUNK):
        col = blk * BLOCK + c0 + tl.arange(0, CHUNK)
        ok = col < V
        p = tl.load(row + col, mask=ok, other=0.0)
        bits = p.to(tl.int32, bitcast=True)
        eq = ok & (bits == v)
        keep = (bits > v) | (eq & (seen + tl.cumsum(eq.to(tl.int32), 0) <= m))
        tl.store(out + col, tl.where(keep, p, 0.0), mask=ok)
        seen += tl.sum(eq.to(tl.int32), 0)


def top_k_top_p(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """`sample_ref.top_k_top_p` without sorting the vocabulary: per phase two passes over probs and
    the rest over the ids still in play, then a count of tied ids and the write."""
    S, V = probs.shape
    if S == 0 or not any(k < V or p < 1.0 for k, p in zip(top_k, top_p)):
        return probs.clone()
    dev = probs.device
    P, FMAX = len(WIDTHS), 1 << max(WIDTHS)
    nb = triton.cdiv(V, CUT_BLOCK)
    kp = torch.tensor([list(top_k), list(top_p)], dtype=torch.float64)  # k < 2**53: exact
    kp = kp.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else kp
    tot = torch.zeros(2 * P * S * 2 * FMAX + 2 * S * 8, dtype=torch.float64, device=dev)
    tot, st = tot[:2 * P * S * 2 * FMAX], tot[2 * P * S * 2 * FMAX:]
    done, lens = torch.zeros(2, 2, P, S, dtype=torch.int32, device=dev)  # programs finished, list lengths
    lists = torch.empty(2, S, V, dtype=probs.dtype, device=dev).unbind(0)
    ran_a = any(k < V and p < 1.0 for k, p in zip(top_k, top_p))
    launch = _cut_pass[(S, nb)]
    for ph in (0, 1) if ran_a else (1,):
        shift = NBITS
        for i, w in enumerate(WIDTHS):
            shift -= w
            src, s_src = (lists[(i - 1) % 2], V) if i >= 2 else (probs, probs.stride(0))
            launch(src, s_src, lens, lists[i % 2], V, kp, tot, st, done, S, i, shift, PH=ph, FIRST=i == 0,
                   LAST=i == P - 1, RAN_A=ran_a, FROM_LIST=i >= 2, TO_LIST=1 <= i < P - 1, P=P, D=w, FMAX=FMAX,
                   BLOCK=CUT_BLOCK, CHUNK=min(CUT_TILE >> w, CUT_BLOCK), LIST_CHUNK=min(LIST_CHUNK, CUT_BLOCK),
                   STAGES=CUT_STAGES, num_warps=CUT_WARPS)
    tiles = dict(BLOCK=CUT_BLOCK, CHUNK=min(WRITE_CHUNK, CUT_BLOCK))
    ties = torch.empty(S, nb, dtype=torch.int32, device=dev)
    _cut_ties[(S, nb)](probs, probs.stride(0), ties, V, st, S, nb, **tiles, num_warps=4)
    out = torch.empty_like(probs)
    _cut_apply[(S, nb)](probs, probs.stride(0), out, out.stride(0), ties, V, st, S, nb,
                        NB_P2=triton.next_power_of_2(nb), **tiles, num_warps=4)
    return out


def top_k_top_p_supports(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> tuple[bool, str]:
    if reason := _declines(probs):
        return False, reason
    if not len(top_k) == len(top_p) == probs.shape[0]:
        return False, f"one top-k and top-p per row: {len(top_k)} and {len(top_p)} for {probs.shape[0]} rows"
    return True, ""
