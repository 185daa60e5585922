#!/usr/bin/env bash
# bench/engine.py on a GPU at the `small` shape (random weights, bf16): the fused kernels with CUDA
# graphs (K3_KERNELS=auto) and the torch reference path (K3_KERNELS=ref) side by side in one run,
# each beside the roofline floor of its steps; then bench/agreement.py (bf16 engine vs fp32 reference).
# Writes engine.txt under $OUT (or /tmp/k3out). T: seconds per phase; PHASES to pick some.
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
B="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 8192"
KEEP="Thread|File |Fatal|kernels: |CUDA graphs|cache: |requests, concurrency|output tok/s|^ +[0-9]|roofline|decode graph|expert load|Error|error"
run() { echo; echo "== K3_KERNELS=$K $*"; K3_KERNELS=$K timeout -s ABRT "${T:-150}" "$@" 2>&1 | grep -E "$KEEP" | awk '!seen[$0]++' | head -40; }
fused() {
  K=auto
  run $B --concurrency 1 --num-requests 4 --warmup 1 --prompt-len 256 --output-len 256
  run $B --concurrency 16 --num-requests 64 --warmup 16 --prompt-len 256 --output-len 128
  run $B --concurrency 64 --num-requests 192 --warmup 64 --prompt-len 256 --output-len 128
  run $B --concurrency 256 --num-requests 512 --warmup 256 --prompt-len 256 --output-len 64
  run $B --concurrency 1 --num-requests 3 --warmup 1 --prompt-len 4096 --output-len 1
  run $B --concurrency 16 --num-requests 32 --warmup 2 --prompt-len 64 --output-len 16 --shared-prefix-len 2048 --shared-prefix-fraction 1.0
  run $B --concurrency 64 --num-requests 128 --warmup 64 --prompt-len 256 --output-len 64 --enforce-eager
}
reference() {
  K=ref
  run $B --concurrency 1 --num-requests 2 --warmup 1 --prompt-len 256 --output-len 16
  run $B --concurrency 64 --num-requests 64 --warmup 0 --prompt-len 256 --output-len 8
  run $B --concurrency 1 --num-requests 1 --warmup 1 --prompt-len 4096 --output-len 1
}
profile() {  # py-spy (carried in .dev/whl, installed by gpu_kernels.sh or here) over whole runs: host time by thread
  python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/py_spy-*.whl 2>&1 | tail -1
  for c in 1 64; do
    echo; echo "== py-spy of concurrency $c -> $OUT/spy-c$c.txt"
    K3_KERNELS=auto timeout 150 /tmp/k3site/bin/py-spy record -r 250 -f raw -o "$OUT/spy-c$c.txt" -- $B \
      --concurrency $c --num-requests $((2 * c)) --warmup $c --prompt-len 256 --output-len 256 2>&1 | grep -E "$KEEP" | tail -4
  done
}
agreement() {
  echo; echo "== bench/agreement.py"
  timeout "${T:-150}" python3 bench/agreement.py --preset small --prompts 4 --prompt-len 256 --output-len 768 2>&1 \
    | grep -vE " INFO |^$"
}
{ for p in ${PHASES:-fused reference agreement}; do $p; done; } | tee "$OUT/engine.txt"
