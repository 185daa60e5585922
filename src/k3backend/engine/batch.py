"""Host-side description of a step's sequences -> the `ForwardBatch` tensors the layers read.

The scheduler says, per sequence, which tokens it feeds this step and where its state lives (a
`SeqChunk`); this builds the flat batch once per step: token ids, cu_seqlens, the KDA slot
indices, the MLA slot mapping through the block tables, the logits rows. Everything is computed
from host ints, so building a batch never waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from k3backend.kernels.varlen import num_chunks, snapshot_tables, varlen_layout
from k3backend.model.cache import ForwardBatch


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: `token_ids` at positions start..start+n, its KDA slot and
    MLA block table; `sample`: compute the logits of its last token; `snapshots`: (offset, slot)
    pairs, the KDA state and conv history after token_ids[:offset] copied into slot (a prefix
    snapshot inside the chunk, offset a whole number of KDA chunks)."""

    token_ids: Sequence[int]
    start: int
    slot: int
    has_initial_state: bool
    block_table: Sequence[int]
    sample: bool = True
    snapshots: Sequence[tuple[int, int]] = ()


def to_device(values, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """Host values (a list, an array, a CPU tensor) on `device` without waiting for it: through pinned
    memory, non-blocking. CUDA makes a copy from pageable memory wait for everything queued on the
    stream, which would hold the host behind the step in flight (async scheduling)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def copy_in(dst: torch.Tensor, values) -> None:
    """dst[...] = host values, without waiting for the device (see to_device)."""
    t = torch.as_tensor(values, dtype=dst.dtype)
    dst.copy_(t.pin_memory() if dst.is_cuda else t, non_blocking=True)


def copy_in_all(parts: Sequence[tuple[torch.Tensor, object]]) -> None:
    """copy_in of every (dst, integer or bool values) pair through one pinned buffer and one
    host-to-device copy, then copies on the device (one pinned allocation a step, not one a buffer; on
    the H200 the fill's host time stayed the same: it is the numpy work). The caching host allocator
    keeps the pinned buffer until its copy has run, so the next step cannot overwrite it."""
    flat = [np.asarray(values).reshape(-1) for _, values in parts]
    ends = np.cumsum([a.size for a in flat]).tolist()
    device = parts[0][0].device
    host = torch.empty(ends[-1], dtype=torch.int64, pin_memory=device.type == "cuda")
    np.concatenate(flat, out=host.numpy())
    staged = host.to(device, non_blocking=True)
    for (dst, _), a, b in zip(parts, [0] + ends, ends):
        dst.copy_(staged[a:b].view(dst.shape))


def build_forward_batch(chunks: Sequence[SeqChunk], num_decode: int, block_size: int, device: torch.device,
                        mm_positions: Sequence[int] = (), mm_embeds: torch.Tensor | None = None) -> ForwardBatch:
    """The flat batch of `chunks` (the first `num_decode` have one token each); mm_positions are flat
    token positions whose embeddings become the rows of mm_embeds [M, H]."""
    assert all(len(c.token_ids) == 1 for c in chunks[:num_decode]), "decode chunks have one token"
    ids: list[int] = []
    cu = [0]
    slot_mapping: list[int] = []
    logits: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        for pos in range(c.start, c.start + n):
            slot_mapping.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + n)
        if c.sample:
            logits.append(cu[-1] - 1)
    width = max((len(c.block_table) for c in chunks), default=0)
    tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]  # block 0: null

    def t(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)

    cu_t = t(cu, torch.int32)
    block_tables = t(tables, torch.int32).view(len(chunks), width)
    context_lens = t([c.start + len(c.token_ids) for c in chunks], torch.int32)
    prefill_cu = t([x - cu[num_decode] for x in cu[num_decode:]], torch.int32)
    num_prefill = cu[-1] - cu[num_decode]
    prefill = chunks[num_decode:]
    snapshots = None
    if any(c.snapshots for c in prefill):
        table, ends, slots = snapshot_tables([len(c.token_ids) for c in prefill], [c.snapshots for c in prefill],
                                             num_chunks(num_prefill, len(prefill)))
        snapshots = (t(table, torch.int32), t(ends, torch.int64), t(slots, torch.int64))
    layout = varlen_layout(prefill_cu, num_prefill, context_lens[num_decode:], block_tables[num_decode:], block_size,
                           snapshots) if num_prefill else None  # the step's prefill tables, once for every layer
    return ForwardBatch(
        input_ids=t(ids, torch.int64), cu_seqlens=cu_t, num_decode=num_decode,
        state_indices=t([c.slot for c in chunks], torch.int32),
        has_initial_state=t([c.has_initial_state for c in chunks], torch.bool),
        slot_mapping=t(slot_mapping, torch.int64), block_tables=block_tables,
        context_lens=context_lens, logits_indices=t(logits, torch.int64),
        prefill_cu_seqlens=prefill_cu, prefill_layout=layout,
        mm_positions=t(list(mm_positions), torch.int64) if len(mm_positions) else None,
        mm_embeds=mm_embeds if len(mm_positions) else None)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` latent rows."""
    return -(-num_tokens // block_size)
