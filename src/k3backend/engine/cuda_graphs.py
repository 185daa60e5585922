"""CUDA graphs of decode steps and of prefill steps (ENGINE.md §7).

A step launches a few hundred (decode) to a couple of thousand (prefill) kernels; eagerly each
costs ~17-25 µs of Python and launch overhead, inside a graph ~1 µs, so an eager step of the
`small` shape spends 60-110 ms on the host whatever its size. At start-up the runner captures, in
one memory pool over static input buffers:

- one decode graph per batch size in `CAPTURE_SIZES` (up to the first size >= max_num_seqs). A
  decode-only step of B sequences copies its ids, slots, block tables and lengths into the first B
  rows of the buffers, pads the rest with the null slot 0 and null block 0 (rows whose writes land
  in entries no sequence owns), and replays the graph of the next captured size;
- one prefill graph per token size in `PREFILL_SIZES` (up to the first size >= the step budget),
  with room for one chunk per 16 tokens (at most `PREFILL_SEQS`): a step's prefill chunks (new
  prompts, a long prompt's next chunk, image rows included) run end to end, each unused chunk place
  as a one-token dummy sequence and the rest of the captured token count as a padding sequence of
  at least `PREFILL_PAD` tokens, all on the null slot and block. The sequences are independent in
  every op (varlen attention and recurrences, row-wise GEMMs and norms), so the padding changes no
  real row. The layout tables are derived on the device inside the graph (kernels/varlen.py). The
  same sizes are captured again with one chunk place (`ModelRunner.prefill_single`): a step of one
  chunk (a long prompt, a lone arrival) does not pay for the dummies.

A step of decode rows and prefill chunks replays one mixed graph (the same prefill graphs with
`decode` padded decode rows in front, for each captured batch size, up to `MIXED_TOKENS` prefill
tokens in at most `MIXED_SEQS` chunks): one forward over all of the step's tokens reads the weights
once. A mixed step beyond them replays the decode graph and then the prefill graph
(`ModelRunner._graphed`); a step that no graph holds runs eagerly, logged once per reason.

The same padding runs eagerly when graphs are off (`capture=False`): that is how CPU tests check
that padded rows change nothing, and the fallback when a capture fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from k3backend.engine.batch import SeqChunk, copy_in, copy_in_all, to_device
from k3backend.kernels.varlen import KDA_CHUNK, num_chunks, snapshot_tables, varlen_layout
from k3backend.model.cache import ForwardBatch

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)  # real tokens
PREFILL_PAD = 16  # tokens of the padding sequence at least (no kernel sees an empty sequence)
PREFILL_SEQS = 64  # chunks of one prefill graph at most (a step with more runs eagerly)
MIXED_TOKENS = 1024  # prefill tokens of the largest mixed graph (decode rows and chunks in one replay)
MIXED_SEQS = 4  # chunk places of a mixed graph: arrivals beside decoding requests come one or two a step


def _ranks() -> int:
    """The process group's size (1 without one): ranks replay graphs in step, so they must all have them."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: every size below max_num_seqs and the first one at or above it."""
    sizes = [b for b in CAPTURE_SIZES if b < max_num_seqs]
    return tuple(sizes + [next((b for b in CAPTURE_SIZES if b >= max_num_seqs), CAPTURE_SIZES[-1])])


