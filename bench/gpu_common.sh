# Sourced by bench/gpu_serving.sh, bench/gpu_openai.sh and bench/gpu_serve_small.sh (with ROOT and OUT set, cwd = ROOT):
# the server and client setup they share on a GPU machine without network.
#   k3_gpu_prepare       unpack .dev/tritonserver.tar.xz to /tmp/k3ts, install the carried wheels (numpy 1.26.4
#                        into python3 itself: the stub needs numpy<2; the others under /tmp/k3site), put src/ on
#                        python3's path, export PYTHONPATH, K3_DEFAULT_CHECKPOINT, PYTHONUNBUFFERED
#   k3_gpu_small_repo CK  copy model_repository to REPO=/tmp/k3repo with k3_lm and k3_vision on checkpoint CK,
#                        k3_lm at bfloat16, gpu_memory_utilization 0.80, max_model_len 4096
#   k3_lm_param KEY VALUE set one k3_lm parameter of that copy
#   k3_gpu_serve REPO [S] tritonserver on REPO in the background (SERVER=its pid, log $OUT/server.log); waits up
#                        to S seconds (300) for k3_ensemble to be ready, else prints the log tail, kills it, fails

k3_gpu_prepare() {
  TS=/tmp/k3ts; mkdir -p $TS && tar -xJf .dev/tritonserver.tar.xz -C $TS
  python3 -m pip install -q --no-index --no-deps .dev/whl/numpy-1.26.4-*.whl 2>&1 | tail -1
  python3 -m pip install -q --no-index --no-deps --target /tmp/k3site .dev/whl/tritonclient-*.whl \
    .dev/whl/python_rapidjson-*.whl .dev/whl/py_spy-*.whl 2>&1 | tail -1
  echo "$ROOT/src" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/k3backend-src.pth"
  export PYTHONPATH=/tmp/k3site K3_DEFAULT_CHECKPOINT=/tmp/k3ck PYTHONUNBUFFERED=1
}

k3_gpu_serve() {
  local repo=$1 wait_s=${2:-300} libdir
  libdir=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
  LD_LIBRARY_PATH=$TS/ts/libs:$libdir $TS/ts/bin/tritonserver --model-repository="$repo" \
    --backend-directory=$TS/ts/backends --cuda-memory-pool-byte-size=0:1073741824 --http-address=127.0.0.1 \
    --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 >"$OUT/server.log" 2>&1 &
  SERVER=$!
  WAIT_S=$wait_s python3 - <<'PY' || { tail -50 "$OUT/server.log"; kill $SERVER; return 1; }
import os, time, urllib.request
for _ in range(int(os.environ["WAIT_S"])):
    try:
        if urllib.request.urlopen("http://localhost:8000/v2/models/k3_ensemble/ready", timeout=2).status == 200:
            print("k3_ensemble ready"); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("server not ready")
PY
}

k3_lm_param() {
  sed -i "s|key: \"$1\" value: { string_value: \"[^\"]*\"|key: \"$1\" value: { string_value: \"$2\"|" $REPO/k3_lm/config.pbtxt
}

k3_gpu_small_repo() {
  local m
  REPO=/tmp/k3repo; rm -rf $REPO; cp -r model_repository $REPO
  for m in k3_lm k3_vision; do
    sed -i "s|key: \"model_path\" value: { string_value: \"[^\"]*\"|key: \"model_path\" value: { string_value: \"$1\"|" \
      $REPO/$m/config.pbtxt
  done
  k3_lm_param dtype bfloat16; k3_lm_param gpu_memory_utilization 0.80; k3_lm_param max_model_len 4096
}
