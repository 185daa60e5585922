#!/usr/bin/env bash
# The served path at engine speed (issue 15), measured as a user would, on one GPU at the `small` shape:
# make-checkpoint --preset small (bf16), tritonserver on it, closed-loop gRPC streaming load through k3_lm and
# k3_ensemble (bench/serving_load.py) at concurrency 1, 64 and 256, py-spy of the k3_lm stub and engine core at
# 256, then bench/engine.py (the engine core in process) on the same checkpoint, lengths and concurrencies.
# Carry .dev (bench/make_gpu_bundle.sh). Writes serve-small.txt, server.log, profile-*.txt under $OUT.
# MODELS="k3_lm" skips the ensemble's runs (each load run takes a minute or more with its client start-up).
# On a fresh machine the first runs compile Triton kernels (cold cache): for a side-by-side ratio, run the
# script twice on the same machine and compare the second run's figures; the in-process pass begins with two
# short workloads that only warm that cache (their rows are not the comparison).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
. bench/gpu_common.sh
k3_gpu_prepare
R="$OUT/serve-small.txt"; : > "$R"
say() { echo "$*" | tee -a "$R"; }
CK=/tmp/k3small
T0=$(date +%s)
[ -f $CK/config.json ] || python3 -m k3backend make-checkpoint --preset small --out $CK 2>&1 | tail -3 | tee -a "$R"
say "checkpoint ready after $(( $(date +%s) - T0 )) s"
say "== in process, same checkpoint and lengths (the first two workloads only warm the kernel cache)"
timeout 200 python3 bench/engine.py --checkpoint $CK --dtype bfloat16 --prompt-len 284 --max-model-len 4096 --warmup 8 \
  --concurrency 64,256,1,64,256 --num-requests 64,256,12,256,512 --output-len 16,16,256,128,64 2>&1 \
  | grep -E "requests, concurrency|output tok/s|^ +[0-9]|roofline|model ready|decode graph" | tee -a "$R"
k3_gpu_small_repo $CK
say "engine pass done after $(( $(date +%s) - T0 )) s"
k3_gpu_serve $REPO 400 || exit 1
say "server ready after $(( $(date +%s) - T0 )) s"
grep -E "k3_lm: (stub|worker)|cache: |loaded" "$OUT/server.log" | head -8 | tee -a "$R"
STUB=$(grep -oP 'k3_lm: stub pid \K[0-9]+' "$OUT/server.log" | head -1)
CORE=$(grep -oP 'engine core pid \K[0-9]+' "$OUT/server.log" | head -1)
L="python3 bench/serving_load.py --url localhost:8001 --metrics-url localhost:8002 --tokenizer $CK --prompt-len 284 --procs 8"
for model in ${MODELS:-k3_lm k3_ensemble}; do
  [ $model = k3_lm ] && timeout 120 $L --model $model --concurrency 1 --num-requests 12 --output-len 256 --warmup 2 2>&1 | tail -3 | tee -a "$R"
  timeout 120 $L --model $model --concurrency 64 --num-requests 256 --output-len 128 2>&1 | tail -3 | tee -a "$R"
  if [ $model = k3_lm ]; then
    SPY=/tmp/k3site/bin/py-spy
    ( sleep 12; $SPY record -r 100 -d 8 --nonblocking -f raw -o "$OUT/profile-stub.txt" -p "$STUB" >/dev/null 2>&1 ) &
    ( sleep 12; $SPY record -r 100 -d 8 --nonblocking -f raw -o "$OUT/profile-core.txt" -p "$CORE" >/dev/null 2>&1 ) &
  fi
  timeout 150 $L --model $model --concurrency 256 --num-requests 512 --output-len 64 2>&1 | tail -3 | tee -a "$R"
done
wait
kill $SERVER; wait $SERVER
grep -iE "error|traceback" "$OUT/server.log" | grep -viE "nvml|dcgm|CudaDriver" | head -10 | tee -a "$R"
say "total $(( $(date +%s) - T0 )) s"
for f in "$OUT"/profile-*.txt; do
  [ -f "$f" ] || continue
  python3 bench/spy_summary.py "$f" | tee -a "$R"
done
