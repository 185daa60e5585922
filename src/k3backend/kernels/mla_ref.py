"""Torch references of MLA attention over a latent cache (K3_LM.md §6.3, §6.5): the definition.

`mla_mha` and `mla_absorbed` are the two forms on one sequence's latent rows. The ops the model
calls work on the paged latent pool [num_blocks, block_size, r + dr] (one block table per
sequence, shared by every MLA layer): `mla_write` stores this step's rows in place at
`slot_mapping` (`mla_latent`: after the in-projection's norms); `mla_decode` (absorbed form, one
query per sequence) and `mla_prefill` (a chunk per sequence; the expanded MHA form when the chunk
is the whole context so far, as SGLang does for a fresh prefill, else the absorbed form over the
cached prefix) read the pool through the block tables.

Shapes: T new query tokens, S cached+new key tokens (the last T keys are the new tokens),
N heads, dn/dr/dv head dims, r = kv_lora_rank.
"""

from __future__ import annotations

import torch

from k3backend.kernels.norm_ref import acc_dtype, rms_norm
from k3backend.kernels.varlen import VarlenLayout


MAX_SCORES = 1 << 26  # scores held at once: queries are taken in blocks so that N·block·S stays below


def _causal_softmax(logits: torch.Tensor, first: int) -> torch.Tensor:
    """Softmax over keys with query i (absolute position first + i) seeing keys j <= first + i. logits: [N, t, S]."""
    N, t, S = logits.shape
    qpos = torch.arange(first, first + t, device=logits.device)[:, None]
    kpos = torch.arange(S, device=logits.device)[None, :]
    return torch.softmax(logits.masked_fill(kpos > qpos, float("-inf")), dim=-1)


