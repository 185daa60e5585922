"""Where the device time of one engine step goes: torch.profiler over one decode step (a replay of
the captured graph, or eager with --enforce-eager) and one prefill, on random `small` weights.

    python bench/profile_step.py --batch 1 --context 256 --prefill 4096 --rows 25
    python bench/profile_step.py --batch --prefill 0 --after-prefix 3072:1024 4080:16   # chunks that continue a prefix

Prints, per step, the number of kernels, their summed device time and the top kernels by device
time (name, calls, total, mean), so a slow step can be traced to the kernel that makes it slow.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from engine import build_model
from k3backend.engine.batch import SeqChunk, blocks_for, build_forward_batch
from k3backend.engine.config import EngineConfig
from k3backend.engine.runner import InProcessExecutor


def table(prof, rows: int) -> str:
    """Kernels only (device events), grouped by name."""
    stats: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            s = stats.setdefault(e.name, [0, 0.0])
            s[0] += 1
            s[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in stats.values())
    lines = [f"{sum(int(v[0]) for v in stats.values())} kernels, {total / 1e3:.3f} ms of device time"]
    for name, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"  {t / total:6.1%} {t / 1e3:8.3f} ms {int(n):5d}x {t / n:8.1f} us  {name[:90]}")
    return "\n".join(lines)


def profiled(fn, rows: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm (compilation, autotuning)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    try:
        text = table(prof, rows)
    except Exception as e:  # noqa: BLE001 - another torch's event API: its own table then
        text = f"({e})\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
    print(f"\n== {label}\n{text}", flush=True)


def wall_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def graph_vs_eager(runner, chunk: SeqChunk, batch) -> None:
    """Wall time of the chunk's step eagerly and through its prefill graph, and the largest logit
    differences, each from the same state (slot 1's KDA state saved in slot 2 and restored): graph
    replay against the same padded batch run eagerly (the graph itself: 0 expected), and the padded
    batch against the chunk alone (other shapes, so other GEMM tilings: rounding, which a random
    model's near-tied routing can amplify)."""
    pools, graphs = runner.pools, runner.prefill_graphs
    slot, save = torch.tensor([1], device="cuda"), torch.tensor([2], device="cuda")

    def from_saved(fn):
        pools.copy_slot(save, slot)
        out = fn()[-1:].float()
        pools.copy_slot(save, slot)
        return out

    pools.copy_slot(slot, save)
    alone = from_saved(lambda: runner.model(batch, pools))
    graph = from_saved(lambda: graphs.run(chunk))
    padded = from_saved(lambda: graphs.forward(graphs.batch(graphs._size_for(len(chunk.token_ids)))))
    t_eager = wall_ms(lambda: runner.model(batch, pools))
    t_graph = wall_ms(lambda: graphs.run(chunk))
    d = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    print(f"   step wall time: eager {t_eager:.2f} ms, prefill graph {t_graph:.2f} ms; max |logits| differences: "
          f"graph vs padded eager {d(graph, padded):.3g}, padded vs alone {d(padded, alone):.3g} "
          f"(|logits| <= {alone.abs().max().item():.3g})", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--after-prefix", nargs="*", default=[], metavar="CACHED:NEW",
                    help="prefill steps of NEW tokens continuing a cached prefix of CACHED tokens")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "mxfp4-as-bf16"],
                    help="routed experts of the random small model (bench/engine.py --experts)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    ns = argparse.Namespace(checkpoint=None, random_weights="small", seed=0, experts=args.experts)
    device = torch.device("cuda")
    model = build_model(ns, device, getattr(torch, args.dtype))
    after = [tuple(int(v) for v in a.split(":")) for a in args.after_prefix]
    longest = max([args.context + 1, args.prefill] + [c + n for c, n in after])
    cfg = EngineConfig(max_num_seqs=max(args.batch, default=1), max_model_len=longest + 64,
                       enforce_eager=args.enforce_eager)
    ex = InProcessExecutor(model, cfg)
    runner, bs = ex.runner, cfg.block_size
    nb = blocks_for(args.context + 1, bs)
    with torch.inference_mode():
        for b in args.batch:  # sequence i: slot i + 1, its own blocks
            chunks = [SeqChunk([1], args.context, i + 1, True, list(range(1 + i * nb, 1 + (i + 1) * nb)))
                      for i in range(b)]
            if runner.graphs is not None:
                profiled(lambda: runner.graphs.run(chunks), args.rows, f"decode B{b} context {args.context} (graph)")
            else:
                batch = build_forward_batch(chunks, b, bs, device)
                profiled(lambda: model(batch, runner.pools), args.rows, f"decode B{b} context {args.context} (eager)")
        for cached, n in ([(0, args.prefill)] if args.prefill else []) + after:
            table_ = list(range(1, blocks_for(cached + n, bs) + 1))
            chunk = SeqChunk([1 + i % 1000 for i in range(n)], cached, 1, cached > 0, table_)
            batch = build_forward_batch([chunk], 0, bs, device)
            label = f"prefill 1 x {n}" + (f" after a cached prefix of {cached}" if cached else "")
            profiled(lambda: model(batch, runner.pools), args.rows, label)
            if runner.prefill_graphs is not None and n <= runner.prefill_graphs.max_tokens:
                graph_vs_eager(runner, chunk, batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
