"""What the engine core hands back each step: every request's news as arrays (ENGINE.md §8).

One `StepOutputs` per step, whatever the number of requests: the ids of the requests that got a
token or ended, the tokens, the finish codes and, for the rare cases, a few sparse maps (log-probs
of the requests that asked, error messages). It pickles as a handful of buffers, so crossing
from the engine-core process to the serving layer costs the same at batch 1 and 256.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3backend.engine.request import FinishReason, TokenLogprob


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters after a step (§9); counters are totals since it started."""

    num_running: int = 0
    num_waiting: int = 0  # added, not yet scheduled
    steps: int = 0
    kv_cache_usage: float = 0.0  # fraction of MLA blocks held by running sequences
    state_slots_usage: float = 0.0  # fraction of KDA slots held by running sequences
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens served from the cache
    workers_alive: int = 1


def _ints(dtype) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class StepOutputs:
    """One step's news. Row i: request `ids[i]` got token `tokens[i]` (-1: none this step) and
    finished with `finish[i]` (FinishReason; NONE while it runs)."""

    ids: np.ndarray = field(default_factory=lambda: _ints(np.int64))
    tokens: np.ndarray = field(default_factory=lambda: _ints(np.int64))
    finish: np.ndarray = field(default_factory=lambda: _ints(np.int8))
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # id -> the row's, when it asked
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> (error code, message) for ERROR
    started: np.ndarray = field(default_factory=lambda: _ints(np.int64))  # ids first scheduled this step
    cached: np.ndarray = field(default_factory=lambda: _ints(np.int32))  # their prompt tokens from the prefix cache
    time_ns: int = 0  # wall clock when the step's tokens reached the host
    scheduled_ns: int = 0  # wall clock when the step was scheduled (its start, for queue times)
    stats: EngineStats = field(default_factory=EngineStats)

    def __len__(self) -> int:
        return len(self.ids)

    def finished(self) -> np.ndarray:
        """The ids that ended this step."""
        return self.ids[self.finish != FinishReason.NONE]
