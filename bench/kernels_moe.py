"""MoE kernels at real sizes for bench/kernels.py: the router (GEMM + route), the route kernel, the fused
latent experts and the shared experts' fused gate-up, each beside its torch reference (kernels/moe_ref.py).

Sizes: the `small` preset (hidden H 2048, latent D 1024, E 64 experts top-6, I 1024) and K3 full width
(K3_LM §0.1, §7.8: H 7168, E 896 experts top-16, latent D 3584, I 3072; bf16 expert weights, 59 GB for one
layer, allocated once and shared by the K3 cases), at T ∈ {1, 16, 64, 256, 512, 8192, 16384} tokens
(the router at 1, 64, 320, 4096). `--smoke`: tiny sizes (E 7, k 3, D 37, I 23, H 300), for
TRITON_INTERPRET=1 on a CPU.
Tile sweep on a GPU: `python bench/kernels_moe.py --shape k3 --tokens 16 512 8192` times the tiles that
kernels/moe.py `experts_config` picks against one-change-at-a-time alternatives (best row marked *; each
row's largest error against the reference, in bf16 ulps of the row's largest output, must stay <= 2).
`--router` does the same for the router GEMM's launch (`router_config`: K splits, BK, stages, token tile),
`--front` for the latent MoE's front (`moe_front`: the router and the down-projection in the same two kernels).
`--per-kernel` adds each experts candidate's kernels' device times (up, down, align, sum) and each GEMM's TFLOP/s.

Routing: independent N(0, 1) logits spread tokens almost uniformly over the experts (busiest expert
1.1-1.3× the mean load at 8 K tokens), which flatters the prefill tail. The logits here add a fixed
per-expert popularity N(0, 0.15²), the skew of a load-balanced (bias-corrected) router: at 8 K tokens
the busiest expert gets ~2× (small) and ~4× (K3) the mean; a decode step of 16 tokens touches ~50 of
64 and ~218 of 896 experts. Top-k over many experts amplifies logit offsets (σ 0.3 already gives 9×),
so keep it small. The correction bias is N(0, 0.01²). The shape column gives the experts actually hit.

Figures:
- router: the model's router op (kernels/routing.py `router`: split-K GEMM on bf16 h and the fp32 gate weight,
  then the route kernel) at the hidden width; its `vs ref` is the three kernels MoE.forward ran before
  (h.to(fp32), cuBLAS's fp32 GEMM, routing.route). bytes = h + the fp32 weight read + weights and ids
  written; flops = 2·T·E·H (useful work, not the three bf16 MMAs per product). The gate weight is
  random fp32 (not bf16 values), so the weight's three-part split is checked.
- front: `moe_front`'s two kernels at every T (the router GEMM with the latent down-projection's bf16 rows as
  more row tiles, then the route kernel, which also adds the down-projection's splits; the op itself takes
  them only where `front_fused` says) against what MoE.forward ran before and still runs elsewhere: `router`,
  then the down-projection (`linear`: the GEMV up to 8 rows, cuBLAS above). bytes = h + both weights + the
  outputs. check: ids and weights as the router's (near ties skipped), the latent within CHECK_ULPS bf16
  ulps of the fp64 product rounded once.
- route: bytes = logits read + weights and ids written.
- experts: bytes = the expert weights actually touched (distinct experts hit × 3·I·D·2 bytes) + x read
  + out written; the intermediate h and per-slot y round trips are not counted. flops = 2·T·k·3·I·D
  (useful work; the padding rows of each expert's last block are not counted).
- shared_glu: the shared experts' gate-up GEMM with SiTU reading the fp32 accumulator (§7.6), against
  moe_ref.glu_linear (an fp32 GEMM on upcast weights, what model/moe.py ran before); bytes = w_gu + x + h.
- check: router ids must equal the old path's wherever the k-th and (k+1)-th biased scores (of the fp64
  logits) are more than 1e-5 apart (the check names the near ties it skipped), weights within fp32
  rounding, logits (the sum of the splits) within ROUTER_LOGITS_REL of each row's largest against fp64,
  two runs bit-equal; route ids must equal the reference's exactly (same fp32 sigmoid), weights within fp32
  rounding; experts within CHECK_ULPS bf16 ulps of each row's largest |output|, and the share of
  elements that are not bit-equal is reported (cuBLAS and the Triton GEMMs accumulate in different
  orders, so some roundings of gu, h, y_e flip; tests/tolerances.py MOE_BF16_* explains the bound).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import Case

from k3backend.kernels import moe_ref

CHECK_ULPS = 2.0  # as tests/tolerances.py MOE_BF16_ULPS
ROUTER_LOGITS_REL = 2e-6  # as tests/tolerances.py
TOKENS = (1, 16, 64, 256, 512, 8192, 16384)
ROUTER_TOKENS = (1, 64, 320, 4096)
FRONT_TOKENS = (1, 2, 4, 8, 16, 64)


@dataclass(frozen=True)
class Shape:
    name: str
    E: int
    k: int
    D: int  # expert input width: the latent
    I: int  # expert width
    H: int  # hidden size: the router's input width


SMALL = Shape("small", 64, 6, 1024, 1024, 2048)
K3 = Shape("k3", 896, 16, 3584, 3072, 7168)
SMOKE = Shape("smoke", 7, 3, 37, 23, 300)
SITU = moe_ref.Activation("situ", 4.0, 25.0)


class _Layer:
    """One MoE layer's routed experts and router statistics, on the device, seeded."""

    def __init__(self, s: Shape, device: str) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.s, self.device, self.gen = s, device, g
        self.w13 = _randn_bf16((s.E, 2 * s.I, s.D), s.D ** -0.5, g, device)  # [E, 2I, D] = [w1 ; w3]
        self.w2 = _randn_bf16((s.E, s.D, s.I), s.I ** -0.5, g, device)
        self.popularity = torch.randn(s.E, generator=g, device=device) * 0.15
        self.bias = torch.randn(s.E, generator=g, device=device) * 0.01

    def logits(self, T: int) -> torch.Tensor:
        return torch.randn(T, self.s.E, generator=self.gen, device=self.device) + self.popularity


