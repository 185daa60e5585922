"""The engine core over a simulated device: scheduling and reporting policies measured on a CPU in seconds.

    python bench/engine_sim.py --workload steady,staggered,long-prompt
    python bench/engine_sim.py --workload steady --heavy-step-ms 0,25,1000 --decode-stall-ms 40

`EngineCore`, with its real scheduler, runs over `SimExecutor`: no model; a step "runs" for the
cost model's milliseconds on a device timeline (a launched step starts when the one before it
ends, and `finish` waits until its step's end, so scheduling overlaps the device as on a GPU), and
every sampled id is 7. bench/engine.py's closed loop drives it and prints its table. Time is a
`VirtualClock`: host work takes none, so a run is exact, repeatable and fast. The cost model
is the H200 at `small` (bf16, CUDA graphs; bench/engine.py and bench/profile_step.py figures of
2026-12-03): a decode step of b rows interpolates the measured decode graphs (B1 2.8 ms, B64 5.7,
B256 8.6); p prefill tokens of chunks starting at s add (0.0079 + 3.1e-7 s) ms per token (3,072
tokens from 0: 28.8 ms, from 8,192: 36.6); a step holds a 4.5 ms floor (the weights read once),
so a mixed step costs decode + prefill - 4.5.

What it shows: how a policy (the decode_stall_ms cap, heavy steps, async scheduling, admission)
moves TTFT and ITL for the same step times. On 2026-12-03 it gave, for the engine of that day and
for the same engine with a heavy step waited for in the call that launched it (as before 15e2923),
steady TTFT p50 91 / 73 ms and long-prompt ITL p99 32 / 53 ms with the same tok/s; the H200 read
102 / 73 and 36 / 43 (the latter on the older tree, which also lacked the cap by chunk start). What
it cannot show: kernel speed, host time, image rows, anything past 16,384 cached tokens (the
absorbed form is slower than the model says).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import numpy as np

import engine as be
from k3backend.engine import core as core_mod
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore
from k3backend.engine.cuda_graphs import CAPTURE_SIZES, PREFILL_SIZES
from k3backend.engine.plan import CacheCapacity, StepPlan
from k3backend.engine.runner import ModelInfo, timed_starts
from k3backend.engine.sampler import Sampled

DECODE_MS = {1: 2.83, 2: 3.09, 4: 3.34, 8: 3.95, 16: 4.63, 32: 5.19, 64: 5.70, 128: 6.62, 256: 8.60}  # H200 graphs
FLOOR_MS = 4.5  # of any step: the weights read once


def decode_ms(rows: int) -> float:
    if not rows:
        return 0.0
    sizes = sorted(DECODE_MS)
    return float(np.interp(rows, sizes, [DECODE_MS[b] for b in sizes]))


def step_ms(plan: StepPlan) -> float:
    """The cost model (module docstring) for one step."""
    prefill = sum(len(s.token_ids) * (0.0079 + 3.1e-7 * s.start) for s in plan.chunks)
    if not prefill:
        return decode_ms(plan.num_decode)
    return max(decode_ms(plan.num_decode), FLOOR_MS) + prefill


class VirtualClock:
    """time.monotonic and time.sleep of the simulated run: sleeping moves the clock, nothing else does."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    @contextlib.contextmanager
    def installed(self) -> Iterator[VirtualClock]:
        """time.monotonic and time.sleep are this clock's inside (the engine and the bench loop read them)."""
        saved = time.monotonic, time.sleep
        time.monotonic, time.sleep = self.monotonic, self.sleep
        try:
            yield self
        finally:
            time.monotonic, time.sleep = saved


@dataclasses.dataclass
class _Step:
    end: float  # monotonic seconds
    samples: int


class SimExecutor:
    """The Executor protocol (engine/runner.py) over the cost model's device timeline."""

    info = ModelInfo(vocab_size=150_000, hidden_size=2048, media_pad_id=149_999)
    overlap = True

    def __init__(self, cfg: EngineConfig) -> None:
        self.capacity = CacheCapacity(num_blocks=200_000, num_slots=cfg.max_num_seqs * 4, block_size=cfg.block_size)
        one = lambda n, s: step_ms(StepPlan(seqs=[_Chunk(n, s)]))  # noqa: E731
        starts = [0] + timed_starts(cfg.max_model_len, PREFILL_SIZES[0])
        self.prefill_ms = {s: {n: one(n, s) for n in PREFILL_SIZES} for s in starts}
        self.decode_ms = decode_ms(next(b for b in CAPTURE_SIZES if b >= cfg.max_num_seqs))
        self._free = 0.0

    def launch(self, plan: StepPlan) -> _Step:
        start = max(time.monotonic(), self._free)
        self._free = start + step_ms(plan) / 1e3
        return _Step(self._free, sum(s.sample for s in plan.seqs))

    def finish(self, step: _Step) -> Sampled:
        time.sleep(max(0.0, step.end - time.monotonic()))
        return Sampled([7] * step.samples, [None] * step.samples)

    def health(self) -> str | None:
        return None

    workers_alive = 1

    def close(self, timeout: float = 20.0) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """The parts of a ScheduledSeq the cost model reads."""

    n: int
    start: int
    sample: bool = True

    @property
    def token_ids(self) -> range:
        return range(self.n)


def simulate(w: argparse.Namespace, cfg: EngineConfig) -> dict:
    """bench/engine.py's closed loop of workload `w` (its image rows left out) over SimExecutor, in
    virtual time; bench/engine.py's result dict."""
    w.image_share = w.image_rows = 0
    jobs = be.workload(w, SimExecutor.info.vocab_size, SimExecutor.info.media_pad_id)[w.warmup:]
    with VirtualClock().installed():
        return be.run(EngineCore(SimExecutor(cfg), cfg), jobs, w.concurrency, 1, temperature=0.0)


def workloads(names: str, scale: float = 1.0) -> list[argparse.Namespace]:
    """bench/engine.py's named workloads (a comma list), `scale` of their requests."""
    return be.workloads(argparse.Namespace(workload=names, scale=scale, seed=0, shared_prefix_len=0,
                                           shared_prefix_fraction=0.0))


def main(argv: list[str] | None = None) -> list[tuple[argparse.Namespace, dict]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="steady,staggered,long-prompt", help="bench/engine.py's named workloads")
    ap.add_argument("--scale", type=float, default=1.0, help="a share of each workload's requests")
    ap.add_argument("--decode-stall-ms", default="40", help="a comma list: one run of the workloads per value")
    ap.add_argument("--heavy-step-ms", default=str(core_mod.HEAVY_STEP_MS), help="a comma list (HEAVY_STEP_MS)")
    ap.add_argument("--sync", action="store_true", help="async scheduling off")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    args = ap.parse_args(argv)
    results = []
    for stall in map(float, args.decode_stall_ms.split(",")):
        for heavy in map(float, args.heavy_step_ms.split(",")):
            core_mod.HEAVY_STEP_MS = heavy  # read when an EngineCore is made
            cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=32768,
                               max_num_batched_tokens=args.max_num_batched_tokens, decode_stall_ms=stall,
                               async_scheduling=not args.sync)
            for w in workloads(args.workload, args.scale):
                r = simulate(w, cfg)
                w.name = f"{w.name} s{stall:g} h{heavy:g}"
                results.append((w, r))
    print(be.summary(results))
    return results


if __name__ == "__main__":
    main()
