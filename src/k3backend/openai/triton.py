"""The gateway's side of Triton: gRPC streams to k3_ensemble, one per choice (tritonclient.grpc.aio).

Each `TritonStream` is one `ModelStreamInfer` call carrying one request; its responses become
`Delta`s. A stream closed before its final response (the HTTP client went away) is stopped with
the stop + request-id convention (docs/client-api.md "Cancellation"), because a gRPC cancel of
a k3_ensemble stream does not reach k3_lm; the gRPC call is cancelled too, which is what frees
a request when the gateway talks to k3_lm directly.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from k3backend.openai.errors import ApiError, from_rpc, from_triton
from k3backend.openai.translate import Job

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
_NP = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}
_INT32 = struct.Struct("<i")


@dataclass
class Delta:
    """One Triton response: the text since the previous one and the tokens it covers."""

    text: str
    reasoning: str
    n_tokens: int
    finish_reason: str  # "" before the final response, then stop / length / cancelled
    logprobs: list | None  # k3's per-token JSON entries (docs/client-api.md "Log-probabilities")
    num_input_tokens: int
    num_cached_tokens: int
    final: bool


def make_inputs(inputs: dict[str, tuple[object, str]]) -> list[grpcclient.InferInput]:
    """{name: (value or list, dtype)} -> InferInputs with the batch dim: scalars [1, 1], lists [1, n]."""
    out = []
    for name, (value, dtype) in inputs.items():
        items = value if isinstance(value, list) else [value]
        arr = np.array([[v.encode() if isinstance(v, str) else v for v in items]], dtype=_NP[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def parse_delta(result: grpcclient.InferResult) -> Delta:
    """Read the one-element outputs straight from the raw contents (each is [1, 1])."""
    resp = result.get_response()
    values: dict[str, object] = {}
    for output, raw in zip(resp.outputs, resp.raw_output_contents):
        if output.datatype == "BYTES":  # 4-byte length, then the bytes
            values[output.name] = raw[4:4 + _INT32.unpack_from(raw)[0]].decode("utf-8", "replace")
        elif output.datatype == "INT32":
            values[output.name] = _INT32.unpack_from(raw)[0]
    lp = values.get("logprobs")
    return Delta(
        text=values.get("text_output", ""), reasoning=values.get("reasoning_output", ""),
        n_tokens=values.get("num_output_tokens", 0), finish_reason=values.get("finish_reason", ""),
        logprobs=json.loads(lp) if lp is not None else None,
        num_input_tokens=values.get("num_input_tokens", 0), num_cached_tokens=values.get("num_cached_tokens", 0),
        final=resp.parameters["triton_final_response"].bool_param,
    )


class TritonStream:
    """The responses of one Job; `close()` (idempotent) stops the request if it has not ended."""

    def __init__(self, pool: TritonPool, job: Job) -> None:
        self.job = job
        self._pool = pool
        self._done = False
        request = {"model_name": pool.model, "inputs": make_inputs(job.inputs), "request_id": job.request_id}
        self._call = pool.client().stream_infer(_once(request))

    def __aiter__(self) -> TritonStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except grpc.RpcError as e:  # the connection failed: the request may still be running
            raise from_rpc(e) from None
        except StopAsyncIteration:
            self._done = True
            raise ApiError(502, "Triton closed the stream before the final response", "server_error") from None
        if error is not None:  # an error is the request's last response ([ERR-1])
            self._done = True
            raise from_triton(error.message())
        delta = parse_delta(result)
        self._done = delta.final
        return delta

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._pool.stop_later(self.job.request_id)
        self._call.cancel()


class TritonPool:
    """A few gRPC channels to one tritonserver, used round-robin; owns the background stop tasks."""

    def __init__(self, url: str, model: str, channels: int = 1) -> None:
        self.url, self.model = url, model
        self._clients = [grpcaio.InferenceServerClient(url) for _ in range(channels)]
        self._next = itertools.cycle(self._clients)
        self._stops: set[asyncio.Task] = set()

    def client(self) -> grpcaio.InferenceServerClient:
        return next(self._next)

    def open(self, job: Job) -> TritonStream:
        return TritonStream(self, job)

    def stop_later(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._stop(request_id))
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    async def _stop(self, request_id: str) -> None:
        """Send the stop request for `request_id` and wait for its one final response."""
        request = {"model_name": self.model, "request_id": request_id,
                   "inputs": make_inputs({"text_input": ("", "BYTES"), "stop": (True, "BOOL")})}
        call = self.client().stream_infer(_once(request))
        try:
            error = await asyncio.wait_for(_final_error(call), STOP_TIMEOUT_S)
            if error:
                logger.warning("stop of request %s failed: %s", request_id, error)
        except (grpc.RpcError, asyncio.TimeoutError) as e:
            logger.warning("stop of request %s failed: %r", request_id, e)
        finally:
            call.cancel()

    async def ready(self) -> bool:
        """Server and model ready (GET /health); any failure to ask counts as not ready."""
        client = self._clients[0]
        try:
            return await client.is_server_ready(client_timeout=2) and await client.is_model_ready(
                self.model, client_timeout=2)
        except Exception as e:  # noqa: BLE001 - an unreachable server is simply not ready
            logger.debug("readiness check failed: %r", e)
            return False

    async def close(self) -> None:
        """Let pending stop requests finish (they free engine work), then close the channels."""
        if self._stops:
            await asyncio.wait(set(self._stops), timeout=STOP_TIMEOUT_S)
        for client in self._clients:
            await client.close()


async def _once(request: dict) -> AsyncIterator[dict]:
    """The request side of a stream: one request, then half-close (Triton still sends every response)."""
    yield request


async def _final_error(call) -> str | None:
    """Read a one-request stream to its final response; its error message, or None."""
    async for result, error in call:
        if error is not None:
            return error.message()
        if result.get_response().parameters["triton_final_response"].bool_param:
            return None
    return "the stream ended before the final response"
