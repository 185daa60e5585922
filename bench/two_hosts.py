"""Two "hosts" on one machine, one device each: the Triton host's engine (node 0, rank 0) and a
`python -m k3backend worker` (node 1, rank 1) as separate process trees on loopback ports,
TP=2 x EP=2, against one process on one device. On GPUs: NCCL with peer-to-peer and shared memory
off, so the ranks talk through NCCL's network transport as across hosts (docs/deployment.md).

    python3 bench/two_hosts.py --device cuda --dtype float32     # 2 GPUs (bash bench/gpu_two_hosts.sh)
    python3 bench/two_hosts.py --device cpu --dtype float64      # gloo, as tests/test_multinode.py

Prints the command, versions, the largest logit difference of a prefill, and the greedy tokens of
a few requests (two hosts == one device); exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from k3backend.checkpoint import load_model
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore
from k3backend.engine.nodes import NodePlan
from k3backend.engine.plan import ScheduledSeq, SlotRequest, StepPlan
from k3backend.engine.request import Request
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.engine.workers import MultiProcessExecutor
from k3backend.presets import make_checkpoint

CFG = EngineConfig(max_model_len=512, max_num_batched_tokens=512, cpu_cache_gb=0.05, gpu_memory_utilization=0.3)


def greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add(i, Request(f"r{i}", ids, params))
    out: list[list[int]] = [[] for _ in prompts]
    while core.has_work:
        step = core.step()
        for rid, token in zip(step.ids.tolist(), step.tokens.tolist()):
            if token >= 0:
                out[rid].append(token)
    return out


def prefill_plan(ids: list[int]) -> StepPlan:
    blocks = tuple(range(1, -(-len(ids) // CFG.block_size) + 1))
    return StepPlan(seqs=[ScheduledSeq(1, tuple(ids), 0, False, blocks, True)],
                    new=[SlotRequest(1, SamplingParams(max_tokens=1, temperature=0.0), 0, (), (), (), ())])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--placement", default="tp", choices=["tp", "host_ep"], help="k3_lm parallel_placement")
    args = ap.parse_args()
    print("command:", " ".join(sys.argv), "| torch", torch.__version__,
          "| device", torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", flush=True)
    ckpt = make_checkpoint(args.preset, tempfile.mkdtemp(prefix="k3-two-hosts-"))
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    prompts = [list(range(10 + i, 40 + 7 * i)) for i in range(4)]
    one = InProcessExecutor.load(ckpt, CFG, dtype=dtype, device=device)
    ref_logits = one.runner.logits(prefill_plan(prompts[0]))[0].cpu()
    ref = greedy(EngineCore(one, CFG), prompts, args.tokens)
    del one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = "1"
    worker = subprocess.Popen([sys.executable, "-m", "k3backend", "worker", "--checkpoint", str(ckpt), "--nnodes", "2",
                               "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--device", args.device,
                               "--dtype", args.dtype, "--dist-timeout-s", "300",
                               "--placement", args.placement], env=env)
    os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")  # the local rank inherits them
    start = time.perf_counter()
    ex = MultiProcessExecutor(str(ckpt), CFG, dtype=args.dtype, gpus=[0] if args.device == "cuda" else None,
                              world_size=2, ep_size=2, nodes=NodePlan(2, "127.0.0.1", port, 300.0),
                              placement=args.placement)
    try:
        print(f"two hosts ready in {time.perf_counter() - start:.1f} s", flush=True)
        diff = (ex.logits(prefill_plan(prompts[0]))[0].cpu().double() - ref_logits.double()).abs().max().item()
        got = greedy(EngineCore(ex, CFG), prompts, args.tokens)
        ping = min(ex.ping() for _ in range(20))
    finally:
        ex.close()
    worker.wait(30)
    same = sum(a == b for a, b in zip(got, ref))
    print(f"\nplacement {args.placement}")
    print(f"\n| case | dtype | max |logit diff| of a prefill | greedy requests equal | empty step round trip | "
          f"worker exit |\n|---|---|---|---|---|---|\n| two hosts vs one {args.device} | {args.dtype} | {diff:.3g} | "
          f"{same}/{len(ref)} x {args.tokens} tokens | {ping * 1e3:.2f} ms | {worker.returncode} |")
    return 0 if same == len(ref) else 1


if __name__ == "__main__":
    sys.exit(main())
