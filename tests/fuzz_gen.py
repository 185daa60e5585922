"""The pieces every fuzz class is built from: server limits, the `Case` record, and `Gen`, one
case's seeded random source with the helpers the classes share (ids, cheap valid requests,
models and protocols).

A case records the answers it may legitimately get (`expect`, SERVING.md §7.2). Nothing in
`fuzz_wire.FAILURES` (INTERNAL, hangs, lost or duplicated responses) is ever expected.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any

from fuzz_wire import Request

OK = frozenset({"ok"})
BAD = frozenset({"INVALID_ARG"})
UNSUP = frozenset({"UNSUPPORTED"})
CORE = frozenset({"TRITON"})  # refused by Triton core before a model runs ([IN-1])
PARSE = frozenset({"TRITON_500"})  # Triton's /generate JSON parser (README "Error status codes")
GEN_MODELS = ("k3_ensemble", "k3_lm")
GEN_PROTOCOLS = ("grpc", "http_generate", "http_stream")
PLACEHOLDER = "<|kimi_image_placeholder|>"


@dataclass(frozen=True)
class Limits:
    """What the fuzzed server allows, so a case knows its answer (k3_lm and k3_vision parameters)."""

    max_prompt_bytes: int = 65536
    max_model_len: int = 4096
    vocab_size: int = 512
    hidden_size: int = 64
    max_images_per_request: int = 16


@dataclass
class Case:
    """One fuzz case: its requests, how they are sent, and the answers each may get.

    action: `send` (all requests, one stream or one HTTP call each), `cancel` (gRPC
    stop_stream(cancel_requests=True) after `delay_s`), `drop` (raw gRPC call closed after
    `delay_s`), `abandon` (HTTP connection closed early), `race` (requests `delay_s` apart on
    one stream: a target and its stop), `parallel` (HTTP requests from threads at once).
    `cleanup`: stop requests sent afterwards, so an abandoned generation frees the engine (the
    documented way for k3_ensemble and HTTP clients, [CAN-2]). `finish`: the finish_reason the
    first request must end with (a stopped target: `cancelled`, [CAN-5]).
    """

    index: int
    kind: str
    protocol: str
    requests: list[Request]
    expect: frozenset[str]
    action: str = "send"
    delay_s: float = 0.0
    cleanup: list[Request] = field(default_factory=list)
    finish: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.requests[0].model


class Gen:
    """One case's random source (seeded by seed and case index) and shared helpers."""

    def __init__(self, seed: int, index: int, limits: Limits, extras: dict[str, Any]) -> None:
        self.rng = random.Random(f"{seed}:{index}")
        self.seed, self.index, self.limits = seed, index, limits
        self.extras = extras  # harness facts: `canary_url`, a loopback port that must never be hit
        self._ids = 0

    def rid(self, tag: str = "") -> str:
        """A request id no other case uses (a stop or tombstone can only touch its own case)."""
        self._ids += 1
        return f"fz{self.seed}-{self.index}-{self._ids}{tag}"

    def choice(self, items: Any) -> Any:
        return self.rng.choice(list(items))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def text(self, n: int | None = None) -> str:
        n = self.rng.randint(1, 24) if n is None else n
        return "".join(self.rng.choice(string.ascii_letters + " ,.") for _ in range(n)).strip() or "x"

    def model(self) -> str:
        return self.choice(GEN_MODELS)

    def protocol(self) -> str:
        return self.choice(GEN_PROTOCOLS)

    def cheap(self, protocol: str, **values: Any) -> dict[str, Any]:
        """A valid generation request that costs the engine at most a few tokens, plus `values`.

        `stream` follows the protocol: /generate needs exactly one response ([STR-1]).
        """
        base: dict[str, Any] = {"text_input": self.text(), "max_tokens": self.rng.randint(1, 3)}
        if self.chance(0.5):
            base["temperature"] = 0.0
        if protocol == "grpc" and self.chance(0.5):
            base["stream"] = True
        if protocol == "http_stream" and self.chance(0.7):
            base["stream"] = True
        return {**base, **values}

    def case(self, kind: str, expect: frozenset[str], values: dict[str, Any], *, model: str | None = None,
             protocol: str | None = None, request_id: str | None = None, **kw: Any) -> Case:
        """A one-request case; `values` are complete (start from `cheap`)."""
        protocol = protocol or self.protocol()
        request = Request(model or self.model(), values, self.rid() if request_id is None else request_id)
        return Case(self.index, kind, protocol, [request], expect, **kw)

    def generation(self, kind: str, expect: frozenset[str], protocols: tuple[str, ...] = GEN_PROTOCOLS,
                   model: str | None = None, **values: Any) -> Case:
        """A cheap generation request with `values` on top, to either LM model and any protocol."""
        protocol = self.choice(protocols)
        return self.case(kind, expect, self.cheap(protocol, **values), model=model, protocol=protocol)


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def malformed_json_text(g: Gen, valid: str) -> str:
    """A string that is not one JSON value: truncated, trailing garbage, Python syntax, comments."""
    return g.choice((
        valid[: g.rng.randint(0, max(0, len(valid) - 1))], valid + g.choice(("x", ",", "}", "]")),
        valid.replace('"', "'"), "{" + valid, "\ufeff" + valid, valid + " // c", "{\"a\": 1,}", "[1, 2,]",
        "{a: 1}", "undefined", "tru",
    ))
