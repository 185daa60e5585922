#!/usr/bin/env bash
# Async scheduling on one GPU (`small`, bf16, random weights): bench/engine.py --async-scheduling both (each
# workload overlapped, then waited, on one model and engine) for closed-loop decode at concurrency 1/64/256
# (prompt 284) and for the steady and staggered traffic workloads; then bench/profile_step.py --step-kinds at
# 24 and 48 layers (host time against depth). Writes async.txt under $OUT (or /tmp/k3out); about 8.5 minutes
# (T_DECODE 200 + T_TRAFFIC 170 + 2 x T_KINDS 70 s at most; LAYERS="" skips the step kinds).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src
E="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --async-scheduling both"
KEEP="requests, concurrency|^ +[0-9]|^workload|^(steady|staggered) |Error|error|eager step|decode graph replay|model ready"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  echo "== decode: concurrency 1, 64, 256 (async, then sync, per row)"
  timeout -s ABRT "${T_DECODE:-200}" $E --prompt-len 284 --max-model-len 4096 --warmup 8 --concurrency 1,64,256 \
    --num-requests 12,256,512 --output-len 256,128,64 2>&1 | grep -E "$KEEP"
  echo "== traffic: steady, staggered"
  timeout -s ABRT "${T_TRAFFIC:-170}" $E --max-model-len 16384 --workload steady,staggered 2>&1 | grep -E "$KEEP" | tail -8
  for layers in ${LAYERS-24 48}; do
    echo "== step kinds, $layers layers"
    timeout -s ABRT "${T_KINDS:-70}" python3 bench/profile_step.py --step-kinds --dtype bfloat16 --layers $layers 2>&1 \
      | grep -vE " INFO |^INFO" | tail -9
  done
} 2>&1 | tee "$OUT/async.txt"
