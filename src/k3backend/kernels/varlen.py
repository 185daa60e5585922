"""The tables of one step's varlen prefill part that every layer's varlen ops share (ENGINE.md §3).

A step's prefill chunks have one layout for all layers: which sequence each token belongs to, its
position, the pool row of its own latent row, whether its sequence has a cached prefix, the KDA
64-token chunk list, the MLA kernels' tile offsets. The fast ops used to derive these from
`cu_seqlens` inside every call (the KDA chunk table 18 times a step at the `small` shape);
`varlen_layout` builds them once per step, with device ops only (no host sync: a captured graph
rebuilds them on each replay from its static buffers), and the layers pass the one object to every
op. The torch references take it and ignore it: they walk `cu_seqlens` on the host, which is the
definition the tables must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KDA_CHUNK = 64  # tokens of a KDA chunk (K3_LM §5.8); kernels/kda_chunk.py tiles by it


@dataclass(frozen=True)
class VarlenLayout:
    """B sequences of T tokens laid end to end (the prefill rows of a step).

    cu_seqlens [B+1] int32; lens [B]; seq_ids [T] int32 (sequence of each token); positions [T]
    int64 (position in its sequence: cached prefix + offset in the chunk); prefix [B] int64 (each
    sequence's cached prefix, 0 without context lens); latent_rows [T] int64 (pool row of the
    token's own latent row; None without block tables); chunk_seq [NC] int32 (sequence of each KDA
    chunk, −1 past the last), chunk_start [NC] int64 (its first token), first_chunk [B] int64,
    num_chunks NC = T/64 + B (an upper bound from shapes alone). Prefix snapshots taken inside a
    chunk (at a whole number of KDA chunks from its start, `snapshot_tables`): chunk_snapshot [NC]
    int32, the KDA slot that gets the state after that chunk (0: none); snapshot_ends [M] int64, the
    flat end of each snapshot's prefix, and snapshot_slots [M] int64 its slot (0: an unused entry),
    for the conv history. padding_last: the last sequence is a captured graph's padding sequence (on
    the null slot: no KDA work), which launch rules then leave out of the sequence count.
    """

    cu_seqlens: torch.Tensor
    num_tokens: int
    lens: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    prefix: torch.Tensor
    latent_rows: torch.Tensor | None
    chunk_seq: torch.Tensor
    chunk_start: torch.Tensor
    first_chunk: torch.Tensor
    num_chunks: int
    chunk_snapshot: torch.Tensor | None = None
    snapshot_ends: torch.Tensor | None = None
    snapshot_slots: torch.Tensor | None = None
    padding_last: bool = False
    _tiles: dict[tuple, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def tile_offsets(self, rows_per_token: int, block_m: int) -> torch.Tensor:
        """[B+1] int32: offsets of each sequence's first tile of `block_m` query rows, a token being
        `rows_per_token` rows (its heads in the latent MQA, 1 in the MHA kernel). Built at the first
        call of a step and shared by the later layers (a graph captures it once too)."""
        key = (rows_per_token, block_m)
        if key not in self._tiles:
            tiles = torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=self.lens.device)
            tiles[1:] = torch.cumsum(torch.div(self.lens * rows_per_token + block_m - 1, block_m,
                                               rounding_mode="floor"), 0)
            self._tiles[key] = tiles
        return self._tiles[key]

    def expanded_prefix(self, capacity: int, min_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which chunks attend to their cached prefix in the expanded form (MLA, kernels/mla.py): those
        of at least `min_len` tokens, in order while their prefixes fit `capacity` workspace rows.
        Returns (prefix_cu [B+1] int32: each sequence's first workspace row, its width the prefix when
        expanded and 0 otherwise; mha [T] bool: the token's chunk runs the expanded form, fresh or
        expanded). Built once per step, like the tile offsets."""
        key = ("prefix", capacity, min_len)
        if key not in self._tiles:
            want = torch.where(self.lens >= min_len, self.prefix, 0)
            width = torch.where(torch.cumsum(want, 0) <= capacity, want, 0)
            cu = torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=self.lens.device)
            cu[1:] = torch.cumsum(width, 0)
            self._tiles[key] = (cu, (width == self.prefix)[self.seq_ids])
        return self._tiles[key]


