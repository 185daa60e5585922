#!/usr/bin/env bash
# Issue 16's real traffic on a GPU at the `small` shape (random weights, bf16): bench/engine.py's named
# workloads (steady, staggered, long-prompt, images) and bench/profile_step.py --step-kinds (host and
# device time of each step kind), on this tree's src/ and, when OLD_SRC names a copy of an older src/,
# on that one too, the same bench scripts for both; ends with one side-by-side table.
#   git -C /work/main archive t15m src | tar -x -C .old     # then carry .old and run with OLD_SRC=.old/src
#   OLD_SRC=.old/src bash bench/gpu_traffic.sh
# Writes traffic.txt (the table) and engine-*.txt / kinds-*.txt (full output) under $OUT (or /tmp/k3out).
# T_ENGINE / T_KINDS: seconds per engine / profile run (190 / 60: both trees fit in ~9 minutes; the
# engine prints its table after each workload, so a run cut short still reports the finished ones);
# DEPTH=1 adds the step kinds at 48 layers for this tree (host time against depth).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1
ENGINE="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 16384
  --workload steady,staggered,long-prompt,images"
KINDS="python3 bench/profile_step.py --step-kinds --dtype bfloat16"
KEEP="Thread|File |Fatal|CUDA graphs|requests, concurrency|output tok/s|^ +[0-9]|^workload|^(steady|staggered|long-prompt|images) |Error|error"
TREES="new:$ROOT/src"
if [ -n "${OLD_SRC:-}" ]; then TREES="old:$(cd "$OLD_SRC" && pwd) $TREES"; fi

tree() {  # name src: both benches with PYTHONPATH=src (nothing else of k3backend on the path)
  local name=$1 src=$2
  echo; echo "== $name: $(PYTHONPATH=$src python3 -c 'import k3backend; print(k3backend.__file__)')"
  PYTHONPATH=$src timeout -s ABRT "${T_ENGINE:-190}" $ENGINE >"$OUT/engine-$name.txt" 2>&1
  grep -E "$KEEP" "$OUT/engine-$name.txt" | awk '!seen[$0]++' | tail -30
  PYTHONPATH=$src timeout -s ABRT "${T_KINDS:-60}" $KINDS >"$OUT/kinds-$name.txt" 2>&1
  grep -vE " INFO |^INFO" "$OUT/kinds-$name.txt" | tail -9
}

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for t in $TREES; do tree "${t%%:*}" "${t#*:}"; done
  if [ "${DEPTH:-0}" = 1 ]; then
    echo; echo "== new, 48 layers"
    PYTHONPATH=$ROOT/src timeout -s ABRT "${T_KINDS:-60}" $KINDS --layers 48 2>&1 | grep -vE " INFO |^INFO" | tail -8
  fi
  echo; echo "== side by side (old -> new)"
  python3 - "$OUT" $TREES <<'PY'
import re, sys
out, trees = sys.argv[1], [t.split(":")[0] for t in sys.argv[2:]]
def rows(path, first):  # lines of a table after its header line, keyed by their first field(s)
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    start = max((i for i, l in enumerate(lines) if l.startswith(first)), default=None)  # the last table
    got = {}
    for l in lines[start + 1:] if start is not None else []:
        if not l.strip():
            break
        m = re.match(r"(.*?\S)\s{2,}(.*)$", l) if first == "step kind" else re.match(r"(\S+\s+\d+\s+\S+\s+\S+\s+\S+)\s+(.*)$", l)
        if m:
            got[m.group(1).strip()] = m.group(2).split()
    return got
for table, first, cols in (("engine", "workload", "tok/s TTFT-p50 TTFT-p99 ITL-p50 ITL-p99 (ms)"),
                           ("kinds", "step kind", "host-ms wall-ms kernels device-ms searchsorted")):
    print(f"\n{table}: {cols}, each as " + " -> ".join(trees))
    data = {t: rows(f"{out}/{table}-{t}.txt", first) for t in trees}
    for key in dict.fromkeys(k for t in trees for k in data[t]):
        vals = [data[t].get(key, []) for t in trees]  # a tree that failed has no row: "?"
        width = max(5, *map(len, vals))
        print(f"{key:<48} " + "  ".join(" -> ".join(v[i] if i < len(v) else "?" for v in vals) for i in range(width)))
PY
} 2>&1 | tee "$OUT/traffic.txt"
