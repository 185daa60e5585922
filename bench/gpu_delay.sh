#!/usr/bin/env bash
# max_prefill_delay_ms on one GPU at the `small` shape (issues 15 and 16): whether holding the waiting prompts
# for a few milliseconds, so that a wave of arrivals shares one prefill step, lowers TTFT and keeps decode fed.
#  1. served k3_lm (closed-loop gRPC streaming, bench/serving_load.py) at concurrency 1, 64 and 256 with
#     the delay at 0, then at each of SERVED_DELAYS (one server per value);
#  2. bench/engine.py in process on the same checkpoint and lengths, greedy as the served load, each delay in DELAYS;
#  3. bench/engine.py's staggered and steady workloads (random weights), each delay in DELAYS.
# Carry .dev (bench/make_gpu_bundle.sh). Writes delay.txt and the full outputs under $OUT.
#   SERVED_DELAYS (default 5; empty: delay 0 only)  DELAYS (default 0,5,15)  SKIP="served inproc staggered"
#   SERVED: instead of SERVED_DELAYS, the k3_lm parameter sets to serve, ';'-separated, each "key=value ..."
#     (e.g. SERVED="max_num_batched_tokens=8192;max_num_batched_tokens=4096"); the first set also runs concurrency 1;
#     an item src=DIR serves that set from an older tree's src/ (relative to the repository), e.g. a git archive
#     of the previous commit's src/ and bench/ unpacked under .dev/old (every set names at least one item):
#     SERVED="src=.dev/old/src max_prefill_delay_ms=0;max_prefill_delay_ms=0"
#   TRACE=1: K3_STEP_TRACE of each served server and in-process run, summarised by bench/step_trace.py
#   (issue 15: TRACE=1 SERVED_DELAYS= DELAYS=0 SKIP=staggered bash bench/gpu_delay.sh)
#   SPY=1: py-spy of the k3_lm stub and the engine core over a longer run at concurrency 256, with the last set
#   TURNAROUND="A/B ...": the in-process closed loop again with each client turnaround (bench/engine.py
#     --turnaround-ms: a successor leaves A ms after its request ended, plus B ms per earlier finisher of the step)
#   STAGGER=1: also a staggered load served and in process on the checkpoint (64 in flight, prompts 256 ± 64,
#     outputs 128 ± 48: requests end and arrive at different times, so no waves form)
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
. bench/gpu_common.sh
k3_gpu_prepare
R="$OUT/delay.txt"; : > "$R"
say() { echo "$*" | tee -a "$R"; }
skip() { case " ${SKIP:-} " in *" $1 "*) return 0;; esac; return 1; }
KEEP="requests, concurrency|output tok/s|^ +[0-9]|max_prefill_delay|^(steady|staggered) |Error|error"
CK=/tmp/k3small
T0=$(date +%s)
[ -f $CK/config.json ] || python3 -m k3backend make-checkpoint --preset small --out $CK 2>&1 | tail -1 | tee -a "$R"
k3_gpu_small_repo $CK
STAGGERED="--concurrency 64 --prompt-len 256 --prompt-len-std 64 --output-len 128 --output-len-std 48"
L="python3 bench/serving_load.py --url localhost:8001 --metrics-url localhost:8002 --tokenizer $CK --prompt-len 284 --procs 8 --model k3_lm"
trace() { [ "${TRACE:-0}" = 1 ] && echo "$OUT/trace-$1.jsonl"; }  # K3_STEP_TRACE of a run (empty: none)
IFS=';' read -ra SETS <<< "${SERVED-$(printf 'max_prefill_delay_ms=%s;' 0 ${SERVED_DELAYS-5})}"
first=1
PTH=$(python3 -c 'import site; print(site.getsitepackages()[0])')/k3backend-src.pth  # where the stub imports k3backend from
skip served || for set in "${SETS[@]}"; do
  echo "$ROOT/src" > "$PTH"
  for kv in $set; do
    case $kv in src=*) echo "$ROOT/${kv#src=}" > "$PTH";; *) k3_lm_param "${kv%%=*}" "${kv#*=}";; esac
  done
  name=$(echo "$set" | sed 's/ /_/g; s/[=/.]/-/g')
  K3_STEP_TRACE=$(trace "served-$name") k3_gpu_serve $REPO 400 || exit 1
  say "== served k3_lm, $set (server ready after $(( $(date +%s) - T0 )) s)"
  [ $first = 1 ] && timeout 100 $L --concurrency 64 --num-requests 64 --output-len 16 2>&1 | tail -2 | sed 's/^/(warm-up) /' | tee -a "$R"
  [ $first = 1 ] && timeout 100 $L --concurrency 1 --num-requests 12 --output-len 256 --warmup 2 2>&1 | tail -2 | tee -a "$R"
  first=0
  timeout 100 $L --concurrency 64 --num-requests 256 --output-len 128 2>&1 | tail -2 | tee -a "$R"
  timeout 120 $L --concurrency 256 --num-requests 512 --output-len 64 2>&1 | tail -2 | tee -a "$R"
  [ "${STAGGER:-0}" = 1 ] && timeout 100 $L $STAGGERED --num-requests 256 2>&1 | tail -2 | tee -a "$R"
  if [ "${SPY:-0}" = 1 ] && [ "$set" = "${SETS[-1]}" ]; then
    STUB=$(grep -oP 'k3_lm: stub pid \K[0-9]+' "$OUT/server.log" | head -1)
    CORE=$(grep -oP 'engine core pid \K[0-9]+' "$OUT/server.log" | head -1)
    for p in stub:$STUB core:$CORE; do
      ( sleep 4; /tmp/k3site/bin/py-spy record -r 100 -d 8 --nonblocking -f raw -o "$OUT/profile-${p%%:*}.txt" \
          -p "${p#*:}" >/dev/null 2>&1 ) &
    done
    timeout 120 $L --concurrency 256 --num-requests 2048 --output-len 64 2>&1 | tail -2 | sed 's/^/(profiled) /' | tee -a "$R"
    wait
  fi
  kill $SERVER; wait $SERVER
  grep -iE "error|traceback" "$OUT/server.log" | grep -viE "nvml|dcgm|CudaDriver" | head -5 | tee -a "$R"
