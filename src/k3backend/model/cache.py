"""What every layer receives besides its input: the step's `ForwardBatch` and the cache pools.

Layers own no state. The pools are allocated once (engine/runner.py sizes them) and layers read
and write them in place at the indices the batch gives: a KDA layer its sequences' state and conv
slots, an MLA layer the rows of its latent block pool (K3_LM.md §10 lists what is kept). Slot 0
and block 0 are null entries that padding rows point at. Nothing here depends on tensor values,
so a decode step can be captured as a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from k3backend.kernels.varlen import VarlenLayout


@dataclass(frozen=True)
class ForwardBatch:
    """One step's flat batch: B sequences laid end to end, the `num_decode` decode rows first.

    input_ids [T] int64; cu_seqlens [B+1] int32; state_indices [B] int32 (KDA slot of each
    sequence); has_initial_state [B] bool (false: zero KDA state and conv history); slot_mapping
    [T] int64 (pool row each token's latent row is written to); block_tables [B, max_blocks] int32;
    context_lens [B] int32 (tokens in the MLA cache after this step's writes); logits_indices [S]
    int64 (rows whose logits are computed); mm_positions [M] int64 and mm_embeds [M, H]: image
    rows that replace the embeddings at those flat positions. `prefill_cu_seqlens` is cu_seqlens
    of the prefill part alone (rows num_decode..T) and `prefill_layout` every table derived from it
    that the layers' varlen ops share (None without prefill rows), both built once per step by the
    batch builder (engine/batch.py, or inside a captured graph from its static buffers).
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    num_decode: int
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    logits_indices: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    prefill_layout: VarlenLayout | None = None
    mm_positions: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.state_indices.shape[0]

    @property
    def has_prefill(self) -> bool:
        return self.num_tokens > self.num_decode


def cat_parts(*parts: torch.Tensor | bool | int) -> torch.Tensor:
    """A layer's decode part and prefill part of a step, in that order; falsy entries are parts the
    step does not have (`nd and op(...)` skips the op when there are no decode rows)."""
    present = [p for p in parts if isinstance(p, torch.Tensor)]
    return present[0] if len(present) == 1 else torch.cat(present)


@dataclass
class KDACache:
    """One KDA layer's pools: recurrent state [N, H, K, V] (fp32; fp64 for exact tests) and conv
    history [N, W-1, C] (model dtype, raw pre-conv rows)."""

    state: torch.Tensor
    conv: torch.Tensor


@dataclass
class MLACache:
    """One MLA layer's latent pool [num_blocks, block_size, r + dr] (model dtype): [c_kv ; k_pe] rows."""

    latent: torch.Tensor


LayerCache = KDACache | MLACache


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except that on the CPU the pages come zeroed from the OS (calloc) and count as
    memory only once written: `cpu_cache_gb` is a budget, not a resident size from the start."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


def layer_cache(attn: torch.nn.Module, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                device: torch.device) -> LayerCache:
    """Zeroed pools of one attention layer (KDA: `cache_shapes()`; MLA: `cache_width`, finite from the start as
    `mla_write` keeps it)."""
    if attn.is_kda:
        (H, K, V), (W1, C) = attn.cache_shapes()
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return KDACache(_zeros((num_slots, H, K, V), state_dtype, device), _zeros((num_slots, W1, C), dtype, device))
    return MLACache(_zeros((num_blocks, block_size, attn.cache_width), dtype, device))


@dataclass
class CachePools:
    """Every layer's pools, with the sizes the engine schedules against."""

    layers: list[LayerCache]
    num_slots: int  # KDA slots, the null slot 0 included
    num_blocks: int  # MLA blocks, the null block 0 included
    block_size: int

    @classmethod
    def allocate(cls, lm: torch.nn.Module, num_slots: int, num_blocks: int, block_size: int) -> CachePools:
        """Zeroed pools for `lm` (a K3ForCausalLM)."""
        device = lm.lm_head.weight.device
        dtype = lm.model.embed_tokens.weight.dtype
        layers = [layer_cache(layer.self_attn, num_slots, num_blocks, block_size, dtype, device)
                  for layer in lm.model.layers]
        return cls(layers, num_slots, num_blocks, block_size)

    @staticmethod
    def bytes_per_slot(lm: torch.nn.Module) -> int:
        """KDA state + conv bytes of one sequence over all layers."""
        dtype = lm.model.embed_tokens.weight.dtype
        state_bytes = 8 if dtype == torch.float64 else 4
        total = 0
        for layer in lm.model.layers:
            if layer.self_attn.is_kda:
                (H, K, V), (W1, C) = layer.self_attn.cache_shapes()
                total += H * K * V * state_bytes + W1 * C * dtype.itemsize
        return total

    @staticmethod
    def bytes_per_token(lm: torch.nn.Module) -> int:
        """MLA latent bytes of one token over all MLA layers."""
        dtype = lm.model.embed_tokens.weight.dtype
        return sum(layer.self_attn.cache_width * dtype.itemsize for layer in lm.model.layers
                   if not layer.self_attn.is_kda)

    def copy_slot(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KDA state and conv of slots `src` [n] into slots `dst` [n], every layer (prefix snapshots)."""
        for c in self.layers:
            if isinstance(c, KDACache):
                c.state[dst] = c.state[src]
                c.conv[dst] = c.conv[src]
