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
. bench/gpu_common.sh
k3_gpu_prepare
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
k3_gpu_serve "$ROOT/model_repository" || exit 1
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
