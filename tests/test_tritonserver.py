"""End-to-end check of the serving infrastructure: the real tritonserver from the pytriton
wheel, Python-backend stubs in this virtualenv, gRPC streaming clients and perf_analyzer.

The models are throwaway ones written into tmp_path; the project's model_repository/ is not
used here.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from k3backend.tritonserver import (
    NO_GPU_ARGS,
    TritonServer,
    TritonServerError,
    find_tritonserver,
    gpu_visible,
    prepare_backends,
    serve_command,
    server_command,
)

STREAM_MODEL_PY = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    # Decoupled: three responses per request, OUT = IN * 10 + i, FINAL on the third. The short
    # sleeps make latency steady enough for perf_analyzer's stability check on a busy CI box.
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            for i in range(3):
                time.sleep(0.002)
                out = pb_utils.Tensor("OUT", (x * 10 + i).astype(np.int32))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == 2 else 0
                sender.send(pb_utils.InferenceResponse([out]), flags=flags)
        return None
"""

STREAM_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

ADD_ONE_MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", (x + 1).astype(np.int32))]))
        return responses
"""

ADD_ONE_CONFIG = """
backend: "python"
max_batch_size: 8
dynamic_batching { }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

BROKEN_MODEL_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("broken_model: initialize failed on purpose")

    def execute(self, requests):
        return None