def _randn_bf16(shape: tuple[int, ...], scale: float, g: torch.Generator, device: str) -> torch.Tensor:
    """bf16 N(0, scale²) filled one expert at a time (no fp32 copy of a 59 GB tensor)."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    for e in range(shape[0]):
        out[e] = (torch.randn(shape[1:], generator=g, device=device) * scale).bfloat16()
    return out


def _route_case(layer: _Layer, T: int) -> Case:
    from k3backend.kernels import routing

    s = layer.s
    logits = layer.logits(T)
    args = (logits, layer.bias, s.k, 1, 1, True, 1.0)
    ok, reason = routing.route_supports(*args)
    assert ok, reason

    def check() -> str:
        (w, ids), (w_ref, ids_ref) = routing.route(*args), moe_ref.route(*args)
        same = (ids == ids_ref).all(-1)
        assert bool(same.all()), f"route: ids differ in {int((~same).sum())} of {T} tokens"
        torch.testing.assert_close(w, w_ref, rtol=2e-5, atol=2e-6)
        return f"ids equal, weights max Δ {(w - w_ref).abs().max().item():.1e}"

    return Case(family="moe", name=f"route_{s.name}", shape=f"T{T} E{s.E} k{s.k}", run=lambda: routing.route(*args),
                ref=lambda: moe_ref.route(*args), bytes=T * s.E * 4 + T * s.k * 12, check=check)


def _router_inputs(s: Shape, T: int, device: str) -> tuple:
    """The router op's arguments: bf16 h [T, H], a random fp32 gate weight [E, H] (logits ~N(0, 1)), bias."""
    g = torch.Generator(device=device).manual_seed(T)
    h = torch.randn(T, s.H, generator=g, device=device).bfloat16()
    weight = torch.randn(s.E, s.H, generator=g, device=device) * s.H ** -0.5
    bias = torch.randn(s.E, generator=g, device=device) * 0.01
    return h, weight, bias, s.k, 1, 1, True, 1.0