def varlen_layout(cu_seqlens: torch.Tensor, num_tokens: int, context_lens: torch.Tensor | None = None,
                  block_tables: torch.Tensor | None = None, block_size: int = 0,
                  snapshots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  padding_last: bool = False) -> VarlenLayout:
    """The layout of `num_tokens` tokens in sequences `cu_seqlens` [B+1]; context_lens [B] (tokens in
    the cache after this step; None: no cached prefix) and block_tables [B, W] with block_size give the
    positions and latent rows; snapshots: (chunk_snapshot, snapshot_ends, snapshot_slots) as
    `snapshot_tables` builds them; padding_last as in VarlenLayout. Device ops only, sizes from shapes alone."""
    B, T = cu_seqlens.shape[0] - 1, num_tokens
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    tok = torch.arange(T, device=dev, dtype=cu_seqlens.dtype)
    seq_ids = torch.searchsorted(cu_seqlens[1:].contiguous(), tok, right=True, out_int32=True)  # [T]
    prefix = (context_lens - lens).long() if context_lens is not None else torch.zeros(B, dtype=torch.long, device=dev)
    positions = tok.long() - cu[seq_ids] + prefix[seq_ids]
    rows = None
    if block_tables is not None:
        rows = block_tables[seq_ids, positions // block_size].long() * block_size + positions % block_size
    n = (lens.long() + KDA_CHUNK - 1) // KDA_CHUNK  # KDA chunks per sequence
    ends = n.cumsum(0)
    NC = num_chunks(T, B)
    ids = torch.arange(NC, device=dev)
    chunk_seq = torch.searchsorted(ends, ids, right=True)
    valid = chunk_seq < B
    chunk_seq = chunk_seq.clamp(max=max(B - 1, 0))
    first = ends - n
    start = cu[chunk_seq] + KDA_CHUNK * (ids - first[chunk_seq]) if B else ids
    chunk_seq = torch.where(valid, chunk_seq, -1).to(torch.int32)
    return VarlenLayout(cu_seqlens, T, lens, seq_ids, positions, prefix, rows, chunk_seq, start, first, NC,
                        *(snapshots or (None, None, None)), padding_last=padding_last)


def num_chunks(num_tokens: int, num_seqs: int) -> int:
    """NC of a layout of T tokens in B sequences (an upper bound of their KDA chunks)."""
    return -(-num_tokens // KDA_CHUNK) + num_seqs


def snapshot_tables(lens: Sequence[int], snapshots: Sequence[Sequence[tuple[int, int]]], nc: int,
                    m: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Host lists of a layout's snapshot tables: lens [B] tokens of each sequence, snapshots[b] its
    (offset, slot) pairs, each offset a whole number of KDA chunks inside the sequence. Returns
    (chunk_snapshot [nc], snapshot_ends [m], snapshot_slots [m]); m entries (all of them when None),
    unused ones on slot 0 ending at row 0 (the layer clamps the history rows it reads at 0)."""
    table, ends, slots = [0] * nc, [], []
    first = flat = 0
    for n, snaps in zip(lens, snapshots):
        for off, slot in snaps:
            assert 0 < off < n and off % KDA_CHUNK == 0, (off, n)
            table[first + off // KDA_CHUNK - 1] = slot
            ends.append(flat + off)
            slots.append(slot)
        first += -(-n // KDA_CHUNK)
        flat += n
    m = len(ends) if m is None else m
    assert len(ends) <= m, (len(ends), m)
    return table, ends + [0] * (m - len(ends)), slots + [0] * (m - len(slots))


def layout_problem(layout: VarlenLayout | None, num_tokens: int, num_seqs: int) -> str:
    """'' when `layout` (or None) fits an op's T tokens of B sequences, else what does not."""
    if layout is None or (layout.num_tokens, layout.num_seqs) == (num_tokens, num_seqs):
        return ""
    return (f"layout: expected {num_tokens} tokens of {num_seqs} sequences, got {layout.num_tokens} tokens of "
            f"{layout.num_seqs}")
