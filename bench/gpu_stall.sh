#!/usr/bin/env bash
# decode_stall_ms on a GPU at the `small` shape (random weights, bf16), issue 16: bench/engine.py's
# long-prompt, staggered and steady workloads with the bound off (0) and at other values, side by side
# on one model (each value on prompts of its own), the prefill step times the runner measured at
# start-up, then bench/profile_step.py's kernel tables of a decode step and of small prefill steps
# (where a prefill step's fixed cost goes). Writes stall.txt (and the full outputs) under $OUT.
# Then staggered with max_prefill_delay_ms at DELAYS (prompts held to share one prefill step).
#   STALLS_LONG (default 0,20,30,45)  STALLS (default 0,30)  DELAYS (default 0,30,60,100)
#   T_LONG / T_MIXED / T_DELAY / T_PROF: seconds per run; SKIP="long mixed prof" leaves phases out
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src
ENGINE="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 16384"
KEEP="Fatal|Error|error|prefill graphs, device ms|steps that decode|decode_stall_ms|requests, concurrency|output tok/s|^ +[0-9]|^workload|^(steady|staggered|long-prompt) "
R="$OUT/stall.txt"; : > "$R"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  skip() { case " ${SKIP:-} " in *" $1 "*) return 0;; esac; return 1; }
  skip long || { echo "== long prompts, decode_stall_ms ${STALLS_LONG:-0,20,30,45}"
  timeout -s ABRT "${T_LONG:-240}" $ENGINE --workload long-prompt --decode-stall-ms "${STALLS_LONG:-0,20,30,45}" \
    >"$OUT/engine-long.txt" 2>&1
  grep -E "$KEEP" "$OUT/engine-long.txt" | awk '!seen[$0]++' | tail -40; }
  skip mixed || { echo "== staggered and steady, decode_stall_ms ${STALLS:-0,30}"
  timeout -s ABRT "${T_MIXED:-200}" $ENGINE --workload staggered,steady --decode-stall-ms "${STALLS:-0,30}" \
    >"$OUT/engine-mixed.txt" 2>&1
  grep -E "$KEEP" "$OUT/engine-mixed.txt" | grep -v "prefill graphs, device ms" | awk '!seen[$0]++' | tail -30; }
  echo "== staggered, max_prefill_delay_ms ${DELAYS:-0,30,60,100}"
  timeout -s ABRT "${T_DELAY:-240}" $ENGINE --workload staggered --max-prefill-delay-ms "${DELAYS:-0,30,60,100}" \
    >"$OUT/engine-delay.txt" 2>&1
  grep -E "$KEEP|^staggered" "$OUT/engine-delay.txt" | awk '!seen[$0]++' | tail -20
  skip prof || { echo "== kernels of a decode step (B64) and of prefill steps of 256 and 512 tokens"
  timeout -s ABRT "${T_PROF:-100}" python3 bench/profile_step.py --batch 64 --prefill 512 --after-prefix 0:256 \
    --rows 14 >"$OUT/profile.txt" 2>&1
  grep -vE " INFO |^INFO" "$OUT/profile.txt" | tail -60; }
} 2>&1 | tee -a "$R"
