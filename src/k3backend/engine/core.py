"""The engine core: requests of token ids in, one `StepOutputs` per step out (ENGINE.md §2, §8).

`EngineCore` is the state of the step loop and nothing else: the scheduler, the executor (the
model on one or several ranks) and the requests by id. It has no threads, no locks, no tokenizer
and no serving callbacks; whoever drives it calls `add`, `abort` and `step` from one thread: the
engine-core process (`engine.core_process`) when serving, a test or a benchmark in process.

A request that fails its checks here is not an exception for the caller: it ends in the next
step's outputs with ERROR and the message, like every other outcome, so the serving layer has one
path for all of them. These checks are the engine's own (lengths against max_model_len and the
cache, token ids against the vocabulary, image rows against the prompt's pads); the serving layer
does not repeat them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3backend.engine.config import EngineConfig
from k3backend.engine.outputs import EngineStats, StepOutputs
from k3backend.engine.plan import StepPlan
from k3backend.engine.request import FinishReason, Request, TokenLogprob
from k3backend.engine.runner import Executor
from k3backend.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from k3backend.errors import InvalidArgument, K3Error

log = logging.getLogger(__name__)

# A step measured to take longer is not overlapped with the next one's scheduling. 25 ms overlaps steps
# that admit 2-4 prompts beside decodes: staggered ITL p99 14.2 ms against 25.3 at 15 ms (H200, `small`);
# the image-row closed loop lost 2.7 % on the same tree, probably from this (not measured apart).
HEAVY_STEP_MS = 25.0
TRACE_ENV = "K3_STEP_TRACE"  # a file path: one JSON line per step (what it carried, arrivals, waits)


class EngineCore:
    """Continuous batching over an `Executor`; see the module docstring."""

    def __init__(self, executor: Executor, cfg: EngineConfig) -> None:
        self.executor, self.cfg = executor, cfg
        self.info = executor.info
        cap = prefill_cap(executor.prefill_ms, cfg.decode_stall_ms, executor.decode_ms)
        if cap:
            log.info("steps that decode take at most %s tokens of longer prompts (decode_stall_ms %g, with up to "
                     "%.1f ms of decode rows)", describe_cap(cap), cfg.decode_stall_ms, executor.decode_ms)
        self.sched = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefix_caching,
                                               cfg.snapshot_interval, cap, cfg.max_prefill_delay_ms / 1e3),
                               executor.capacity)
        self._seqs: dict[int, Sequence] = {}
        self._ended: list[tuple[int, FinishReason, tuple[str, str] | None]] = []  # reported with the next step
        self._in_flight: tuple[Any, list[Sequence]] | None = None  # a launched step and its sampling rows' seqs
        self._heavy_in_flight = False  # the step in flight is heavy: the next call only waits for it
        self._history: set[int] = set()  # ids whose sampling reads their token history (no overlap then)
        self.overlap = cfg.async_scheduling and executor.overlap
        # Prefill tokens up to which a step is short enough to overlap (measured: HEAVY_STEP_MS); a longer
        # step is waited for before the next one is scheduled, so requests that arrive while it runs
        # join the very next step.
        self._light_prefill = max((n for n, ms in executor.prefill_ms[0].items() if ms < HEAVY_STEP_MS), default=0) \
            if executor.prefill_ms else None
        self.steps = 0
        self._trace = _Trace(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None

    # ---- requests ------------------------------------------------------------------------------

    def add(self, rid: int, request: Request) -> None:
        """Queue a request under the caller's unique id; a request that fails the checks ends, with
        the message, in the next step's outputs."""
        if rid in self._seqs:
            raise ValueError(f"request id {rid} is already in the engine")
        try:
            self._validate(request)
        except K3Error as e:
            self._ended.append((rid, FinishReason.ERROR, (e.code, str(e))))
            return
        seq = Sequence(rid, request, pad_id=self.info.media_pad_id)
        self._seqs[rid] = seq
        if self._trace is not None:
            self._trace.added += 1
        if _reads_history(request):
            self._history.add(rid)
        self.sched.add(seq)

    def abort(self, rid: int) -> None:
        """End a request at the next step boundary (CANCELLED); unknown or finished ids are ignored."""
        seq = self._seqs.get(rid)
        if seq is not None:
            seq.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self._seqs or self._ended or self._in_flight)

    def stats(self) -> EngineStats:
        s = self.sched
        running = len(s.running)
        return EngineStats(running, len(self._seqs) - running, self.steps, s.blocks.usage, s.slots.usage,
                           s.num_preemptions, s.prefix_queries, s.prefix_hits, self.executor.workers_alive)

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Cancellations, one scheduled forward with its sampling, and every request's news.

        With `overlap`, the step is scheduled and launched while the previous one still runs on the
        device (its drawn ids are this step's decode inputs there), and the news is the previous
        step's: a request that the previous token ended may run one more row, which is dropped. A step
        with more prefill than runs in HEAVY_STEP_MS is waited for by the next call, which returns its
        news alone: requests that arrive while it runs join the step after it, and the step before it
        reports when it ends, not when the heavy one does (that doubled decoding requests' gaps).
        """
        rows = _Rows()
        for rid, reason, error in self._ended:
            rows.end(rid, reason, error)
        self._ended = []
        for seq in self.sched.pop_cancelled():
            self._drop(seq)
            rows.end(seq.rid, FinishReason.CANCELLED)
        if self._in_flight is not None and self._heavy_in_flight:
            self._resolve(rows)
            return rows.outputs(self.stats())
        if self._in_flight is not None and (not self.overlap or self._history):
            self._resolve(rows)  # this step's rows need the previous tokens on the host
        plan, seqs = self.sched.schedule()
        rows.scheduled_ns = time.time_ns()
        for seq in seqs:
            if not seq.started:
                seq.started = True
                rows.started.append((seq.rid, seq.num_cached_tokens))
        launched = self.executor.launch(plan) if not plan.empty else None
        if self._trace is not None and not plan.empty:
            self._trace.step(plan, len(rows.started), self._heavy(plan), len(self.sched.waiting))
        self.sched.update(plan, seqs)
        sampling = [seq for sch, seq in zip(plan.seqs, seqs) if sch.sample]
        for seq in sampling:
            seq.pending += 1
        if self._in_flight is not None:
            self._resolve(rows)  # the previous step, which ran while this one was scheduled
        self._in_flight = (launched, sampling) if launched is not None else None
        self._heavy_in_flight = self._heavy(plan)
        if self._in_flight is not None and (not self.overlap or not self._seqs):
            self._resolve(rows)  # waited for; or every request ended, so nothing of it is news
        self.steps += not plan.empty
        return rows.outputs(self.stats())

    def _heavy(self, plan: StepPlan) -> bool:
        """A step long enough that overlapping it saves little host time and costs much time to first
        token: a request arriving while it runs would miss the step scheduled behind it."""
        return self._light_prefill is not None and plan.prefill_tokens > self._light_prefill

    def _resolve(self, rows: _Rows) -> None:
        """Wait for the step in flight; its tokens join their sequences, which may end."""
        launched, sampling = self._in_flight
        self._in_flight = None
        t0 = time.monotonic()
        sampled = self.executor.finish(launched)
        if self._trace is not None:
            self._trace.waited += time.monotonic() - t0
        ended = False
        for seq, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
            seq.pending -= 1
            if self._seqs.get(seq.rid) is not seq:
                continue  # a row drawn after its request ended or was cancelled: dropped
            finish = seq.append_token(token) or FinishReason.NONE
            ended |= bool(finish)
            rows.token(seq.rid, token, finish, lp)
        if ended:
            for seq in self.sched.remove_finished(waiting_too=self.overlap):
                self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        del self._seqs[seq.rid]
        self._history.discard(seq.rid)

    # ---- checks ----------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        ids, p, cfg, info = request.prompt_ids, request.params, self.cfg, self.info
        if not ids:
            raise InvalidArgument("prompt is empty")
        if len(ids) >= cfg.max_model_len:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) leaves no room for output within "
                                  f"max_model_len {cfg.max_model_len}")
        if len(ids) + p.max_tokens > cfg.max_model_len:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                                  f"max_model_len {cfg.max_model_len}")
        if not self.sched.can_ever_fit(len(ids) + p.max_tokens):
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) does not fit in the "
                                  f"cache ({self.sched.blocks.capacity * self.sched.bs} tokens)")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary 0..{info.vocab_size - 1}")
        pads = ids.count(info.media_pad_id)
        emb = request.image_embeds
        n_rows = 0 if emb is None else emb.shape[0]
        if pads != n_rows:
            raise InvalidArgument(f"the prompt has {pads} image pad positions but image_embeds has {n_rows} rows")
        if emb is not None and (emb.dim() != 2 or emb.shape[1] != info.hidden_size):
            raise InvalidArgument(f"image_embeds: expected [{n_rows}, {info.hidden_size}], got {list(emb.shape)}")


class _Trace:
    """K3_STEP_TRACE: per step, when it was launched (monotonic s), its decode rows, prefill chunks and
    tokens, the requests first scheduled in it, requests added and seconds spent waiting for the
    device since the previous step, the prompts still waiting, and whether it was a heavy step.
    For finding where time to first token goes under a given load (docs/operations.md)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered: the process may end by os._exit
        self.added, self.waited = 0, 0.0
        log.info("step trace: %s", path)

    def step(self, plan: StepPlan, new: int, heavy: bool, waiting: int) -> None:
        self.file.write(json.dumps({
            "t": round(time.monotonic(), 6), "decode": plan.num_decode, "chunks": len(plan.chunks),
            "prefill": plan.prefill_tokens, "new": new, "added": self.added,
            "waited_ms": round(self.waited * 1e3, 3), "waiting": waiting, "heavy": heavy}) + "\n")
        self.added, self.waited = 0, 0.0


def _reads_history(request: Request) -> bool:
    """Its draws read its earlier output ids (penalties, bad words of several tokens)."""
    return request.params.reads_output or any(len(w) > 1 for w in request.bad_word_seqs)


@dataclass
class _Rows:
    """A step's outputs while they are collected."""

    ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    started: list[tuple[int, int]] = field(default_factory=list)
    scheduled_ns: int = 0

    def end(self, rid: int, reason: FinishReason, error: tuple[str, str] | None = None) -> None:
        self.ids.append(rid)
        self.tokens.append(-1)
        self.finish.append(reason)
        if error is not None:
            self.errors[rid] = error

    def token(self, rid: int, token: int, finish: FinishReason, lp: TokenLogprob | None) -> None:
        self.ids.append(rid)
        self.tokens.append(token)
        self.finish.append(finish)
        if lp is not None:
            self.logprobs[rid] = lp

    def outputs(self, stats: EngineStats) -> StepOutputs:
        started = np.array(self.started, dtype=np.int64).reshape(-1, 2)
        return StepOutputs(np.array(self.ids, dtype=np.int64), np.array(self.tokens, dtype=np.int64),
                           np.array(self.finish, dtype=np.int8), self.logprobs, self.errors, started[:, 0].copy(),
                           started[:, 1].astype(np.int32), time.time_ns(), self.scheduled_ns, stats)


@dataclass
class Completed:
    """One request driven to its end by `run_requests` (in-process tools and benchmarks)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish: FinishReason = FinishReason.NONE
    error: tuple[str, str] | None = None
    first_token_s: float = 0.0  # monotonic time of its first and last token
    last_token_s: float = 0.0


def run_requests(core: EngineCore, requests: list[Request], first_id: int = 1) -> list[Completed]:
    """Add every request (ids first_id, first_id + 1, ...), step until all ended; results in order."""
    done = [Completed(r.request_id) for r in requests]
    by_id = dict(enumerate(done, first_id))
    for rid, r in zip(by_id, requests):
        core.add(rid, r)
    live = set(by_id)
    while live:
        out = core.step()
        now = time.monotonic()
        for rid, token, finish in zip(out.ids.tolist(), out.tokens.tolist(), out.finish.tolist()):
            c = by_id[rid]
            if token >= 0:
                c.token_ids.append(token)
                c.first_token_s, c.last_token_s = c.first_token_s or now, now
            if finish:
                c.finish, c.error = FinishReason(finish), out.errors.get(rid)
                live.discard(rid)
    return done


def prefill_cap(prefill_ms: dict[int, dict[int, float]], stall_ms: float,
                decode_ms: float = 0.0) -> tuple[tuple[int, int], ...]:
    """(chunk start, tokens), starts ascending: the prefill tokens a step that decodes may take of
    a chunk that starts at most there. Each is the largest size measured there whose step, with the
    largest decode batch's decode_ms beside it, runs within stall_ms (at least the smallest size:
    prompts must advance), and never more than at an earlier start. () when unmeasured or stall_ms is
    0 (no cap). Counting the decode rows matters: on the H200 a 3,072-token prefill step (38 ms)
    beside 16 decode rows made 42 ms inter-token gaps under a 40 ms stall."""
    if not prefill_ms or not stall_ms:
        return ()
    smallest, caps = min(prefill_ms[0]), []
    for start, row in sorted(prefill_ms.items()):
        n = max([n for n, ms in row.items() if ms + decode_ms <= stall_ms], default=smallest)
        caps.append((start, min(n, caps[-1][1]) if caps else n))
    return tuple(caps)


def describe_cap(cap: tuple[tuple[int, int], ...]) -> str:
    """'2048 (1536 from token 8192, 512 from token 32768)': where the cap changes."""
    changes = [f"{n} from token {start}" for (start, n), (_, before) in zip(cap[1:], cap) if n != before]
    return f"{cap[0][1]}" + (f" ({', '.join(changes)})" if changes else "")
