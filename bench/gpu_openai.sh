#!/usr/bin/env bash
# The OpenAI gateway's overhead on a GPU machine: bench/openai_overhead.py (TTFT p50 and decode
# speed through the gateway vs k3_ensemble over gRPC, concurrency 1 and 64) against tritonserver
# serving the `small` checkpoint (random weights, bf16), with 1 and with 4 gateway processes.
#
# Carried inputs as for bench/gpu_serving.sh (.dev/tritonserver.tar.xz and .dev/whl/, built by
# bench/make_gpu_bundle.sh); the GPU image already has aiohttp and grpcio. Writes under $OUT (or
# /tmp/k3out): server.log, openai.txt (the tables). CKPT=tiny serves the built-in checkpoint
# instead (no checkpoint to write: the `small` one takes a few minutes and about 12 GB of disk).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
TS=/tmp/k3ts; mkdir -p $TS && tar -xJf .dev/tritonserver.tar.xz -C $TS
python3 -m pip install -q --no-index --no-deps .dev/whl/numpy-1.26.4-*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/tritonclient-*.whl \
  .dev/whl/python_rapidjson-*.whl 2>&1 | tail -1
echo "$ROOT/src" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/k3backend-src.pth"
export PYTHONPATH=/tmp/k3site K3_DEFAULT_CHECKPOINT=/tmp/k3ck PYTHONUNBUFFERED=1
REPO=$ROOT/model_repository
if [ "${CKPT:-small}" = small ]; then
  [ -e /tmp/k3small/config.json ] || timeout 900 python3 -m k3backend make-checkpoint --preset small --out /tmp/k3small \
    || { echo "make-checkpoint failed"; exit 1; }
  REPO=/tmp/k3repo; rm -rf $REPO; cp -r "$ROOT/model_repository" $REPO
  sed -i 's|key: "model_path" value: { string_value: "" }|key: "model_path" value: { string_value: "/tmp/k3small" }|' \
    $REPO/k3_lm/config.pbtxt $REPO/k3_vision/config.pbtxt
fi
LIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
LD_LIBRARY_PATH=$TS/ts/libs:$LIBDIR $TS/ts/bin/tritonserver --model-repository="$REPO" \
  --backend-directory=$TS/ts/backends --cuda-memory-pool-byte-size=0:1073741824 --http-address=127.0.0.1 \
  --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 >"$OUT/server.log" 2>&1 &
SERVER=$!
python3 - <<'PY' || { tail -50 "$OUT/server.log"; kill $SERVER; exit 1; }
import time, urllib.request
for _ in range(600):
    try:
        if urllib.request.urlopen("http://localhost:8000/v2/models/k3_ensemble/ready", timeout=2).status == 200:
            print("k3_ensemble ready"); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("server not ready")
PY
grep -E "k3_lm: (stub|worker)|cache:|engine started" "$OUT/server.log" | head -10
for W in 1 4; do
  timeout "${T:-400}" python3 bench/openai_overhead.py --grpc-url 127.0.0.1:8001 --concurrency 1 64 \
    --max-tokens 128 --prompt-chars 512 --client-procs 8 --gateway-args "--workers $W" 2>&1 \
    | grep -v INFO | tee -a "$OUT/openai.txt"
done
kill $SERVER; wait $SERVER
grep -iE "error|traceback" "$OUT/server.log" | grep -viE "nvml|dcgm" | head -20
