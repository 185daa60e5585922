"""Gated MLA without RoPE (K3_LM.md §6): latent projections, latent cache, two attention forms, output gate."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3backend import kernels
from k3backend.config import TextConfig
from k3backend.model.cache import ForwardBatch, MLACache, cat_parts
from k3backend.model.linear import Linear
from k3backend.model.norm import RMSNorm
from k3backend.model.parallel import SINGLE, Parallel, packed_rows


class MLA(nn.Module):
    """One MLA layer. NoPE: q_pe/k_pe are used as computed (§6.2); scale (dn+dr)^−½.

    Prefill of a fresh sequence uses the expanded (MHA) form; a chunk with cached prefix, decode
    included, uses the absorbed form over the latent pool (SGLang's choice with the triton backend).
    """

    is_kda = False

    def __init__(self, cfg: TextConfig, par: Parallel = SINGLE) -> None:
        """Under TP this rank holds heads [r·N/tp, (r+1)·N/tp) of q_b/kv_b/g/o; the latent projections
        and norms, and so the latent cache, are replicated (§9.2)."""
        super().__init__()
        self.par = par
        self.N = par.split(cfg.num_attention_heads, "num_attention_heads")  # heads on this rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        self.scale = (self.dn + self.dr) ** -0.5
        D, qd = cfg.hidden_size, self.N * (self.dn + self.dr)
        self.q_lora, self.gated = cfg.q_lora_rank is not None, cfg.mla_use_output_gate
        # The projections of x, one GEMM: [q_a_proj (or q_proj) ; kv_a_proj_with_mqa ; g_proj]
        self.in_sizes = (cfg.q_lora_rank if self.q_lora else qd, self.r + self.dr) + ((self.N * self.dv,) if self.gated
                                                                                       else ())
        self.in_proj = Linear(D, sum(self.in_sizes))
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, qd)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.r, self.N * (self.dn + self.dv))
        self.o_proj = Linear(self.N * self.dv, D)

    def packing(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint name -> (packed parameter, first row, end row), names relative to this layer."""
        names = ("q_a_proj.weight" if self.q_lora else "q_proj.weight", "kv_a_proj_with_mqa.weight", "g_proj.weight")
        return packed_rows("in_proj.weight", list(zip(names, self.in_sizes)))

    def shards(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint name -> (dim, start, end) of the full tensor this rank loads (head-parallel)."""
        r = self.par.tp_rank
        rows = lambda per_head: (0, r * self.N * per_head, (r + 1) * self.N * per_head)  # noqa: E731
        q = "q_b_proj.weight" if self.q_lora else "q_proj.weight"
        out = {q: rows(self.dn + self.dr), "kv_b_proj.weight": rows(self.dn + self.dv),
               "o_proj.weight": (1, r * self.N * self.dv, (r + 1) * self.N * self.dv)}
        if self.gated:
            out["g_proj.weight"] = rows(self.dv)
        return out

    @property
    def cache_width(self) -> int:
        """Values per token per layer in the latent pool: r + dr (576 for K3)."""
        return self.r + self.dr

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_kc [N, dn, r], w_vc [N, r, dv]) as views of kv_b_proj (§6.3); head h owns rows [h(dn+dv), ...)."""
        w = self.kv_b_proj.weight.view(self.N, self.dn + self.dv, self.r)
        return w[:, :self.dn], w[:, self.dn:].transpose(1, 2)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: MLACache,
                adds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """x: [T, D] normed attention input (flat). Writes this step's latent rows, then attends; returns
        the output plus `adds` (the residual, added in turn)."""
        T = x.shape[0]
        q, lat, *z = self.in_proj(x).split(self.in_sizes, dim=-1)  # lat [T, r + dr]; z: the gate's logits
        q_norm = (q, self.q_a_layernorm.weight, self.q_a_layernorm.eps) if self.q_lora else (None, None, 0.0)
        kv_norm = (lat, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        q_a = kernels.mla_latent(*q_norm, *kv_norm, cache.latent, batch.slot_mapping)  # rows appended first
        q = (self.q_b_proj(q_a) if self.q_lora else q).view(T, self.N, self.dn + self.dr)
        q_nope, q_pe = q[..., :self.dn], q[..., self.dn:]  # [T, N, dn], [T, N, dr]
        w_kc, w_vc = self.absorbed_weights()
        nd = batch.num_decode
        o = cat_parts(  # [T, N·dv]
            nd and kernels.mla_decode(q_nope[:nd], q_pe[:nd], cache.latent, batch.block_tables[:nd],
                                      batch.context_lens[:nd], w_kc, w_vc, self.scale),
            batch.has_prefill and kernels.mla_prefill(q_nope[nd:], q_pe[nd:], cache.latent, batch.prefill_cu_seqlens,
                                                      batch.block_tables[nd:], batch.context_lens[nd:],
                                                      self.kv_b_proj.weight, w_kc, w_vc, self.scale,
                                                      layout=batch.prefill_layout))
        gate = z[0] if self.gated else None  # o_proj reads bf(O ⊙ bf(σ(z))) (§6.4)
        return self.par.row_parallel(self.o_proj, o, adds, gate)  # §9.3 item 2