done
echo "$ROOT/src" > "$PTH"
skip inproc || { say "== in process, same checkpoint and lengths, greedy, max_prefill_delay_ms ${DELAYS:-0,5,15} (the first workload warms)"
  K3_STEP_TRACE=$(trace inproc) timeout 200 python3 bench/engine.py --checkpoint $CK --dtype bfloat16 --temperature 0 --prompt-len 284 --max-model-len 4096 --warmup 8 \
    --concurrency 64,64,256 --num-requests 64,256,512 --output-len 16,128,64 --max-prefill-delay-ms "${DELAYS:-0,5,15}" \
    >"$OUT/engine-inproc.txt" 2>&1
  grep -E "$KEEP" "$OUT/engine-inproc.txt" | tee -a "$R"
  for t in ${TURNAROUND:-}; do
    tn=${t//\//-}  # 10/0.5 -> 10-0.5 in the file name
    timeout 200 python3 bench/engine.py --checkpoint $CK --dtype bfloat16 --temperature 0 --prompt-len 284 --max-model-len 4096 --warmup 8 \
      --concurrency 64,64,256 --num-requests 64,256,512 --output-len 16,128,64 --turnaround-ms "$t" \
      >"$OUT/engine-inproc-turnaround-$tn.txt" 2>&1
    grep -E "$KEEP|turnaround" "$OUT/engine-inproc-turnaround-$tn.txt" | tail -n +4 | tee -a "$R"
  done
  [ "${STAGGER:-0}" = 1 ] && { timeout 150 python3 bench/engine.py --checkpoint $CK --dtype bfloat16 --temperature 0 --max-model-len 4096 \
    --warmup 8 $STAGGERED --num-requests 256 >"$OUT/engine-inproc-staggered.txt" 2>&1
    grep -E "$KEEP" "$OUT/engine-inproc-staggered.txt" | tee -a "$R"; }; }
skip staggered || { say "== staggered and steady (random weights), max_prefill_delay_ms ${DELAYS:-0,5,15}"
  timeout 200 python3 bench/engine.py --random-weights small --dtype bfloat16 --max-model-len 16384 \
    --workload staggered,steady --max-prefill-delay-ms "${DELAYS:-0,5,15}" >"$OUT/engine-staggered.txt" 2>&1
  grep -E "$KEEP" "$OUT/engine-staggered.txt" | awk '!seen[$0]++' | tee -a "$R"; }
[ "${TRACE:-0}" = 1 ] && python3 bench/step_trace.py --since 5 "$OUT"/trace-*.jsonl 2>&1 | tee -a "$R"
for f in "$OUT"/profile-*.txt; do [ -f "$f" ] && python3 bench/spy_summary.py "$f" | tee -a "$R"; done
say "total $(( $(date +%s) - T0 )) s"
