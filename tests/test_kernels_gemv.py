"""The Triton `linear` (kernels/gemv.py) equals x·wᵀ computed in fp64, element by element, and the
kernels that take part in programmatic dependent launch wait before they touch memory.

Interpreter cases: 1 to 8 rows; N and K from 1 up to 2,048, K not a multiple of the step (masked
tails), several K steps (the next step's weights in flight), the rule's 2,048-wide step; a strided x
(a column slice, as the model's projections get); bf16, fp16 and fp32. Outputs start as NaN
(`poisoned_empty`). Bound: one rounding to the output dtype plus fp32 summation, K·2⁻²³·Σ|x||w|.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
import triton.language as tl

from interpret import Checks, poisoned_empty

CHECKS = Checks(__file__)
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


def check_linear_matches_fp64() -> None:
    from k3backend.kernels import gemv

    g = torch.Generator().manual_seed(7)
    cases = [(1, 1, 1, None), (1, 7, 33, None), (2, 7, 33, None), (1, 64, 2048, None), (2, 37, 1030, None),
             (1, 300, 96, None), (2, 5, 200, 16), (1, 9, 100, 32), (3, 9, 100, None), (4, 20, 600, None),
             (5, 6, 300, None), (8, 33, 130, None), (7, 5, 40, 16)]  # (M, N, K, BK forced or the rule's)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for M, N, K, bk in cases:
            wide = torch.randn(M, K + 24, generator=g).to(dtype)
            x = wide[:, 24:] if M > 1 else wide[:, :K]  # a column slice: row stride K + 24
            w = torch.randn(N, K, generator=g).to(dtype)
            ok, why = gemv.linear_supports(x, w)
            assert ok, why
            with poisoned_empty():
                y = gemv.linear(x, w) if bk is None else gemv.linear_with(x, w, gemv.LinearConfig(4, bk, 4))
            ref = x.double() @ w.double().T
            mag = x.double().abs() @ w.double().abs().T
            bound = EPS[dtype] * ref.abs() + K * 2.0 ** -23 * mag + 1e-30
            err = (y.double() - ref).abs()
            assert y.dtype == dtype and y.shape == (M, N), (y.dtype, y.shape)
            assert (err <= bound).all(), f"{dtype} M{M} N{N} K{K} bk {bk}: worst {(err / bound).max():.2f}x the bound"


def check_linear_random_shapes() -> None:
    """A seeded fuzz: 30 random (M, N, K, dtype, row stride, tile) cases, each element within the bound."""
    import random

    from k3backend.kernels import gemv

    rng, g = random.Random(11), torch.Generator().manual_seed(12)
    for case in range(30):
        M, N, K = rng.randint(1, 8), rng.randint(1, 300), rng.randint(1, 1500)
        dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
        pad = rng.choice((0, 8, 13))
        x = torch.randn(M, K + pad, generator=g).to(dtype)[:, pad:]
        w = (torch.randn(N, K + pad, generator=g).to(dtype)[:, :K]) if rng.random() < 0.5 else \
            torch.randn(N, K, generator=g).to(dtype)
        cfg = gemv.LinearConfig(rng.choice((1, 2, 4, 8)), rng.choice((16, 64, 256, 1024)), rng.choice((1, 4)))
        with poisoned_empty():
            y = gemv.linear_with(x, w, cfg)
        ref = x.double() @ w.double().T
        bound = EPS[dtype] * ref.abs() + K * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30
        worst = ((y.double() - ref).abs() / bound).max().item()
        assert worst <= 1, f"case {case}: M{M} N{N} K{K} {dtype} pad {pad} {cfg}: {worst:.2f}x the bound"


def check_linear_adds_are_torch_adds() -> None:
    """The epilogue's adds give torch's `(y + a0) + a1` on the kernel's own product, bit for bit, for
    1, 2 and 8 rows, strided adds (a column slice), every dtype; the reference op adds the same way."""
    from k3backend.kernels import gemv, linear_ref

    g = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for M, N, K in ((1, 37, 300), (2, 300, 96), (8, 33, 130)):
            x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
            a0 = (torch.randn(M, N + 5, generator=g) * 30).to(dtype)[:, 5:]  # larger than y: the add rounds
            a1 = torch.randn(M, N, generator=g).to(dtype)
            with poisoned_empty():
                y = gemv.linear(x, w)
                one, two = gemv.linear(x, w, (a0,)), gemv.linear(x, w, (a0, a1))
            assert torch.equal(one, y + a0), f"{dtype} M{M}: one add"
            assert torch.equal(two, (y + a0) + a1), f"{dtype} M{M}: two adds"
            assert not torch.equal(two, y + (a0 + a1)), "the check cannot tell the order of the adds"
            ref = linear_ref.linear(x, w, (a0, a1))
            assert torch.equal(ref, (linear_ref.linear(x, w) + a0) + a1)


def check_linear_gate_is_the_rounded_product() -> None:
    """gate: the GEMV reads bf(x · bf(σ(g))) (MLA's output gate). Through an identity weight y is that input
    itself, so it must be torch's x * torch.sigmoid(g) bit for bit (up to a last-bit difference of the two
    sigmoids in rare elements); through a random weight, within the fp64 bound of that input."""
    from k3backend.kernels import gemv, linear_ref

    g = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.float32):
        for M, K in ((1, 300), (3, 96), (8, 130)):
            x = torch.randn(M, K + 7, generator=g).to(dtype)[:, 7:]  # strided, as the in-projection's slices
            z = (torch.randn(M, K + 3, generator=g) * 4).to(dtype)[:, 3:]
            ok, why = gemv.linear_supports(x, torch.eye(K, dtype=dtype), (), z)
            assert ok, why
            with poisoned_empty():
                y = gemv.linear(x, torch.eye(K, dtype=dtype), (), z)
            want = x * torch.sigmoid(z)
            ulp = EPS[dtype] * 2 or 2.0 ** -22  # a bf16 / fp32 sigmoid's last bit (fp32: Triton's and torch's differ)
            if dtype == torch.bfloat16:  # the roundings: bit-equal but where the two sigmoids round apart
                assert (y != want).float().mean() <= 0.01, f"{dtype} M{M}: {(y != want).float().mean():.1%} differ"
            assert ((y.double() - want.double()).abs() <= ulp * want.double().abs() + 1e-30).all(), f"{dtype} M{M}"
            w = torch.randn(40, K, generator=g).to(dtype)
            y = gemv.linear(x, w, (), z)
            ref = want.double() @ w.double().T
            bound = 2 * EPS[dtype] * (want.double().abs() @ w.double().abs().T) + K * 2.0 ** -23 * \
                (want.double().abs() @ w.double().abs().T) + EPS[dtype] * ref.abs() + 1e-30
            assert ((y.double() - ref).abs() <= bound).all(), f"{dtype} M{M} K{K}: gated product"
            assert torch.equal(linear_ref.linear(x, w, (), z), linear_ref.linear(want, w))
    x, z = torch.zeros(2, 16, dtype=torch.bfloat16, device="meta"), torch.zeros(2, 16, device="meta")
    ok, why = gemv.linear_supports(x, torch.zeros(8, 16, dtype=torch.bfloat16, device="meta"), (), z)
    assert not ok and "gate" in why, why


def check_linear_dot_matches_fp64() -> None:
    """The tensor-core kernel (9-64 rows): every element within the fp64 bound, for 9 to 64 rows (a
    BLOCK_M of 16, 32 or 64 with masked rows), masked K tails, N not a multiple of the tile, a strided x,
    several pipelined K steps, every dtype; its adds are torch's on its own product bit for bit, and its
    gate reads bf(x · bf(σ(g))) as the GEMV's does (through a random weight, within the bound of that input)."""
    from k3backend.kernels import gemv

    g = torch.Generator().manual_seed(13)
    cases = [(9, 37, 300, 16, 64, 2), (16, 64, 128, 32, 64, 3), (33, 20, 70, 16, 32, 2), (64, 50, 256, 64, 64, 4),
             (17, 130, 520, 32, 128, 3), (40, 16, 16, 16, 16, 1)]  # (M, N, K, BN, BK, stages)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for M, N, K, bn, bk, st in cases:
            x = torch.randn(M, K + 5, generator=g).to(dtype)[:, 5:]
            w = torch.randn(N, K, generator=g).to(dtype)
            cfg = gemv.LinearConfig(bn, bk, 4, stages=st)
            with poisoned_empty():
                y = gemv.linear_with(x, w, cfg)
            ref = x.double() @ w.double().T
            bound = EPS[dtype] * ref.abs() + K * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30
            worst = ((y.double() - ref).abs() / bound).max().item()
            assert y.shape == (M, N) and worst <= 1, f"{dtype} M{M} N{N} K{K} {cfg}: {worst:.2f}x the bound"
            a0 = (torch.randn(M, N + 3, generator=g) * 30).to(dtype)[:, 3:]
            a1 = torch.randn(M, N, generator=g).to(dtype)
            with poisoned_empty():
                one, two = gemv.linear_with(x, w, cfg, (a0,)), gemv.linear_with(x, w, cfg, (a0, a1))
            assert torch.equal(one, y + a0) and torch.equal(two, (y + a0) + a1), f"{dtype} M{M}: adds"
            z = (torch.randn(M, K, generator=g) * 4).to(dtype)
            with poisoned_empty():
                yg = gemv.linear_with(x, w, cfg, (), z)
            xg = (x * torch.sigmoid(z)).double()
            mag = xg.abs() @ w.double().abs().T
            bound = (3 * EPS[dtype] + K * 2.0 ** -23) * mag + EPS[dtype] * (xg @ w.double().T).abs() + 1e-30
            assert ((yg.double() - xg @ w.double().T).abs() <= bound).all(), f"{dtype} M{M}: gated"


