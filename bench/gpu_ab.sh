#!/usr/bin/env bash
# An A/B of the engine on one GPU: bench/engine.py at the `small` shape, arm a then arm b (ROUNDS times), for each
# expert storage: tok/s, TTFT and ITL at concurrency 1 and 64, each decode graph's replay time, and each decode
# graph's logits on a fixed step, compared between the arms (bit-equal, or the largest difference).
#   A_ENV, B_ENV   each arm's environment, e.g. B_ENV="K3_PDL=off"
#   A_SRC, B_SRC   each arm's src/ tree (default this checkout's), e.g. an older commit's:
#                  git archive <commit> src | tar -x -C /tmp/old   ->   B_SRC=/tmp/old/src
#   SAME=1         exit 1 unless every decode graph's logits are bit-equal: for a switch that moves work (where a
#                  kernel runs, when it starts), never what it computes
#   EXPERTS        the routed experts' storages (mxfp4); ROUNDS (1) rounds, a then b in odd rounds and b then a
#                  in even ones, so neither arm always runs first (noise: ITL p99 at 64 streams varied 8-19 ms
#                  between identical runs on an H100); T each run's limit (s; 300: a fresh machine compiles every
#                  kernel in its first run); ENGINE_ARGS appended to bench/engine.py's
# Writes ab.txt under $OUT (or /tmp/k3out), ending with each graph's replay in both arms and their ratio. The switches measured so far (docs/operations.md has the figures):
#   B_ENV=K3_PDL=off SAME=1 bash bench/gpu_ab.sh
#   B_ENV=K3_OVERLAP=off SAME=1 EXPERTS="mxfp4 bf16" bash bench/gpu_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
export PYTHONUNBUFFERED=1
B="python3 -X faulthandler bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 4096
   --max-num-seqs 64 --concurrency 1,64 --num-requests 6,128 --output-len 256,128 --warmup 8 --prompt-len 256"
KEEP="requests, concurrency|output tok/s|^ +[0-9]|decode graph|decode logits|WARNING|Error|error|Traceback"

arm() {  # arm (a / b), expert storage, round
  local src=${A_SRC:-$ROOT/src} vars=${A_ENV:-}
  [ "$1" = b ] && src=${B_SRC:-$ROOT/src} vars=${B_ENV:-}
  echo "== arm $1: ${vars:-(no env)}, src $src, experts $2, round $3"
  # shellcheck disable=SC2086  # B, vars and ENGINE_ARGS are word lists
  env $vars PYTHONPATH="$src" timeout -s ABRT "${T:-300}" $B --experts "$2" ${ENGINE_ARGS:-} \
    --save-decode-logits "$OUT/logits_$1.pt" 2>&1 | grep -E "$KEEP"
}

compare() {  # the last round's decode logits of the two arms; rc 1 if SAME=1 and any differ
  python3 - "$OUT" "${SAME:-0}" <<'PY'
import os, sys, torch
out, same_required = sys.argv[1], sys.argv[2] == "1"
paths = [f"{out}/logits_{a}.pt" for a in ("a", "b")]
if not all(map(os.path.exists, paths)):
    print("decode logits: not saved by both arms (no decode graphs, or a run failed)")
    sys.exit(1 if same_required else 0)
a, b = map(torch.load, paths)
equal = a.keys() == b.keys() and all(torch.equal(a[bs], b[bs]) for bs in a)
for bs in sorted(a.keys() & b.keys()):
    x, y = a[bs].float(), b[bs].float()
    print(f"decode logits B{bs}: bit-equal {torch.equal(a[bs], b[bs])}, max |a - b| {(x - y).abs().max().item():.3e}, "
          f"same argmax {(x.argmax(-1) == y.argmax(-1)).float().mean().item():.0%}")
sys.exit(1 if same_required and not equal else 0)
PY
}

run_all() {
  local status=0
  for e in ${EXPERTS:-mxfp4}; do
    for r in $(seq "${ROUNDS:-1}"); do
      if [ $((r % 2)) = 1 ]; then arm a "$e" "$r"; arm b "$e" "$r"; else arm b "$e" "$r"; arm a "$e" "$r"; fi
    done
    compare || status=1
    rm -f "$OUT/logits_a.pt" "$OUT/logits_b.pt"
  done
  return $status
}
summary() {  # each decode graph's replay (the fastest round of each arm) and b / a, per expert storage
  python3 bench/arms.py "$OUT/ab.txt"
}
run_all 2>&1 | tee "$OUT/ab.txt"
rc=${PIPESTATUS[0]}
summary | tee -a "$OUT/ab.txt"
echo "rc=$rc" | tee -a "$OUT/ab.txt"
exit "$rc"
