"""Step results -> `RequestOutput` events, on the engine's output thread (SERVING.md §5.5-5.9).

The engine thread only samples and applies the id-level termination checks of [STP-1] (stop
token ids, EOS, max_tokens). Everything that costs Python time per token runs here instead:
detokenization, stop strings ([STP-3]), hold-back ([STR-6]) and event building. On a GPU the
engine thread is then free to launch the next step while this thread works on the last one.

A stop string is decided here, so the engine learns of it one step late: `on_finished(id)`
tells it to drop the sequence (as it does for a request whose processing here failed), and tokens it sampled meanwhile are discarded, never sent or
counted ([STP-3]: the token that completed the match is the last one generated).

Messages arrive in one FIFO queue, so a request's `Opened` precedes its `Progress` items, and
exactly one final event is emitted per request ([STR-9]).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from k3backend.detokenizer import IncrementalDetokenizer
from k3backend.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from k3backend.errors import Internal
from k3backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]


@dataclass
class Opened:
    """A request was admitted to the scheduler: its stream of events starts."""

    key: str  # engine id
    request: Request
    on_output: OnOutput


@dataclass
class Progress:
    """Tokens sampled for one request in one step; `finish` when the engine ended it by id ([STP-1] 1, 3)."""

    key: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    time_ns: int
    first_scheduled_time_ns: int = 0
    num_cached_tokens: int = 0
    finish: FinishReason | None = None
    terminal: bool = False  # the last token is the EOS / stop id that ended it: no text ([STP-2])


@dataclass
class Closed:
    """The engine removed a request: stopped ([CAN-5], flush), aborted, failed or shut down."""

    key: str
    reason: FinishReason
    error: Exception | None = None
    flush: bool = True


@dataclass
class Rejected:
    """A request that never reached the scheduler: its only event is this final one."""

    request_id: str
    on_output: OnOutput
    reason: FinishReason
    error: Exception | None = None
    arrival_time_ns: int = 0


Message = Opened | Progress | Closed | Rejected


@dataclass(eq=False)
class _Stream:
    """Per-request output state; touched only by the output thread."""

    request: Request
    on_output: OnOutput
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_text: str = ""
    pending_reasoning: str = ""
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    num_cached_tokens: int = 0


class OutputProcessor:
    """Owns the output thread; `put()` is called by the engine, events go to each request's callback."""

    def __init__(self, tokenizer: Tokenizer, on_finished: Callable[[str], None]) -> None:
        self._tok = tokenizer
        self._on_finished = on_finished
        self._queue: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._loop, name="k3-engine-output", daemon=True)
        self._thread.start()

    @staticmethod
    def detokenizer(request: Request, tokenizer: Tokenizer) -> IncrementalDetokenizer:
        """The request's detokenizer; raises ValueError for options it rejects (an empty stop string)."""
        p = request.params
        return IncrementalDetokenizer(tokenizer, skip_special_tokens=p.skip_special_tokens, stop_strings=p.stop,
                                      include_stop_str_in_output=p.include_stop_str_in_output,
                                      split_reasoning=request.split_reasoning, in_think=request.in_think)

    def put(self, messages: list[Message]) -> None:
        if messages:
            self._queue.put(messages)

    def close(self, timeout: float) -> bool:
        """Handle what is queued, then stop the thread. False if it did not stop within `timeout`."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while (messages := self._queue.get()) is not None:
            for msg in messages:
                try:
                    self._handle(msg)
                except Exception as e:  # noqa: BLE001 - one request's defect must not stop the others
                    self._fail(msg, e)

    def _fail(self, msg: Message, exc: Exception) -> None:
        """End the request whose message raised: one final INTERNAL event naming the cause, and the
        engine drops it at the next step boundary; later messages for it are ignored."""
        key = getattr(msg, "key", None)
        s = self._streams.pop(key, None)
        on_output = s.on_output if s is not None else getattr(msg, "on_output", None)
        request_id = s.request.request_id if s is not None else getattr(msg, "request_id", key)
        log.error("output processing failed for %r; it ends with INTERNAL", key or request_id, exc_info=exc)
        if key is not None:
            self._on_finished(key)
        if on_output is None or (s is None and not isinstance(msg, Opened)):
            return  # nothing is open for it here (already finished): its final event was sent
        if isinstance(msg, Opened):
            request_id = msg.request.request_id
        error = Internal(f"output processing failed: {type(exc).__name__}: {exc}")
        _call(on_output, RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, error=error))

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Opened):
            self._streams[msg.key] = _Stream(msg.request, msg.on_output, self.detokenizer(msg.request, self._tok))
        elif isinstance(msg, Rejected):
            out = RequestOutput(msg.request_id, finished=True, finish_reason=msg.reason, error=msg.error,
                                arrival_time_ns=msg.arrival_time_ns)
            _call(msg.on_output, out)
        elif (s := self._streams.get(msg.key)) is None:
            return  # already finished here (a stop string): later news from the engine is moot
        elif isinstance(msg, Progress):
            self._progress(msg, s)
        else:
            self._finish(msg.key, s, msg.reason, error=msg.error, flush=msg.flush)

    def _progress(self, msg: Progress, s: _Stream) -> None:
        p = s.request.params
        s.first_scheduled_time_ns = s.first_scheduled_time_ns or msg.first_scheduled_time_ns
        s.num_cached_tokens = msg.num_cached_tokens or s.num_cached_tokens
        s.first_token_time_ns = s.first_token_time_ns or msg.time_ns
        s.last_token_time_ns = msg.time_ns
        last = len(msg.token_ids) - 1
        for i, token in enumerate(msg.token_ids):
            s.num_tokens += 1
            s.pending_ids.append(token)
            if msg.logprobs is not None:
                s.pending_logprobs.append(msg.logprobs[i])
            if msg.terminal and i == last:
                break  # [STP-2]: the terminating token produces no text
            delta = s.detok.push([token], check_stops=s.num_tokens >= p.min_tokens)  # [STP-5]
            s.pending_text += delta.text
            s.pending_reasoning += delta.reasoning
            if delta.stopped:
                self._on_finished(msg.key)
                self._finish(msg.key, s, FinishReason.STOP)
                return
        if msg.finish is not None:
            self._finish(msg.key, s, msg.finish)
        elif s.pending_text or s.pending_reasoning:  # [STR-3]: otherwise carry the ids into the next event
            _call(s.on_output, self._event(s, None))

    def _finish(self, key: str, s: _Stream, reason: FinishReason, *, error: Exception | None = None,
                flush: bool = True) -> None:
        del self._streams[key]
        if error is None and flush:
            delta = s.detok.finish()  # [STR-6]: held text that is not part of a stop match
            s.pending_text += delta.text
            s.pending_reasoning += delta.reasoning
        _call(s.on_output, self._event(s, reason, error))

    @staticmethod
    def _event(s: _Stream, finish: FinishReason | None, error: Exception | None = None) -> RequestOutput:
        r = s.request
        out = RequestOutput(
            request_id=r.request_id, text=s.pending_text, reasoning=s.pending_reasoning, token_ids=s.pending_ids,
            logprobs=s.pending_logprobs if r.params.logprobs is not None else None,
            finished=finish is not None, finish_reason=finish, error=error, num_input_tokens=len(r.prompt_ids),
            num_cached_tokens=s.num_cached_tokens, arrival_time_ns=int(r.arrival_time * 1e9),
            first_scheduled_time_ns=s.first_scheduled_time_ns, first_token_time_ns=s.first_token_time_ns,
            last_token_time_ns=s.last_token_time_ns)
        s.pending_ids, s.pending_logprobs, s.pending_text, s.pending_reasoning = [], [], "", ""
        return out


def _call(on_output: OnOutput, out: RequestOutput) -> None:
    try:
        on_output(out)
    except Exception:  # noqa: BLE001 - a client callback must not stop other requests' output
        log.exception("on_output callback of request %r raised", out.request_id)
