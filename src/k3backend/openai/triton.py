"""The gateway's side of Triton: one gRPC `ModelStreamInfer` call per choice.

The calls go through grpc.aio with tritonclient's service definitions (`tritonclient.grpc.
service_pb2*`), building the request protobuf directly: measured on the 2-core CI machine,
`tritonclient.grpc.aio.InferenceServerClient.stream_infer` with `InferInput`s cost 0.5 ms more CPU
per request (numpy arrays and wrappers) and 5 % more per response, all of it on the path of the
first token (docs/openai.md "Overhead").

A `TritonStream` closed before its final response (the HTTP client went away) is stopped with the
stop + request-id convention (docs/client-api.md "Cancellation"), because a gRPC cancel of a
k3_ensemble stream does not reach k3_lm. Its call is then read to its final response in the
background instead of being cancelled: Triton 2.51 can keep a cancelled in-flight ensemble request
forever, and with it k3_ensemble "live", so that an unload or shutdown waits out its exit timeout
(seen in tests/test_openai_serve.py). Only a call that does not end within `STOP_TIMEOUT_S` is
cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import struct
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from k3backend.openai.errors import ApiError, from_rpc, from_triton
from k3backend.openai.translate import Job

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 2.0
# As tritonclient sets them: images make requests far larger than gRPC's 4 MiB default.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
_INT32, _INT64 = struct.Struct("<i"), struct.Struct("<q")
_PACK = {"INT32": "i", "FP32": "f", "BOOL": "?", "UINT64": "Q"}
_TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


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
    times: dict[str, int] | None  # the *_time_ns outputs (return_perf_metrics) of the final response
    final: bool


def request_pb(model: str, request_id: str, inputs: dict[str, tuple[object, str]]) -> service_pb2.ModelInferRequest:
    """{name: (value or list, dtype)} -> the request, each tensor [1, 1] or [1, n] in raw form."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, (value, dtype) in inputs.items():
        items = value if isinstance(value, list) else [value]
        req.inputs.add(name=name, datatype=dtype, shape=[1, len(items)])
        if dtype == "BYTES":  # each element: 4-byte little-endian length, then its bytes
            data = [v.encode() if isinstance(v, str) else v for v in items]
            raw = b"".join(_INT32.pack(len(d)) + d for d in data)
        else:
            raw = struct.pack(f"<{len(items)}{_PACK[dtype]}", *items)
        req.raw_input_contents.append(raw)
    return req


def parse_delta(resp: service_pb2.ModelInferResponse) -> Delta:
    """Read the one-element outputs straight from the raw contents, by name: their types are fixed
    by k3_ensemble's config (BYTES: a 4-byte length, then the bytes). Runs once per streamed
    response; the perf times are read from the final one only, the one that uses them."""
    raw = {output.name: data for output, data in zip(resp.outputs, resp.raw_output_contents)}
    get = raw.get
    text, reasoning, reason, lp = get("text_output"), get("reasoning_output"), get("finish_reason"), get("logprobs")
    n_out, n_in, n_cached = get("num_output_tokens"), get("num_input_tokens"), get("num_cached_tokens")
    final = resp.parameters["triton_final_response"].bool_param
    return Delta(
        text=_text(text) if text else "", reasoning=_text(reasoning) if reasoning else "",
        n_tokens=_INT32.unpack_from(n_out)[0] if n_out else 0, finish_reason=_text(reason) if reason else "",
        logprobs=json.loads(_text(lp)) if lp else None,
        num_input_tokens=_INT32.unpack_from(n_in)[0] if n_in else 0,
        num_cached_tokens=_INT32.unpack_from(n_cached)[0] if n_cached else 0,
        times=({k: _INT64.unpack_from(raw[k])[0] for k in _TIMES if k in raw} or None) if final else None,
        final=final,
    )


def _text(raw: bytes) -> str:
    return raw[4:4 + _INT32.unpack_from(raw)[0]].decode("utf-8", "replace")


