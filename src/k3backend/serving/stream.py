"""One request from `execute()` to its final response: `RequestStream` (SERVING.md §5.5-5.10, §6).

The stream is the only place that holds a request's serving state: its parsed inputs, its
response sender, the engine id it runs under, its detokenizer (text, reasoning, stop strings,
hold-back), its response builder, its cancellation and its metrics bookkeeping. The engine core
speaks ids; the stream turns each step's ids into at most one response.

Threads: the prepare thread calls `prepare()`; from then on only the response thread touches the
stream (it owns the sender: nothing is sent or asked `is_cancelled()` after the final response).
The engine learns of a stop string one step late, so tokens that arrive after the stream ended
are dropped, never sent or counted ([STP-3]: the token that completed the match is the last one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from k3backend.detokenizer import IncrementalDetokenizer
from k3backend.engine.request import FinishReason, Request, TokenLogprob
from k3backend.errors import Cancelled, Internal, InvalidArgument, from_code
from k3backend.serving.params import ParsedRequest
from k3backend.serving.prompt import build_request, ends_in_think
from k3backend.serving.responses import RequestOutput, ResponseBuilder
from k3backend.tokenizer import Tokenizer


class Cancel(str, Enum):
    STOP = "stop"  # the stop convention ([CAN-5]): held-back text flushed, finish_reason cancelled
    ABORT = "abort"  # a direct client cancel ([CAN-1]): the request ends with a CANCELLED error


@dataclass(eq=False)
class RequestStream:
    """See the module docstring. `done` once the final response is decided."""

    client_id: str
    sender: Any
    parsed: ParsedRequest
    tokenizer: Tokenizer
    arrival: float = field(default_factory=time.monotonic)
    rid: int = 0  # the engine's id once added (0: not yet)
    cancel: Cancel | None = None
    done: bool = False
    started: bool = False  # scheduled by the engine at least once
    request: Request | None = None
    num_tokens: int = 0  # output tokens that count (none after a stop string)
    last_poll: float = 0.0  # monotonic time of its last is_cancelled() check
    first_sent: float | None = None  # monotonic time of its first data response
    first_token_ns: int = 0  # wall clock of its first and latest token
    last_token_ns: int = 0
    metrics_token_ns: int = 0  # last token time covered by a time-per-output-token observation
    finish_reason: FinishReason | None = None  # how it ended, once done (None for an error)
    _sent_tokens: int = 0  # tokens covered by the responses sent so far
    _detok: IncrementalDetokenizer | None = None
    _builder: ResponseBuilder | None = None
    _delta: RequestOutput | None = None  # what arrived since the last response
    _sent_final: bool = False

    # ---- prepare thread -------------------------------------------------------------------------

    def prepare(self, *, eos_ids: tuple[int, ...], max_model_len: int, default_max_tokens: int) -> Request:
        """Tokenize and render ([PRM-2], [PRM-4]), expand images, build the detokenizer (it refuses
        bad stop strings) and the response builder; returns the engine's request."""
        parsed, tok = self.parsed, self.tokenizer
        request, echo = build_request(parsed, tok, eos_ids=eos_ids, max_model_len=max_model_len,
                                      default_max_tokens=default_max_tokens)
        p = request.params
        try:
            self._detok = IncrementalDetokenizer(
                tok, skip_special_tokens=p.skip_special_tokens, stop_strings=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                split_reasoning=parsed.outputs.return_reasoning, in_think=ends_in_think(request.prompt_ids, tok))
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        self._builder = ResponseBuilder(parsed, echo, num_input_tokens=len(request.prompt_ids), tokenizer=tok)
        self.request = request
        return request

    # ---- response thread: the engine's news ------------------------------------------------------

    def on_started(self, time_ns: int, num_cached: int) -> None:
        self.started = True
        d = self._open_delta()
        d.first_scheduled_time_ns = d.first_scheduled_time_ns or time_ns
        d.num_cached_tokens = num_cached

    def on_token(self, token: int, logprob: TokenLogprob | None, finish: FinishReason, time_ns: int) -> bool:
        """One sampled token; True when it completed a stop string (the engine must drop the request)."""
        if self.done:
            return False  # sampled after the stream ended (a stop string): neither sent nor counted
        d = self._open_delta()
        self.num_tokens += 1
        d.token_ids.append(token)
        if logprob is not None:
            d.logprobs = (d.logprobs or []) + [logprob]
        d.first_token_time_ns = d.first_token_time_ns or time_ns
        d.last_token_time_ns = time_ns
        self.first_token_ns = self.first_token_ns or time_ns
        self.last_token_ns = time_ns
        if finish is FinishReason.STOP:  # [STP-2]: the EOS / stop id that ended it produces no text
            self._end(FinishReason.STOP)
            return False
        delta = self._detok.push([token], check_stops=self.num_tokens >= self.request.params.min_tokens)  # [STP-5]
        d.text += delta.text
        d.reasoning += delta.reasoning
        if delta.stopped:
            self._end(FinishReason.STOP, flush=False)
            return True
        if finish is FinishReason.LENGTH:
            self._end(FinishReason.LENGTH)
        return False

    def on_end(self, finish: FinishReason, error: tuple[str, str] | None) -> None:
        """The engine ended the request without a token: cancelled (this side asked) or failed."""
        if self.done:
            return  # it ended here first (a stop string, a failure): the engine only confirms
        if finish is FinishReason.ERROR:
            self.fail(from_code(*error) if error else Internal("the engine ended the request with an error"))
        elif self.cancel is Cancel.ABORT:
            self.fail(Cancelled("request cancelled by client"))
        else:
            self._end(FinishReason.CANCELLED)  # [CAN-5]: held text flushed

    # ---- ends decided here ------------------------------------------------------------------------

    def cancel_now(self, how: Cancel) -> None:
        """Cancelled before the engine saw it (or a live tombstone): answered here."""
        self.cancel = how
        if how is Cancel.ABORT:
            self.fail(Cancelled("request cancelled by client"))
        elif not self.done:
            self._end(FinishReason.CANCELLED)

    def fail(self, error: Exception) -> None:
        """End with an error response: a client-visible K3Error, or a defect (INTERNAL)."""
        if not self.done:
            self._end(FinishReason.ERROR, error=error)

    # ---- response thread: what to send -----------------------------------------------------------

    def take_response(self) -> tuple[dict | None, Exception | None, bool] | None:
        """The one response to send now, as (outputs, None, final) or (None, error, True); None when
        nothing may be sent yet (a streaming delta without visible text waits for the next, [STR-3])."""
        ev, self._delta = self._delta, None
        if ev is None or self._sent_final:
            return None
        if ev.finished:
            self._sent_final = True
            if ev.error is not None:
                return None, ev.error, True
        if self._builder is None:  # never prepared: ended before it reached the engine
            self._builder = ResponseBuilder(self.parsed, "", tokenizer=self.tokenizer)
        outputs = self._builder.on_event(ev)  # keeps what it may not send yet ([STR-3])
        return None if outputs is None else (outputs, None, ev.finished)

    def tokens_since_response(self) -> int:
        """Tokens the response being sent covers (the ones since the previous response)."""
        n, self._sent_tokens = self.num_tokens - self._sent_tokens, self.num_tokens
        return n

    # ---- internals ---------------------------------------------------------------------------------

    def _open_delta(self) -> RequestOutput:
        if self._delta is None:
            n = len(self.request.prompt_ids) if self.request is not None else 0
            self._delta = RequestOutput(self.parsed.request_id, num_input_tokens=n,
                                        arrival_time_ns=int(self.parsed.arrival_time * 1e9))
        return self._delta

    def _end(self, reason: FinishReason, *, flush: bool = True, error: Exception | None = None) -> None:
        self.done = True
        self.finish_reason = None if error else reason
        ev = self._open_delta()
        if error is None and flush and self._detok is not None:
            delta = self._detok.finish()  # [STR-6]: held text that is not part of a stop match
            ev.text += delta.text
            ev.reasoning += delta.reasoning
        ev.finished, ev.finish_reason, ev.error = True, None if error else reason, error
