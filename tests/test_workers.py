"""Tensor/expert-parallel worker processes on the CPU with gloo: real processes, real process groups.

Parity: TP=2, EP=2 and TP=2 x EP=2 give the logits of one rank (float64 to ~1e-12); the engine on
workers gives the in-process engine's tokens. Faults: a corrupt shard only rank 1 reads fails
start-up naming rank 1 and leaves no process; a worker killed mid-generation ends the in-flight
requests with UNAVAILABLE naming the rank, within seconds. Memory: each rank holds about 1/TP of
the split weights plus the replicated ones.
"""

from __future__ import annotations

import json
import re
import multiprocessing as mp
import os
import signal
import shutil
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3backend.checkpoint import checkpoint_files, load_model
from k3backend.engine.client import EngineClient
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore
from k3backend.engine.core_process import CoreSpec
from k3backend.engine.plan import ScheduledSeq, SlotRequest, StepPlan
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.engine.workers import MultiProcessExecutor, WorkerFailure
from k3backend.generate import full_forward
from k3backend.presets import make_checkpoint
from k3backend.tokenizer import Tokenizer
from serverutil import alive, wait_until
from engine_process_util import add_all, children, collect
from test_engine import run

CFG = EngineConfig(max_model_len=512, cpu_cache_gb=0.05, block_size=16, snapshot_interval=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_workers"))


def prefill_plan(ids: list[int]) -> StepPlan:
    blocks = tuple(range(1, -(-len(ids) // CFG.block_size) + 1))
    return StepPlan(seqs=[ScheduledSeq(1, tuple(ids), 0, False, blocks, True)],
                    new=[SlotRequest(1, SamplingParams(max_tokens=1, temperature=0.0), 0, (), (), (), ())])


@pytest.fixture(scope="module")
def ckpt_mx(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_workers_mx"), experts="mxfp4")


@pytest.mark.parametrize("experts, tp, ep", [("bf16", 2, 1), ("bf16", 2, 2), ("bf16", 4, 2), ("mxfp4", 2, 1),
                                             ("mxfp4", 2, 2)],
                         ids=["tp2", "tp2-ep2", "tp4-ep2", "mxfp4-tp2", "mxfp4-tp2-ep2"])
def test_parallel_logits_equal_one_rank(request, experts, tp, ep):
    """tp4-ep2 is TP=2 x EP=2 in the MoE: 2 expert groups of 2 moe-TP ranks each. mxfp4: the experts
    stay packed on every rank (moe-TP slices of whole 32-value groups, whole experts under EP)."""
    ckpt = request.getfixturevalue("ckpt_mx" if experts == "mxfp4" else "ckpt")
    ids = list(range(10, 47))
    ref = full_forward(load_model(ckpt, dtype=torch.float64, progress=False), ids)[-1]
    ex = MultiProcessExecutor(str(ckpt), CFG, dtype="float64", gpus=None, world_size=tp, ep_size=ep)
    try:
        got = ex.logits(prefill_plan(ids))[0]
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
        single = sum(p.numel() * p.element_size() for p in load_model(ckpt, dtype=torch.float64, progress=False,
                                                                       vision=False).parameters())
        for r in ex.ranks:  # split weights / tp + replicated ones: well below one rank's full copy
            assert r.weight_bytes < single * (0.5 + 1.0 / tp)
        assert sum(r.weight_bytes for r in ex.ranks) > single  # replicated parts are counted on every rank
    finally:
        ex.close()
    assert all(p.exitcode == 0 for p in ex._procs)


def test_parallel_logits_fp32_within_the_reference_noise(ckpt):
    ids = list(range(5, 40))
    ref = full_forward(load_model(ckpt, dtype=torch.float32, progress=False), ids)[-1]
    ex = MultiProcessExecutor(str(ckpt), CFG, dtype="float32", gpus=None, world_size=2)
    try:
        got = ex.logits(prefill_plan(ids))[0]
    finally:
        ex.close()
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)  # reduction order: fp32 rounding noise only


def test_engine_core_on_workers_gives_the_in_process_tokens_and_a_killed_worker_fails_it(ckpt):
    """The serving layout: an engine-core process coordinating two worker ranks gives the in-process
    engine's tokens; SIGKILL of rank 1 ends the in-flight request with a failure naming the rank and
    signal within 5 s, and no process of the engine is left."""
    tok = Tokenizer.from_dir(ckpt)
    reqs = [Request(f"w{i}", tok.encode(f"worker test {i}: hello", allow_special=True),
                    SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i)) for i in range(4)]
    inproc = run(EngineCore(InProcessExecutor(load_model(ckpt, dtype=torch.float64, progress=False), CFG), CFG), reqs)
    client = EngineClient(CoreSpec(str(ckpt), CFG, "float64", "cpu", tensor_parallel_size=2))
    try:
        got = collect(client, add_all(client, reqs))
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in inproc.items()}
        assert client.ready.workers_alive == 2
        ranks = children(client.process.pid)
        assert len(ranks) == 2, ranks

        long = Request("long", tok.encode("run until killed", allow_special=True),
                       SamplingParams(max_tokens=400, min_tokens=400, ignore_eos=True))
        killed = []

        def on_token(name, token):
            if not killed:
                victim = max(ranks)  # spawned second: rank 1
                os.kill(victim, signal.SIGKILL)
                killed.append((victim, time.monotonic()))

        out = collect(client, add_all(client, [long]), on_token=on_token)["long"]
        victim, at = killed[0]
        assert time.monotonic() - at < 5
        assert out.finish is FinishReason.ERROR
        assert re.search(rf"worker rank 1 pid {victim} (exited|closed its pipe) \(signal 9\)", out.error[1]), out.error
        wait_until(lambda: not client.alive and not any(alive(p) for p in ranks), 10, "every process to be gone")
    finally:
        client.close()


def test_corrupt_shard_seen_only_by_rank_1_fails_start_up_naming_it(ckpt, tmp_path):
    """Expert 7's w1 is read only by expert group 1 (EP=2): a mis-shaped copy of it fails rank 1 alone."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    victim = "language_model.model.layers.1.block_sparse_moe.experts.7.w1.weight"
    for f in checkpoint_files(bad):
        with safe_open(str(f), "pt") as sf:
            tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        if victim in tensors:
            tensors[victim] = tensors[victim][:-1]
            save_file(tensors, str(f), metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{victim} not in the checkpoint: {json.dumps([str(f) for f in checkpoint_files(bad)])}")
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"worker rank 1 failed: CheckpointError.*experts\.7\.w1") as info:
        MultiProcessExecutor(str(bad), CFG, dtype="float32", gpus=None, world_size=2, ep_size=2)
    assert "its last log lines" in str(info.value)
    assert time.monotonic() - start < 60
    wait_until(lambda: not mp.active_children(), 10, "every worker of the failed start-up to be gone")


def test_a_rank_gets_the_gpu_of_its_index_among_the_visible_ones(monkeypatch):
    """gpu_device_ids index the GPUs the server sees: under CUDA_VISIBLE_DEVICES=2,3 (or UUIDs),
    GPU 0 is physical 2, not physical 0."""
    from k3backend.engine.workers import visible_gpu

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [visible_gpu(i) for i in (0, 1)] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert [visible_gpu(i) for i in (0, 1)] == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    assert visible_gpu(1) == "GPU-bb"
    with pytest.raises(ValueError, match="not among the 2"):
        visible_gpu(2)