class TritonStream:
    """The responses of one Job, as (choice index, Delta); `close()` (idempotent) stops the request
    if it has not ended."""

    def __init__(self, pool: TritonPool, job: Job) -> None:
        self.job = job
        self._pool = pool
        self._done = False
        self.model = pool.model_for(job)
        self._call = pool.call(request_pb(self.model, job.request_id, job.inputs))

    def __aiter__(self) -> TritonStream:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:  # the connection failed: the request may still be running
            raise from_rpc(e) from None
        if msg is grpc.aio.EOF:
            self._done = True
            raise ApiError(502, "Triton closed the stream before the final response", "server_error")
        if msg.error_message:  # an error is the request's last response ([ERR-1])
            self._done = True
            raise from_triton(msg.error_message)
        delta = parse_delta(msg.infer_response)
        self._done = delta.final
        return self.job.index, delta

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._pool.stop_later(self.model, self.job.request_id, self._call)


class TritonPool:
    """A few gRPC channels to one tritonserver, used round-robin; owns the background stop tasks.
    Requests go to `model` (the ensemble), those without images to `text_model` when it is set."""

    def __init__(self, url: str, model: str, channels: int = 1, text_model: str | None = None) -> None:
        self.url, self.model, self.text_model = url, model, text_model
        self.models = tuple(dict.fromkeys(m for m in (model, text_model) if m))  # what readiness needs
        # A local subchannel pool per channel: gRPC otherwise shares one TCP connection between
        # channels with the same target and options, and N channels would still be one connection.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.aio.insecure_channel(url, options=options) for _ in range(channels)]
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channels[0])  # readiness
        # ModelStreamInfer with one request, called as unary-stream: its initial metadata, the request and
        # the half-close leave in one batch (the stub's stream-stream call takes three operations, one
        # after the other, each a round trip through the event loop, and a task per call to send them).
        # Triton sees the same stream as from the stub, and still sends every response.
        methods = [c.unary_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                  response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
                   for c in self._channels]
        self._next = itertools.cycle(methods)
        self._stops: set[asyncio.Task] = set()

    def call(self, request: service_pb2.ModelInferRequest) -> grpc.aio.UnaryStreamCall:
        """One ModelStreamInfer stream that sends `request`, on the next channel."""
        return next(self._next)(request)

    def open(self, job: Job) -> TritonStream:
        return TritonStream(self, job)

    def model_for(self, job: Job) -> str:
        return self.text_model if job.text_only and self.text_model else self.model

    def stop_later(self, model: str, request_id: str, call: grpc.aio.UnaryStreamCall) -> None:
        task = asyncio.get_running_loop().create_task(self._stop(model, request_id, call))
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    async def _stop(self, model: str, request_id: str, target: grpc.aio.UnaryStreamCall) -> None:
        """Send the stop request for `request_id` to the model it went to, then read the target's call
        to its end."""
        stop = request_pb(model, request_id, {"text_input": ("", "BYTES"), "stop": (True, "BOOL")})
        call = self.call(stop)
        try:
            msg = await asyncio.wait_for(call.read(), STOP_TIMEOUT_S)  # the stop request's one response
            if msg is grpc.aio.EOF or msg.error_message:
                logger.warning("stop of request %s failed: %s", request_id, getattr(msg, "error_message", "no answer"))
            await asyncio.wait_for(_drain(target), STOP_TIMEOUT_S)
            logger.debug("stopped request %s", request_id)
        except (grpc.RpcError, asyncio.TimeoutError) as e:
            logger.warning("stop of request %s: %r; cancelling its call", request_id, e)
            target.cancel()
            call.cancel()

    async def ready(self) -> bool:
        """Server and model ready (GET /health); failing to ask counts as not ready."""
        try:
            server = await self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=READY_TIMEOUT_S)
            models = [await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=name), timeout=READY_TIMEOUT_S)
                      for name in self.models]
        except grpc.RpcError as e:
            logger.debug("readiness check failed: %s", e.code())
            return False
        return server.ready and all(m.ready for m in models)

    async def close(self) -> None:
        """Let pending stop requests finish (they free engine work), then close the channels."""
        if self._stops:
            await asyncio.wait(set(self._stops), timeout=STOP_TIMEOUT_S)
        for channel in self._channels:
            await channel.close()


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    """Read a call until its final response, an error response or its end."""
    while True:
        msg = await call.read()
        if (msg is grpc.aio.EOF or msg.error_message
                or msg.infer_response.parameters["triton_final_response"].bool_param):
            return
