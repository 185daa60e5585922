#!/usr/bin/env bash
# Issue 17 on one GPU: the end-to-end numerics check of bench/agreement.py at the small preset (6 B parameters,
# bf16, conditioned random init): fused path and bf16 torch reference against the fp32 reference, teacher-forced
# over 4 x 512 prompt rows (prefill) and 128 cached decode steps, then the old greedy agreement table (4 x 256).
#   clean    expect the rule to PASS (rc=0)
#   planted  the fused attn_res_mix_norm's output x (1 + 2^-6): expect the rule to FAIL (rc=1) while the greedy table
#            looks like the clean run's
#   default  the clean check on the default random init (chaotic: errors ~1 whatever the kernels do), no greedy
# Writes numerics.txt under $OUT (or /tmp/k3out); at most 7.2 min (limits 180 + 150 + 100 s). PHASES picks phases,
# T overrides each run's limit (s).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
A="python3 -X faulthandler bench/agreement.py --preset small --prompts 4 --prompt-len 512 --decode-steps 128"
run() {  # the tables, the kernel choices once, and the exit status of the check
  echo; echo "== $*"
  timeout -s ABRT "${T:-150}" "$@" 2>&1 | grep -vE "^$|^INFO (cache|capacity|engine)" | awk '!seen[$0]++'
  echo "rc=${PIPESTATUS[0]}"
}
clean() { T=${T:-180} run $A --output-len 256 --conditioned; }  # the first run also compiles the kernels
planted() { T=${T:-150} run $A --output-len 256 --conditioned --plant attn_res_mix_norm; }
default() { T=${T:-100} run $A --prompts 2 --prompt-len 256 --decode-steps 16; }
for p in ${PHASES:-clean planted default}; do $p; done | tee "$OUT/numerics.txt"
