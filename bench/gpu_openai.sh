#!/usr/bin/env bash
# The OpenAI gateway's overhead on a GPU machine: bench/openai_overhead.py (TTFT p50 and decode
# speed through the gateway vs k3_ensemble over gRPC, concurrency 1 and 64) against tritonserver
# serving the `small` checkpoint (random weights, bf16): one gateway process and 4 processes (--workers 4),
# against k3_ensemble and (MODELS) k3_lm, then the gateway against a fake server.
#
# Carried inputs as for bench/gpu_serving.sh (.dev/tritonserver.tar.xz and .dev/whl/, built by
# bench/make_gpu_bundle.sh; setup shared in bench/gpu_common.sh); the GPU image has aiohttp and
# grpcio. Writes under $OUT (or /tmp/k3out): server.log, openai.txt (the tables). The `small`
# checkpoint is written to /tmp/k3small first if missing (a few minutes, about 12 GB of disk; do it in
# a call of its own where calls are limited to 10 minutes); CKPT=tiny serves the built-in one instead.
# GATEWAYS: the gateway argument sets to compare, ';'-separated (default "--workers 1;--workers 4";
# an empty set is the default, one process per 4 CPUs);
# FAKE=0 leaves out the run against the fake server; REPEATS: ABBA pairs per concurrency (default 1);
# MODELS: the Triton models both paths call, ' '-separated (default k3_ensemble; k3_lm compares the gateway
# with k3_lm over gRPC, both without the ensemble's k3_vision hop).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
. bench/gpu_common.sh
k3_gpu_prepare
REPO=$ROOT/model_repository
if [ "${CKPT:-small}" = small ]; then
  [ -e /tmp/k3small/config.json ] || timeout 900 python3 -m k3backend make-checkpoint --preset small --out /tmp/k3small \
    || { echo "make-checkpoint failed"; exit 1; }
  k3_gpu_small_repo /tmp/k3small  # REPO=/tmp/k3repo: k3_lm and k3_vision on it, bf16, as bench/gpu_serve_small.sh
fi
k3_gpu_serve "$REPO" 900 || exit 1
grep -E "k3_lm: (stub|worker)|cache:" "$OUT/server.log" | head -10
# Each gateway argument set against each model; then the gateway alone against tests/fake_triton.py (one
# token per 10 ms for every request, no model): its own cost here.
IFS=';' read -ra SETS <<< "${GATEWAYS:---workers 1;--workers 4}"  # gateway argument sets, ';'-separated
for MODEL in ${MODELS:-k3_ensemble}; do  # k3_lm: both paths skip the ensemble (the gateway's own cost)
for ARGS in "${SETS[@]}"; do
  echo "== $MODEL, gateway ${ARGS:-defaults}" | tee -a "$OUT/openai.txt"
  timeout "${T:-400}" python3 bench/openai_overhead.py --grpc-url 127.0.0.1:8001 --concurrency ${CONC:-1 64} \
    --max-tokens 128 --prompt-chars 512 --client-procs 8 --repeats "${REPEATS:-1}" --triton-model "$MODEL" \
    --gateway-args "$ARGS" 2>&1 | grep -v INFO | tee -a "$OUT/openai.txt"
done
done
[ "${FAKE:-1}" = 0 ] || { echo "== gateway against tests/fake_triton.py" | tee -a "$OUT/openai.txt"
timeout "${T:-400}" python3 bench/openai_overhead.py --fake-step-ms 10 --concurrency 1 64 --max-tokens 128 \
  --prompt-chars 512 --client-procs 8 2>&1 | grep -v INFO | tee -a "$OUT/openai.txt"; }
kill $SERVER; wait $SERVER
grep -iE "error|traceback" "$OUT/server.log" | grep -viE "nvml|dcgm" | head -20
