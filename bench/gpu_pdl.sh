#!/usr/bin/env bash
# Programmatic dependent launch on one GPU: bench/engine.py at the `small` shape (MXFP4 experts) with
# K3_PDL=on and K3_PDL=off, one after the other: ITL and tok/s at concurrency 1 and 64, each decode graph's
# replay time, and each decode graph's logits on a fixed step, which must be bit-equal between the two
# (PDL changes when a kernel starts, never what it computes). Writes pdl.txt under $OUT (or /tmp/k3out).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
B="python3 bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64
   --experts mxfp4 --concurrency 1,64 --num-requests 6,128 --output-len 256,128 --warmup 4 --prompt-len 256"
{
  for mode in on off; do
    echo "== K3_PDL=$mode"
    K3_PDL=$mode timeout "${T:-240}" $B --save-decode-logits "$OUT/logits_pdl_$mode.pt" 2>&1 \
      | grep -E "requests, concurrency|output tok/s|^ +[0-9]|decode graph|decode logits|Error|error"
  done
  python3 - "$OUT" <<'PY'
import sys, torch
a, b = (torch.load(f"{sys.argv[1]}/logits_pdl_{m}.pt") for m in ("on", "off"))
same = {bs: torch.equal(a[bs], b[bs]) for bs in sorted(a)}
print("decode logits, K3_PDL on == off bit for bit:", same)
sys.exit(0 if a.keys() == b.keys() and all(same.values()) else 1)
PY
  echo "rc=$?"
} | tee "$OUT/pdl.txt"
