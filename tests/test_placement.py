"""Placement host_ep (docs/deployment.md): TP inside each host, replicated across hosts, and the
routed experts split across hosts, so that only the MoE reduction crosses hosts.

Layout: which TP rank, TP size and expert group every rank gets, and that one host degenerates
to "tp" (expert_parallel_size must equal nnodes, else the load, the executor and the worker
command refuse naming both). Collectives: with torch.distributed's calls recorded, a forward
under host_ep puts exactly the MoE reductions on the world group and everything else on the
host's group. Parity: two "hosts" as separate process trees (`python -m k3backend worker`, as in
tests/test_multinode.py), gloo, the tiny checkpoint at float64, 2 hosts x 1 rank and 2 hosts x 2
ranks: the logits of a prefill and the engine's greedy tokens equal one process's; a worker
started with placement tp is refused naming the placement first.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.engine.core import EngineCore
from k3backend.engine.nodes import NodePlan
from k3backend.engine.request import Request
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.engine.workers import MultiProcessExecutor, check_placement, placement_layout
from k3backend.generate import full_forward
from k3backend.model.moe import MoE
from k3backend.model.parallel import Parallel, ParallelConfigError
from k3backend.presets import make_checkpoint
from test_engine import run
from test_multinode import finished, free_port, start_worker, tree, workers  # noqa: F401 - workers: a fixture
from test_workers import CFG, prefill_plan


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_placement"))


def test_host_ep_layout_and_one_host():
    # 2 hosts x 2 ranks: a TP group per host, expert group = host
    assert [placement_layout("host_ep", 4, r, 2, 2) for r in range(4)] == [
        {"tp_size": 2, "tp_rank": r % 2, "ep_size": 2, "hosts": 2, "host": r // 2} for r in range(4)]
    par = Parallel(**placement_layout("host_ep", 4, 3, 2, 2))
    assert (par.ep_rank, par.moe_tp_size, par.moe_tp_rank) == (1, 2, 1)
    # the default placement is unchanged: one TP group over all ranks, expert groups inside it
    assert placement_layout("tp", 4, 3, 2, 2) == {"tp_size": 4, "tp_rank": 3, "ep_size": 2}
    # one host: host_ep is tp with expert_parallel_size 1; any other expert_parallel_size is refused
    for r in range(2):
        assert placement_layout("host_ep", 2, r, 1, 1) == placement_layout("tp", 2, r, 1, 1)
    check_placement("host_ep", 2, 1, 1)
    with pytest.raises(ValueError, match=r"expert_parallel_size 2 must equal nnodes 1"):
        check_placement("host_ep", 2, 2, 1)
    with pytest.raises(ValueError, match=r"expert_parallel_size 1 must equal nnodes 2"):
        check_placement("host_ep", 4, 1, 2)
    with pytest.raises(ValueError, match=r"placement 'dp': expected one of tp, host_ep"):
        check_placement("dp", 4, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size 1 == nnodes 2"):
        Parallel(2, 0, 1, hosts=2)


@pytest.mark.parametrize("params, message", [
    ({"parallel_placement": "dp"}, r"parameter parallel_placement: expected one of \['tp', 'host_ep'\], got 'dp'"),
    ({"parallel_placement": "host_ep"}, r"placement host_ep .* expert_parallel_size 1 must equal nnodes 2"),
], ids=["unknown", "ep-not-nnodes"])
def test_bad_placement_fails_the_load_naming_it(params, message):
    from k3backend.config import ConfigError
    from k3backend.engine.config import EngineConfig
    from k3backend.serving.lm_adapter import MODEL, PARAMETERS, LmServer
    from k3backend.serving.triton_io import ModelParams

    def core_spec(ep: int, **values):
        values = {"nnodes": "2", "master_addr": "10.0.0.1", **values}
        p = ModelParams({"parameters": {k: {"string_value": v} for k, v in values.items()}}, PARAMETERS, MODEL)
        return LmServer._core_spec(p, "ckpt", EngineConfig(), torch.device("cpu"), torch.float64, 2, ep)

    with pytest.raises(ConfigError, match=rf"^k3_lm: .*{message}"):
        core_spec(1, **params)
    assert core_spec(2, parallel_placement="host_ep").placement == "host_ep" and core_spec(2).placement == "tp"


def test_the_worker_command_refuses_host_ep_with_another_expert_parallel_size(ckpt, workers):
    worker = start_worker(ckpt, free_port(), "--placement", "host_ep", "--expert-parallel-size", "1")
    workers.append(worker)
    out = finished(worker, 60)
    assert worker.returncode == 2 and "expert_parallel_size 1 must equal nnodes 2" in out, out


def test_only_the_moe_reduction_uses_the_world_group(ckpt, monkeypatch):
    """Rank 0 of 2 hosts x 2 ranks, with torch.distributed's collectives recorded (and no-ops): the
    world group sees one all-reduce per MoE layer, of [routed latent | shared]; the host group the
    embedding, every o_proj and dense down_proj, and the logits' all-gather."""
    import torch.distributed as dist

    calls: list[tuple[str, str, int]] = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None, **kw: calls.append(("all_reduce", group,
                                                                                        x.shape[-1])))

    def all_gather(parts, x, group=None, **kw):
        calls.append(("all_gather", group, x.shape[-1]))
        for p in parts:
            p.copy_(x)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    par = Parallel(**placement_layout("host_ep", 4, 0, 2, 2), group="host", world_group="world")
    model = load_model(ckpt, dtype=torch.float64, progress=False, par=par, vision=False)
    text = model.cfg.text
    moe = sum(isinstance(m, MoE) for m in model.modules())
    full_forward(model, list(range(10, 30)))
    world = [c for c in calls if c[1] == "world"]
    assert moe > 0 and world == [("all_reduce", "world", text.routed_expert_hidden_size + text.hidden_size)] * moe
    host = [c for c in calls if c[1] == "host"]
    dense = text.num_hidden_layers - moe
    assert sorted(host) == sorted([("all_reduce", "host", text.hidden_size)] * (1 + text.num_hidden_layers + dense)
                                  + [("all_gather", "host", text.vocab_size // 2)])
    assert len(calls) == len(world) + len(host)


@pytest.mark.parametrize("tp", [2, 4], ids=["2x1", "2x2"])
def test_two_hosts_host_ep_equals_one_process(ckpt, workers, tp):
    """2 hosts x tp/2 ranks, expert group n on host n. 2x1 first refuses a worker started with the
    default placement, naming it."""
    ids = list(range(10, 47))
    one = load_model(ckpt, dtype=torch.float64, progress=False)
    ref = full_forward(one, ids)[-1]
    reqs = [Request(f"p{i}", list(range(20 + i, 40 + 5 * i)), SamplingParams(max_tokens=8, temperature=0.0))
            for i in range(3)]
    want = run(EngineCore(InProcessExecutor(one, CFG), CFG), reqs)
    port = free_port()
    built: dict = {}

    def coordinator():
        try:
            built["ex"] = MultiProcessExecutor(str(ckpt), CFG, dtype="float64", gpus=None, world_size=tp, ep_size=2,
                                               nodes=NodePlan(2, "127.0.0.1", port, 120.0), placement="host_ep",
                                               startup_timeout_s=300)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            built["error"] = e

    thread = threading.Thread(target=coordinator, daemon=True)  # a failed test does not wait for its start-up
    thread.start()
    ex = good = None
    try:
        if tp == 2:
            bad = start_worker(ckpt, port)
            workers.append(bad)
            out = finished(bad, 120)
            refusal = [line for line in out.splitlines() if "refused by the Triton host" in line]
            assert bad.returncode == 2 and len(refusal) == 1, out
            assert "placement: worker 'tp' != Triton host 'host_ep'" in refusal[0], out
        good = start_worker(ckpt, port, "--placement", "host_ep", "--tensor-parallel-size", str(tp))
        workers.append(good)
        thread.join(240)
        assert "error" not in built, built.get("error")
        ex = built["ex"]
        torch.testing.assert_close(ex.logits(prefill_plan(ids))[0], ref, atol=1e-10, rtol=0)
        got = run(EngineCore(ex, CFG), reqs)
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
        assert all(len(v.token_ids) == 8 for v in got.values())
    finally:
        if ex is not None:
            ex.close()
        else:  # start-up failed or still waits: stop this host's rank, which exit would otherwise wait for
            for p in mp.active_children():
                if p.name.startswith("k3-rank"):
                    p.kill()
        thread.join(5)
    assert good is not None and ex is not None
    good.wait(20)
    assert not tree(good.pid) and not any(p.is_alive() for p in ex._procs)
