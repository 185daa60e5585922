"""One k3_lm over two "hosts" on this machine: the Triton host (node 0) and a `python -m k3backend
worker` (node 1) as separate process trees, meeting on loopback ports, gloo, the tiny checkpoint
at float64, TP=2 x EP=2 (one rank and one expert group per host). Network namespaces joined by a
veth pair are not used: the link is loopback (docs/deployment.md).

Rendezvous: a missing node fails the start-up naming it; workers with another dtype, checkpoint
or TP size are refused naming the difference on both sides, then a matching one joins and gives
one rank's logits; once its whole tree is stopped (no EOF, as for a hung host or a cut link) the
next step fails naming node 1 after SILENCE_S; a stopped engine core makes node 1 stop its rank
and exit after SILENCE_S. Bad multi-host parameters fail the load naming them.

Served: greedy text equals one process's; SIGKILL of node 1's rank, then of a restarted node 1's
whole agent, ends the stream in flight with UNAVAILABLE naming node and rank within 10 s and
makes k3_lm not ready; every process of both trees exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.detokenizer import detokenize_all
from k3backend.engine.client import EngineClient
from k3backend.engine.core_process import CoreSpec
from k3backend.engine.nodes import HEARTBEAT_S, SILENCE_S, NodePlan
from k3backend.engine.sampling_params import SamplingParams
from k3backend.engine.workers import MultiProcessExecutor, WorkerFailure
from k3backend.generate import full_forward, generate
from k3backend.presets import ensure_default_checkpoint, make_checkpoint
from k3backend.tokenizer import Tokenizer
from k3client import http_post
from serverutil import (alive, child_pids, load_repository_model, log_pid, none_ready, repo_copy, wait_until,
                        worker_pids)
from engine_process_util import children
from test_lm_faults import LONG, Watch
from test_workers import CFG, prefill_plan

TP, EP = "2", "2"


@pytest.fixture(scope="module", autouse=True)
def default_checkpoint(tmp_path_factory):
    os.environ["K3_DEFAULT_CHECKPOINT"] = str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0")
    return ensure_default_checkpoint()  # before any worker fingerprints it


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(ckpt, port: int, *extra: str, timeout_s: float = 120) -> subprocess.Popen:
    """Node 1 as its own process tree (own session), as on another host."""
    args = {"--checkpoint": str(ckpt), "--nnodes": "2", "--node-rank": "1", "--master-addr": "127.0.0.1",
            "--master-port": str(port), "--tensor-parallel-size": TP, "--expert-parallel-size": EP,
            "--device": "cpu", "--dtype": "float64", "--dist-timeout-s": str(timeout_s)}
    for key, value in zip(extra[::2], extra[1::2]):
        args[key] = value
    argv = [sys.executable, "-m", "k3backend", "worker", *[x for kv in args.items() for x in kv]]
    fd, log = tempfile.mkstemp(prefix="k3-worker-", suffix=".log")  # a file: a full pipe would stall its ranks
    worker = subprocess.Popen(argv, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(fd)
    worker.log_path = Path(log)
    return worker


def finished(worker: subprocess.Popen, timeout: float) -> str:
    """Wait for the worker to exit; its output."""
    worker.wait(timeout)
    return worker.log_path.read_text(errors="replace")


@pytest.fixture
def workers():
    """Started workers (`workers.append(start_worker(...))`), stopped with their trees at the end: SIGTERM to the
    worker's session first, which multiprocessing's resource tracker ignores, so it outlives the rest and unlinks
    their semaphores (a SIGKILL of the whole tree left one in /dev/shm), then SIGKILL whatever is left."""
    started: list[subprocess.Popen] = []
    yield started
    for w in started:
        pids = tree(w.pid)
        if pids:
            try:
                os.killpg(w.pid, signal.SIGTERM)  # its own session (start_worker): the tree's group
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while tree(w.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        for pid in tree(w.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        w.wait(10)
        if pids:  # it was still running: show what it said (pytest prints it if the test failed)
            print(f"--- worker pid {w.pid} output (tail) ---\n{finished(w, 1)[-4000:]}")
        w.log_path.unlink(missing_ok=True)


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo += child_pids(p)
    return out


def test_a_silent_triton_host_makes_the_worker_stop_its_ranks_and_exit(default_checkpoint, workers):
    """The engine core stopped (SIGSTOP: no EOF, as for a hung host or a cut link): node 1's agent
    gives it up after SILENCE_S, stops its rank and exits 1."""
    port = free_port()
    worker = start_worker(default_checkpoint, port)
    workers.append(worker)
    client = EngineClient(CoreSpec(str(default_checkpoint), CFG, "float64", "cpu", tensor_parallel_size=2,
                                   expert_parallel_size=2, nodes=NodePlan(2, "127.0.0.1", port, 120.0)))
    try:
        remote = [p for p in tree(worker.pid) if p != worker.pid]  # its rank (and multiprocessing's tracker)
        assert remote and client.ready.workers_alive == 2
        os.kill(client.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        out = finished(worker, SILENCE_S + 20)
        took = time.monotonic() - start
        assert worker.returncode == 1 and "nothing from the Triton host" in out, out
        assert SILENCE_S - HEARTBEAT_S - 0.1 <= took < SILENCE_S + 5  # from the host's last answer
        wait_until(lambda: not any(alive(p) for p in remote), 5, "node 1's processes to exit")
        print(f"Triton host silent: node 1 stopped in {took:.2f} s")
    finally:
        os.kill(client.process.pid, signal.SIGCONT)
        local = children(client.process.pid)
        client.close(timeout=10)
    wait_until(lambda: not any(alive(p) for p in local), 20, "the Triton host's worker to exit")


@pytest.mark.parametrize("params, tp, message", [
    ({"nnodes": "2"}, 3, r"tensor_parallel_size 3 is not divisible by nnodes 2"),
    ({"nnodes": "2"}, 2, r"nnodes 2 needs master_addr .* got '':29500"),
    ({"nnodes": "2", "master_addr": "10.0.0.1", "node_rank": "1"}, 2, r"node_rank 1: the Triton host is node 0"),
    ({"nnodes": "2", "master_addr": "10.0.0.1", "node_rank": "2"}, 2, r"node_rank 2 is not in \[0, 1\]"),
    ({"master_port": "0"}, 2, r"parameter master_port: expected an integer in \[1, 65535\], got '0'"),
    ({"nnodes": "0"}, 2, r"parameter nnodes: expected an integer in \[1, inf\], got '0'"),
    ({"dist_timeout_s": "-1"}, 2, r"parameter dist_timeout_s: expected a finite number >= 0.001, got '-1'"),
], ids=["tp-not-divisible", "no-master-addr", "node-rank-1", "node-rank-out-of-range", "port-0", "nnodes-0",
        "negative-timeout"])
def test_bad_multi_host_parameters_fail_the_load_naming_them(params, tp, message):
    from k3backend.config import ConfigError
    from k3backend.engine.config import EngineConfig
    from k3backend.serving.lm_adapter import MODEL, PARAMETERS, LmServer
    from k3backend.serving.triton_io import ModelParams

    def core_spec(tp: int = 2, **values):
        p = ModelParams({"parameters": {k: {"string_value": v} for k, v in values.items()}}, PARAMETERS, MODEL)
        return LmServer._core_spec(p, "ckpt", EngineConfig(), torch.device("cpu"), torch.float64, tp, 1)

    with pytest.raises(ConfigError, match=rf"^k3_lm: .*{message}"):
        core_spec(tp, **params)
    good = core_spec(nnodes="2", master_addr="10.0.0.1", master_port="29511", dist_timeout_s="60")
    assert good.nodes == NodePlan(2, "10.0.0.1", 29511, 60.0) and core_spec().nodes is None


@pytest.mark.parametrize("extra, message", [
    (("--node-rank", "0"), "node_rank 0 is the Triton host"),
    (("--tensor-parallel-size", "3"), "tensor_parallel_size 3 is not divisible by nnodes 2"),
], ids=["node-rank-0", "tp-not-divisible"])
def test_the_worker_command_refuses_settings_that_cannot_work(default_checkpoint, workers, extra, message):
    worker = start_worker(default_checkpoint, free_port(), *extra)
    workers.append(worker)
    out = finished(worker, 60)
    assert worker.returncode == 2 and message in out, out


def test_a_missing_node_fails_start_up_naming_it():
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"node\(s\) \[1\] did not join within dist_timeout_s 2 .*master_port"):
        MultiProcessExecutor(os.environ["K3_DEFAULT_CHECKPOINT"], CFG, dtype="float64", gpus=None, world_size=2,
                             ep_size=2, nodes=NodePlan(2, "127.0.0.1", free_port(), 2.0))
    assert time.monotonic() - start < 30


def test_mismatched_workers_are_refused_naming_the_difference_then_one_joins_until_its_host_is_silent(
        default_checkpoint, tmp_path, caplog, workers):
    caplog.set_level(logging.ERROR, logger="k3backend.engine.nodes")
    port = free_port()
    other = make_checkpoint("tiny", tmp_path / "seed1", seed=1)
    built: dict = {}

    def coordinator():
        try:
            built["ex"] = MultiProcessExecutor(str(default_checkpoint), CFG, dtype="float64", gpus=None, world_size=2,
                                               ep_size=2, nodes=NodePlan(2, "127.0.0.1", port, 120.0))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            built["error"] = e

    thread = threading.Thread(target=coordinator)
    thread.start()
    bad = {"dtype: worker 'float32' != Triton host 'float64'": start_worker(default_checkpoint, port,
                                                                          "--dtype", "float32"),
           "weights_sha256: worker": start_worker(other, port),
           "tensor_parallel_size: worker 4 != Triton host 2": start_worker(default_checkpoint, port,
                                                                             "--tensor-parallel-size", "4")}
    workers += bad.values()
    ex = None
    try:
        for why, worker in bad.items():
            out = finished(worker, 120)
            refusal = [line for line in out.splitlines() if "refused by the Triton host" in line]
            assert worker.returncode == 2 and len(refusal) == 1 and why in refusal[0], out
            assert "config_sha256" not in refusal[0]  # each differs in the one field it names (seed 1: weights)
        for why in bad:
            assert any(why in r.getMessage() and "refused" in r.getMessage() for r in caplog.records), why
        good = start_worker(default_checkpoint, port)
        workers.append(good)
        thread.join(120)
        assert "error" not in built, built.get("error")
        ex = built["ex"]
        ids = list(range(10, 47))
        ref = full_forward(load_model(default_checkpoint, dtype=torch.float64, progress=False), ids)[-1]
        torch.testing.assert_close(ex.logits(prefill_plan(ids))[0], ref, atol=1e-12, rtol=0)
        remote = ex._procs[1]
        assert remote.pid in tree(good.pid) and ex.workers_alive == 2

        # node 1 goes silent (its whole tree stopped: a hung host or a cut link, no EOF): a step fails
        stopped = tree(good.pid)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"node 1 \(.*\): its worker agent pid \d+ sent nothing for .* "
                                                r"lost worker rank 1"):
            ex.logits(prefill_plan(ids))
        took = time.monotonic() - start
        # silence counts from the node's last heartbeat, which came up to HEARTBEAT_S before the stop
        assert SILENCE_S - HEARTBEAT_S - 0.1 <= took < SILENCE_S + 3
        print(f"node 1 silent: detected in {took:.2f} s")
    finally:
        for pid in locals().get("stopped", []):
            os.kill(pid, signal.SIGCONT)
        if ex is not None:
            ex.close()
        thread.join(5)
    good.wait(20)
    assert not tree(good.pid) and not any(alive(p.pid) for p in ex._procs)


def assert_greedy_like_one_process(srv, ckpt) -> None:
    """Greedy text through the server equals one process's (float64)."""
    prompt = "The capital of France is"
    status, body = http_post(srv.http_url, "/v2/models/k3_ensemble/generate",
                             {"text_input": prompt, "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
                              "temperature": 0})
    assert status == 200, body
    tok = Tokenizer.from_dir(ckpt)
    ref = [s.token for s in generate(load_model(ckpt, dtype=torch.float64, progress=False),
                                     tok.encode_text_input(prompt),
                                     SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True))]
    assert json.loads(body)["text_output"] == detokenize_all(tok, ref)[0]


