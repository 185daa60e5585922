"""The model runner of one rank, and the in-process executor the engine talks to.

`ModelRunner` owns the model, the cache pools and the sampler; `execute(plan)` turns a `StepPlan`
into one `ForwardBatch`, runs one forward over all of the step's tokens (decode rows and prefill
chunks together: the MoE reads its weights once), copies prefix snapshots, and samples on the
device. The engine sees only the `Executor` interface: `InProcessExecutor` runs the runner in
this process (TP = 1: tests, CPU, one GPU); a multi-process executor runs one per rank.

Pool sizing (`size_cache`): on a GPU after the weights and a warm-up forward at the largest step,
from `gpu_memory_utilization` of the device's total memory; on a CPU from `cpu_cache_gb`. Slots
come first (`max_num_seqs` running sequences plus prefix snapshots), the rest becomes MLA
blocks; the load fails, naming the numbers, when one `max_model_len` sequence cannot fit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from k3backend import kernels
from k3backend.engine.batch import SeqChunk, blocks_for, build_forward_batch, to_device
from k3backend.engine.config import EngineConfig
from k3backend.engine.cuda_graphs import (MIXED_SEQS, MIXED_TOKENS, PREFILL_PAD, PREFILL_SEQS, DecodeGraphs,
                                          GraphPool, PrefillGraphs, capture_sizes, prefill_seqs, prefill_sizes)
from k3backend.engine.plan import PENDING, CacheCapacity, ScheduledSeq, SlotRequest, StepPlan
from k3backend.engine.sampler import DeviceSample, Sampled, Sampler, SamplingRow
from k3backend.engine.sampler_ref import banned_ids
from k3backend.model.cache import CachePools
from k3backend.model.k3 import K3Model

log = logging.getLogger(__name__)


def timed_starts(max_model_len: int, smallest: int) -> list[int]:
    """Chunk starts at which prefill steps are timed besides 0: powers of two from 2,048 and the latest
    start a chunk can have. A step's cost grows with its chunk's start, so a chunk is budgeted at the
    next timed start at or above its own."""
    last, starts = max_model_len - smallest, []
    while 2048 << len(starts) < last:
        starts.append(2048 << len(starts))
    return starts + [last] if last > 0 else []


def agreed(ms: dict[int, float], device: torch.device) -> dict[int, float]:
    """The slowest rank's times, where ranks run together: a choice made from them (which graphs to
    replay next) must be the same on every rank, since their graphs meet in the collectives."""
    import torch.distributed as dist

    if not ms or not (dist.is_available() and dist.is_initialized()):
        return ms
    t = torch.tensor(list(ms.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(ms, t.tolist()))


def _ms(row: dict[int, float]) -> str:
    return ", ".join(f"{n}: {ms:.2f}" for n, ms in sorted(row.items()))


@dataclass(frozen=True)
class ModelInfo:
    """What the engine checks requests against."""

    vocab_size: int
    hidden_size: int
    media_pad_id: int


class Executor(Protocol):
    """The model on one or several ranks, as the engine sees it."""

    info: ModelInfo
    capacity: CacheCapacity
    # chunk start -> prefill tokens -> device ms of such a step, measured (start 0: every size; later
    # starts: the sizes up to the first beyond decode_stall_ms); {} when not (CPU)
    prefill_ms: dict[int, dict[int, float]]
    decode_ms: float  # device ms of the largest captured decode step, measured; 0 when not (CPU)

    def launch(self, plan: StepPlan) -> Launched: ...  # the step queued; `finish` waits for its ids
    def finish(self, launched: Launched) -> Sampled: ...
    overlap: bool  # launch accepts PENDING decode inputs (the engine schedules while a step runs)
    def health(self) -> str | None: ...  # why it cannot serve (a dead worker), or None
    @property
    def workers_alive(self) -> int: ...
    def close(self, timeout: float = 20.0) -> None: ...


@dataclass
class _Slot:
    """What the runner keeps per occupied slot: the request's sampling state and token history."""

    req: SlotRequest
    output_ids: list[int] = field(default_factory=list)
    pending: int = 0  # tokens drawn by launched steps, not yet on the host


