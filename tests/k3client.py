"""Small tritonclient helpers for the end-to-end tests: build TRT-LLM-dialect tensors, collect streams."""

from __future__ import annotations

import base64
import io
import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

TYPES = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32), str: ("BYTES", np.object_),
         bytes: ("BYTES", np.object_)}  # bytes: sent as they are (e.g. not UTF-8)
UINT64 = {"seed", "random_seed", "prompt_table_extra_id"}


def make_inputs(values: dict) -> list[grpcclient.InferInput]:
    """{name: scalar | list} → InferInputs with the batch dim: scalars [1, 1], lists [1, n]."""
    inputs = []
    for name, v in values.items():
        if isinstance(v, np.ndarray):
            arr, dtype = v, {np.uint8: "UINT8", np.int32: "INT32"}[v.dtype.type]
        else:
            items = v if isinstance(v, list) else [v]
            dtype, np_type = TYPES[type(items[0])]
            if name in UINT64:
                dtype, np_type = "UINT64", np.uint64
            arr = np.array([[x.encode() if isinstance(x, str) else x for x in items]], dtype=np_type)
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


@dataclass
class Stream:
    """What one streamed request produced: data responses (as numpy dicts), the final flag, an error."""

    responses: list[dict] = field(default_factory=list)
    final: bool = False
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(r["text_output"].reshape(-1)[0].decode() for r in self.responses)

    def total(self, name: str) -> int:
        return int(sum(int(r[name].reshape(-1)[0]) for r in self.responses))


def collect(client: grpcclient.InferenceServerClient, jobs: list[tuple[str, dict, str]], timeout: float = 120,
            outputs: tuple[str, ...] = ()) -> dict[str, Stream]:
    """Send every (model, inputs, request_id) on one gRPC stream; wait for each final response."""
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    streams = {rid: Stream() for _, _, rid in jobs}
    try:
        for model, values, rid in jobs:
            client.async_stream_infer(model, make_inputs(values), request_id=rid)
        pending = set(streams)
        while pending:
            result, error = q.get(timeout=timeout)
            if error is not None:
                rid = _error_request_id(error, pending)
                streams[rid].error, streams[rid].final = str(error), True
                pending.discard(rid)
                continue
            resp = result.get_response()
            rid = resp.id
            names = [o.name for o in resp.outputs]
            if names:
                streams[rid].responses.append({n: result.as_numpy(n) for n in names})
            if resp.parameters["triton_final_response"].bool_param:
                streams[rid].final = True
                pending.discard(rid)
    finally:
        client.stop_stream()
    return streams


def _error_request_id(error, pending: set[str]) -> str:
    """gRPC stream errors carry no request id; tests that expect errors send one request per stream."""
    assert len(pending) == 1, f"error on a multi-request stream: {error}"
    return next(iter(pending))


def stream_one(url: str, model: str, values: dict, request_id: str = "r1", timeout: float = 120) -> Stream:
    client = grpcclient.InferenceServerClient(url)
    try:
        return collect(client, [(model, values, request_id)], timeout)[request_id]
    finally:
        client.close()


def http_post(url: str, path: str, body: dict | None, timeout: float = 120, headers: dict | None = None,
              raw: bytes | None = None) -> tuple[int, str]:
    """POST JSON (or `raw` bytes) to `url` (http://host:port) + `path`; returns (status, body) for errors too."""
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode() if raw is None else raw,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(url: str) -> dict[str, float]:
    """Parse the Prometheus text at the metrics URL into {'name{labels}': value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def settled_metrics(url: str, name: str = "k3:generation_tokens_total", timeout: float = 5.0) -> dict[str, float]:
    """`metrics(url)` once `name` has stopped moving for 0.3 s: updates of earlier requests go through
    the metrics thread's queue and may still land after their final response (docs/metrics.md)."""
    values, deadline = metrics(url), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = metrics(url)
        if metric(again, name) == metric(values, name):
            return again
        values = again
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric family's samples whose labels include `labels`."""
    total = 0.0
    for key, v in values.items():
        if key.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
    return total


def png_data_uri(w: int = 64, h: int = 48, seed: int = 0) -> str:
    """A random w x h RGB PNG as a data URI."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
