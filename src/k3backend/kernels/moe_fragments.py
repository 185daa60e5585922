"""The routed experts' MXFP4 GEMMs for 16-row blocks (the decode tier of `moe.experts_config`, m <= 16) in
Gluon, Triton's dialect with explicit layouts: each thread loads exactly the code words its mma.sync B
fragments hold and the PTX turns each word into four of those fragment registers, with no shared memory
and no register shuffles between load and MMA (Marlin's idea, on the checkpoint's own row-major codes).

A K step is 128 k of a weight row: 16 int32 words of 8 codes. mma.m16n8k16 with the operands' k width 8
gives lane q (0-3, lane % 4) the MMA k indices kappa = 32c + 8q + 2j + b (c, j < 4, b < 2). Lane q reads
the 4 words of k 32q .. 32q + 31; `_E2M1_PAIRS` makes each word c into 4 bf16x2 registers, register j
holding its nibbles (j, j + 4): model k = 32q + 8c + j + 4b. The activations take the same map, so the MMA
sums the same products as the model's row times column (in another order). A lane's activations are 32
consecutive k of a row (64 bytes), its codes 16 consecutive bytes a column: plain vector loads.

`moe.experts_config` gives them MXFP4's BM 16 tier from 2 to 8 rows an expert (`ExpertsConfig.fragments`) and
`moe.experts_with` runs them where `supports` says (a GPU with Gluon, MXFP4 expanded by PTX, K widths a
multiple of 128, the activation's table); elsewhere moe.py's Triton kernels run the same tier. Gluon has no
interpreter: CI compiles both kernels for sm_90a (tests/test_kernels_moe.py) and checks the k map in torch
(`KAPPA_A`, `KAPPA_B`); bench/kernels_mxfp4.py checks every element on a GPU.
"""

from __future__ import annotations

import torch
import triton

from k3backend.kernels.moe import _code_words, _e2m1_pair, _word_pairs, _word_ptx_head

try:  # Gluon ships with triton >= 3.4; without it the Triton kernels run this tier
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - an older triton
    gluon = None

# The tiles `moe.experts_config` gives them, (BLOCK_N, warps) up and down: (64, 4) and (64, 2), from .dev scratch
# timings of each kernel alone (one H100, `small`, 8-128 tokens:
# (64, 4) and (32, 2) the best up, (64, 2) and (128, 4) the best down; staging the codes through shared memory
# by cp.async in 3-6 stages, loading a K step ahead in registers, and an L2 bulk prefetch of a program's rows
# were each slower). No PDL: launched with it (wait, then release the next kernel, as moe.py's kernels do),
# decode replays at batch 16 / 32 / 64 took 3.412 / 3.895 / 4.535 -> 3.601 / 4.102 / 4.780 ms; plainly, 3.415 /
# 3.900 / 4.545 -> 3.374 / 3.828 / 4.472 (H100, `small`, MXFP4, bench/gpu_ab.sh against 2830414). The routed
# experts of one layer (align, up, down, sum; bench/kernels_mxfp4.py, µs, against moe.py's BM 16 tiles), 24 /
# 32 / 64 / 80 tokens: 63 / 64 / 66 / 66 against 69 / 70 / 71 / 73; but 8 / 16 tokens 50 / 60 against 49 / 57,
# where moe.py's tiles read K in steps of 256, and 96 / 112 / 128 tokens 79 / 82 / 83 against 74 / 75 / 80. So
# `moe.experts_config` takes these kernels from 2 to 8 rows an expert (`small`: 22-85 tokens). There, decode
# replays at batch 32 / 64: 3.838 / 4.514 -> 3.804 / 4.439 ms (batch 1-16 unchanged, logits bit-equal).
K_STEP = 128
# The k maps, as the kernels write them (Gluon takes no tuple constant there; a test reads their source): the
# activations [16, 4 q, 32] viewed [m, q, c, b, j1, j0] and permuted to [m, c, q, j1, j0, b]; the PTX's outputs
# joined to [c, q, n, b, j0, j1] and permuted to [c, q, j1, j0, b, n].
KAPPA_A = (0, 2, 1, 4, 5, 3)
KAPPA_B = (0, 1, 5, 4, 3, 2)


