"""Torch references for the normalisations (K3_LM.md §2.2, §2.6, §2.7, §4.2).

Conventions for every `*_ref` module: inputs are in the model dtype (bf16, fp32 or fp64); the
spec's "fp32" arithmetic runs in `acc_dtype(x)` (fp32, or fp64 when the model runs in fp64 so
that exact comparisons are possible); the result is rounded once to the model dtype where the
spec writes `bf(·)`.
"""

from __future__ import annotations

import torch


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The spec's fp32 accumulation dtype for a tensor: fp64 stays fp64, everything else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf(x32 · rsqrt(mean(x32²) + eps) · w32)`: SGLang's single-rounding RMSNorm (§2.2)."""
    a = acc_dtype(x)
    x32 = x.to(a)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * r * weight.to(a)).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA `o_norm` (§2.7): per-head RMSNorm times sigmoid(z), one rounding. o, z: [..., D]."""
    a = acc_dtype(o)
    o32 = o.to(a)
    r = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (o32 * r * weight.to(a) * torch.sigmoid(z.to(a))).to(o.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(Σ x² + eps)` in the accumulation dtype (§2.6); eps is added to the sum, not the mean."""
    x32 = x.to(acc_dtype(x))
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def attn_res_mix(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention-Residual aggregation of one point (§4.2), the pre-norm mixture.

    rows: candidate rows r_0..r_n, each [T, H] (bank rows in order, the current prefix last).
    s_j = (Σ_h r_jh·cw_h)·rsqrt(mean_h r_jh² + eps) with cw = ns ⊙ wp; p = softmax_j(s);
    returns bf(Σ_j p_j r_j) summed in order j = 0..n.
    """
    a = acc_dtype(rows[0])
    cw = norm_w.to(a) * proj_w.reshape(-1).to(a)  # [H]
    r32 = torch.stack([r.to(a) for r in rows])  # [n+1, T, H]
    scores = (r32 @ cw) * torch.rsqrt(r32.pow(2).mean(-1) + eps)  # [n+1, T]
    p = torch.softmax(scores, dim=0)
    mix = p[0, :, None] * r32[0]
    for j in range(1, len(rows)):
        mix = mix + p[j, :, None] * r32[j]
    return mix.to(rows[0].dtype)


def attn_res_mix_norm(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                      out_w: torch.Tensor, out_eps: float) -> torch.Tensor:
    """A sub-layer's input: `rms_norm(attn_res_mix(rows, norm_w, proj_w, eps), out_w, out_eps)` (§4.2).

    The bf16 mixture is normalised (the Hopper path of §4.9: two roundings), as one op so that a
    kernel can fuse the mix with the norm that always follows it.
    """
    return rms_norm(attn_res_mix(rows, norm_w, proj_w, eps), out_w, out_eps)
