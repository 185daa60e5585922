"""Kimi Delta Attention layer (K3_LM.md §5): projections, short conv, gates, recurrence, gated norm."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3backend import kernels
from k3backend.config import TextConfig
from k3backend.kernels.varlen import VarlenLayout
from k3backend.model.cache import ForwardBatch, KDACache, cat_parts
from k3backend.model.linear import Linear
from k3backend.model.norm import RMSNorm
from k3backend.model.parallel import SINGLE, Parallel, packed_rows

O_NORM_EPS = 1e-5  # hard-coded in SGLang whatever rms_norm_eps says (§5.7)


class KDA(nn.Module):
    """One KDA layer. Parameter names follow the checkpoint (`self_attn.*`, §8.1), except that the
    projections of x (q, k, v, the output gate's first, f_a, b) and the q/k/v conv weights are
    packed into one tensor each, their runtime layout (`packing()` tells the loader where each
    checkpoint tensor goes): one GEMM instead of six.

    Two output-gate variants: full rank (`g_proj`, K3) or low rank (`g_a_proj`/`g_b_proj`,
    Kimi-Linear); two forget gates: lower-bounded (K3) or softplus (Kimi-Linear).
    """

    is_kda = True

    def __init__(self, cfg: TextConfig, par: Parallel = SINGLE) -> None:
        """Under TP this rank holds heads [r·H/tp, (r+1)·H/tp) of every head-parallel tensor (§9.2)."""
        super().__init__()
        lac = cfg.linear_attn_config
        self.par = par
        self.H = par.split(lac.num_heads, "linear_attn_config.num_heads")  # heads on this rank
        self.K, self.V = lac.head_dim, cfg.kda_v_head_dim
        self.W = lac.short_conv_kernel_size
        self.lower_bound = lac.gate_lower_bound
        self.full_rank_gate = lac.use_full_rank_gate
        D, P, PV = cfg.hidden_size, self.H * self.K, self.H * self.V
        # [q_proj ; k_proj ; v_proj ; g_proj (or g_a_proj) ; f_a_proj ; b_proj]
        self.in_sizes = (2 * P + PV, PV if self.full_rank_gate else self.K, self.K, self.H)
        self.in_proj = Linear(D, sum(self.in_sizes))
        # Depthwise conv weights [C, 1, W] = [q_conv1d ; k_conv1d ; v_conv1d], fp32 on disk and in SGLang.
        self.conv1d_weight = nn.Parameter(torch.zeros(2 * P + PV, 1, self.W))
        self.f_b_proj = Linear(self.K, P)
        self.A_log = nn.Parameter(torch.zeros(self.H))  # one per head; checkpoints pad it (§13)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        if not self.full_rank_gate:
            self.g_b_proj = Linear(self.K, PV)
        self.o_norm = RMSNorm(self.V, O_NORM_EPS)  # weight shared by all heads; applied gated below
        self.o_proj = Linear(PV, D)

    def packing(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint name -> (packed parameter, first row, end row), names relative to this layer."""
        P, PV = self.H * self.K, self.H * self.V
        qkv = [("q", P), ("k", P), ("v", PV)]
        gate = "g_proj" if self.full_rank_gate else "g_a_proj"
        return {**packed_rows("in_proj.weight", [(f"{n}_proj.weight", m) for n, m in qkv]
                              + [(f"{gate}.weight", self.in_sizes[1]), ("f_a_proj.weight", self.K),
                                 ("b_proj.weight", self.H)]),
                **packed_rows("conv1d_weight", [(f"{n}_conv1d.weight", m) for n, m in qkv])}

    def shards(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint name -> (dim, start, end) of the full tensor this rank loads (head-parallel)."""
        r, H, P, PV = self.par.tp_rank, self.H, self.H * self.K, self.H * self.V
        rows = lambda n: (0, r * n, (r + 1) * n)  # noqa: E731
        out = {f"{n}_proj.weight": rows(P) for n in "qk"} | {f"{n}_conv1d.weight": rows(P) for n in "qk"}
        out |= {"v_proj.weight": rows(PV), "v_conv1d.weight": rows(PV), "b_proj.weight": rows(H),
                "f_b_proj.weight": rows(P), "A_log": rows(H), "dt_bias": rows(P), "o_proj.weight": (1, r * PV, (r + 1) * PV)}
        out["g_proj.weight" if self.full_rank_gate else "g_b_proj.weight"] = rows(PV)
        return out

    def cache_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """((H, K, V) of the recurrent state, (W-1, C) of the conv history) per slot."""
        return (self.H, self.K, self.V), (self.W - 1, self.conv1d_weight.shape[0])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KDACache,
                adds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """x: [T, D] normed attention input (flat over the batch). Returns [T, D] plus `adds` (the
        residual, added in turn); updates the slots.

        Decode rows (the first `num_decode`) take the fused one-token op from the raw projections
        to the gated norm; prefill chunks take the varlen conv and the chunked form (§5.8).
        """
        T = x.shape[0]
        H, K, V = self.H, self.K, self.V
        nd, si = batch.num_decode, batch.state_indices
        xqkv, z, f_a, b = self.in_proj(x).split(self.in_sizes, dim=-1)  # raw q/k/v rows [T, 2P+PV]; b: beta logits
        z = (z if self.full_rank_gate else self.g_b_proj(z)).view(T, H, V)  # [T, H, V] output-gate logits
        w = self.conv1d_weight.squeeze(1)  # [C, W]
        y = cat_parts(  # [T, H, V]: decode rows (f = f_b(f_a) inside the op), then prefill chunks
            nd and kernels.kda_decode_fused(xqkv[:nd], w, cache.conv, f_a[:nd], self.dt_bias, self.A_log,
                                            self.lower_bound, b[:nd], z[:nd], self.o_norm.weight, cache.state,
                                            si[:nd], O_NORM_EPS, f_b_weight=self.f_b_proj.weight),
            batch.has_prefill and self._prefill(xqkv[nd:], w, self.f_b_proj(f_a[nd:]).view(-1, H, K), b[nd:],
                                                z[nd:], batch, cache))
        return self.par.row_parallel(self.o_proj, y.reshape(T, H * V), adds)  # §9.3 item 2

    def _prefill(self, xqkv: torch.Tensor, w: torch.Tensor, f: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                 batch: ForwardBatch, cache: KDACache) -> torch.Tensor:
        """The prefill chunks (rows num_decode..T, T' of them): §5.2 conv, §5.3-§5.5, §5.8, §5.7."""
        T = xqkv.shape[0]
        H, K, V = self.H, self.K, self.V
        nd, si = batch.num_decode, batch.state_indices
        qkv = kernels.short_conv(xqkv, w, cache.conv, batch.prefill_cu_seqlens, si[nd:], batch.has_initial_state[nd:],
                                 layout=batch.prefill_layout)  # bf(silu(conv))
        self._snapshot_conv(xqkv, batch.prefill_layout, cache)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q, k, g, beta = kernels.kda_prefill_inputs(q.view(T, H, K), k.view(T, H, K), f, b, self.dt_bias, self.A_log,
                                                   self.lower_bound, K ** -0.5)  # fp32; g [T', H, K], beta [T', H]
        o = kernels.kda_prefill(q, k, v.view(T, H, V), g, beta, cache.state, batch.prefill_cu_seqlens, si[nd:],
                                batch.has_initial_state[nd:], layout=batch.prefill_layout)
        return kernels.gated_rms_norm(o.to(xqkv.dtype), z, self.o_norm.weight, O_NORM_EPS)  # out_t = bf(o_t)

    def _snapshot_conv(self, xqkv: torch.Tensor, layout: VarlenLayout | None, cache: KDACache) -> None:
        """Prefix snapshots inside the chunks: the conv history there (the W−1 raw rows before each
        snapshot's end) into its slot; kda_prefill writes the state. Unused entries go to slot 0."""
        if layout is None or layout.snapshot_slots is None:
            return
        taps = torch.arange(self.W - 1, device=xqkv.device)
        rows = (layout.snapshot_ends[:, None] - (self.W - 1) + taps).clamp(min=0)  # [M, W-1]
        cache.conv.index_copy_(0, layout.snapshot_slots, xqkv[rows].to(cache.conv.dtype))
