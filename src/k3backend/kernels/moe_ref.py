"""Torch references of the MoE ops (K3_LM.md §2.3, §2.4, §7.3, §7.4).

Shapes: T tokens, E experts, k = top-k, D expert input width (latent 3584 in K3, or H), I expert width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3backend.kernels.norm_ref import acc_dtype, rms_norm


@dataclass(frozen=True)
class Activation:
    """A GLU activation as data, so a kernel can fuse it: SiTU with (β, λ) (§2.4) or SiLU (§2.3)."""

    kind: str  # "situ" | "silu"
    beta: float = 0.0
    linear_beta: float | None = None  # SiTU's cap on the up half; None: uncapped


def glu(gu: torch.Tensor, act: Activation, out_dtype: torch.dtype) -> torch.Tensor:
    """act-and-mul of [.., 2I] = [g | u] -> [.., I], one rounding to out_dtype."""
    if act.kind == "silu":
        return silu_and_mul(gu, out_dtype)
    return situ_and_mul(gu, act.beta, act.linear_beta, out_dtype)


def glu_linear(x: torch.Tensor, w_gu: torch.Tensor, act: Activation, fp32_front: bool = False) -> torch.Tensor:
    """A GLU MLP's first half: act-and-mul of x·w_guᵀ, x [T, D], w_gu [2I, D] = [gate ; up] -> [T, I] (§7.1, §7.5).

    The GEMM output is rounded to x.dtype before the activation (a plain linear), except with
    fp32_front: SGLang's fused MoE front feeds the shared experts' activation the fp32 GEMM output (§7.6).
    """
    if fp32_front:
        a = acc_dtype(x)
        gu = F.linear(x.to(a), w_gu.to(a))
    else:
        gu = F.linear(x, w_gu)
    return glu(gu, act, x.dtype)


def situ_and_mul(gu: torch.Tensor, beta: float, linear_beta: float | None, out_dtype: torch.dtype) -> torch.Tensor:
    """SiTU-and-mul (§2.4): β·tanh(g/β)·σ(g) · λ·tanh(u/λ), in fp32, one rounding. gu: [.., 2I] = [g | u]."""
    a = acc_dtype(gu)
    g, u = gu.to(a).chunk(2, dim=-1)
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)  # σ uses the uncapped g
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gate * up).to(out_dtype)


def silu_and_mul(gu: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """SiLU-and-mul (§2.3): silu(g)·u in fp32, one rounding."""
    g, u = gu.to(acc_dtype(gu)).chunk(2, dim=-1)
    return (F.silu(g) * u).to(out_dtype)


def _topk_lowest_id(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lowest index (SGLang's kernels)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-for-selection and grouped top-k (§7.3, §13).

    logits: [T, E] fp32. Returns (weights [T, k] fp32, expert ids [T, k] int64).
    Groups are ranked by the sum of their two largest biased scores; ties go to the lowest id.
    """
    T, E = logits.shape
    s = torch.sigmoid(logits)
    c = s if correction_bias is None else s + correction_bias.to(s.dtype)
    if n_group > 1:
        grouped = c.view(T, n_group, E // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = _topk_lowest_id(group_score, topk_group)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=c.device).scatter_(1, keep, True)
        c = c.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = _topk_lowest_id(c, top_k)
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, ids


def router(h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
           topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router from its input (§7.3): `route` of the fp32 logits h·weightᵀ (fp64 for fp64 h).

    h: [T, D] normed MLP input; weight: [E, D] (`gate.weight`, fp32 at run time). Returns (weights
    [T, k] fp32, expert ids [T, k] int64), as `route`.
    """
    a = acc_dtype(h)
    return route(F.linear(h.to(a), weight.to(a)), correction_bias, top_k, n_group, topk_group, renormalize, scaling)


def moe_front(h: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
              down_weight: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The latent MoE's front (§7.2, §7.3): `router` of h and the latent input bf(h·down_weightᵀ) [T, L],
    one op because both read h (the kernel computes them in one GEMM). Returns (weights, ids, latent)."""
    w, ids = router(h, gate_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling)
    return w, ids, F.linear(h, down_weight)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            act: Activation, scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
            norm_eps: float = 0.0, ep: int = 1) -> torch.Tensor:
    """Routed experts with SGLang's rounding points (§7.4).

    x: [T, D] model dtype; weights, ids: [T, k]; w13: [E, 2I, D] = [w1; w3]; w2: [E, D, I];
    act: the GLU of [.., 2I]. Per expert e: y_e = bf(w_e·(act(bf(x·w13ᵀ))·w2ᵀ));
    returns bf(scaling·Σ_e fp32(y_e)) [T, D]. Expert ids outside [0, E) are skipped (another
    rank's experts under expert parallelism). norm_weight: then `rms_norm` of that sum with it and
    norm_eps, the latent norm (§7.2), for a caller that holds the whole sum (no reduction between).
    ep: the expert-parallel ranks the layer's experts are split over, which the fused op's tiles are keyed
    on (`moe.experts_config`); the result does not depend on it.
    """
    out = _experts(x, weights, ids, w13.shape[0], lambda e: (w13[e], w2[e]), act, scaling)
    return out if norm_weight is None else rms_norm(out, norm_weight, norm_eps)


def experts_mxfp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, act: Activation,
                  scaling: float = 1.0, norm_weight: torch.Tensor | None = None,
                  norm_eps: float = 0.0, ep: int = 1) -> torch.Tensor:
    """`experts` on MXFP4 weights (§7.7): each expert's matrices dequantized exactly to x.dtype, then
    the same op (the norm too). The logical function of the real checkpoint's experts; the fused w4a16 kernel
    expands the codes in registers instead of in memory.

    w13: [E, 2I, D/2] uint8 codes, w13_scale: [E, 2I, D/32] uint8 exponents ([w1; w3] rows);
    w2: [E, D, I/2], w2_scale: [E, D, I/32]. Only the experts a token chose are dequantized.
    """
    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequant_mxfp4(w13[e], w13_scale[e], x.dtype), dequant_mxfp4(w2[e], w2_scale[e], x.dtype)

    out = _experts(x, weights, ids, w13.shape[0], expert, act, scaling)
    return out if norm_weight is None else rms_norm(out, norm_weight, norm_eps)


