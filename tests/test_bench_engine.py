"""bench/engine.py's closed loop: the client turnaround model (a finished request's successor is sent
`A` ms later, plus `B` ms per earlier finisher of the same step), against a stand-in engine core."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from k3backend.engine.outputs import StepOutputs
from k3backend.engine.request import FinishReason

spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).resolve().parents[1] / "bench" / "engine.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


class OneStepCore:
    """Every request gets its one token and ends at the next step; steps take 2 ms."""

    def __init__(self) -> None:
        self.added: list[float] = []
        self.steps: list[tuple[float, int]] = []  # (end, requests that finished)
        self._new: list[int] = []

    def add(self, rid: int, request) -> None:
        self.added.append(time.monotonic())
        self._new.append(rid)

    def step(self) -> StepOutputs:
        time.sleep(0.002)
        ids, self._new = self._new, []
        self.steps.append((time.monotonic(), len(ids)))
        return StepOutputs(np.array(ids, dtype=np.int64), np.zeros(len(ids), dtype=np.int64),
                           np.full(len(ids), FinishReason.LENGTH, dtype=np.int8))


def test_a_successor_is_sent_after_the_turnaround_of_the_request_it_follows():
    """Three clients, twelve requests: each request after the first three is added no earlier than a
    client became free (the i-th add after the i-th free client, both in time order), where a client
    is free A ms after its request ended plus B ms per request that ended before it in the step."""
    jobs = [([1, 2, 3], 1, 0)] * 12
    core = OneStepCore()
    r = bench.run(core, jobs, 3, first_id=1, turnaround=(0.030, 0.010))
    assert r["n"] == 12 and r["tokens"] == 12 and min(r["ttft"]) >= 0.002
    free = sorted(end + 0.030 + 0.010 * j for end, n in core.steps for j in range(n))
    adds = sorted(core.added[3:])
    assert all(a >= f - 1e-4 for a, f in zip(adds, free)), [round(a - f, 4) for a, f in zip(adds, free)]
    assert adds[-1] - adds[0] > 0.06  # spread by the turnaround (without one: about 8 steps of 2 ms)
    # without one, a successor goes into the very next step
    core = OneStepCore()
    bench.run(core, jobs, 3, first_id=1)
    free = sorted(end for end, n in core.steps for _ in range(n))
    assert all(0 <= a - f < 0.02 for a, f in zip(sorted(core.added[3:]), free))
