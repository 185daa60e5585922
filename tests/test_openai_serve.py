"""`k3backend serve --openai` (what `scripts/serve --openai` runs): tritonserver and the OpenAI
gateway start together, stop together, and the gateway answers 429 when k3_lm's queue is full
and 503 when the model is not loaded. One private server with room for one running and one
queued request (max_num_seqs 1, max_queued_requests 1), in explicit model-control mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from gatewayutil import http_status
from k3client import http_post, metric, metrics
from serverutil import alive, child_pids, group_pids, repo_copy, wait_until

from k3backend.tritonserver import _free_ports

KEY = "serve-key"
MESSAGES = [{"role": "user", "content": "Tell me a long story"}]


@dataclass
class Served:
    proc: subprocess.Popen
    http: str
    metrics: str
    openai: str
    log_path: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-openai")
    repo = repo_copy(tmp / "repo", k3_lm={"max_num_seqs": "1", "max_queued_requests": "1", "cpu_cache_gb": "1"})
    http, grpc, metrics_port, port = _free_ports(4)
    # The checkpoint of the modules before this one, if any: building one takes half a minute.
    ckpt = os.environ.get("K3_DEFAULT_CHECKPOINT") or str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0")
    cmd = [sys.executable, "-m", "k3backend", "serve", "--model-repository", str(repo), "--backend-root", str(tmp),
           f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics_port}",
           "--openai", "--openai-port", str(port), "--api-key", KEY,
           "--model-control-mode=explicit", "--load-model=k3_ensemble"]
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(cmd, env={**os.environ, "K3_DEFAULT_CHECKPOINT": ckpt}, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    served = Served(proc, f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics_port}/metrics",
                    f"http://127.0.0.1:{port}", tmp / "serve.log")
    try:
        wait_until(lambda: proc.poll() is not None or http_status(served.openai + "/health") == 200, 300,
                   "the gateway's /health to turn 200")
        assert proc.poll() is None, served.log_path.read_text()
        yield served
    finally:
        children = child_pids(proc.pid)
        if proc.poll() is None:  # a test failed before the SIGTERM test: stop both the same way
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        log.close()


def _client(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.openai + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _count(served, name: str) -> float:
    return metric(metrics(served.metrics), name, model="k3_lm")


def test_full_queue_is_429_and_the_held_requests_are_freed(served):
    async def run() -> None:
        c = _client(served)
        long = dict(model="k3", messages=MESSAGES, max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
        first = await c.chat.completions.create(**long)
        await first.__anext__()  # running
        queued = asyncio.create_task(c.chat.completions.create(**long))  # no answer until it runs
        await asyncio.to_thread(wait_until, lambda: _count(served, "k3:num_requests_waiting") == 1, 30,
                                "the second request to queue")
        with pytest.raises(openai.RateLimitError, match="request queue is full"):
            await c.chat.completions.create(**long)
        queued.cancel()
        await first.close()
        await c.close()

    asyncio.run(run())
    wait_until(lambda: _count(served, "k3:num_requests_running") + _count(served, "k3:num_requests_waiting") == 0,
               2, "both held requests to be freed")


def test_unloaded_model_is_503(served):
    # k3_lm: text requests go to it directly, and the ensemble cannot run without it
    assert http_post(served.http, "/v2/repository/models/k3_lm/unload", {})[0] == 200
    wait_until(lambda: http_status(served.openai + "/health") == 503, 30, "/health to report 503")

    async def run() -> None:
        c = _client(served)
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model="k3", messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 503 and "not ready" in str(e.value)
        await c.close()

    asyncio.run(run())


def test_sigterm_stops_both_and_leaves_nothing_running(served):
    children = child_pids(served.proc.pid)  # tritonserver and the gateway, each in its own process group
    assert len(children) == 2
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(90) == 0, served.log_path.read_text()[-3000:]
    for pid in children:
        assert not alive(pid) and not group_pids(pid)