@dataclass
class Launched:
    """A launched step's draw and the slots it drew for, in its sampling rows' order."""

    sample: DeviceSample
    slots: list[_Slot]


class ModelRunner:
    """One rank: model, pools, sampler. `execute` is the whole step on this rank.

    Every rank runs the same plans in the same order, so all meet in the same collectives; only
    the rank that `samples` (rank 0) keeps sampling state and returns tokens.
    """

    def __init__(self, model: K3Model, pools: CachePools, samples: bool = True) -> None:
        self.model, self.pools, self.samples = model, pools, samples
        self.device = model.language_model.lm_head.weight.device
        self.sampler = Sampler()
        self._slots: dict[int, _Slot] = {}
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # one chunk place per graph: a step of one chunk replays these, without the multi-chunk graphs'
        # dummy places (one-token sequences, about 60 µs each at the `small` shape on the H200)
        self.prefill_single: PrefillGraphs | None = None
        # decode rows and chunks in one replay, by the captured decode batch size (ascending)
        self.mixed: dict[int, PrefillGraphs] = {}
        self._eager_logged: set[str] = set()
        self.prefill_ms: dict[int, dict[int, float]] = {}  # chunk start -> tokens -> device ms (`time_prefill`)
        self.decode_ms = 0.0  # the slowest decode graph's replay (GPU): what decode rows add to a step
        self._last: tuple[torch.Tensor, dict[int, int]] = (torch.zeros(0, dtype=torch.long), {})  # ids, slot -> row

    @torch.inference_mode()
    def capture_graphs(self, cfg: EngineConfig) -> None:
        """CUDA graphs for decode steps and prefill steps (of several chunks, and of one) where
        `_wants_graphs`, in one memory pool and capture stream; a kind whose capture fails stays off."""
        if not _wants_graphs(self.device, cfg):
            return
        pool = GraphPool.new(self.device)
        sizes = prefill_graph_sizes(cfg)
        prefill = self.make_prefill_graphs(cfg, sizes, capture=True, pool=pool) if sizes else None
        single = None
        if prefill is not None and prefill.max_seqs > 1:  # the same sizes with one chunk place
            single = self.make_prefill_graphs(cfg, sizes, capture=True, pool=pool, max_seqs=1)
            if not prefill.graphs:  # keep one-chunk graphs at least
                if single.graphs:
                    log.warning("CUDA graphs: only prefill steps of one chunk replay graphs")
                prefill, single = single, None
        self.prefill_graphs = prefill if prefill is not None and prefill.graphs else None
        self.prefill_single = single if single is not None and single.graphs else None
        t0, before = time.monotonic(), torch.cuda.memory_reserved(self.device)
        mixed = self.make_mixed_graphs(cfg, capture=True, pool=pool)
        self.mixed = {d: g for d, g in mixed.items() if g.graphs}
        if self.mixed:
            log.info("CUDA graphs: captured mixed steps of decode batch sizes %s beside prefill sizes %s in %.1f s, "
                     "%.0f MiB", list(self.mixed), list(next(iter(self.mixed.values())).sizes), time.monotonic() - t0,
                     (torch.cuda.memory_reserved(self.device) - before) / 2**20)
        decode = self.make_decode_graphs(cfg, capture=True, pool=pool)
        self.graphs = decode if decode.graphs else None
        if self.graphs is not None:
            self.decode_ms = max(self.graphs.replay_ms(self.device).values())
        if self.prefill_graphs is not None:  # every rank replays the same graphs: they meet in the collectives
            self.prefill_ms = self.time_prefill(cfg)
            log.info("prefill graphs, device ms by prefill tokens: %s", _ms(self.prefill_ms[0]))
            for start, row in self.prefill_ms.items():
                if start:
                    log.info("  with the chunk from token %d: %s", start, _ms(row))
        if self.prefill_single is not None:
            log.info("prefill graphs of one chunk, device ms by prefill tokens: %s",
                     _ms(self.prefill_single.replay_ms(self.device)))

    def time_prefill(self, cfg: EngineConfig) -> dict[int, dict[int, float]]:
        """Device ms of the prefill graphs by chunk start and size. A chunk attends to its cached prefix,
        so the same size costs more later in a long prompt: on the H200 (`small`) a 3,072-token step
        timed at 32 ms from token 0 made 44 ms inter-token gaps beside 8,192-token prompts. Each start
        in `timed_starts` is timed up to the first size that does not fit decode_stall_ms beside the
        decode rows (the sizes the cap can pick there), each at that start or the latest it can have.
        Every rank stops at the same size: the times are the slowest rank's (`agreed`)."""
        graphs = self.prefill_graphs
        times = {0: agreed(graphs.replay_ms(self.device), self.device)}
        if not cfg.decode_stall_ms:
            return times
        for start in timed_starts(cfg.max_model_len, graphs.sizes[0]):
            row = times[start] = {}
            for n in graphs.sizes:  # a chunk of n tokens starts at max_model_len - n at the latest
                if n > cfg.max_model_len:
                    break
                row |= agreed(graphs.replay_ms(self.device, sizes=[n], prefix=min(start, cfg.max_model_len - n)),
                              self.device)
                if row[n] + self.decode_ms > cfg.decode_stall_ms:
                    break
        return times

    def _forward(self, batch) -> torch.Tensor:
        return self.model(batch, self.pools)

    def make_decode_graphs(self, cfg: EngineConfig, capture: bool, pool: GraphPool | None = None) -> DecodeGraphs:
        """The static decode buffers for this runner's pools (capture=False: padded eager steps, for tests)."""
        return DecodeGraphs(self._forward, capture_sizes(cfg.max_num_seqs),
                            blocks_for(cfg.max_model_len, self.pools.block_size), self.pools.block_size, self.device,
                            capture, pool)

    def make_prefill_graphs(self, cfg: EngineConfig, sizes: tuple[int, ...], capture: bool,
                            pool: GraphPool | None = None, max_seqs: int = PREFILL_SEQS, decode: int = 0,
                            out: torch.Tensor | None = None) -> PrefillGraphs:
        """The static prefill buffers for steps of up to sizes[-1] prefill tokens, after `decode` decode
        rows (capture=False: padded eager steps, for tests)."""
        lm = self.model.language_model
        return PrefillGraphs(self._forward, sizes, blocks_for(cfg.max_model_len, self.pools.block_size),
                             self.pools.block_size, self.device, capture, pool, hidden=lm.lm_head.weight.shape[1],
                             dtype=lm.lm_head.weight.dtype, max_seqs=min(max_seqs, cfg.max_num_seqs), decode=decode,
                             out=out)

    def make_mixed_graphs(self, cfg: EngineConfig, sizes: tuple[int, ...] | None = None, capture: bool = False,
                          pool: GraphPool | None = None) -> dict[int, PrefillGraphs]:
        """Mixed graphs for every captured decode batch size, over prefill `sizes` (default: those up to
        MIXED_TOKENS) in MIXED_SEQS chunk places, sharing one logits buffer; largest first, so the smaller
        reuse the pool's memory (capture=False: padded eager steps, for tests)."""
        sizes = sizes or mixed_graph_sizes(cfg)
        lm = self.model.language_model
        decode = capture_sizes(cfg.max_num_seqs)
        places = prefill_seqs(sizes[-1], min(MIXED_SEQS, cfg.max_num_seqs))
        out = lm.lm_head.weight.new_empty(decode[-1] + places, lm.cfg.vocab_size)
        graphs = {d: self.make_prefill_graphs(cfg, sizes, capture, pool, MIXED_SEQS, decode=d, out=out)
                  for d in reversed(decode)}
        return dict(sorted(graphs.items()))

    def execute(self, plan: StepPlan) -> Sampled | None:
        launched = self.launch(plan)
        return None if launched is None else self.finish(launched)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched | None:
        """The step queued on the device, its draw included; None on a rank that does not sample."""
        logits = self.logits(plan)
        if not self.samples:
            return None
        sampled = [s for s in plan.seqs if s.sample]
        out = self.sampler.launch(logits, [self._row(s) for s in sampled]) if sampled else _NO_SAMPLE
        slots = [self._slots[s.slot] for s in sampled]
        for st in slots:
            st.pending += 1
        self._last = out.ids, {s.slot: i for i, s in enumerate(sampled)}
        return Launched(out, slots)

    @staticmethod
    def finish(launched: Launched) -> Sampled:
        """Wait for a launched step's ids; they join their slots' histories (a slot freed meanwhile
        keeps its own object, so a new request in it sees none of them)."""
        out = launched.sample.result()
        for st, token in zip(launched.slots, out.token_ids):
            st.output_ids.append(token)
            st.pending -= 1
        return out

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """The step's forward: slot bookkeeping, snapshot copies, logits [S, V] of the sampling rows."""
        for slot in plan.freed:
            self._slots.pop(slot, None)
        for r in plan.new:
            self._slots[r.slot] = _Slot(r, list(r.output_ids))
        self._copy(plan.copies)
        decodes, chunks = plan.seqs[:plan.num_decode], plan.seqs[plan.num_decode:]
        eager = self._eager_reason(decodes, chunks) if plan.seqs else ""
        if plan.seqs and not eager:
            logits = self._graphed(decodes, chunks)
        else:
            t0 = time.perf_counter()
            batch = self._batch(plan)
            self._feed(batch.input_ids, decodes)
            logits = self.model(batch, self.pools)
            if eager and self.prefill_graphs is not None and eager not in self._eager_logged:
                self._eager_logged.add(eager)
                log.info("an eager step (no CUDA graph holds it: %s) took %.1f ms of host time; logged once per "
                         "reason", eager, (time.perf_counter() - t0) * 1e3)
        self._copy(plan.snapshots)
        return logits

    def _graphed(self, decodes: list[ScheduledSeq], chunks: list[ScheduledSeq]) -> torch.Tensor:
        """The step as graph replays, logits of its sampled rows: one mixed replay where one holds the
        decode rows and the chunks, else the decode rows' replay and then the chunks' (reading the
        weights twice instead of paying an eager step's host time)."""
        fix = lambda ids: self._feed(ids, decodes)  # noqa: E731
        mixed = self._mixed_for(decodes, chunks)
        if mixed is not None:
            return mixed.run([_chunk(s) for s in chunks], *self._image_rows(chunks),
                             decodes=[_chunk(s) for s in decodes], fix_ids=fix)
        parts = []
        if decodes:
            parts.append(self.graphs.run([_chunk(s) for s in decodes], fix))
        if chunks:
            if parts:  # the graphs share one memory pool: the decode logits must leave it first
                parts[0] = parts[0].clone()
            parts.append(self._prefill_for(chunks).run([_chunk(s) for s in chunks], *self._image_rows(chunks)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _mixed_for(self, decodes: list[ScheduledSeq], chunks: list[ScheduledSeq]) -> PrefillGraphs | None:
        """The mixed graphs that hold a step of these decode rows and prefill chunks, or None."""
        if not (decodes and chunks and self.mixed) or not _plain(decodes):
            return None
        graphs = next((g for d, g in self.mixed.items() if d >= len(decodes)), None)
        fits = graphs is not None and graphs.size_for([len(s.token_ids) for s in chunks]) is not None
        return graphs if fits else None

    def _prefill_for(self, chunks: list[ScheduledSeq]) -> PrefillGraphs:
        """The one-chunk graphs for a step of one chunk, else the graphs with room for several."""
        single = self.prefill_single
        if len(chunks) == 1 and single is not None and single.size_for([len(chunks[0].token_ids)]) is not None:
            return single
        return self.prefill_graphs

    def _eager_reason(self, decodes: list[ScheduledSeq], chunks: list[ScheduledSeq]) -> str:
        """'' when captured graphs hold the step's decode rows and prefill chunks, else why not."""
        if self._mixed_for(decodes, chunks) is not None:
            return ""
        if decodes:
            if self.graphs is None:
                return "no decode graphs"
            if len(decodes) > self.graphs.max_batch:
                return f"more than {self.graphs.max_batch} decode rows"
            if not _plain(decodes):
                return "a decode row that is not sampled or is an image row"
        if chunks:
            if self.prefill_graphs is None:
                return "no prefill graphs"
            if self.prefill_graphs.size_for([len(s.token_ids) for s in chunks]) is None:
                return (f"prefill chunks beyond the largest graph ({self.prefill_graphs.max_tokens} tokens, "
                        f"{self.prefill_graphs.seqs(self.prefill_graphs.max_tokens)} chunks)")
        return ""

    def _feed(self, input_ids: torch.Tensor, decodes: list[ScheduledSeq]) -> None:
        """Decode rows whose input is PENDING take the token their slot drew in the last launched
        step, device to device (input_ids: the step's flat ids, decode rows first)."""
        pairs = [(j, self._last[1][s.slot]) for j, s in enumerate(decodes) if s.token_ids[0] == PENDING]
        if pairs:
            dst, src = to_device(list(zip(*pairs)), torch.long, self.device).unbind(0)
            input_ids.index_copy_(0, dst, self._last[0].index_select(0, src))

    def _image_rows(self, seqs: list[ScheduledSeq]) -> tuple[list[int], torch.Tensor | None]:
        """Flat positions of the image rows of `seqs` laid end to end, and those rows (on the device)."""
        positions: list[int] = []
        rows: list[torch.Tensor] = []
        offset = 0
        for s in seqs:
            if s.mm_offsets:
                embeds = self._slots[s.slot].req.image_embeds
                positions += [offset + o for o in s.mm_offsets]
                rows.append(embeds[s.mm_first_row:s.mm_first_row + len(s.mm_offsets)])
            offset += len(s.token_ids)
        return positions, to_device(torch.cat(rows), None, self.device) if rows else None

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = to_device(list(zip(*pairs)), torch.long, self.device).unbind(0)
            self.pools.copy_slot(src, dst)

    def _batch(self, plan: StepPlan):
        return build_forward_batch([_chunk(s) for s in plan.seqs], plan.num_decode, self.pools.block_size,
                                   self.device, *self._image_rows(plan.seqs))

    def _row(self, s: ScheduledSeq) -> SamplingRow:
        st = self._slots[s.slot]
        r = st.req
        # A pending token's value is unknown, its count is not: only min_tokens reads the count (rows whose
        # draws read values, penalties and bad words of several tokens, never overlap a step).
        seen = st.output_ids + [PENDING] * st.pending if len(st.output_ids) < r.params.min_tokens else st.output_ids
        return SamplingRow(r.params, r.seed, len(st.output_ids) + st.pending,
                           tuple(banned_ids(r.params, seen, r.eos_ids, r.bad_word_seqs)), r.prompt_ids, st.output_ids)


_NO_SAMPLE = DeviceSample(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, [], [])


def _plain(decodes: list[ScheduledSeq]) -> bool:
    """Decode rows a graph holds: sampled, and no image row (a graph's decode rows take token ids only)."""
    return all(s.sample and not s.mm_offsets for s in decodes)


def _chunk(s: ScheduledSeq) -> SeqChunk:
    return SeqChunk(s.token_ids, s.start, s.slot, s.has_initial_state, s.block_table, s.sample, s.snapshots)


def size_cache(model: K3Model, cfg: EngineConfig) -> CacheCapacity:
    """Slots and blocks for the pools (see the module docstring)."""
    lm = model.language_model
    bs = cfg.block_size
    if cfg.num_blocks is not None and cfg.num_slots is not None:
        capacity = CacheCapacity(cfg.num_blocks, cfg.num_slots, bs)
    else:
        slot_bytes = CachePools.bytes_per_slot(lm)
        block_bytes = CachePools.bytes_per_token(lm) * bs
        budget = _cache_budget(model, cfg)
        one_seq = blocks_for(cfg.max_model_len, bs) + 1
        need = 2 * slot_bytes + one_seq * block_bytes
        if budget < need:
            where = "gpu_memory_utilization" if lm.lm_head.weight.is_cuda else "cpu_cache_gb"
            raise ValueError(f"the cache cannot hold one max_model_len {cfg.max_model_len} sequence: it needs "
                             f"{need / 2**30:.2f} GiB ({one_seq} blocks of {block_bytes} bytes and 2 KDA slots of "
                             f"{slot_bytes} bytes), {budget / 2**30:.2f} GiB are available; raise {where} or "
                             f"lower max_model_len")
        snapshots = max(4, cfg.max_num_seqs // 2) if cfg.prefix_caching else 0  # prefix snapshot slots
        slots = min(1 + cfg.max_num_seqs + snapshots, (budget - one_seq * block_bytes) // slot_bytes)
        capacity = CacheCapacity(int((budget - slots * slot_bytes) // block_bytes), int(slots), bs)
    return capacity


def log_capacity(capacity: CacheCapacity, cfg: EngineConfig) -> None:
    """The pools the engine schedules against, logged once (after every rank agreed on them)."""
    log.info("cache: %d KDA state slots (%d concurrent requests plus prefix snapshots), %d MLA blocks of %d "
             "tokens (%d tokens cached at most)", capacity.num_slots - 1, min(cfg.max_num_seqs, capacity.num_slots - 1),
             capacity.num_blocks - 1, capacity.block_size, (capacity.num_blocks - 1) * capacity.block_size)


def _cache_budget(model: K3Model, cfg: EngineConfig) -> int:
    """Bytes the pools may take: what gpu_memory_utilization leaves after weights and a warm-up
    forward at the largest step, or cpu_cache_gb."""
    device = model.language_model.lm_head.weight.device
    if device.type != "cuda":
        return int(cfg.cpu_cache_gb * 2**30)
    n = cfg.max_num_batched_tokens  # the largest step: several chunks may fill it past max_model_len
    chunk = SeqChunk([0] * n, 0, 1, False, list(range(1, blocks_for(n, cfg.block_size) + 1)))
    used = torch.cuda.memory_allocated(device) + _activation_bytes(model, cfg, [chunk], 0)
    if _wants_graphs(device, cfg):  # the graphs' pool keeps the largest graphed steps' activations for good
        b = capture_sizes(cfg.max_num_seqs)[-1]
        used += _activation_bytes(model, cfg, [SeqChunk([0], 0, 0, False, [0])] * b, b)
        p, m = prefill_graph_sizes(cfg)[-1], mixed_graph_sizes(cfg)[-1]
        used += _activation_bytes(model, cfg, _padded_step(cfg, p, PREFILL_SEQS), 0)
        if b + m > p:  # the largest mixed step, where it is the larger (a short step budget)
            used += _activation_bytes(model, cfg, [SeqChunk([0], 0, 0, False, [0])] * b
                                      + _padded_step(cfg, m, MIXED_SEQS), b)
        lm = model.language_model  # the mixed graphs' one logits buffer
        used += (b + MIXED_SEQS) * lm.cfg.vocab_size * lm.lm_head.weight.element_size()
    free, total = torch.cuda.mem_get_info(device)
    # What the fraction allows, but never more than is free now (other processes share the GPU).
    return max(0, int(min(cfg.gpu_memory_utilization * total - used, free - 2**30)))


def _padded_step(cfg: EngineConfig, size: int, max_seqs: int) -> list[SeqChunk]:
    """The chunks of a prefill graph's step of `size` tokens: one chunk, the dummies, the padding."""
    dummies = prefill_seqs(size, min(max_seqs, cfg.max_num_seqs)) - 1
    return ([SeqChunk([0] * size, 0, 0, False, [0] * blocks_for(size, cfg.block_size))]
            + [SeqChunk([0], 0, 0, False, [0])] * dummies + [SeqChunk([0] * PREFILL_PAD, 0, 0, False, [0])])


def _activation_bytes(model: K3Model, cfg: EngineConfig, chunks: list[SeqChunk], num_decode: int) -> int:
    """Peak device memory of one warm-up forward over `chunks` beyond what was allocated before it
    and the warm-up pools it writes."""
    device = model.language_model.lm_head.weight.device
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    blocks = max(max(c.block_table) for c in chunks) + 1
    warm = CachePools.allocate(model.language_model, 2, blocks, cfg.block_size)
    with torch.inference_mode():
        model(build_forward_batch(chunks, num_decode, cfg.block_size, device), warm)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - sum(t.numel() * t.element_size() for c in warm.layers
                                                                for t in vars(c).values())
    del warm
    torch.cuda.empty_cache()
    return max(0, peak)


def prefill_graph_sizes(cfg: EngineConfig) -> tuple[int, ...]:
    """The prefill graphs' token sizes: up to the step budget, which several chunks can fill even when
    max_model_len is shorter (each chunk is at most max_model_len)."""
    return prefill_sizes(cfg.max_num_batched_tokens)


def mixed_graph_sizes(cfg: EngineConfig) -> tuple[int, ...]:
    """The mixed graphs' prefill token sizes: the prefill graphs' up to MIXED_TOKENS."""
    return prefill_sizes(min(cfg.max_num_batched_tokens, MIXED_TOKENS))


def _wants_graphs(device: torch.device, cfg: EngineConfig) -> bool:
    """Decode steps are captured on a GPU with the fused kernels (the torch references sync with the
    host, so they cannot be), unless cfg.enforce_eager."""
    return device.type == "cuda" and not cfg.enforce_eager and kernels.MODE != "ref"


class InProcessExecutor:
    """TP = 1: the model runner in this process."""

    def __init__(self, model: K3Model, cfg: EngineConfig) -> None:
        text = model.cfg.text
        self.info = ModelInfo(text.vocab_size, text.hidden_size, model.cfg.media_placeholder_token_id)
        self.capacity = size_cache(model, cfg)
        log_capacity(self.capacity, cfg)
        pools = CachePools.allocate(model.language_model, self.capacity.num_slots, self.capacity.num_blocks,
                                    self.capacity.block_size)
        self.runner = ModelRunner(model, pools)
        self.runner.capture_graphs(cfg)
        self.prefill_ms, self.decode_ms = self.runner.prefill_ms, self.runner.decode_ms
        # A GPU runs a launched step while the host schedules the next; a CPU computes it as it is
        # launched, so overlapping would only deliver each token one step later (tests set it anyway).
        self.overlap = self.runner.device.type == "cuda"
        self._closed = False

    @classmethod
    def load(cls, path: str | Path, cfg: EngineConfig, *, dtype: torch.dtype, device: torch.device) -> InProcessExecutor:
        from k3backend.checkpoint import load_model

        return cls(load_model(path, dtype=dtype, device=device, progress=False), cfg)

    def launch(self, plan: StepPlan) -> Launched:
        return self.runner.launch(plan)

    def finish(self, launched: Launched) -> Sampled:
        return self.runner.finish(launched)

    def health(self) -> str | None:
        return None

    @property
    def workers_alive(self) -> int:
        return 0 if self._closed else 1  # as the worker executor: none serving once the engine closed it

    def close(self, timeout: float = 20.0) -> None:
        self._closed = True
