"""How a fuzz case travels and how its answer is classified ([ERR-5], SERVING.md §7.3).

A `Request` is one logical Triton request (model, input values, request id) or raw bytes for
HTTP, or a raw gRPC protobuf. `Sender` sends it over one of `PROTOCOLS` and returns one `Answer`
per request: a code (`ok`, a k3 model code read from the message [ERR-1], `TRITON` for a Triton
core refusal, `TRITON_500` for Triton's own HTTP parse errors, or a failure class such as
`hang`) and the status the client saw. `fuzz.py` builds the requests; `fuzz_run.py` drives them.

Everything here talks to 127.0.0.1 only: the target URLs come from a server on loopback.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).resolve().parents[1] / "model_repository"
PROTOCOLS = ("grpc", "grpc_raw", "grpc_infer", "http_generate", "http_stream", "http_infer")
# Never legitimate, whatever the case: a defect in the model, Triton or the protocol handling.
FAILURES = frozenset({"INTERNAL", "TRITON_INTERNAL", "hang", "lost", "duplicate", "bad_output", "error_after_data"})
# [ERR-2]: a client mistake is found before the first response, so it is always the only one.
CLIENT_CODES = frozenset({"INVALID_ARG", "UNSUPPORTED"})
_MODEL_CODE = re.compile(r"\bk3_(?:lm|vision): (INVALID_ARG|UNSUPPORTED|UNAVAILABLE|CANCELLED|INTERNAL):")
# Triton's HTTP frontend answers 500 for JSON it cannot read into tensors (a JSON value of the
# wrong kind, a body that is no JSON object): its own parser, before any model runs.
_TRITON_PARSE = re.compile(r"Unable to parse|failed to parse the request JSON|attempt to ")
# Triton core messages that mean a model process or the server itself failed.
_TRITON_FAILURE = re.compile(r"Stub process|not healthy|Failed to process the request|unexpected error")


@dataclass(frozen=True)
class Wire:
    """An input sent exactly as given (datatype and array, batch dimension included): Triton-level
    garbage such as a wrong dtype or shape, which the declared-type encoding would not produce."""

    datatype: str
    array: np.ndarray


@dataclass
class Request:
    """One request of a case. `values` maps input names to a scalar ([1, 1]), a list ([1, n]), an
    ndarray (sent as is, with the declared dtype) or a `Wire`. `body` replaces them for raw HTTP,
    `raw` for a raw gRPC `ModelInferRequest`."""

    model: str
    values: dict[str, Any] = field(default_factory=dict)
    request_id: str | bytes = ""  # bytes: an id that is not UTF-8, for HTTP
    body: bytes | None = None
    raw: Any = None
    path: str = ""  # HTTP path override (unknown models, versions)


@dataclass(frozen=True)
class Answer:
    """What one request got: `code` (see module docstring), `status` (HTTP status, gRPC status
    name, or `stream` for a gRPC stream, which carries no status), the message, the time taken."""

    code: str
    status: str
    message: str = ""
    seconds: float = 0.0
    finish: str = ""  # finish_reason of the final response, when it carried one


@dataclass(frozen=True)
class Target:
    """Where the server listens (loopback only)."""

    http_url: str  # http://127.0.0.1:port
    grpc_url: str  # 127.0.0.1:port

    @property
    def http_host_port(self) -> tuple[str, int]:
        host, port = self.http_url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


def classify(message: str, status: str) -> str:
    """The answer code of an error: the k3 code in the message, else a Triton refusal."""
    m = _MODEL_CODE.search(message)
    if m:
        return m.group(1)
    if _TRITON_FAILURE.search(message) or status in ("StatusCode.INTERNAL", "StatusCode.UNKNOWN"):
        return "TRITON_INTERNAL"
    if status == "500":
        return "TRITON_500" if _TRITON_PARSE.search(message) else "TRITON_INTERNAL"
    return "TRITON"


# ---- declared inputs: the encoding uses the dtypes config.pbtxt declares ------------------------

_TYPES = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
          "TYPE_UINT64": "UINT64", "TYPE_UINT8": "UINT8", "TYPE_FP32": "FP32", "TYPE_BF16": "BF16"}
NP_TYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
            "UINT32": np.uint32, "UINT8": np.uint8, "FP32": np.float32, "FP64": np.float64, "INT8": np.int8,
            "FP16": np.float16, "BF16": ml_dtypes.bfloat16}


@cache
def declared(model: str) -> dict[str, str]:
    """{input name: Triton datatype} from model_repository/<model>/config.pbtxt (the ensemble's
    inputs are k3_lm's plus k3_vision's image inputs, [CFG-E3])."""
    if model not in ("k3_lm", "k3_vision", "k3_ensemble"):
        return declared("k3_lm")
    if model == "k3_ensemble":
        lm = {k: v for k, v in declared("k3_lm").items() if not k.startswith("image_")}
        return {**lm, **declared("k3_vision")}
    cfg = text_format.Parse((REPO / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {i.name: _TYPES[model_config_pb2.DataType.Name(i.data_type)] for i in cfg.input}


def wire_arrays(request: Request) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (datatype, array with the batch dimension)} of a values request."""
    types = declared(request.model)
    out = {}
    for name, value in request.values.items():
        if isinstance(value, Wire):
            out[name] = (value.datatype, value.array)
            continue
        datatype = types.get(name, "BYTES" if isinstance(value, (str, bytes)) else "INT32")
        if isinstance(value, np.ndarray):
            out[name] = (datatype, value)
            continue
        items = value if isinstance(value, list) else [value]
        if datatype == "BYTES":
            items = [x.encode() if isinstance(x, str) else x for x in items]
            out[name] = (datatype, np.array([items], dtype=np.object_))
        else:
            out[name] = (datatype, np.array([items], dtype=NP_TYPES[datatype]))
    return out


