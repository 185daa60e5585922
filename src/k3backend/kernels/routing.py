"""Triton router ops (K3_LM.md §7.3): the MoE router `router`, its second kernel `route`, and the latent
MoE's front `moe_front` (the router and the latent down-projection, which read the same input, together).

Same names, signatures and semantics as `moe_ref.py`; `kernels/__init__.py` imports this module
lazily. router: two kernels. A split-K GEMM writes S partial fp32 sums of the logits h·wᵀ [S, T, E]
from bf16 h and the fp32 gate weight (three exact bf16 parts of each weight tile,
`_router_gemm_kernel`); the route kernel adds them in split order, then sigmoid, bias, grouped top-k
(one program per token). Before, three kernels: h.to(fp32), cuBLAS's fp32 (SIMT) GEMM and the route
kernel. moe_front: the same two kernels with the down-projection's bf16 rows [L, D] as more row tiles of
the GEMM (one MMA a step) and more programs of the route kernel, which add their splits and round once:
two launches where a decode step had three. No host syncs: the launch is a pure function of the shapes
(graph capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl
from k3backend.kernels.moe import _GPU, _div, _mma, _round, _sigmoid

_MAX_EXPERTS = 4096  # route: one program holds a token's E scores in registers
# router_config: K splits until the GEMM has about two waves of programs on the H200's 132 SMs, none
# narrower than ROUTER_MIN_SPLIT_K (fewer partial sums for the route kernel to add).
ROUTER_PROGRAMS = 264
ROUTER_MIN_SPLIT_K = 64


# ----------------------------------------------------------------------------- router
@triton.jit
def _split_k_tile(w_ptr, stride_w, rows, n_rows, h_ptr, stride_ht, t, T, k0, D, split_k, EVEN_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, FP32_W: tl.constexpr,
                  GPU: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """Σ w[rows, k]·h[t, k] over [k0, k0 + split_k) in fp32, [BLOCK_E, BLOCK_T]. FP32_W: each fp32 weight tile
    is split in registers into three bf16 parts, hi + mid + lo = w exactly (each holds the next 8 bits of the
    24-bit significand), and every product of two bf16 values is exact in fp32: three bf16 MMAs give the fp32
    GEMM up to summation order, at tensor-core speed, from the fp32 weight in memory. Else: bf16 weights, one MMA.
    EARLY (`pdl.early`): L2 is asked for the split's weights before the wait for the previous kernel (no kernel
    writes them); the loop loads its steps ahead (num_stages) either way. Loading the first step into registers
    there instead, with a loop that then loaded each next step, measured slower (one H100, `small`, batch 1: 6.4
    -> 7.4 µs a call on the critical path)."""
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + (rows % n_rows).to(tl.int64) * stride_w  # % keeps edges in bounds
    w_ptrs = w_rows[:, None] + (k0 + kk)[None, :]
    h_ptrs = h_ptr + (t % T).to(tl.int64)[None, :] * stride_ht + (k0 + kk)[:, None]  # hᵀ [BLOCK_K, BLOCK_T]
    if EARLY:
        pdl.prefetch_rows(w_rows, k0, tl.minimum(D, k0 + split_k), BLOCK_K, PDL)
    pdl.enter(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
    for k in range(k0, tl.minimum(D, k0 + split_k), BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            hb = tl.load(h_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(kk < D - k)[None, :], other=0.0)
            hb = tl.load(h_ptrs, mask=(kk < D - k)[:, None], other=0.0)
        if FP32_W:
            hi = w.to(tl.bfloat16)
            r = w - hi.to(tl.float32)  # exact: |r| < one bf16 ulp of w
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)  # exact: at most 8 significant bits remain
            acc = _mma(hi, hb, acc, GPU)
            acc = _mma(mid, hb, acc, GPU)
            acc = _mma(lo, hb, acc, GPU)
        else:
            acc = _mma(w, hb, acc, GPU)
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["T"])
def _router_gemm_kernel(h_ptr, w_ptr, d_ptr, out_ptr, T, E, L, D, split_k, stride_ht, stride_we, stride_wd,
                        stride_os, stride_ot, GPU: tl.constexpr, EVEN_K: tl.constexpr, FRONT: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, EARLY: tl.constexpr,
                        PDL: tl.constexpr):
    """out[s, t, e] = Σ h[t, d]·w[e, d] over split s's K range [s·split_k, (s+1)·split_k), in fp32.

    A tile of logitsᵀ [BLOCK_E, BLOCK_T]: the experts fill the MMA's 64 rows and a decode step's few
    tokens its N. FRONT: the row tiles past the gate's take the bf16 down-projection d [L, D] into
    out[s, t, E + l]. `_split_k_tile` waits for the previous kernel (PDL).
    """
    pid_e, pid_t, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    k0 = s * split_k
    gate_tiles = tl.cdiv(E, BLOCK_E)
    down = False
    if FRONT:
        down = pid_e >= gate_tiles
    if down:
        rows = (pid_e - gate_tiles) * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = _split_k_tile(d_ptr, stride_wd, rows, L, h_ptr, stride_ht, t, T, k0, D, split_k, EVEN_K, BLOCK_E,
                            BLOCK_T, BLOCK_K, False, GPU, EARLY, PDL)
        cols, ok = E + rows, rows < L
    else:
        rows = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = _split_k_tile(w_ptr, stride_we, rows, E, h_ptr, stride_ht, t, T, k0, D, split_k, EVEN_K, BLOCK_E,
                            BLOCK_T, BLOCK_K, True, GPU, EARLY, PDL)
        cols, ok = rows, rows < E
    out = out_ptr + s.to(tl.int64) * stride_os + t.to(tl.int64)[None, :] * stride_ot + cols[:, None]
    tl.store(out, acc, mask=ok[:, None] & (t < T)[None, :])


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, z_ptr, stride_ls, stride_lt, stride_wt, stride_it,
                  stride_zt, E, L, per_group, scaling, SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, FRONT: tl.constexpr,
                  BLOCK_L: tl.constexpr, GPU: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0): token t's E scores as a [group, member] tile; top-k by repeated argmax. The
    logits are the sum of SPLITS partial sums [SPLITS, T, E + L] (the router GEMM's K splits), added in
    split order: the same bits on every run (no atomics). FRONT, program (t, c > 0): BLOCK_L columns of
    the down-projection z[t] = bf(Σ_s partial[s, t, E + l]), the same way."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if FRONT:
        c = tl.program_id(1)
        if c > 0:
            j = (c - 1) * BLOCK_L + tl.arange(0, BLOCK_L)
            p = logits_ptr + t * stride_lt + E + j
            z = tl.load(p, mask=j < L, other=0.0)
            for _ in tl.static_range(SPLITS - 1):
                p += stride_ls
                z += tl.load(p, mask=j < L, other=0.0)
            tl.store(z_ptr + t * stride_zt + j, _round(z, z_ptr.dtype.element_ty, GPU), mask=j < L)
            return
    gi = tl.arange(0, BLOCK_G)
    pi = tl.arange(0, BLOCK_P)
    ok = (gi[:, None] < N_GROUP) & (pi[None, :] < per_group)
    e = gi[:, None] * per_group + pi[None, :]  # expert id [BLOCK_G, BLOCK_P]
    row = logits_ptr + t * stride_lt + e
    x = tl.load(row, mask=ok, other=0.0)
    for _ in tl.static_range(SPLITS - 1):
        row += stride_ls
        x += tl.load(row, mask=ok, other=0.0)
    s = _sigmoid(x, GPU)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + e, mask=ok, other=0.0)
    c = tl.where(ok, c, float("-inf"))
    if N_GROUP > 1:  # keep the TOPK_GROUP groups with the largest sum of their two best biased scores
        m1 = tl.max(c, axis=1)
        first = tl.min(tl.where(c == m1[:, None], pi[None, :], BLOCK_P), axis=1)
        m2 = tl.max(tl.where(pi[None, :] == first[:, None], float("-inf"), c), axis=1)
        score = tl.where(gi < N_GROUP, m1 + m2, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.min(tl.where(score == tl.max(score, axis=0), gi, BLOCK_G), axis=0)  # ties: lowest group
            keep = keep | (gi == best)
            score = tl.where(gi == best, float("-inf"), score)
        c = tl.where(keep[:, None], c, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    big = BLOCK_G * BLOCK_P
    for j in tl.static_range(TOP_K):  # ids in descending biased score, ties to the lowest id
        top = tl.max(tl.max(c, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(c == top, e, big), axis=1), axis=0)
        hit = (e == pick) & ok  # padding members alias the next group's ids
        w = tl.where(kk == j, tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=1), axis=0), w)  # unbiased score
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        c = tl.where(hit, float("-inf"), c)
    if RENORMALIZE:
        w = _div(w, tl.sum(w, axis=0), GPU)
    tl.store(w_ptr + t * stride_wt + kk, w * scaling, mask=kk < TOP_K)
    tl.store(ids_ptr + t * stride_it + kk, ids, mask=kk < TOP_K)


def _route_args_supported(E: int, device: torch.device, correction_bias: torch.Tensor | None, top_k: int,
                          n_group: int, topk_group: int) -> tuple[bool, str]:
    """What the route kernel needs of the routing arguments for E experts on `device`."""
    if E > _MAX_EXPERTS:
        return False, f"num_experts {E} > {_MAX_EXPERTS} (one program per token)"
    if correction_bias is not None and (correction_bias.dtype != torch.float32 or correction_bias.shape != (E,)
                                        or correction_bias.device != device or correction_bias.stride(0) != 1):
        return False, (f"correction_bias: expected float32 [{E}] on {device}, got {correction_bias.dtype} "
                       f"{list(correction_bias.shape)} on {correction_bias.device}")
    if n_group < 1 or E % n_group:
        return False, f"n_group {n_group} does not divide num_experts {E}"
    if n_group > 1 and E // n_group < 2:
        return False, f"grouped top-k needs >= 2 experts per group, got {E // n_group}"
    if not 1 <= topk_group <= n_group:
        return False, f"topk_group {topk_group} not in [1, n_group {n_group}]"
    if not 1 <= top_k <= topk_group * (E // n_group):
        return False, f"top_k {top_k} not in [1, {topk_group * (E // n_group)}] (topk_group · experts per group)"
    return True, ""


def route_supports(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
                   topk_group: int, renormalize: bool, scaling: float) -> tuple[bool, str]:
    """(ok, reason): the kernel takes fp32 [T, E] logits, E ≤ 4096, and enough allowed experts for top_k."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        return False, f"logits: expected float32 [T, E], got {logits.dtype} {list(logits.shape)}"
    if not (logits.is_cuda or not _GPU):
        return False, "logits not on a GPU"
    if logits.stride(1) != 1:
        return False, f"logits: expected unit stride over experts, got strides {logits.stride()}"
    return _route_args_supported(logits.shape[1], logits.device, correction_bias, top_k, n_group, topk_group)


