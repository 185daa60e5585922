#!/usr/bin/env bash
# bench/engine.py on a GPU at the `small` shape (random weights, bf16), the engine-core figures:
# decode at concurrency 1, 16, 64, a 4096-token prefill, and a shared-prefix workload.
# Writes engine.txt under $OUT (or /tmp/k3out). K3_KERNELS selects the kernels (ref | triton | auto).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
B="python3 bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 8192"
run() { echo; echo "== $*"; timeout "${T:-240}" "$@" 2>&1 | grep -vE " INFO |^$" | tail -4; }
{
  run $B --concurrency 1 --num-requests 6 --warmup 2 --prompt-len 256 --output-len 48 --expert-stats
  run $B --concurrency 16 --num-requests 32 --warmup 2 --prompt-len 256 --output-len 32
  run $B --concurrency 64 --num-requests 64 --warmup 2 --prompt-len 256 --output-len 24
  run $B --concurrency 1 --num-requests 2 --warmup 1 --prompt-len 4096 --output-len 1
  run $B --concurrency 16 --num-requests 32 --warmup 2 --prompt-len 64 --output-len 16 --shared-prefix-len 2048 --shared-prefix-fraction 1.0
} | tee "$OUT/engine.txt"
