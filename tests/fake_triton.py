"""A stand-in for tritonserver's gRPC `ModelStreamInfer` that decodes in lockstep, like an engine
with every request in one batch: each `step_s` every open request gets one response of one token,
the final one at its `max_tokens`. The outputs are k3_ensemble's (text_output "ab ", and the
`return_*` outputs a request asks for, perf metrics included), so the gateway and
bench/openai_overhead.py run against it unchanged, with no model and almost no server CPU: what
they measure is the client side. A `stop` request gets one empty final response and stops nothing.

    python tests/fake_triton.py --port 8001 --step-ms 20      # until SIGTERM/SIGINT
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import struct
import time

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

_I32, _I64 = struct.Struct("<i"), struct.Struct("<q")
_PERF = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def _output(resp: service_pb2.ModelInferResponse, name: str, dtype: str, raw: bytes) -> None:
    resp.outputs.add(name=name, datatype=dtype, shape=[1, 1])
    resp.raw_output_contents.append(raw)


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.peers: list[str] = []  # context.peer() of each stream: one address per connection
        self._tick = asyncio.Event()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self._tick.set()
            self._tick = asyncio.Event()

    async def ServerReady(self, request, context):  # noqa: N802 - gRPC's names
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=True)

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        self.peers.append(context.peer())
        async for req in request_iterator:
            arrival = time.time_ns()
            inputs = {t.name: raw for t, raw in zip(req.inputs, req.raw_input_contents)}
            n = 1 if "stop" in inputs else _I32.unpack(inputs["max_tokens"])[0] if "max_tokens" in inputs else 16
            first = None
            for i in range(n):
                await self._tick.wait()
                first = first or time.time_ns()
                yield self._response(req, inputs, (arrival, first), final=i == n - 1,
                                     text=b"" if "stop" in inputs else b"ab ")

    @staticmethod
    def _response(req, inputs: dict, times: tuple[int, int], final: bool,
                  text: bytes) -> service_pb2.ModelStreamInferResponse:
        out = service_pb2.ModelStreamInferResponse()
        r = out.infer_response
        r.model_name, r.id = req.model_name, req.id
        r.parameters["triton_final_response"].bool_param = final
        _output(r, "text_output", "BYTES", _I32.pack(len(text)) + text)
        if "return_num_output_tokens" in inputs:
            _output(r, "num_output_tokens", "INT32", _I32.pack(1 if text else 0))
        if "return_finish_reason" in inputs:
            reason = b"length" if final else b""
            _output(r, "finish_reason", "BYTES", _I32.pack(len(reason)) + reason)
        if "return_num_input_tokens" in inputs:
            _output(r, "num_input_tokens", "INT32", _I32.pack(8))
        if "return_perf_metrics" in inputs:
            arrival, first = times  # arrival, first token
            for name, value in zip(_PERF, (arrival, arrival, first, time.time_ns())):
                _output(r, name, "INT64", _I64.pack(value))
            _output(r, "num_cached_tokens", "INT32", _I32.pack(0))
        return out


async def start(step_s: float, port: int = 0) -> tuple[grpc.aio.Server, int, FakeTriton, asyncio.Task]:
    """Serve on 127.0.0.1:`port` (0: a free one) in the running loop; stop the server and cancel the task."""
    server = grpc.aio.server()
    fake = FakeTriton(step_s)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port, fake, asyncio.get_running_loop().create_task(fake.tick())


async def _main(args: argparse.Namespace) -> None:
    server, port, _, ticker = await start(args.step_ms / 1e3, args.port)
    print(f"fake ModelStreamInfer on 127.0.0.1:{port}, one token per {args.step_ms} ms", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    ticker.cancel()
    await server.stop(None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--step-ms", type=float, default=20.0)
    asyncio.run(_main(ap.parse_args()))
