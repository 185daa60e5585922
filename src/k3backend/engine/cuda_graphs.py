"""CUDA graphs of decode steps and of single-sequence prefill chunks (ENGINE.md §7).

A step launches a few hundred (decode) to a couple of thousand (prefill) kernels; eagerly each
costs ~17-25 µs of Python and launch overhead, inside a graph ~1 µs, so an eager step of the
`small` shape spends ~40 ms on the host whatever its size. At start-up the runner captures, in one
memory pool over static input buffers:

- one decode graph per batch size in `CAPTURE_SIZES` (up to the first size >= max_num_seqs). A
  decode-only step of B sequences copies its ids, slots, block tables and lengths into the first B
  rows of the buffers, pads the rest with the null slot 0 and null block 0 (rows whose writes land
  in entries no sequence owns), and replays the graph of the next captured size;
- one prefill graph per chunk size in `PREFILL_SIZES` (up to max_num_batched_tokens): a step that
  is one sequence's prefill chunk (a prompt on an idle server, each chunk of a long prompt) runs
  as that sequence plus a padding sequence of at least `PREFILL_PAD` tokens on the null slot and
  block, which fills the captured token count. The sequences are independent in every op (varlen
  attention and recurrences, row-wise GEMMs and norms), so the padding changes no real row.

A step of decode rows and one prefill chunk replays the decode graph and then the prefill graph
(`ModelRunner._graphed`); other steps run eagerly.

The same padding runs eagerly when graphs are off (`capture=False`): that is how CPU tests check
that padded rows change nothing, and the fallback when a capture fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from k3backend.engine.batch import SeqChunk
from k3backend.kernels.varlen import varlen_layout
from k3backend.model.cache import ForwardBatch

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # real tokens of a chunk, at most
PREFILL_PAD = 16  # tokens of the padding sequence at least (no kernel sees an empty sequence)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: every size below max_num_seqs and the first one at or above it."""
    sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs]
    return tuple(sizes + [next((b for b in CAPTURE_SIZES if b >= max_num_seqs), CAPTURE_SIZES[-1])])


def prefill_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The captured prefill chunk sizes that a step's token budget can use."""
    return tuple(n for n in PREFILL_SIZES if n + PREFILL_PAD <= max_num_batched_tokens)


