"""Triton MoE ops: the fused latent experts and the shared experts' fused gate-up
(K3_LM.md §2.3, §2.4, §7.4-7.6); the router is in `routing.py`.

Same names, signatures and semantics as `moe_ref.py` (the definition); `kernels/__init__.py`
imports this module lazily, so the CPU path never needs triton. Wrappers validate (`*_supports`),
kernels trust. No host syncs and no value-dependent shapes: every buffer size follows from
(T, k, E, D, I), so a decode step can be captured in a CUDA graph (ENGINE.md §7).

experts, shapes: T tokens, k slots, n = T·k assignments (a = t·k + j), E local experts, D expert input
width (the latent), I expert width, BM the block of rows that share one expert.
  1. align   ids [T, k] -> sorted [NB·BM] (assignment of each row, n = padding), block_expert [NB]
             (expert of each row block, -1 = unused); per expert, rows padded to a multiple of BM
             (SGLang/vLLM's moe_align_block_size, written here with two small kernels; an atomic
             cursor per expert places rows, and the row order inside an expert changes no result).
  2. up      h [NB·BM, I] = act(bf(x[tok]·w1ᵀ), bf(x[tok]·w3ᵀ)), bf16, one rounding (§2.4); act's two
             halves of bf16 inputs are looked up in a table of all 65,536 values (`_act_table`).
  3. down    y [n, D] = bf(w_a · fp32(h·w2ᵀ)): the routed weight scales the fp32 accumulator (§7.4).
  4. sum     out [T, D] = bf(scaling · Σ_j fp32(y[t·k + j])), j in slot order; slots whose expert
             is outside [0, E) (another rank's, §9.4) are skipped. No atomics in the reduction.
glu_linear: the up step over x's rows against one weight (DENSE), optionally on the fp32 accumulator.

experts_mxfp4 (w4a16, §7.7): the same four steps and tiles on MXFP4 weights, codes [.., K/2] uint8
(two E2M1 a byte, low nibble first) and E8M0 exponents [.., K/32]. Hopper has no FP4 arithmetic, so
each K step loads the packed tile (a quarter of the bf16 bytes, plus 1/32 for the exponents) and
expands it to bf16 in registers before the same bf16 tensor-core MMA with fp32 accumulation: the
products equal those of the dequantized weights (every dequantized value is exact in bf16), only the
accumulation order can differ. Four expansions (`ExpertsConfig.decode`): tl.dot_scaled's own e2m1
upcast (0), `_mx_rows` through fp32 (1), or bit placement in inline PTX (2, `_E2M1_PTX`; 3 with the 2^126
folded into the scale, for weights whose exponents allow it), which bench/kernels_mxfp4.py times against
each other. `ExpertsConfig.expand` instead expands whole experts to bf16 first (`expand_mxfp4`, a chunk of
experts at a time, so the scratch stays bounded) and runs the bf16 tiles: at prefill sizes the expansion is
paid once per weight rather than once per row block (vLLM's AWQ layers dequantize from 256 rows on).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from k3backend.kernels import norm as norm_ops
from k3backend.kernels import pdl
from k3backend.kernels.mla import has_tma
from k3backend.kernels.moe_ref import Activation

# GPU: compiled for a GPU rather than run by the interpreter (TRITON_INTERPRET=1, read by triton at
# import). On a GPU, libdevice's expf/tanhf and IEEE division are what torch's CUDA sigmoid / tanh /
# silu compile to, so router scores and activations should match torch's CUDA ops bit for bit
# (bench/kernels_moe.py --check compares on a GPU). The interpreter has no libdevice (tl.exp and a tanh
# built on it stand in), its bf16 tl.dot multiplies the raw bits and its fp32 -> bf16 cast truncates
# (triton 3.9): there the dot operands go to fp32 first (bf16 products are exact in fp32, the same
# math) and `_round` rounds to nearest even by hand.
_GPU = not triton.knobs.runtime.interpret

# Shapes that take the GEMV kernels instead of the MMA tiles (ExpertsConfig.gemv): at most GEMV_ROWS
# assignments (T·k) and GEMV_PER_MATRIX rows per weight matrix (T·k/E), since each row streams its
# matrix again. On the H200 at `small` (bench/kernels_moe.py, 2026-12-02): routed experts 2.1× at 1
# token, 1.2× at 2, 1.1× at 4, 0.9× at 8; a dense [2·1024, 2048] glu 1.4× at 1-2 rows, [2·8192, 2048] 1.5×
# at 1 row and 0.6× at 4.
# MXFP4 weights take the same rule (bench/kernels_mxfp4.py, 2026-12-04, decode 2 by bit placement: 2.6× the
# MMA tiles at 1 token, 1.6× at 2, 1.10× at 3, 1.06-1.08× at 4 in two runs; with the byte tables 4 tokens
# were 0.92×).
GEMV_ROWS = 24
GEMV_PER_MATRIX = 2
TWO_WAVES = 2 * 132  # programs that fill the H200's 132 SMs twice: the tile rules' bound
GEMV_AHEAD_PROGRAMS = 3 * 132  # one wave of the GEMV kernels that load ahead (3 programs an SM)


# ----------------------------------------------------------------------------- scalar math
@triton.jit
def _exp(x, GPU: tl.constexpr):
    if GPU:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _div(x, y, GPU: tl.constexpr):
    if GPU:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _sigmoid(x, GPU: tl.constexpr):
    """torch's CUDA sigmoid: 1 / (1 + exp(-x)) in fp32."""
    return _div(1.0, 1.0 + _exp(-x, GPU), GPU)


@triton.jit
def _tanh(x, GPU: tl.constexpr):
    if GPU:
        return libdevice.tanh(x)
    else:  # interpreter only: odd Taylor series near 0 (no cancellation), (1 - e^-2|x|)/(1 + e^-2|x|) elsewhere
        ax = tl.abs(x)
        t = tl.exp(-2.0 * ax)
        big = (1.0 - t) / (1.0 + t)
        x2 = x * x
        small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        r = tl.where(ax < 0.0625, small, big)
        return tl.where(x < 0, -r, r)


@triton.jit
def _gate(g, inv_beta, beta, ACT: tl.constexpr, GPU: tl.constexpr):
    """The gate half of the GLU in fp32, in the reference's order of operations.

    SiTU (§2.4): (β·tanh(g·(1/β)))·σ(g). torch's CUDA division by a Python scalar multiplies by the
    fp32 reciprocal, as SGLang's SiTU kernel does (`tanhf(g·(1/β))`). SiLU (§2.3): g / (1 + exp(-g))
    (torch's CUDA silu).
    """
    if ACT == 0:
        return _div(g, 1.0 + _exp(-g, GPU), GPU)
    else:
        return beta * _tanh(g * inv_beta, GPU) * _sigmoid(g, GPU)


@triton.jit
def _up(u, inv_lam, lam, ACT: tl.constexpr, HAS_LAMBDA: tl.constexpr, GPU: tl.constexpr):
    """The up half: SiTU's cap λ·tanh(u·(1/λ)), else u itself."""
    if ACT == 1 and HAS_LAMBDA:
        return lam * _tanh(u * inv_lam, GPU)
    else:
        return u


@triton.jit
def _glu(g, u, inv_beta, beta, inv_lam, lam, ACT: tl.constexpr, HAS_LAMBDA: tl.constexpr, GPU: tl.constexpr):
    """act(g)·up(u) in fp32 on bf16-rounded inputs (or, for the fused MoE front, fp32 ones)."""
    return _gate(g, inv_beta, beta, ACT, GPU) * _up(u, inv_lam, lam, ACT, HAS_LAMBDA, GPU)


