"""The gateway's gRPC side against tests/fake_triton.py (no tritonserver, no model): its channels
are separate connections."""

from __future__ import annotations

import asyncio

import fake_triton

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
                assert [d.text async for d in pool.open(plan.jobs[0])] == ["ab ", "ab "]
        finally:
            await pool.close()
            ticker.cancel()
            await server.stop(None)
        return fake.peers

    peers = asyncio.run(run())
    assert len(peers) == 6 and len(set(peers)) == 3, peers