def grpc_inputs(request: Request) -> list[grpcclient.InferInput]:
    inputs = []
    for name, (datatype, array) in wire_arrays(request).items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def raw_contents(datatype: str, array: np.ndarray) -> bytes:
    """The bytes of one tensor in `raw_input_contents`: BYTES elements length-prefixed."""
    if datatype == "BYTES":
        items = [x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)]
        return b"".join(struct.pack("<I", len(x)) + x for x in items)
    return np.ascontiguousarray(array).tobytes()


def infer_request_proto(request: Request) -> service_pb2.ModelInferRequest:
    """The `ModelInferRequest` tritonclient would send; fuzz classes then break it."""
    proto = service_pb2.ModelInferRequest(model_name=request.model, id=request.request_id)
    for name, (datatype, array) in wire_arrays(request).items():
        tensor = proto.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(array.shape)
        proto.raw_input_contents.append(raw_contents(datatype, array))
    return proto


# ---- JSON bodies that can carry invalid UTF-8 --------------------------------------------------


def json_bytes(obj: Any) -> bytes:
    """JSON of `obj`, where a `bytes` value becomes a JSON string holding those raw bytes (invalid
    UTF-8 included: json.dumps cannot write it); NaN and inf as rapidjson reads them."""
    if isinstance(obj, bytes):
        escaped = obj.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
        return b'"' + re.sub(rb"[\x00-\x1f]", lambda m: b"\\u%04x" % m.group()[0], escaped) + b'"'
    if isinstance(obj, dict):
        return b"{" + b",".join(json_bytes(str(k)) + b":" + json_bytes(v) for k, v in obj.items()) + b"}"
    if isinstance(obj, (list, tuple)):
        return b"[" + b",".join(json_bytes(v) for v in obj) + b"]"
    if isinstance(obj, np.ndarray):
        return json_bytes(obj.tolist())
    if isinstance(obj, np.generic):
        return json_bytes(obj.item())
    return json.dumps(obj).encode()


def generate_body(request: Request) -> bytes:
    """The /generate body: input values as JSON values (Triton unwraps one-element tensors), the
    request id as "id"."""
    if request.body is not None:
        return request.body
    body: dict[str, Any] = {}
    if request.request_id:
        body["id"] = request.request_id
    for name, value in request.values.items():
        body[name] = value.array.reshape(-1).tolist() if isinstance(value, Wire) else value
    return json_bytes(body)


def infer_body(request: Request) -> bytes:
    """The KServe /infer JSON body; outputs are asked in binary (BF16 cannot travel as JSON)."""
    if request.body is not None:
        return request.body
    inputs = []
    for name, (datatype, array) in wire_arrays(request).items():
        inputs.append({"name": name, "shape": list(array.shape), "datatype": datatype,
                       "data": array.reshape(-1).tolist()})
    body: dict[str, Any] = {"inputs": inputs, "parameters": {"binary_data_output": True}}
    if request.request_id:
        body["id"] = request.request_id
    return json_bytes(body)


# ---- sending -----------------------------------------------------------------------------------


