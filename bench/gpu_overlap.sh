#!/usr/bin/env bash
# The MoE layer's shared experts on a side stream (model/overlap.py) on one GPU: bench/engine.py at the `small`
# shape with K3_OVERLAP=off and on, one after the other, for MXFP4 and for bf16 routed experts: ITL, TTFT and
# tok/s at concurrency 1 and 64, each decode graph's replay time, and each decode graph's logits on a fixed step,
# which must be bit-equal between the two (the branch changes where a kernel runs, never what it computes).
# Writes overlap.txt under $OUT (or /tmp/k3out); rc 1 if any logits differ. EXPERTS picks (mxfp4 bf16), T the
# limit of each run (s; 300: the first run on a fresh machine also compiles every kernel).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
B="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 4096
   --max-num-seqs 64 --concurrency 1,64 --num-requests 6,128 --output-len 256,128 --warmup 8 --prompt-len 256"
run_all() {
local status=0
for e in ${EXPERTS:-mxfp4 bf16}; do
  for mode in off on; do
    echo "== experts $e, K3_OVERLAP=$mode"
    K3_OVERLAP=$mode timeout -s ABRT "${T:-300}" $B --experts "$e" --save-decode-logits "$OUT/logits_${e}_$mode.pt" \
      2>&1 | grep -E "requests, concurrency|output tok/s|^ +[0-9]|decode graph|Error|error|Traceback"
  done
  python3 - "$OUT" "$e" <<'PY' || status=1
import sys, torch
a, b = (torch.load(f"{sys.argv[1]}/logits_{sys.argv[2]}_{m}.pt") for m in ("off", "on"))
same = {bs: torch.equal(a[bs], b[bs]) for bs in sorted(a)}
print(f"{sys.argv[2]} experts: decode logits, K3_OVERLAP on == off bit for bit:", same)
sys.exit(0 if a.keys() == b.keys() and all(same.values()) else 1)
PY
  rm -f "$OUT/logits_${e}_off.pt" "$OUT/logits_${e}_on.pt"
done
return $status
}
run_all 2>&1 | tee "$OUT/overlap.txt"
rc=${PIPESTATUS[0]}
echo "rc=$rc" | tee -a "$OUT/overlap.txt"
exit "$rc"
