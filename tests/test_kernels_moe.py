"""The Triton MoE ops (kernels/moe.py) equal their torch references (kernels/moe_ref.py).

Every `check_*` runs in a child process under TRITON_INTERPRET=1 (tests/interpret.py) on CPU
tensors: small odd sizes (E = 7 experts, k = 3, odd T, D, I), experts with no tokens, ids of other
ranks' experts (outside [0, E)) skipped, grouped top-k with several groups, ties. Every buffer the ops
allocate with torch.empty is poisoned (NaN, or -7777 for integers), so an element that a kernel
forgets to write, or a padding row that a kernel reads without masking, shows up; every output
element is compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import interpret
from tolerances import MOE_BF16_MISMATCH_FRACTION, MOE_BF16_ULPS, ROUTER_LOGITS_REL, tol

CHECKS = interpret.Checks(__file__, env={"K3_KERNELS": "triton"})

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("name", CHECKS.names)
def test_under_interpreter(name):
    CHECKS.assert_passed(name)


# ---------------------------------------------------------------- helpers (run in the child)
@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """torch.empty returns NaN-filled floats and -7777-filled integers while active."""
    real = torch.empty

    def empty(*size, dtype=None, device=None, **kwargs):
        t = real(*size, dtype=dtype, device=device, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7777)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = F32) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen(seed))).to(dtype)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """All elements within MOE_BF16_ULPS bf16 ulps of the row's magnitude `scale` [T, 1], and at most
    MOE_BF16_MISMATCH_FRACTION of them not bit-equal: the same rounding points give the same bits except
    where a different fp32 accumulation order (or exp/tanh last bit) flips a rounding (tolerances.py)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} vs {want.shape}"
    assert not got.isnan().any(), f"{what}: NaN in the output (an element not written, or poison read)"
    ulp = scale.float() * 2.0 ** -7  # one bf16 ulp at the magnitude of the row's largest expert output
    err = (got.float() - want.float()).abs()
    worst = (err / ulp).max().item()
    assert worst <= MOE_BF16_ULPS, f"{what}: max error {worst:.2f} bf16 ulps > {MOE_BF16_ULPS}"
    frac = (got != want).float().mean().item()
    assert frac <= MOE_BF16_MISMATCH_FRACTION, f"{what}: {frac:.2%} of elements differ from the reference"


# ---------------------------------------------------------------- route
def route_both(logits, bias, top_k, n_group, topk_group, renormalize=True, scaling=1.0):
    from k3backend.kernels import moe_ref, routing

    args = (logits, bias, top_k, n_group, topk_group, renormalize, scaling)
    ok, reason = routing.route_supports(*args)
    assert ok, reason
    with poisoned_empty():
        got = routing.route(*args)
    return got, moe_ref.route(*args)


def assert_route_equal(got, want, what: str) -> None:
    assert got[1].dtype == torch.int64 and got[0].dtype == F32
    assert torch.equal(got[1], want[1]), f"{what}: ids differ\n{got[1]}\n{want[1]}"
    torch.testing.assert_close(got[0], want[0], **tol(F32), msg=f"{what}: weights")


def check_route_ids_and_weights_equal_reference():
    logits, bias = randn(11, 7, seed=1, scale=2.0), randn(7, seed=2, scale=0.3)
    for renormalize, scaling in [(True, 1.0), (True, 2.5), (False, 2.5)]:
        got, want = route_both(logits, bias, 3, 1, 1, renormalize, scaling)
        assert_route_equal(got, want, f"renormalize={renormalize} scaling={scaling}")
    got, want = route_both(logits, None, 3, 1, 1)
    assert_route_equal(got, want, "no correction bias")
    logits, bias = randn(3, 896, seed=3, scale=2.0), randn(896, seed=4, scale=0.05)  # K3: 896 experts, top-16
    assert_route_equal(*route_both(logits, bias, 16, 1, 1), "K3 width")


def check_grouped_route_equals_reference():
    logits, bias = randn(13, 15, seed=5, scale=2.0), randn(15, seed=6, scale=0.3)
    for n_group, topk_group, top_k in [(5, 3, 4), (5, 1, 2), (3, 2, 7)]:  # 3 or 5 experts per group
        got, want = route_both(logits, bias, top_k, n_group, topk_group)
        assert_route_equal(got, want, f"{n_group} groups keep {topk_group} top {top_k}")
    logits, bias = randn(5, 256, seed=7), randn(256, seed=8, scale=0.1)  # DeepSeek-V3 shape: 8 groups keep 4
    assert_route_equal(*route_both(logits, bias, 8, 8, 4), "8 groups of 32")


def check_route_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, 12)  # σ = 0.5 exactly everywhere: the biases decide, with exact ties
    bias = torch.tensor([0.0, 0.25, 0.125, 0.0, 0.125, 0.0, 0.0, 0.25, 0.25, 0.0, 0.125, 0.0])
    got, want = route_both(logits, bias, 4, 1, 1)
    assert_route_equal(got, want, "expert ties")
    assert got[1][0].tolist() == [1, 7, 8, 2]
    got, want = route_both(logits, bias, 3, 3, 2)  # groups {0..3}, {4..7}, {8..11}: top-2 sums tie 0.375
    assert_route_equal(got, want, "group ties")
    assert got[1][0].tolist() == [1, 7, 2], "groups 0 and 1 kept (tie with group 2 goes to the lower id)"


def check_route_supports_declines_what_it_cannot_do():
    from k3backend.kernels import routing

    lg = torch.zeros(3, 16)
    assert routing.route_supports(lg, None, 4, 4, 2, True, 1.0) == (True, "")
    declined = {
        "float64 logits": (lg.double(), None, 4, 1, 1),
        "n_group does not divide": (lg, None, 4, 3, 1),
        "one expert per group": (torch.zeros(3, 4), None, 1, 4, 1),
        "top_k beyond the kept groups": (lg, None, 9, 4, 2),
        "bias of another dtype": (lg, torch.zeros(16, dtype=torch.float64), 4, 1, 1),
        "too many experts": (torch.zeros(1, 8192), None, 4, 1, 1),
    }
    for what, args in declined.items():
        ok, reason = routing.route_supports(*args, True, 1.0)
        assert not ok and reason, what


# ---------------------------------------------------------------- router (split-K GEMM + route)
def router_case(T: int, E: int, D: int, seed: int, bias: bool = True):
    """bf16 h, an fp32 gate weight whose values are not bf16 (all three parts of the kernel's split
    carry bits), logits ~N(0, 3²) (scores spread over (0, 1)), correction bias N(0, 0.05²) or None."""
    h = randn(T, D, seed=seed, dtype=BF16)
    w = randn(E, D, seed=seed + 1, scale=3 * D ** -0.5)
    assert (w != w.to(BF16).float()).float().mean() > 0.99, "gate weights must not be bf16 values"
    return h, w, randn(E, seed=seed + 2, scale=0.05) if bias else None


