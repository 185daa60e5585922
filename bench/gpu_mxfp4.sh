#!/usr/bin/env bash
# Issue 18 on one GPU: MXFP4 routed experts kept packed, against the same weights dequantized to bf16.
#   kernels  bench/kernels_mxfp4.py: expert memory, check (every element) and time of the w4a16 kernel, both
#            in-register expansions, beside the bf16 kernel at 1..16384 tokens, small and K3 shapes (<= 9 min)
#   engine   bench/engine.py --random-weights small: MXFP4 vs the same weights as bf16, decode at batch 1 and
#            64 (weights, cache size, ITL, roofline share of the experts) (2 runs, <= 200 s each)
#   sweep    kernels_mxfp4 at small: tiles and the two expansions, one change at a time (<= 6 min)
#   ckpt     make-checkpoint --preset small (bf16, then --experts mxfp4) timed, and the MXFP4 one loaded from
#            disk and run by the in-process engine (<= 3 min)
# Writes mxfp4-<phase>.txt under $OUT (or /tmp/k3out). PHASES picks phases (default all: ~25 min, so run them
# as three commands: PHASES=kernels, PHASES=engine, PHASES="sweep ckpt"); T overrides each step's limit (s).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
KEEP="Thread|File |Fatal|kernels: |CUDA graphs|cache: |weights: |requests, concurrency|output tok/s|^ +[0-9]|roofline|decode graph|Error|error|FAILED"
B="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64"
step() { echo; echo "== $*"; timeout -s ABRT "${T:-240}" "$@" 2>&1; }
kept() { echo; echo "== $*"; timeout -s ABRT "${T:-240}" "$@" 2>&1 | grep -E "$KEEP|wrote|loaded" \
  | awk '!seen[$0]++' | head -40; }
kernels() { T=${T:-540} step python3 -X faulthandler bench/kernels_mxfp4.py --iters 30; }
sweep() { T=${T:-360} step python3 -X faulthandler bench/kernels_mxfp4.py --shapes small --no-check --tokens 1 --sweep \
  --sweep-tokens 1 16 64 256 512 8192 16384 --iters 20; }
engine() {
  local T=${T:-200}
  for e in mxfp4 mxfp4-as-bf16; do
    kept $B --experts $e --concurrency 1,64 --num-requests 4,128 --warmup 8 --prompt-len 256 --output-len 256,128
  done
}
ckpt() {
  local T=${T:-120}
  rm -rf /tmp/k3-small /tmp/k3-small-mx
  kept python3 -m k3backend make-checkpoint --preset small --out /tmp/k3-small
  rm -rf /tmp/k3-small
  kept python3 -m k3backend make-checkpoint --preset small --experts mxfp4 --out /tmp/k3-small-mx
  du -sh /tmp/k3-small-mx
  kept python3 -X faulthandler bench/engine.py --checkpoint /tmp/k3-small-mx --dtype bfloat16 --max-model-len 4096 \
    --max-num-seqs 16 --concurrency 16 --num-requests 32 --warmup 4 --prompt-len 128 --output-len 64
  rm -rf /tmp/k3-small-mx
}
for p in ${PHASES:-kernels engine sweep ckpt}; do $p | tee "$OUT/mxfp4-$p.txt"; done