@triton.jit
def _act_table_kernel(table_ptr, inv_beta, beta, inv_lam, lam, ACT: tl.constexpr, HAS_LAMBDA: tl.constexpr,
                      GPU: tl.constexpr, BLOCK: tl.constexpr):
    """table[0, c] = _gate(bf16 code c), table[1, c] = _up(c), for every 16-bit pattern c."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = c.to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    tl.store(table_ptr + c, _gate(v, inv_beta, beta, ACT, GPU))
    tl.store(table_ptr + 65536 + c, _up(v, inv_lam, lam, ACT, HAS_LAMBDA, GPU))


@triton.jit
def _glu_table(g, u, table_ptr):
    """_glu of bf16-rounded g and u by lookup: two gathers from a 512 KB table instead of two tanh, an
    exp and a division per element (a fifth of the experts op's time at prefill sizes, H200)."""
    gi = g.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
    ui = u.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
    return tl.load(table_ptr + gi) * tl.load(table_ptr + 65536 + ui)


@triton.jit
def _up_epilogue(g, u, table_ptr, inv_beta, beta, inv_lam, lam, dt: tl.constexpr, ACT: tl.constexpr,
                 HAS_LAMBDA: tl.constexpr, ROUND_GU: tl.constexpr, TABLE: tl.constexpr, GPU: tl.constexpr):
    """h = bf(act(g)·up(u)) from the fp32 gate/up sums; ROUND_GU: gu = bf(x·w13ᵀ) first, the
    reference's rounding point (then TABLE may look the activation up)."""
    if ROUND_GU:
        g = _round(g, dt, GPU).to(tl.float32)
        u = _round(u, dt, GPU).to(tl.float32)
    if TABLE:
        return _round(_glu_table(g, u, table_ptr), dt, GPU)
    else:
        return _round(_glu(g, u, inv_beta, beta, inv_lam, lam, ACT, HAS_LAMBDA, GPU), dt, GPU)


@triton.jit
def _round(x, dt: tl.constexpr, GPU: tl.constexpr):
    """fp32 -> dt, round to nearest even (a GPU cast does; the interpreter's bf16 cast truncates, and flushes
    subnormals to zero: the bits are placed by hand)."""
    if GPU or dt != tl.bfloat16:
        return x.to(dt)
    else:
        b = x.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(dt, bitcast=True)


@triton.jit
def _mma(a, b, acc, GPU: tl.constexpr):
    if GPU:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks (≈ the same few experts) sweep N together, so an
    expert's weight tile and the blocks' rows are reused from L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


# ----------------------------------------------------------------------------- experts: align
@triton.jit(do_not_specialize=["n"])
def _align_count_kernel(ids_ptr, counts_ptr, n, E, stride_it, stride_ik, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_E: tl.constexpr, RESERVE: tl.constexpr, PDL: tl.constexpr):
    """counts[e] += the assignments to expert e; RESERVE: one atomic a program and expert (its histogram), not
    one an assignment on E counters."""
    pdl.enter(PDL)
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + (a // TOP_K) * stride_it + (a % TOP_K) * stride_ik, mask=a < n, other=-1)
    ok = (e >= 0) & (e < E)
    if RESERVE:
        ev = tl.arange(0, BLOCK_E)
        mine = tl.histogram(tl.where(ok, e, 0).to(tl.int32), BLOCK_E, mask=ok)
        tl.atomic_add(counts_ptr + ev, mine, mask=(ev < E) & (mine > 0), sem="relaxed")
    else:
        tl.atomic_add(counts_ptr + tl.where(ok, e, 0), 1, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _align_place_kernel(ids_ptr, counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, n, E, num_blocks,
                        stride_it, stride_ik, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_E: tl.constexpr, PAD_E: tl.constexpr, RESERVE: tl.constexpr, CH: tl.constexpr,
                        PDL: tl.constexpr):
    """Every program derives the padded expert offsets from the counts, places its assignments
    (a per-expert atomic cursor gives each a row; the row order inside an expert does not change
    any result), and does its share of the padding rows and of the unused blocks. RESERVE: the program
    reserves its rows of each expert with one atomic (its histogram) and ranks its assignments inside them,
    CH at a time, by a running count of each expert's (a cumulative sum over [CH, BLOCK_E] one-hot rows)."""
    pdl.enter(PDL)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    ev = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ev, mask=ev < E, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    total = tl.sum(padded, axis=0)

    a = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + (a // TOP_K) * stride_it + (a % TOP_K) * stride_ik, mask=a < n, other=-1)
    ok = (e >= 0) & (e < E)
    e = tl.where(ok, e, 0).to(tl.int32)
    if RESERVE:
        mine = tl.histogram(e, BLOCK_E, mask=ok)
        first = start + tl.where(mine > 0, tl.atomic_add(cursor_ptr + ev, mine, mask=(ev < E) & (mine > 0),
                                                         sem="relaxed"), 0)  # this program's first row of each
        for c0 in range(0, BLOCK, CH):
            ac = pid * BLOCK + c0 + tl.arange(0, CH)
            ec = tl.load(ids_ptr + (ac // TOP_K) * stride_it + (ac % TOP_K) * stride_ik, mask=ac < n, other=-1)
            okc = (ec >= 0) & (ec < E)
            ec = tl.where(okc, ec, 0).to(tl.int32)
            hot = ((ec[:, None] == ev[None, :]) & okc[:, None]).to(tl.int32)
            rank = tl.sum(tl.cumsum(hot, axis=0) * hot, axis=1) - 1  # earlier ones of its expert in the chunk
            row = tl.gather(first, ec, 0) + rank
            first += tl.sum(hot, axis=0)
            tl.store(sorted_ptr + row, ac, mask=okc)
            tl.store(block_expert_ptr + row // BLOCK_M, ec, mask=okc)
    else:
        row = tl.gather(start, e, 0) + tl.atomic_add(cursor_ptr + e, 1, mask=ok, sem="relaxed")
        tl.store(sorted_ptr + row, a, mask=ok)
        tl.store(block_expert_ptr + row // BLOCK_M, e, mask=ok)  # every used block holds >= 1 real row

    r = tl.arange(0, BLOCK_M)
    for e0 in range(pid * PAD_E, E, nprog * PAD_E):  # padding rows: [start + cnt, start + padded)
        ec = e0 + tl.arange(0, PAD_E)
        ecs = tl.where(ec < E, ec, 0)
        c, s, p = tl.gather(cnt, ecs, 0), tl.gather(start, ecs, 0), tl.gather(padded, ecs, 0)
        pad = (ec[:, None] < E) & (r[None, :] < (p - c)[:, None])
        tl.store(sorted_ptr + (s + c)[:, None] + r[None, :], n, mask=pad)
    for b0 in range(pid * BLOCK, num_blocks, nprog * BLOCK):  # blocks past the last expert's
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + b, -1, mask=(b < num_blocks) & (b * BLOCK_M >= total))


def _align(ids: torch.Tensor, E: int, block_m: int, reserve: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted [NB·BM] int32, block_expert [NB] int32) for ids [T, k]; NB = cdiv(n, BM) + min(E, n),
    the most blocks any routing can need (each expert adds at most one partial block). reserve: the kernels'
    RESERVE (ExpertsConfig.reserve)."""
    T, k = ids.shape
    n = T * k
    num_blocks = triton.cdiv(n, block_m) + min(E, n)
    dev = ids.device
    work = torch.zeros(2 * E, dtype=torch.int32, device=dev)  # counts, cursors
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    block = 1024 if n > 4096 else 256
    block_e = triton.next_power_of_2(E)
    _align_count_kernel[(triton.cdiv(n, block),)](
        ids_ptr=ids, counts_ptr=work, n=n, E=E, stride_it=ids.stride(0), stride_ik=ids.stride(1), TOP_K=k,
        BLOCK=block, BLOCK_E=block_e, RESERVE=reserve, **pdl.launch_args(dev), num_warps=4)
    place = 256 if reserve else block  # the ranks' one-hot work grows with a program's assignments
    _align_place_kernel[(triton.cdiv(n, place),)](
        ids_ptr=ids, counts_ptr=work, cursor_ptr=work[E:], sorted_ptr=sorted_ids, block_expert_ptr=block_expert,
        n=n, E=E, num_blocks=num_blocks, stride_it=ids.stride(0), stride_ik=ids.stride(1), TOP_K=k,
        BLOCK_M=block_m, BLOCK=place, BLOCK_E=block_e, PAD_E=max(1, 2048 // block_m), RESERVE=reserve,
        CH=max(1, min(place, 4096 // block_e)), **pdl.launch_args(dev), num_warps=4,
    )
    return sorted_ids, block_expert


# ----------------------------------------------------------------------------- experts: GEMMs
# E2M1 -> bf16 by bit placement (decode 2). A code's magnitude bits e1 e0 m placed at bf16 bits 8:6 make the
# bf16 of its value times 2^-126 (the 0.5 code, e = 0, is a subnormal there), exactly; its sign (bit 3) goes
# to bit 15. An fma by 2^126 (bf16 0x7E80) gives the value, a second by the E8M0 scale (2^(s-127), bf16 bits
# s << 7; s = 0 gives 0, as tl.dot_scaled does) finishes: 27 instructions per 8 values, shifts, lop3s and
# fmas, with no table constants to keep live (Marlin-style w4a16 kernels convert the same way). The 4 code
# bytes ($4) are first reordered as (b0, b2, b1, b3), so that nibbles i and i + 4 of the word are the pair
# one output register holds. $5-$8: each byte's scale as bf16x2 (an int32 a byte: no byte packing, and no
# assumption on which bytes pack=4 groups); $0, $1 the low nibbles' bf16x2 (bytes 0-1, 2-3), $2, $3 the
# high nibbles'. On the H200 at `small` the routed experts took 9-10 % less at 16-64 tokens than with the
# byte-table lookups this replaced (whose table constants the register allocator rematerialised at every
# use), with the same bits. tests/test_kernels_moe.py runs this text through a model of the instructions.


def _e2m1_pair(out: str, mag: str, sign: str, scale: str, bias: bool = True) -> str:
    """One output register: magnitudes to bits 8:6 and 24:22, signs to 15 and 31, times 2^126 (bias; else the
    scale carries it), times the scale."""
    return (f"{mag}\n{sign}\nand.b32 b, b, 0x80008000;\nlop3.b32 a, a, 0x01C001C0, b, 0xEA;\n"
            + ("fma.rn.bf16x2 a, a, k, nz;\n" if bias else "") + f"fma.rn.bf16x2 {out}, a, {scale}, nz;\n")


def _e2m1_ptx(bias: bool) -> str:
    return ("{\n.reg .b32 w, a, b, k, nz, s01, s23;\n"
            "prmt.b32 w, $4, 0, 0x3120;\n" + ("mov.b32 k, 0x7E807E80; " if bias else "") + "mov.b32 nz, 0x80008000;\n"
            "prmt.b32 s01, $5, $6, 0x5410;\nprmt.b32 s23, $7, $8, 0x5410;\n"
            + _e2m1_pair("$0", "shl.b32 a, w, 6;", "shl.b32 b, w, 12;", "s01", bias)
            + _e2m1_pair("$2", "shl.b32 a, w, 2;", "shl.b32 b, w, 8;", "s01", bias)
            + _e2m1_pair("$1", "shr.u32 a, w, 2;", "shl.b32 b, w, 4;", "s23", bias)
            + _e2m1_pair("$3", "shr.u32 a, w, 6;", "mov.b32 b, w;", "s23", bias)
            + "}")


_E2M1_PTX = tl.constexpr(_e2m1_ptx(True))
# decode 3: the scale operand is 2^(s-1) = 2^126 · 2^(s-127) (bf16 bits (s + 126) << 7), one fma fewer per pair;
# exact for exponents s <= 128 (scales <= 2), where 2^(s-1) is a finite bf16, and s = 0 keeps its 2^-127
_E2M1_PTX_FOLDED = tl.constexpr(_e2m1_ptx(False))


def _word_pairs(word: str) -> tuple[tuple[str, str], ...]:
    """For register `word` (8 codes, nibble n = k n): the magnitude and sign shifts of `_e2m1_pair` for its
    nibble pairs (n, n + 4), n = 0..3, which need no byte reorder (the word PTX here and in moe_fragments)."""
    return ((f"shl.b32 a, {word}, 6;", f"shl.b32 b, {word}, 12;"), (f"shl.b32 a, {word}, 2;", f"shl.b32 b, {word}, 8;"),
            (f"shr.u32 a, {word}, 2;", f"shl.b32 b, {word}, 4;"), (f"shr.u32 a, {word}, 6;", f"mov.b32 b, {word};"))


def _word_ptx_head(bias: bool, regs: str) -> str:
    """The opening of a word PTX: its registers, the 2^126 (bias) and the sign mask constants."""
    return "{\n.reg .b32 " + regs + ";\n" + ("mov.b32 k, 0x7E807E80; " if bias else "") + "mov.b32 nz, 0x80008000;\n"


def _e2m1_word_ptx(bias: bool) -> str:
    """The GEMV kernels' expansion: $9 one int32 word of 8 codes (nibble n = k n; one exponent group), $8 its
    scale as bf16x2, -> 8 fp32 $0-$7 in the order of `WORD_ORDER`: the same pairs as `_e2m1_ptx` without its
    byte reorder and scale packing, each bf16x2 then widened (a bf16 is the top half of its fp32)."""
    out = _word_ptx_head(bias, "a, b, k, nz, r")
    for i, (mag, sign) in enumerate(_word_pairs("$9")):
        out += _e2m1_pair("r", mag, sign, "$8", bias)
        out += f"shl.b32 ${2 * i}, r, 16;\nand.b32 ${2 * i + 1}, r, 0xFFFF0000;\n"  # widen: low half, high half
    return out + "}"


WORD_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the k (nibble) of each output of `_e2m1_word_ptx`: pairs (n, n + 4)
_E2M1_WORD_PTX = tl.constexpr(_e2m1_word_ptx(True))
_E2M1_WORD_PTX_FOLDED = tl.constexpr(_e2m1_word_ptx(False))


@triton.jit
def _halves(v, BLOCK_K: tl.constexpr):
    """[R, BK] -> the same values with each 8 k in the order (0, 2, 4, 6, 1, 3, 5, 7). The tiles `_halves_for`
    names expand MXFP4 codes in this order (`_mx_bf16` with HALVES: the low nibbles of 4 code bytes, then their
    high nibbles) and give the activations the same order, so the dot's sum is unchanged; in this order each
    expanded bf16x2 register of the PTX is one operand register of the MMA as it stands (k order makes
    PRMTs repack them), and the activation's fragments come out of the permute as the MMA's register quads
    (k order copies them by IMAD.MOVs before each MMA). sm_90a, decode 3, BK 128: a K step of the up loop
    664 -> 514 SASS instructions at BM 16 and 771 -> 596 at BM 32, down 355 -> 297 and 460 -> 370."""
    R: tl.constexpr = v.shape[0]
    return tl.permute(v.reshape(R, BLOCK_K // 8, 4, 2), (0, 1, 3, 2)).reshape(R, BLOCK_K)


@triton.jit
def _mx_expand(w, s, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, GPU: tl.constexpr, HALVES: tl.constexpr):
    """MXFP4 tile -> bf16 [BK, BN] by hand (DECODE 1, 2 or 3), in k or (HALVES) `_halves` order: w [BK/2, BN]
    codes (low nibble = even k), s [BN, BK/32] E8M0 exponents."""
    return tl.trans(_mx_bf16(tl.trans(w), s, BLOCK_K, DECODE, GPU, HALVES))


@triton.jit
def _mx_bf16(wt, s, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, GPU: tl.constexpr, HALVES: tl.constexpr):
    """MXFP4 rows -> bf16 [BN, BK] (wt [BN, BK/2] codes, s [BN, BK/32] exponents), in k order or (HALVES)
    `_halves` order: DECODE 2 by `_E2M1_PTX` on a GPU, 3 by `_E2M1_PTX_FOLDED`, else `_mx_rows`."""
    BN: tl.constexpr = wt.shape[0]
    if DECODE >= 2 and GPU:
        # 2^(s-127) as bf16x2 (s << 7 in both halves); decode 3: 2^(s-1), which carries the 2^126
        sx2 = (s.to(tl.int32) + (126 if DECODE == 3 else 0)) * 0x800080
        sb = tl.broadcast_to(sx2[:, :, None], (BN, BLOCK_K // 32, 16)).reshape(BN, BLOCK_K // 2)
        asm: tl.constexpr = _E2M1_PTX_FOLDED if DECODE == 3 else _E2M1_PTX
        lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r,r,r", [wt, sb],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        w = tl.join(lo, hi).reshape(BN, BLOCK_K)
    else:
        w = _mx_rows(wt, s, BLOCK_K).to(tl.bfloat16)
    if HALVES:
        w = _halves(w, BLOCK_K)
    return w


@triton.jit
def _e2m1(q):
    """E2M1 codes (0..15) -> fp32 values: fp16 bit patterns (value · 2^-14; the 0.5 code is an fp16 subnormal,
    which conversions keep), then · 2^14: exact."""
    q = q.to(tl.uint16)
    bits = (((q & 8) << 12) | ((q & 7) << 9)).to(tl.uint16)  # (the shifts may have promoted q to int32)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e8m0(s):
    """E8M0 exponents -> fp32 scales 2^(s-127), exactly (s = 0 is the subnormal 2^-127)."""
    return tl.where(s == 0, 0x00400000, s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_rows(wt, s, BLOCK_K: tl.constexpr):
    """MXFP4 rows -> fp32 [BN, BK] in k order, exactly: wt [BN, BK/2] codes, s [BN, BK/32] exponents."""
    BN: tl.constexpr = wt.shape[0]
    v = _e2m1(tl.join(wt & 0xF, wt >> 4).reshape(BN, BLOCK_K))  # [BN, BK], k interleaved
    return (v.reshape(BN, BLOCK_K // 32, 32) * _e8m0(s)[:, :, None]).reshape(BN, BLOCK_K)


@triton.jit
def _expand_kernel(w_ptr, s_ptr, out_ptr, N, stride_we, stride_wn, stride_se, stride_sn, stride_oe, stride_on,
                   GPU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, rows, k-block] = the MXFP4 rows' values, exactly (`expand_mxfp4`); program (row block, k block, e)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    e = tl.program_id(2).to(tl.int64)
    m = (r < N)[:, None]
    r = r.to(tl.int64)[:, None]
    wt = tl.load(w_ptr + e * stride_we + r * stride_wn + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :], mask=m,
                 other=0)
    s = tl.load(s_ptr + e * stride_se + r * stride_sn + k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :], mask=m,
                other=0)
    v = _round(_mx_rows(wt, s, BLOCK_K), out_ptr.dtype.element_ty, GPU)
    tl.store(out_ptr + e * stride_oe + r * stride_on + k0 + tl.arange(0, BLOCK_K)[None, :], v, mask=m)


@triton.jit
def _exponents(s_ptrs, k_left, EVEN_K: tl.constexpr, SW: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step's E8M0 exponents [BN, BK/32] (int32 or uint8). SW > 0: s_ptrs [BN, SW] int32 words of 4
    exponents: 4-byte loads, which the pipeliner issues as async copies steps ahead (it leaves 1-2-byte loads
    synchronous, a memory round trip a K step); the bytes come apart by uniform shifts and joins, through which
    the dot operand's layout still reaches the code loads. SW 0: the bytes. Past K: 127 (scale 1, code 0)."""
    if SW > 0:
        if EVEN_K:
            w = tl.load(s_ptrs)
        else:
            w = tl.load(s_ptrs, mask=(tl.arange(0, SW) < k_left // 128)[None, :], other=0x7F7F7F7F)
        even, odd = tl.join(w & 0xFF, (w >> 16) & 0xFF), tl.join((w >> 8) & 0xFF, (w >> 24) & 0xFF)
        return tl.join(even, odd).reshape(w.shape[0], 4 * SW)  # [..., j, i]: byte 2j + i
    elif EVEN_K:
        return tl.load(s_ptrs)
    else:
        return tl.load(s_ptrs, mask=(tl.arange(0, BLOCK_K // 32) < k_left // 32)[None, :], other=127)


@triton.constexpr_function
def _halves_for(MX: tl.constexpr, DECODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Whether a K step runs in `_halves` order: MXFP4 expanded by hand in the BM 32 tiles. One H100, `small`
    (bench/kernels_mxfp4.py, µs, k order -> halves, 2026-12-06): BM 32 at 256 tokens 117 -> 111 (decode 3), ahead
    of tl.dot_scaled's 116; BM 16, with 23 % fewer instructions a K step, not faster (decode 3: 16 tokens 59 ->
    61, 64 tokens 70 -> 70), as those tiles wait on memory rather than issue. The wgmma tiles (BM >= 64) take
    their weight operand from shared memory, where the order saves nothing, and their activations would have
    to leave it (sm_90a, BM 64: 2-byte loads, 125 -> 161 registers)."""
    return MX and DECODE > 0 and BLOCK_M == 32


@triton.jit
def _k_order(a, HALVES: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of activations [BM, BK] in the order `_w_dot` expands the weights in."""
    if HALVES:
        return _halves(a, BLOCK_K)
    else:
        return a


@triton.jit
def _step_exponents(s_ptrs, k_left, s_ahead, step_s, EVEN_K: tl.constexpr, MX: tl.constexpr, SW: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """(this K step's exponents, s_ahead for the next step) of the MMA tiles' loops. Exponent bytes (SW 0, the
    BM >= 64 tiles' K steps of 64) load a step ahead: the pipeliner leaves such loads synchronous, and a load used
    at once was a memory round trip a step, stalling the tile (no other program shares its SM); one H100, `small`,
    two runs, µs: 512 / 2,048 / 8,192 / 16,384 tokens 145 / 366 / 1,135 / 2,163 -> 140 / 358 / 1,123 / 2,114.
    s_ahead: before the loop `_exponents` of step 0 (SW 0), else 0; step_s: how far the pointers move a step."""
    if MX and SW == 0:
        return s_ahead, _exponents(s_ptrs + step_s, k_left - BLOCK_K, False, SW, BLOCK_K)
    elif MX:
        return _exponents(s_ptrs, k_left, EVEN_K, SW, BLOCK_K), s_ahead
    else:
        return 0, s_ahead


@triton.jit
def _first_exponents(s_ptrs, k_left, MX: tl.constexpr, SW: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_step_exponents`'s s_ahead before the loop: step 0's exponent bytes, or 0 where they are not loaded ahead."""
    if MX and SW == 0:
        return _exponents(s_ptrs, k_left, False, SW, BLOCK_K)
    else:
        return 0


@triton.jit
def _w_dot(a, acc, w_ptrs, s, k_left, GPU: tl.constexpr, EVEN_K: tl.constexpr, MX: tl.constexpr,
           DECODE: tl.constexpr, HALVES: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a · (one K step of a weight tile), a [BM, BK] as `_k_order` gives it: w_ptrs [BK, BN] in a's
    dtype, or MXFP4 (w_ptrs [BK/2, BN] codes, s the step's exponents, `_step_exponents`) expanded to
    bf16 in registers: by tl.dot_scaled (DECODE 0, Triton's own e2m1 upcast on Hopper; fast_math: no NaN
    select, the loader refuses the NaN exponent 255; its bf16 scale flushes exponent byte 0, 2^-127, to
    zero, which leaves out weights below 2^-124) or by `_mx_expand` (DECODE 1, 2, 3). k_left: K elements
    left from this step on."""
    if MX:
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K // 2) < k_left // 2)[:, None], other=0)
        if DECODE == 0:
            return tl.dot_scaled(a, None, "bf16", w, s.to(tl.uint8), "e2m1", acc, fast_math=True)
        else:
            return _mma(a, _mx_expand(w, s, BLOCK_K, DECODE, GPU, HALVES), acc, GPU)
    else:
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K) < k_left)[:, None], other=0.0)
        return _mma(a, w, acc, GPU)


@triton.jit
def _w_ptrs(w_ptr, s_ptr, rows, stride_wn, stride_sn, MX: tl.constexpr, SW: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers of the first K step of weight rows `rows` [BN] (int64): w [BK, BN] (MXFP4: codes
    [BK/2, BN] and exponents, `_s_ptrs`), views of wᵀ; step them by BK (BK/2, and SW or BK/32)."""
    if MX:
        w = w_ptr + rows[None, :] * stride_wn + tl.arange(0, BLOCK_K // 2)[:, None]
    else:
        w = w_ptr + rows[None, :] * stride_wn + tl.arange(0, BLOCK_K)[:, None]
    return w, _s_ptrs(s_ptr, rows, stride_sn, MX, SW, BLOCK_K)


@triton.jit
def _s_ptrs(s_ptr, rows, stride_sn, MX: tl.constexpr, SW: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers to the first K step's exponents of `rows`: [BN, SW] int32 words (SW > 0) or [BN, BK/32] bytes."""
    if not MX:
        return s_ptr
    elif SW > 0:
        return s_ptr + rows[:, None] * stride_sn + tl.arange(0, SW)[None, :]
    else:
        return s_ptr + rows[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _up_kernel(x_ptr, x_desc, w13_ptr, s13_ptr, w_desc, h_ptr, sorted_ptr, block_expert_ptr, table_ptr, n, D, I,
               num_blocks, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hm, inv_beta, beta, inv_lam,
               lam, TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_LAMBDA: tl.constexpr, DENSE: tl.constexpr,
               ROUND_GU: tl.constexpr, TABLE: tl.constexpr, GPU: tl.constexpr, EVEN_K: tl.constexpr, MX: tl.constexpr,
               DECODE: tl.constexpr, SW: tl.constexpr, TMA: tl.constexpr, XTMA: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """h[rows, n-block] = act(bf(x[tok]·w1ᵀ), bf(x[tok]·w3ᵀ)): gate and up columns of one expert.

    DENSE: one weight for all n rows of x, row r = token r (glu_linear). ROUND_GU False: the
    activation reads the fp32 accumulator (the fused MoE front, §7.6). TABLE (with ROUND_GU, bf16): the
    activation by lookup in `table_ptr` (`_act_table`). MX: w13 holds MXFP4 codes [E, 2I, D/2] and s13
    their exponents [E, 2I, D/32] (SW > 0: as int32 words [E, 2I, D/128], SW a K step). TMA: weight tiles
    [BN, BK] come through w_desc, w13 viewed [E·2I, D] (BN divides I, so a tile never crosses into the next
    matrix). XTMA: x's tiles [BM, BK] too, through x_desc over x permuted into row-block order (row r holds
    the token of assignment sorted[r]) instead of gathered row by row.
    """
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if DENSE:
        a_idx = rows
        w_ptr, s_ptr = w13_ptr, s13_ptr
        w_row = pid_n * BLOCK_N  # of w_desc
    else:
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:
            return
        a_idx = tl.load(sorted_ptr + rows)
        w_ptr, s_ptr = w13_ptr + e.to(tl.int64) * stride_we, s13_ptr + e.to(tl.int64) * stride_se
        w_row = e * 2 * I + pid_n * BLOCK_N
    tok = tl.where(a_idx < n, a_idx // TOP_K, 0).to(tl.int64)  # padding rows read token 0, never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptrs, gs_ptrs = _w_ptrs(w_ptr, s_ptr, (offs_n % I).to(tl.int64), stride_wn, stride_sn, MX, SW, BLOCK_K)  # w1ᵀ;
    u_ptrs, us_ptrs = g_ptrs + I * stride_wn, gs_ptrs + I * stride_sn  # % I keeps the edge block in bounds
    step_w: tl.constexpr = BLOCK_K // 2 if MX else BLOCK_K
    step_s: tl.constexpr = (SW if SW > 0 else BLOCK_K // 32) if MX else 0
    HALVES: tl.constexpr = _halves_for(MX, DECODE, BLOCK_M)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sg_ahead = _first_exponents(gs_ptrs, D, MX, SW, BLOCK_K)
    su_ahead = _first_exponents(us_ptrs, D, MX, SW, BLOCK_K)
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        k_left = D - k0 * BLOCK_K
        if XTMA:
            xa = x_desc.load([pid_m * BLOCK_M, k0 * BLOCK_K])
        elif EVEN_K:
            xa = tl.load(x_ptrs)
        else:
            xa = tl.load(x_ptrs, mask=(offs_k < k_left)[None, :], other=0.0)
        if TMA:  # past D the copy engine fills zeros
            acc_g = _mma(xa, w_desc.load([w_row, k0 * BLOCK_K]).T, acc_g, GPU)
            acc_u = _mma(xa, w_desc.load([w_row + I, k0 * BLOCK_K]).T, acc_u, GPU)
        else:
            sg, sg_ahead = _step_exponents(gs_ptrs, k_left, sg_ahead, step_s, EVEN_K, MX, SW, BLOCK_K)
            su, su_ahead = _step_exponents(us_ptrs, k_left, su_ahead, step_s, EVEN_K, MX, SW, BLOCK_K)
            xa = _k_order(xa, HALVES, BLOCK_K)
            acc_g = _w_dot(xa, acc_g, g_ptrs, sg, k_left, GPU, EVEN_K, MX, DECODE, HALVES, BLOCK_K)
            acc_u = _w_dot(xa, acc_u, u_ptrs, su, k_left, GPU, EVEN_K, MX, DECODE, HALVES, BLOCK_K)
        x_ptrs += BLOCK_K
        g_ptrs += step_w
        u_ptrs += step_w
        gs_ptrs += step_s
        us_ptrs += step_s
    h = _up_epilogue(acc_g, acc_u, table_ptr, inv_beta, beta, inv_lam, lam, h_ptr.dtype.element_ty, ACT, HAS_LAMBDA,
                     ROUND_GU, TABLE, GPU)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h, mask=(a_idx < n)[:, None] & (offs_n < I)[None, :])


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _down_kernel(h_ptr, w2_ptr, s2_ptr, h_desc, w_desc, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, n, D, I,
                 num_blocks, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_yn, stride_pt, stride_pk,
                 TOP_K: tl.constexpr, GPU: tl.constexpr, EVEN_K: tl.constexpr, MX: tl.constexpr,
                 DECODE: tl.constexpr, SW: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """y[a, n-block] = bf(w_a · fp32(h[row]·w2ᵀ)) for the rows of one expert block (MX: w2 codes
    [E, D, I/2], s2 exponents [E, D, I/32], or as int32 words with SW > 0). TMA: h tiles [BM, BK] through
    h_desc and weight tiles [BN, BK] through w_desc, w2 viewed [E·D, I] (BN divides D). A padding row's h was
    never written: its product row is garbage, and never stored."""
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(D, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_idx = tl.load(sorted_ptr + rows)
    real = a_idx < n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs, s_ptrs = _w_ptrs(w2_ptr + e.to(tl.int64) * stride_we, s2_ptr + e.to(tl.int64) * stride_se,
                             (offs_n % D).to(tl.int64), stride_wn, stride_sn, MX, SW, BLOCK_K)  # w2ᵀ
    step_w: tl.constexpr = BLOCK_K // 2 if MX else BLOCK_K
    step_s: tl.constexpr = (SW if SW > 0 else BLOCK_K // 32) if MX else 0
    HALVES: tl.constexpr = _halves_for(MX, DECODE, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s_ahead = _first_exponents(s_ptrs, I, MX, SW, BLOCK_K)
    for k0 in range(0, tl.cdiv(I, BLOCK_K)):
        k_left = I - k0 * BLOCK_K
        if TMA:
            ha = h_desc.load([pid_m * BLOCK_M, k0 * BLOCK_K])
            acc = _mma(ha, w_desc.load([e * D + pid_n * BLOCK_N, k0 * BLOCK_K]).T, acc, GPU)
        else:
            if EVEN_K:
                ha = tl.load(h_ptrs, mask=real[:, None], other=0.0)
            else:
                ha = tl.load(h_ptrs, mask=real[:, None] & (offs_k < k_left)[None, :], other=0.0)
            s, s_ahead = _step_exponents(s_ptrs, k_left, s_ahead, step_s, EVEN_K, MX, SW, BLOCK_K)
            acc = _w_dot(_k_order(ha, HALVES, BLOCK_K), acc, w_ptrs, s, k_left, GPU, EVEN_K, MX, DECODE, HALVES,
                         BLOCK_K)
        h_ptrs += BLOCK_K
        w_ptrs += step_w
        s_ptrs += step_s
    a_safe = tl.where(real, a_idx, 0)
    wt = tl.load(weights_ptr + (a_safe // TOP_K) * stride_pt + (a_safe % TOP_K) * stride_pk, mask=real, other=0.0)
    y = _round(acc * wt[:, None], y_ptr.dtype.element_ty, GPU)
    y_ptrs = y_ptr + a_safe.to(tl.int64)[:, None] * stride_yn + offs_n[None, :]
    tl.store(y_ptrs, y, mask=real[:, None] & (offs_n < D)[None, :])


@triton.jit
def _vec(ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of an activation row, in fp32, zeros past its end."""
    if EVEN_K:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=tl.arange(0, BLOCK_K) < k_left, other=0.0).to(tl.float32)


@triton.jit
def _row_load(w_ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, MX: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of weight rows as stored, for `_gemv`: MXFP4 codes as int32 words [BN, BK/8] and their
    exponents (`_exponents`), or w [BN, BK] (twice: no exponents)."""
    if MX:
        if EVEN_K:
            c = tl.load(w_ptrs)
        else:  # K is whole exponent groups, so k_left is whole words
            c = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K // 8) < k_left // 8)[None, :], other=0)
        return c, _exponents(s_ptrs, k_left, EVEN_K, 0, BLOCK_K)
    else:
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K) < k_left)[None, :], other=0.0)
        return w, w


@triton.jit
def _gemv(acc, c, s, v, MX: tl.constexpr, DECODE: tl.constexpr, GPU: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + w [BN, BK] · v [BK] elementwise in fp32 (bf16 products, and those of MXFP4 values, are exact in
    fp32); c, s: `_row_load`'s. bf16: acc [BN, BK]. MXFP4: acc [BN, BK/8], each code word's 8 products added
    to its column (`_mx_words`)."""
    if MX:
        w0, w1, w2, w3, w4, w5, w6, w7 = _mx_words(c, s, BLOCK_K, DECODE, GPU)
        v0, v1, v2, v3, v4, v5, v6, v7 = _word_split(v, BLOCK_K)
        acc += w0 * v0[None, :] + w1 * v1[None, :] + w2 * v2[None, :] + w3 * v3[None, :]
        return acc + (w4 * v4[None, :] + w5 * v5[None, :] + w6 * v6[None, :] + w7 * v7[None, :])
    else:
        return acc + c.to(tl.float32) * v[None, :]


@triton.jit
def _word_split(v, BLOCK_K: tl.constexpr):
    """v [BK] -> 8 vectors [BK/8]: v[8j + n] for n in `WORD_ORDER`."""
    e, o = tl.split(v.reshape(BLOCK_K // 8, 2, 2, 2))  # k = 8j + 4·b2 + 2·b1 + b0: split b0, then b1, then b2
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    v0, v4 = tl.split(e0)
    v2, v6 = tl.split(e1)
    v1, v5 = tl.split(o0)
    v3, v7 = tl.split(o1)
    return v0, v4, v1, v5, v2, v6, v3, v7


@triton.jit
def _nibble(c, n: tl.constexpr, sc):
    """Code n of each word of c, times its scale sc, in fp32."""
    return _e2m1((c >> (4 * n)) & 0xF) * sc


@triton.jit
def _mx_words(c, s, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, GPU: tl.constexpr):
    """MXFP4 code words c [BN, BK/8] (8 codes each), exponents s [BN, BK/32] -> 8 fp32 [BN, BK/8], the codes of
    `WORD_ORDER`: by `_E2M1_WORD_PTX` (decode 2, `_FOLDED` 3) on a GPU, else by `_e2m1` and `_e8m0`."""
    BN: tl.constexpr = c.shape[0]
    if DECODE >= 2 and GPU:
        sx2 = (s.to(tl.int32) + (126 if DECODE == 3 else 0)) * 0x800080
        sw = tl.broadcast_to(sx2[:, :, None], (BN, BLOCK_K // 32, 4)).reshape(BN, BLOCK_K // 8)
        asm: tl.constexpr = _E2M1_WORD_PTX_FOLDED if DECODE == 3 else _E2M1_WORD_PTX
        return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [sw, c], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    else:
        sc = tl.broadcast_to(_e8m0(s)[:, :, None], (BN, BLOCK_K // 32, 4)).reshape(BN, BLOCK_K // 8)
        return (_nibble(c, 0, sc), _nibble(c, 4, sc), _nibble(c, 1, sc), _nibble(c, 5, sc), _nibble(c, 2, sc),
                _nibble(c, 6, sc), _nibble(c, 3, sc), _nibble(c, 7, sc))


@triton.jit
def _row_ptrs(w_ptr, s_ptr, rows, stride_wn, stride_sn, MX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers of the first K step of weight rows `rows` [BN] (int64) for the GEMV kernels: w [BN, BK]
    (MXFP4: int32 code words [BN, BK/8] and exponent bytes [BN, BK/32]); step them by BK (BK/8, BK/32)."""
    if MX:
        w = w_ptr + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    else:
        w = w_ptr + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    return w, _s_ptrs(s_ptr, rows, stride_sn, MX, 0, BLOCK_K)


@triton.jit(do_not_specialize=["n"])
def _up_gemv_kernel(x_ptr, w13_ptr, s13_ptr, h_ptr, ids_ptr, table_ptr, n, D, I, E, stride_xt, stride_we, stride_wn,
                    stride_se, stride_sn, stride_it, stride_ik, stride_hm, inv_beta, beta, inv_lam, lam,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_LAMBDA: tl.constexpr, DENSE: tl.constexpr,
                    ROUND_GU: tl.constexpr, TABLE: tl.constexpr, GPU: tl.constexpr, EVEN_K: tl.constexpr,
                    MX: tl.constexpr, DECODE: tl.constexpr, AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """`_up_kernel` for a handful of rows (ExpertsConfig.gemv): one program per (assignment, N block),
    h[a] in assignment order; the weights stream through vector loads and fp32 FMAs instead of MMA
    tiles padded to 16 rows, and no align step runs. Assignments to other ranks' experts do nothing.
    MX: w13 holds MXFP4 codes as int32 words [E, 2I, D/8] and s13 their exponents [E, 2I, D/32]. AHEAD: each K
    step's loads issue before the previous step's FMAs (nothing pipelines loads without a dot), which costs
    registers."""
    pdl.enter(PDL)
    a = tl.program_id(0)
    if DENSE:
        t = a
        w_ptr, s_ptr = w13_ptr, s13_ptr
    else:
        t = a // TOP_K
        e = tl.load(ids_ptr + t * stride_it + (a % TOP_K) * stride_ik)
        if (e < 0) | (e >= E):
            return
        w_ptr, s_ptr = w13_ptr + e.to(tl.int64) * stride_we, s13_ptr + e.to(tl.int64) * stride_se
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ptrs, gs_ptrs = _row_ptrs(w_ptr, s_ptr, (offs_n % I).to(tl.int64), stride_wn, stride_sn, MX, BLOCK_K)
    u_ptrs, us_ptrs = g_ptrs + I * stride_wn, gs_ptrs + I * stride_sn
    step_w: tl.constexpr = BLOCK_K // 8 if MX else BLOCK_K
    step_s: tl.constexpr = BLOCK_K // 32 if MX else 0
    ACC_K: tl.constexpr = BLOCK_K // 8 if MX else BLOCK_K  # `_gemv`'s accumulator columns
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    xv = _vec(x_ptrs, D, EVEN_K, BLOCK_K)
    cg, sg = _row_load(g_ptrs, gs_ptrs, D, EVEN_K, MX, BLOCK_K)
    cu, su = _row_load(u_ptrs, us_ptrs, D, EVEN_K, MX, BLOCK_K)
    for k0 in range(1, tl.cdiv(D, BLOCK_K)):
        if not AHEAD:
            acc_g = _gemv(acc_g, cg, sg, xv, MX, DECODE, GPU, BLOCK_K)
            acc_u = _gemv(acc_u, cu, su, xv, MX, DECODE, GPU, BLOCK_K)
        k_left = D - k0 * BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += step_w
        u_ptrs += step_w
        gs_ptrs += step_s
        us_ptrs += step_s
        xn = _vec(x_ptrs, k_left, EVEN_K, BLOCK_K)
        cgn, sgn = _row_load(g_ptrs, gs_ptrs, k_left, EVEN_K, MX, BLOCK_K)
        cun, sun = _row_load(u_ptrs, us_ptrs, k_left, EVEN_K, MX, BLOCK_K)
        if AHEAD:
            acc_g = _gemv(acc_g, cg, sg, xv, MX, DECODE, GPU, BLOCK_K)
            acc_u = _gemv(acc_u, cu, su, xv, MX, DECODE, GPU, BLOCK_K)
        xv, cg, sg, cu, su = xn, cgn, sgn, cun, sun
    g = tl.sum(_gemv(acc_g, cg, sg, xv, MX, DECODE, GPU, BLOCK_K), axis=1)
    u = tl.sum(_gemv(acc_u, cu, su, xv, MX, DECODE, GPU, BLOCK_K), axis=1)
    h = _up_epilogue(g, u, table_ptr, inv_beta, beta, inv_lam, lam, h_ptr.dtype.element_ty, ACT, HAS_LAMBDA, ROUND_GU,
                     TABLE, GPU)
    tl.store(h_ptr + a.to(tl.int64) * stride_hm + offs_n, h, mask=offs_n < I)


@triton.jit(do_not_specialize=["n"])
def _down_gemv_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, ids_ptr, n, D, I, E, stride_hm, stride_we,
                      stride_wn, stride_se, stride_sn, stride_yn, stride_it, stride_ik, stride_pt, stride_pk,
                      TOP_K: tl.constexpr, GPU: tl.constexpr, EVEN_K: tl.constexpr, MX: tl.constexpr,
                      DECODE: tl.constexpr, AHEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EARLY: tl.constexpr, PDL: tl.constexpr):
    """y[a, n-block] = bf(w_a · fp32(h[a]·w2ᵀ)) for one assignment (ExpertsConfig.gemv; MX: w2 codes as int32
    words [E, D, I/8], s2 exponents [E, D, I/32]); AHEAD as in `_up_gemv_kernel`.

    EARLY (`pdl.early`): the ids and the first K step's weights load before the wait for the previous kernel,
    and L2 is asked for the other steps. That kernel is the up GEMV (`experts_with` launches nothing between),
    which reads the ids only after its own wait for their writer, so they are complete before this one starts."""
    if not EARLY:
        pdl.enter(PDL)
    a = tl.program_id(0)
    t, j = a // TOP_K, a % TOP_K
    e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
    if (e < 0) | (e >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e, s_e, rows = w2_ptr + e.to(tl.int64) * stride_we, s2_ptr + e.to(tl.int64) * stride_se, (offs_n % D).to(tl.int64)
    w_ptrs, s_ptrs = _row_ptrs(w_e, s_e, rows, stride_wn, stride_sn, MX, BLOCK_K)
    step_w: tl.constexpr = BLOCK_K // 8 if MX else BLOCK_K
    step_s: tl.constexpr = BLOCK_K // 32 if MX else 0
    ACC_K: tl.constexpr = BLOCK_K // 8 if MX else BLOCK_K  # `_gemv`'s accumulator columns
    h_ptrs = h_ptr + a.to(tl.int64) * stride_hm + tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    c, s = _row_load(w_ptrs, s_ptrs, I, EVEN_K, MX, BLOCK_K)
    if EARLY:  # L2: the later K steps (MX: codes in words of 8, exponents a byte per 32)
        pdl.prefetch_rows(w_e + rows * stride_wn, step_w, I // 8 if MX else I, step_w, PDL)
        if MX:
            pdl.prefetch_rows(s_e + rows * stride_sn, step_s, I // 32, step_s, PDL)
        pdl.enter(PDL)
    hv = _vec(h_ptrs, I, EVEN_K, BLOCK_K)
    for k0 in range(1, tl.cdiv(I, BLOCK_K)):
        if not AHEAD:
            acc = _gemv(acc, c, s, hv, MX, DECODE, GPU, BLOCK_K)
        k_left = I - k0 * BLOCK_K
        h_ptrs += BLOCK_K
        w_ptrs += step_w
        s_ptrs += step_s
        hn = _vec(h_ptrs, k_left, EVEN_K, BLOCK_K)
        cn, sn = _row_load(w_ptrs, s_ptrs, k_left, EVEN_K, MX, BLOCK_K)
        if AHEAD:
            acc = _gemv(acc, c, s, hv, MX, DECODE, GPU, BLOCK_K)
        hv, c, s = hn, cn, sn
    wt = tl.load(weights_ptr + t * stride_pt + j * stride_pk)
    y = _round(tl.sum(_gemv(acc, c, s, hv, MX, DECODE, GPU, BLOCK_K), axis=1) * wt, y_ptr.dtype.element_ty, GPU)
    tl.store(y_ptr + a.to(tl.int64) * stride_yn + offs_n, y, mask=offs_n < D)


@triton.jit(do_not_specialize=["T"])
def _sum_kernel(y_ptr, ids_ptr, out_ptr, norm_w_ptr, T, D, E, scaling, eps, stride_yn, stride_it, stride_ik,
                stride_ot, TOP_K: tl.constexpr, GPU: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t] = bf(scaling · Σ_j fp32(y[t·k + j])) in slot order; a skipped slot adds +0 as in the reference.
    NORM (whole rows, BLOCK_D ≥ D): then the RMSNorm of that rounded row, in the tile, warps and arithmetic of
    norm.py's `_row_norm_kernel` (the same `row_config`, `rms_normed`, no fma contraction): one launch for two."""
    pdl.enter(PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (t < T)[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=t < T, other=-1)
        mine = ok & ((e >= 0) & (e < E))[:, None]
        acc += tl.load(y_ptr + (t * TOP_K + j)[:, None] * stride_yn + d[None, :], mask=mine, other=0.0).to(tl.float32)
    out = _round(scaling * acc, out_ptr.dtype.element_ty, GPU)
    if NORM:
        x = tl.where(ok, out.to(tl.float32), 0.0)
        w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        out = _round(norm_ops.rms_normed(x, w, D, eps, 1), out_ptr.dtype.element_ty, GPU)
    tl.store(out_ptr + t[:, None] * stride_ot + d[None, :], out, mask=ok)


@dataclass(frozen=True)
class ExpertsConfig:
    """Tiles of the two grouped GEMMs; both share block_m (the align step's padding). decode: how
    MXFP4 weights are expanded (0: tl.dot_scaled, 1: `_mx_rows`, 2: `_E2M1_PTX`, 3: `_E2M1_PTX_FOLDED`, exact
    only for exponents <= 128; the GEMV kernels take 1's math for 0); bf16 weights ignore it.
    table: the up GEMM's activation by lookup where its inputs are bf16-rounded (`_glu_table`).
    gemv: `_up_gemv_kernel` / `_down_gemv_kernel` with these tiles instead (a few rows)."""

    block_m: int
    up: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    down: tuple[int, int, int, int]
    group_m: int = 8
    decode: int = 0
    table: bool = True
    gemv: tuple[int, int, int, int] | None = None  # BLOCK_N, BLOCK_K, num_warps, stages (> 1: AHEAD)
    tma: bool = False  # bf16 weight (and down's h) tiles through TMA descriptors where the shapes allow (`_desc`)
    # MXFP4 BM 16 at 2-8 rows an expert: moe_fragments' Gluon kernels where they run, with these tiles (up
    # BLOCK_N, warps, down BLOCK_N, warps)
    fragments: tuple[int, int, int, int] | None = None
    # MXFP4 weights expanded to bf16 this many experts at a time (`expand_mxfp4`), each chunk then run by the bf16
    # tiles above (which should be bf16's); 0: expanded in registers inside the tiles. experts_mxfp4_config takes all
    # experts at once for large steps; smaller chunks are a variant the bench times.
    expand: int = 0
    # the align step's kernels reserve rows with one atomic a program and expert rather than one an assignment (on
    # `small` at 8 K tokens they took 45 µs, reading under 1 MB: atomics on 64 addresses; 21 µs reserving). The rule
    # takes it with BM 128; below, a variant the bench times (a tie at 2,048 tokens).
    reserve: bool = False
    # with tma: x permuted into row-block order first (a copy of its token's row for every sorted row), so up reads its
    # x tiles by TMA rather than gathering rows (at 8 K tokens of `small` up ran at 396 TFLOP/s, down, both operands
    # by TMA, at 454 on an H100). A variant the bench times.
    xtma: bool = False


def experts_config(T: int, k: int, E: int, D: int, I: int, mxfp4: bool = False, ep: int = 1) -> ExpertsConfig:
    """Tiles keyed on the mean rows per expert m = T·k/(E·ep) (a pure function of the shape: nothing is
    autotuned, so a captured graph replays the kernels it was captured with). E: this rank's experts; ep: the
    expert-parallel ranks they are split over, so about T·k/ep of the assignments are this rank's.

    - m ≤ 16 (decode): weight-streaming. BM 16 (the smallest tl.dot); N split fine (BN 64, or 32 / 16
      when the touched experts alone would not fill 2 waves of 132 SMs) instead of split-K, so the
      activation reads the full-K accumulator; 4-stage pipelines keep ~100 KB of weights in flight per SM.
      MXFP4 below 2 rows an expert takes up's K in steps of 256, and down's below 1 row (one H100, `small`,
      8 layers' weights a graph, µs: 8 / 12 / 16 tokens 51.5 / 57.1 / 59.4 -> 47.1 / 54.2 / 55.7; from 24 on
      no gain). MXFP4 from 2 to 8 rows an expert takes moe_fragments' kernels (`fragments`; its docstring has
      the figures): below, they lose to the K steps of 256; above, to moe.py's pipelined tiles.
    - a few rows (GEMV_ROWS, GEMV_PER_MATRIX): the GEMV kernels, one program per assignment and N block,
      BN 16 and BK 256 (near the best of the tiles measured at 1-4 tokens), BN 8 / 4 / 2 where the rows
      alone would give fewer than 2 waves of programs: the shared experts' glu at 1 row had 64 programs
      of 16 rows; 512 of 2 cut the batch-1 decode step 2.510 -> 2.359 ms of device time on the H200
      (`small`, MXFP4 experts, graph replays, `_up_gemv_kernel` 10.0 -> 7.3 µs a call), batch 2 2.690 -> 2.566.
      K steps of 1,024 where a program holds at most 4 rows: more of its weights in flight (the shared experts'
      glu at 1 / 2 rows 6.2 / 7.0 -> 4.6 / 5.3 µs, graphs of 48 calls with PDL; 16-row programs would spill).
      MXFP4 weights take them too, their codes read as int32 words of 8 and expanded in registers (`_mx_words`; one
      H100, `small`: 1 / 4 tokens 15 / 36 -> 12 / 27 µs against byte tiles). Stages 2 (AHEAD): each K step's loads issue
      before the previous step's FMAs, at 167 registers against 128 (3 programs an SM, not 4): where the grid fits one
      wave of those or the K loop runs 8 steps or more (one H100, `small`, 8-16 layers' weights a graph, µs: the dense
      MLP's glu at 1 / 2 rows 26.8 / 29.7 -> 26.5 / 29.1; the routed experts at 2 / 4 tokens 21.7 / 35.7 -> 21.9 / 36.3,
      so stages 1 there). With every GEMV loading ahead, decode replays took batch 1 1.895 -> 1.866 ms and batch 4 2.669
      -> 2.708 (the engine with this rule is not measured yet).
    - many experts (`wide`), m ≤ 40: BM 32 with BN 128 (up BK 64, down BK 128 in 3 stages); at 192 /
      320 tokens of `small` 7 / 10 % faster than BN 64, and BM 64 wins from m = 48 (512 tokens: −25 %;
      bench/kernels_moe.py's sweep on the H200).
    - one dense matrix (E = k = 1: glu_linear), below 2,048 rows: one row block up to 64 rows (a weight larger
      than L2 is streamed once), then the widest N tile that still gives ≥ 256 programs. The expert
      tiers gave it 16-32 programs from 17 rows on (`bench/kernels_moe.py --glu`, H200, `small`
      shared experts: 15.2 → 9.7 µs at 64 rows, 38.8 → 15.4 at 320, 38.8 → 23.7 at 1,024; the dense
      MLP [2·8192, 2048] at 64 rows 24.1 µs; K3 width 75.7 → 54.9 at 64, 204 → 189 at 512).
    - m ≤ 192: BM 64, BN 128 (two accumulators in up: a 64×256 wgmma tile). Larger: BM 128, up BN 128 and
      down BN 256, 8 warps, and the align kernels that reserve rows (`reserve`). Padding each expert to BM costs
      ~BM/2 rows per expert, which is why BM grows only with m (K3 at 8 K tokens: m ≈ 146). One H100, `small`
      (bench/kernels_moe.py --per-kernel, 2026-12-07), 8,192 / 16,384 tokens against down BN 128 and atomics an
      assignment: down 230.6 / 414.6 -> 207.0 / 366.4 µs, align 44.8 / 85.8 -> 20.7 / 27.2 µs (each change
      alone; the op 0.796 / 1.466 -> 0.773 / 1.430 ms with BN 256, 0.783 / 1.448 with reserve). Both together,
      one run: 0.793 / 1.489 -> 0.757-0.765 / 1.385-1.405 ms (408 / 447 TFLOP/s); 4,096 tokens 0.460 -> 0.452.
    - BM ≥ 64 (bf16): weight tiles (and down's h tiles) through TMA descriptors (`tma`): on the H200 at
      `small` (bench/kernels_moe.py --tma, 2026-12-03) 4,096 / 8,192 / 16,384 tokens took 0.425 / 0.761 /
      1.415 ms against 0.448 / 0.807 / 1.510 with pointer loads (363 / 406 / 437 TFLOP/s), and the same at
      512-1,024 tokens; a 4,096-token prefill graph 0.5 ms less.
    Shared memory per stage (bf16): up (BM + 2·BN)·BK·2, down (BM + BN)·BK·2, all ≤ 192 KB of 228.
    mxfp4: the same tiles but never `wide` (a weight tile is a quarter of the bytes), BK at least 64 (two exponent
    groups), 3 stages up to BM 32. Expansion (`decode`): the PTX bit placement (2). Until 2026-12-06 BM 32 took
    tl.dot_scaled (0), 9 % faster than the PTX in k order; in `_halves` order (`_halves_for`) the PTX took 111 µs at 256
    tokens against tl.dot_scaled's 116 (one H100, `small`). H200, `small`, µs, d2 against d0 (bench/kernels_mxfp4.py,
    2026-12-04): GEMV 1 token 15 (d1 18), 2 tokens 21 (d1 28); BM 16 at 4 / 16 / 64 tokens 39 / 71 / 78 against 45 / 85
    / 91; BM 32 at 256 tokens 130 against 116; BM 64 at 1,024 229 against 266; BM 128 at 8,192 1,161 against 1,270. (The
    byte-table expansion that decode 2 was before: 41 / 78 / 87 at 4 / 16 / 64 tokens, 239 and 1,218 at 1,024 and 8,192,
    same run.) experts_mxfp4_config takes decode 3 for 2 where the exponents allow (2026-12-05, µs, d2 against d3: GEMV
    1 token 15.7 / 15.0; BM 16 at 4 / 32 / 64 / 128 tokens 34.3 / 75.6 / 75.7 / 88.8 against 33.7 / 73.3 / 72.0 / 84.5,
    16 tokens 62.8 / 63.5; at BM 32 d3 is 9 % slower than d0). MXFP4 leaves BM 32 above m = 40, as bf16 does where it is
    `wide`: on an H100 (2026-12-05), 512 tokens (m = 48) took 181 µs in BM 32 with d0 and 158 in BM 64 with d3 (bf16:
    177), while at 256 BM 32 with d0 stayed the fastest (113 against 137 in BM 64 with d3). Its BM 64 tiles run 8 warps:
    448 / 512 tokens 147 / 146 µs against 157 / 160 with 4 (H100, bench/kernels_mxfp4.py --sweep, 2026-12-05; BM 32 with
    d0 stayed ahead at 320 / 384, 129 / 147 against 133 / 152).
    """
    here = -(-T * k // ep)  # the assignments this rank expects; the others' are skipped
    m = here / max(E, 1)
    # the experts hit fill 2 waves of BN-128 tiles (bf16: MXFP4 was not measured with them)
    wide = not mxfp4 and min(E, here) * triton.cdiv(I, 128) >= TWO_WAVES
    if E == 1 and k == 1 and T < 2048:  # glu_linear
        bm = max(16, min(64, triton.next_power_of_2(T)))
        bn = next((b for b in (128, 64, 32) if triton.cdiv(T, bm) * triton.cdiv(I, b) >= 256), 16)
        up = down = (bn, 128, 4, 3) if T <= 64 else (bn, 64, 4, 4)
    elif m <= 16:
        blocks = min(E, here)  # ≈ the experts hit: one row block each

        def bn(N: int) -> int:  # the widest N tile that still gives >= 2 waves of programs
            return next((b for b in (64, 32) if blocks * triton.cdiv(N, b) >= TWO_WAVES), 16)

        # MXFP4 below 2 rows an expert: up in K steps of 256 (two exponent words), down too below 1 row
        up_bk, down_bk = (256 if mxfp4 and m <= 2 else 128), (256 if mxfp4 and m < 1 else 128)
        bm, up, down = 16, (bn(I), up_bk, 4, 4), (bn(D), down_bk, 4, 4)
    elif wide and m <= 40:
        bm, up, down = 32, (128, 64, 4, 4), (128, 128, 4, 3)
    elif m <= (40 if mxfp4 else 64) and not wide:
        bm, up, down = 32, (64, 128, 4, 4), (64, 128, 4, 4)
    elif m <= 192:  # MXFP4's expansion is issue-bound: 8 warps
        w = 8 if mxfp4 else 4
        bm, up, down = 64, (128, 64, w, 4), (128, 64, w, 4)
    else:  # MXFP4's expansion in registers was not measured with down's BN 256
        bm, up, down = 128, (128, 64, 8, 4), ((128 if mxfp4 else 256), 64, 8, 3)

    gemv = None
    if T * k <= GEMV_ROWS and m <= GEMV_PER_MATRIX:  # rows a program: fewer where 16 would not fill 2 waves
        bn = next((b for b in (16, 8, 4) if T * k * triton.cdiv(I, b) >= TWO_WAVES), 2)
        bk = min(1024 if bn <= 4 else 256, max(16, triton.next_power_of_2(D)))
        # loads a K step ahead (stages 2) where the grid fits one wave at the 3 programs an SM that its registers
        # allow, or the K loop is long (the dense MLP's 2,048 in steps of 256); else 1 (GEMV_AHEAD_PROGRAMS). MXFP4
        # too: alone, over 8 copies of the weights, 1 token took 11.6 µs ahead against 10.4 not (one H100, `small`),
        # but in the engine not ahead made batch-1 ITL p50 1.82 -> 1.85 ms (MXFP4 experts, runs A B A: 1.82, 1.85, 1.82)
        ahead = T * k * triton.cdiv(I, bn) <= GEMV_AHEAD_PROGRAMS or triton.cdiv(D, bk) >= 8
        gemv = (bn, bk, 4, 2 if ahead else 1)

    def fit(tiles: tuple[int, int, int, int], N: int, K: int) -> tuple[int, int, int, int]:
        bn, bk, warps, stages = tiles  # tiny test sizes: no tile wider than the (padded) matrix
        bk = min(bk, max(16, triton.next_power_of_2(K)))
        if mxfp4 and bm <= 32:  # a quarter of the bytes in flight per stage, but 3 beat 4 (H200, small:
            stages = 3  # 86 vs 89 us at 16 tokens, 91 vs 95 at 64, 130 vs 142 at 320)
        return min(bn, max(16, triton.next_power_of_2(N))), max(64, bk) if mxfp4 else bk, warps, stages

    decode = 2 if mxfp4 else 0
    fragments = (64, 4, 64, 2) if mxfp4 and bm == 16 and 2 < m <= 8 else None  # moe_fragments' docstring
    return ExpertsConfig(bm, fit(up, I, D), fit(down, D, I), decode=decode, gemv=gemv,
                         tma=bm >= 64 and not mxfp4, fragments=fragments, reserve=bm == 128)


_TABLES: dict[tuple[Activation, torch.device], torch.Tensor] = {}


def _act_table(act: Activation, device: torch.device) -> torch.Tensor | None:
    """[2, 65536] fp32: `_gate` and `_up` of every bf16 value, built once per activation and device by
    the kernels' own math, so a lookup gives the bits the epilogue would compute. None while a CUDA
    graph is being captured and the table is not built yet: kernels recorded there would only run at
    replay (the engine's warm-up runs outside the capture build it first)."""
    key = (act, device)
    if key not in _TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        situ, lam = act.kind == "situ", act.linear_beta
        table = torch.empty(2, 65536, dtype=torch.float32, device=device)
        _act_table_kernel[(65536 // 1024,)](
            table, inv_beta=1.0 / act.beta if situ else 1.0, beta=float(act.beta) if situ else 1.0,
            inv_lam=1.0 / lam if lam else 1.0, lam=float(lam) if lam else 1.0, ACT=int(situ),
            HAS_LAMBDA=situ and lam is not None, GPU=_GPU, BLOCK=1024, num_warps=4)
        _TABLES[key] = table
    return _TABLES[key]


def expand_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`moe_ref.dequant_mxfp4` in one launch for experts [E, N, K/2] codes and [E, N, K/32] exponents (K a multiple
    of 32, unit inner strides: `experts_mxfp4_supports` checks both): [E, N, K] in dtype, bit-equal (every MXFP4
    value is exact in bf16)."""
    E, N, half = packed.shape
    K = 2 * half
    out = torch.empty(E, N, K, dtype=dtype, device=packed.device)
    bk = next(b for b in (256, 128, 64, 32) if K % b == 0)
    if out.numel():
        _expand_kernel[(triton.cdiv(N, 32), K // bk, E)](
            packed, scale, out, N, packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
            out.stride(1), GPU=_GPU, BLOCK_R=32, BLOCK_K=bk, num_warps=4)
    return out


def _code_words(w: torch.Tensor) -> torch.Tensor | None:
    """MXFP4 codes viewed as int32 words of 8 codes for the GEMV kernels, or None where the view is not legal
    (a row of whole exponent groups is whole words; an odd view's strides or offset may not be)."""
    if w.shape[-1] % 4 or w.stride(-1) != 1 or w.storage_offset() % 4 or any(st % 4 for st in w.stride()[:-1]):
        return None
    return w.view(torch.int32)


def _exponent_words(s: torch.Tensor | None, bk: int) -> tuple[torch.Tensor | None, int]:
    """(exponents to pass, SW): s viewed as int32 words of 4 exponents, SW = BK/128 of them a K step, where
    K steps hold whole words and the view is legal (K a multiple of 128, strides and offset in whole words:
    `small`'s and K3's widths, and K3's TP shards of I); else s as bytes, SW 0."""
    if s is None or bk < 128 or s.shape[-1] % 4 or s.stride(-1) != 1 or s.storage_offset() % 4 \
            or any(st % 4 for st in s.stride()[:-1]):
        return s, 0
    return s.view(torch.int32), bk // 128


def _launch_up(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, h: torch.Tensor,
               sorted_ids: torch.Tensor | None, block_expert: torch.Tensor | None, n: int, k: int, act: Activation,
               cfg: ExpertsConfig, *, dense: bool, round_gu: bool, ids: torch.Tensor | None = None) -> None:
    """The gate-up GEMM + activation over n rows: sorted expert blocks, or (dense) x's rows against one w,
    or (cfg.gemv) the n assignments of `ids` in order. s: the MXFP4 exponents of w (then w holds codes, as
    `_code_words` for the GEMV kernels), or None for weights in x's dtype."""
    D, I = x.shape[1], w.shape[-2] // 2
    situ, lam = act.kind == "situ", act.linear_beta
    table = _act_table(act, x.device) if cfg.table and round_gu and h.dtype == torch.bfloat16 else None
    if cfg.gemv is not None:
        bn, bk, warps, stages = cfg.gemv
        _up_gemv_kernel[(n, triton.cdiv(I, bn))](
            x_ptr=x, w13_ptr=w, s13_ptr=w if s is None else s, h_ptr=h, ids_ptr=x if dense else ids,
            table_ptr=h if table is None else table, n=n, D=D, I=I, E=1 if dense else w.shape[0],
            stride_xt=x.stride(0), stride_we=0 if dense else w.stride(0), stride_wn=w.stride(-2),
            stride_se=0 if s is None or dense else s.stride(0), stride_sn=0 if s is None else s.stride(-2),
            stride_it=0 if dense else ids.stride(0), stride_ik=0 if dense else ids.stride(1), stride_hm=h.stride(0),
            inv_beta=1.0 / act.beta if situ else 1.0, beta=float(act.beta) if situ else 1.0,
            inv_lam=1.0 / lam if lam else 1.0, lam=float(lam) if lam else 1.0, TOP_K=k, ACT=int(situ),
            HAS_LAMBDA=situ and lam is not None, DENSE=dense, ROUND_GU=round_gu, TABLE=table is not None, GPU=_GPU,
            EVEN_K=D % bk == 0, MX=s is not None, DECODE=cfg.decode, AHEAD=stages > 1, BLOCK_N=bn, BLOCK_K=bk,
            **pdl.launch_args(x.device), num_warps=warps,
            num_stages=stages,
        )
        return
    nb = triton.cdiv(n, cfg.block_m) if dense else block_expert.numel()
    bn, bk, warps, stages = cfg.up
    w_desc = _desc(w, bn, bk) if cfg.tma and s is None and I % bn == 0 else None
    x_desc = None
    if cfg.xtma and w_desc is not None and not dense:  # x in row-block order (padding and unused rows: any row)
        x_desc = _desc(x.index_select(0, sorted_ids.clamp(0, n - 1) // k), cfg.block_m, bk)
    s, sw = _exponent_words(s, bk)
    _up_kernel[(nb * triton.cdiv(I, bn),)](
        x_ptr=x, x_desc=x if x_desc is None else x_desc, w13_ptr=w, s13_ptr=w if s is None else s,
        w_desc=w if w_desc is None else w_desc, h_ptr=h,
        sorted_ptr=x if dense else sorted_ids, block_expert_ptr=x if dense else block_expert,
        table_ptr=h if table is None else table, n=n, D=D, I=I, num_blocks=nb, stride_xt=x.stride(0),
        stride_we=0 if dense else w.stride(0), stride_wn=w.stride(-2), stride_se=0 if s is None else s.stride(0),
        stride_sn=0 if s is None else s.stride(-2), stride_hm=h.stride(0),
        inv_beta=1.0 / act.beta if situ else 1.0, beta=float(act.beta) if situ else 1.0,
        inv_lam=1.0 / lam if lam else 1.0, lam=float(lam) if lam else 1.0, TOP_K=k, ACT=int(situ),
        HAS_LAMBDA=situ and lam is not None, DENSE=dense, ROUND_GU=round_gu, TABLE=table is not None, GPU=_GPU,
        EVEN_K=D % bk == 0, MX=s is not None, DECODE=cfg.decode, SW=sw, TMA=w_desc is not None,
        XTMA=x_desc is not None, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        **pdl.launch_args(x.device), num_warps=warps, num_stages=stages,
    )


def _desc(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor | None:
    """A TMA descriptor over contiguous t viewed [-1, t.shape[-1]] with tiles [rows, cols], or None where
    TMA cannot read it (before Hopper, rows not 16-byte aligned)."""
    K = t.shape[-1]
    if not t.is_contiguous() or (K * t.element_size()) % 16 or t.data_ptr() % 16 or not has_tma(t.device):
        return None
    return TensorDescriptor(t, [t.numel() // K, K], [K, 1], [rows, cols])


def _act_supported(act: Activation) -> tuple[bool, str]:
    if act.kind not in ("silu", "situ") or (act.kind == "situ" and act.beta == 0) or act.linear_beta == 0:
        return False, f"activation {act}: expected silu, or situ with beta != 0 and linear_beta None or != 0"
    return True, ""


def _routing_supported(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *tensors: torch.Tensor,
                       act: Activation, norm_weight: torch.Tensor | None) -> tuple[bool, str]:
    """What both experts ops need of x, the routing, the norm and the devices."""
    if norm_weight is not None and (norm_weight.shape != (x.shape[-1],) or norm_weight.stride(0) != 1
                                    or norm_weight.device != x.device or x.shape[-1] > norm_ops.MAX_WIDTH):
        return False, (f"norm_weight: expected [{x.shape[-1]}] (at most {norm_ops.MAX_WIDTH}) with unit stride on "
                       f"{x.device}, got {list(norm_weight.shape)} on {norm_weight.device}")
    if not (x.is_cuda or not _GPU):
        return False, "x not on a GPU"
    T = x.shape[0]
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype not in (torch.int32, torch.int64):
        return False, f"ids: expected int32/int64 [{T}, k], got {ids.dtype} {list(ids.shape)}"
    if tuple(weights.shape) != tuple(ids.shape) or weights.dtype != torch.float32:
        return False, f"weights: expected float32 {list(ids.shape)}, got {weights.dtype} {list(weights.shape)}"
    if any(t.stride(-1) != 1 for t in (x, *tensors)):
        return False, "x and the expert weights: expected unit stride in the last dimension"
    if len({t.device for t in (x, weights, ids, *tensors)}) != 1:
        return False, "x, weights, ids and the expert weights on different devices"
    return _act_supported(act)


def experts_supports(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, act: Activation, scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
                     norm_eps: float = 0.0, ep: int = 1) -> tuple[bool, str]:
    """(ok, reason): bf16/fp16 activations and weights of one dtype, fp32 routing weights, unit inner strides."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False, f"x: expected bfloat16 or float16, got {x.dtype} (fp32 tl.dot would use tf32)"
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return False, f"expected x [T, D], w13 [E, 2I, D], w2 [E, D, I], got {list(x.shape)}, " \
                      f"{list(w13.shape)}, {list(w2.shape)}"
    T, D = x.shape
    E, two_i, Dw = w13.shape
    I = two_i // 2
    if two_i % 2 or Dw != D or tuple(w2.shape) != (E, D, I):
        return False, f"expected w13 [E, 2I, {D}] and w2 [E, {D}, I], got {list(w13.shape)}, {list(w2.shape)}"
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False, f"weights: expected {x.dtype}, got w13 {w13.dtype}, w2 {w2.dtype}"
    return _routing_supported(x, weights, ids, w13, w2, act=act, norm_weight=norm_weight)


def experts_mxfp4_supports(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                           w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, act: Activation,
                           scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
                           norm_eps: float = 0.0, ep: int = 1) -> tuple[bool, str]:
    """(ok, reason): bf16 activations (fp16 cannot hold every E8M0 scale), uint8 codes and exponents
    of one expert layout, widths in whole groups of 32, unit inner strides."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        return False, f"x: expected bfloat16 [T, D], got {x.dtype} {list(x.shape)}"
    T, D = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        return False, f"expected w13 [E, 2I, D/2], w2 [E, D, I/2], got {list(w13.shape)}, {list(w2.shape)}"
    E, two_i, I = w13.shape[0], w13.shape[1], w2.shape[2] * 2
    want = {"w13": (E, two_i, D // 2), "w13_scale": (E, two_i, D // 32), "w2": (E, D, I // 2),
            "w2_scale": (E, D, I // 32)}
    got = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
    if D % 32 or I % 32 or two_i != 2 * I or any(tuple(got[n].shape) != want[n] for n in want):
        return False, (f"expected uint8 w13 [E, 2I, {D // 2}], w13_scale [E, 2I, {D // 32}], w2 [E, {D}, I/2], "
                       f"w2_scale [E, {D}, I/32] with D, I multiples of 32, got "
                       + ", ".join(f"{n} {list(t.shape)}" for n, t in got.items()))
    if any(t.dtype != torch.uint8 for t in got.values()):
        return False, "MXFP4 codes and exponents: expected uint8, got " + ", ".join(
            f"{n} {t.dtype}" for n, t in got.items())
    return _routing_supported(x, weights, ids, *got.values(), act=act, norm_weight=norm_weight)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            act: Activation, scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
            norm_eps: float = 0.0, ep: int = 1) -> torch.Tensor:
    """Routed experts with SGLang's rounding points (§7.4); see moe_ref.experts. Returns [T, D] in x.dtype."""
    (T, D), k = x.shape, ids.shape[1]
    cfg = experts_config(T, k, w13.shape[0], D, w13.shape[1] // 2, ep=ep)
    return experts_with(x, weights, ids, w13, w2, act, scaling, cfg, norm=_norm(norm_weight, norm_eps))


def experts_mxfp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, act: Activation,
                  scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
                  norm_eps: float = 0.0, ep: int = 1) -> torch.Tensor:
    """Routed experts on MXFP4 weights (§7.4, §7.7), w4a16: the same kernels, which read the packed
    codes and exponents and expand them to bf16 in registers; see moe_ref.experts_mxfp4."""
    (T, D), k = x.shape, ids.shape[1]
    cfg = experts_mxfp4_config(T, k, w13.shape[0], D, w2.shape[2] * 2, w13_scale, w2_scale, ep=ep)
    return experts_with(x, weights, ids, w13, w2, act, scaling, cfg, (w13_scale, w2_scale),
                        _norm(norm_weight, norm_eps))


def _norm(weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, float] | None:
    return None if weight is None else (weight, eps)


def experts_mxfp4_config(T: int, k: int, E: int, D: int, I: int, *scales: torch.Tensor, ep: int = 1) -> ExpertsConfig:
    """experts_config's MXFP4 tiles, with decode 3 for 2 where every exponent of `scales` is at most
    FOLD_MAX_EXPONENT (H200, `small`, .dev sweep of 2026-12-05: 2-5 % faster at 1-128 tokens, GEMV and BM 16).
    From EXPAND_ROWS rows an expert, where all the experts expanded fit EXPAND_BYTES: every expert expanded to bf16
    first, then bf16's tiles (`expand`). One H100, `small` (all 64 experts a chunk, against the MXFP4 tiles, µs):
    2,048 / 4,096 / 8,192 / 16,384 tokens (m = 192 / 384 / 768 / 1,536) 486 / 622 / 966 / 1,643 against 361 / 612 /
    1,132 / 2,137; 16 experts a chunk 596 / 740 / 1,117 / 1,843 (the other chunks' blocks still launch), so one."""
    if T * k >= EXPAND_ROWS * E * ep and 3 * E * D * I * 2 <= EXPAND_BYTES:
        return replace(experts_config(T, k, E, D, I, ep=ep), expand=E)
    cfg = experts_config(T, k, E, D, I, mxfp4=True, ep=ep)
    if cfg.decode == 2 and max(map(_max_exponent, scales), default=0) <= FOLD_MAX_EXPONENT:
        cfg = replace(cfg, decode=3)
    return cfg


FOLD_MAX_EXPONENT = 128  # decode 3's bound: the scale 2^(s-1) must be a finite bf16
EXPAND_ROWS = 512  # mean rows an expert (T·k/E) from which MXFP4 experts are expanded first (4,096 tokens: a tie)
EXPAND_BYTES = 2**30  # the most bf16 scratch that expansion may take (all of `small`'s experts: 403 MB)


def _max_exponent(scale: torch.Tensor) -> int:
    """The largest E8M0 exponent of `scale`, kept on the tensor (`_k3_max_exponent`, with its version, so an
    in-place change is seen): one device sync per weight, at its first call. Unknown while a CUDA graph is
    being captured: 255, so the graph records decode 2 (the engine's warm-up runs outside the capture first)."""
    seen = getattr(scale, "_k3_max_exponent", None)
    if seen is not None and seen[0] == scale._version:
        return seen[1]
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return 255
    value = int(scale.max()) if scale.numel() else 0
    scale._k3_max_exponent = (scale._version, value)
    return value


def experts_with(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 act: Activation, scaling: float, cfg: ExpertsConfig,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """`experts` (or, with scales = (w13_scale, w2_scale), `experts_mxfp4`) with explicit tiles
    (bench/kernels_moe.py --sweep compares configs with it); norm = (weight, eps): the sum's RMSNorm too."""
    T, D = x.shape
    k = ids.shape[1]
    E = w13.shape[0]
    I = w13.shape[1] // 2
    s13, s2 = scales if scales is not None else (None, None)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()  # the norm of a zero row is zero
    if cfg.gemv is not None and s13 is not None:  # the GEMV kernels read MXFP4 codes as int32 words
        words = _code_words(w13), _code_words(w2)
        if None in words:
            cfg = replace(cfg, gemv=None)
        else:
            w13, w2 = words
    if cfg.gemv is not None:  # a few rows: assignment order, no align step
        h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
        y = torch.empty(T * k, D, dtype=x.dtype, device=x.device)
        _launch_up(x, w13, s13, h, None, None, T * k, k, act, cfg, dense=False, round_gu=True, ids=ids)
        bn, bk, warps, stages = cfg.gemv
        _down_gemv_kernel[(T * k, triton.cdiv(D, bn))](
            h_ptr=h, w2_ptr=w2, s2_ptr=w2 if s2 is None else s2, y_ptr=y, weights_ptr=weights, ids_ptr=ids, n=T * k,
            D=D, I=I, E=E, stride_hm=h.stride(0), stride_we=w2.stride(0), stride_wn=w2.stride(1),
            stride_se=0 if s2 is None else s2.stride(0), stride_sn=0 if s2 is None else s2.stride(1),
            stride_yn=y.stride(0), stride_it=ids.stride(0), stride_ik=ids.stride(1), stride_pt=weights.stride(0),
            stride_pk=weights.stride(1), TOP_K=k, GPU=_GPU, EVEN_K=I % bk == 0, MX=s2 is not None,
            DECODE=cfg.decode, AHEAD=stages > 1, BLOCK_N=bn, BLOCK_K=bk, EARLY=pdl.early(T),
            **pdl.launch_args(x.device), num_warps=warps, num_stages=stages,
        )
        return _sum(y, ids, out, E, scaling, norm)
    sorted_ids, block_expert = _align(ids, E, cfg.block_m, cfg.reserve)
    h = torch.empty(sorted_ids.numel(), I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * k, D, dtype=x.dtype, device=x.device)
    if cfg.fragments and s13 is not None:
        from k3backend.kernels import moe_fragments  # (it imports this module)

        table = _act_table(act, x.device) if cfg.table else None
        if moe_fragments.supports(x, w13, s13, w2, s2, cfg.decode, table, cfg.fragments):
            moe_fragments.up(x, w13, s13, h, sorted_ids, block_expert, table, T * k, k, cfg.decode, cfg.fragments[:2])
            moe_fragments.down(h, w2, s2, y, weights, sorted_ids, block_expert, T * k, k, cfg.decode,
                               cfg.fragments[2:])
            return _sum(y, ids, out, E, scaling, norm)
    if cfg.expand and s13 is not None:  # MXFP4 expanded to bf16 a chunk of experts at a time, then bf16 tiles
        for e0 in range(0, E, cfg.expand):
            e1 = min(E, e0 + cfg.expand)
            chunk = block_expert if e1 - e0 == E else torch.where(
                (block_expert >= e0) & (block_expert < e1), block_expert - e0, -1)  # other experts' blocks: -1
            w13_e, w2_e = expand_mxfp4(w13[e0:e1], s13[e0:e1], x.dtype), expand_mxfp4(w2[e0:e1], s2[e0:e1], x.dtype)
            _tiles(x, w13_e, None, w2_e, None, h, y, weights, sorted_ids, chunk, T * k, k, act, cfg)
    else:
        _tiles(x, w13, s13, w2, s2, h, y, weights, sorted_ids, block_expert, T * k, k, act, cfg)
    return _sum(y, ids, out, E, scaling, norm)


def _tiles(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
           h: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
           block_expert: torch.Tensor, n: int, k: int, act: Activation, cfg: ExpertsConfig) -> None:
    """Steps 2 and 3 by the MMA tiles over the sorted expert blocks (s13, s2: MXFP4 exponents, or None)."""
    D, I, nb = x.shape[1], h.shape[1], block_expert.numel()
    _launch_up(x, w13, s13, h, sorted_ids, block_expert, n, k, act, cfg, dense=False, round_gu=True)
    bn, bk, warps, stages = cfg.down
    tma = cfg.tma and s2 is None and D % bn == 0
    s2, sw = _exponent_words(s2, bk)
    h_desc, w_desc = (_desc(h, cfg.block_m, bk), _desc(w2, bn, bk)) if tma else (None, None)
    tma = h_desc is not None and w_desc is not None
    _down_kernel[(nb * triton.cdiv(D, bn),)](
        h_ptr=h, w2_ptr=w2, s2_ptr=w2 if s2 is None else s2, h_desc=h_desc if tma else h,
        w_desc=w_desc if tma else w2, y_ptr=y, weights_ptr=weights, sorted_ptr=sorted_ids,
        block_expert_ptr=block_expert, n=n, D=D, I=I, num_blocks=nb, stride_hm=h.stride(0),
        stride_we=w2.stride(0), stride_wn=w2.stride(1), stride_se=0 if s2 is None else s2.stride(0),
        stride_sn=0 if s2 is None else s2.stride(1), stride_yn=y.stride(0), stride_pt=weights.stride(0),
        stride_pk=weights.stride(1), TOP_K=k, GPU=_GPU, EVEN_K=I % bk == 0, MX=s2 is not None, DECODE=cfg.decode,
        SW=sw, TMA=tma, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, **pdl.launch_args(x.device),
        num_warps=warps, num_stages=stages,
    )


def _sum(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, E: int, scaling: float,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """out [T, D] = bf(scaling · Σ_j y[t·k + j]) over the slots of this rank's experts (step 4); norm = (weight,
    eps): then its RMSNorm in the same kernel (whole rows a program, as norm.py's row kernel takes them)."""
    (T, D), k = out.shape, ids.shape[1]
    if norm is None:
        block_d = min(1024, triton.next_power_of_2(D))
        block_t, warps = max(1, 2048 // block_d), 8
    else:
        block_d, block_t, warps = norm_ops.row_config(D, T)
    _sum_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
        y_ptr=y, ids_ptr=ids, out_ptr=out, norm_w_ptr=out if norm is None else norm[0], T=T, D=D, E=E,
        scaling=float(scaling), eps=0.0 if norm is None else float(norm[1]), stride_yn=y.stride(0),
        stride_it=ids.stride(0), stride_ik=ids.stride(1), stride_ot=out.stride(0), TOP_K=k, GPU=_GPU,
        NORM=norm is not None, BLOCK_T=block_t, BLOCK_D=block_d, **pdl.launch_args(out.device), num_warps=warps,
        enable_fp_fusion=norm_ops.FP_FUSION,
    )
    return out


# ----------------------------------------------------------------------------- dense GLU (shared experts)
def glu_linear_supports(x: torch.Tensor, w_gu: torch.Tensor, act: Activation,
                        fp32_front: bool = False) -> tuple[bool, str]:
    """(ok, reason): bf16/fp16 x [T, D] and w_gu [2I, D] of one dtype on a GPU, unit inner strides."""
    if not (x.is_cuda or not _GPU):
        return False, "x not on a GPU"
    if x.dtype not in (torch.bfloat16, torch.float16) or w_gu.dtype != x.dtype:
        return False, f"x, w_gu: expected bfloat16 or float16, both, got {x.dtype}, {w_gu.dtype}"
    if x.dim() != 2 or w_gu.dim() != 2 or w_gu.shape[1] != x.shape[1] or w_gu.shape[0] % 2:
        return False, f"expected x [T, D], w_gu [2I, D], got {list(x.shape)}, {list(w_gu.shape)}"
    if x.stride(1) != 1 or w_gu.stride(1) != 1 or w_gu.device != x.device:
        return False, "x, w_gu: expected unit stride in the last dimension, one device"
    return _act_supported(act)


def glu_linear(x: torch.Tensor, w_gu: torch.Tensor, act: Activation, fp32_front: bool = False) -> torch.Tensor:
    """act-and-mul of x·w_guᵀ in one kernel (§7.1, §7.5, §7.6); see moe_ref.glu_linear. Returns [T, I].

    The shared experts are not folded into `experts`: in K3 they read h (7168 wide) while the routed
    experts read the latent (3584), their width differs (6144 vs 3072) and their activation reads the
    fp32 GEMM output (§7.6). They are one dense GEMM with the activation in its epilogue instead.
    """
    T, D = x.shape
    I = w_gu.shape[0] // 2
    h = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T == 0:
        return h
    cfg = experts_config(T, 1, 1, D, I)
    _launch_up(x, w_gu, None, h, None, None, T, 1, act, cfg, dense=True, round_gu=not fp32_front)
    return h