def selection_margin(logits: torch.Tensor, bias, top_k: int, n_group: int, topk_group: int) -> float:
    """The smallest gap, over tokens, between the last selected and the first rejected biased score
    (and group score): ids may only differ from the reference's where a gap is within rounding."""
    c = torch.sigmoid(logits) + (0 if bias is None else bias.double())
    T, E = c.shape
    gaps = []
    if n_group > 1:
        score = c.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        ranked = score.sort(-1, descending=True).values
        if topk_group < n_group:
            gaps.append(ranked[:, topk_group - 1] - ranked[:, topk_group])
        keep = score.topk(topk_group, dim=-1).indices
        mask = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(E // n_group, 1)
        c = c.masked_fill(~mask, float("-inf"))
    ranked = c.sort(-1, descending=True).values
    if top_k < ranked.shape[1] and ranked[:, top_k].isfinite().all():
        gaps.append(ranked[:, top_k - 1] - ranked[:, top_k])
    return min((g.min().item() for g in gaps), default=float("inf"))


def check_router_equals_reference_on_fp32_gate_weights():
    """Shapes with K tails (D 200, 300, 60), one and several K splits, T tiles with a ragged edge (300
    rows), K3's 896 experts top-16, grouped top-k, no bias, no renormalisation."""
    from k3backend.kernels import moe_ref, routing

    cases = [  # T, E, D, top_k, n_group, topk_group, bias, renormalize, scaling, splits
        (1, 16, 200, 3, 1, 1, True, True, 1.0, 4),
        (5, 896, 300, 16, 1, 1, True, True, 1.0, 5),  # K3 width, top-16
        (64, 64, 256, 6, 1, 1, False, True, 1.0, 4),  # even K: no masks
        (300, 64, 300, 6, 1, 1, True, False, 2.5, 5),
        (13, 64, 200, 6, 8, 4, True, True, 2.5, 4),  # 8 groups keep 4
        (5, 16, 60, 3, 4, 2, True, True, 1.0, 1),  # 4 groups of 4 keep 2, one split
    ]
    for i, (T, E, D, k, n_group, topk_group, bias, renormalize, scaling, splits) in enumerate(cases):
        what = f"T{T} E{E} D{D} top{k} groups {n_group}/{topk_group} bias={bias}"
        h, w, b = router_case(T, E, D, seed=1000 + 10 * i, bias=bias)
        exact = h.double() @ w.double().T  # the logits, to ~1e-16
        assert selection_margin(exact, b, k, n_group, topk_group) > 1e-5, f"{what}: test data has a near tie"
        cfg = routing.router_config(T, E, D)
        assert cfg.splits == splits, f"{what}: {cfg}"
        with poisoned_empty(), interpret.poisoned_empty():
            partials = routing._router_logits(h, w, cfg)
        assert partials.shape == (splits, T, E) and not partials.isnan().any(), f"{what}: partial sums not written"
        err = (partials.double().sum(0) - exact).abs().max(-1).values / exact.abs().max(-1).values
        assert err.max() <= ROUTER_LOGITS_REL, f"{what}: logits off by {err.max():.1e} of the row's largest"
        args = (h, w, b, k, n_group, topk_group, renormalize, scaling)
        ok, reason = routing.router_supports(*args)
        assert ok, reason
        with poisoned_empty(), interpret.poisoned_empty():
            got = routing.router(*args)
        assert_route_equal(got, moe_ref.router(*args), what)
    h, w, b = router_case(0, 64, 200, seed=999)
    assert [t.shape for t in routing.router(h, w, b, 6, 1, 1, True, 1.0)] == [(0, 6), (0, 6)]


def check_moe_front_equals_router_and_down_projection():
    """moe_front (kernels/routing.py): the router's ids and weights, and the latent bf(h·downᵀ) against the
    fp64 product rounded once, with the down rows as more GEMM tiles (a ragged last tile: L 100, 70; K tails:
    D 200, 300), in the rule's K splits and in one; where front_fused says no, the router and `linear`."""
    from k3backend.kernels import moe_ref, routing

    cases = [  # T, E, D, L, top_k, n_group, topk_group
        (1, 16, 200, 100, 3, 1, 1),
        (2, 64, 256, 128, 6, 1, 1),  # even K
        (17, 64, 300, 70, 6, 8, 4),  # grouped top-k
        (5, 16, 200, 100, 3, 1, 1),  # router + linear (front_fused: 3-8 rows)
        (routing.FRONT_MAX_ROWS + 3, 16, 200, 100, 3, 1, 1),  # router + linear
    ]
    for i, (T, E, D, L, k, n_group, topk_group) in enumerate(cases):
        h, w, b = router_case(T, E, D, seed=3000 + 10 * i)
        down = randn(L, D, seed=3001 + 10 * i, scale=D ** -0.5, dtype=BF16)
        args = (h, w, b, down, k, n_group, topk_group, True, 1.0)
        assert selection_margin(h.double() @ w.double().T, b, k, n_group, topk_group) > 1e-5, f"case {i}: a near tie"
        assert routing.moe_front_supports(*args) == (True, "")
        want = moe_ref.moe_front(*args)
        exact = h.double() @ down.double().T
        rule = routing.router_config(T, E, D, L)
        one = routing.RouterConfig(64, 16, 64, 1, -(-D // 64) * 64)
        for cfg in (rule, one) if routing.front_fused(T) else (None,):
            what = f"T{T} E{E} D{D} L{L} top{k} groups {n_group}/{topk_group} splits {cfg and cfg.splits}"
            with poisoned_empty(), interpret.poisoned_empty():
                got = routing.moe_front(*args) if cfg is rule or cfg is None else routing.moe_front_with(*args, cfg)
            assert_route_equal(got[:2], want[:2], what)
            assert_bf16_close(got[2], exact.to(BF16), exact.abs().amax(-1, keepdim=True), f"{what}: latent")
    h, w, b = router_case(3, 16, 40, seed=3100)
    for bad in (torch.zeros(8, 40), torch.zeros(8, 41, dtype=BF16), torch.zeros(40, 8, dtype=BF16).T):
        ok, reason = routing.moe_front_supports(h, w, b, bad, 3, 1, 1, True, 1.0)
        assert not ok and "down weight" in reason, (bad.dtype, bad.shape, reason)


def test_router_splits_fill_the_gpu_at_decode_and_stay_few_at_prefill():
    """router_config: `small` (hidden 2048, 64 experts) at 1-64 tokens splits K into 32 (about two waves
    of programs stream the weight), at thousands of tokens into at most 8; every split is non-empty."""
    from k3backend.kernels import routing

    for T in (1, 5, 64, 320, 4096, 16384):
        for E, D in ((64, 2048), (384, 7168), (896, 7168)):
            cfg = routing.router_config(T, E, D)
            programs = -(-E // cfg.block_e) * -(-T // cfg.block_t) * cfg.splits
            assert cfg.split_k % cfg.block_k == 0 and (cfg.splits - 1) * cfg.split_k < D <= cfg.splits * cfg.split_k
            assert cfg.splits == 1 or programs <= routing.ROUTER_PROGRAMS, (T, E, cfg)
            if E == 64 and T <= 64:
                assert cfg.splits == D // routing.ROUTER_MIN_SPLIT_K, (T, cfg)
            if T >= 4096:
                assert cfg.splits <= 8, (T, E, cfg)


def test_router_kernels_compile_for_hopper_without_spills():
    """The interpreter never runs the GPU path (bf16 MMAs on the weight's parts in registers): the GEMM and
    the route kernel compile for sm_90a at `small` and K3 sizes with the wrappers' launch choices."""
    import triton
    from sm90 import compile_sm90

    from k3backend.kernels import pdl, routing

    for T, E, D, L in ((1, 64, 2048, 0), (4096, 64, 2048, 0), (64, 896, 7168, 0), (1, 64, 2048, 1024),
                       (64, 384, 7168, 3584)):
        cfg = routing.router_config(T, E, D, L)
        args = dict(h_ptr="*bf16", w_ptr="*fp32", d_ptr="*bf16", out_ptr="*fp32", T=T, E=E, L=L, D=D,
                    split_k=cfg.split_k, stride_ht=D, stride_we=D, stride_wd=D, stride_os=T * (E + L),
                    stride_ot=E + L)
        constexprs = dict(GPU=True, EVEN_K=D % cfg.block_k == 0, FRONT=L > 0, BLOCK_E=cfg.block_e,
                          BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, EARLY=pdl.early(T))
        c = compile_sm90(routing._router_gemm_kernel, args, constexprs, num_warps=cfg.warps, num_stages=cfg.stages)
        assert c.stack == 0 and c.mma, f"router GEMM T{T} E{E} D{D}: {c}"
        k, block = (6, 64) if E == 64 else (16, 1024)
        warps = 4 if block >= 512 else 1
        args = dict(logits_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", z_ptr="*bf16",
                    stride_ls=T * (E + L), stride_lt=E + L, stride_wt=k, stride_it=k, stride_zt=L, E=E, L=L,
                    per_group=E, scaling=1.0)
        constexprs = dict(SPLITS=cfg.splits, TOP_K=k, N_GROUP=1, TOPK_GROUP=1, HAS_BIAS=True, RENORMALIZE=True,
                          BLOCK_G=1, BLOCK_P=block, BLOCK_K=triton.next_power_of_2(k), FRONT=L > 0,
                          BLOCK_L=min(triton.next_power_of_2(max(L, 1)), 256 * warps), GPU=True)
        c = compile_sm90(routing._route_kernel, args, constexprs, num_warps=warps, num_stages=1)
        assert c.stack == 0, f"route T{T} E{E} L{L} splits {cfg.splits}: {c}"


def test_down_gemv_compiles_for_hopper_early_or_not():
    """`_down_gemv_kernel` on both storages, with its loads before the PDL wait (`pdl.early`) and without (then
    tests/sm90.py requires the wait first), as `small` decodes one token: no spills."""
    from sm90 import compile_sm90

    from k3backend.kernels import moe

    bn, bk, warps, stages = moe.experts_config(1, 6, 64, 1024, 1024, mxfp4=True).gemv
    for mx in (False, True):
        args = dict(h_ptr="*bf16", w2_ptr="*i32" if mx else "*bf16", s2_ptr="*u8" if mx else "*bf16", y_ptr="*bf16",
                    weights_ptr="*fp32", ids_ptr="*i64", n=6, D=1024, I=1024, E=64, stride_hm=1024,
                    stride_we=1024 * (128 if mx else 1024), stride_wn=128 if mx else 1024,
                    stride_se=1024 * 32 if mx else 0, stride_sn=32 if mx else 0, stride_yn=1024, stride_it=6,
                    stride_ik=1, stride_pt=6, stride_pk=1)
        for early in (False, True):
            constexprs = dict(TOP_K=6, GPU=True, EVEN_K=True, MX=mx, DECODE=3 if mx else 0, AHEAD=stages > 1,
                              BLOCK_N=bn, BLOCK_K=bk, EARLY=early, PDL=True)
            c = compile_sm90(moe._down_gemv_kernel, args, constexprs, num_warps=warps, num_stages=stages)
            assert c.stack == 0, f"down GEMV mx={mx} early={early}: {c}"


def check_router_supports_declines_what_it_cannot_do():
    from k3backend.kernels import routing

    h, w, b = router_case(3, 16, 40, seed=1100)
    assert routing.router_supports(h, w, b, 4, 4, 2, True, 1.0) == (True, "")
    declined = {
        "float32 h (an fp32 model)": (h.float(), w, b, 4, 1, 1),
        "float64 h and weight": (h.double(), w.double(), b, 4, 1, 1),
        "float16 h": (h.half(), w, b, 4, 1, 1),
        "bf16 gate weight": (h, w.to(BF16), b, 4, 1, 1),
        "transposed gate weight": (h, w.T.contiguous().T, b, 4, 1, 1),
        "gate weight of another width": (h, w[:, :32], b, 4, 1, 1),
        "h with a strided inner dimension": (torch.zeros(3, 80, dtype=BF16)[:, ::2], w, b, 4, 1, 1),
        "n_group does not divide": (h, w, b, 4, 3, 1),
        "bias of another dtype": (h, w, b.double(), 4, 1, 1),
        "top_k beyond the kept groups": (h, w, b, 9, 4, 2),
    }
    for what, args in declined.items():
        ok, reason = routing.router_supports(*args, True, 1.0)
        assert not ok and reason, what


# ---------------------------------------------------------------- experts
def experts_case(T: int, E: int, k: int, D: int, I: int, seed: int, dtype=BF16, ids_dtype=torch.int64):
    """Random routing with experts 2 and 5 unused and ~1/8 of the slots on other ranks' experts."""
    x = randn(T, D, seed=seed, dtype=dtype)
    w13 = randn(E, 2 * I, D, seed=seed + 1, scale=D ** -0.5, dtype=dtype)
    w2 = randn(E, D, I, seed=seed + 2, scale=I ** -0.5, dtype=dtype)
    local = torch.tensor([e for e in range(E) if e not in (2, 5)])
    ids = local[torch.randperm(len(local) * ((T * k) // len(local) + 1), generator=gen(seed + 3)) % len(local)]
    ids = ids[: T * k].view(T, k).clone()
    other = torch.rand(T, k, generator=gen(seed + 4)) < 0.125
    ids[other] = torch.tensor([-1, E, E + 3])[torch.arange(int(other.sum())) % 3]
    weights = torch.rand(T, k, generator=gen(seed + 5)) + 0.05
    weights = weights / weights.sum(-1, keepdim=True)
    return x, weights, ids.to(ids_dtype), w13, w2


def experts_both(x, weights, ids, w13, w2, act, scaling=1.0):
    from k3backend.kernels import moe, moe_ref

    ok, reason = moe.experts_supports(x, weights, ids, w13, w2, act, scaling)
    assert ok, reason
    with poisoned_empty():
        got = moe.experts(x, weights, ids, w13, w2, act, scaling)
    want = moe_ref.experts(x, weights, ids, w13, w2, act, scaling)
    # magnitude of each row's expert outputs: the scale of one rounding step of the fp32 sum
    scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
    return got, want, scale


SITU = dict(kind="situ", beta=4.0, linear_beta=25.0)


def check_experts_equal_reference_in_each_block_tier():
    """T chosen so that T·k/E lands in each tier of experts_config (BM 16, 32, 64, 128)."""
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    E, k, D, I = 7, 3, 37, 23
    for T, block_m in [(1, 16), (5, 16), (61, 32), (157, 64), (467, 128)]:
        assert moe.experts_config(T, k, E, D, I).block_m == block_m
        args = experts_case(T, E, k, D, I, seed=T)
        got, want, scale = experts_both(*args, Activation(**SITU), 2.5 if T == 61 else 1.0)
        assert_bf16_close(got, want, scale, f"T={T} BM={block_m}")


def check_tma_tiles_equal_pointer_tiles_and_the_reference():
    """ExpertsConfig.tma (the BM 64 and 128 tiers): weight tiles, and down's h tiles, through TMA
    descriptors give the pointer loads' bits (same K steps; the padding rows' unwritten h stays out of
    the output) and the reference's values, for routed experts with a partial last N tile of rows
    (BN 16 of D 48 and I 32 divide; D 40 leaves the last K tile to the copy engine's zero fill) and for
    glu_linear; rows not 16-byte aligned (D 37) fall back to pointer loads."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    E, k, act = 7, 3, Activation(**SITU)
    for T, D, I in [(157, 48, 32), (467, 40, 32), (157, 37, 32)]:
        x, weights, ids, w13, w2 = experts_case(T, E, k, D, I, seed=900 + T + D)
        cfg = moe.experts_config(T, k, E, D, I)
        assert cfg.tma and cfg.block_m >= 64, cfg
        cfg = dataclasses.replace(cfg, up=(16,) + cfg.up[1:], down=(16,) + cfg.down[1:])
        with poisoned_empty():
            got = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, cfg)
        plain = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, dataclasses.replace(cfg, tma=False))
        assert torch.equal(got, plain), f"T={T} D={D}: TMA and pointer tiles differ"
        want = moe_ref.experts(x, weights, ids, w13, w2, act, 1.0)
        assert_bf16_close(got, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3), f"T={T} D={D}")
    x, w_gu = randn(2100, 64, seed=950, dtype=BF16), randn(64, 64, seed=951, scale=0.125, dtype=BF16)
    cfg = moe.experts_config(2100, 1, 1, 64, 32)
    assert cfg.tma, cfg
    with poisoned_empty():
        got = moe.glu_linear(x, w_gu, act)
    h = torch.empty(2100, 32, dtype=BF16)
    moe._launch_up(x, w_gu, None, h, None, None, 2100, 1, act, dataclasses.replace(cfg, tma=False), dense=True,
                   round_gu=True)
    assert torch.equal(got, h), "glu_linear: TMA and pointer tiles differ"


def test_a_rank_of_expert_parallelism_keys_its_tiles_on_its_share_of_the_assignments():
    """Under EP a rank holds E/ep experts and gets about T·k/ep of the assignments: its rows an expert are the
    whole layer's, T·k/E, not T·k/(E/ep). Keyed on those, `small` split over 8 ranks takes the single rank's tier
    (BM) at decode and prefill sizes (between, at 256-512 tokens, whether the experts hit fill two waves of wide
    tiles is the rank's own: 8 experts do not), and MXFP4 expands first from the same token count; on its
    local E alone it would take BM 32 at 64 decode rows and expand from 1,024 tokens."""
    from k3backend.kernels import moe

    E, ep, k, D, I = 64, 8, 6, 1024, 1024
    for T in (1, 4, 16, 64, 2048, 8192):
        for mx in (False, True):
            whole, rank = moe.experts_config(T, k, E, D, I, mx), moe.experts_config(T, k, E // ep, D, I, mx, ep=ep)
            assert rank.block_m == whole.block_m, (T, mx, whole, rank)
    assert moe.experts_config(64, k, E // ep, D, I).block_m == 32  # what the rank took before: m = 48, not 16
    scales = torch.zeros(1, dtype=torch.uint8)
    for T in (1024, 2048, 4096, 8192):
        expands = moe.experts_mxfp4_config(T, k, E, D, I, scales).expand > 0
        assert (moe.experts_mxfp4_config(T, k, E // ep, D, I, scales, ep=ep).expand > 0) == expands, T
    assert moe.experts_mxfp4_config(1024, k, E // ep, D, I, scales).expand == E // ep


def test_tma_only_where_rows_share_an_expert_block_of_64_or_more_and_weights_are_bf16():
    from k3backend.kernels import moe

    for T, tma in ((16, False), (320, False), (1024, True), (8192, True)):
        assert moe.experts_config(T, 6, 64, 1024, 1024).tma is tma, T
        assert not moe.experts_config(T, 6, 64, 1024, 1024, mxfp4=True).tma, T


def _tma_tile_compiles(cfg, n: int, num_blocks: int, *, xtma: bool) -> dict:
    """{"up": ..., "down": ...}: each a call compiling that GEMM for sm_90a with TMA weight tiles at `small` (D = I =
    1,024) and `cfg`'s tiles (xtma: up's x tiles by TMA too)."""
    from sm90 import compile_sm90

    from k3backend.kernels import moe

    D = I = 1024
    (ubn, ubk, uw, us), (dbn, dbk, dw, ds), bm = cfg.up, cfg.down, cfg.block_m
    common = dict(TOP_K=6, GPU=True, EVEN_K=True, MX=False, DECODE=0, SW=0, TMA=True, BLOCK_M=bm, GROUP_M=cfg.group_m)
    return dict(up=lambda: compile_sm90(moe._up_kernel, dict(
        x_ptr="*bf16", x_desc=f"tensordesc<bf16[{bm}, {ubk}]>" if xtma else "*bf16", w13_ptr="*bf16", s13_ptr="*bf16",
        w_desc=f"tensordesc<bf16[{ubn}, {ubk}]>", h_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
        table_ptr="*bf16", n=n, D=D, I=I, num_blocks=num_blocks, stride_xt=D, stride_we=2 * I * D, stride_wn=D,
        stride_se=0, stride_sn=0, stride_hm=I, inv_beta=0.25, beta=4.0, inv_lam=0.04, lam=25.0),
        dict(common, ACT=1, HAS_LAMBDA=True, DENSE=False, ROUND_GU=True, TABLE=True, XTMA=xtma, BLOCK_N=ubn,
             BLOCK_K=ubk), num_warps=uw, num_stages=us), down=lambda: compile_sm90(moe._down_kernel, dict(
        h_ptr="*bf16", w2_ptr="*bf16", s2_ptr="*bf16", h_desc=f"tensordesc<bf16[{bm}, {dbk}]>",
        w_desc=f"tensordesc<bf16[{dbn}, {dbk}]>", y_ptr="*bf16", weights_ptr="*fp32", sorted_ptr="*i32",
        block_expert_ptr="*i32", n=n, D=D, I=I, num_blocks=num_blocks, stride_hm=I, stride_we=D * I, stride_wn=I,
        stride_se=0, stride_sn=0, stride_yn=D, stride_pt=6, stride_pk=1), dict(common, BLOCK_N=dbn, BLOCK_K=dbk),
        num_warps=dw, num_stages=ds))


@pytest.mark.parametrize("xtma", [False, True])
def test_experts_kernels_compile_for_hopper_with_tma_without_spills(xtma):
    """The prefill tiles with TMA descriptors compile for sm_90a at `small` sizes (xtma: up's x tiles by TMA too):
    wgmma, no spills, shared memory within the 227 KB a program may use."""
    from k3backend.kernels import moe

    for what, compile_it in _tma_tile_compiles(moe.experts_config(4096, 6, 64, 1024, 1024), 24576, 300,
                                               xtma=xtma).items():
        c = compile_it()
        assert c.stack == 0 and c.smem <= 227 * 1024 and 3 in c.mma, f"{what}: {c}"


@pytest.mark.parametrize("E", [64, 384])
def test_align_kernels_that_reserve_compile_for_hopper_without_spills(E):
    """The align kernels' RESERVE form at a prefill step (8,192 tokens, top 6: counted in blocks of 1,024
    assignments, placed in blocks of 256) for `small`'s 64 experts and 384 (one-hot chunks of 64 and 8): no
    spills."""
    import triton
    from sm90 import compile_sm90

    from k3backend.kernels import moe

    block_e = triton.next_power_of_2(E)
    ids = dict(ids_ptr="*i64", counts_ptr="*i32", n=49152, E=E, stride_it=6, stride_ik=1)
    count = compile_sm90(moe._align_count_kernel, ids, dict(TOP_K=6, BLOCK=1024, BLOCK_E=block_e, RESERVE=True),
                         num_warps=4, num_stages=1)
    place = compile_sm90(moe._align_place_kernel, dict(ids, cursor_ptr="*i32", sorted_ptr="*i32",
                                                       block_expert_ptr="*i32", num_blocks=1000),
                         dict(TOP_K=6, BLOCK_M=128, BLOCK=256, BLOCK_E=block_e, PAD_E=16, RESERVE=True,
                              CH=max(1, min(256, 4096 // block_e))), num_warps=4, num_stages=1)
    for what, c in (("count", count), ("place", place)):
        assert c.stack == 0, f"{what}: {c}"


@pytest.mark.parametrize("tokens", [16, 512])
@pytest.mark.parametrize("decode", [2, 3])
def test_mxfp4_ptx_expansion_compiles_for_hopper_without_spills(decode, tokens):
    """DECODE 2's and 3's inline PTX is accepted by ptxas for sm_90a in the MMA tiles (16 and 512 tokens of
    `small`: BM 16, and BM 64 in 8 warps) and the GEMV kernels (1 token), with no spills: the interpreter cannot
    run it, so this and test_e2m1_ptx_decodes_every_code_and_exponent are what CI checks of it. Where the
    exponents come as int32 words (BM 16's K steps of 128 and 256), the MMA loops load nothing synchronously: the
    pipeliner copies every operand ahead (byte exponents were a memory round trip a K step). The GEMV's K step
    issues fewer than 6.3 instructions a weight value and thread."""
    from sm90 import compile_sm90

    from k3backend.kernels import moe

    D = I = 1024
    cfg = moe.experts_config(tokens, 6, 64, D, I, mxfp4=True)
    (ubn, ubk, uw, us), (dbn, dbk, dw, ds) = cfg.up, cfg.down
    mx = dict(GPU=True, EVEN_K=True, MX=True, DECODE=decode, TOP_K=6)
    act = dict(inv_beta=0.25, beta=4.0, inv_lam=0.04, lam=25.0)
    s13, usw = moe._exponent_words(torch.empty(64, 2 * I, D // 32, dtype=torch.uint8), ubk)
    s2, dsw = moe._exponent_words(torch.empty(64, D, I // 32, dtype=torch.uint8), dbk)
    assert (usw > 0, dsw > 0) == ((True, True) if tokens == 16 else (False, False)), (usw, dsw)
    sty = {torch.uint8: "*u8", torch.int32: "*i32"}
    up = compile_sm90(moe._up_kernel, dict(
        x_ptr="*bf16", x_desc="*bf16", w13_ptr="*u8", s13_ptr=sty[s13.dtype], w_desc="*u8", h_ptr="*bf16",
        sorted_ptr="*i32", block_expert_ptr="*i32", table_ptr="*fp32", n=96, D=D, I=I, num_blocks=100, stride_xt=D,
        stride_we=I * D, stride_wn=D // 2, stride_se=s13.stride(0), stride_sn=s13.stride(1), stride_hm=I, **act),
        dict(mx, ACT=1, HAS_LAMBDA=True, DENSE=False, ROUND_GU=True, TABLE=True, SW=usw, TMA=False, XTMA=False,
             BLOCK_M=cfg.block_m, BLOCK_N=ubn, BLOCK_K=ubk, GROUP_M=cfg.group_m), num_warps=uw, num_stages=us)
    down = compile_sm90(moe._down_kernel, dict(
        h_ptr="*bf16", w2_ptr="*u8", s2_ptr=sty[s2.dtype], h_desc="*bf16", w_desc="*u8", y_ptr="*bf16",
        weights_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32", n=96, D=D, I=I, num_blocks=100,
        stride_hm=I, stride_we=D * I // 2, stride_wn=I // 2, stride_se=s2.stride(0), stride_sn=s2.stride(1),
        stride_yn=D, stride_pt=6, stride_pk=1), dict(mx, SW=dsw, TMA=False, BLOCK_M=cfg.block_m, BLOCK_N=dbn,
                                                       BLOCK_K=dbk, GROUP_M=cfg.group_m), num_warps=dw, num_stages=ds)
    if usw:
        assert up.loop_loads == 0 and down.loop_loads == 0, f"up: {up}; down: {down}"
    bn, bk, warps, stages = moe.experts_config(1, 6, 64, D, I, mxfp4=True).gemv
    gemv = {ahead: compile_sm90(moe._up_gemv_kernel, dict(
        x_ptr="*bf16", w13_ptr="*i32", s13_ptr="*u8", h_ptr="*bf16", ids_ptr="*i32", table_ptr="*fp32", n=6, D=D,
        I=I, E=64, stride_xt=D, stride_we=I * D // 4, stride_wn=D // 8, stride_se=I * D // 16, stride_sn=D // 32,
        stride_it=6, stride_ik=1, stride_hm=I, **act),
        dict(mx, ACT=1, HAS_LAMBDA=True, DENSE=False, ROUND_GU=True, TABLE=True, AHEAD=ahead, BLOCK_N=bn, BLOCK_K=bk),
        num_warps=warps, num_stages=stages) for ahead in (False, True)}
    for what, c in (("up", up), ("down", down), ("up gemv", gemv[False]), ("up gemv ahead", gemv[True])):
        assert c.stack == 0 and c.smem <= 227 * 1024, f"{what}: {c}"
    # the GEMV's K step a weight value and thread: code words, 8 fp32 straight from the PTX, took it from 7.6
    # (bytes unpacked and repacked for the pack-4 asm, then bf16 widened) to 5.3 (decode 3; decode 2: 5.8)
    per_value = [gemv[a].loop_sass * warps * 32 / (2 * bn * bk) for a in (False, True)]
    assert max(per_value) < 6.3, f"GEMV SASS a weight value {per_value}: {gemv[False]}"


def check_experts_with_the_latent_norm_equal_the_sum_then_rms_norm():
    """norm_weight (the latent norm, §7.2) in the sum's kernel: equal to the references' sum then rms_norm, and
    bit-equal to the Triton experts then the Triton rms_norm (the same tile and arithmetic), bf16 and MXFP4
    weights, in the GEMV kernels, BM 16 and BM 32, with a width that is not a power of two."""
    from k3backend.kernels import moe, moe_ref, norm
    from k3backend.kernels.moe_ref import Activation

    act = Activation(**SITU)
    for T, D, I in [(1, 96, 64), (5, 96, 64), (61, 160, 64)]:
        nw = randn(D, seed=1300 + T, scale=0.3) + 1.0
        bf = experts_case(T, 7, 3, D, I, seed=1310 + T)
        mx = mxfp4_case(T, 7, 3, D, I, seed=1320 + T)
        for name, args, fast, ref in (("bf16", bf, moe.experts, moe_ref.experts),
                                      ("mxfp4", mx, moe.experts_mxfp4, moe_ref.experts_mxfp4)):
            what = f"{name} T={T} D={D}"
            ok, reason = (moe.experts_supports if name == "bf16" else moe.experts_mxfp4_supports)(
                *args, act, 2.5, nw, 1e-5)
            assert ok, reason
            with poisoned_empty():
                got = fast(*args, act, 2.5, nw, 1e-5)
                two = norm.rms_norm(fast(*args, act, 2.5), nw, 1e-5)
            assert torch.equal(got, two), f"{what}: not the two kernels' bits"
            want = ref(*args, act, 2.5, nw, 1e-5)
            assert torch.equal(want, moe_ref.rms_norm(ref(*args, act, 2.5), nw, 1e-5))
            assert_bf16_close(got, want, want.float().abs().amax(-1, keepdim=True), what)
    x, weights, ids, w13, w2 = experts_case(3, 7, 3, 96, 64, seed=1350)
    for bad in (torch.ones(95), torch.ones(96, 2)[:, 0]):
        ok, reason = moe.experts_supports(x, weights, ids, w13, w2, act, 1.0, bad, 1e-5)
        assert not ok and "norm_weight" in reason, reason


def check_experts_activations_and_dtypes_equal_reference():
    from k3backend.kernels.moe_ref import Activation

    E, k = 7, 3
    cases = [  # (T, D, I, act, dtype, ids dtype): even sizes take the unmasked K loop
        (9, 64, 32, Activation(**SITU), BF16, torch.int64),
        (9, 37, 23, Activation("situ", 4.0, None), BF16, torch.int32),
        (13, 37, 23, Activation("silu"), BF16, torch.int64),
        (13, 64, 32, Activation("silu"), torch.float16, torch.int64),
    ]
    for T, D, I, act, dtype, ids_dtype in cases:
        got, want, scale = experts_both(*experts_case(T, E, k, D, I, seed=100 + T, dtype=dtype, ids_dtype=ids_dtype),
                                        act)
        if dtype == BF16:
            assert_bf16_close(got, want, scale, f"{act} D={D} I={I}")
        else:
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale.max().item(), msg=f"{act} fp16")


def check_activation_table_gives_the_epilogue_math_bits():
    """ExpertsConfig.table: the lookup of bf16 gate/up values gives the bits of the math epilogue, for
    SiTU with and without its cap and SiLU, in each tier, with gate/up values large enough to saturate
    tanh; glu_linear's rounded front takes the table too."""
    import dataclasses

    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    E, k, D, I = 7, 3, 64, 40
    for act in (Activation(**SITU), Activation("situ", 4.0, None), Activation("silu")):
        for T in (5, 61, 157, 467):
            x, weights, ids, w13, w2 = experts_case(T, E, k, D, I, seed=600 + T)
            w13 = w13 * 8.0  # |g|, |u| up to ~30: SiTU's tanh saturates, σ reaches 0 and 1
            cfg = moe.experts_config(T, k, E, D, I)
            assert cfg.table
            with poisoned_empty():
                got = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, cfg)
            plain = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, dataclasses.replace(cfg, table=False))
            assert torch.equal(got, plain), f"{act} T={T}: table and math epilogues differ"
    x, w_gu = randn(33, 64, seed=650, dtype=BF16), randn(80, 64, seed=651, scale=1.0, dtype=BF16)
    act = Activation(**SITU)
    table = moe._act_table(act, x.device)
    assert table.shape == (2, 65536)
    got = moe.glu_linear(x, w_gu, act)
    moe._TABLES.clear()
    moe._TABLES[(act, x.device)] = torch.full_like(table, float("nan"))  # a table read shows as NaN
    assert moe.glu_linear(x, w_gu, act).isnan().all(), "glu_linear with a rounded front reads the table"
    assert not moe.glu_linear(x, w_gu, act, fp32_front=True).isnan().any(), "the fp32 front cannot use it"
    moe._TABLES.clear()
    assert torch.equal(moe.glu_linear(x, w_gu, act), got)


def check_experts_of_other_ranks_only_give_zero():
    from k3backend.kernels.moe_ref import Activation

    x, weights, ids, w13, w2 = experts_case(5, 7, 3, 37, 23, seed=200)
    ids[:2] = torch.tensor([-1, 7, 9])  # tokens 0 and 1 route only to other ranks' experts
    got, want, scale = experts_both(x, weights, ids, w13, w2, Activation(**SITU))
    assert torch.equal(got[:2], torch.zeros_like(got[:2]))
    assert_bf16_close(got, want, scale, "partially remote")


def check_align_places_every_assignment_once_in_its_experts_block():
    """Both forms of the align kernels (reserve: one atomic a program and expert, the assignments ranked in chunks
    of CH), at 87 assignments of 7 experts, and at 4,200 of 300 (counted in blocks of 1,024 assignments; placed in
    blocks of 256 in one-hot chunks of 8), and a bf16 experts call through either form."""
    import dataclasses

    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    for T, k, E, bm, reserve in ((29, 3, 7, 16, False), (29, 3, 7, 16, True), (1400, 3, 300, 64, False),
                                 (1400, 3, 300, 64, True)):
        align_case(T, k, E, bm, reserve)
    x, weights, ids, w13, w2 = experts_case(61, 7, 3, 64, 96, seed=310)
    cfg = moe.experts_config(61, 3, 7, 64, 96)
    with poisoned_empty():
        one, reserved = (moe.experts_with(x, weights, ids, w13, w2, Activation(**SITU), 1.0,
                                          dataclasses.replace(cfg, reserve=r)) for r in (False, True))
    assert torch.equal(one, reserved), "the rows' order inside an expert changed a result"


def align_case(T: int, k: int, E: int, bm: int, reserve: bool) -> None:
    from k3backend.kernels import moe

    *_, ids, _, _ = experts_case(T, E, k, 16, 16, seed=300 + T)
    with poisoned_empty():
        sorted_ids, block_expert = moe._align(ids, E, bm, reserve)
    n = T * k
    flat = ids.view(-1)
    assert block_expert.numel() == -(-n // bm) + min(E, n)
    assert ((block_expert >= 0) & (block_expert < E) | (block_expert == -1)).all(), "every block written"
    used = block_expert >= 0
    assert torch.equal(used, torch.arange(block_expert.numel()) < used.sum()), "used blocks first, then -1"
    rows = sorted_ids.view(-1, bm)[used]  # [used blocks, bm]
    real = rows < n
    assert ((rows == n) | real).all(), "padding rows hold n"
    placed = rows[real]
    mine = ((flat >= 0) & (flat < E)).nonzero().view(-1)
    assert torch.equal(placed.sort().values.long(), mine), "each local assignment exactly once, no remote one"
    row_expert = block_expert[used].long()[:, None].expand_as(rows)
    assert torch.equal(flat[rows.long().clamp_max(n - 1)][real], row_expert[real]), "rows sit in their expert's blocks"
    counts = torch.bincount(flat[mine], minlength=E)
    assert int(used.sum()) == int(((counts + bm - 1) // bm).sum()), "each expert padded to whole blocks only"


def check_experts_supports_declines_what_it_cannot_do():
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    x, weights, ids, w13, w2 = experts_case(3, 7, 3, 16, 16, seed=400)
    act = Activation(**SITU)
    assert moe.experts_supports(x, weights, ids, w13, w2, act) == (True, "")
    declined = {
        "float32 activations": (x.float(), weights, ids, w13.float(), w2.float(), act),
        "weights of another dtype": (x, weights, ids, w13.half(), w2, act),
        "bf16 routing weights": (x, weights.to(BF16), ids, w13, w2, act),
        "float ids": (x, weights, ids.float(), w13, w2, act),
        "w2 of the wrong shape": (x, weights, ids, w13, w2[:, :, :8], act),
        "transposed w13": (x, weights, ids, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, act),
        "unknown activation": (x, weights, ids, w13, w2, Activation("gelu")),
    }
    for what, args in declined.items():
        ok, reason = moe.experts_supports(*args)
        assert not ok and reason, what


# ---------------------------------------------------------------- experts on MXFP4 weights (w4a16, §7.7)
def mxfp4_case(T: int, E: int, k: int, D: int, I: int, seed: int):
    """experts_case's routing with random MXFP4 codes and exponents 2^-7..2^-5 (weights O(D^-1/2))."""
    x, weights, ids, _, _ = experts_case(T, E, k, D, I, seed)
    g = gen(seed + 10)
    u8 = dict(dtype=torch.uint8, generator=g)
    w13, w2 = torch.randint(0, 256, (E, 2 * I, D // 2), **u8), torch.randint(0, 256, (E, D, I // 2), **u8)
    s13, s2 = torch.randint(120, 123, (E, 2 * I, D // 32), **u8), torch.randint(120, 123, (E, D, I // 32), **u8)
    return x, weights, ids, w13, s13, w2, s2


def experts_mxfp4_both(x, weights, ids, w13, s13, w2, s2, act, scaling=1.0, decode=None):
    """The Triton op (decode None: as dispatched; 0 / 1: that expansion) and moe_ref.experts_mxfp4."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref

    ok, reason = moe.experts_mxfp4_supports(x, weights, ids, w13, s13, w2, s2, act, scaling)
    assert ok, reason
    with poisoned_empty():
        if decode is None:
            got = moe.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, act, scaling)
        else:
            cfg = moe.experts_config(x.shape[0], ids.shape[1], w13.shape[0], x.shape[1], w2.shape[2] * 2, mxfp4=True)
            got = moe.experts_with(x, weights, ids, w13, w2, act, scaling, dataclasses.replace(cfg, decode=decode),
                                   (s13, s2))
    want = moe_ref.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, act, scaling)
    return got, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)


def check_experts_mxfp4_equal_dequantised_reference_in_each_block_tier():
    """D 96, I 64: the K loop of up (BK 64) ends in a masked half step, down's is even. D 224, I 192 in the wgmma
    tiers: up's exponent bytes, loaded a step ahead (`_step_exponents`), over 4 steps and a masked last, down's
    over 3."""
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    E, k = 7, 3
    for T, block_m, D, I in [(1, 16, 96, 64), (5, 16, 96, 64), (61, 32, 96, 64), (157, 64, 96, 64),
                             (467, 128, 96, 64), (157, 64, 224, 192), (467, 128, 224, 192)]:
        cfg = moe.experts_config(T, k, E, D, I, mxfp4=True)
        assert cfg.block_m == block_m and (D < 128 or cfg.up[1] == cfg.down[1] == 64), cfg
        args = mxfp4_case(T, E, k, D, I, seed=800 + T + D)
        got, want, scale = experts_mxfp4_both(*args, Activation(**SITU), 2.5 if T == 61 else 1.0)
        assert_bf16_close(got, want, scale, f"mxfp4 T={T} BM={block_m} D={D}")


def check_experts_mxfp4_hand_expansion_equals_reference():
    """The expansions the GPU bench times against the chosen one: DECODE 1 (`_mx_expand` + tl.dot) and 0
    (tl.dot_scaled), in BM 16 and BM 32 tiles."""
    from k3backend.kernels.moe_ref import Activation

    for T, D, I, act in [(5, 96, 64, Activation(**SITU)), (61, 64, 96, Activation("silu"))]:
        case = mxfp4_case(T, 7, 3, D, I, seed=900 + T)
        for decode in (1, 0):
            got, want, scale = experts_mxfp4_both(*case, act, decode=decode)
            assert_bf16_close(got, want, scale, f"mxfp4 expansion {decode} T={T}")


def check_experts_mxfp4_ptx_expansion_equals_reference():
    """DECODE 2 (`_E2M1_PTX` on a GPU): under the interpreter it runs `_mx_rows`' math, so this checks
    the plumbing (MMA tiles and GEMV kernels); test_e2m1_ptx_decodes_every_code_and_exponent the asm."""
    from k3backend.kernels.moe_ref import Activation

    for T, D, I in [(1, 96, 64), (5, 96, 64), (61, 64, 96)]:
        got, want, scale = experts_mxfp4_both(*mxfp4_case(T, 7, 3, D, I, seed=920 + T), Activation(**SITU), decode=2)
        assert_bf16_close(got, want, scale, f"mxfp4 PTX expansion T={T}")


def check_experts_mxfp4_codes_off_word_boundaries_take_the_mma_tiles():
    """The GEMV kernels read codes as int32 words (`_code_words`); codes that cannot be viewed so (here views 2
    bytes into a wider buffer) run the MMA tiles instead, at a token count that takes the GEMV, and equal the
    reference."""
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    x, weights, ids, w13, s13, w2, s2 = mxfp4_case(1, 7, 3, 96, 64, seed=960)
    assert moe.experts_mxfp4_config(1, 3, 7, 96, 64, s13, s2).gemv is not None
    odd13 = torch.zeros(*w13.shape[:-1], w13.shape[-1] + 4, dtype=torch.uint8)[..., 2:-2]
    odd2 = torch.zeros(*w2.shape[:-1], w2.shape[-1] + 4, dtype=torch.uint8)[..., 2:-2]
    odd13.copy_(w13)
    odd2.copy_(w2)
    assert moe._code_words(w13) is not None and moe._code_words(odd13) is None and moe._code_words(odd2) is None
    seen, real = [], moe._up_kernel.run
    moe._up_kernel.run = lambda *a, **kw: seen.append(kw.get("BLOCK_M")) or real(*a, **kw)
    try:
        got, want, scale = experts_mxfp4_both(x, weights, ids, odd13, s13, odd2, s2, Activation(**SITU))
    finally:
        moe._up_kernel.run = real
    assert seen == [16], seen  # the MMA tiles ran
    assert_bf16_close(got, want, scale, "codes off word boundaries")


def check_experts_mxfp4_fold_the_bias_into_scales_up_to_exponent_128():
    """experts_mxfp4 runs decode 3 (`_E2M1_PTX_FOLDED`) where experts_config picks 2 and every exponent is
    <= 128, and decode 2 once an in-place change puts one above (`_max_exponent` keeps the maximum with the
    tensor's version); both equal the reference."""
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    x, weights, ids, w13, s13, w2, s2 = mxfp4_case(5, 7, 3, 96, 64, seed=940)
    seen, real = [], moe.experts_with
    moe.experts_with = lambda *a, **kw: seen.append(a[7].decode) or real(*a, **kw)
    try:
        for top in (128, 129):
            s2[1, 2, 0] = top
            got, want, scale = experts_mxfp4_both(x, weights, ids, w13, s13, w2, s2, Activation(**SITU))
            assert_bf16_close(got, want, scale, f"largest exponent {top}")
    finally:
        moe.experts_with = real
    assert moe.experts_config(5, 3, 7, 96, 64, mxfp4=True).decode == 2
    assert seen == [3, 2], seen


def check_experts_mxfp4_exponent_words_equal_exponent_bytes():
    """Widths in whole 128s hand the MMA tiles their exponents as int32 words (`_exponent_words`, SW > 0): the
    outputs equal the reference, and bit for bit those of the byte loads (SW 0) on the same tiles: BM 16
    (decode 2, which the interpreter runs as `_mx_rows`: this checks the words' byte order, not the PTX) and
    BM 32 (decode 2 in `_halves` order), and a K step of 256 over K = 384 (two words a step, the last step
    masked). Shapes that cannot take words keep the bytes."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    act = Activation(**SITU)
    s = torch.zeros(3, 8, 12, dtype=torch.uint8)
    assert moe._exponent_words(s, 256)[1] == 2 and moe._exponent_words(s, 64)[1] == 0
    assert moe._exponent_words(s[..., :6], 128)[1] == 0 and moe._exponent_words(s[..., 1:5], 128)[1] == 0
    real = moe._exponent_words
    for T, D, I, up_bk in [(5, 256, 128, None), (61, 128, 256, None), (5, 384, 128, 256)]:
        x, weights, ids, w13, s13, w2, s2 = mxfp4_case(T, 7, 3, D, I, seed=960 + T)
        cfg = moe.experts_config(T, 3, 7, D, I, mxfp4=True)
        assert cfg.gemv is None and cfg.up[1] >= 128 and cfg.down[1] >= 128, cfg
        if up_bk:
            cfg = dataclasses.replace(cfg, up=(cfg.up[0], up_bk, *cfg.up[2:]))
        seen = []
        moe._exponent_words = lambda s, bk: seen.append(real(s, bk)[1]) or real(s, bk)
        try:
            with poisoned_empty():
                words = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, cfg, (s13, s2))
            moe._exponent_words = lambda s, bk: (s, 0)
            with poisoned_empty():
                nbytes = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, cfg, (s13, s2))
        finally:
            moe._exponent_words = real
        assert seen == [(up_bk or 128) // 128, 1], seen
        want = moe_ref.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, act)
        assert_bf16_close(words, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3), f"words T={T}")
        assert torch.equal(words, nbytes), f"T={T}: words and bytes differ in {(words != nbytes).sum()} elements"


def check_expand_mxfp4_equals_dequant_bit_for_bit():
    """`expand_mxfp4` against moe_ref.dequant_mxfp4 in bf16, bit for bit: every code with exponents 0 (2^-127, whose
    0.5 is a bf16 subnormal), 1, 127 and 254 (whose 6 is near bf16's largest); rows past a 32-row block, K steps of
    32 and 256, and experts as a slice of a larger tensor (the expanded path's chunks)."""
    from k3backend.kernels import moe, moe_ref

    g = gen(1300)
    for E, N, K in [(3, 40, 96), (2, 33, 512)]:
        codes = torch.randint(0, 256, (E + 2, N, K // 2), dtype=torch.uint8, generator=g)
        codes[0, 0, :8] = torch.tensor([0x10 * c + c for c in range(0, 16, 2)], dtype=torch.uint8)
        codes[0, 1, :8] = torch.tensor([0x10 * c + c for c in range(1, 16, 2)], dtype=torch.uint8)
        exps = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)[torch.randint(0, 4, (E + 2, N, K // 32), generator=g)]
        packed, scale = codes[1:E + 1], exps[1:E + 1]
        with poisoned_empty():
            got = moe.expand_mxfp4(packed, scale)
        want = moe_ref.dequant_mxfp4(packed, scale, torch.bfloat16)
        assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), \
            f"E={E} N={N} K={K}: {(got.view(torch.int16) != want.view(torch.int16)).sum()} values differ"


def check_experts_mxfp4_expanded_in_chunks_equal_the_bf16_tiles():
    """ExpertsConfig.expand: the experts expanded to bf16 a chunk at a time (7 experts in chunks of 3: 3, 3, 1),
    each chunk's blocks run by the bf16 tiles, equal bit for bit the same tiles on the dequantized weights, and the
    reference; BM 16 and BM 64 tiles."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    act = Activation(**SITU)
    for T, D, I in [(5, 96, 64), (157, 224, 192)]:
        x, weights, ids, w13, s13, w2, s2 = mxfp4_case(T, 7, 3, D, I, seed=1320 + T)
        cfg = moe.experts_config(T, 3, 7, D, I)
        w13_bf, w2_bf = (moe_ref.dequant_mxfp4(w, s, torch.bfloat16) for w, s in ((w13, s13), (w2, s2)))
        with poisoned_empty():
            got = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, dataclasses.replace(cfg, expand=3), (s13, s2))
            bf16 = moe.experts_with(x, weights, ids, w13_bf, w2_bf, act, 1.0, cfg)
        assert torch.equal(got, bf16), f"T={T}: {(got != bf16).sum()} elements differ from the bf16 tiles"
        want = moe_ref.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, act)
        assert_bf16_close(got, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3), f"expand T={T}")


def check_experts_x_by_tma_equals_x_gathered():
    """ExpertsConfig.xtma: x permuted into row-block order and read by TMA in the up GEMM gives the bits of x gathered
    row by row: BM 64 tiles with TMA weights at 157 tokens (a ragged last K step: D 96 in steps of 64), with remote
    experts' slots."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    act = Activation(**SITU)
    T, E, k, D, I = 157, 7, 3, 96, 128
    x, weights, ids, w13, w2 = experts_case(T, E, k, D, I, seed=1360)
    cfg = dataclasses.replace(moe.experts_config(T, k, E, D, I), tma=True)
    assert cfg.block_m >= 64 and cfg.gemv is None, cfg
    with poisoned_empty():
        gathered = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, cfg)
        by_tma = moe.experts_with(x, weights, ids, w13, w2, act, 1.0, dataclasses.replace(cfg, xtma=True))
    assert torch.equal(by_tma, gathered), f"{(by_tma != gathered).sum()} elements differ"
    want = moe_ref.experts(x, weights, ids, w13, w2, act)
    assert_bf16_close(by_tma, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3), "xtma")


def check_experts_gemv_loads_ahead_or_not_alike():
    """The GEMV kernels with and without AHEAD (stages > 1: a K step's loads before the previous step's FMAs) give
    the same bits and equal the reference: bf16 and MXFP4 weights, two K steps of 256 with a masked tail in up
    (D 384) and in down (I 320)."""
    import dataclasses

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    act = Activation(**SITU)
    T, E, k, D, I = 1, 7, 3, 384, 320
    base = moe.experts_config(T, k, E, D, I, mxfp4=True)
    assert base.gemv is not None, base
    x, weights, ids, w13, s13, w2, s2 = mxfp4_case(T, E, k, D, I, seed=990)
    _, _, _, b13, b2 = experts_case(T, E, k, D, I, seed=991)
    for what, w_up, w_down, scales, ref in (
            ("mxfp4", w13, w2, (s13, s2), lambda: moe_ref.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, act)),
            ("bf16", b13, b2, None, lambda: moe_ref.experts(x, weights, ids, b13, b2, act))):
        got = {}
        for stages in (1, 2):
            cfg = dataclasses.replace(base, gemv=(16, 256, 4, stages), decode=3 if scales else 0)
            with poisoned_empty():
                got[stages] = moe.experts_with(x, weights, ids, w_up, w_down, act, 1.0, cfg, scales)
        want = ref()
        assert_bf16_close(got[2], want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3), what)
        assert torch.equal(got[1], got[2]), f"{what}: ahead and not differ in {(got[1] != got[2]).sum()} elements"


def run_ptx(text: str, regs: dict) -> dict:
    """Run straight-line PTX over numpy uint32 arrays: the instructions `_E2M1_PTX` uses, as the PTX ISA
    defines them (prmt.b32's default mode, lop3's truth table, fma.rn.bf16x2 rounded to nearest even)."""
    import numpy as np

    def prmt(a, b, c):
        out = np.zeros_like(a)
        for i in range(4):
            sel = (c >> (4 * i)) & 0xF
            idx = sel & 7
            byte = np.where(idx < 4, a >> (8 * (idx & 3)), b >> (8 * (idx & 3))) & 0xFF
            byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte)
            out |= byte.astype(np.uint32) << (8 * i)
        return out

    def lop3(a, b, c, lut):
        out = np.zeros_like(a)
        for i in range(8):
            if int(lut[0]) >> i & 1:
                out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        return out

    def fma_bf16x2(a, b, c):
        def half(x, h):
            return torch.from_numpy(((x >> (16 * h)) << 16).astype(np.int64).astype(np.int32)).view(torch.float32)
        out = np.zeros_like(a)
        for h in range(2):
            r = (half(a, h).double() * half(b, h).double() + half(c, h).double()).to(torch.bfloat16)
            out |= r.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << (16 * h)
        return out

    ops = {"mov.b32": lambda a: a, "and.b32": lambda a, b: a & b, "shr.u32": lambda a, b: a >> b,
           "shl.b32": lambda a, b: a << b, "prmt.b32": prmt, "lop3.b32": lop3, "fma.rn.bf16x2": fma_bf16x2}
    n = len(next(iter(regs.values())))
    for stmt in text.strip().removeprefix("{").removesuffix("}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        assert op in ops, f"run_ptx: {op} is not modelled"
        vals = [regs[a] if a in regs else np.full(n, int(a, 0), dtype=np.uint32) for a in src]
        regs[dst] = np.asarray(ops[op](*vals), dtype=np.uint32)
    return regs


@pytest.mark.parametrize("folded", [False, True])
def test_e2m1_ptx_decodes_every_code_and_exponent(folded):
    """`_E2M1_PTX`, run instruction by instruction in a model, gives each of the 8 values of 4 code bytes the
    bf16 of E2M1 times 2^(s-127) bit for bit, each byte with its own exponent given as `_mx_bf16` gives it
    (bf16x2 bits s << 7, an int32 a byte): every code byte in every byte position with every exponent 1..254
    (the loader refuses 255), neighbours random; exponent 0 gives a zero of the code's sign.
    `_E2M1_PTX_FOLDED` (decode 3, bits (s + 126) << 7) does the same for exponents 0..128, 0 included."""
    import numpy as np

    from k3backend.kernels import moe

    rng = np.random.default_rng(0)
    top = 129 if folded else 255
    code, exp, pos = (a.ravel() for a in np.meshgrid(np.arange(256), np.arange(top), np.arange(4), indexing="ij"))
    codes = rng.integers(0, 256, (code.size, 4))
    exps = rng.integers(0, top, (code.size, 4))
    codes[np.arange(code.size), pos], exps[np.arange(code.size), pos] = code, exp
    word = (codes.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(1).astype(np.uint32)
    scales = {f"${5 + b}": ((exps[:, b] + (126 if folded else 0)) * 0x800080).astype(np.uint32) for b in range(4)}
    regs = run_ptx((moe._E2M1_PTX_FOLDED if folded else moe._E2M1_PTX).value, {"$4": word, **scales})
    for byte in range(4):
        for nib, out in ((0, "$0" if byte < 2 else "$1"), (1, "$2" if byte < 2 else "$3")):
            got = (regs[out] >> (16 * (byte % 2))) & 0xFFFF
            c, e = torch.from_numpy((codes[:, byte] >> (4 * nib)) & 0xF), torch.from_numpy(exps[:, byte])
            want = e2m1_bf16(c, e, folded).view(torch.int16).numpy().astype(np.uint16)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (f"byte {byte} nibble {nib}: {bad.size} wrong, e.g. code {c[bad[0]].item():#x} "
                                   f"exponent {e[bad[0]].item()}: {got[bad[0]]:#06x} != {want[bad[0]]:#06x}")


def word_cases(folded: bool, seed: int):
    """(codes [N, 8], exponents [N], the int32 words of the codes, the exponents as the kernels' bf16x2 scale bits):
    every code in every nibble with every exponent (1..254, or 0..128 folded, 0 included), other nibbles random."""
    import numpy as np

    rng = np.random.default_rng(seed)
    top = 129 if folded else 255
    code, exp, pos = (a.ravel() for a in np.meshgrid(np.arange(16), np.arange(top), np.arange(8), indexing="ij"))
    codes = rng.integers(0, 16, (code.size, 8))
    codes[np.arange(code.size), pos] = code
    word = (codes.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(1).astype(np.uint32)
    return codes, exp, word, ((exp + (126 if folded else 0)) * 0x800080).astype(np.uint32)


def e2m1_bf16(c: torch.Tensor, e: torch.Tensor, folded: bool) -> torch.Tensor:
    """The bf16 of E2M1 codes c times 2^(e-127) (decode 2 gives exponent 0 a zero; decode 3 keeps its 2^-127)."""
    from k3backend.kernels.moe_ref import E2M1, e8m0_scale

    mag = torch.tensor(E2M1, dtype=torch.float64)[c & 7]
    scale = e8m0_scale(e, torch.float64)
    return (torch.where(c & 8 != 0, -mag, mag) * (scale if folded else torch.where(e == 0, 0.0, scale))).to(BF16)


@pytest.mark.parametrize("folded", [False, True])
def test_e2m1_word_ptx_decodes_every_code_and_exponent(folded):
    """`_E2M1_WORD_PTX` (the GEMV kernels'), run in the model: each of the 8 codes of a word, in `WORD_ORDER`,
    becomes the fp32 of E2M1 times 2^(s-127) bit for bit, with the word's exponent as `_mx_words` gives it:
    every code in every nibble with every exponent 1..254 (0..128 folded, 0 included), the other nibbles random."""
    import numpy as np

    from k3backend.kernels import moe

    codes, exp, word, scale_bits = word_cases(folded, seed=1)
    regs = run_ptx((moe._E2M1_WORD_PTX_FOLDED if folded else moe._E2M1_WORD_PTX).value, {"$9": word, "$8": scale_bits})
    for out, nib in enumerate(moe.WORD_ORDER):
        got = regs[f"${out}"]
        c, e = torch.from_numpy(codes[:, nib]), torch.from_numpy(exp)
        want = e2m1_bf16(c, e, folded).float().view(torch.int32).numpy().astype(np.uint32)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"output {out} (nibble {nib}): {bad.size} wrong, e.g. code {c[bad[0]].item():#x} "
                               f"exponent {e[bad[0]].item()}: {got[bad[0]]:#010x} != {want[bad[0]]:#010x}")


@pytest.mark.parametrize("folded", [False, True])
def test_fragment_ptx_decodes_every_code_and_exponent(folded):
    """moe_fragments' PTX, run in the model: output register j of a word holds the bf16 of nibbles j (low half) and
    j + 4 (high half), E2M1 times 2^(s-127) bit for bit: every code in every nibble with every exponent (0..128
    folded), the other nibbles random. The kernels' k map (`test_fragment_k_map_...`) relies on this pairing."""
    import numpy as np

    from k3backend.kernels import moe_fragments

    codes, exp, word, scale_bits = word_cases(folded, seed=2)
    regs = run_ptx(moe_fragments._pairs_ptx(not folded), {"$4": word, "$5": word, "$6": scale_bits,
                                                         "$7": scale_bits})
    for j in range(4):
        for half, nib in ((0, j), (1, j + 4)):
            got = (regs[f"${j}"] >> (16 * half)) & 0xFFFF
            c, e = torch.from_numpy(codes[:, nib]), torch.from_numpy(exp)
            want = e2m1_bf16(c, e, folded).view(torch.int16).numpy().astype(np.uint16)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, f"register {j} nibble {nib}: {bad.size} wrong, e.g. code {c[bad[0]].item():#x}"


def test_fragment_k_map_sums_the_models_products():
    """The fragment kernels' k map, applied to values as the kernels apply it to registers (`KAPPA_A` on a lane's
    32 activations, the PTX's nibble pairs joined and permuted by `KAPPA_B`), makes the MMA's 128-k dot of each
    row and column the model's: fp64, random rows and columns. The kernels' permutes are these constants."""
    import inspect

    from k3backend.kernels import moe_fragments as F

    g = torch.Generator().manual_seed(7)
    h = torch.randn(16, 128, generator=g, dtype=torch.float64)
    w = torch.randn(24, 128, generator=g, dtype=torch.float64)  # w[n, k]
    a = h.reshape(16, 4, 4, 2, 2, 2).permute(F.KAPPA_A).reshape(16, 128)
    words = w.reshape(24, 4, 4, 8)  # [n, q, c, nibble]: word c of lane q holds k = 32q + 8c + nibble
    pairs = [torch.stack([words[..., j], words[..., j + 4]], -1).permute(2, 1, 0, 3) for j in range(4)]  # c q n b
    join = lambda u, v: torch.stack([u, v], -1)  # noqa: E731 - gl.join: a new last axis of 2
    b = join(join(pairs[0], pairs[1]), join(pairs[2], pairs[3])).permute(F.KAPPA_B).reshape(128, 24)
    torch.testing.assert_close(a @ b, h @ w.T, rtol=1e-12, atol=1e-12)
    assert not torch.equal(a, h), "the map moves activations"
    if F.available():
        src = inspect.getsource(F._acts.fn) + inspect.getsource(F._weights.fn)
        assert f".permute{F.KAPPA_A}" in src and f".permute{F.KAPPA_B}" in src, "the kernels permute otherwise"


@pytest.mark.parametrize("decode", [2, 3])
def test_mxfp4_fragment_kernels_compile_for_hopper_without_shared_memory(decode):
    """moe_fragments' Gluon kernels compile for sm_90a at `small` with their tiles: every layout conversion
    between the loads and the MMAs is a renaming of registers (the kernels assert it: a change that needs a
    shuffle fails to compile), no shared memory, no spills, and a K step under 3.6 SASS instructions a weight
    value and thread with decode 3 (4.1 with decode 2's extra fma a pair; moe.py's BM 16 loop: 5.2)."""
    from sm90 import compile_sm90

    from k3backend.kernels import moe
    from k3backend.kernels import moe_fragments as F

    if not F.available():
        pytest.skip("this triton has no Gluon")
    D = I = 1024
    ubn, uw, dbn, dw = moe.experts_config(64, 6, 64, D, I, mxfp4=True).fragments
    up = compile_sm90(F._up_kernel, dict(
        x_ptr="*bf16", w13_ptr="*i32", s13_ptr="*u8", h_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
        table_ptr="*fp32", n=96, D=D, I=I, stride_xt=D, stride_we=2 * I * D // 8, stride_wn=D // 8,
        stride_se=2 * I * D // 32, stride_sn=D // 32, stride_hm=I),
        dict(TOP_K=6, DECODE=decode, BLOCK_N=ubn, WARPS=uw), num_warps=uw, num_stages=1)
    down = compile_sm90(F._down_kernel, dict(
        h_ptr="*bf16", w2_ptr="*i32", s2_ptr="*u8", y_ptr="*bf16", weights_ptr="*fp32", sorted_ptr="*i32",
        block_expert_ptr="*i32", n=96, D=D, I=I, stride_hm=I, stride_we=D * I // 8, stride_wn=I // 8,
        stride_se=D * I // 32, stride_sn=I // 32, stride_yn=D, stride_pt=6, stride_pk=1),
        dict(TOP_K=6, DECODE=decode, BLOCK_N=dbn, WARPS=dw), num_warps=dw, num_stages=1)
    bound = 3.6 if decode == 3 else 4.1
    for what, c, values in (("up", up, 2 * ubn * 128 // (32 * uw)), ("down", down, dbn * 128 // (32 * dw))):
        assert c.stack == 0 and c.smem == 0 and c.regs <= 128 and c.mma == (2,), f"{what}: {c}"
        assert c.loop_sass / values < bound, f"{what}: {c.loop_sass / values:.2f} SASS a weight value: {c}"


def check_experts_mxfp4_takes_the_fragment_kernels_only_where_they_run():
    """experts_config gives MXFP4's BM 16 tier from 2 to 8 rows an expert the fragment kernels; moe_fragments.supports
    declines the interpreter and the shapes and expansions the kernels cannot take: moe.py's kernels run those."""
    from k3backend.kernels import moe, moe_fragments
    from k3backend.kernels.moe_ref import Activation

    assert moe.experts_config(64, 6, 64, 1024, 1024, mxfp4=True).fragments
    assert not moe.experts_config(16, 6, 64, 1024, 1024, mxfp4=True).fragments, "K steps of 256 win there"
    assert not moe.experts_config(64, 6, 64, 1024, 1024).fragments, "bf16 weights"
    assert not moe.experts_config(128, 6, 64, 1024, 1024, mxfp4=True).fragments, "moe.py's tiles win there"
    assert not moe.experts_config(512, 6, 64, 1024, 1024, mxfp4=True).fragments, "BM 64"
    x, weights, ids, w13, s13, w2, s2 = mxfp4_case(5, 8, 2, 256, 128, seed=960)
    table = moe._act_table(Activation(**SITU), x.device)
    tiles = moe.experts_config(64, 6, 64, 1024, 1024, mxfp4=True).fragments
    assert moe_fragments.fits(x, w13, s13, w2, s2, 3, table, tiles)
    assert not moe_fragments.supports(x, w13, s13, w2, s2, 3, table, tiles), "the interpreter (or a CPU tensor)"
    odd = torch.empty(w13.numel() + 1, dtype=torch.uint8)[1:].view(w13.shape).copy_(w13)
    declined = {"decode 1": (x, w13, s13, w2, s2, 1, table, tiles), "no table": (x, w13, s13, w2, s2, 3, None, tiles),
                "fp16 activations": (x.half(), w13, s13, w2, s2, 3, table, tiles),
                "I not whole K steps of 128": (x, w13[:, :192], s13[:, :192], w2[..., :48], s2[..., :3], 3, table,
                                               tiles),
                "codes off word boundaries": (x, odd, s13, w2, s2, 3, table, tiles),
                "N tiles wider than the expert": (x, w13, s13, w2, s2, 3, table, (256, 4, 64, 2)),
                "fewer than 8 columns a warp": (x, w13, s13, w2, s2, 3, table, (64, 4, 64, 16))}
    for what, args in declined.items():
        assert not moe_fragments.fits(*args), what


def check_experts_mxfp4_supports_declines_what_it_cannot_do():
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    x, weights, ids, w13, s13, w2, s2 = mxfp4_case(3, 7, 3, 64, 32, seed=950)
    act = Activation(**SITU)
    assert moe.experts_mxfp4_supports(x, weights, ids, w13, s13, w2, s2, act) == (True, "")
    declined = {
        "fp16 activations": (x.half(), weights, ids, w13, s13, w2, s2, act),
        "bf16 weights": (x, weights, ids, w13.bfloat16(), s13, w2, s2, act),
        "int32 exponents": (x, weights, ids, w13, s13.int(), w2, s2, act),
        "exponents of another group size": (x, weights, ids, w13, s13[..., :1], w2, s2, act),
        "D not in groups of 32": (x[:, :48], weights, ids, w13[..., :24], s13, w2[:, :48], s2[:, :48], act),
        "unknown activation": (x, weights, ids, w13, s13, w2, s2, Activation("gelu")),
    }
    for what, args in declined.items():
        ok, reason = moe.experts_mxfp4_supports(*args)
        assert not ok and reason, what


# ---------------------------------------------------------------- glu_linear (shared experts, dense MLP)
def check_glu_linear_equals_reference_with_and_without_the_fp32_front():
    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    for T, D, I, act in [(1, 37, 23, Activation(**SITU)), (21, 64, 48, Activation("situ", 1.0, 25.0)),
                         (75, 37, 23, Activation("silu")), (203, 40, 24, Activation(**SITU))]:
        x = randn(T, D, seed=600 + T, dtype=BF16)
        w_gu = randn(2 * I, D, seed=601 + T, scale=D ** -0.5, dtype=BF16)
        for fp32_front in (False, True):
            ok, reason = moe.glu_linear_supports(x, w_gu, act, fp32_front)
            assert ok, reason
            with poisoned_empty():
                got = moe.glu_linear(x, w_gu, act, fp32_front)
            want = moe_ref.glu_linear(x, w_gu, act, fp32_front)
            scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
            assert_bf16_close(got, want, scale, f"T={T} {act.kind} fp32_front={fp32_front}")
    x, w_gu = randn(3, 16, seed=700, dtype=BF16), randn(32, 16, seed=701, dtype=BF16)
    assert not moe.glu_linear_supports(x.float(), w_gu.float(), Activation("silu"))[0], "fp32 declined"
    assert not moe.glu_linear_supports(x, w_gu[:31], Activation("silu"))[0], "odd 2I declined"


def test_mxfp4_row_blocks_of_up_to_32_take_three_stages():
    """The MXFP4 MMA tiles at decode and mixed-step sizes pipeline 3 K steps (the H200 sweep: 3-8 %
    faster than 4 at 16-320 tokens of `small`); bf16 keeps its 4, prefill tiles their own."""
    from k3backend.kernels import moe

    for T in (16, 64, 320):
        mx, bf = moe.experts_config(T, 6, 64, 1024, 1024, mxfp4=True), moe.experts_config(T, 6, 64, 1024, 1024)
        assert mx.block_m <= 32 and mx.up[3] == mx.down[3] == 3, (T, mx)
        assert bf.up[3] == 4, (T, bf)
    assert moe.experts_config(8192, 6, 64, 1024, 1024, mxfp4=True).up[3] == 4


def test_mxfp4_expands_by_ptx_in_every_row_block():
    """The measurements behind experts_config's MXFP4 expansion at `small`: the PTX expansion (decode 2) was
    faster in the GEMV kernels and the BM 16, 64 and 128 tiles (H200), and in `_halves` order at BM 32 (H100;
    tl.dot_scaled had been faster there in k order), which MXFP4 leaves above 40 rows an expert (512 tokens:
    BM 64 with decode 3, 13 % faster on an H100)."""
    from k3backend.kernels import moe

    for T, bm, decode in ((1, 16, 2), (16, 16, 2), (64, 16, 2), (256, 32, 2), (320, 32, 2), (512, 64, 2),
                          (1024, 64, 2), (8192, 128, 2)):
        cfg = moe.experts_config(T, 6, 64, 1024, 1024, mxfp4=True)
        assert (cfg.block_m, cfg.decode) == (bm, decode), (T, cfg)
    assert moe.experts_config(1, 6, 64, 1024, 1024, mxfp4=True).gemv, "1 token: the GEMV kernels, decode 2"
    assert moe.experts_config(64, 6, 64, 1024, 1024).decode == 0, "bf16 weights have nothing to expand"


def test_mxfp4_prefill_expands_the_experts_first_from_512_rows_an_expert_where_they_fit():
    """experts_mxfp4_config's `expand`: every expert expanded to bf16 first, then bf16's tiles (with their TMA), from
    512 rows an expert (`small` on an H100: 8,192 / 16,384 tokens 15 / 23 % faster, 4,096 a tie), and only where the
    expanded copy fits EXPAND_BYTES (not K3's 896 experts of a whole layer: 59 GB)."""
    import dataclasses

    from k3backend.kernels import moe

    s = torch.ones(64, 2048, 32, dtype=torch.uint8)
    for T, want in ((4096, 0), (5461, 0), (5462, 64), (16384, 64)):
        cfg = moe.experts_mxfp4_config(T, 6, 64, 1024, 1024, s, s)
        assert cfg.expand == want, (T, cfg)
        if want:
            assert cfg == dataclasses.replace(moe.experts_config(T, 6, 64, 1024, 1024), expand=64) and cfg.tma, cfg
    assert moe.experts_mxfp4_config(16384, 16, 896, 3584, 3072, s, s).expand == 0, "K3's layer: 59 GB expanded"
    assert moe.experts_mxfp4_config(16384, 16, 896 // 8, 3584, 3072 // 8, s, s).expand == 112, "an EP=8 TP=8 rank"


def test_one_matrix_fills_the_gpu_below_2048_rows():
    """glu_linear (E = 1): one row block up to 64 rows and N split to >= 256 programs where the width
    allows. The expert tiers gave the `small` shared experts 16-32 programs from 17 rows on: 2.5x
    slower at 256-1,024 rows on the H200."""
    import triton

    from k3backend.kernels import moe

    for T in (3, 16, 17, 64, 65, 256, 320, 1024, 2047):
        for D, I in ((2048, 1024), (2048, 8192), (7168, 6144)):
            cfg = moe.experts_config(T, 1, 1, D, I)
            bn = cfg.up[0]
            assert cfg.block_m == min(64, max(16, triton.next_power_of_2(T))), (T, I, cfg)
            assert triton.cdiv(T, cfg.block_m) * triton.cdiv(I, bn) >= 256 or bn == 16, (T, I, cfg)
    assert moe.experts_config(4096, 1, 1, 2048, 1024).block_m == 128, "large prefills keep the big tiles"


def test_gemv_programs_fill_two_waves():
    """The GEMV kernels take 16 rows a program unless the rows alone would give fewer than 2 waves of 132
    SMs: then 8, 4 or 2 (the `small` shared experts' glu at 1 row: 512 programs of 2 rows, not 64 of 16)."""
    import triton

    from k3backend.kernels import moe

    for T, k, E, D, I, bn in ((1, 1, 1, 2048, 1024, 2), (2, 1, 1, 2048, 1024, 4), (1, 1, 1, 2048, 8192, 16),
                              (1, 6, 64, 1024, 1024, 16), (4, 6, 64, 1024, 1024, 16), (1, 16, 896, 3584, 3072, 16)):
        gemv = moe.experts_config(T, k, E, D, I).gemv
        assert gemv is not None and gemv[0] == bn, (T, k, E, D, I, gemv)
        assert T * k * triton.cdiv(I, bn) >= moe.TWO_WAVES or bn == 2, (T, k, I, bn)


def check_down_gemv_launches_right_after_the_up_gemv():
    """`_down_gemv_kernel` reads the ids before its PDL wait: safe only while the launch right before it is the
    up GEMV (which reads them after its own wait, so the ids' writer has finished when the down GEMV starts).
    Every launch of the MoE kernels is recorded on both storages: no other kernel comes between the two."""
    from k3backend.kernels import moe
    from k3backend.kernels.moe_ref import Activation

    log: list[str] = []

    class Recorded:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                log.append(self.name)
                return launch(*args, **kwargs)
            return run

    names = [n for n in vars(moe) if n.endswith("_kernel")]
    saved = {n: getattr(moe, n) for n in names}
    for n in names:
        setattr(moe, n, Recorded(n, saved[n]))
    try:
        x, weights, ids, w13, w2 = experts_case(1, 7, 3, 64, 32, seed=731)
        assert moe.experts_config(1, 3, 7, 64, 32).gemv is not None
        moe.experts(x, weights, ids, w13, w2, Activation(**SITU), 1.0)
        x, weights, ids, w13, s13, w2, s2 = mxfp4_case(1, 7, 3, 64, 64, seed=732)
        moe.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, Activation(**SITU), 1.0)
    finally:
        for n in names:
            setattr(moe, n, saved[n])
    downs = [i for i, n in enumerate(log) if n == "_down_gemv_kernel"]
    assert len(downs) == 2 and all(i > 0 and log[i - 1] == "_up_gemv_kernel" for i in downs), log


def check_gemv_kernels_equal_reference_for_a_few_rows():
    """ExpertsConfig.gemv: routed experts (bf16 and MXFP4) and glu_linear for 1-4 rows, uneven and even
    K, both activations, fp16, slots of other ranks' experts skipped; more rows (per matrix, or in all)
    keep the MMA tiles."""
    from dataclasses import replace

    from k3backend.kernels import moe, moe_ref
    from k3backend.kernels.moe_ref import Activation

    saved = moe.GEMV_ROWS, moe.GEMV_PER_MATRIX
    moe.GEMV_ROWS, moe.GEMV_PER_MATRIX = 24, 2  # the defaults as measured, pinned
    try:
        assert moe.experts_config(4, 6, 64, 64, 32).gemv is not None, "K3 decode at 4 tokens: 24 assignments"
        assert moe.experts_config(5, 6, 64, 64, 32).gemv is None, "30 assignments > GEMV_ROWS: MMA tiles"
        assert moe.experts_config(5, 3, 7, 64, 32).gemv is None, "15 rows over 7 experts > GEMV_PER_MATRIX"
        assert moe.experts_config(2, 1, 1, 64, 32).gemv is not None, "a dense glu at 2 rows"
        assert moe.experts_config(3, 1, 1, 64, 32).gemv is None, "a dense glu at 3 rows: MMA tiles"
        assert moe.experts_config(4, 6, 64, 64, 64, mxfp4=True).gemv is not None, "MXFP4 at 24 assignments"
        assert moe.experts_config(5, 6, 64, 64, 64, mxfp4=True).gemv is None, "MXFP4 at 30: MMA tiles"
        for T, D, I, act, dtype in [(1, 37, 23, Activation(**SITU), BF16), (2, 64, 32, Activation(**SITU), BF16),
                                    (4, 300, 40, Activation("situ", 4.0, None), BF16),
                                    (3, 37, 23, Activation("silu"), BF16),
                                    (4, 64, 32, Activation("silu"), torch.float16)]:
            assert moe.experts_config(T, 3, 7, D, I).gemv is not None
            x, weights, ids, w13, w2 = experts_case(T, 7, 3, D, I, seed=700 + T, dtype=dtype)
            ids[0, 1] = -1  # another rank's expert
            got, want, scale = experts_both(x, weights, ids, w13, w2, act, 1.5)
            if dtype == BF16:
                assert_bf16_close(got, want, scale, f"gemv T={T} D={D} I={I} {act.kind}")
            else:
                torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale.max().item(), msg="gemv fp16")
            cfg = moe.experts_config(T, 3, 7, D, I)  # these sizes take 2 rows a program: 16, as a GPU's do
            with poisoned_empty():
                got16 = moe.experts_with(x, weights, ids, w13, w2, act, 1.5, replace(cfg, gemv=(16,) + cfg.gemv[1:]))
            torch.testing.assert_close(got16, got, rtol=0, atol=0, msg=f"gemv 16 rows a program T={T}")
        for T, D, I in [(1, 96, 64), (2, 64, 96), (4, 320, 64)]:  # MXFP4: K tails of 1 and 2 exponent groups
            x, weights, ids, w13, s13, w2, s2 = mxfp4_case(T, 7, 3, D, I, seed=780 + T)
            ids[0, 0] = 9  # another rank's expert
            cfg = moe.experts_config(T, 3, 7, D, I, mxfp4=True)
            assert cfg.gemv is not None, (T, cfg)
            with poisoned_empty():
                got = moe.experts_with(x, weights, ids, w13, w2, Activation(**SITU), 1.0, cfg, (s13, s2))
            want = moe_ref.experts_mxfp4(x, weights, ids, w13, s13, w2, s2, Activation(**SITU), 1.0)
            assert_bf16_close(got, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3),
                              f"gemv mxfp4 T={T} D={D} I={I}")
            with poisoned_empty():
                got16 = moe.experts_with(x, weights, ids, w13, w2, Activation(**SITU), 1.0,
                                         replace(cfg, gemv=(16,) + cfg.gemv[1:]), (s13, s2))
            torch.testing.assert_close(got16, got, rtol=0, atol=0, msg=f"gemv mxfp4 16 rows a program T={T}")
        for T, D, I in [(1, 37, 23), (2, 64, 48)]:
            x, w_gu = randn(T, D, seed=750 + T, dtype=BF16), randn(2 * I, D, seed=751 + T, scale=D ** -0.5, dtype=BF16)
            for fp32_front in (False, True):
                with poisoned_empty():
                    got = moe.glu_linear(x, w_gu, Activation(**SITU), fp32_front)
                want = moe_ref.glu_linear(x, w_gu, Activation(**SITU), fp32_front)
                assert_bf16_close(got, want, want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3),
                                  f"gemv glu_linear T={T} fp32_front={fp32_front}")
    finally:
        moe.GEMV_ROWS, moe.GEMV_PER_MATRIX = saved


def check_moe_layer_takes_the_triton_ops_and_matches_the_reference():
    """K3_KERNELS=triton (set for the child): the switch routes MoE.forward to kernels/moe.py, with
    bf16 and with MXFP4 routed experts."""
    import dataclasses

    from k3backend import kernels
    from k3backend.config import K3Config
    from k3backend.kernels import moe_ref
    from k3backend.model.moe import MoE
    from k3backend.presets import preset_config, random_tensor

    ops = ("router", "moe_front", "experts", "experts_mxfp4", "glu_linear")
    for op in ops:
        assert getattr(kernels, op).__wrapped__ is getattr(moe_ref, op), f"{op} must be registered in kernels.FAST_OPS"
    for quant in (None, "mxfp4"):
        cfg = dataclasses.replace(K3Config.from_dict(preset_config("tiny")).text, num_expert_group=2, topk_group=1,
                                  routed_expert_quant=quant)
        _moe_layer_matches_reference(MoE(cfg), ops, randn(7, cfg.hidden_size, seed=500, dtype=BF16), random_tensor)


def _moe_layer_matches_reference(layer, ops, h, random_tensor):
    from k3backend import kernels
    from k3backend.kernels import moe_ref

    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype == torch.uint8:  # MXFP4 codes and exponents, by make-checkpoint's rule
                p.copy_(random_tensor(name, tuple(p.shape), p.dtype, gen(len(name))))
            else:
                p.copy_(torch.randn(p.shape, generator=gen(len(name))) * (0.1 if "bias" in name else p.shape[-1] ** -0.5))
    layer = layer.to(BF16)
    layer.gate.float()  # the router's weights stay fp32 (model/moe.py Gate)
    got = layer(h)
    fast = {op: getattr(kernels, op) for op in ops}
    for op in ops:
        setattr(kernels, op, getattr(moe_ref, op))
    try:
        want = layer(h)
    finally:
        for op, fn in fast.items():
            setattr(kernels, op, fn)
    assert torch.equal(got, want) or (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
