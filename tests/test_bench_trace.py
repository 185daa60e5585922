"""bench/trace_kernels.py on a trace of the shape torch.profiler writes: kernels in start order from the
named one, and the summary's totals (a CPU trace, which has no kernels, is refused with a message)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "trace_kernels.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_trace_kernels_orders_by_start_and_sums_by_name(tmp_path):
    k = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                               "args": {"grid": [4, 1, 1], "registers per thread": 32, "shared memory": 0}}
    events = [k("b", 130.0, 5.0), k("a", 100.0, 10.0), {"cat": "cpu_op", "name": "x", "ts": 90, "dur": 1},
              k("c", 112.0, 30.0), k("a", 150.0, 2.0)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = run(str(path), "--after", "c", "0", "--count", "2").stdout.splitlines()[1:]
    assert [r.split()[3] for r in rows] == ["c", "b"], rows
    assert rows[0].split()[:3] == ["12.0", "42.0", "30.0"], rows  # µs from the first kernel (a at 100)
    summary = run(str(path), "--summary").stdout.splitlines()
    assert summary[0] == "4 kernels over 52.0 us, 47.0 us summed", summary
    assert summary[1].split()[:3] == ["30.0", "us", "1x"] and summary[1].endswith("c"), summary
    assert summary[2].split()[:5] == ["12.0", "us", "2x", "6.0", "us"] and summary[2].endswith("a"), summary
    # a 100-110, c 112-142 (2 idle before it), b 130-135 inside c (adds 0), a 150-152 (8 idle before it)
    critical = run(str(path), "--critical").stdout.splitlines()
    assert critical[0] == "4 kernels over 52.0 us, 52.0 us charged", critical
    charged = {r.split()[-1]: float(r.split()[0]) for r in critical[1:]}
    assert charged == {"c": 30.0, "a": 12.0, "(idle)": 10.0, "b": 0.0}, charged
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": events[2:3]}))
    refused = run(str(tmp_path / "cpu.json"))
    assert refused.returncode != 0 and "no kernels" in refused.stderr, refused.stderr