def route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-for-selection and grouped top-k (§7.3, §13) on given fp32 logits [T, E];
    see moe_ref.route. Returns (weights [T, k] fp32, ids [T, k] int64), ids in descending biased score.

    The model calls `router`, which computes the logits too; this is its second kernel on its own (the
    tests of the routing rules, and the bench's baseline of an fp32 GEMM followed by it).
    """
    return _route(logits[None], correction_bias, top_k, n_group, topk_group, renormalize, scaling)


def _route(partials: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
           topk_group: int, renormalize: bool, scaling: float,
           z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The route kernel on logits given as S partial sums [S, T, E] (unit stride over E). z [T, L]: the
    partials are [S, T, E + L], and their last L columns, added, are written to z (`moe_front`)."""
    S, T, width = partials.shape
    L = 0 if z is None else z.shape[1]
    E = width - L
    w = torch.empty(T, top_k, dtype=torch.float32, device=partials.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=partials.device)
    if T == 0:
        return w, ids
    per = E // n_group
    block_g, block_p = triton.next_power_of_2(n_group), triton.next_power_of_2(per)
    warps = 4 if block_g * block_p >= 512 else 1
    block_l = min(triton.next_power_of_2(max(L, 1)), 256 * warps)  # 8 columns a thread
    _route_kernel[(T, 1 + triton.cdiv(L, block_l))](
        logits_ptr=partials, bias_ptr=partials if correction_bias is None else correction_bias, w_ptr=w, ids_ptr=ids,
        z_ptr=partials if z is None else z, stride_ls=partials.stride(0), stride_lt=partials.stride(1),
        stride_wt=w.stride(0), stride_it=ids.stride(0), stride_zt=0 if z is None else z.stride(0), E=E, L=L,
        per_group=per, scaling=float(scaling), SPLITS=S, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
        HAS_BIAS=correction_bias is not None, RENORMALIZE=bool(renormalize), BLOCK_G=block_g, BLOCK_P=block_p,
        BLOCK_K=triton.next_power_of_2(top_k), FRONT=z is not None, BLOCK_L=block_l, GPU=_GPU,
        **pdl.launch_args(partials.device), num_warps=warps,
    )
    return w, ids


@dataclass(frozen=True)
class RouterConfig:
    """The router GEMM's launch: logitsᵀ tiles [block_e, block_t], K steps of block_k, K cut into
    `splits` ranges of split_k (a multiple of block_k) whose partial sums the route kernel adds."""

    block_e: int
    block_t: int
    block_k: int
    splits: int
    split_k: int
    warps: int = 4
    stages: int = 3


def router_config(T: int, E: int, D: int, L: int = 0) -> RouterConfig:
    """Tiles and K splits as a pure function of the shape (a captured graph replays what it captured).

    A decode step's logits are one or a few tiles: split K until about ROUTER_PROGRAMS programs
    stream the weight (each split at least ROUTER_MIN_SPLIT_K wide, so `small` at 1-64 tokens takes 32
    splits of 64); thousands of tokens take token tiles of 128 and a few splits. bench/kernels_moe.py
    --router on the H200 at `small` (µs, this rule against the best of its sweep): T1 6.7 / 6.7, T64
    7.4 / 7.4, T320 ~9.2 / 8.7, T4096 17.6 / 17.6; the old three kernels 11.0, 16.3, 19.3, 69.3.
    L: the down-projection's rows of `moe_front`, more row tiles (so fewer splits).
    """
    block_t = 32 if T <= 64 else 64 if T < 1024 else 128
    block_t = min(block_t, max(16, triton.next_power_of_2(T)))
    block_e = 64  # one wgmma M; E ≥ 64 in every real config
    block_k = min(64, max(16, triton.next_power_of_2(D)))
    tiles = (triton.cdiv(E, block_e) + triton.cdiv(L, block_e)) * triton.cdiv(T, block_t)
    steps = triton.cdiv(D, block_k)
    want = max(1, min(triton.cdiv(D, ROUTER_MIN_SPLIT_K), ROUTER_PROGRAMS // max(tiles, 1)))
    per = triton.cdiv(steps, want)  # K steps per split; no split is left empty
    return RouterConfig(block_e, block_t, block_k, triton.cdiv(steps, per), per * block_k)


def router_supports(h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                    n_group: int, topk_group: int, renormalize: bool, scaling: float) -> tuple[bool, str]:
    """(ok, reason): bf16 h [T, D] (unit inner stride) and the fp32 gate weight [E, D] (contiguous) on one
    GPU, and routing arguments the route kernel takes. fp32 / fp64 models run the reference."""
    if not (h.is_cuda or not _GPU):
        return False, "h not on a GPU"
    if h.dim() != 2 or h.dtype != torch.bfloat16 or h.stride(1) != 1:
        return False, f"h: expected bfloat16 [T, D] with unit inner stride, got {h.dtype} {list(h.shape)} " \
                      f"strides {h.stride()}"
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] != h.shape[1] \
            or not weight.is_contiguous() or weight.device != h.device:
        return False, (f"gate weight: expected contiguous float32 [E, {h.shape[1]}] on {h.device}, got "
                       f"{weight.dtype} {list(weight.shape)} on {weight.device}")
    return _route_args_supported(weight.shape[0], h.device, correction_bias, top_k, n_group, topk_group)


def router(h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
           topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router in two kernels (§7.3): the fp32 logits h·weightᵀ by a split-K bf16 GEMM, then the
    route kernel, which adds the splits; see moe_ref.router. Returns (weights [T, k] fp32, ids [T, k]
    int64)."""
    cfg = router_config(h.shape[0], weight.shape[0], h.shape[1])
    return router_with(h, weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling, cfg)


def router_with(h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                n_group: int, topk_group: int, renormalize: bool, scaling: float,
                cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`router` with an explicit launch (bench/kernels_moe.py --router compares configs with it)."""
    partials = _router_logits(h, weight, cfg)
    return _route(partials, correction_bias, top_k, n_group, topk_group, renormalize, scaling)


def _router_logits(h: torch.Tensor, weight: torch.Tensor, cfg: RouterConfig,
                   down: torch.Tensor | None = None) -> torch.Tensor:
    """[S, T, E] fp32: cfg.splits partial sums of h·weightᵀ over K; their sum in split order is the logits.
    down [L, D]: [S, T, E + L], the last L columns those of h·downᵀ."""
    (T, D), E = h.shape, weight.shape[0]
    L = 0 if down is None else down.shape[0]
    partials = torch.empty(cfg.splits, T, E + L, dtype=torch.float32, device=h.device)
    if T > 0:
        grid = (triton.cdiv(E, cfg.block_e) + triton.cdiv(L, cfg.block_e), triton.cdiv(T, cfg.block_t), cfg.splits)
        _router_gemm_kernel[grid](
            h_ptr=h, w_ptr=weight, d_ptr=h if down is None else down, out_ptr=partials, T=T, E=E, L=L, D=D,
            split_k=cfg.split_k, stride_ht=h.stride(0), stride_we=weight.stride(0),
            stride_wd=0 if down is None else down.stride(0), stride_os=partials.stride(0),
            stride_ot=partials.stride(1), GPU=_GPU, EVEN_K=D % cfg.block_k == 0, FRONT=down is not None,
            BLOCK_E=cfg.block_e, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, EARLY=pdl.early(T),
            **pdl.launch_args(h.device),
            num_warps=cfg.warps, num_stages=cfg.stages,
        )
    return partials


# ----------------------------------------------------------------------------- the latent MoE's front
FRONT_MAX_ROWS = 32  # moe_front's two kernels at most up to here


def front_fused(T: int) -> bool:
    """Whether moe_front runs its two kernels for T tokens. On an H100 at `small` (MXFP4 experts, the shared
    experts on their side stream, PDL; decode graph replays, ms, against the router and `linear`) the front
    took B1 1.991 -> 1.956, B16 3.749 -> 3.650, B32 4.212 -> 4.082, but B4 2.727 -> 3.217, B8 3.270 -> 3.637
    and B64 4.735 -> 4.769, where the router and `linear` stay. Without the side stream it was faster at
    every batch (B4 2.799 -> 2.757, B64 4.982 -> 4.933), so there it loses to an interplay with the shared
    experts' kernels (the front's alone: 8.4 against 9.2 µs at 4 tokens, bench/kernels_moe.py): a trace of the
    B4 replay (bench/trace_kernels.py) shows the shared down-projection's 512 programs, launched early by PDL,
    waiting on the SMs while the routed experts' GEMV cannot start."""
    return T <= 2 or 16 <= T <= FRONT_MAX_ROWS


def moe_front_supports(h: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                       down_weight: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                       scaling: float) -> tuple[bool, str]:
    """(ok, reason): what `router_supports` takes, and a contiguous down weight [L, D] of h's dtype and device."""
    ok, reason = router_supports(h, gate_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling)
    if ok and (down_weight.dim() != 2 or down_weight.dtype != h.dtype or down_weight.shape[1] != h.shape[1]
               or not down_weight.is_contiguous() or down_weight.device != h.device):
        return False, (f"down weight: expected contiguous {h.dtype} [L, {h.shape[1]}] on {h.device}, got "
                       f"{down_weight.dtype} {list(down_weight.shape)} on {down_weight.device}")
    return ok, reason


def moe_front(h: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
              down_weight: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router` and the latent bf(h·down_weightᵀ) (moe_ref.moe_front): in the router's two kernels where
    `front_fused` says, else the router then the model's `linear` (its GEMV up to 8 rows, cuBLAS above).
    Returns (weights, ids, z [T, L])."""
    from k3backend import kernels  # the linear op's own choice of kernel (a cycle at import time)

    (T, D), E, L = h.shape, gate_weight.shape[0], down_weight.shape[0]
    how = (top_k, n_group, topk_group, renormalize, scaling)
    if not front_fused(T):
        return *router(h, gate_weight, correction_bias, *how), kernels.linear(h, down_weight)
    return moe_front_with(h, gate_weight, correction_bias, down_weight, *how, router_config(T, E, D, L))


def moe_front_with(h: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                   down_weight: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                   scaling: float, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_front` in two kernels with an explicit launch (the tests and bench/kernels_moe.py)."""
    z = torch.empty(h.shape[0], down_weight.shape[0], dtype=h.dtype, device=h.device)
    partials = _router_logits(h, gate_weight, cfg, down_weight)
    return *_route(partials, correction_bias, top_k, n_group, topk_group, renormalize, scaling, z), z
