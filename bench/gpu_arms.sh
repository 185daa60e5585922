#!/usr/bin/env bash
# Decode graph replays of several src/ trees side by side on one GPU: a short bench/engine.py run at `small` per
# arm (it captures every decode graph, 1-64 rows, then times one replay of each on a fixed step and saves its
# logits), the arms in turn, ROUNDS times; then bench/arms.py's table (each arm's fastest round, its ratio to the
# first arm) and each arm's logits against the first's. Cheaper than bench/gpu_ab.sh (no load runs): about 30 s an
# arm once the kernels are compiled, so many variants fit one call.
#   ARMS     "name=src_dir ..." (required; the first is the baseline), e.g. an older commit's:
#            git archive <commit> src | tar -x -C /tmp/old   ->   ARMS="main=src old=/tmp/old/src"
#   SAME=1   exit 1 unless every arm's logits are bit-equal to the first's
#   EXPERTS  the routed experts' storage (mxfp4); ROUNDS (2); T each run's limit in seconds (90), T0 the first's
#            (240: a fresh machine compiles every kernel); STOP stop starting runs after this many seconds (480)
# Writes arms.txt under $OUT (or /tmp/k3out).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1
[ -n "${ARMS:-}" ] || { echo "ARMS=\"name=src_dir ...\" is required" >&2; exit 2; }
E=${EXPERTS:-mxfp4}
B="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 4096
   --max-num-seqs 64 --concurrency 1 --num-requests 2 --output-len 16 --warmup 1 --prompt-len 256 --experts $E"
limit=${T0:-240}
for r in $(seq "${ROUNDS:-2}"); do
  for arm in $ARMS; do
    [ "$SECONDS" -gt "${STOP:-480}" ] && break 2
    name=${arm%%=*}
    echo "== arm $name: src ${arm#*=}, experts $E, round $r ($SECONDS s)"
    # shellcheck disable=SC2086  # B is a word list
    PYTHONPATH="${arm#*=}" timeout -s ABRT "$limit" $B --save-decode-logits "$OUT/logits_$name.pt" 2>&1 |
      grep -E "decode graph|Error|error|Traceback"
    limit=${T:-90}
  done
done 2>&1 | tee "$OUT/arms.txt"
same=(); [ "${SAME:-0}" = 1 ] && same=(--same)
python3 bench/arms.py "$OUT/arms.txt" --logits "$OUT" "${same[@]}" | tee -a "$OUT/arms.txt"
rc=${PIPESTATUS[0]}
rm -f "$OUT"/logits_*.pt
exit "$rc"
