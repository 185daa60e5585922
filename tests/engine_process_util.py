"""Driving an `EngineClient` (the engine core in its own process) from a test: collect each
request's ids until it ends, and find the processes it owns."""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from pathlib import Path

from k3backend.engine.client import EngineClient
from k3backend.engine.request import FinishReason, Request
from test_engine import Completion


def collect(client: EngineClient, rids: dict[int, str], timeout: float = 120, on_token=None) -> dict[str, Completion]:
    """Read the client's messages until every id in `rids` ended (or the engine failed)."""
    got = {name: Completion() for name in rids.values()}
    live = set(rids)
    deadline = time.monotonic() + timeout
    while live:
        assert time.monotonic() < deadline, f"requests {sorted(rids[r] for r in live)} did not end"
        wait([client] if client.readable else [], 0.5)
        for message in client.receive():
            if message[0] == "failed":
                for rid in live:
                    got[rids[rid]].finish, got[rids[rid]].error = FinishReason.ERROR, ("UNAVAILABLE", message[1])
                return got
            out = message[1]
            for rid, token, finish in zip(out.ids.tolist(), out.tokens.tolist(), out.finish.tolist()):
                if rid not in rids:
                    continue
                c = got[rids[rid]]
                if token >= 0:
                    c.token_ids.append(token)
                    if on_token is not None:
                        on_token(rids[rid], token)
                if finish:
                    c.finish, c.error = FinishReason(finish), out.errors.get(rid)
                    live.discard(rid)
    return got


def add_all(client: EngineClient, requests: list[Request]) -> dict[int, str]:
    return {client.add(r): r.request_id for r in requests}


def children(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out
