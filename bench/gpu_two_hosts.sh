#!/usr/bin/env bash
# Issue 19's GPU check on a machine with 2 GPUs: bench/two_hosts.py, two "hosts" of one GPU each
# (node 0 on GPU 0, `python -m k3backend worker` on GPU 1) over NCCL on loopback with P2P and shared
# memory off, against one GPU. float32 is the parity case (exit 1 unless the greedy tokens are
# equal); bfloat16 is shown for information. Writes two_hosts.txt (and each run's full log) under
# $OUT (or /tmp/k3out).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"; : >"$OUT/two_hosts.txt"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:${PYTHONPATH:-}
rc=0
for dtype in float32 bfloat16; do
  echo "== bench/two_hosts.py --device cuda --dtype $dtype" | tee -a "$OUT/two_hosts.txt"
  timeout -s ABRT 300 python3 -X faulthandler bench/two_hosts.py --device cuda --dtype $dtype \
    >"$OUT/two_hosts_$dtype.log" 2>&1 || { [ $dtype = float32 ] && rc=1; }
  grep -vE " INFO |^$|^frame #" "$OUT/two_hosts_$dtype.log" | tail -20 | tee -a "$OUT/two_hosts.txt"
done
exit $rc