def _experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
             expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]], act: Activation,
             scaling: float) -> torch.Tensor:
    """The §7.4 loop over the experts hit; expert(e) -> (w13 [2I, D], w2 [D, I]) in x.dtype."""
    a = acc_dtype(x)
    T, k = ids.shape
    D = expert(0)[1].shape[0] if T == 0 else None
    y = None  # y_e per (token, slot), [T, k, D]
    for e in ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        w13, w2 = expert(e)
        if y is None:
            y = torch.zeros(T, k, w2.shape[0], dtype=x.dtype, device=x.device)
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = glu(F.linear(x[tok], w13), act, x.dtype)  # [n, I]
        y[tok, slot] = (F.linear(h.to(a), w2.to(a)) * weights[tok, slot, None].to(a)).to(x.dtype)
    if y is None:  # no local expert hit
        return torch.zeros(T, D if D is not None else expert(0)[1].shape[0], dtype=x.dtype, device=x.device)
    return (scaling * y.to(a).sum(1)).to(x.dtype)


# ----------------------------------------------------------------------------- MXFP4 (§7.7)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code c & 7; bit 3 is the sign
E8M0_NAN = 255  # the one scale byte that is not a power of two (OCP MX)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (compressed-tensors, group 32) -> dtype (§7.7). packed [.., out, in/2] uint8, scale [.., out, in/32]
    uint8 -> [.., out, in].

    Low nibble = even input index; code bit 3 = sign, E2M1[c & 7] the magnitude; scale byte s is
    2^(s-127), and 255 is NaN. Every value is a 2-bit significand times a power of two, computed
    exactly (in fp64 for a fp64 result, else fp32, where only an overflow to inf can happen) and
    rounded once to dtype: exact in bf16 and fp32 wherever the value is finite there.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(E2M1, dtype=work, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # [.., out, in]
    mag = lut[codes & 7]
    vals = torch.where(codes & 8 != 0, -mag, mag)
    return (vals * e8m0_scale(scale, work).repeat_interleave(32, dim=-1)).to(dtype)


def e8m0_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^(s-127) of each uint8 s in dtype (float32 or float64), 255 -> NaN, written as exponent bits
    (exact on every device: 2^-127 is fp32's subnormal 0x00400000)."""
    s = scale.to(torch.int64)
    if dtype == torch.float64:
        out = ((s + (1023 - 127)) << 52).view(torch.float64)
    else:
        out = torch.where(s == 0, 0x00400000, s << 23).to(torch.int32).view(torch.float32)
    return torch.where(s == E8M0_NAN, torch.nan, out)
