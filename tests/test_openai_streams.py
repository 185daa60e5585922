"""The gateway against tests/fake_triton.py (no tritonserver, no model, about a second): its gRPC
channels are separate connections, and concurrent streams are relayed side by side, each with its
whole answer."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import fake_triton
from aiohttp import web

from k3backend.openai.app import GatewayConfig, make_app
from k3backend.openai.translate import completion_plan
from k3backend.openai.triton import TritonPool


def test_grpc_channels_are_separate_connections():
    """gRPC shares one connection among channels to one target unless told otherwise (it did here:
    --grpc-channels 4 was one TCP connection)."""

    async def run() -> list[str]:
        server, port, fake, ticker = await fake_triton.start(0.002)
        pool = TritonPool(f"127.0.0.1:{port}", "k3_ensemble", channels=3)
        try:
            for _ in range(6):
                plan = completion_plan({"prompt": "hi", "max_tokens": 2}, "k3")
                assert [d.text async for _, d in pool.open(plan.jobs[0])] == ["ab ", "ab "]
        finally:
            await pool.close()
            ticker.cancel()
            await server.stop(None)
        return fake.peers

    peers = asyncio.run(run())
    assert len(peers) == 6 and len(set(peers)) == 3, peers


def test_64_streams_are_relayed_side_by_side():
    """Every stream has its first token before any stream has its last (16 tokens, one per 40 ms for
    all of them): none waits for another. Each ends with its usage chunk and [DONE]."""
    n_streams, n_tokens = 64, 16

    async def run() -> list[tuple[list[float], list[bytes]]]:
        server, port, _, ticker = await fake_triton.start(0.04)
        runner = web.AppRunner(make_app(GatewayConfig(triton_url=f"127.0.0.1:{port}")))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        loop = asyncio.get_running_loop()

        async def one(session: aiohttp.ClientSession, i: int) -> tuple[list[float], list[bytes]]:
            body = {"model": "k3", "prompt": f"p{i}", "max_tokens": n_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            stamps, events = [], []
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: "):
                        stamps.append(loop.time())
                        events.append(line[6:].strip())
            return stamps, events

        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                return await asyncio.gather(*(one(session, i) for i in range(n_streams)))
        finally:
            await runner.cleanup()
            ticker.cancel()
            await server.stop(None)

    got = asyncio.run(run())
    for stamps, events in got:
        assert len(events) == n_tokens + 2 and events[-1] == b"[DONE]", events
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "ab " * n_tokens
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
    last_first_token = max(stamps[0] for stamps, _ in got)
    first_last_token = min(stamps[-3] for stamps, _ in got)
    assert last_first_token < first_last_token, (last_first_token, first_last_token)


def test_choices_of_several_prompts_stream_whole_answers():
    """n = 2 over two prompts: four Triton streams merged into one SSE stream, each choice whole."""

    async def run() -> list[dict]:
        server, port, _, ticker = await fake_triton.start(0.002)
        runner = web.AppRunner(make_app(GatewayConfig(triton_url=f"127.0.0.1:{port}")))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        body = {"model": "k3", "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                lines = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
        finally:
            await runner.cleanup()
            ticker.cancel()
            await server.stop(None)
        assert lines[-1] == b"[DONE]"
        return [json.loads(e) for e in lines[:-1]]

    chunks = asyncio.run(run())
    texts, reasons = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {i: "ab " * 3 for i in range(4)} and reasons == {i: "length" for i in range(4)}
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and not chunks[-1]["choices"]
