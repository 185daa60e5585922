"""The engine core in its own process (ENGINE.md §8): what crosses the pipe, and how it ends.

The same requests give the same ids through `EngineClient` as through `EngineCore` in process; a
step that raises is reported once as a failure naming it; a killed engine core is seen at once;
close() leaves no process. (The worker ranks behind it: tests/test_workers.py; the serving layer
on top: tests/test_lm_adapter.py and the server tests.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from k3backend.engine.client import EngineClient, EngineStartError
from k3backend.engine.config import EngineConfig
from k3backend.engine.core_process import CoreSpec
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.sampling_params import SamplingParams
from engine_process_util import add_all, collect
from serverutil import alive, wait_until
from test_engine import ckpt, model64, new_core, one_thread, run, tok  # noqa: F401 - fixtures

CFG = EngineConfig(max_model_len=1024, cpu_cache_gb=0.25)


@pytest.fixture(scope="module")
def client(ckpt):
    c = EngineClient(CoreSpec(str(ckpt), CFG, "float64", "cpu"))
    yield c
    c.close()


def requests(tok, n: int, max_tokens: int = 8) -> list[Request]:
    return [Request(f"p{i}", tok.encode(f"process boundary {i}: " + "xy" * i, allow_special=True),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.8, seed=i,
                                   logprobs=2 if i == 1 else None))
            for i in range(n)]


def test_the_engine_process_gives_the_in_process_ids(client, model64, tok):
    reqs = requests(tok, 6)
    alone = run(new_core(model64), reqs)
    got = collect(client, add_all(client, reqs))
    for r in reqs:
        assert got[r.request_id].token_ids == alone[r.request_id].token_ids, r.request_id
        assert got[r.request_id].finish is FinishReason.LENGTH
    assert client.ready.info.vocab_size == 512 and client.alive


def test_an_abort_and_a_refused_request_come_back_as_outputs(client, tok):
    long = Request("long", tok.encode("abort me", allow_special=True),
                   SamplingParams(max_tokens=500, min_tokens=500, ignore_eos=True))
    bad = Request("bad", [], SamplingParams())
    rids = add_all(client, [long, bad])
    seen = []

    def on_token(name, token):
        seen.append(token)
        if len(seen) == 3:
            client.abort(next(r for r, n in rids.items() if n == "long"))

    got = collect(client, rids, on_token=on_token)
    assert got["long"].finish is FinishReason.CANCELLED and 3 <= len(got["long"].token_ids) < 500
    assert got["bad"].finish is FinishReason.ERROR and got["bad"].error == ("INVALID_ARG", "prompt is empty")


def test_a_killed_engine_core_is_seen_at_once_and_named(ckpt, tok):
    c = EngineClient(CoreSpec(str(ckpt), CFG, "float32", "cpu"))
    try:
        rids = add_all(c, [Request("l", tok.encode("x", allow_special=True),
                                   SamplingParams(max_tokens=900, min_tokens=900, ignore_eos=True))])
        first = []
        start = [0.0]

        def on_token(name, token):
            if not first:
                first.append(token)
                os.kill(c.process.pid, signal.SIGKILL)
                start[0] = time.monotonic()

        got = collect(c, rids, on_token=on_token)
        assert time.monotonic() - start[0] < 5
        assert got["l"].finish is FinishReason.ERROR
        assert f"engine core process pid {c.process.pid} exited (signal 9)" in got["l"].error[1]
        assert c.receive() == []  # the failure is reported once
    finally:
        c.close()
    assert not c.process.is_alive()


def test_a_failed_step_is_reported_once_with_its_cause():
    """The loop of the engine-core process around a core whose step raises: one ("failed", reason)
    naming the exception, after the outputs of the steps before it; then the loop returns."""
    import multiprocessing as mp
    import pickle
    import threading

    from k3backend.engine.core_process import _Pipe, _serve
    from k3backend.engine.outputs import StepOutputs

    class Broken:
        has_work = True
        steps = 0

        def step(self):
            self.steps += 1
            if self.steps == 3:
                raise ValueError("injected fault")
            return StepOutputs()

    ours, theirs = mp.Pipe()
    t = threading.Thread(target=_serve, args=(Broken(), _Pipe(theirs)))
    t.start()
    t.join(10)
    messages = []
    while ours.poll(0):
        messages.append(pickle.loads(ours.recv_bytes()))
    assert [m[0] for m in messages] == ["step", "step", "failed"]
    assert messages[-1][1] == "engine step failed: ValueError: injected fault"


def test_an_engine_core_whose_stub_is_gone_exits(ckpt):
    c = EngineClient(CoreSpec(str(ckpt), CFG, "float32", "cpu"))
    pid = c.process.pid
    c.conn.close()  # the stub's end of the pipe is gone: EOF for the engine core
    wait_until(lambda: not alive(pid), 10, "the engine core to exit on EOF")
    c.close()


def test_close_ends_an_engine_core_blocked_on_outputs_nobody_reads(ckpt, tok):
    """Once the serving layer's reader has stopped (its response thread ended at shutdown), the engine
    core fills the pipe with step outputs and blocks sending, so it never reads "close": close() then
    waited its whole timeout and killed the core (a shutdown stalled 20 s; the stub later crashed)."""
    c = EngineClient(CoreSpec(str(ckpt), CFG, "float32", "cpu"))
    pid = c.process.pid
    c.add(Request("long", tok.encode("fill the pipe", allow_special=True),
                  SamplingParams(max_tokens=900, min_tokens=900, ignore_eos=True, logprobs=20)))
    wait_until(lambda: _unread_bytes(c.conn) > 60_000, 60, "the engine core to fill its pipe (nobody reads)")
    time.sleep(0.5)  # and block in its next send
    t0 = time.monotonic()
    c.close(timeout=15)
    assert time.monotonic() - t0 < 5, "close() waited for an engine core blocked on its own outputs"
    assert not alive(pid)


def _unread_bytes(conn) -> int:
    """Bytes waiting in a pipe (Linux FIONREAD); its capacity is 64 KiB."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_start_up_failure_is_raised_with_the_engine_cores_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineStartError, match="the engine core failed to start"):
        EngineClient(CoreSpec(str(tmp_path), CFG, "float32", "cpu", startup_timeout_s=60))