class Sender:
    """One worker's connections: a tritonclient gRPC client (streams, unary infer) and a raw gRPC
    channel (protobuf garbage). Requests that wait longer than `timeout_s` are `hang`."""

    def __init__(self, target: Target, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.client = grpcclient.InferenceServerClient(target.grpc_url)
        self._channel = grpc.insecure_channel(target.grpc_url)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def close(self) -> None:
        self.client.close()
        self._channel.close()

    # -- gRPC ModelStreamInfer ------------------------------------------------------------------

    def stream(self, requests: list[Request], *, cancel_after_s: float | None = None,
               stagger_s: float = 0.0) -> list[Answer]:
        """Send `requests` on one stream; one answer per request, in order of their final responses.

        cancel_after_s: `stop_stream(cancel_requests=True)` that long after sending; every request
        without a final answer by then is `dropped` (the client gave up, nothing can arrive).
        """
        got: queue.Queue = queue.Queue()
        start = time.monotonic()
        self.client.start_stream(callback=lambda result, error: got.put((result, error)))
        for i, request in enumerate(requests):
            if i and stagger_s:
                time.sleep(stagger_s)
            self.client.async_stream_infer(request.model, grpc_inputs(request), request_id=request.request_id)
        answers: list[Answer] = []
        deadline = start + (cancel_after_s if cancel_after_s is not None else self.timeout_s)
        data_seen = False
        while len(answers) < len(requests):
            try:
                result, error = got.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.client.stop_stream(cancel_requests=True)
                lost = "dropped" if cancel_after_s is not None else "hang"
                return answers + [Answer(lost, "stream", seconds=time.monotonic() - start)] * (
                    len(requests) - len(answers))
            answer = _stream_answer(result, error, time.monotonic() - start)
            if answer is None:
                data_seen = True
                continue
            if data_seen and len(requests) == 1 and answer.code in CLIENT_CODES:
                answer = Answer("error_after_data", "stream", f"{answer.code} after data: {answer.message}")
            answers.append(answer)
        self.client.stop_stream()  # every request has its final answer: returns at once
        while not got.empty():  # anything after a final response is a duplicate
            result, error = got.get()
            answers.append(Answer("duplicate", "stream", str(error or result.get_response().id)))
        return answers

    def raw_stream(self, request: Request, *, drop_after_s: float | None = None) -> Answer:
        """A raw `ModelInferRequest` on its own ModelStreamInfer call, read until the server ends
        the call; `drop_after_s` gives the call a deadline instead, so the client goes away that
        long after sending (mid-generation).

        Only a drop cancels: Triton 2.51 keeps the model of a stream that the client cancels
        around its final response live for tens of seconds (a clean shutdown then needs longer
        than the exit timeout), so a plain case half-closes and lets the server finish the call.
        """
        start = time.monotonic()
        timeout = drop_after_s if drop_after_s is not None else self.timeout_s
        answer = None
        try:
            for response in self._stub.ModelStreamInfer(iter([request.raw]), timeout=timeout):
                seconds = time.monotonic() - start
                if answer is not None:
                    return Answer("duplicate", "stream", f"a response after the final one: {response}"[:300], seconds)
                if response.error_message:
                    answer = Answer(classify(response.error_message, "stream"), "stream", response.error_message,
                                    seconds)
                elif response.infer_response.parameters["triton_final_response"].bool_param:
                    answer = Answer("ok", "stream", seconds=seconds)
            return answer or Answer("lost", "stream", "stream ended without a final response",
                                    time.monotonic() - start)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return answer or Answer("dropped" if drop_after_s is not None else "hang", "stream",
                                        seconds=time.monotonic() - start)
            msg = e.details() or ""
            return Answer(classify(msg, f"StatusCode.{e.code().name}"), f"StatusCode.{e.code().name}", msg,
                          time.monotonic() - start)

    # -- gRPC ModelInfer (k3_vision: not decoupled) ----------------------------------------------

    def raw_infer(self, request: Request) -> Answer:
        """A raw `ModelInferRequest` by unary ModelInfer."""
        start = time.monotonic()
        try:
            self._stub.ModelInfer(request.raw, timeout=self.timeout_s)
            return Answer("ok", "StatusCode.OK", seconds=time.monotonic() - start)
        except grpc.RpcError as e:
            status, msg = f"StatusCode.{e.code().name}", e.details() or ""
            code = "hang" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else classify(msg, status)
            return Answer(code, status, msg, time.monotonic() - start)

    def infer(self, request: Request) -> Answer:
        start = time.monotonic()
        try:
            self.client.infer(request.model, grpc_inputs(request), request_id=request.request_id,
                              client_timeout=self.timeout_s)
            return Answer("ok", "StatusCode.OK", seconds=time.monotonic() - start)
        except InferenceServerException as e:
            status, msg = str(e.status()), e.message() or ""
            if status == "StatusCode.DEADLINE_EXCEEDED":
                return Answer("hang", status, msg, time.monotonic() - start)
            return Answer(classify(msg, status), status, msg, time.monotonic() - start)

    # -- HTTP ------------------------------------------------------------------------------------

    def http(self, request: Request, endpoint: str) -> Answer:
        """POST to /generate, /generate_stream or /infer; the status and the first error event."""
        path = request.path or f"/v2/models/{request.model}/{endpoint}"
        body = infer_body(request) if endpoint == "infer" else generate_body(request)
        start = time.monotonic()
        req = urllib.request.Request(self.target.http_url + path, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with _DIRECT.open(req, timeout=self.timeout_s) as r:
                status, text = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read()
        except TimeoutError:
            return Answer("hang", "timeout", seconds=time.monotonic() - start)
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            return Answer("lost", "connection", str(e), time.monotonic() - start)
        return _http_answer(status, text, endpoint, time.monotonic() - start)

    def http_abandon(self, request: Request, endpoint: str, *, read_bytes: int, reset: bool,
                     short_body: bool = False) -> Answer:
        """Send the request on a raw socket and close it before the response is complete: after
        `read_bytes` bytes of it (0: none), with a TCP reset or a normal close; `short_body`
        announces more body bytes than it sends."""
        body = generate_body(request)
        host, port = self.target.http_host_port
        length = len(body) + (100 if short_body else 0)
        head = (f"POST /v2/models/{request.model}/{endpoint} HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()
        start = time.monotonic()
        with socket.create_connection((host, port), timeout=self.timeout_s) as s:
            s.sendall(head + body)
            if read_bytes and not short_body:  # a short body gets no response to read
                try:
                    s.recv(read_bytes)
                except TimeoutError:
                    return Answer("hang", "timeout", seconds=time.monotonic() - start)
            if reset:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return Answer("dropped", "closed", seconds=time.monotonic() - start)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def _stream_answer(result: Any, error: Any, seconds: float) -> Answer | None:
    """One stream callback -> the request's answer, or None for a non-final data response."""
    if error is not None:
        msg = error.message() if isinstance(error, InferenceServerException) else str(error)
        return Answer(classify(msg, "stream"), "stream", msg, seconds)
    response = result.get_response()
    finish = ""
    for out in response.outputs:
        if out.name in ("text_output", "reasoning_output", "finish_reason"):
            try:
                items = [item.decode("utf-8") for item in result.as_numpy(out.name).reshape(-1)]  # [STR-5]
            except UnicodeDecodeError as e:
                return Answer("bad_output", "stream", f"{out.name} is not UTF-8: {e}", seconds)
            finish = items[0] if out.name == "finish_reason" and items else finish
    if response.parameters["triton_final_response"].bool_param:
        return Answer("ok", "stream", seconds=seconds, finish=finish)
    return None


def _http_answer(status: int, raw: bytes, endpoint: str, seconds: float) -> Answer:
    """An HTTP reply -> Answer; on /generate_stream the first error event decides ([ERR-6])."""
    if endpoint == "infer" and status == 200:
        return Answer("ok", "200", seconds=seconds)  # a JSON header, then the binary outputs
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Answer("bad_output", str(status), f"response is not UTF-8: {e}", seconds)
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if endpoint != "generate_stream" or not events:  # errors before streaming are one JSON object
        events = [text]
    for i, event in enumerate(events):
        try:
            obj = json.loads(event)
        except json.JSONDecodeError:
            return Answer("bad_output", str(status), f"not JSON: {event[:200]}", seconds)
        if isinstance(obj, dict) and "error" in obj:
            msg = str(obj["error"])
            code = classify(msg, str(status))
            if i and code in CLIENT_CODES:
                return Answer("error_after_data", str(status), f"{code} after {i} events: {msg}", seconds)
            return Answer(code, str(status), msg, seconds)
    if status != 200 or not events:
        return Answer(classify(text, str(status)), str(status), text[:300], seconds)
    last = json.loads(events[-1])
    return Answer("ok", "200", seconds=seconds, finish=str(last.get("finish_reason", "")))
