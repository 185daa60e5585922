"""Torch references of the KDA ops (K3_LM.md §2.5, §5.3, §5.6, §5.8): the definition of each op.

Two levels. The math on one sequence (`short_conv_seq`, `kda_recurrent`, `kda_chunked`), and the
ops the model calls, varlen over a flat batch and indexed into the state pools (the engine
contract's signatures, like fla's `fused_recurrent_kda(..., cu_seqlens, ssm_state_indices)`):
`short_conv` / `short_conv_decode` and `kda_prefill` / `kda_decode` read each sequence's state
from its slot and write the new state back in place. Loops over sequences are fine here; the
fused Triton ops of the same signatures do without them.

Shapes: T tokens, B sequences, N pool slots, H heads, K key dim, V value dim, C conv channels,
W conv width. State convention follows fla's naive reference: S [H, K, V], row d of S decays
with α[d]. Pools: S_pool [N, H, K, V] (fp32, fp64 for exact tests), conv_pool [N, W-1, C] (model
dtype, raw pre-conv rows). Slot 0 is the null slot that padding rows point at.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3backend.kernels.norm_ref import acc_dtype, gated_rms_norm, l2_norm
from k3backend.kernels.varlen import KDA_CHUNK, VarlenLayout


def short_conv_seq(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU (§2.5), continuing from the cached raw rows.

    x: [T, C] raw projection rows (model dtype); weight: [C, W] (fp32 parameter);
    history: [W-1, C] raw rows before this chunk (zeros at a sequence start).
    Returns (bf(silu(conv)) [T, C], new history [W-1, C] = the last W-1 raw rows).
    """
    T, C = x.shape
    W = weight.shape[1]
    a = acc_dtype(weight)
    full = torch.cat([history.to(x.dtype), x], dim=0).to(a)  # [W-1+T, C]
    y = torch.zeros(T, C, dtype=a, device=x.device)
    for j in range(W):  # w[:, W-1] multiplies the current token
        y = y + weight[:, j].to(a) * full[j:j + T]
    new_history = torch.cat([history.to(x.dtype), x], dim=0)[-(W - 1):] if W > 1 else history
    return F.silu(y).to(x.dtype), new_history.contiguous()


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g (§5.3). f: [T, H, K] pre-activation; dt_bias: [H*K]; A_log: [H].

    Lower-bounded (K3): g = lb·σ(exp(A_log[h])·(f + dt_bias)); plain: g = −exp(A_log[h])·softplus(f + dt_bias).
    """
    T, H, K = f.shape
    a = acc_dtype(dt_bias)
    s = f.to(a) + dt_bias.to(a).view(H, K)
    A = torch.exp(A_log.to(a)).view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * s)
    return -A * torch.where(s > 20.0, s, torch.log1p(torch.exp(s)))


def kda_prefill_inputs(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                       A_log: torch.Tensor, lower_bound: float | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked form's per-token inputs: q̂ = l2(q)·scale, k̂ = l2(k) (§2.6), g = `kda_gate(f)` (§5.3)
    and β = σ(b) (§5.4), in the accumulation dtype. q, k, f: [T, H, K] (conv output, gate
    pre-activation); b: [T, H] beta logits."""
    g = kda_gate(f, dt_bias, A_log, lower_bound)
    return l2_norm(q) * scale, l2_norm(k), g, torch.sigmoid(b.to(g.dtype))


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token recurrence (§5.6), everything in the accumulation dtype of S.

    q, k: [T, H, K] (already l2-normalised, q scaled); v: [T, H, V]; g: [T, H, K] log-decay;
    beta: [T, H]; S: [H, K, V] incoming state. Returns (o [T, H, V], final S).
    """
    a = S.dtype
    q, k, v, g, beta = (t.to(a) for t in (q, k, v, g, beta))
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=a, device=q.device)
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[..., None]  # diag(α_t)·S
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))  # [H, V]
        S = S + k[t][..., None] * u[:, None, :]  # + k uᵀ
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)  # read after the update
    return o, S


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form of the same recurrence (§5.8); equal to `kda_recurrent` in exact arithmetic.

    Same arguments as `kda_recurrent`; T need not be a multiple of chunk_size (the last chunk is short).
    """
    a = S.dtype
    q, k, v, g, beta = (t.to(a).transpose(0, 1) for t in (q, k, v, g, beta))  # head-major: [H, T, ...]
    H, T, K = q.shape
    o = torch.empty(H, T, v.shape[-1], dtype=a, device=q.device)
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]  # [H, C, ·]
        G = g[:, sl].cumsum(1)  # Γ_i, [H, C, K]
        C = qc.shape[1]
        decay = torch.exp(G[:, :, None, :] - G[:, None, :, :])  # e^{Γ_i − Γ_j}, [H, C, C, K]
        strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=-1)
        causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
        A = -bc[:, :, None] * torch.einsum("hik,hjk,hijk->hij", kc, kc, decay)
        A = A.masked_fill(~strict, 0.0)
        # T = (I − A)^{-1} by forward substitution, then right-multiplied by diag(β)
        Tm = torch.eye(C, dtype=a, device=q.device).repeat(H, 1, 1)
        for i in range(1, C):
            Tm[:, i, :i] = Tm[:, i, :i] + torch.einsum("hj,hjm->hm", A[:, i, :i], Tm[:, :i, :i])
        Tm = Tm * bc[:, None, :]
        w = Tm @ (torch.exp(G) * kc)  # [H, C, K]
        u = Tm @ vc  # [H, C, V]
        v_new = u - w @ S
        Aqk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay).masked_fill(~causal, 0.0)
        o[:, sl] = (qc * torch.exp(G)) @ S + Aqk @ v_new
        G_last = G[:, -1]  # [H, K]
        S = torch.exp(G_last)[..., None] * S + (torch.exp(G_last[:, None, :] - G) * kc).transpose(1, 2) @ v_new
    return o.transpose(0, 1), S


