"""The kernels of a Chrome trace (bench/profile_step.py --trace) in start order, with their start, end and
duration (µs from the trace's first kernel), grid, registers and shared memory: one layer's window shows which
kernels overlap and which waited (with PDL a kernel's time includes its wait for the one before it).

    python bench/trace_kernels.py decode_B4.json --after _sum_kernel 9 --count 22   # the 10th MoE layer
    python bench/trace_kernels.py decode_B1.json.gz --summary                        # totals by kernel name
    python bench/trace_kernels.py decode_B1.json.gz --critical                       # what lengthens the step

--critical charges each moment of the step's span to the kernel that extended it: in start order, a kernel adds
the part of its interval past every earlier kernel's end (its work after the one it waited for, under PDL), and
moments with no kernel running are `(idle)`. The figures add up to the span, so, unlike durations, they show
where removing or shortening a kernel can shorten the step.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def kernels(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--after", nargs=2, metavar=("NAME", "N"), help="start at the N-th (from 0) kernel named NAME")
    ap.add_argument("--count", type=int, default=30, help="kernels to print")
    ap.add_argument("--summary", action="store_true", help="calls, summed and mean time by name, and the span")
    ap.add_argument("--critical", action="store_true", help="the span charged to the kernels that extended it")
    a = ap.parse_args()
    ks = kernels(a.trace)
    if not ks:
        raise SystemExit(f"{a.trace}: no kernels (a CPU trace?)")
    t0 = ks[0]["ts"]
    if a.summary or a.critical:
        by = defaultdict(lambda: [0, 0.0])
        reach = t0  # the latest end so far
        for e in ks:
            end = e["ts"] + e["dur"]
            by[e["name"]][0] += 1
            if not a.critical:
                by[e["name"]][1] += e["dur"]
                continue
            if e["ts"] > reach:
                by["(idle)"][1] += e["ts"] - reach
            by[e["name"]][1] += max(0.0, end - max(reach, e["ts"]))
            reach = max(reach, end)
        span = max(e["ts"] + e["dur"] for e in ks) - t0
        what = "charged" if a.critical else "summed"
        print(f"{len(ks)} kernels over {span:.1f} us, {sum(v[1] for v in by.values()):.1f} us {what}")
        for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"{t:9.1f} us {n:5d}x {t / max(n, 1):7.1f} us  {name[:90]}")
        return
    start = 0
    if a.after:
        hits = [i for i, e in enumerate(ks) if e["name"] == a.after[0]]
        start = hits[int(a.after[1])]
    print(f"{'start':>9} {'end':>9} {'us':>6}  kernel, grid, registers, shared memory (bytes)")
    for e in ks[start:start + a.count]:
        g = e["args"]
        print(f"{e['ts'] - t0:9.1f} {e['ts'] + e['dur'] - t0:9.1f} {e['dur']:6.1f}  {e['name'][:44]:<44} "
              f"grid {g.get('grid')} regs {g.get('registers per thread')} smem {g.get('shared memory')}")


if __name__ == "__main__":
    main()
