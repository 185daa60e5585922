"""CUDA graphs of decode steps (ENGINE.md §7).

A decode step launches a few hundred small kernels; eagerly each costs ~17 µs of Python and launch
overhead, inside a graph ~1 µs. At start-up the runner captures one graph per batch size in
`CAPTURE_SIZES` (up to the first size >= max_num_seqs), all in one memory pool, over static input
buffers. A decode-only step of B sequences copies its ids, slots, block tables and lengths into the
first B rows of the buffers, pads the rest with the null slot 0 and null block 0 (rows whose
writes land in entries no sequence owns), and replays the graph of the next captured size.

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
from k3backend.model.cache import ForwardBatch

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: every size below max_num_seqs and the first one at or above it."""
    sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs]
    return tuple(sizes + [next((b for b in CAPTURE_SIZES if b >= max_num_seqs), CAPTURE_SIZES[-1])])


class DecodeGraphs:
    """Static decode buffers and, when `capture`, one CUDA graph per size in `sizes`.

    `forward(batch)` is the model's forward over the pools (returns logits [B, V]); it must not
    sync with the host, which holds for the fused kernels and not for the torch references.
    """

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int], max_blocks: int,
                 block_size: int, device: torch.device, capture: bool) -> None:
        self.forward, self.sizes, self.block_size = forward, tuple(sorted(sizes)), block_size
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture(device)

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

    def _size_for(self, b: int) -> int:
        return next(s for s in self.sizes if s >= b)

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] of a decode-only step (every chunk one token, sampled)."""
        b = len(chunks)
        size = self._size_for(b)
        self._fill(chunks, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:b]
        return self.forward(self.batch(size))[:b]

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

    def _capture(self, device: torch.device) -> None:
        """Warm each size up eagerly (kernel compilation, autotuning), then capture, largest first so
        the smaller graphs reuse the pool's memory."""
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        try:
            for size in reversed(self.sizes):
                batch = self.batch(size)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self.forward(batch)  # warm-up outside the capture
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self.forward(batch)
                self.graphs[size] = graph
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: run decode eagerly
            self.graphs.clear()
            self.outputs.clear()
            torch.cuda.synchronize(device)
            log.warning("CUDA graphs off, decode steps run eagerly: capture failed: %s", e)
            return
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s, %.0f MiB", list(self.sizes),
                 time.monotonic() - t0, (torch.cuda.memory_reserved(device) - before) / 2**20)