def check_tiles_sweep_checks_every_variant() -> None:
    """bench/kernels_gemv.py --tiles (smoke sizes): the rule's launch first and every variant checked against
    cuBLAS's op; a variant whose outputs are wrong is counted as a failure, and only those."""
    import contextlib
    import io
    import sys
    from pathlib import Path

    from k3backend.kernels import gemv

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    spec = importlib.util.spec_from_file_location("bench_kernels_gemv", Path(sys.path[0]) / "kernels_gemv.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.tiles_sweep([1], 1, smoke=True) == 0, out.getvalue()
    tables = out.getvalue().split("== ")[1:]
    assert len(tables) == 2, out.getvalue()  # the plain shape with its add, and the gated one
    for table in tables:
        rows = table.splitlines()[1:]
        assert rows[0].endswith("ok  (chosen)"), table
        assert len(rows) == len(bench.tile_variants(1, 96, True)), table  # the rule's launch is one of them
        assert all(row.endswith(" ok") for row in rows[1:]), table
    right = gemv.linear_with
    gemv.linear_with = lambda x, w, cfg, *a: right(x, w, cfg, *a) * (2 if cfg.block_n == 8 else 1)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            failed = bench.tiles_sweep([1], 1, smoke=True)
    finally:
        gemv.linear_with = right
    assert failed == 2 * sum(v[0] == 8 for v in bench.tile_variants(1, 96, True)), failed


def test_tiles_sweep_checks_every_variant():
    CHECKS.assert_passed("tiles_sweep_checks_every_variant")


def test_linear_dot_matches_fp64():
    CHECKS.assert_passed("linear_dot_matches_fp64")


def test_linear_gate_is_the_rounded_product():
    CHECKS.assert_passed("linear_gate_is_the_rounded_product")


def test_linear_matches_fp64():
    CHECKS.assert_passed("linear_matches_fp64")


def test_linear_random_shapes():
    CHECKS.assert_passed("linear_random_shapes")


def test_linear_adds_are_torch_adds():
    CHECKS.assert_passed("linear_adds_are_torch_adds")


def test_linear_declines_what_it_does_not_take():
    from k3backend.kernels import gemv

    def case(m: int, n: int, k: int, dtype=torch.bfloat16, wdtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(m, k, dtype=dtype, device="meta"), torch.empty(n, k, dtype=wdtype or dtype, device="meta")

    for m, n, k in ((1, 8336, 2048), (2, 3392, 2048), (4, 2048, 8192), (8, 2048, 2048), (9, 16, 16),
                    (16, 3392, 2048), (32, 2048, 2048)):
        assert gemv.linear_supports(*case(m, n, k)) == (True, ""), (m, n, k)
    declined = {
        "no rows": case(0, 16, 16),
        "65 rows": case(65, 16, 16),
        "16 rows of 8,336 x 2,048": case(16, 8336, 2048),
        "32 rows of 3,392 x 2,048": case(32, 3392, 2048),
        "64 rows without adds": case(64, 2048, 1024),
        "fp32 at 16 rows": case(16, 64, 64, torch.float32),
        "2 rows of 8,336": case(2, 8336, 2048),
        "3 rows of 3,392": case(3, 3392, 2048),
        "5 rows, K 8,192": case(5, 2048, 8192),
        "mixed dtypes": case(1, 16, 16, torch.bfloat16, torch.float32),
        "fp64": case(1, 16, 16, torch.float64),
        "x strided along K": (torch.empty(1, 32, dtype=torch.bfloat16, device="meta")[:, ::2],
                              torch.empty(16, 16, dtype=torch.bfloat16, device="meta")),
        "3-D x": (torch.empty(1, 1, 16, dtype=torch.bfloat16, device="meta"),
                  torch.empty(16, 16, dtype=torch.bfloat16, device="meta")),
    }
    for what, (x, w) in declined.items():
        ok, why = gemv.linear_supports(x, w)
        assert not ok and why, what
    x, w = case(2, 16, 16)
    add = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    assert gemv.linear_supports(x, w, (add(2, 16), add(2, 16))) == (True, "")
    assert gemv.linear_supports(*case(64, 2048, 1024), (add(64, 2048),)) == (True, "")  # 33-64 rows: with adds
    assert gemv.linear_supports(*case(16, 64, 64), (), add(16, 64)) == (True, "")  # a gate: up to 16 rows
    assert not gemv.linear_supports(*case(17, 64, 64), (), add(17, 64))[0]
    bad_adds = {"3 adds": (add(2, 16),) * 3, "an add of 1 row": (add(1, 16),),
                "an fp32 add": (add(2, 16, dtype=torch.float32),), "an add strided along N": (add(2, 32)[:, ::2],),
                "an add on another device": (torch.empty(2, 16, dtype=torch.bfloat16),)}
    for what, adds in bad_adds.items():
        ok, why = gemv.linear_supports(x, w, adds)
        assert not ok and why, what


SMALL_SHAPES = ((8336, 2048), (2048, 128), (2048, 2048), (3392, 2048), (3072, 768), (1024, 2048), (2048, 1024),
                (2048, 8192))  # the `small` preset's projections: KDA in/f_b/o, MLA in/q_b, latent down/up, MLP down


def test_linear_compiles_for_hopper_without_spills():
    """The rule's launches at the `small` projections, 1-64 rows, compile for sm_90a without spills."""
    from sm90 import compile_sm90

    from k3backend.kernels import gemv

    for M in (1, 2, 4, 8):
        for N, K in SMALL_SHAPES:
            cfg = gemv.linear_config(M, N, K)
            if cfg is None:
                continue
            for adds, gate in ((0, False), (2, False), (2, True)):
                c = compile_sm90(gemv._linear_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", a0_ptr="*bf16",
                                                           a1_ptr="*bf16", g_ptr="*bf16", N=N, K=K, stride_xm=K,
                                                           stride_wn=K, stride_ym=N, stride_a0=N, stride_a1=N,
                                                           stride_gm=K),
                                 dict(M=M, BLOCK_M=M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ADDS=adds, GATE=gate,
                                      INTERPRET=False), num_warps=cfg.warps, num_stages=1)
                assert c.stack == 0, f"M{M} N{N} K{K} {cfg} adds {adds} gate {gate}: {c}"
    for M in (16, 32, 64):  # the tensor-core kernel at its three row tiles
        for N, K in SMALL_SHAPES:
            for adds, gate in ((0, False), (2, False), (1, True)):
                cfg = gemv.linear_config(M, N, K, gate, adds)
                if cfg is None:
                    continue
                c = compile_sm90(gemv._linear_dot_kernel, dict(
                    x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", a0_ptr="*bf16", a1_ptr="*bf16", g_ptr="*bf16", M=M,
                    N=N, K=K, stride_xm=K, stride_wn=K, stride_ym=N, stride_a0=N, stride_a1=N, stride_gm=K),
                    dict(BLOCK_M=M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, ADDS=adds, GATE=gate,
                         INTERPRET=False), num_warps=cfg.warps, num_stages=1)
                assert c.stack == 0, f"M{M} N{N} K{K} {cfg} adds {adds} gate {gate}: {c}"


# The PDL kernels no other compile test builds: (module, kernel) -> (args, constexprs, warps).
_PDL_ONLY_HERE = {
    ("kda", "_kda_decode_fused_kernel"): (
        dict(xqkv="*bf16", conv_weight="*fp32", conv_pool="*bf16", f="*bf16", f_b="*bf16", dt_bias="*fp32",
             A_log="*fp32", b="*bf16", z="*bf16", o_norm_weight="*bf16", S_pool="*fp32", state_indices="*i32",
             y="*bf16", s_x=8336, s_b=8336, s_z=8336, s_f=8336),  # f_b_proj in the kernel (1-2 rows)
        dict(H=16, K=128, V=128, W=4, BK=128, BV=64, BW=4, NV=2, SPLIT=True, F_B=True, R=128, BR=128,
             USE_LOWER_BOUND=True, LOWER_BOUND=-5.0, SCALE=128 ** -0.5, EPS=1e-5, ACC=tl.float32, BITS=False), 4),
    ("kda", "_kda_decode_norm_kernel"): (
        dict(xqkv="*bf16", conv_pool="*bf16", z="*bf16", o_norm_weight="*bf16", state_indices="*i32", y="*bf16",
             s_x=8336, s_z=8336),
        dict(H=16, K=128, V=128, W=4, BK=128, BV=128, BW=4, EPS=1e-5, ACC=tl.float32, BITS=False), 4),
    ("moe", "_align_count_kernel"): (
        dict(ids_ptr="*i64", counts_ptr="*i32", n=384, E=64, stride_it=6, stride_ik=1),
        dict(TOP_K=6, BLOCK=256, BLOCK_E=64, RESERVE=False), 4),
    ("moe", "_align_place_kernel"): (
        dict(ids_ptr="*i64", counts_ptr="*i32", cursor_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
             n=384, E=64, num_blocks=88, stride_it=6, stride_ik=1),
        dict(TOP_K=6, BLOCK_M=16, BLOCK=256, BLOCK_E=64, PAD_E=128, RESERVE=False, CH=64), 4),
    ("moe", "_down_gemv_kernel"): (
        dict(h_ptr="*bf16", w2_ptr="*bf16", s2_ptr="*bf16", y_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i64", n=6,
             D=1024, I=1024, E=64, stride_hm=1024, stride_we=1024 * 1024, stride_wn=1024, stride_se=0, stride_sn=0,
             stride_yn=1024, stride_it=6, stride_ik=1, stride_pt=6, stride_pk=1),
        dict(TOP_K=6, GPU=True, EVEN_K=True, MX=False, DECODE=0, AHEAD=True, BLOCK_N=16, BLOCK_K=256, EARLY=False),
        4),
    ("moe", "_sum_kernel"): (  # with the latent norm, in norm.row_config(1024, 4)'s tile
        dict(y_ptr="*bf16", ids_ptr="*i64", out_ptr="*bf16", norm_w_ptr="*bf16", T=4, D=1024, E=64, scaling=1.0,
             eps=1e-5, stride_yn=1024, stride_it=6, stride_ik=1, stride_ot=1024),
        dict(TOP_K=6, GPU=True, NORM=True, BLOCK_T=1, BLOCK_D=1024), 8),
}
_PDL_BUILT_ELSEWHERE = {  # compiled with PDL on (tests/sm90.py turns it on) by these files' hopper tests
    ("gemv", "_linear_kernel"), ("gemv", "_linear_dot_kernel"), ("norm", "_row_norm_kernel"),
    ("norm", "_attn_res_mix_kernel"),
    ("norm", "_mla_latent_kernel"),
    ("routing", "_route_kernel"), ("routing", "_router_gemm_kernel"), ("moe", "_up_kernel"), ("moe", "_down_kernel"),
    ("moe", "_up_gemv_kernel"), ("mla", "_latent_attn_kernel"), ("mla", "_latent_reduce_kernel")}


def test_pdl_kernels_compile_for_hopper_and_wait_before_touching_memory():
    """Every kernel with a PDL constexpr is compiled for sm_90a with PDL on by some hopper test, and each
    waits (griddepcontrol.wait) before its first global load or store (tests/sm90.py checks the PTX)."""
    from sm90 import compile_sm90

    import k3backend.kernels as pkg

    with_pdl = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"k3backend.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and "PDL" in getattr(obj, "arg_names", ()):
                with_pdl.add((info.name, name))
    assert with_pdl == set(_PDL_ONLY_HERE) | _PDL_BUILT_ELSEWHERE, with_pdl ^ (set(_PDL_ONLY_HERE) | _PDL_BUILT_ELSEWHERE)
    for (mod, name), (args, constexprs, warps) in _PDL_ONLY_HERE.items():
        kernel = getattr(importlib.import_module(f"k3backend.kernels.{mod}"), name)
        c = compile_sm90(kernel, args, constexprs, num_warps=warps, num_stages=1)
        assert c.stack == 0, f"{name}: {c}"


def test_the_wait_check_catches_an_early_load():
    """tests/sm90.py's check is not vacuous: the GEMV loads its first weights before the wait, and
    without its exemption it fails."""
    import pytest
    import sm90

    from k3backend.kernels import gemv

    ptx_like = "\n".join(["ld.param.u64 %rd1, [p];", "@%p1 ld.global.v4.b32 {%r1}, [%rd1];",
                          "griddepcontrol.wait;", "st.global.b16 [%rd2], %rs1;"])
    assert sm90.accesses_before_wait(ptx_like) == ["@%p1 ld.global"]
    args = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", a0_ptr="*bf16", a1_ptr="*bf16", g_ptr="*bf16", N=2048,
                K=2048, stride_xm=2048, stride_wn=2048, stride_ym=2048, stride_a0=2048, stride_a1=2048,
                stride_gm=2048)
    constexprs = dict(M=1, BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, ADDS=1, GATE=False, INTERPRET=False)
    saved = dict(sm90.PREFETCH_BEFORE_WAIT)
    sm90.PREFETCH_BEFORE_WAIT.clear()
    try:
        with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
            sm90.compile_sm90(gemv._linear_kernel, args, constexprs, num_warps=8, num_stages=1)
    finally:
        sm90.PREFETCH_BEFORE_WAIT.update(saved)


def test_k3_pdl_switch():
    """K3_PDL off turns PDL off before any device is asked (a child reads it at import); a bad value fails
    the import with the variable's name; on a CPU it is off either way."""
    import os
    import subprocess
    import sys

    code = ("import torch; from k3backend.kernels import pdl; "
            "print(pdl.MODE, pdl.enabled(torch.device('cuda', 0)), pdl.launch_args(torch.device('cpu')) == "
            "{'PDL': False, 'launch_pdl': False})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "K3_PDL": "off"}, capture_output=True, text=True)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["off", "False", "True"], off.stdout
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "K3_PDL": "maybe"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "K3_PDL must be on or off" in bad.stderr, bad.stderr[-500:]
