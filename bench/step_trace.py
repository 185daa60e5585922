"""Summarise K3_STEP_TRACE files (docs/operations.md "A trace of the engine's steps"), side by side.

    K3_STEP_TRACE=/tmp/served.jsonl scripts/serve ...   # then load it (bench/serving_load.py)
    K3_STEP_TRACE=/tmp/inproc.jsonl python bench/engine.py ...
    python bench/step_trace.py /tmp/served.jsonl /tmp/inproc.jsonl [--since 10]

Per file: the steps, how many carried prompt tokens and how many of those also decoded, prompt
tokens and new requests per such step (mean and percentiles), how the requests that arrived were
spread over steps, the prompts left waiting, heavy steps, and the wall time between steps of each
kind. When requests come in waves (a closed loop), a wave that is split over more prefill steps
shows as fewer new requests per prefill step and more prompts waiting.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def summary(steps: list[dict]) -> dict[str, str]:
    """Rows of the table for one trace (values formatted)."""
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])]
    prefill = [i for i, s in enumerate(steps) if s["prefill"]]
    decode_only = [i for i, s in enumerate(steps) if not s["prefill"]]
    gap_after = lambda idx: [gaps[i] * 1e3 for i in idx if i < len(gaps)]  # noqa: E731 - ms until the next step

    def dist(values: list[float], fmt: str = "{:.0f}") -> str:
        if not values:
            return "-"
        return f"{fmt.format(statistics.mean(values))} (p50 {fmt.format(pct(values, 50))}, " \
               f"p90 {fmt.format(pct(values, 90))}, max {fmt.format(max(values))})"

    added = [s["added"] for s in steps]
    return {
        "steps": f"{len(steps)} over {steps[-1]['t'] - steps[0]['t']:.2f} s" if steps else "0",
        "steps with prompt tokens": f"{len(prefill)} ({sum(1 for i in prefill if steps[i]['decode'])} also decoding)",
        "prompt tokens per such step": dist([steps[i]["prefill"] for i in prefill]),
        "new requests per such step": dist([steps[i]["new"] for i in prefill], "{:.1f}"),
        "requests added per step": f"{sum(added)} in {sum(1 for a in added if a)} steps, "
                                   f"{dist([a for a in added if a], '{:.1f}')} when any",
        "prompts waiting after a step": dist([s["waiting"] for s in steps], "{:.1f}"),
        "heavy steps": str(sum(1 for s in steps if s["heavy"])),
        "ms to next step, prompt steps": dist(gap_after(prefill), "{:.1f}"),
        "ms to next step, decode only": dist(gap_after(decode_only), "{:.1f}"),
        "ms waited for the device": dist([s["waited_ms"] for s in steps], "{:.1f}"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--since", type=float, default=0.0, help="skip the first seconds of each trace (warm-up)")
    args = ap.parse_args(argv)
    tables = {}
    for path in args.traces:
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        start = steps[0]["t"] + args.since if steps else 0.0
        tables[path.name] = summary([s for s in steps if s["t"] >= start])
    for path_name, rows in tables.items():
        print(f"== {path_name}")
        for key, value in rows.items():
            print(f"  {key:32s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