def _old_router(h, weight, bias, k, n_group, topk_group, renormalize, scaling):
    """What MoE.forward ran before `router`: h.to(fp32), cuBLAS's fp32 GEMM, the route kernel."""
    from k3backend.kernels import routing

    return routing.route(F.linear(h.to(torch.float32), weight), bias, k, n_group, topk_group, renormalize, scaling)


def _router_case(s: Shape, T: int, device: str) -> Case:
    from k3backend.kernels import routing

    args = _router_inputs(s, T, device)
    h, weight, bias, k = args[:4]
    ok, reason = routing.router_supports(*args)
    assert ok, reason
    cfg = routing.router_config(T, s.E, s.H)

    def check() -> str:
        (w, ids), (w_old, ids_old) = routing.router(*args), _old_router(*args)
        again = routing.router(*args)
        assert torch.equal(w, again[0]) and torch.equal(ids, again[1]), "router: two runs differ"
        exact = h.double() @ weight.double().T
        logits = routing._router_logits(h, weight, cfg).double().sum(0)
        err = ((logits - exact).abs().amax(-1) / exact.abs().amax(-1)).max().item()
        err_old = ((F.linear(h.float(), weight).double() - exact).abs().amax(-1) / exact.abs().amax(-1)).max().item()
        assert err <= ROUTER_LOGITS_REL, f"router: logits off by {err:.1e} of the row's largest > {ROUTER_LOGITS_REL}"
        ranked = (torch.sigmoid(exact) + bias.double()).sort(-1, descending=True).values
        clear = ranked[:, k - 1] - ranked[:, k] > 1e-5  # tokens whose selection no rounding can flip
        same = (ids == ids_old).all(-1)
        assert bool(same[clear].all()), f"router: ids differ in {int((~same[clear]).sum())} of {T} tokens"
        torch.testing.assert_close(w[clear], w_old[clear], rtol=2e-5, atol=2e-6)
        return (f"ids equal ({int((~clear).sum())} near ties skipped), weights max Δ "
                f"{(w - w_old)[clear].abs().max().item():.1e}, logits {err:.1e} (old {err_old:.1e})")

    return Case(family="moe", name=f"router_{s.name}", shape=f"T{T} E{s.E} H{s.H} S{cfg.splits}",
                run=lambda: routing.router(*args), ref=lambda: _old_router(*args),
                bytes=T * s.H * 2 + s.E * s.H * 4 + T * s.k * 12, flops=2.0 * T * s.E * s.H, check=check)


