"""Torch references of the MoE ops (K3_LM.md §2.3, §2.4, §7.3, §7.4).

Shapes: T tokens, E experts, k = top-k, D expert input width (latent 3584 in K3, or H), I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3backend.kernels.norm_ref import acc_dtype


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


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            act: Activation, scaling: float = 1.0) -> torch.Tensor:
    """Routed experts with SGLang's rounding points (§7.4).

    x: [T, D] model dtype; weights, ids: [T, k]; w13: [E, 2I, D] = [w1; w3]; w2: [E, D, I];
    act: the GLU of [.., 2I]. Per expert e: y_e = bf(w_e·(act(bf(x·w13ᵀ))·w2ᵀ));
    returns bf(scaling·Σ_e fp32(y_e)) [T, D]. Expert ids outside [0, E) are skipped (another
    rank's experts under expert parallelism).
    """
    a = acc_dtype(x)
    T, k = ids.shape
    y = torch.zeros(T, k, w2.shape[1], dtype=x.dtype, device=x.device)  # y_e per (token, slot)
    for e in ids.unique().tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = glu(F.linear(x[tok], w13[e]), act, x.dtype)  # [n, I]
        y[tok, slot] = (F.linear(h.to(a), w2[e].to(a)) * weights[tok, slot, None].to(a)).to(x.dtype)
    return (scaling * y.to(a).sum(1)).to(x.dtype)
