"""The K3 language model (K3_LM.md §3, §4, §10): decoder layers, Attention-Residual stream, head.

Parameter names follow the checkpoint after `language_model.` (§8.1), with exceptions that the
loader maps: the AttnRes score weights live in `ResScore` modules (`self_attention_res`,
`mlp_res`, `output_attn_res`), routed experts are stacked (`experts.w13`, `experts.w2`), and
q/k/v and gate/up projections are packed (each module's `packing()`).

Every forward takes one `ForwardBatch` and the cache pools (`model/cache.py`): the engine's
varlen step over decode rows and prefill chunks, or one fresh sequence for a full forward.
"""

from __future__ import annotations

import torch
from torch import nn

from k3backend import kernels
from k3backend.config import TextConfig
from k3backend.model.attn_res import ResScore
from k3backend.model.cache import CachePools, ForwardBatch, LayerCache
from k3backend.model.kda import KDA
from k3backend.model.linear import Linear
from k3backend.model.mla import MLA
from k3backend.model.moe import MLP, MoE
from k3backend.model.norm import RMSNorm
from k3backend.model.parallel import SINGLE, Parallel, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    """Attention (KDA or MLA) then MLP/MoE, joined by Attention Residuals or a plain pre-norm residual."""

    def __init__(self, cfg: TextConfig, i: int, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.i, self.S = i, cfg.attn_res_block_size
        self.self_attn = KDA(cfg, par) if cfg.is_kda_layer(i) else MLA(cfg, par)
        self.mlp = MoE(cfg, par) if cfg.is_moe_layer(i) else MLP(cfg, cfg.hidden_size, cfg.intermediate_size, par)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.S is not None:
            self.self_attention_res = ResScore(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res = ResScore(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, bank: list[torch.Tensor], batch: ForwardBatch,
                cache: LayerCache) -> torch.Tensor:
        """Attention-Residual layer (§4.4, §4.10). x: running prefix [T, H]; `bank` grows at block starts."""
        a_in = self.self_attention_res.mix_norm(bank + [x], self.input_layernorm) if bank else self.input_layernorm(x)
        P = None if self.i % self.S == 0 else x
        if P is None:
            bank.append(x)  # freeze the old prefix; the running prefix restarts at this layer
        Q = self.self_attn(a_in, batch, cache, () if P is None else (P,))  # A, or bf(P + A): the pending add
        m_in = self.mlp_res.mix_norm(bank + [Q], self.post_attention_layernorm)
        return self.mlp(m_in, adds=(Q,))  # bf(M + Q): dense bf(d + Q), MoE bf(bf(up + sh) + Q)

    def forward_plain(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                      cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm path without AttnRes (§4.11): fused add-RMSNorm normalises the unrounded fp32 sum."""
        x, residual = _add_norm(h, residual, self.input_layernorm)
        h = self.self_attn(x, batch, cache)
        x, residual = _add_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(x), residual


def _add_norm(h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + residual), bf(h + residual)); the sum is kept in fp32 for the norm (§2.2)."""
    if residual is None:
        return norm(h), h
    s = h.to(kernels.acc_dtype(h)) + residual
    return kernels.rms_norm(s, norm.weight, norm.eps).to(h.dtype), s.to(h.dtype)


class K3TextModel(nn.Module):
    """`language_model.model`: embeddings, decoder layers, final aggregation and norm."""

    def __init__(self, cfg: TextConfig, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res = ResScore(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        """x: [T, H] input embeddings. Returns the final normed hidden states [T, H]."""
        if self.cfg.attn_res_block_size is None:
            residual = None
            for layer, cache in zip(self.layers, pools.layers):
                x, residual = layer.forward_plain(x, residual, batch, cache)
            return _add_norm(x, residual, self.norm)[0]
        bank: list[torch.Tensor] = []
        for layer, cache in zip(self.layers, pools.layers):
            x = layer(x, bank, batch, cache)
        return self.output_attn_res.mix_norm(bank + [x], self.norm)  # §4.7


class K3ForCausalLM(nn.Module):
    """`language_model`: the text model plus an untied (or tied) LM head. Logits are in the model dtype.

    The head is vocab-parallel like the embedding: this rank's logit columns, then an all-gather (§9.3 item 5).
    """

    def __init__(self, cfg: TextConfig, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.par = cfg, par
        self.model = K3TextModel(cfg, par)
        v0, v1 = par.tp_range(cfg.vocab_size, "vocab_size")
        self.lm_head = Linear(cfg.hidden_size, v1 - v0)  # 1 row: the GEMV (H100: 214.7 µs, cuBLAS 232.6)
        self._head_rows = (v0, v1)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shards(self) -> dict[str, tuple[int, int, int]]:
        return {"lm_head.weight": (0, *self._head_rows)}

    def forward(self, batch: ForwardBatch, pools: CachePools, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, V] of the rows `batch.logits_indices` (model dtype), after the step's cache writes.

        inputs_embeds [T, H] replaces the token embeddings (image rows already written in).
        """
        x = self.model.embed_tokens(batch.input_ids) if inputs_embeds is None else inputs_embeds
        h = self.model(x, batch, pools)[batch.logits_indices]
        logits = self.par.all_gather(self.lm_head(h))
        return logits if self.cfg.logit_scale == 1.0 else logits * self.cfg.logit_scale
