#!/usr/bin/env bash
# The fused KDA decode on a GPU (issue 17 item 2): the model's call and each forced V-split / warps
# variant of kernels/kda.py kda_decode_fused, checked against the reference and timed by CUDA-graph
# replay beside fla-core (when .dev/whl carries its wheels: bench/make_gpu_bundle.sh). Writes
# kda_decode.txt under $OUT (or /tmp/k3out). MATCH: the case filter (decode_fused); T: the time limit.
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
if ls .dev/whl/fla_core-*.whl >/dev/null 2>&1; then  # without them the fla column stays empty
  python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/fla_core-*.whl .dev/whl/einops-*.whl \
    2>&1 | tail -1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:/tmp/k3site
timeout -s ABRT "${T:-300}" python3 -X faulthandler bench/kernels.py --families kda --check \
  --match "${MATCH:-decode_fused}" 2>&1 | grep -v " INFO " | tee "$OUT/kda_decode.txt"
