"""Deltas from Triton -> OpenAI bodies: chat.completion / text_completion, their stream chunks, usage.

One `Answer` per HTTP request accumulates every choice's deltas (for the non-streamed body and
for usage) and renders each delta as one server-sent event in OpenAI's chunk format.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from k3backend.openai.translate import Plan
from k3backend.openai.triton import Delta

# k3's `cancelled` (someone sent a stop for this request id) has no OpenAI name; vLLM says abort.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
DONE = b"data: [DONE]\n\n"


# What json.dumps(obj, ensure_ascii=False, separators=(",", ":")) does, without building the encoder
# each call; a string alone goes straight to the C escaper that the encoder would call.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_string = json.encoder.encode_basestring


def sse(obj: object) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    n_tokens: int = 0
    offset: int = 0  # legacy logprobs' text_offset: characters before the next token
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    times: dict[str, int] | None = None


class Answer:
    """The OpenAI answer to one request, built from the deltas of its choices."""

    def __init__(self, plan: Plan, model: str) -> None:
        self.plan = plan
        self.chat = plan.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.choices = [_Choice() for _ in plan.jobs]
        self._open = len(self.choices)  # choices still without their final delta
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        # Every chunk shares this envelope; with include_usage each carries "usage": null but the last.
        self._head = f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},"model":{_dumps(model)},"choices":['
        self._tail = ("],\"usage\":null}\n\n" if plan.include_usage else "]}\n\n")

    # ---- accumulate ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every choice has had its final delta."""
        return self._open == 0

    def add(self, index: int, d: Delta) -> dict | None:
        """Record one delta of choice `index`; returns its log-probabilities in OpenAI's form, if asked for."""
        c = self.choices[index]
        c.n_tokens += d.n_tokens
        c.prompt_tokens = d.num_input_tokens or c.prompt_tokens
        c.cached_tokens = d.num_cached_tokens or c.cached_tokens
        if d.final and c.finish_reason is None:
            c.finish_reason = FINISH_REASONS.get(d.finish_reason, d.finish_reason or "stop")
            c.times = d.times
            self._open -= 1
        logprobs = None
        if self.plan.logprobs and d.logprobs is not None:
            logprobs = self._logprobs(c, d.logprobs)
        if d.text:
            c.text.append(d.text)
        if d.reasoning:
            c.reasoning.append(d.reasoning)
        return logprobs

    def event(self, index: int, d: Delta) -> bytes:
        """Record one delta and return it as one server-sent event (an OpenAI chunk of one choice).

        Written as strings around the escaped text, the same bytes as json.dumps of the choice's
        dict: this runs for every streamed response, and building and encoding the dict took 2.8 µs
        against 0.6 (docs/openai.md "Overhead")."""
        logprobs = self.add(index, d)
        if self.chat:
            delta = '"content":' + _string(d.text) if d.text else ""
            if d.reasoning:
                delta += (',"reasoning_content":' if delta else '"reasoning_content":') + _string(d.reasoning)
            choice = f'{{"index":{index},"delta":{{{delta}}}'
        else:
            choice = f'{{"index":{index},"text":{_string(d.text)}'
        reason = self.choices[index].finish_reason
        choice += (',"logprobs":' + ("null" if logprobs is None else _dumps(logprobs))
                   + ',"finish_reason":' + ("null" if reason is None else _string(reason)))
        if d.final and self.plan.perf_metrics:
            choice += ',"perf_metrics":' + _dumps(self.choices[index].times)
        return self._event(choice + "}")

    def _logprobs(self, c: _Choice, entries: list[dict]) -> dict:
        """k3's entries (sampled token first, then the top ones; they may overlap) in OpenAI's form."""
        top = self.plan.top_logprobs
        picked = [(next(iter(e.values())), sorted((v for v in e.values() if v["rank"] <= top),
                                                  key=lambda v: v["rank"])) for e in entries]
        if self.chat:
            content = [{**_token(s), "top_logprobs": [_token(t) for t in tops]} for s, tops in picked]
            c.logprobs += content
            return {"content": content}
        offsets = []
        for s, _ in picked:
            offsets.append(c.offset)
            c.offset += len(s["decoded_token"])
        out = {"tokens": [s["decoded_token"] for s, _ in picked], "token_logprobs": [s["logprob"] for s, _ in picked],
               "top_logprobs": [{t["decoded_token"]: t["logprob"] for t in tops} for _, tops in picked],
               "text_offset": offsets}
        c.logprobs.append(out)
        return out

    # ---- streamed ---------------------------------------------------------------------------

    def _event(self, choice: str) -> bytes:
        """The chunk around one choice's JSON, as one SSE event."""
        if self.plan.continuous_usage:
            return (self._head + choice + '],"usage":' + _dumps(self.usage()) + "}\n\n").encode()
        return (self._head + choice + self._tail).encode()

    def role_chunks(self) -> bytes:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        return b"".join(self._event(f'{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                                    '"finish_reason":null}') for i in range(len(self.choices)))

    def usage_chunk(self) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})

    # ---- whole ------------------------------------------------------------------------------

    def usage(self) -> dict:
        """prompt tokens once per prompt (n choices share it), completion tokens over all choices."""
        prompts: dict[int, _Choice] = {}
        for job, c in zip(self.plan.jobs, self.choices):
            prompts.setdefault(job.prompt_index, c)
        prompt = sum(c.prompt_tokens for c in prompts.values())
        completion = sum(c.n_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in prompts.values())}}

    def body(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if c.reasoning:
                    message["reasoning_content"] = "".join(c.reasoning)
                choice = {"index": i, "message": message, "logprobs": {"content": c.logprobs} if self.plan.logprobs else None}
            else:
                choice = {"index": i, "text": text, "logprobs": _join_legacy(c.logprobs) if self.plan.logprobs else None}
            choice["finish_reason"] = c.finish_reason
            if self.plan.perf_metrics:
                choice["perf_metrics"] = c.times
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}


def _token(v: dict) -> dict:
    tok = v["decoded_token"]
    return {"token": tok, "logprob": v["logprob"], "bytes": list(tok.encode("utf-8"))}


def _join_legacy(parts: list[dict]) -> dict:
    return {key: [x for p in parts for x in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