def _down_weight(s: Shape, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(s.D)
    return (torch.randn(s.D, s.H, generator=g, device=device) * s.H ** -0.5).bfloat16()


def _old_front(h, weight, bias, down, k, n_group, topk_group, renormalize, scaling):
    """What MoE.forward ran before `moe_front`: the router's two kernels, then the down-projection."""
    from k3backend import kernels
    from k3backend.kernels import routing

    return *routing.router(h, weight, bias, k, n_group, topk_group, renormalize, scaling), kernels.linear(h, down)


def _front_case(s: Shape, T: int, device: str) -> Case:
    from k3backend.kernels import routing

    h, weight, bias, k, *how = _router_inputs(s, T, device)
    down = _down_weight(s, device)
    args = (h, weight, bias, down, k, *how)
    ok, reason = routing.moe_front_supports(*args)
    assert ok, reason
    cfg = routing.router_config(T, s.E, s.H, s.D)

    def check() -> str:
        (w, ids, z), (w_old, ids_old, _) = routing.moe_front_with(*args, cfg), _old_front(*args)
        again = routing.moe_front_with(*args, cfg)
        assert all(torch.equal(a, b) for a, b in zip((w, ids, z), again)), "front: two runs differ"
        ranked = (torch.sigmoid(h.double() @ weight.double().T) + bias.double()).sort(-1, descending=True).values
        clear = ranked[:, k - 1] - ranked[:, k] > 1e-5  # tokens whose selection no rounding can flip
        assert bool((ids == ids_old).all(-1)[clear].all()), "front: ids differ from the router's"
        torch.testing.assert_close(w[clear], w_old[clear], rtol=2e-5, atol=2e-6)
        exact = h.double() @ down.double().T
        ulp = exact.abs().amax(-1, keepdim=True).clamp_min(1e-6) * 2.0 ** -7
        worst = ((z.double() - exact.bfloat16().double()).abs() / ulp).max().item()
        differ = (z != exact.bfloat16()).float().mean().item()
        assert worst <= CHECK_ULPS, f"front: latent off by {worst:.2f} bf16 ulps > {CHECK_ULPS}"
        return (f"ids, weights as the router's ({int((~clear).sum())} near ties skipped), latent max {worst:.2f} ulp, "
                f"{differ:.1%} not the rounded fp64")

    return Case(family="moe", name=f"front_{s.name}", shape=f"T{T} E{s.E} L{s.D} H{s.H} S{cfg.splits}",
                run=lambda: routing.moe_front_with(*args, cfg), ref=lambda: _old_front(*args),
                bytes=T * s.H * 2 + s.E * s.H * 4 + s.D * s.H * 2 + T * (s.k * 12 + s.D * 2),
                flops=2.0 * T * (s.E + s.D) * s.H, check=check)


def _experts_case(layer: _Layer, T: int) -> Case:
    from k3backend.kernels import moe

    s = layer.s
    w, ids = moe_ref.route(layer.logits(T), layer.bias, s.k, 1, 1, True, 1.0)
    x = torch.randn(T, s.D, generator=layer.gen, device=layer.device).bfloat16()
    args = (x, w, ids, layer.w13, layer.w2, SITU, 1.0)
    ok, reason = moe.experts_supports(*args)
    assert ok, reason
    hit = int(torch.unique(ids).numel())  # host sync here, at set-up only
    cfg = moe.experts_config(T, s.k, s.E, s.D, s.I)

    def check() -> str:
        got, want = moe.experts(*args), moe_ref.experts(*args)
        assert not got.isnan().any(), "experts: NaN in the output"
        assert torch.equal(got, moe.experts(*args)), "experts: two runs differ (row placement must not matter)"
        ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-6) * 2.0 ** -7
        worst = ((got.float() - want.float()).abs() / ulp).max().item()
        differ = (got != want).float().mean().item()
        assert worst <= CHECK_ULPS, f"experts: max error {worst:.2f} bf16 ulps > {CHECK_ULPS} ({differ:.1%} differ)"
        return f"max {worst:.2f} ulp <= {CHECK_ULPS}, {differ:.1%} not bit-equal"

    expert_bytes = 3 * s.I * s.D * 2
    return Case(family="moe", name=f"experts_{s.name}", shape=f"T{T} hit{hit}/{s.E} BM{cfg.block_m}",
                run=lambda: moe.experts(*args), ref=lambda: moe_ref.experts(*args),
                bytes=hit * expert_bytes + 2 * T * s.D * 2 + T * s.k * 12,
                flops=2.0 * T * s.k * 3 * s.I * s.D, check=check)


