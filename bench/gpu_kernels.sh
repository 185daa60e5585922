#!/usr/bin/env bash
# The fused kernels on a GPU: bench/kernels.py --check family by family (each in its own process, so
# one family's inputs leave the GPU before the next), beside the torch references and fla-core.
# Carried: .dev/whl/ with fla_core and einops wheels (bench/make_gpu_bundle.sh). Writes kernels.txt
# under $OUT (or /tmp/k3out). FAMILIES="norm mla kda moe sample" by default; T: seconds per family.
set -uo pipefail
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/fla_core-*.whl .dev/whl/einops-*.whl \
  2>&1 | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src:/tmp/k3site
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
for f in ${FAMILIES:-norm mla kda moe sample}; do
  echo "== $f"
  timeout -s ABRT "${T:-200}" python3 -X faulthandler bench/kernels.py --families "$f" --check 2>&1 | grep -v " INFO "
done | tee "$OUT/kernels.txt"
