"""k3_lm with tensor_parallel_size 2 on a real tritonserver: worker processes, faults, reload (SERVING.md §8).

One explicit-mode server, in phases: greedy text equals one rank's; SIGKILL of a worker ends the
stream in flight with UNAVAILABLE within 5 s and unloads k3_lm and k3_ensemble ([HLT-5], [HLT-7]);
a reload brings fresh workers ([HLT-8]); SIGKILL of the stub leaves no worker after 10 s ([HLT-10]).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.detokenizer import detokenize_all
from k3backend.engine.sampling_params import SamplingParams
from k3backend.generate import generate
from k3backend.tokenizer import Tokenizer
from k3client import http_post, metric, metrics
from serverutil import alive, load_repository_model, none_ready, repo_copy, stub_pid, wait_until, worker_pids
from test_lm_faults import LONG, Watch


@pytest.fixture(scope="module", autouse=True)
def default_checkpoint(tmp_path_factory):
    os.environ["K3_DEFAULT_CHECKPOINT"] = str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0")


def test_tp2_serves_like_one_rank_and_survives_a_worker_kill(triton_server, tmp_path):
    repo = repo_copy(tmp_path / "repo", k3_lm={"tensor_parallel_size": "2", "dtype": "float64"})
    srv = triton_server(repo, ["k3_ensemble"], ["--model-control-mode=explicit", "--load-model=k3_ensemble"],
                        fresh=True)
    pids = worker_pids(srv.log_path)
    assert sorted(pids) == [0, 1] and stub_pid(srv.log_path) not in pids.values()

    # greedy text of two ranks equals one rank's (float64: batching and reduction order are below argmax)
    prompt = "The capital of France is"
    status, body = http_post(srv.http_url, "/v2/models/k3_ensemble/generate",
                             {"text_input": prompt, "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
                              "temperature": 0})
    assert status == 200, body
    ckpt = os.environ["K3_DEFAULT_CHECKPOINT"]
    tok = Tokenizer.from_dir(ckpt)
    ref = [s.token for s in generate(load_model(ckpt, dtype=torch.float64, progress=False),
                                     tok.encode_text_input(prompt),
                                     SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True))]
    assert json.loads(body)["text_output"] == detokenize_all(tok, ref)[0]

    # a worker killed mid-stream: UNAVAILABLE within 5 s, engine_healthy 0, not ready (explicit mode)
    watch = Watch(srv.grpc_url, "k3_lm", {"text_input": "long", **LONG}, "victim")
    try:
        wait_until(lambda: watch.responses, 60, "the first response")
        os.kill(pids[1], signal.SIGKILL)
        took = wait_until(watch.final.is_set, 5, "the stream to end")
        assert watch.error and "UNAVAILABLE" in watch.error and "worker rank 1" in watch.error, watch.error
    finally:
        watch.close()
    assert took < 5
    wait_until(lambda: none_ready(srv.http_url, "k3_lm", "k3_ensemble"), 5, "k3_lm and k3_ensemble to be not ready")
    wait_until(lambda: not any(alive(p) for p in pids.values()), 10, "the other worker to exit")

    # reload: fresh workers serve again
    load_repository_model(srv.http_url, "k3_ensemble")
    fresh = worker_pids(srv.log_path)  # the log keeps both generations; the last lines win
    assert set(fresh.values()).isdisjoint(pids.values()) and sorted(fresh) == [0, 1]
    status, body = http_post(srv.http_url, "/v2/models/k3_ensemble/generate", {"text_input": "again", "max_tokens": 3})
    assert status == 200, body
    # the gauge is published every 0.25 s: poll it (read once, right after the response, it can still be the
    # value published before the first step of the reloaded engine)
    wait_until(lambda: metric(metrics(srv.metrics_url), "k3:workers_alive") == 2, 5, "k3:workers_alive == 2")

    # SIGKILL of the stub: its workers are gone within 10 s
    stub = stub_pid(srv.log_path, last=True)
    os.kill(stub, signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in fresh.values()), 10, "the workers of the killed stub to exit")
    time.sleep(0.1)