def test_two_hosts_with_placement_host_ep_serve_like_one(triton_server, tmp_path, default_checkpoint, workers):
    """parallel_placement host_ep through tritonserver: each host a TP group of its own rank, the
    experts split between the hosts; greedy text equals one process's."""
    port = free_port()
    worker = start_worker(default_checkpoint, port, "--placement", "host_ep", timeout_s=600)
    workers.append(worker)
    repo = repo_copy(tmp_path / "repo", k3_lm={"tensor_parallel_size": TP, "expert_parallel_size": EP,
                                               "dtype": "float64", "nnodes": "2", "master_addr": "127.0.0.1",
                                               "master_port": str(port), "dist_timeout_s": "120",
                                               "parallel_placement": "host_ep"})
    srv = triton_server(repo, ["k3_ensemble"], ["--model-control-mode=explicit", "--load-model=k3_ensemble"],
                        fresh=True, startup_timeout_s=600)
    assert sorted(worker_pids(srv.log_path)) == [0, 1]
    assert_greedy_like_one_process(srv, default_checkpoint)


def test_two_hosts_serve_like_one_and_a_lost_remote_rank_or_host_fails_k3_lm(triton_server, tmp_path,
                                                                               default_checkpoint, workers):
    port = free_port()
    worker = start_worker(default_checkpoint, port, timeout_s=600)  # outwaits a slow server start
    workers.append(worker)
    repo = repo_copy(tmp_path / "repo", k3_lm={"tensor_parallel_size": TP, "expert_parallel_size": EP,
                                               "dtype": "float64", "nnodes": "2", "master_addr": "127.0.0.1",
                                               "master_port": str(port), "dist_timeout_s": "120"})
    srv = triton_server(repo, ["k3_ensemble"], ["--model-control-mode=explicit", "--load-model=k3_ensemble"],
                        fresh=True, startup_timeout_s=600)  # a bound for a loaded machine; ~30 s when quiet
    pids = worker_pids(srv.log_path)
    assert sorted(pids) == [0, 1] and pids[1] in tree(worker.pid) and pids[0] not in tree(worker.pid)

    assert_greedy_like_one_process(srv, default_checkpoint)

    def lose(victim: int, what: str) -> float:
        """SIGKILL `victim` mid-stream: UNAVAILABLE naming node 1 and rank 1 within 10 s, k3_lm not ready
        (unloaded: its engine core exits too)."""
        core = log_pid(srv.log_path, r"engine core pid (\d+)", last=True)
        watch = Watch(srv.grpc_url, "k3_lm", {"text_input": "long", **LONG}, what)
        try:
            wait_until(lambda: watch.responses, 240, "the first response")  # a bound for a loaded machine
            os.kill(victim, signal.SIGKILL)
            took = wait_until(watch.final.is_set, 10, "the stream to end")
            assert watch.error and "UNAVAILABLE" in watch.error, watch.error
            assert "node 1" in watch.error and "rank 1" in watch.error, watch.error
        finally:
            watch.close()
        wait_until(lambda: none_ready(srv.http_url, "k3_lm", "k3_ensemble"), 10, "k3_lm to be not ready")
        wait_until(lambda: not alive(core), 30, "the failed engine core to exit")
        return took

    took = lose(pids[1], "rank")
    print(f"node 1's rank killed: stream ended in {took:.2f} s")
    worker.wait(20)
    assert worker.returncode == 1  # its rank was lost
    wait_until(lambda: not tree(worker.pid) and not any(alive(p) for p in pids.values()), 20,
               "every process of both trees to exit")

    # node 1 restarted, k3_lm reloaded: it joins again; then the whole agent (the host) is lost
    worker = start_worker(default_checkpoint, port, timeout_s=600)
    workers.append(worker)
    load_repository_model(srv.http_url, "k3_ensemble")
    fresh = worker_pids(srv.log_path)
    assert fresh[1] in tree(worker.pid) and set(fresh.values()).isdisjoint(pids.values())
    took = lose(worker.pid, "host")
    print(f"node 1's agent killed: stream ended in {took:.2f} s")
    wait_until(lambda: not tree(worker.pid) and not any(alive(p) for p in fresh.values()), 20,
               "every process of both trees to exit")
    worker.wait(5)