"""


def write_model(repo: Path, name: str, config: str, model_py: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n' + textwrap.dedent(config))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model_py))


@pytest.fixture(scope="module")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("model_repository")
    write_model(repo, "stream3", STREAM_CONFIG, STREAM_MODEL_PY)
    write_model(repo, "add_one", ADD_ONE_CONFIG, ADD_ONE_MODEL_PY)
    return repo


@pytest.fixture(scope="module")
def server(triton_server, model_repo: Path) -> TritonServer:
    return triton_server(model_repo, ["stream3", "add_one"], startup_timeout_s=60)


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_ready_and_decoupled_config_over_http(server: TritonServer) -> None:
    assert http_get(server.http_url + "/v2/health/ready")[0] == 200
    status, body = http_get(server.http_url + "/v2/models/stream3/config")
    assert status == 200
    config = json.loads(body)
    assert config["model_transaction_policy"]["decoupled"] is True
    status, body = http_get(server.metrics_url)
    assert status == 200 and b"nv_inference_request_success" in body


def test_grpc_stream_gives_three_responses_then_final(server: TritonServer) -> None:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inp = grpcclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([7], dtype=np.int32))
        client.async_stream_infer("stream3", [inp], request_id="r1", enable_empty_final_response=True)
        got = []
        while not got or not got[-1][1]:
            result, error = results.get(timeout=10)
            assert error is None, error
            response = result.get_response()
            assert response.id == "r1"
            got.append((result.as_numpy("OUT").tolist(), response.parameters["triton_final_response"].bool_param))
        client.stop_stream()  # waits for the stream to end: nothing may follow the final response
    finally:
        client.close()
    assert got == [([70], False), ([71], False), ([72], True)]
    assert results.empty()


def test_non_decoupled_model_answers_http_infer(server: TritonServer) -> None:
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("IN", [2, 1], "INT32")
        inp.set_data_from_numpy(np.array([[41], [-1]], dtype=np.int32))
        assert client.infer("add_one", [inp]).as_numpy("OUT").tolist() == [[42], [0]]
    finally:
        client.close()  # an open keep-alive connection delays server shutdown by exit-timeout


def test_perf_analyzer_streams_decoupled_model(server: TritonServer, perf_analyzer: Path, tmp_path: Path) -> None:
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{"IN": [3]}, {"IN": [5]}]}))
    cmd = [
        str(perf_analyzer), "-m", "stream3", "-i", "grpc", "-u", server.grpc_url,
        "--async", "--streaming", "--input-data", str(data),
        "--measurement-mode", "count_windows", "--measurement-request-count", "20",
        "--concurrency-range", "1:2",
        # The check is that streaming works end to end, not a measurement: accept noisy windows.
        "--stability-percentage", "100",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}"
    assert "error" not in output.lower(), output
    assert "Concurrency: 2" in output, output


def test_stop_terminates_server_and_its_stubs(model_repo: Path, tmp_path: Path) -> None:
    with TritonServer(model_repo, tmp_path, models=["add_one"], startup_timeout_s=60) as server:
        pid = server.pid
        assert http_get(server.http_url + "/v2/models/add_one/ready")[0] == 200
    assert server.stop() == 0  # idempotent: the context exit already stopped it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing left in the server's process group (the stubs)


def test_failed_model_load_raises_with_log_tail(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "broken_model", ADD_ONE_CONFIG, BROKEN_MODEL_PY)
    server = TritonServer(repo, tmp_path / "work", models=["broken_model"], startup_timeout_s=60)
    with pytest.raises(TritonServerError, match="initialize failed on purpose"):
        server.start()
    assert not server.is_running()


def test_prepare_backends_is_idempotent(tmp_path: Path) -> None:
    install = find_tritonserver()
    backends = prepare_backends(tmp_path, install)
    stub = backends / "python" / "triton_python_backend_stub"
    assert os.access(stub, os.X_OK) and (backends / "python" / "libtriton_python.so").is_file()
    before = {p: p.stat().st_ino for p in backends.rglob("*")}
    assert prepare_backends(tmp_path, install) == backends
    assert {p: p.stat().st_ino for p in backends.rglob("*")} == before  # nothing copied again


def test_no_gpu_flags_only_without_a_gpu_and_before_extra_args(tmp_path: Path) -> None:
    args = (tmp_path, tmp_path, 1, 2, 3, ["--allow-gpu-metrics=true"])
    cpu, gpu = server_command(*args, gpu=False), server_command(*args, gpu=True)
    assert cpu[-3:] == [*NO_GPU_ARGS, "--allow-gpu-metrics=true"]  # the caller's flag still wins
    assert not set(NO_GPU_ARGS) & set(gpu)


@pytest.mark.parametrize("visible", ["", "-1", " -1,0"])
def test_cuda_visible_devices_can_hide_every_gpu(visible: str) -> None:
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": visible})


# What tritonserver 2.51 still logs on a machine without a GPU, all harmless (docs/operations.md): its GPU
# build's CUDA block manager and ensemble stream setup at start, and the first request that
# prefers pinned memory; no flag skips them.
NO_GPU_LEFTOVERS = ('"CudaDriverHelper has not been initialized."', '"unable to create stream for ',
                    '"failed to allocate pinned system memory: no pinned memory pool, falling back')


def test_server_log_without_gpu_has_no_gpu_probing_errors(server: TritonServer) -> None:
    """No NVML, DCGM or pinned-pool errors on a CPU machine; every other E/W line is a known one."""
    log = server.log_path.read_text().splitlines()
    assert not [line for line in log if re.search(r"NVML|DCGM|Unable to allocate pinned", line)], log[:20]
    if not gpu_visible():
        alarms = [line for line in log if re.match(r"[EW]\d{4} ", line)]
        assert all(any(known in line for known in NO_GPU_LEFTOVERS) for line in alarms), alarms


def test_serve_binds_loopback_unless_told_otherwise(tmp_path: Path) -> None:
    """`scripts/serve` must not expose an unprotected 2.51 server: loopback by default, `--address`
    (or a later tritonserver `--http-address`) for other interfaces."""
    root = ["--backend-root", str(tmp_path)]
    cmd, _, urls = serve_command(root)
    for endpoint in ("http", "grpc", "metrics"):
        assert f"--{endpoint}-address=127.0.0.1" in cmd
    assert urls[0] == "HTTP    http://localhost:8000"
    cmd, _, _ = serve_command([*root, "--address", "0.0.0.0", "--http-address=10.1.2.3"])
    assert "--grpc-address=0.0.0.0" in cmd and cmd[-1] == "--http-address=10.1.2.3"


@pytest.mark.parametrize("args, allowed", [
    ((), True), (("--log-verbose=1",), True), (("--allow-metrics=false",), False),
    (("--allow-metrics", "0"), False), (("--allow-metrics=False", "--allow-metrics=true"), True)])
def test_readiness_waits_for_metrics_only_when_the_server_serves_them(args, allowed):
    """_wait_ready polls /metrics unless the arguments turn metrics off, in either spelling: polling
    an endpoint that never starts would run into the startup timeout."""
    from k3backend.tritonserver import _metrics_allowed

    assert _metrics_allowed(args) is allowed
