"""Torch references of MLA attention over a latent cache (K3_LM.md §6.3), one sequence.

Shapes: T new query tokens, S cached+new key tokens (the last T keys are the new tokens),
N heads, dn/dr/dv head dims, r = kv_lora_rank.
"""

from __future__ import annotations

import torch

from k3backend.kernels.norm_ref import acc_dtype


def _causal_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over keys with query i (absolute position S−T+i) seeing keys j ≤ S−T+i. logits: [N, T, S]."""
    N, T, S = logits.shape
    qpos = torch.arange(S - T, S, device=logits.device)[:, None]
    kpos = torch.arange(S, device=logits.device)[None, :]
    return torch.softmax(logits.masked_fill(kpos > qpos, float("-inf")), dim=-1)


def mla_mha(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
            kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Expanded (MHA) form: K/V re-expanded from the latent through kv_b_proj, rounded to the model dtype.

    q_nope: [T, N, dn]; q_pe: [T, N, dr]; c_kv: [S, r]; k_pe: [S, dr]; kv_b: [N·(dn+dv), r].
    Returns O [T, N·dv] in the model dtype.
    """
    T, N, dn = q_nope.shape
    a = acc_dtype(q_nope)
    kv = (c_kv @ kv_b.t()).view(-1, N, kv_b.shape[0] // N)  # bf(c_kv·W_kvbᵀ), [S, N, dn+dv]
    k_nope, v = kv[..., :dn].to(a), kv[..., dn:].to(a)
    logits = (torch.einsum("tnd,snd->nts", q_nope.to(a), k_nope)
              + torch.einsum("tnd,sd->nts", q_pe.to(a), k_pe.to(a))) * scale
    p = _causal_softmax(logits)
    return torch.einsum("nts,snd->tnd", p, v).reshape(T, -1).to(q_nope.dtype)


def mla_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed (MQA-over-latent) form used for decode: q̂ = bf(q_nope·W_UK), ô = bf(p·c_kv), o = bf(ô·W_UV).

    w_kc: [N, dn, r] (W_UK per head); w_vc: [N, r, dv] (W_UVᵀ per head). Same result as `mla_mha`
    up to the two extra roundings. Returns O [T, N·dv].
    """
    T, N, _ = q_nope.shape
    a = acc_dtype(q_nope)
    q_hat = torch.einsum("tnd,ndr->tnr", q_nope.to(a), w_kc.to(a)).to(q_nope.dtype)  # [T, N, r]
    logits = (torch.einsum("tnr,sr->nts", q_hat.to(a), c_kv.to(a))
              + torch.einsum("tnd,sd->nts", q_pe.to(a), k_pe.to(a))) * scale
    p = _causal_softmax(logits)
    o_hat = torch.einsum("nts,sr->tnr", p, c_kv.to(a)).to(q_nope.dtype)  # [T, N, r]
    o = torch.einsum("tnr,nrd->tnd", o_hat.to(a), w_vc.to(a))
    return o.reshape(T, -1).to(q_nope.dtype)
