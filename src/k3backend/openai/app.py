"""The HTTP side: aiohttp routes, the API key and error middleware, streaming, and `serve()`.

aiohttp because tritonclient[http] already brings it (no new dependency), it is one library for
the server with a request-size limit built in (413), and `handler_cancellation` cancels a
handler whose client disconnected, which is how a dropped stream reaches `TritonStream.close()`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from k3backend.openai.errors import ApiError, bad_request
from k3backend.openai.responses import DONE, Answer
from k3backend.openai.translate import Plan, chat_plan, completion_plan
from k3backend.openai.triton import Delta, TritonPool, TritonStream

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class GatewayConfig:
    triton_url: str
    host: str = "127.0.0.1"
    port: int = 9000
    served_model_name: str = "k3"
    api_key: str | None = None
    triton_model: str = "k3_ensemble"
    text_model: str | None = "k3_lm"  # requests without images skip the ensemble (None: everything to triton_model)
    max_request_bytes: int = 64 * 2**20
    grpc_channels: int = 1
    reuse_port: bool = False  # one of several processes on this port (--workers)


POOL = web.AppKey("pool", TritonPool)
CONFIG = web.AppKey("config", GatewayConfig)


def make_app(cfg: GatewayConfig) -> web.Application:
    app = web.Application(client_max_size=cfg.max_request_bytes, middlewares=[_errors, _auth])
    app[CONFIG] = cfg
    app.add_routes([web.get("/health", health), web.get("/v1/models", models),
                    web.post("/v1/chat/completions", chat), web.post("/v1/completions", completions)])

    async def pool_context(app: web.Application) -> AsyncIterator[None]:
        app[POOL] = TritonPool(cfg.triton_url, cfg.triton_model, cfg.grpc_channels, cfg.text_model)
        yield
        await app[POOL].close()

    app.cleanup_ctx.append(pool_context)
    return app


# ---- middleware ---------------------------------------------------------------------------------


def _error_response(e: ApiError) -> web.Response:
    return web.Response(status=e.status, text=e.json(), content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error JSON with its status (aiohttp's own 404/405/413 too)."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(ApiError(e.status, e.reason if e.status != 413 else e.text or e.reason,
                                        code="request_too_large" if e.status == 413 else None))


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "Incorrect API key provided (send Authorization: Bearer <key>)",
                           code="invalid_api_key")
    return await handler(request)


# ---- routes -------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """200 once Triton and its model are ready, else 503 (for load balancers and `scripts/serve`)."""
    if await request.app[POOL].ready():
        return web.Response(status=200)
    pool = request.app[POOL]
    raise ApiError(503, f"Triton at {pool.url} or its model {' and '.join(pool.models)} is not ready",
                   "service_unavailable")


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [
        {"id": cfg.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "k3backend",
         "root": cfg.triton_model}]})


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat_plan(await _body(request), request.app[CONFIG].served_model_name))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, completion_plan(await _body(request), request.app[CONFIG].served_model_name))


async def _body(request: web.Request) -> dict:
    limit = request.app[CONFIG].max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    raw = await request.read()  # aiohttp raises 413 past client_max_size for chunked bodies
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


# ---- generation ---------------------------------------------------------------------------------


async def _generate(request: web.Request, plan: Plan) -> web.StreamResponse:
    pool = request.app[POOL]
    answer = Answer(plan, request.app[CONFIG].served_model_name)
    streams = [pool.open(job) for job in plan.jobs]
    events = _merged(streams) if len(streams) > 1 else streams[0]
    try:
        if not plan.stream:
            async for index, delta in events:
                answer.add(index, delta)
            return web.json_response(answer.body())
        # The first response decides the status: a refused request is still a plain 4xx/5xx answer.
        first = await events.__anext__()
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            await _stream(response, answer, first, events)
        except ConnectionResetError:  # the client went away: the finally below stops its requests
            logger.debug("client of %s disconnected mid-stream", answer.id)
        return response
    finally:
        if events is not streams[0]:
            await events.aclose()  # cancels its readers
        for s in streams:
            s.close()


async def _stream(response: web.StreamResponse, answer: Answer, first: tuple[int, Delta],
                  events: AsyncIterator[tuple[int, Delta]]) -> None:
    """One write per delta as it arrives, except the last: it leaves with the usage chunk, [DONE] and
    the end of the chunked body in one write, so the client has the whole end of its answer at once."""
    chunk = (answer.role_chunks() if answer.chat else b"") + answer.event(*first)
    try:
        while not answer.finished:
            await response.write(chunk)
            chunk = answer.event(*await anext(events))
        if answer.plan.include_usage:
            chunk += answer.usage_chunk()
    except ApiError as e:  # after data was sent the status is 200; the error goes in the stream
        chunk = f"data: {e.json()}\n\n".encode()
    await response.write_eof(chunk + DONE)


async def _merged(streams: list[TritonStream]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several choices (n > 1, several prompts) in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: TritonStream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except ApiError as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


# ---- serving ------------------------------------------------------------------------------------


async def _serve(cfg: GatewayConfig) -> None:
    runner = web.AppRunner(make_app(cfg), handler_cancellation=True, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_port=cfg.reuse_port or None)
    await site.start()
    logger.info("OpenAI API on http://%s:%d/v1 (model %r) -> Triton %s model %s%s%s; %s event loop", cfg.host,
                cfg.port, cfg.served_model_name, cfg.triton_url, cfg.triton_model,
                f" ({cfg.text_model} for text)" if cfg.text_model else "", ", API key required" if cfg.api_key else "",
                type(asyncio.get_running_loop()).__module__.split(".")[0])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("OpenAI gateway shutting down")
        await runner.cleanup()


def serve(cfg: GatewayConfig) -> int:
    """Run the gateway on uvloop when it is installed (the `serve` extra has it): against
    tests/fake_triton.py at concurrency 64 it took 1-3 ms off the gateway's TTFT p50 overhead, for
    2-4 % less CPU (docs/openai.md "Overhead"); asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(cfg))
    else:
        uvloop.run(_serve(cfg))
    return 0
