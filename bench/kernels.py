"""Fused kernels at real sizes: correctness (--check) and speed, side by side with the torch reference
and fla-core, against the measured ceilings of one H200.

    python bench/kernels.py --check                 # every family, check then time
    python bench/kernels.py --families kda moe       # some families
    TRITON_INTERPRET=1 python bench/kernels.py --check --smoke   # tiny sizes on a CPU: the harness itself
    python bench/kernels.py --families kda --match decode_fused  # the cases whose family/name has this

Each family module (`bench/kernels_<family>.py`) defines `cases(args) -> list[Case]`. Times are the
mean of CUDA-graph replays (so launch overhead counts as it does inside the engine's decode graph),
or of eager calls where a case cannot be captured. The table ends each run: time, achieved TB/s or
TFLOP/s, the fraction of the ceiling that bounds the case, and the ratios against the reference and
fla measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

HBM_TBS = 4.27  # device-to-device copy, read + write (measured on the project's H200s)
BF16_TFLOPS = 788.0  # 8192^3 bf16 matmul on random data
FAMILIES = ("kda", "moe", "mxfp4", "mla", "norm", "sample", "gemv")


@dataclass
class Case:
    """One kernel at one shape. `run`, `ref`, `fla` take no arguments (inputs prepared by `cases`)."""

    family: str
    name: str
    shape: str
    run: Callable[[], Any]
    ref: Callable[[], Any] | None = None
    fla: Callable[[], Any] | None = None
    bytes: float = 0.0  # bytes the kernel must move at least
    flops: float = 0.0
    check: Callable[[], str] | None = None  # raises on a mismatch, returns e.g. "rel 3.1e-3 <= 8e-3"
    graph: bool = True  # time by CUDA-graph replay


def time_fn(fn: Callable[[], Any], graph: bool, iters: int = 50) -> float:
    """Seconds per call."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g.replay()  # untimed: the first replay of a graph pays for its upload (and idle clocks ramp up)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        except Exception:  # noqa: BLE001 - not capturable: time eagerly
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _maybe_time(fn: Callable[[], Any] | None, graph: bool, iters: int, what: str) -> float | None:
    """The time of a baseline, or None (printed) when it is absent or fails."""
    if fn is None:
        return None
    try:
        return time_fn(fn, graph, iters)
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run does not end the bench
        print(f"    {what} failed: {type(e).__name__}: {e}", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--check", action="store_true", help="check every case against its reference first")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter runs of the harness)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--match", default="", help="only the cases whose family/name contains this")
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import triton

    print("$ python bench/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}; ceilings {HBM_TBS} TB/s, "
          f"{BF16_TFLOPS} TFLOP/s bf16")
    rows, failures = [], 0
    for family in args.families:
        try:
            module = importlib.import_module(f"kernels_{family}")
        except ModuleNotFoundError as e:
            print(f"{family}: no bench module ({e})")
            continue
        try:
            cases = [c for c in module.cases(args) if args.match in f"{c.family}/{c.name}"]
        except Exception as e:  # noqa: BLE001 - one family's setup failing leaves the others to run
            print(f"{family}: cases failed to build: {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        while cases:
            case = cases.pop(0)  # dropped after timing: its inputs leave the GPU before the next family
            status = ""
            try:
                if args.check and case.check is not None:
                    try:
                        status = case.check()
                    except AssertionError as e:
                        status, failures = f"FAILED {e}", failures + 1
                t = time_fn(case.run, case.graph, args.iters)
            except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or launch: report, go on
                print(f"  {case.family}/{case.name} {case.shape}: ERROR {type(e).__name__}: {e}", flush=True)
                failures += 1
                continue
            t_ref = _maybe_time(case.ref, case.graph, max(3, args.iters // 10), "reference")
            t_fla = _maybe_time(case.fla, case.graph, args.iters, "fla")
            rows.append((case.family, case.name, case.shape, case.bytes, case.flops, t, t_ref, t_fla, status))
            print(f"  {case.family}/{case.name} {case.shape}: {t * 1e3:.3f} ms {status}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{'case':<28} {'shape':<26} {'ms':>9} {'TB/s':>6} {'TFLOP/s':>8} {'%ceil':>6} {'vs ref':>7} "
          f"{'vs fla':>7}  check")
    for family, name, shape, nbytes, flops, t, t_ref, t_fla, status in rows:
        tbs, tfs = nbytes / t / 1e12, flops / t / 1e12
        ceil = max(tbs / HBM_TBS, tfs / BF16_TFLOPS)
        ratio = lambda other: f"{other / t:>6.2f}x" if other else f"{'-':>7}"  # noqa: E731
        print(f"{family + '/' + name:<28} {shape:<26} {t * 1e3:>9.3f} {tbs:>6.2f} {tfs:>8.1f} "
              f"{ceil:>6.1%} {ratio(t_ref)} {ratio(t_fla)}  {status}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