# ---- the ops the model calls: varlen, pool-indexed, in place -------------------------------------

def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, cu_seqlens: torch.Tensor,
               state_indices: torch.Tensor, has_initial_state: torch.Tensor,
               layout: VarlenLayout | None = None) -> torch.Tensor:
    """Prefill chunks: causal conv + SiLU per sequence, continuing from and updating its conv slot.

    x: [T, C] raw rows of B sequences laid end to end (`cu_seqlens` [B+1]); weight: [C, W] fp32;
    conv_pool: [N, W-1, C]; state_indices: [B] slots; has_initial_state: [B] (false: zero history).
    Returns [T, C] = bf(silu(conv)); conv_pool[slot] becomes the sequence's last W-1 raw rows.
    `layout` (the step's shared tables, `kernels/varlen.py`) is for the fast op: this walks cu_seqlens.
    """
    out = torch.empty_like(x)
    bounds, slots, init = cu_seqlens.tolist(), state_indices.tolist(), has_initial_state.tolist()
    for b, (slot, has) in enumerate(zip(slots, init)):
        sl = slice(bounds[b], bounds[b + 1])
        history = conv_pool[slot] if has else torch.zeros_like(conv_pool[slot])
        out[sl], conv_pool[slot] = short_conv_seq(x[sl], weight, history)
    return out


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                      state_indices: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x [B, C] -> [B, C], with the same math as `short_conv_seq` (vectorized)."""
    W = weight.shape[1]
    a = acc_dtype(weight)
    hist = conv_pool[state_indices.long()]  # [B, W-1, C]
    full = torch.cat([hist, x[:, None].to(hist.dtype)], dim=1).to(a)  # [B, W, C]
    y = torch.zeros(x.shape, dtype=a, device=x.device)
    for j in range(W):
        y = y + weight[:, j].to(a) * full[:, j]
    if W > 1:
        conv_pool[state_indices.long()] = full[:, 1:].to(conv_pool.dtype)
    return F.silu(y).to(x.dtype)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S_pool: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, layout: VarlenLayout | None = None) -> torch.Tensor:
    """Chunked KDA (§5.8) over varlen prefill chunks; initial states from, final states into, `S_pool`.

    q, k: [T, H, K] (l2-normalised, q scaled); v: [T, H, V]; g: [T, H, K] log-decay; beta: [T, H];
    S_pool: [N, H, K, V]. Returns o [T, H, V] in the state's dtype. `layout`: as in `short_conv`, except
    that its prefix snapshots (`chunk_snapshot`) are taken: the state after those KDA chunks into their slots.
    A sequence on the null slot 0 is padding (a captured graph's unused places): zero rows of o, no state.
    """
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=S_pool.dtype, device=q.device)
    bounds, slots, init = cu_seqlens.tolist(), state_indices.tolist(), has_initial_state.tolist()
    snaps = layout.chunk_snapshot.tolist() if layout is not None and layout.chunk_snapshot is not None else []
    first = 0
    for b, (slot, has) in enumerate(zip(slots, init)):
        a, end = bounds[b], bounds[b + 1]
        n = -(-(end - a) // KDA_CHUNK)
        if slot == 0:
            o[a:end] = 0
            first += n
            continue
        S = S_pool[slot] if has else torch.zeros_like(S_pool[slot])
        # a prefix snapshot after KDA chunk j (table entry first + j): the walk split there changes no chunk
        cuts = [(a + KDA_CHUNK * (j + 1), snaps[first + j]) for j in range(n) if snaps and snaps[first + j]]
        for stop, dst in cuts + [(end, slot)]:
            o[a:stop], S = kda_chunked(q[a:stop], k[a:stop], v[a:stop], g[a:stop], beta[a:stop], S)
            S_pool[dst] = S
            a = stop
        first += n
    return o


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               S_pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """One recurrent step (§5.6) for B sequences at once; q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H].

    Reads and writes S_pool[state_indices] in place. Returns o [B, H, V] in the state's dtype.
    """
    a = S_pool.dtype
    idx = state_indices.long()
    q, k, v, g, beta = (t.to(a) for t in (q, k, v, g, beta))
    S = S_pool[idx] * torch.exp(g)[..., None]  # diag(α)·S, [B, H, K, V]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., None] * u[:, :, None, :]
    S_pool[idx] = S
    return torch.einsum("bhk,bhkv->bhv", q, S)


def kda_decode_fused(xqkv: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor, f: torch.Tensor,
                     dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None, b: torch.Tensor,
                     z: torch.Tensor, o_norm_weight: torch.Tensor, S_pool: torch.Tensor, state_indices: torch.Tensor,
                     eps: float = 1e-5, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """A KDA layer's decode rows from the raw projections to the gated-norm output (K3_LM §5.2-§5.7).

    The composition of the unfused chain, with its rounding points: q̃k̃ṽ = bf(silu(conv)) (§5.2,
    conv_pool updated in place), g in the accumulation dtype (§5.3), β = σ(b) (§5.4), q = l2(q̃)·K^-½ and
    k = l2(k̃) kept unrounded (§5.5, §2.6), the §5.6 step in S_pool's dtype, out = bf(o), then the
    sigmoid-gated RMSNorm (§5.7). xqkv: [B, C] raw conv input, C = 2·H·K + H·V ([q ; k ; v], head-major);
    conv_weight: [C, W]; conv_pool: [N, W-1, C]; f: [B, H, K] gate pre-activation; dt_bias: [H·K];
    A_log: [H]; b: [B, H] beta logits; z: [B, H, V] output gate; o_norm_weight: [V]; S_pool: [N, H, K, V];
    state_indices: [B]. Returns y [B, H, V] in the model dtype (xqkv's). With f_b_weight [H·K, R] (f_b_proj's,
    the gate's second low-rank factor), f is f_a's rows [B, R] and the gate pre-activation is bf(f·f_b_weightᵀ).
    """
    if f_b_weight is not None:
        f = F.linear(f, f_b_weight).view(f.shape[0], z.shape[1], -1)
    B, H, K = f.shape
    V = z.shape[-1]
    g = kda_gate(f, dt_bias, A_log, lower_bound)  # [B, H, K], acc dtype
    beta = torch.sigmoid(b.to(g.dtype))  # [B, H]
    qkv = short_conv_decode(xqkv, conv_weight, conv_pool, state_indices)  # [B, C], bf(silu(conv))
    q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
    q = l2_norm(q.view(B, H, K)) * K ** -0.5
    k = l2_norm(k.view(B, H, K))
    o = kda_decode(q, k, v.view(B, H, V), g, beta, S_pool, state_indices)  # [B, H, V], S's dtype
    return gated_rms_norm(o.to(xqkv.dtype), z, o_norm_weight, eps)  # out = bf(o), then §5.7