def _glu_linear_case(D: int, I: int, T: int, label: str, device: str) -> Case:
    """The shared experts' gate-up GEMM + SiTU with the fp32 front (§7.6): x [T, D], w_gu [2I, D]."""
    from k3backend.kernels import moe

    g = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, D, generator=g, device=device).bfloat16()
    w_gu = (torch.randn(2 * I, D, generator=g, device=device) * D ** -0.5).bfloat16()
    args = (x, w_gu, SITU, True)
    ok, reason = moe.glu_linear_supports(*args)
    assert ok, reason

    def check() -> str:
        got, want = moe.glu_linear(*args), moe_ref.glu_linear(*args)
        assert not got.isnan().any(), "glu_linear: NaN in the output"
        ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-6) * 2.0 ** -7
        worst = ((got.float() - want.float()).abs() / ulp).max().item()
        differ = (got != want).float().mean().item()
        assert worst <= CHECK_ULPS, f"glu_linear: max error {worst:.2f} bf16 ulps > {CHECK_ULPS} ({differ:.1%} differ)"
        return f"max {worst:.2f} ulp <= {CHECK_ULPS}, {differ:.1%} not bit-equal"

    return Case(family="moe", name=f"shared_glu_{label}", shape=f"T{T} D{D} 2I{2 * I}",
                run=lambda: moe.glu_linear(*args), ref=lambda: moe_ref.glu_linear(*args),
                bytes=2 * I * D * 2 + T * (D + I) * 2, flops=2.0 * T * 2 * I * D, check=check)


def cases(args: argparse.Namespace) -> list[Case]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        layer = _Layer(SMOKE, device)
        return ([_router_case(SMOKE, T, device) for T in (1, 70)] + [_front_case(SMOKE, T, device) for T in (1, 70)]
                + [_route_case(layer, 5)]
                + [_experts_case(layer, T) for T in (1, 5, 61)] + [_glu_linear_case(37, 23, 9, "smoke", device)])
    out = []
    for shape in (SMALL, K3):
        out += [_router_case(shape, T, device) for T in ROUTER_TOKENS]
        out += [_front_case(shape, T, device) for T in FRONT_TOKENS]
        layer = _Layer(shape, device)
        out += [_route_case(layer, T) for T in (1, 256, 16384)]
        out += [_experts_case(layer, T) for T in TOKENS]
    for D, I, label in ((2048, 1024, "small"), (7168, 6144, "k3")):  # hidden, shared width (K3: 2 × 3072)
        out += [_glu_linear_case(D, I, T, label, device) for T in (16, 64, 256, 8192)]
    return out


# ----------------------------------------------------------------------------- tile sweep (GPU, by hand)
def _candidates(cfg) -> list:
    """The chosen tiles, then one change at a time: up's tiles, down's tiles, BM, GROUP_M, the align form, x by TMA
    (and where the rule takes BM 128, BM 64 with its widest up tile); the GEMV kernels' tiles (ExpertsConfig.gemv)
    where the shape is small enough to choose them, two of them beside BM 16."""
    from dataclasses import replace

    tiles = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (64, 64, 4, 6),
             (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 32, 4, 6),
             (64, 64, 8, 4), (64, 128, 8, 3)]  # BN 64 on 8 warps: half the accumulator registers of BN 128
    out = [cfg]
    out += [replace(cfg, up=t) for t in tiles if t != cfg.up]
    out += [replace(cfg, down=t) for t in tiles if t != cfg.down]
    out += [replace(cfg, block_m=bm) for bm in (16, 32, 64, 128) if bm != cfg.block_m]
    out += [replace(cfg, group_m=g) for g in (1, 4, 16) if g != cfg.group_m]
    out += [replace(cfg, reserve=not cfg.reserve)]  # the align kernels' other form
    out += [replace(cfg, xtma=True)] if cfg.tma else []  # up's x permuted first and read by TMA
    if cfg.block_m == 128:  # BM 64's widest up tile (2 x 64 x 256 accumulators; at BM 128 they would spill)
        out += [replace(cfg, block_m=64, up=(256, 64, 8, 3))]
    gemv = [(16, 256, 4, 3), (8, 512, 4, 3), (32, 128, 4, 3), (8, 256, 2, 3), (16, 128, 4, 3)]
    if cfg.gemv is not None:  # a few rows: the GEMV tiles, and the MMA tiles above (gemv None) for comparison
        out = [cfg] + [replace(cfg, gemv=t) for t in gemv if t != cfg.gemv] + [replace(c, gemv=None) for c in out]
    elif cfg.block_m == 16:  # two of them beside decode's MMA tiles (at prefill sizes they take seconds a row)
        out += [replace(cfg, gemv=t) for t in gemv[:2]]
    return out


