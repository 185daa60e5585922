"""Per-request sampling and termination settings (SERVING.md §2.2, §5.3–5.5), validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3backend.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs and stop conditions of one request. `seed=None` draws from OS entropy."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    end_id: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no log-probs; k >= 0: sampled token plus k alternatives
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidArgument(msg)

        if self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 or >= 1, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                bad(f"{name} must be in [-2, 2], got {v}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"top_logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def reads_prompt(self) -> bool:
        """The repetition penalty counts the prompt's ids too ([SMP-6] step 2)."""
        return self.repetition_penalty != 1.0

    @property
    def reads_output(self) -> bool:
        """A penalty reads the request's earlier output ids."""
        return self.reads_prompt or bool(self.frequency_penalty or self.presence_penalty)


def eos_sets(p: SamplingParams, eos_ids: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """([STP-2]) the ids masked below min_tokens (end_id replaces the EOS set) and the ids that end
    generation (none with ignore_eos)."""
    mask = (p.end_id,) if p.end_id is not None else tuple(eos_ids)
    return mask, () if p.ignore_eos else mask
