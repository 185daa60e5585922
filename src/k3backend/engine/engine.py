"""The serving engine: `add` / `stop` / `abort` / `close` around three owned threads.

Spec: SERVING.md §5.4-5.10 (sampling, termination, text, streaming, accounting, log-probs), §6
(cancellation, the stop convention and its tombstones), §8.3-8.4 (failure, shutdown).

Threads, each with one job:
- admission: runs each request's `prepare()` (tokenization, rendering: off the Triton thread),
  validates it and hands it to the scheduler; also the watchdog of a stuck step ([HLT-7]);
- loop: each step applies cancellations, schedules, forwards, samples, and applies the id-level
  termination checks;
- output (`engine.output`): detokenization, stop strings, events.

The request registry lives here and only here: every request from `add()` until its final
event is decided, whatever its phase (being prepared, queued, running), keyed by the engine's
id and by the client's id, with the stop tombstones beside it under the same lock. So a stop
finds its target at every interleaving ([CAN-5]) and a tombstone is consumed exactly once ([CAN-7]).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from k3backend.engine.config import EngineConfig
from k3backend.engine.output import Closed, Message, Opened, OutputProcessor, Progress, Rejected
from k3backend.engine.plan import StepPlan
from k3backend.engine.request import FinishReason, Request, RequestOutput
from k3backend.engine.runner import Executor
from k3backend.engine.sampler import Sampled
from k3backend.engine.scheduler import Cancel, Scheduler, SchedulerConfig, Sequence
from k3backend.engine.workers import WorkerFailure
from k3backend.errors import Cancelled, InvalidArgument, Unavailable
from k3backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SHUTDOWN_ERROR = "server shutting down"
WATCHDOG_PERIOD_S = 0.5  # how often the admission thread checks for a stuck step


MAX_TOMBSTONES = 65536  # unmatched stop ids remembered at once; the oldest go first beyond it


def _digest(client_id: str) -> bytes:
    """16 bytes per remembered stop id, however long the id (ids are client-chosen)."""
    return hashlib.blake2b(client_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for gauges and counters (§9); counters are totals since the engine started."""

    num_running: int
    num_waiting: int  # being prepared or queued
    healthy: bool
    steps: int
    kv_cache_usage: float = 0.0  # fraction of MLA blocks held by running sequences
    state_slots_usage: float = 0.0  # fraction of KDA slots held by running sequences
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens served from the cache
    workers_alive: int = 1
    unhealthy_reason: str | None = None


