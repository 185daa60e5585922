"""What status a client sees for each error code a Python model sends, per endpoint, on the real
tritonserver 2.51 (SERVING.md §7.3, [ERR-1], [ERR-6]). docs/errors.md ("What each protocol shows")
documents it.

Three probe models send `k3backend.serving.triton_io.error_response(code)`, the call k3_lm and
k3_vision use: `decoupled` (like k3_lm; the code is named in `text_input`, "data-then-<CODE>" first
sends one data response), `unary` (not decoupled) and `ensemble` (one step, `decoupled`; like
k3_ensemble). These tests pin Triton's behaviour, not ours: when one fails after a Triton upgrade,
update the table in docs/errors.md and this file together.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from k3client import http_post

CODES = ["INVALID_ARG", "UNSUPPORTED", "UNAVAILABLE", "CANCELLED", "INTERNAL"]  # all that k3 models send
IO = """max_batch_size: 1
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
MODELS = {
    "decoupled": (IO + 'backend: "python"\nmodel_transaction_policy { decoupled: true }\n', '''
import numpy as np
import triton_python_backend_utils as pb_utils
from k3backend.serving.triton_io import data_response, error_response

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            code = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            sender = request.get_response_sender()
            if code.startswith("data-then-"):
                code = code[len("data-then-"):]
                sender.send(data_response(pb_utils, {"text_output": np.array([b"x"], dtype=object)}))
            sender.send(error_response(pb_utils, code, "probe: " + code),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''),
    "unary": (IO + 'backend: "python"\n', '''
import triton_python_backend_utils as pb_utils
from k3backend.serving.triton_io import error_response

class TritonPythonModel:
    def execute(self, requests):
        codes = [pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0].decode()
                 for r in requests]
        return [error_response(pb_utils, code, "probe: " + code) for code in codes]
'''),
    "ensemble": (IO + 'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "decoupled" '
                 'model_version: -1 input_map { key: "text_input" value: "text_input" } '
                 'output_map { key: "text_output" value: "text_output" } } ] }\n', None),
}


@pytest.fixture(scope="module")
def server(triton_server, tmp_path_factory):
    repo = tmp_path_factory.mktemp("probe_repository")
    for name, (config, model_py) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
        if model_py:
            (repo / name / "1" / "model.py").write_text(model_py)
    return triton_server(Path(repo), list(MODELS))


def message(code: str, model: str) -> str:
    return ("in ensemble 'ensemble', " if model == "ensemble" else "") + "probe: " + code


@pytest.mark.parametrize("model", ["decoupled", "ensemble"])
@pytest.mark.parametrize("code", CODES)
def test_http_generate_answers_400_whatever_the_code(server, code: str, model: str):
    """Triton 2.51's generate handler frees the response error before it reads its code
    (GenerateRequestClass::InferResponseComplete: AddErrorJson deletes it, then HttpCodeFromError),
    so every error a model sends comes back as 400; the message still names the code ([ERR-1])."""
    for endpoint, body_of in (("generate", lambda e: e), ("generate_stream", lambda e: "data: " + e + "\n\n")):
        status, body = http_post(server.http_url, f"/v2/models/{model}/{endpoint}", {"text_input": code})
        expected = body_of(json.dumps({"error": message(code, model)}, separators=(",", ":")))
        assert (status, body) == (400, expected), (
            f"{endpoint} {code}: Triton now answers {status} {body!r}; update README 'Error status codes'")


def test_http_generate_stream_error_after_data_is_an_sse_event_with_200(server):
    """[ERR-6]: the status is fixed by the first event."""
    status, body = http_post(server.http_url, "/v2/models/decoupled/generate_stream",
                             {"text_input": "data-then-UNSUPPORTED"})
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[0]["text_output"] == "x" and events[1] == {"error": "probe: UNSUPPORTED"}, body


HTTP_INFER_STATUS = {"INVALID_ARG": 400, "UNSUPPORTED": 501, "UNAVAILABLE": 503, "CANCELLED": 400, "INTERNAL": 500}


@pytest.mark.parametrize("code", CODES)
def test_http_infer_maps_the_code_for_a_non_decoupled_model(server, code: str):
    """The code our error_response sets does reach Triton: /infer (refused for decoupled models, so
    not usable with k3_lm or k3_ensemble) turns it into the §7.3 status."""
    status, body = http_post(server.http_url, "/v2/models/unary/infer", {"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [code]}]})
    assert (status, json.loads(body)) == (HTTP_INFER_STATUS[code], {"error": message(code, "unary")})


def test_http_infer_on_a_decoupled_model_is_501(server):
    status, body = http_post(server.http_url, "/v2/models/decoupled/infer", {"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["INVALID_ARG"]}]})
    assert status == 501 and "decoupled transaction policy" in body, body


def _inputs(text: str) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return [inp]


GRPC_UNARY_STATUS = {"INVALID_ARG": "INVALID_ARGUMENT", "UNSUPPORTED": "UNIMPLEMENTED", "UNAVAILABLE": "UNAVAILABLE",
                     "CANCELLED": "CANCELLED", "INTERNAL": "INTERNAL"}


@pytest.mark.parametrize("model", ["unary", "decoupled", "ensemble"])
def test_grpc_unary_status(server, model: str):
    """ModelInfer keeps the code for a non-decoupled model; a decoupled one, or an ensemble with a
    decoupled step, is refused with UNIMPLEMENTED before the model runs."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for code in CODES:
            with pytest.raises(InferenceServerException) as e:
                client.infer(model, _inputs(code))
            if model == "unary":
                assert (e.value.status(), e.value.message()) == (
                    f"StatusCode.{GRPC_UNARY_STATUS[code]}", message(code, model))
            else:
                assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "decoupled" in e.value.message()
    finally:
        client.close()


@pytest.mark.parametrize("model", ["decoupled", "ensemble", "unary"])
def test_grpc_stream_carries_the_message_and_no_status(server, model: str):
    """ModelStreamInfer sends `error_message` text only, so a stream client learns the code from
    the message ([ERR-1]); the stream stays open for the next request ([ERR-7])."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    try:
        for code in CODES:
            client.async_stream_infer(model, _inputs(code), request_id=code)
            error = results.get(timeout=30)
            assert error is not None and (error.status(), error.message()) == (None, message(code, model))
    finally:
        client.stop_stream()
        client.close()