def prefill_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The captured prefill token sizes: every size below the step budget and the first one at or above it."""
    sizes = [n for n in PREFILL_SIZES if n < max_num_batched_tokens]
    return tuple(sizes + [next((n for n in PREFILL_SIZES if n >= max_num_batched_tokens), PREFILL_SIZES[-1])])


def prefill_seqs(size: int, max_seqs: int = PREFILL_SEQS) -> int:
    """Chunk places of the prefill graph of `size` tokens: one per 16 tokens (short chunks of new
    prompts come several to a step), at most max_seqs."""
    return max(1, min(max_seqs, size // 16))


@dataclass(frozen=True)
class GraphPool:
    """One memory pool and one capture stream for all of a runner's graphs. The caching allocator
    reuses a freed block only on the stream that allocated it, so graph sets captured on streams of
    their own each kept their largest step's activations (the one-chunk prefill set 1.2 GiB, the
    mixed sets 3.5 GiB more at `small` on the H200)."""

    handle: tuple
    stream: torch.cuda.Stream

    @classmethod
    def new(cls, device: torch.device) -> GraphPool:
        return cls(torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))


class _Graphs:
    """Graphs over static buffers, one per size: `batch(size)` is the ForwardBatch of those buffers
    that `forward` (the model over the pools, no host sync) is captured on. `batch` is called inside
    the capture: the tables it derives on the device (the prefill layout) are rebuilt by each replay."""

    what = ""
    quiet = False  # the capture logs at debug level (one of many sets; the runner sums them up)

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int],
                 out: torch.Tensor | None = None) -> None:
        self.forward, self.sizes = forward, tuple(sorted(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.out = out  # logits rows every graph writes, when given (many graphs, one buffer)

    def batch(self, size: int) -> ForwardBatch:
        raise NotImplementedError

    def _size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _prepare(self, size: int, prefix: int = 0) -> None:
        """Make the buffers a valid step of `size` for its warm-up and capture runs (and its timing
        with a chunk after `prefix` cached tokens, where the graphs have chunks)."""

    def _replay(self, size: int) -> torch.Tensor:
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size]
        return self.run_eagerly(size)

    def run_eagerly(self, size: int) -> torch.Tensor:
        """The forward over the buffers of `size`, as its graph runs it."""
        logits = self.forward(self.batch(size))
        return logits if self.out is None else self.out[:logits.shape[0]].copy_(logits)

    def capture(self, device: torch.device, pool: GraphPool | None = None) -> None:
        """Warm each size up eagerly (kernel compilation, autotuning), then capture, largest first so
        the smaller graphs reuse the pool's memory. A capture that fails leaves none of these graphs."""
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved(device)
        pool = pool or GraphPool.new(device)
        stream = pool.stream
        try:
            for size in reversed(self.sizes):
                self._prepare(size)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self.run_eagerly(size)  # warm-up outside the capture
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool.handle, stream=stream):
                    self.outputs[size] = self.run_eagerly(size)
                self.graphs[size] = graph
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: run these steps eagerly
            self.graphs.clear()
            self.outputs.clear()
            torch.cuda.synchronize(device)
            if _ranks() > 1:  # the others may have captured, or wait in a warm-up collective: fail the load
                raise RuntimeError(f"CUDA graph capture of {self.what} steps failed on this rank: {e}; the ranks "
                                   "would run different steps (enforce_eager=true serves without graphs)") from e
            log.error("CUDA graphs off for %s steps, they run eagerly (many times slower): capture failed: %s "
                      "(enforce_eager=true skips the capture)", self.what, e)
            return
        log.log(logging.DEBUG if self.quiet else logging.INFO, "CUDA graphs: captured %s sizes %s in %.1f s, %.0f MiB",
                self.what, list(self.sizes),
                 time.monotonic() - t0, (torch.cuda.memory_reserved(device) - before) / 2**20)


    def replay_ms(self, device: torch.device, reps: int = 3, sizes: Sequence[int] | None = None,
                  prefix: int = 0) -> dict[int, float]:
        """Device milliseconds of one replay of each captured size (or of `sizes`; the median of
        `reps`), with the buffers made a valid step of that size first (its chunk after `prefix`
        cached tokens)."""
        times = {}
        for size in self.graphs if sizes is None else sizes:
            self._prepare(size, prefix)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
            self.graphs[size].replay()  # warm
            events[0].record()
            for e in events[1:]:
                self.graphs[size].replay()
                e.record()
            torch.cuda.synchronize(device)
            times[size] = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))[reps // 2]
        return times


def spread_token(row: int) -> int:
    """A token for decode row `row` of a made-up step, different per row (below 256, so the tiny
    vocabulary has it): one id for every row routes them all to the same few experts, which made a
    B64 step 4.0 ms against 5.7 with rows like a real batch (H200, `small`)."""
    return 1 + 37 * row % 255


class DecodeGraphs(_Graphs):
    """Static decode buffers and, when `capture`, one CUDA graph per batch size in `sizes`.

    `forward(batch)` is the model's forward over the pools (returns logits [B, V]); it must not
    sync with the host, which holds for the fused kernels and not for the torch references.
    """

    what = "decode batch"

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int], max_blocks: int,
                 block_size: int, device: torch.device, capture: bool, pool: GraphPool | None = None) -> None:
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

    def run(self, chunks: Sequence[SeqChunk], fix_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [len(chunks), V] of a decode-only step (every chunk one token, sampled); fix_ids edits
        the filled token ids on the device before the replay."""
        b = len(chunks)
        size = self._size_for(b)
        self._fill(chunks, size)
        if fix_ids is not None:
            fix_ids(self.input_ids[:b])
        return self._replay(size)[:b]

    def _fill(self, chunks: Sequence[SeqChunk], size: int) -> None:
        copy_in_all(decode_parts(self, chunks, size))

    def _prepare(self, size: int, prefix: int = 0) -> None:
        """Rows on the null slot and block with tokens of their own, so the replays that time the graphs
        (`replay_ms`, the runner's decode_ms) route like a real batch."""
        copy_in(self.input_ids[:size], [spread_token(i) for i in range(size)])


def decode_parts(g: DecodeGraphs | PrefillGraphs, chunks: Sequence[SeqChunk], size: int) -> list[tuple]:
    """(buffer, values) pairs for decode rows 0..b-1 of g's buffers from one-token chunks, rows b..size-1
    the null slot and block. Block-table columns past the longest table keep stale entries: no kernel
    reads past a row's context length."""
    b, bs = len(chunks), g.block_size
    pad = size - b
    ids = [c.token_ids[0] for c in chunks] + [0] * pad
    slots = [c.slot for c in chunks] + [0] * pad
    init = [c.has_initial_state for c in chunks] + [False] * pad
    mapping = [c.block_table[c.start // bs] * bs + c.start % bs for c in chunks] + [0] * pad
    lens = [c.start + 1 for c in chunks] + [1] * pad
    width = max([len(c.block_table) for c in chunks] + [1])
    tables = np.zeros((size, width), dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    return [(g.input_ids[:size], ids), (g.state_indices[:size], slots), (g.has_initial_state[:size], init),
            (g.slot_mapping[:size], mapping), (g.context_lens[:size], lens), (g.block_tables[:size, :width], tables)]


class PrefillGraphs(_Graphs):
    """Static buffers of a prefill step of up to `prefill_seqs(size)` chunks and, when `capture`, one
    CUDA graph per token size in `sizes`, each over `padded_tokens(size)` tokens in
    `prefill_seqs(size) + 1` sequences: the step's k chunks end to end, a one-token dummy sequence
    for each unused chunk place, then the padding sequence, all dummies on the null slot and block.
    Image rows replace the embeddings of their positions from a static buffer; unused entries point
    at the padding sequence's last row. The graph computes the logits of every chunk place's last
    token whether or not the step samples it.

    A mixed graph (`decode` > 0) has that many decode rows in front, filled as a decode graph's
    (padding rows on the null slot and block), so a step of b <= decode decoding requests and
    its chunks is one forward."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], sizes: Sequence[int], max_blocks: int,
                 block_size: int, device: torch.device, capture: bool, pool: GraphPool | None = None, *,
                 hidden: int, dtype: torch.dtype, max_seqs: int = PREFILL_SEQS, decode: int = 0,
                 out: torch.Tensor | None = None) -> None:
        super().__init__(forward, sizes, out)
        self.block_size, self.max_seqs, self.decode = block_size, max_seqs, decode
        self.what, self.quiet = (f"mixed (decode {decode})", True) if decode else ("prefill", False)
        D = decode
        n, seqs = self.padded_tokens(self.sizes[-1]), self.seqs(self.sizes[-1]) + 1
        max_blocks = max(max_blocks, -(-n // block_size))  # the padding sequence may outgrow max_model_len
        i32 = dict(dtype=torch.int32, device=device)
        # rows: the decode rows, then the chunks' tokens (per token) or sequences (per sequence)
        self.input_ids = torch.zeros(D + n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(D + n, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.zeros(seqs + 1, **i32)  # of the chunks alone
        self.state_indices = torch.zeros(D + seqs, **i32)  # dummies and padding: the null slot
        self.has_initial_state = torch.zeros(D + seqs, dtype=torch.bool, device=device)
        self.block_tables = torch.zeros(D + seqs, max_blocks, **i32)
        self.context_lens = torch.ones(D + seqs, **i32)
        self.logits_index = torch.arange(D + seqs - 1, dtype=torch.int64, device=device)  # decode rows: their own
        self._decode_cu = torch.arange(D, **i32)
        self.mm_positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)  # flat, decode rows included
        self.mm_embeds = torch.zeros(self.sizes[-1], hidden, dtype=dtype, device=device)
        self._no_images = {size: torch.full((size,), D + self.padded_tokens(size) - 1, dtype=torch.int64,
                                            device=device) for size in self.sizes}
        self.chunk_snapshot = torch.zeros(num_chunks(n, seqs), **i32)  # prefix snapshots inside chunks
        self.snapshot_ends = torch.zeros(self.sizes[-1] // KDA_CHUNK, dtype=torch.int64, device=device)
        self.snapshot_slots = torch.zeros_like(self.snapshot_ends)
        self._snapshots_written = False
        if capture:
            self.capture(device, pool)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def seqs(self, size: int) -> int:
        return prefill_seqs(size, self.max_seqs)

    def padded_tokens(self, size: int) -> int:
        """Tokens of the graph of `size` past the decode rows: room for the chunks, their dummies and a
        padding sequence of at least PREFILL_PAD tokens (no kernel sees an empty sequence)."""
        return size + self.seqs(size) - 1 + PREFILL_PAD

    def size_for(self, lengths: Sequence[int]) -> int | None:
        """The smallest captured size that holds chunks of these lengths, or None."""
        n = sum(lengths)
        return next((s for s in self.sizes if s >= n and self.seqs(s) >= len(lengths)), None)

    def batch(self, size: int) -> ForwardBatch:
        D, s, t = self.decode, self.seqs(size) + 1, self.padded_tokens(size)
        cu, lens, tables = self.cu_seqlens[:s + 1], self.context_lens[:D + s], self.block_tables[:D + s]
        m = size // KDA_CHUNK
        snapshots = (self.chunk_snapshot[:num_chunks(t, s)], self.snapshot_ends[:m], self.snapshot_slots[:m])
        return ForwardBatch(
            input_ids=self.input_ids[:D + t], cu_seqlens=torch.cat([self._decode_cu, cu + D]) if D else cu,
            num_decode=D, state_indices=self.state_indices[:D + s], has_initial_state=self.has_initial_state[:D + s],
            slot_mapping=self.slot_mapping[:D + t], block_tables=tables, context_lens=lens,
            logits_indices=self.logits_index[:D + s - 1], prefill_cu_seqlens=cu,
            prefill_layout=varlen_layout(cu, t, lens[D:], tables[D:], self.block_size, snapshots, padding_last=True),
            mm_positions=self.mm_positions[:size], mm_embeds=self.mm_embeds[:size])

    def _prepare(self, size: int, prefix: int = 0) -> None:
        """One chunk of `size` tokens after `prefix` cached ones on slot 1 (free at start-up, when graphs
        are captured and timed), its latent rows and its prefix's in the null block; the other places
        dummies, the decode rows padding. The chunk does a real prompt's KDA work, which padding on the
        null slot skips, and attends to its whole prefix, so `replay_ms` (the runner's prefill_ms, and
        with it the decode_stall_ms cap) times a step of that size and prefix."""
        chunk = SeqChunk([spread_token(i) for i in range(size)], prefix, 1, prefix > 0,
                         [0] * -(-(prefix + size) // self.block_size))
        self._fill([chunk], size, [], None)

    def run(self, chunks: Sequence[SeqChunk], mm_positions: Sequence[int] = (), mm_embeds: torch.Tensor | None = None,
            decodes: Sequence[SeqChunk] = (), fix_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits of the step's sampled rows: every decode row (one-token chunks, at most `decode`), then
        the last token of each chunk that samples. mm_positions are flat positions in the chunks laid
        end to end, which get the rows of mm_embeds; fix_ids edits the decode rows' filled ids on the
        device before the replay."""
        size = self.size_for([len(c.token_ids) for c in chunks])
        self._fill(chunks, size, mm_positions, mm_embeds, decodes)
        if fix_ids is not None:
            fix_ids(self.input_ids[:len(decodes)])
        out = self._replay(size)
        rows = list(range(len(decodes))) + [self.decode + i for i, c in enumerate(chunks) if c.sample]
        if rows == list(range(len(rows))):
            return out[:len(rows)]
        # not out[rows]: a list index is a copy from pageable memory, which waits for the step
        return out.index_select(0, to_device(rows, torch.long, out.device))

    def _fill(self, chunks: Sequence[SeqChunk], size: int, mm_positions: Sequence[int],
              mm_embeds: torch.Tensor | None, decodes: Sequence[SeqChunk] = ()) -> None:
        """The buffers for `decodes` and `chunks` in the graph of `size` (see the class docstring). The
        block-table rows of dummies (where they read: the first column) and of the padding sequence are
        zeroed: in another step they held a chunk's table."""
        D, bs, k, places, t = self.decode, self.block_size, len(chunks), self.seqs(size), self.padded_tokens(size)
        lens = np.array([len(c.token_ids) for c in chunks] + [1] * (places - k), dtype=np.int64)
        lens = np.append(lens, t - int(lens.sum()))  # the padding sequence
        cu = np.zeros(places + 2, dtype=np.int64)
        cu[1:] = np.cumsum(lens)
        ids = np.zeros(t, dtype=np.int64)
        rows = np.arange(t, dtype=np.int64) % bs  # dummies and padding: rows of the null block, in turn
        width = max([len(c.block_table) for c in chunks] + [1])
        tables = np.zeros((places, width), dtype=np.int32)
        starts = np.zeros(places + 1, dtype=np.int64)
        for i, c in enumerate(chunks):
            a, m = int(cu[i]), len(c.token_ids)
            pos = c.start + np.arange(m)
            table = np.asarray(c.block_table, dtype=np.int64)
            ids[a:a + m] = c.token_ids
            rows[a:a + m] = table[pos // bs] * bs + pos % bs
            tables[i, :len(table)] = table
            starts[i] = c.start
        small = np.concatenate([cu, starts + lens, [c.slot for c in chunks] + [0] * (places + 1 - k),
                                [c.has_initial_state for c in chunks] + [0] * (places + 1 - k),
                                D + cu[1:places + 1] - 1])
        s = places + 1
        parts = decode_parts(self, decodes, D) if D else []
        parts += [(self.cu_seqlens[:s + 1], small[:s + 1]), (self.context_lens[D:D + s], small[s + 1:2 * s + 1]),
                  (self.state_indices[D:D + s], small[2 * s + 1:3 * s + 1]),
                  (self.has_initial_state[D:D + s], small[3 * s + 1:4 * s + 1]),
                  (self.logits_index[D:D + places], small[4 * s + 1:]), (self.input_ids[D:D + t], ids),
                  (self.slot_mapping[D:D + t], rows), (self.block_tables[D:D + places, :width], tables)]
        self.block_tables[D + places].zero_()  # the padding row: a chunk place's table in a larger graph
        self.mm_positions[:size].copy_(self._no_images[size])  # unused: the padding sequence's last row
        parts += self._snapshot_parts(chunks, lens, size, t)
        if len(mm_positions):
            parts.append((self.mm_positions[:len(mm_positions)], np.asarray(mm_positions, dtype=np.int64) + D))
            self.mm_embeds[:len(mm_positions)].copy_(mm_embeds, non_blocking=True)
        copy_in_all(parts)

    def _snapshot_parts(self, chunks: Sequence[SeqChunk], lens: np.ndarray, size: int, t: int) -> list[tuple]:
        """(buffer, values) pairs of the step's snapshot tables (zeros: none); every entry another size's
        graph reads is zeroed again after a step that wrote some."""
        snaps = [c.snapshots for c in chunks]
        if not any(snaps) and not self._snapshots_written:
            return []
        for buf in (self.chunk_snapshot, self.snapshot_ends, self.snapshot_slots):
            buf.zero_()
        self._snapshots_written = any(snaps)
        if self._snapshots_written:
            table, ends, slots = snapshot_tables(lens.tolist(), snaps + [()] * (len(lens) - len(chunks)),
                                                 num_chunks(t, len(lens)), size // KDA_CHUNK)
            return [(self.chunk_snapshot[:len(table)], table), (self.snapshot_ends[:len(ends)], ends),
                    (self.snapshot_slots[:len(slots)], slots)]
        return []