class Engine:
    """Continuous batching over an `Executor` (the model on one or several ranks). `close()` is idempotent."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer, cfg: EngineConfig) -> None:
        self.executor, self.tokenizer, self.cfg = executor, tokenizer, cfg
        self._info = executor.info
        self._sched = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefix_caching,
                                                cfg.snapshot_interval), executor.capacity)
        self._cond = threading.Condition()  # guards the registry, the scheduler, the flags below
        self._by_key: dict[str, Sequence] = {}  # every request from add() until it leaves the engine
        self._by_client: dict[str, list[Sequence]] = {}
        # [CAN-7] digest of a client id -> expiry (monotonic), oldest first: bounded in count and bytes
        self._tombstones: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._keys = itertools.count()
        self._accepting = True  # False once close() began: add() refuses
        self._stopping = False  # the loop and admission end everything
        self._drain_cut = threading.Event()  # ends a close()'s drain early (a second close())
        self._close_lock = threading.Lock()
        self._closed = False
        self._unhealthy: str | None = None
        self._abandoned = False  # the loop's requests were answered elsewhere: it must emit nothing
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._steps = 0
        self._out = OutputProcessor(tokenizer, self._finished_by_output)
        self._admit_q: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._admit_loop, name="k3-engine-admit", daemon=True),
                         threading.Thread(target=self._loop, name="k3-engine", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("engine started: max_num_seqs=%d max_model_len=%d max_num_batched_tokens=%d prefix_caching=%s",
                 cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens, cfg.prefix_caching)

    # ---- public API ----------------------------------------------------------------------------

    def add(self, client_id: str, prepare: Callable[[], Request],
            on_output: Callable[[RequestOutput], None]) -> str:
        """Register a request now and prepare it on the admission thread; returns the engine's id.

        Events arrive on `on_output` from the output thread. A request whose client id has a live
        tombstone ends at once, cancelled, without `prepare` being called ([CAN-7]). Raises
        Unavailable when the engine is closing, failed, or its queue is full.
        """
        with self._cond:
            self._check_available()
            limit = self.cfg.max_queued_requests
            waiting = len(self._by_key) - len(self._sched.running)
            if limit and waiting >= limit:
                raise Unavailable(f"request queue is full ({waiting} waiting, max_queued_requests {limit})")
            key = f"{client_id}#{next(self._keys)}"
            if self._take_tombstone(client_id):
                self._out.put([Rejected(client_id, on_output, FinishReason.CANCELLED,
                                        arrival_time_ns=time.time_ns())])
                return key
            seq = Sequence(key, client_id, on_output, prepare)
            self._by_key[key] = seq
            self._by_client.setdefault(client_id, []).append(seq)
        self._admit_q.put(seq)
        return key

    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> str:
        """`add()` for a request that is already built (tests, benchmarks, the CLI)."""
        return self.add(request.request_id, lambda: request, on_output)

    def stop(self, client_id: str) -> int:
        """[CAN-5]: every in-flight request with this client id ends at the next step boundary,
        cancelled, held text flushed. With none in flight, leave a tombstone ([CAN-7]). Returns
        the number of requests matched."""
        with self._cond:
            seqs = self._by_client.get(client_id, [])
            for seq in seqs:
                seq.cancel = seq.cancel or Cancel.STOP
            if not seqs and self.cfg.stop_tombstone_ttl_s > 0:
                key = _digest(client_id)
                self._tombstones[key] = time.monotonic() + self.cfg.stop_tombstone_ttl_s
                self._tombstones.move_to_end(key)  # expiries stay in order: the TTL is one constant
                while len(self._tombstones) > MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
            self._cond.notify()
            return len(seqs)

    def abort(self, key: str) -> None:
        """[CAN-1]: the request ends at the next step boundary with a CANCELLED error."""
        with self._cond:
            seq = self._by_key.get(key)
            if seq is not None and seq.cancel is not Cancel.DONE:
                seq.cancel = Cancel.ABORT
                self._cond.notify()

    def is_healthy(self) -> bool:
        with self._cond:
            return self._health_reason() is None

    def stats(self) -> EngineStats:
        with self._cond:
            reason = self._health_reason()
            running = len(self._sched.running)
            s = self._sched
            return EngineStats(running, len(self._by_key) - running, reason is None, self._steps, s.blocks.usage,
                               s.slots.usage, s.num_preemptions, s.prefix_queries, s.prefix_hits,
                               self.executor.workers_alive, reason)

    def close(self, timeout: float = 20.0, drain_s: float = 0.0) -> None:
        """Refuse new requests; let in-flight ones run up to `drain_s`; end the rest with
        UNAVAILABLE ("server shutting down"); join the threads within about `timeout` ([HLT-9]).

        Idempotent; a call during another's drain ends that drain now and returns once the
        first call is done.
        """
        with self._cond:
            self._accepting = False
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not self._drain_cut.is_set() and not self._idle():
            self._drain_cut.wait(0.05)
        self._drain_cut.set()
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._shut_down(timeout)

    def _shut_down(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._admit_q.put(None)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.error("engine loop did not stop within %.1f s; failing its requests from close()", timeout)
            self._abandon(Unavailable(SHUTDOWN_ERROR))
        if not self._out.close(max(1.0, end - time.monotonic())):
            log.error("engine output thread is stuck in an on_output callback")
        self.executor.close(timeout=max(1.0, end - time.monotonic()))
        log.info("engine closed after %d steps", self._steps)

    # ---- admission -----------------------------------------------------------------------------

    def _check_available(self) -> None:
        if not self._accepting:
            raise Unavailable(f"engine is closed ({SHUTDOWN_ERROR})")
        reason = self._health_reason()
        if reason is not None:
            raise Unavailable(f"engine is not healthy ({reason})")

    def _take_tombstone(self, client_id: str) -> bool:
        """Under the lock: consume a live tombstone of this id, dropping the expired ones first."""
        now = time.monotonic()
        while self._tombstones and next(iter(self._tombstones.values())) < now:
            self._tombstones.popitem(last=False)
        return self._tombstones.pop(_digest(client_id), None) is not None

    def _admit_loop(self) -> None:
        while True:
            try:
                seq = self._admit_q.get(timeout=WATCHDOG_PERIOD_S)
            except queue.Empty:
                self._check_stuck()
                continue
            if seq is None:
                break
            self._admit(seq)
        with self._cond:  # close(): whatever is still queued here was never admitted
            leftover = [s for s in self._by_key.values() if s.request is None]
            for seq in leftover:
                self._forget(seq)
        self._out.put([Rejected(s.client_id, s.on_output, FinishReason.ERROR, Unavailable(SHUTDOWN_ERROR))
                       for s in leftover])

    def _admit(self, seq: Sequence) -> None:
        error: Exception | None = None
        request = None
        if seq.cancel is None:
            try:
                request = seq.prepare()
                self._validate(request)
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's final event
                error = e
        with self._cond:
            if seq.key not in self._by_key:
                return  # answered already (close() gave up on the loop)
            if error is None and seq.cancel is None and self._stopping:
                error = Unavailable(SHUTDOWN_ERROR)
            if error is not None or seq.cancel is not None:
                self._forget(seq)
                if error is not None:
                    msg = Rejected(seq.client_id, seq.on_output, FinishReason.ERROR, error)
                else:  # stopped or aborted while being prepared
                    msg = Rejected(seq.client_id, seq.on_output, FinishReason.CANCELLED,
                                   Cancelled("request cancelled by client") if seq.cancel is Cancel.ABORT else None)
                self._out.put([msg])
                return
            seq.bind(request, self._info.media_pad_id)
            self._out.put([Opened(seq.key, request, seq.on_output)])  # before the loop can see it
            self._sched.add(seq)
            self._cond.notify()

    def _validate(self, request: Request) -> None:
        ids, p = request.prompt_ids, request.params
        if not ids:
            raise InvalidArgument("prompt is empty")
        if len(ids) >= self.cfg.max_model_len:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) leaves no room for output within "
                                  f"max_model_len {self.cfg.max_model_len}")
        if len(ids) + p.max_tokens > self.cfg.max_model_len:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                                  f"max_model_len {self.cfg.max_model_len}")
        if not self._sched.can_ever_fit(len(ids) + p.max_tokens):
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) does not fit in the "
                                  f"cache ({self._sched.blocks.capacity * self._sched.bs} tokens)")
        info = self._info
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary 0..{info.vocab_size - 1}")
        pads = ids.count(info.media_pad_id)
        emb = request.image_embeds
        rows = 0 if emb is None else emb.shape[0]
        if pads != rows:
            raise InvalidArgument(f"the prompt has {pads} image pad positions but image_embeds has {rows} rows")
        if emb is not None and (emb.dim() != 2 or emb.shape[1] != info.hidden_size):
            raise InvalidArgument(f"image_embeds: expected [{rows}, {info.hidden_size}], got {list(emb.shape)}")
        try:
            OutputProcessor.detokenizer(request, self.tokenizer)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e

    # ---- failure -------------------------------------------------------------------------------

    def _health_reason(self) -> str | None:
        if self._unhealthy is not None:
            return self._unhealthy
        if self._step_started is not None:
            running = time.monotonic() - self._step_started
            if running > self.cfg.step_timeout_s:
                return f"engine step made no progress for {running:.0f} s (step_timeout_s {self.cfg.step_timeout_s:g})"
        return None

    def _check_stuck(self) -> None:
        """[HLT-7]: a step past step_timeout_s, or a dead worker while the engine idles, fails the
        engine; its requests are answered from here."""
        with self._cond:
            if self._unhealthy is not None:
                return
            reason = self._health_reason() if self._step_started is not None else None
        reason = reason or self.executor.health()
        if reason is not None:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        """The engine cannot serve: mark it, answer every request with UNAVAILABLE, stop the workers."""
        with self._cond:
            if self._unhealthy is not None:
                return
            self._unhealthy = reason
            self._step_started = None
        log.error("engine failed: %s", reason)
        self._abandon(Unavailable(f"engine failed: {reason}"))
        self.executor.close(timeout=2.0)

    def _abandon(self, error: Exception) -> None:
        """End every request from this thread; the loop, if it ever returns, emits nothing more."""
        with self._cond:
            self._abandoned = True
            seqs = self._take_all()
        self._out.put(self._fail_messages(seqs, error))

    def _fail_messages(self, seqs: list[Sequence], error: Exception) -> list[Message]:
        return [Closed(s.key, FinishReason.ERROR, error) if s.request is not None
                else Rejected(s.client_id, s.on_output, FinishReason.ERROR, error) for s in seqs]

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._sched.waiting or self._sched.running):
                        self._cond.wait()
                    if self._stopping or self._abandoned:
                        break
                self._step()
            with self._cond:  # requests still being prepared are the admission thread's to answer
                seqs = [] if self._abandoned else self._take_all(prepared_only=True)
            self._out.put(self._fail_messages(seqs, Unavailable(SHUTDOWN_ERROR)))
        except BaseException as e:  # noqa: BLE001 - the loop must answer every request whatever failed
            if not isinstance(e, WorkerFailure):
                log.exception("engine step failed; every in-flight request gets an error")
            self._fail(str(e) if isinstance(e, WorkerFailure) else f"engine step failed: {type(e).__name__}: {e}")

    def _step(self) -> None:
        """One step. Sequences leave the registry only once their messages are queued, so a step
        that raises leaves every request it had in hand for `_abandon` to answer."""
        with self._cond:
            cancelled = self._sched.pop_cancelled()
            plan, seqs = self._sched.schedule()
            self._step_started = time.monotonic()
        messages: list[Message] = [self._cancel_message(s) for s in cancelled if s.cancel is not Cancel.DONE]
        now = time.time_ns()
        for seq in seqs:
            seq.first_scheduled_time_ns = seq.first_scheduled_time_ns or now
        sampled = self.executor.execute(plan) if not plan.empty else Sampled([], [])
        with self._cond:
            self._step_started = None
            if self._abandoned:
                return
            self._sched.update(plan, seqs)
            messages += self._progress(plan, seqs, sampled)
            for seq in cancelled + self._sched.remove_finished():
                self._forget(seq)
            self._steps += not plan.empty
            self._out.put(messages)

    def _progress(self, plan: StepPlan, seqs: list[Sequence], sampled: Sampled) -> list[Message]:
        """The id-level checks of [STP-1] for every sampled token, as output messages."""
        now = time.time_ns()
        rows = [seq for sch, seq in zip(plan.seqs, seqs) if sch.sample]
        messages: list[Message] = []
        for seq, token, lp in zip(rows, sampled.token_ids, sampled.logprobs):
            finish = seq.append_token(token)
            messages.append(Progress(seq.key, [token], None if lp is None else [lp], now,
                                     first_scheduled_time_ns=seq.first_scheduled_time_ns,
                                     num_cached_tokens=seq.num_cached_tokens, finish=finish,
                                     terminal=finish is FinishReason.STOP))
        return messages

    @staticmethod
    def _cancel_message(seq: Sequence) -> Closed:
        if seq.cancel is Cancel.ABORT:
            return Closed(seq.key, FinishReason.CANCELLED, Cancelled("request cancelled by client"), flush=False)
        return Closed(seq.key, FinishReason.CANCELLED)  # [CAN-5]: held text flushed

    # ---- registry ------------------------------------------------------------------------------

    def _finished_by_output(self, key: str) -> None:
        """The output thread ended a request (a stop string, or its processing failed): drop it at the
        next step boundary."""
        with self._cond:
            seq = self._by_key.get(key)
            if seq is not None:
                seq.cancel = Cancel.DONE
                self._cond.notify()

    def _idle(self) -> bool:
        with self._cond:
            return not self._by_key

    def _forget(self, seq: Sequence) -> None:
        """Under the lock: `seq` is no longer in flight, so stop()/abort() no longer match it."""
        self._by_key.pop(seq.key, None)
        same = self._by_client.get(seq.client_id, [])
        if seq in same:
            same.remove(seq)
        if not same:
            self._by_client.pop(seq.client_id, None)

    def _take_all(self, prepared_only: bool = False) -> list[Sequence]:
        """Under the lock: every in-flight sequence (or every admitted one), removed from the
        scheduler and the registry."""
        seqs = [s for s in self._by_key.values() if s.request is not None or not prepared_only]
        self._sched.pop_all()
        for seq in seqs:
            self._forget(seq)
        return seqs
