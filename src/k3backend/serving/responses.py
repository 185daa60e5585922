"""Engine events -> Triton output tensors (SERVING.md §2.3, §5.6-5.10), and the error table (§7).

One `ResponseBuilder` per request turns the engine's `RequestOutput` deltas into the dicts of numpy
arrays a response carries (batch dimension included: `text_output` is `[1, 1]`). It decides when a
response may be sent at all: streaming sends on visible text and on the final event ([STR-2],
[STR-3]); non-streaming sends once, on the final event ([STR-1]).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field

import numpy as np

from k3backend.engine.request import FinishReason, TokenLogprob
from k3backend.errors import Internal, K3Error
from k3backend.serving.params import ParsedRequest
from k3backend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The codes k3_lm / k3_vision emit besides INTERNAL ([ERR-1]); each code string (INTERNAL too) is
# the name of a pb_utils.TritonError code: `pb_utils.TritonError(message, getattr(TritonError, code))`.
CLIENT_CODES = ("INVALID_ARG", "UNSUPPORTED", "UNAVAILABLE", "CANCELLED")
# JSON has no -Infinity: a log-prob that underflowed is written as vLLM's OpenAI server writes it.
JSON_MIN_LOGPROB = -9999.0
_SURROGATE = re.compile("[\ud800-\udfff]")


def error_message(model_name: str, exc: BaseException, request_id: str = "") -> tuple[str, str]:
    """(code, message) for an error response: `<model>: <CODE>: <detail>` ([ERR-1]).

    Anything that is not a client-visible K3Error is a defect: INTERNAL, with the traceback logged
    here, once ([ERR-3]), and only the request id in the message; an `Internal` error names its
    cause (its traceback was logged where it was caught).
    """
    if isinstance(exc, K3Error) and exc.code in CLIENT_CODES:
        return exc.code, f"{model_name}: {exc.code}: {exc}"
    if isinstance(exc, Internal):  # its cause was logged with its traceback where it was caught
        return "INTERNAL", f"{model_name}: INTERNAL: {exc}"
    logger.error("%s: request %r failed with an unexpected error", model_name, request_id, exc_info=exc)
    return "INTERNAL", f"{model_name}: INTERNAL: unexpected error (see server log, request id {request_id!r})"


def _utf8(text: str) -> bytes:
    """UTF-8 of `text`; lone surrogates (JSON `\\ud800` escapes in messages) become U+FFFD ([STR-5])."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")


def _bytes_tensor(text: str) -> np.ndarray:
    out = np.empty((1, 1), dtype=object)  # BYTES [1] with the batch dim: exactly one element
    out[0, 0] = _utf8(text)
    return out


def stop_request_response() -> dict[str, np.ndarray]:
    """The one final data response of a stop request ([CAN-4]): `text_output = ""` and nothing else."""
    return {"text_output": _bytes_tensor("")}