def _pairs_ptx(bias: bool) -> str:
    """$4 (= $5): one int32 word of 8 codes, $6 (= $7) its scale as bf16x2 -> $0-$3: bf16x2 of nibbles (j, j + 4),
    by `moe._e2m1_pair` (bias: times 2^126 too, decode 2; else the scale carries it, decode 3)."""
    pairs = _word_pairs("$4")
    return _word_ptx_head(bias, "a, b, k, nz") + "".join(_e2m1_pair(f"${j}", mag, sign, "$6", bias)
                                                         for j, (mag, sign) in enumerate(pairs)) + "}"


def available() -> bool:
    return gluon is not None


if gluon is not None:
    _E2M1_PAIRS = gl.constexpr(_pairs_ptx(True))
    _E2M1_PAIRS_FOLDED = gl.constexpr(_pairs_ptx(False))

    @gluon.constexpr_function
    def _layouts(BN, WARPS):
        """(the accumulator [16, BN], warps along N; the B operand [128, BN]; the A operand [16, 128]; code words
        [4 c, 4 q, BN]: 16 bytes a lane and column; activations [16 m, 4 q, 32]: 64 bytes a lane and row)."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
        n_warps = [[0, 0, 8 << i] for i in range(WARPS.bit_length() - 1)]
        n_regs = [[0, 0, (8 * WARPS) << i] for i in range((BN // (8 * WARPS)).bit_length() - 1)]
        words = gl.DistributedLinearLayout(reg_bases=[[1, 0, 0], [2, 0, 0]] + n_regs,
                                           lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                           warp_bases=n_warps, block_bases=[], shape=[4, 4, BN])
        acts = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 0]] * (WARPS.bit_length() - 1), block_bases=[], shape=[16, 4, 32])
        return mma, gl.DotOperandLayout(1, mma, 8), gl.DotOperandLayout(0, mma, 8), words, acts

    @gluon.jit
    def _acts(ptrs, BN: gl.constexpr, WARPS: gl.constexpr):
        """One K step of activations [16, 4 q, 32] (k = 32q + 8c + 4b + 2j1 + j0) as the MMA's A operand."""
        A_OP: gl.constexpr = _layouts(BN, WARPS)[2]
        a = gl.load(ptrs).reshape(16, 4, 4, 2, 2, 2).permute(0, 2, 1, 4, 5, 3).reshape(16, 128)
        return gl.convert_layout(a, A_OP, assert_trivial=True)

    @gluon.jit
    def _weights(w_ptrs, s_ptrs, BN: gl.constexpr, WARPS: gl.constexpr, DECODE: gl.constexpr):
        """One K step of MXFP4 rows (code words [4 c, 4 q, BN], exponent bytes [4 q, BN]) as the B operand."""
        B_OP: gl.constexpr = _layouts(BN, WARPS)[1]
        words = gl.load(w_ptrs)
        sx2 = (gl.load(s_ptrs).to(gl.int32) + (126 if DECODE == 3 else 0)) * 0x800080  # 2^(s-127) (3: 2^(s-1))
        scale = gl.broadcast(gl.expand_dims(sx2, 0), words)[0]
        asm: gl.constexpr = _E2M1_PAIRS_FOLDED if DECODE == 3 else _E2M1_PAIRS
        # pack 2 over a joined copy: each call gets the word twice and fills 4 bf16x2 registers
        o0, o1, o2, o3 = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r,r",
                                                   [gl.join(words, words), gl.join(scale, scale)],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
        w = gl.join(gl.join(o0, o1), gl.join(o2, o3)).permute(0, 1, 5, 4, 3, 2).reshape(128, BN)
        return gl.convert_layout(w, B_OP, assert_trivial=True)

    @gluon.jit
    def _word_ptrs(w_ptr, s_ptr, e, n0, stride_we, stride_wn, stride_se, stride_sn, BN: gl.constexpr,
                   WARPS: gl.constexpr):
        """Pointers of the first K step of rows n0 .. n0 + BN of expert e: words [4 c, 4 q, BN] (stride_* in
        words) and exponent bytes [4 q, BN]; step them by 16 and 4."""
        WL: gl.constexpr = _layouts(BN, WARPS)[3]
        SL: gl.constexpr = gl.SliceLayout(0, WL)
        c = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL))), 1), 2)
        q = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL))), 0), 2)
        n = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))).to(gl.int64)
        w = w_ptr + e.to(gl.int64) * stride_we + gl.expand_dims(gl.expand_dims(n * stride_wn, 0), 1) + q * 4 + c
        qs = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, SL)), 1)
        ns = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, SL))).to(gl.int64)
        return w, s_ptr + e.to(gl.int64) * stride_se + gl.expand_dims(ns * stride_sn, 0) + qs

    @gluon.jit
    def _block(block_expert_ptr, N, BN: gl.constexpr):
        """(row block, first column, expert; -1: an unused block) of this program: blocks sweep N."""
        n_tiles = gl.cdiv(N, BN)
        pid_m = gl.program_id(0) // n_tiles
        return pid_m, (gl.program_id(0) % n_tiles) * BN, gl.load(block_expert_ptr + pid_m)

    @gluon.jit
    def _act_ptrs(ptr, rows, stride, AL: gl.constexpr):
        """Pointers of the first K step of activation rows `rows` [16]: [16, 4 q, 32]; step them by 128."""
        q = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, AL))), 0), 2)
        kk = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, AL))), 0), 1)
        return ptr + gl.expand_dims(gl.expand_dims(rows * stride, 1), 2) + q * 32 + kk

    @gluon.jit(do_not_specialize=["n"])
    def _up_kernel(x_ptr, w13_ptr, s13_ptr, h_ptr, sorted_ptr, block_expert_ptr, table_ptr, n, D, I,
                   stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hm, TOP_K: gl.constexpr,
                   DECODE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """h[rows, n-block] = act(bf(x[tok]·w1ᵀ), bf(x[tok]·w3ᵀ)) by `moe._act_table` lookup, for one 16-row
        expert block (moe._up_kernel's MXFP4 tier): w13 int32 code words [E, 2I, D/8], s13 exponents [E, 2I, D/32]."""
        MMA: gl.constexpr = _layouts(BLOCK_N, WARPS)[0]
        AL: gl.constexpr = _layouts(BLOCK_N, WARPS)[4]
        pid_m, n0, e = _block(block_expert_ptr, I, BLOCK_N)
        if e < 0:
            return
        a_idx = gl.load(sorted_ptr + pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, AL))))
        tok = gl.where(a_idx < n, a_idx // TOP_K, 0).to(gl.int64)  # padding rows read token 0, never stored
        x_ptrs = _act_ptrs(x_ptr, tok, stride_xt, AL)
        g_ptrs, gs_ptrs = _word_ptrs(w13_ptr, s13_ptr, e, n0, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N,
                                     WARPS)
        acc_g = gl.zeros([16, BLOCK_N], gl.float32, MMA)
        acc_u = gl.zeros([16, BLOCK_N], gl.float32, MMA)
        for k in range(D // 128):
            a = _acts(x_ptrs + k * 128, BLOCK_N, WARPS)
            acc_g = mma_v2(a, _weights(g_ptrs + k * 16, gs_ptrs + k * 4, BLOCK_N, WARPS, DECODE), acc_g)
            acc_u = mma_v2(a, _weights(g_ptrs + (I * stride_wn + k * 16), gs_ptrs + (I * stride_sn + k * 4), BLOCK_N,
                                       WARPS, DECODE), acc_u)
        gi = acc_g.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.int32)  # the reference rounds gu first
        ui = acc_u.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.int32)
        h = (gl.load(table_ptr + gi) * gl.load(table_ptr + 65536 + ui)).to(h_ptr.dtype.element_ty)
        rows = pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        real = gl.load(sorted_ptr + rows) < n
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        gl.store(h_ptr + gl.expand_dims(rows.to(gl.int64) * stride_hm, 1) + gl.expand_dims(cols, 0), h,
                 mask=gl.expand_dims(real, 1) & gl.expand_dims(cols < I, 0))

    @gluon.jit(do_not_specialize=["n"])
    def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, n, D, I, stride_hm,
                     stride_we, stride_wn, stride_se, stride_sn, stride_yn, stride_pt, stride_pk, TOP_K: gl.constexpr,
                     DECODE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """y[a, n-block] = bf(w_a · fp32(h[row]·w2ᵀ)) for one 16-row expert block (moe._down_kernel's MXFP4
        tier): w2 int32 code words [E, D, I/8], s2 exponents [E, D, I/32]. A padding row's h was never written:
        its product row is garbage, and never stored."""
        MMA: gl.constexpr = _layouts(BLOCK_N, WARPS)[0]
        AL: gl.constexpr = _layouts(BLOCK_N, WARPS)[4]
        pid_m, n0, e = _block(block_expert_ptr, D, BLOCK_N)
        if e < 0:
            return
        rows_a = (pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, AL)))).to(gl.int64)
        h_ptrs = _act_ptrs(h_ptr, rows_a, stride_hm, AL)
        w_ptrs, s_ptrs = _word_ptrs(w2_ptr, s2_ptr, e, n0, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N,
                                     WARPS)
        acc = gl.zeros([16, BLOCK_N], gl.float32, MMA)
        for k in range(I // 128):
            acc = mma_v2(_acts(h_ptrs + k * 128, BLOCK_N, WARPS),
                         _weights(w_ptrs + k * 16, s_ptrs + k * 4, BLOCK_N, WARPS, DECODE), acc)
        a_idx = gl.load(sorted_ptr + pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, MMA)))
        real = a_idx < n
        a_safe = gl.where(real, a_idx, 0)
        wt = gl.load(weights_ptr + (a_safe // TOP_K) * stride_pt + (a_safe % TOP_K) * stride_pk, mask=real,
                     other=0.0)
        y = (acc * gl.expand_dims(wt, 1)).to(y_ptr.dtype.element_ty)
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        gl.store(y_ptr + gl.expand_dims(a_safe.to(gl.int64) * stride_yn, 1) + gl.expand_dims(cols, 0), y,
                 mask=gl.expand_dims(real, 1))


def supports(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
             decode: int, table: torch.Tensor | None, tiles: tuple[int, int, int, int]) -> bool:
    """Whether these kernels run this call: compiled for a GPU (not interpreted), Gluon present, and `fits`."""
    return gluon is not None and x.is_cuda and not triton.knobs.runtime.interpret and fits(x, w13, s13, w2, s2,
                                                                                            decode, table, tiles)


def fits(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, decode: int,
         table: torch.Tensor | None, tiles: tuple[int, int, int, int]) -> bool:
    """Whether the call is one the kernels take with these tiles (`ExpertsConfig.fragments`): bf16 activations,
    the PTX expansion (decode 2 or 3), the activation's table, K widths D and I whole K steps, N tiles whole
    (and at least 8 columns a warp), codes readable as int32 words, exponents with unit inner stride."""
    D, I = x.shape[1], w13.shape[1] // 2
    up_bn, up_warps, down_bn, down_warps = tiles
    return (x.dtype == torch.bfloat16 and decode in (2, 3) and table is not None and D % K_STEP == 0
            and I % K_STEP == 0 and I % up_bn == 0 and D % down_bn == 0 and up_bn % (8 * up_warps) == 0
            and down_bn % (8 * down_warps) == 0 and x.stride(1) == 1
            and w13.shape[2] * 2 == D and w2.shape[2] * 2 == I
            and _code_words(w13) is not None and _code_words(w2) is not None and s13.stride(-1) == 1
            and s2.stride(-1) == 1)


def up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, h: torch.Tensor, sorted_ids: torch.Tensor,
       block_expert: torch.Tensor, table: torch.Tensor, n: int, k: int, decode: int, tiles: tuple[int, int]) -> None:
    """The up step of `moe.experts_with` over 16-row blocks: w13 MXFP4 codes (uint8, viewed here as words);
    tiles (BLOCK_N, warps)."""
    D, I = x.shape[1], w13.shape[1] // 2
    words = _code_words(w13)  # `fits` saw it can
    bn, warps = tiles
    _up_kernel[(block_expert.numel() * triton.cdiv(I, bn),)](
        x, words, s13, h, sorted_ids, block_expert, table, n, D, I, x.stride(0), words.stride(0), words.stride(1),
        s13.stride(0), s13.stride(1), h.stride(0), TOP_K=k, DECODE=decode, BLOCK_N=bn, WARPS=warps, num_warps=warps)


def down(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
         sorted_ids: torch.Tensor, block_expert: torch.Tensor, n: int, k: int, decode: int,
         tiles: tuple[int, int]) -> None:
    """The down step of `moe.experts_with` over 16-row blocks: w2 MXFP4 codes (uint8, viewed here as words);
    tiles (BLOCK_N, warps)."""
    D, I = w2.shape[1], h.shape[1]
    words = _code_words(w2)
    bn, warps = tiles
    _down_kernel[(block_expert.numel() * triton.cdiv(D, bn),)](
        h, words, s2, y, weights, sorted_ids, block_expert, n, D, I, h.stride(0), words.stride(0), words.stride(1),
        s2.stride(0), s2.stride(1), y.stride(0), weights.stride(0), weights.stride(1), TOP_K=k, DECODE=decode,
        BLOCK_N=bn, WARPS=warps, num_warps=warps)
