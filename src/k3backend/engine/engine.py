"""The serving engine: `submit` / `stop` / `abort` / `close` around one owned step-loop thread.

Spec: SERVING.md §5.4–5.10 (sampling, termination, text, streaming, accounting, log-probs), §6
(cancellation), §8.3–8.4 (failure, shutdown). Each step: apply cancellations, admit and prefill
(chunked within `max_num_batched_tokens`), one batched decode forward, sample every row with the
request's own generator, and send each request's event in the step that made it ([STR-7]).

Per-sequence `SequenceCache`s, freed when a request finishes; paged caches come later.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from k3backend.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from k3backend.engine.sampler import make_generator, sample
from k3backend.engine.scheduler import Cancel, Scheduler, Sequence, StepPlan
from k3backend.errors import InvalidArgument, Unavailable
from k3backend.model.cache import ForwardBatch
from k3backend.model.k3 import K3Model
from k3backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SHUTDOWN_ERROR = "server shutting down"

Event = tuple[Sequence, RequestOutput]  # an event and the sequence whose callback receives it


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256  # most sequences in one step
    max_model_len: int = 131072  # prompt + output
    max_num_batched_tokens: int = 8192  # prefill token budget per step (chunked prefill beyond it)
    max_queued_requests: int = 0  # 0 = no limit; beyond it submit raises Unavailable
    step_timeout_s: float = 300.0  # a step running longer makes the engine unhealthy ([HLT-7])

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"EngineConfig.max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"EngineConfig.step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for gauges and counters (§9); counters are totals since the engine started."""

    num_running: int
    num_waiting: int
    healthy: bool
    steps: int
    prompt_tokens_total: int  # prompt tokens of admitted requests ([TOK-3])
    generation_tokens_total: int  # sampled tokens ([TOK-2])
    unhealthy_reason: str | None = None


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """[LP-1]..[LP-3] from the raw fp32 logits [V] (before penalties): rank 1-based, ties to the lower id."""
    lp = torch.log_softmax(logits, dim=-1)
    v = lp[token]
    rank = 1 + int((lp > v).sum()) + int((lp[:token] == v).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.sort(lp, descending=True, stable=True)  # stable: ties keep the lower id first
        top = list(zip(ids[:k].tolist(), vals[:k].tolist()))
    return TokenLogprob(token, float(v), rank, top)


class Engine:
    """Continuous batching over a `K3Model` on one device; callbacks run on the engine thread."""

    def __init__(self, model: K3Model, tokenizer: Tokenizer, cfg: EngineConfig) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.device = model.language_model.lm_head.weight.device
        self._vocab_size = model.cfg.text.vocab_size
        self._hidden_size = model.cfg.text.hidden_size
        self._pad_id = model.cfg.media_placeholder_token_id
        self._sched = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self._cond = threading.Condition()  # guards everything below, the scheduler and Sequence.cancel
        self._by_id: dict[str, list[Sequence]] = {}  # in-flight (queued or running) sequences per id
        self._closing = False
        self._unhealthy: str | None = None
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._steps = self._prompt_tokens = self._generation_tokens = 0
        self._emit_lock = threading.Lock()  # held while calling back; see close()
        self._abandoned = False  # close() gave up on a stuck loop and finished requests itself
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()
        log.info("engine started: max_num_seqs=%d max_model_len=%d max_num_batched_tokens=%d device=%s",
                 cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens, self.device)

    # ---- public API ----------------------------------------------------------------------------

    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        """Validate cheaply and queue; events then arrive on `on_output` from the engine thread."""
        with self._cond:
            self._check_available()
        seq = self._validate(request, on_output)
        with self._cond:
            self._check_available()
            limit = self.cfg.max_queued_requests
            if limit and len(self._sched.waiting) >= limit:
                raise Unavailable(f"request queue is full ({len(self._sched.waiting)} waiting, "
                                  f"max_queued_requests {limit})")
            self._sched.add(seq)
            self._by_id.setdefault(request.request_id, []).append(seq)
            self._cond.notify()

    def stop(self, request_id: str) -> int:
        """[CAN-5]: matching requests finish at the next step boundary, CANCELLED, held text flushed."""
        return self._cancel(request_id, Cancel.STOP)

    def abort(self, request_id: str) -> int:
        """[CAN-1]: matching requests are removed at the next step boundary with a final CANCELLED event."""
        return self._cancel(request_id, Cancel.ABORT)

    def is_healthy(self) -> bool:
        with self._cond:
            return self._health_reason() is None

    def stats(self) -> EngineStats:
        with self._cond:
            reason = self._health_reason()
            return EngineStats(len(self._sched.running), len(self._sched.waiting), reason is None, self._steps,
                               self._prompt_tokens, self._generation_tokens, reason)

    def close(self, timeout: float = 20.0) -> None:
        """Idempotent: stop admitting, end every in-flight request with an ERROR event, join the loop."""
        with self._cond:
            first = not self._closing
            self._closing = True
            self._cond.notify()
        if threading.current_thread() is self._thread:
            return  # called from a callback: the loop ends after this step
        self._thread.join(timeout)
        if self._thread.is_alive():
            # The loop is stuck in a step: answer its requests from here, and have the loop emit nothing more.
            log.error("engine loop did not stop within %.1f s; failing its requests from close()", timeout)
            if not self._emit_lock.acquire(timeout=1.0):
                log.error("engine loop is stuck inside an on_output callback; its requests get no final event")
                return
            try:
                self._abandoned = True
            finally:
                self._emit_lock.release()
            with self._cond:
                seqs = self._take_all()
            self._finish_all(seqs, SHUTDOWN_ERROR, force=True)
        elif first:
            log.info("engine closed after %d steps", self._steps)

    # ---- submit helpers ------------------------------------------------------------------------

    def _check_available(self) -> None:
        if self._closing:
            raise Unavailable(f"engine is closed ({SHUTDOWN_ERROR})")
        reason = self._health_reason()
        if reason is not None:
            raise Unavailable(f"engine is not healthy ({reason})")

    def _health_reason(self) -> str | None:
        if self._unhealthy is not None:
            return self._unhealthy
        if self._step_started is not None:
            running = time.monotonic() - self._step_started
            if running > self.cfg.step_timeout_s:
                return f"engine step made no progress for {running:.0f} s (step_timeout_s {self.cfg.step_timeout_s:g})"
        return None

    def _validate(self, request: Request, on_output: Callable[[RequestOutput], None]) -> Sequence:
        ids, p = request.prompt_ids, request.params
        if not ids:
            raise InvalidArgument("prompt is empty")
        if len(ids) + p.max_tokens > self.cfg.max_model_len:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                                  f"max_model_len {self.cfg.max_model_len}")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self._vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary 0..{self._vocab_size - 1}")
        pads = ids.count(self._pad_id)
        emb = request.image_embeds
        rows = 0 if emb is None else emb.shape[0]
        if pads != rows:
            raise InvalidArgument(f"the prompt has {pads} image pad positions but image_embeds has {rows} rows")
        if emb is not None and (emb.dim() != 2 or emb.shape[1] != self._hidden_size):
            raise InvalidArgument(f"image_embeds: expected [{rows}, {self._hidden_size}], got {list(emb.shape)}")
        try:
            return Sequence.create(request, on_output, self.tokenizer)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e

    def _cancel(self, request_id: str, mode: Cancel) -> int:
        with self._cond:
            seqs = self._by_id.get(request_id, [])
            for seq in seqs:
                if seq.cancel is None or mode is Cancel.ABORT:
                    seq.cancel = mode
            if seqs:
                self._cond.notify()
            return len(seqs)

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closing or self._sched.waiting or self._sched.running):
                        self._cond.wait()
                    if self._closing:
                        seqs = self._take_all()
                        break
                self._step()
            self._finish_all(seqs, SHUTDOWN_ERROR)
        except BaseException as e:  # noqa: BLE001 - the loop must answer every request whatever failed
            reason = f"engine step failed: {type(e).__name__}: {e}"
            log.exception("engine failed; every in-flight request gets an error")
            with self._cond:
                self._unhealthy = reason
                self._step_started = None
                seqs = self._take_all()
            self._finish_all(seqs, reason)

    def _step(self) -> None:
        with self._cond:
            cancelled = self._sched.pop_cancelled()
            for seq in cancelled:
                self._forget(seq)
            plan = self._sched.schedule()
            self._step_started = time.monotonic()
        self._emit([self._end(s, FinishReason.CANCELLED, flush=s.cancel is Cancel.STOP) for s in cancelled])
        events = self._run(plan) if not plan.empty else []
        with self._cond:
            self._sched.remove_finished()
            for seq, out in events:
                if out.finished:
                    self._forget(seq)
            self._steps += not plan.empty
            self._step_started = None
        self._emit(events)

    def _run(self, plan: StepPlan) -> list[Event]:
        """Forward the plan and sample one token for every sequence that has logits this step."""
        now = time.time_ns()
        for seq in plan.admitted:
            seq.cache = self.model.new_cache()
            seq.generator = make_generator(seq.request.params.seed)  # at admission ([SMP-7])
            seq.first_scheduled_time_ns = now
        sampled = [c.seq for c in plan.prefill if c.last] + plan.decode
        logits = self._forward(plan)  # [len(sampled), V] fp32 on the host: the step's one sync
        events = [e for row, seq in zip(logits, sampled)
                  if not seq.finished and (e := self._sample(seq, row)) is not None]  # finished: by close()
        with self._cond:
            self._prompt_tokens += sum(s.num_prompt_tokens for s in plan.admitted)
            self._generation_tokens += len(sampled)
        return events

    @torch.inference_mode()
    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Prefill chunks in one flat forward, then one decode forward; logits rows in `sampled` order."""
        lm = self.model.language_model
        parts = []
        if plan.prefill:
            lens = [c.end - c.start for c in plan.prefill]
            ids = torch.tensor([t for c in plan.prefill for t in c.seq.request.prompt_ids[c.start:c.end]],
                               dtype=torch.long, device=self.device)
            embeds = [self.model.embed(chunk_ids, self._image_rows(c.seq, c.start, c.end))
                      for c, chunk_ids in zip(plan.prefill, ids.split(lens))]
            ends = torch.tensor(lens).cumsum(0) - 1
            rows = ends[torch.tensor([c.last for c in plan.prefill])].to(self.device)
            batch = ForwardBatch(lens, [c.seq.cache for c in plan.prefill])
            parts.append(lm(batch=batch, inputs_embeds=torch.cat(embeds), logits_rows=rows))
        if plan.decode:
            # Output tokens are embedded as plain tokens: a sampled <|media_pad|> has no image row.
            ids = torch.tensor([s.output_ids[-1] for s in plan.decode], dtype=torch.long, device=self.device)
            parts.append(lm(ids, ForwardBatch([1] * len(plan.decode), [s.cache for s in plan.decode])))
        return torch.cat(parts).float().cpu()

    def _image_rows(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """The image rows of the media-pad positions in prompt[start:end], in order."""
        n = seq.request.prompt_ids[start:end].count(self._pad_id)
        if not n:
            return None
        first = seq.num_pads_computed
        seq.num_pads_computed += n
        return seq.request.image_embeds[first:first + n].to(self.device)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> Event | None:
        """[SMP-6] with the request's generator, then [STP-1]; the event to send now, if any ([STR-3])."""
        p, req = seq.request.params, seq.request
        token = sample(logits, p, seq.generator, prompt_ids=req.prompt_ids, output_ids=seq.output_ids,
                       eos_ids=seq.mask_eos, bad_word_seqs=req.bad_word_seqs)
        lp = token_logprob(logits, token, p.logprobs) if p.logprobs is not None else None  # [LP-4]
        finish = seq.append_token(token, lp)
        if finish is not None:
            return self._end(seq, finish)
        out = seq.take_output()
        return None if out is None else (seq, out)

    # ---- finishing -----------------------------------------------------------------------------

    def _end(self, seq: Sequence, reason: FinishReason, *, flush: bool = True, error: str | None = None) -> Event:
        out = seq.take_output(reason, flush=flush, error=error)
        assert out is not None
        seq.free()
        return seq, out

    def _forget(self, seq: Sequence) -> None:
        """Under the lock: `seq` is no longer in flight, so stop()/abort() no longer match it."""
        same = self._by_id.get(seq.request_id, [])
        if seq in same:
            same.remove(seq)
        if not same:
            self._by_id.pop(seq.request_id, None)

    def _take_all(self) -> list[Sequence]:
        """Under the lock: every in-flight sequence, removed from the scheduler and the id index."""
        seqs = self._sched.pop_all()
        self._by_id.clear()
        return seqs

    def _finish_all(self, seqs: list[Sequence], error: str, *, force: bool = False) -> None:
        events = [self._end(s, FinishReason.ERROR, flush=False, error=error) for s in seqs if not s.final_sent]
        self._emit(events, force=force)

    def _emit(self, events: list[Event], *, force: bool = False) -> None:
        """Call back in order; a raising callback is logged and never stops the loop."""
        if not events:
            return
        with self._emit_lock:
            if self._abandoned and not force:
                return
            for seq, out in events:
                seq.final_sent = out.finished
                try:
                    seq.on_output(out)
                except Exception:  # noqa: BLE001 - a client callback must not kill the engine
                    log.exception("on_output callback of request %r raised", seq.request_id)
