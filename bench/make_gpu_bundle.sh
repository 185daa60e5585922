#!/usr/bin/env bash
# Build what bench/gpu_serving.sh carries to a GPU machine without network (docs/benchmarking.md):
#   .dev/tritonserver.tar.xz  tritonserver 2.51 from the nvidia-pytriton wheel: bin/, backends/python with the
#                             Python 3.12 stub, and its libraries as libs/ (libpython dropped), about 27 MB
#   .dev/whl/                 numpy 1.26.4 (the stub needs numpy<2), tritonclient, python-rapidjson and py-spy
#                             for cp312; fla-core and einops (the kernel benches' baselines)
# Then: run `bash bench/gpu_serving.sh` (or gpu_kernels.sh, gpu_engine.sh) there with `.dev` carried.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); cd "$ROOT"
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PT=$SITE/pytriton/tritonserver
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/ts/backends" "$TMP/ts/libs" .dev/whl
cp -r "$PT/bin" "$TMP/ts/"
cp -r "$PT/backends/python" "$TMP/ts/backends/"
cp "$PT/python_backend_stubs/3.12/triton_python_backend_stub" "$TMP/ts/backends/python/"
cp "$SITE/nvidia_pytriton.libs/"* "$TMP/ts/libs/" && rm -f "$TMP/ts/libs/"libpython3-*
tar -cJf .dev/tritonserver.tar.xz -C "$TMP" ts
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .dev/whl \
  numpy==1.26.4 python-rapidjson tritonclient==2.73.0 py-spy==0.4.3 fla-core==0.6.0 einops
ls -la .dev .dev/whl
