#!/usr/bin/env bash
# Serve model_repository/ on a GPU machine without Docker and check it end to end.
#
# Carried inputs, built by bench/make_gpu_bundle.sh (see docs/benchmarking.md): .dev/tritonserver.tar.xz (bin, backends/python with the
# 3.12 stub, libs) and .dev/whl/ (numpy 1.26.4 cp312 — the stub needs numpy<2 —, tritonclient,
# python-rapidjson, py-spy). Writes under $OUT (or /tmp/k3out): server.log, serving.txt (latency table,
# one-GPU equality of served vs in-process text), pytest.txt, and py-spy profiles of the k3_lm stub and
# its worker while k3_lm serves (profile-stub.txt, profile-worker.txt: collapsed stacks).
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
TS=/tmp/k3ts; mkdir -p $TS && tar -xJf .dev/tritonserver.tar.xz -C $TS
python3 -m pip install -q --no-index --no-deps .dev/whl/numpy-1.26.4-*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/tritonclient-*.whl \
  .dev/whl/python_rapidjson-*.whl .dev/whl/py_spy-*.whl 2>&1 | tail -1
echo "$ROOT/src" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/k3backend-src.pth"
export PYTHONPATH=/tmp/k3site K3_DEFAULT_CHECKPOINT=/tmp/k3ck PYTHONUNBUFFERED=1
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
LIBDIR=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
LD_LIBRARY_PATH=$TS/ts/libs:$LIBDIR $TS/ts/bin/tritonserver --model-repository="$ROOT/model_repository" \
  --backend-directory=$TS/ts/backends --cuda-memory-pool-byte-size=0:1073741824 --http-address=127.0.0.1 \
  --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 >"$OUT/server.log" 2>&1 &
SERVER=$!
python3 - <<'PY' || { tail -50 "$OUT/server.log"; kill $SERVER; exit 1; }
import time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen("http://localhost:8000/v2/models/k3_ensemble/ready", timeout=2).status == 200:
            print("k3_ensemble ready"); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("server not ready")
PY
grep -E "k3_lm: (stub|worker)|cache:" "$OUT/server.log" | head -20
STUB=$(grep -oP 'k3_lm: stub pid \K[0-9]+' "$OUT/server.log" | head -1)
WORKER=$(grep -oP 'k3_lm: worker rank 0 pid \K[0-9]+' "$OUT/server.log" | head -1)
SPY=/tmp/k3site/bin/py-spy
( sleep 8; $SPY record -r 200 -d 25 --nonblocking -f raw -o "$OUT/profile-stub.txt" -p "$STUB" >/dev/null 2>&1 ) &
( sleep 8; $SPY record -r 200 -d 25 --nonblocking -f raw -o "$OUT/profile-worker.txt" -p "$WORKER" >/dev/null 2>&1 ) &
python3 bench/serving_latency.py --url localhost:8001 --requests 20 --max-tokens 64 2>&1 \
  | grep -v INFO | tee "$OUT/serving.txt"
python3 bench/served_equals_inprocess.py --url http://127.0.0.1:8000 2>&1 | grep -v INFO | tee -a "$OUT/serving.txt"
K3_EXTERNAL_SERVER=http://127.0.0.1:8000,127.0.0.1:8001,http://127.0.0.1:8002/metrics \
  timeout "${PT:-300}" python3 -m pytest tests/test_lm_server.py -q -p no:cacheprovider -k "not perf_analyzer" 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
kill $SERVER; wait $SERVER
grep -iE "error|traceback" "$OUT/server.log" | grep -viE "nvml|dcgm" | head -20