# tiles tried with TMA descriptors (--tma): up holds two B tiles a stage, so its list stays within shared memory
TMA_UP = [(128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 5), (64, 128, 4, 3), (128, 32, 4, 6)]
TMA_DOWN = [(128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 5)]


def _tma_candidates(cfg) -> list:
    """The chosen tiles without and with TMA descriptors (ExpertsConfig.tma), then TMA with one change at a time."""
    from dataclasses import replace

    t = replace(cfg, tma=True, gemv=None)
    return ([cfg, t] + [replace(t, up=u) for u in TMA_UP if u != t.up]
            + [replace(t, down=d) for d in TMA_DOWN if d != t.down]
            + [replace(t, block_m=bm) for bm in (64, 128) if bm != t.block_m] + [replace(t, group_m=g) for g in (4, 16)])


# the experts op's kernels by part: a kernel goes to the first part whose name it contains, else to "other" (the x
# copy of xtma, a chunk's expert ids)
PARTS = (("up", "_up_kernel"), ("down", "_down_kernel"), ("align", "_align_"), ("sum", "_sum_kernel"),
         ("expand", "_expand_kernel"))


def parts_us(kernels: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """µs a call of each part (PARTS) from (kernel name, device µs) pairs over `calls` calls, largest first."""
    out: dict[str, float] = {}
    for name, us in kernels:
        part = next((p for p, key in PARTS if key in name), "other")
        out[part] = out.get(part, 0.0) + us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def per_kernel(run, calls: int = 10) -> dict[str, float]:
    """`parts_us` of `calls` eager calls of run (after one untimed), from torch.profiler's device times."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return parts_us([(e.name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
                     for e in cuda], calls)


def sweep(shape: Shape, tokens: list[int], iters: int, tma: bool = False, kernels: bool = False) -> None:
    """Time `experts_with` over tile candidates (`_candidates`, or with tma `_tma_candidates`); print one
    line per candidate as it is timed (kernels: then each part's device µs, `per_kernel`, and the two GEMMs'
    TFLOP/s), then the fastest of those whose error is finite again, marked."""
    from k3backend.kernels import moe

    layer = _Layer(shape, "cuda")
    for T in tokens:
        w, ids = moe_ref.route(layer.logits(T), layer.bias, shape.k, 1, 1, True, 1.0)
        x = torch.randn(T, shape.D, generator=layer.gen, device="cuda").bfloat16()
        hit = int(torch.unique(ids).numel())
        byts, flops = hit * 3 * shape.I * shape.D * 2, 2.0 * T * shape.k * 3 * shape.I * shape.D
        want = moe_ref.experts(x, w, ids, layer.w13, layer.w2, SITU, 1.0)
        chosen = moe.experts_config(T, shape.k, shape.E, shape.D, shape.I)
        run_of = lambda cfg: lambda: moe.experts_with(x, w, ids, layer.w13, layer.w2, SITU, 1.0, cfg)  # noqa: E731

        def line(t: float, cfg, err: float, mark: str = " ") -> None:
            print(f"{mark} {shape.name} T{T:<6} {t * 1e3:9.3f} ms {byts / t / 1e12:5.2f} TB/s {err:4.2f} ulp "
                  f"{flops / t / 1e12:6.1f} TFLOP/s  "
                  + (f"gemv{cfg.gemv}" if cfg.gemv else f"BM{cfg.block_m} up{cfg.up} down{cfg.down} G{cfg.group_m}")
                  + "".join(f" {f}" for f in ("tma", "xtma", "reserve") if getattr(cfg, f)), flush=True)

        def show(t: float, cfg, err: float) -> None:  # each row as it is timed: a cut-short sweep keeps its rows
            line(t, cfg, err)
            if kernels:
                us = per_kernel(run_of(cfg))
                gemm = {p: flops * (2 if p == "up" else 1) / 3 / us[p] / 1e6 for p in ("up", "down") if us.get(p)}
                print("      " + "  ".join(f"{p} {v:.1f}" for p, v in us.items()) + " us;  "
                      + "  ".join(f"{p} {v:.0f} TFLOP/s" for p, v in gemm.items()), flush=True)

        rows = _timed(_tma_candidates(chosen) if tma else _candidates(chosen), run_of, want, iters,
                      f"{shape.name} T{T}", show)
        line(*min((r for r in rows if math.isfinite(r[2])), key=lambda r: r[0]), mark="*")


def _timed(cands: list, run_of, want: torch.Tensor, iters: int, label: str,
           show=None) -> list[tuple[float, object, float]]:
    """(seconds, config, largest error in bf16 ulps of each row's largest |want|) of each candidate;
    run_of(config) gives the call; show(seconds, config, error), if given, is called on each row as it is
    timed. A tile that does not compile or fit is reported and skipped."""
    from kernels import time_fn

    ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-6) * 2.0 ** -7
    rows = []
    for cfg in cands:
        run = run_of(cfg)
        try:
            err = ((run().float() - want.float()).abs() / ulp).max().item()  # every element
            t = time_fn(run, True, iters)
        except Exception as e:  # noqa: BLE001
            print(f"{label} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        rows.append((t, cfg, err))
        if show is not None:
            show(t, cfg, err)
    return rows


def glu_sweep(D: int, I: int, tokens: list[int], iters: int, tma: bool = False) -> None:
    """Time the dense glu (glu_linear with the fp32 front: the shared experts) over BM x BN x BK x
    stages; the chosen tiles first, the fastest marked."""
    from dataclasses import replace
    from itertools import product

    from k3backend.kernels import moe

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, the harness only
    g = torch.Generator(device=dev).manual_seed(0)
    w_gu = (torch.randn(2 * I, D, generator=g, device=dev) * D ** -0.5).bfloat16()
    act = SITU
    for T in tokens:
        x = torch.randn(T, D, generator=g, device=dev).bfloat16()
        want = moe_ref.glu_linear(x, w_gu, act, True)
        chosen = moe.experts_config(T, 1, 1, D, I)
        if tma:
            cands = [chosen] + [replace(chosen, block_m=bm, up=u, gemv=None, tma=True)
                                for bm, u in product((64, 128), [chosen.up] + TMA_UP)]
        else:
            cands = [chosen] + [replace(chosen, block_m=bm, up=(bn, bk, 8 if bm * bn >= 128 * 128 else 4, st),
                                        gemv=None)
                                for bm, bn, bk, st in product((16, 32, 64, 128), (16, 32, 64, 128), (64, 128), (3, 4))]
        h = torch.empty(T, I, dtype=x.dtype, device=dev)
        rows = _timed(cands, lambda cfg: lambda: (moe._launch_up(x, w_gu, None, h, None, None, T, 1, act, cfg,
                                                                  dense=True, round_gu=False), h)[1],
                      want, iters, f"glu T{T}")
        best = min(t for t, _, _ in rows)
        byts = 2 * I * D * 2
        for t, cfg, err in [rows[0]] + sorted(rows[1:], key=lambda r: r[0])[:12]:
            print(f"{'*' if t == best else ' '} glu D{D} I{I} T{T:<5} {t * 1e6:7.1f} us {byts / t / 1e12:5.2f} TB/s "
                  f"{err:4.2f} ulp  " + (f"gemv{cfg.gemv}" if cfg.gemv else f"BM{cfg.block_m} up{cfg.up}")
                  + (" tma" if cfg.tma else "") + ("  (chosen)" if cfg is chosen else ""), flush=True)


def router_sweep(shape: Shape, tokens: list[int], iters: int, front: bool = False) -> None:
    """Time `router_with` (front: `moe_front_with`) over launches (K splits x BK x stages x token tile), the
    chosen one first, each one's logits error against fp64 checked; the fastest marked; then the old path."""
    from dataclasses import replace
    from itertools import product

    import triton
    from kernels import time_fn

    from k3backend.kernels import routing

    what = "front" if front else "router"
    down = _down_weight(shape, "cuda") if front else None
    for T in tokens:
        args = _router_inputs(shape, T, "cuda")
        h, weight = args[:2]
        full = (*args[:3], down, *args[3:]) if front else args
        exact = h.double() @ weight.double().T
        chosen = routing.router_config(T, shape.E, shape.H, shape.D if front else 0)
        cands = [chosen]
        for splits, bk, stages, bt in product((1, 2, 4, 8, 11, 16, 32), (32, 64, 128), (3, 4), (16, 32, 64, 128)):
            steps = triton.cdiv(shape.H, bk)
            if bt < chosen.block_t // 2 or bt > chosen.block_t * 2 or steps < splits:
                continue
            per = triton.cdiv(steps, splits)  # K steps per split, none left empty
            cfg = replace(chosen, block_t=bt, block_k=bk, stages=stages, splits=triton.cdiv(steps, per), split_k=per * bk)
            if cfg not in cands:
                cands.append(cfg)
        rows = []
        for cfg in cands:
            try:
                err = ((routing._router_logits(h, weight, cfg)[..., :shape.E].double().sum(0) - exact).abs().amax(-1)
                       / exact.abs().amax(-1)).max().item()
                run = routing.moe_front_with if front else routing.router_with
                t = time_fn(lambda cfg=cfg: run(*full, cfg), True, iters)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile or fit: report, go on
                print(f"{what} T{T} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            rows.append((t, cfg, err))
        best = min(t for t, _, _ in rows)
        for t, cfg, err in [rows[0]] + sorted(rows[1:], key=lambda r: r[0])[:12]:
            print(f"{'*' if t == best else ' '} {what} {shape.name} T{T:<5} {t * 1e6:7.1f} us  logits {err:.1e}  "
                  f"S{cfg.splits} BT{cfg.block_t} BK{cfg.block_k} st{cfg.stages}" + ("  (chosen)" if cfg is chosen else ""),
                  flush=True)
        old, label = ((lambda: _old_front(*full)), "old path (router, then linear)") if front else \
            ((lambda: _old_router(*args)), "old path (h.to(fp32), cuBLAS fp32 GEMM, route kernel)")
        print(f"  {what} {shape.name} T{T:<5} {time_fn(old, True, iters) * 1e6:7.1f} us  {label}", flush=True)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ap = argparse.ArgumentParser(description="sweep the experts tiles on a GPU (the first row is the current choice)")
    ap.add_argument("--shape", choices=("small", "k3"), default="small")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--glu", nargs="*", metavar="DxI", help="the dense glu instead, at --tokens: its D x I "
                    "(default the shape's shared experts: 2048x1024 small, 7168x6144 K3; the dense MLP is 2048x8192)")
    ap.add_argument("--router", action="store_true", help="the router GEMM's launches instead, at --tokens")
    ap.add_argument("--front", action="store_true", help="moe_front's launches (router + down-projection) instead")
    ap.add_argument("--tma", action="store_true",
                    help="experts and glu: the chosen tiles against TMA-descriptor variants")
    ap.add_argument("--per-kernel", action="store_true",
                    help="experts: each candidate's kernels' device time too (up, down, align, sum; torch.profiler)")
    a = ap.parse_args()
    shape = SMALL if a.shape == "small" else K3
    if a.router or a.front:
        router_sweep(shape, a.tokens, a.iters, front=a.front)
    elif a.glu is not None:
        for dims in a.glu or ["2048x1024" if a.shape == "small" else "7168x6144"]:
            glu_sweep(*map(int, dims.split("x")), a.tokens, a.iters, a.tma)
    else:
        sweep(shape, a.tokens, a.iters, a.tma, a.per_kernel)