def _query_blocks(T: int, N: int, S: int) -> list[slice]:
    """Query rows in blocks of bounded score memory: each row's softmax is its own, so blocking
    changes nothing but peak memory (a 16 K-token image prompt would otherwise hold N·T·S scores)."""
    rows = max(1, MAX_SCORES // max(1, N * S))
    return [slice(i, min(i + rows, T)) for i in range(0, T, rows)]


def mla_mha(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
            kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Expanded (MHA) form: K/V re-expanded from the latent through kv_b_proj, rounded to the model dtype.

    q_nope: [T, N, dn]; q_pe: [T, N, dr]; c_kv: [S, r]; k_pe: [S, dr]; kv_b: [N·(dn+dv), r].
    Returns O [T, N·dv] in the model dtype.
    """
    T, N, dn = q_nope.shape
    S = c_kv.shape[0]
    a = acc_dtype(q_nope)
    kv = (c_kv @ kv_b.t()).view(-1, N, kv_b.shape[0] // N)  # bf(c_kv·W_kvbᵀ), [S, N, dn+dv]
    k_nope, v = kv[..., :dn].to(a), kv[..., dn:].to(a)
    out = torch.empty(T, N * v.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    for b in _query_blocks(T, N, S):
        logits = (torch.einsum("tnd,snd->nts", q_nope[b].to(a), k_nope)
                  + torch.einsum("tnd,sd->nts", q_pe[b].to(a), k_pe.to(a))) * scale
        p = _causal_softmax(logits, S - T + b.start)
        out[b] = torch.einsum("nts,snd->tnd", p, v).reshape(b.stop - b.start, -1).to(q_nope.dtype)
    return out


def mla_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed (MQA-over-latent) form used for decode: q̂ = bf(q_nope·W_UK), ô = bf(p·c_kv), o = bf(ô·W_UV).

    w_kc: [N, dn, r] (W_UK per head); w_vc: [N, r, dv] (W_UVᵀ per head). Same result as `mla_mha`
    up to the two extra roundings. Returns O [T, N·dv].
    """
    T, N, _ = q_nope.shape
    S = c_kv.shape[0]
    a = acc_dtype(q_nope)
    q_hat = torch.einsum("tnd,ndr->tnr", q_nope.to(a), w_kc.to(a)).to(q_nope.dtype)  # [T, N, r]
    out = torch.empty(T, N * w_vc.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    for b in _query_blocks(T, N, S):
        logits = (torch.einsum("tnr,sr->nts", q_hat[b].to(a), c_kv.to(a))
                  + torch.einsum("tnd,sd->nts", q_pe[b].to(a), k_pe.to(a))) * scale
        p = _causal_softmax(logits, S - T + b.start)
        o_hat = torch.einsum("nts,sr->tnr", p, c_kv.to(a)).to(q_nope.dtype)  # [t, N, r]
        o = torch.einsum("tnr,nrd->tnd", o_hat.to(a), w_vc.to(a))
        out[b] = o.reshape(b.stop - b.start, -1).to(q_nope.dtype)
    return out


# ---- the ops the model calls: paged latent pool -------------------------------------------------

def mla_write(rows: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """pool.view(-1, r+dr)[slot_mapping] = rows, in place, NaN and Inf stored as 0. rows: [T, r+dr]; slot_mapping:
    [T] int64. The pool (allocated zeroed) so never holds a non-finite value: the TMA decode tiles
    (`kernels/mla.py`) read a partial block's rows past the context and weight them by p = 0."""
    pool.view(-1, pool.shape[-1])[slot_mapping] = rows.to(pool.dtype).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def mla_latent(q_a: torch.Tensor | None, q_norm_weight: torch.Tensor | None, q_eps: float, lat: torch.Tensor,
               kv_norm_weight: torch.Tensor, kv_eps: float, pool: torch.Tensor,
               slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The in-projection's latent outputs (§6.1, §6.2): this step's rows [rms_norm(c_kv) ; k_pe] written to the
    pool (`mla_write`; lat [T, r + dr] = [c_kv ; k_pe]) and rms_norm(q_a) returned (None without a q LoRA).
    One op because both norms read the one GEMM's output (the kernel: one launch for four)."""
    r = kv_norm_weight.shape[0]
    mla_write(torch.cat([rms_norm(lat[:, :r], kv_norm_weight, kv_eps), lat[:, r:]], dim=-1), pool, slot_mapping)
    return None if q_a is None else rms_norm(q_a, q_norm_weight, q_eps)


def _gather(pool: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n latent rows of one sequence, in position order: [n, r+dr]."""
    bs = pool.shape[1]
    pos = torch.arange(n, device=pool.device)
    return pool[block_table[pos // bs].long(), pos % bs]


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed attention of one new token per sequence over its whole context (its own row included).

    q_nope: [B, N, dn]; q_pe: [B, N, dr]; block_tables: [B, max_blocks]; context_lens: [B].
    Returns [B, N·dv] in the model dtype.
    """
    r = w_kc.shape[-1]
    lens = context_lens.tolist()
    out = [mla_absorbed(q_nope[b:b + 1], q_pe[b:b + 1], *_split(_gather(pool, block_tables[b], n), r), w_kc, w_vc,
                        scale) for b, n in enumerate(lens)]
    return torch.cat(out) if out else q_nope.new_zeros(0, q_nope.shape[1] * w_vc.shape[-1])


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, cu_seqlens: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, kv_b: torch.Tensor, w_kc: torch.Tensor,
                w_vc: torch.Tensor, scale: float, layout: VarlenLayout | None = None) -> torch.Tensor:
    """Causal attention of each prefill chunk over its sequence's context (cached prefix + chunk).

    q_nope: [T, N, dn]; q_pe: [T, N, dr] for the chunks laid end to end (`cu_seqlens` [B+1]);
    context_lens: [B] tokens in the cache after this step's writes. Returns [T, N·dv]. `layout` (the
    step's shared tables, `kernels/varlen.py`) is for the fast op: this walks cu_seqlens on the host.
    """
    r = w_kc.shape[-1]
    out = torch.empty(q_nope.shape[0], q_nope.shape[1] * w_vc.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    bounds, lens = cu_seqlens.tolist(), context_lens.tolist()
    for b, n in enumerate(lens):
        sl = slice(bounds[b], bounds[b + 1])
        c_kv, k_pe = _split(_gather(pool, block_tables[b], n), r)
        if bounds[b + 1] - bounds[b] == n:  # no cached prefix: the expanded form
            out[sl] = mla_mha(q_nope[sl], q_pe[sl], c_kv, k_pe, kv_b, scale)
        else:
            out[sl] = mla_absorbed(q_nope[sl], q_pe[sl], c_kv, k_pe, w_kc, w_vc, scale)
    return out


def _split(latent: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    return latent[:, :r], latent[:, r:]
