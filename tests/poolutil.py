"""Feed sequences to layers or stacks chunk by chunk, as the engine would, with real cache pools."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from k3backend.engine.batch import SeqChunk, blocks_for, build_forward_batch
from k3backend.model.cache import CachePools, ForwardBatch, layer_cache


class Streams:
    """Pools for `attns` (one attention layer, or every layer of a stack) and `n` sequences.

    Sequence i lives in KDA slot i + 1 and owns its own MLA blocks; `batch(lens)` is the next step
    with lens[i] new tokens of sequence i (0: not in this step), decode rows (one token) first when
    `num_decode` says how many lead the list.
    """

    def __init__(self, attns: Sequence[torch.nn.Module], n: int, max_tokens: int, *, dtype: torch.dtype,
                 block_size: int = 4, device: torch.device | str = "cpu") -> None:
        self.bs, self.device = block_size, torch.device(device)
        per_seq = blocks_for(max_tokens, block_size)
        self.pools = CachePools([layer_cache(a, n + 1, n * per_seq + 1, block_size, dtype, self.device) for a in attns],
                                n + 1, n * per_seq + 1, block_size)
        self.tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
        self.pos = [0] * n

    @property
    def cache(self):
        """The one layer's cache (single-layer streams)."""
        assert len(self.pools.layers) == 1
        return self.pools.layers[0]

    def batch(self, lens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None, num_decode: int = 0,
              order: Sequence[int] | None = None, all_logits: bool = False) -> ForwardBatch:
        """The next step: sequence i gets lens[i] tokens (ids from token_ids[i], zeros when absent);
        logits of each chunk's last token, or of every token with `all_logits`."""
        order = list(order) if order is not None else [i for i, n in enumerate(lens) if n]
        chunks = []
        for i in order:
            ids = list(token_ids[i]) if token_ids is not None else [0] * lens[i]
            chunks.append(SeqChunk(ids, self.pos[i], i + 1, self.pos[i] > 0, self.tables[i]))
            self.pos[i] += lens[i]
        batch = build_forward_batch(chunks, num_decode, self.bs, self.device)
        if all_logits:
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens, device=self.device))
        return batch

    def state(self, i: int) -> torch.Tensor:
        return self.cache.state[i + 1]

    def conv(self, i: int) -> torch.Tensor:
        return self.cache.conv[i + 1]

    def latent(self, i: int) -> torch.Tensor:
        """Sequence i's latent rows so far, in position order."""
        lat = self.cache.latent
        pos = torch.arange(self.pos[i])
        return lat[torch.tensor(self.tables[i])[pos // self.bs], pos % self.bs]


def one_prefill(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Streams]:
    """A fresh single-sequence prefill of x [T, D] through one layer; returns (out, its streams)."""
    s = Streams([attn], 1, x.shape[0], dtype=x.dtype)
    return attn(x, s.batch([x.shape[0]]), s.cache), s


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters under their checkpoint names too: packed tensors split as `packing()` says."""
    from k3backend.checkpoint import packed_params

    out = {n: t.detach() for n, t in module.named_parameters()}
    for name, (packed, a, b) in packed_params(module).items():
        out[name] = out[packed][a:b]
    return out


def lm_streams(lm: torch.nn.Module, n: int, max_tokens: int, block_size: int = 4) -> Streams:
    """Streams over every layer of a K3ForCausalLM."""
    dtype = lm.model.embed_tokens.weight.dtype
    return Streams([layer.self_attn for layer in lm.model.layers], n, max_tokens, dtype=dtype, block_size=block_size)


def full_logits(lm: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of every position of one fresh sequence (a K3ForCausalLM, no engine)."""
    s = lm_streams(lm, 1, len(ids))
    return lm(s.batch([len(ids)], [ids.tolist()], all_logits=True), s.pools)