class _Graphs:
    """Graphs over static buffers, one per size: `batch(size)` is the ForwardBatch of those buffers
    that `forward` (the model over the pools, no host sync) is captured on. `batch` is called inside
    the capture: the tables it derives on the device (the prefill layout) are rebuilt by each replay."""

    what = ""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int]) -> None:
        self.forward, self.sizes = forward, tuple(sorted(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def batch(self, size: int) -> ForwardBatch:
        raise NotImplementedError

    def _size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _prepare(self, size: int) -> None:
        """Make the buffers a valid step of `size` for its warm-up and capture runs."""

    def _replay(self, size: int) -> torch.Tensor:
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size]
        return self.forward(self.batch(size))

    def capture(self, device: torch.device, pool: tuple | None = None) -> None:
        """Warm each size up eagerly (kernel compilation, autotuning), then capture, largest first so
        the smaller graphs reuse the pool's memory. A capture that fails leaves none of these graphs."""
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved(device)
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        try:
            for size in reversed(self.sizes):
                self._prepare(size)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self.forward(self.batch(size))  # warm-up outside the capture
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self.forward(self.batch(size))
                self.graphs[size] = graph
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: run these steps eagerly
            self.graphs.clear()
            self.outputs.clear()
            torch.cuda.synchronize(device)
            log.warning("CUDA graphs off for %s steps, they run eagerly: capture failed: %s", self.what, e)
            return
        log.info("CUDA graphs: captured %s sizes %s in %.1f s, %.0f MiB", self.what, list(self.sizes),
                 time.monotonic() - t0, (torch.cuda.memory_reserved(device) - before) / 2**20)


class DecodeGraphs(_Graphs):
    """Static decode buffers and, when `capture`, one CUDA graph per batch size in `sizes`.

    `forward(batch)` is the model's forward over the pools (returns logits [B, V]); it must not
    sync with the host, which holds for the fused kernels and not for the torch references.
    """

    what = "decode batch"

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int], max_blocks: int,
                 block_size: int, device: torch.device, capture: bool, pool: tuple | None = None) -> None:
        super().__init__(forward, sizes)
        self.block_size = block_size
        n = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.state_indices = torch.zeros(n, **i32)
        self.has_initial_state = torch.zeros(n, dtype=torch.bool, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.context_lens = torch.ones(n, **i32)
        self._arange = torch.arange(n + 1, **i32)
        self._logits_rows = torch.arange(n, dtype=torch.int64, device=device)
        self._no_prefill = torch.zeros(1, **i32)
        if capture:
            self.capture(device, pool)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def batch(self, b: int) -> ForwardBatch:
        """The static buffers' first b rows as a decode-only ForwardBatch."""
        return ForwardBatch(
            input_ids=self.input_ids[:b], cu_seqlens=self._arange[:b + 1], num_decode=b,
            state_indices=self.state_indices[:b], has_initial_state=self.has_initial_state[:b],
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b], context_lens=self.context_lens[:b],
            logits_indices=self._logits_rows[:b], prefill_cu_seqlens=self._no_prefill)

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] of a decode-only step (every chunk one token, sampled)."""
        b = len(chunks)
        size = self._size_for(b)
        self._fill(chunks, size)
        return self._replay(size)[:b]

    def _fill(self, chunks: Sequence[SeqChunk], size: int) -> None:
        """Rows 0..b-1 from the chunks, rows b..size-1 the null slot and block. Block-table columns past
        the longest table keep stale entries: no kernel reads past a row's context length."""
        b, bs = len(chunks), self.block_size
        pad = size - b
        ids = [c.token_ids[0] for c in chunks] + [0] * pad
        slots = [c.slot for c in chunks] + [0] * pad
        init = [c.has_initial_state for c in chunks] + [False] * pad
        mapping = [c.block_table[c.start // bs] * bs + c.start % bs for c in chunks] + [0] * pad
        lens = [c.start + 1 for c in chunks] + [1] * pad
        width = max(len(c.block_table) for c in chunks)
        tables = np.zeros((size, width), dtype=np.int32)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table
        for dst, values in ((self.input_ids, ids), (self.state_indices, slots), (self.has_initial_state, init),
                            (self.slot_mapping, mapping), (self.context_lens, lens)):
            dst[:size].copy_(torch.tensor(values, dtype=dst.dtype), non_blocking=True)
        self.block_tables[:size, :width].copy_(torch.from_numpy(tables), non_blocking=True)


class PrefillGraphs(_Graphs):
    """Static buffers of a two-sequence prefill step (the chunk, then the padding sequence) and,
    when `capture`, one CUDA graph per chunk size in `sizes` (each over size + PREFILL_PAD tokens).
    The graph computes the logits of the chunk's last token whether or not the step samples it."""

    what = "prefill chunk"

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int], max_blocks: int,
                 block_size: int, device: torch.device, capture: bool, pool: tuple | None = None) -> None:
        super().__init__(forward, sizes)
        self.block_size = block_size
        n = self.sizes[-1] + PREFILL_PAD
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)  # padding rows: the null block
        self.cu_seqlens = torch.tensor([0, 1, 2], **i32)
        self.state_indices = torch.zeros(2, **i32)  # the padding sequence: the null slot
        self.has_initial_state = torch.zeros(2, dtype=torch.bool, device=device)
        self.block_tables = torch.zeros(2, max_blocks, **i32)
        self.context_lens = torch.ones(2, **i32)
        self.logits_index = torch.zeros(1, dtype=torch.int64, device=device)
        self._fill_lengths(1, 1 + PREFILL_PAD, 0, 0, False)
        if capture:
            self.capture(device, pool)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def batch(self, size: int) -> ForwardBatch:
        t = size + PREFILL_PAD
        return ForwardBatch(
            input_ids=self.input_ids[:t], cu_seqlens=self.cu_seqlens, num_decode=0, state_indices=self.state_indices,
            has_initial_state=self.has_initial_state, slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables, context_lens=self.context_lens, logits_indices=self.logits_index,
            prefill_cu_seqlens=self.cu_seqlens,
            prefill_layout=varlen_layout(self.cu_seqlens, t, self.context_lens, self.block_tables, self.block_size))

    def _prepare(self, size: int) -> None:
        self._fill_lengths(size, size + PREFILL_PAD, 0, 0, False)  # on the null slot and block

    def run(self, chunk: SeqChunk) -> torch.Tensor:
        """Logits [1, V] of the chunk's last token."""
        n, bs = len(chunk.token_ids), self.block_size
        size = self._size_for(n)
        t = size + PREFILL_PAD
        pos = chunk.start + np.arange(n)
        table = np.asarray(chunk.block_table, dtype=np.int64)
        rows = np.zeros(t, dtype=np.int64)  # padding rows: rows of the null block, in turn
        rows[:n] = table[pos // bs] * bs + pos % bs
        rows[n:] = np.arange(t - n) % bs
        ids = np.zeros(t, dtype=np.int64)
        ids[:n] = chunk.token_ids
        self.input_ids[:t].copy_(torch.from_numpy(ids), non_blocking=True)
        self.slot_mapping[:t].copy_(torch.from_numpy(rows), non_blocking=True)
        self.block_tables[0, :len(table)].copy_(torch.from_numpy(table.astype(np.int32)), non_blocking=True)
        self._fill_lengths(n, t, chunk.start, chunk.slot, chunk.has_initial_state)
        return self._replay(size)

    def _fill_lengths(self, n: int, t: int, start: int, slot: int, has_initial_state: bool) -> None:
        """cu_seqlens [0, n, t], context lengths [start + n, t - n], the chunk's slot, its last row."""
        h = torch.tensor([0, n, t, start + n, t - n, slot, int(has_initial_state), n - 1])
        self.cu_seqlens.copy_(h[:3], non_blocking=True)
        self.context_lens.copy_(h[3:5], non_blocking=True)
        self.state_indices[:1].copy_(h[5:6], non_blocking=True)
        self.has_initial_state[:1].copy_(h[6:7], non_blocking=True)
        self.logits_index.copy_(h[7:8], non_blocking=True)