@dataclass
class _Pending:
    """What the next response will cover: text not yet sent and tokens since the previous response."""

    text: str = ""
    reasoning: str = ""
    n_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A request's news since its previous response ([STR-4], [STR-8]), as `RequestStream` collects it.

    text / reasoning: newly released visible text (may be empty on the final one); token_ids /
    logprobs: tokens sampled since the previous one (whether or not their text was held back).
    `error` (final only): why it ended without a normal finish: a client-visible K3Error
    (INVALID_ARG, CANCELLED, UNAVAILABLE) or, for a defect, any other exception.
    """

    request_id: str
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: Exception | None = None
    num_input_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0


_FIRST_TIMES = ("first_scheduled_time_ns", "first_token_time_ns")


class ResponseBuilder:
    """Per-request state between engine events and responses.

    `on_event` returns the outputs to send now, or None when nothing may be sent: a non-final
    streaming event without visible text is merged into the next response ([STR-3], [STR-8]), and
    non-streaming requests answer only on the final event. `tokenizer` is needed only for the
    `logprobs` JSON (`decoded_token`, [LP-3]); `num_input_tokens` is used when events carry 0.
    """

    def __init__(self, parsed: ParsedRequest, echo_prompt: str = "", *, num_input_tokens: int = 0,
                 tokenizer: Tokenizer | None = None):
        self._out = parsed.outputs
        if self._out.return_logprobs and tokenizer is None:
            raise ValueError("ResponseBuilder: return_logprobs needs the tokenizer for decoded_token")
        self._tokenizer = tokenizer
        self._echo = "" if self._out.exclude_input_in_output else echo_prompt  # [TXT-4]
        self._num_input = num_input_tokens
        self._times = {"arrival_time_ns": int(parsed.arrival_time * 1e9), "first_scheduled_time_ns": 0,
                       "first_token_time_ns": 0, "last_token_time_ns": 0}
        self._num_cached = 0
        self._pending = _Pending()
        self._cum_logprob = 0.0
        self._sent = 0
        self._finished = False
        self._decoded: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        return self._finished

    def on_event(self, ev: RequestOutput) -> dict[str, np.ndarray] | None:
        """Absorb one engine delta; returns a response's outputs, or None when none may be sent yet.

        A final event with an `error` raises it: the request ends with an error response, not a
        data response (§5.8): its client mistake, a cancellation, or the engine's failure ([HLT-7]).
        """
        if self._finished:
            raise RuntimeError(f"request {ev.request_id!r}: event after the final one")
        if ev.error is not None:
            self._finished = True
            raise ev.error
        self._absorb(ev)
        if ev.finished:
            self._finished = True
            if ev.finish_reason is None:
                raise RuntimeError(f"request {ev.request_id!r}: final event without a finish_reason")
            return self._build(ev.finish_reason.label)
        if not self._out.stream or not (self._pending.text or self._pending.reasoning):
            return None
        return self._build("")

    def _absorb(self, ev: RequestOutput) -> None:
        pending = self._pending
        if self._out.return_reasoning:
            pending.text += ev.text
            pending.reasoning += ev.reasoning
        else:  # the engine keeps thinking text in `text` then; merge defensively ([TXT-3])
            pending.text += ev.reasoning + ev.text
        pending.n_tokens += len(ev.token_ids)
        if self._out.needs_logprobs and ev.token_ids:
            if ev.logprobs is None or len(ev.logprobs) != len(ev.token_ids):
                got = None if ev.logprobs is None else len(ev.logprobs)
                raise RuntimeError(f"request {ev.request_id!r}: {len(ev.token_ids)} tokens but logprobs {got}")
            pending.logprobs += ev.logprobs
        self._num_input = ev.num_input_tokens or self._num_input
        self._num_cached = ev.num_cached_tokens or self._num_cached
        for name, kept in self._times.items():  # the first_* times keep the request's first, not a delta's
            value = getattr(ev, name)
            if value and not (kept and name in _FIRST_TIMES):
                self._times[name] = value

    def _build(self, finish_reason: str) -> dict[str, np.ndarray]:
        """The outputs of one response; only what the request asked for ([OUT-1])."""
        out, pending = self._out, self._pending
        text = pending.text if self._sent else self._echo + pending.text
        outputs = {"text_output": _bytes_tensor(text)}
        if out.return_reasoning and pending.reasoning:
            outputs["reasoning_output"] = _bytes_tensor(pending.reasoning)
        if out.return_finish_reason:
            outputs["finish_reason"] = _bytes_tensor(finish_reason)
        if out.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([[self._num_input]], dtype=np.int32)
        if out.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([[pending.n_tokens]], dtype=np.int32)
        if out.needs_logprobs:
            values = [lp.logprob for lp in pending.logprobs]
            self._cum_logprob += math.fsum(values)
            if out.return_log_probs:
                outputs["cum_log_probs"] = np.array([[self._cum_logprob]], dtype=np.float32)
                outputs["output_log_probs"] = np.array(values, dtype=np.float32).reshape(1, 1, len(values))
            if out.return_cumulative_logprob:
                outputs["cumulative_logprob"] = np.array([[self._cum_logprob]], dtype=np.float32)
            if out.return_logprobs:
                outputs["logprobs"] = _bytes_tensor(self._logprobs_json(pending.logprobs))
        if out.return_perf_metrics:
            outputs["num_cached_tokens"] = np.array([[self._num_cached]], dtype=np.int32)
            for name, value in self._times.items():
                outputs[name] = np.array([[value]], dtype=np.int64)
        self._pending = _Pending()
        self._sent += 1
        return outputs

    # ---- logprobs JSON ([LP-3]) ------------------------------------------------------------------

    def _decode(self, token: int) -> str:
        if token not in self._decoded:
            assert self._tokenizer is not None
            self._decoded[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return self._decoded[token]

    def _entry(self, token: int, logprob: float, rank: int) -> dict[str, object]:
        value = logprob if math.isfinite(logprob) else JSON_MIN_LOGPROB
        return {"logprob": value, "rank": rank, "decoded_token": self._decode(token)}

    def _logprobs_json(self, logprobs: list[TokenLogprob]) -> str:
        """vllm_backend format: one object per token, id (decimal string) -> logprob, rank, decoded_token."""
        entries = []
        for lp in logprobs:
            entry = {str(lp.token): self._entry(lp.token, lp.logprob, lp.rank)}
            for rank, (token, logprob) in enumerate(lp.top[:self._out.top_logprobs], 1):
                entry.setdefault(str(token), self._entry(token, logprob, rank))
            entries.append(entry)
        return json.dumps(entries, ensure_ascii=False)
