"""Where the time of one engine step goes: torch.profiler over one decode step (a replay of the
captured graph, or eager with --enforce-eager) and one prefill, on random `small` weights; and, with
--step-kinds, the host and device time of each kind of step the engine runs.

    python bench/profile_step.py --batch 1 --context 256 --prefill 4096 --rows 25
    python bench/profile_step.py --batch --prefill 0 --after-prefix 3072:1024 4080:16   # chunks that continue a prefix
    python bench/profile_step.py --step-kinds                    # decode, chunks, decode + chunks, image rows
    python bench/profile_step.py --step-kinds --layers 48        # how host time grows with depth
    python bench/profile_step.py --step-kinds --kind-kernels --rows 15   # and each kind's top kernels
                                                     # (a mixed kind's also minus the plain decode step's)
    python bench/profile_step.py --step-kinds --random-weights tiny --device cpu

Prints, per step, the number of kernels, their summed device time and the top kernels by device
time (name, calls, total, mean), so a slow step can be traced to the kernel that makes it slow.
--step-kinds runs each kind through `ModelRunner.logits` (the engine's path: graph replays where the
runner takes them, else one eager forward) and prints one table: host ms (until the call returns,
the Python and launch time), wall ms (until the device is done), kernels and their summed device
time (torch.profiler), the torch.searchsorted calls of the step (the device tables derived from
the layout: once per step, or once per layer before the shared prefill layout), and for steps whose
chunks replay a prefill graph the largest logit differences of those chunks against the same padded
buffers run eagerly and against an unpadded eager forward.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from engine import build_model, decode_rows, decode_token
from k3backend.engine.batch import SeqChunk, blocks_for, build_forward_batch
from k3backend.engine.config import EngineConfig
from k3backend.engine.plan import ScheduledSeq, SlotRequest, StepPlan
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams


def kernel_stats(prof) -> dict[str, list[float]]:
    """Kernel name -> [calls, µs of device time] over the profiled events."""
    stats: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            s = stats.setdefault(e.name, [0, 0.0])
            s[0] += 1
            s[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return stats


def diff_table(base: dict[str, list[float]], stats: dict[str, list[float]], rows: int) -> str:
    """What a step kind adds to the base kind, kernel by kernel: the largest differences first."""
    d = {n: (stats.get(n, [0, 0.0])[0] - base.get(n, [0, 0.0])[0], stats.get(n, [0, 0.0])[1] - base.get(n, [0, 0.0])[1])
         for n in set(base) | set(stats)}
    lines = [f"{sum(t for _, t in d.values()) / 1e3:+.3f} ms of device time"]
    for name, (n, t) in sorted(d.items(), key=lambda kv: -abs(kv[1][1]))[:rows]:
        lines.append(f"  {t / 1e3:+8.3f} ms {int(n):+5d}x  {name[:90]}")
    return "\n".join(lines)


def table(prof, rows: int) -> str:
    """Kernels only (device events), grouped by name."""
    stats = kernel_stats(prof)
    total = sum(v[1] for v in stats.values())
    lines = [f"{sum(int(v[0]) for v in stats.values())} kernels, {total / 1e3:.3f} ms of device time"]
    for name, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"  {t / total:6.1%} {t / 1e3:8.3f} ms {int(n):5d}x {t / n:8.1f} us  {name[:90]}")
    return "\n".join(lines)


def profiled(fn, rows: int, label: str, base: dict[str, list[float]] | None = None,
             trace: str | None = None) -> dict[str, list[float]]:
    """Print the top kernels of one call of fn (and, given a base kind's stats, the difference to it);
    returns its kernel stats. trace: write the call's timeline there (a Chrome trace: each stream's kernels
    with their start and end, for overlap the table cannot show)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    fn()  # warm (compilation, autotuning)
    gpu and torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        fn()
        gpu and torch.cuda.synchronize()
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
    try:
        text, stats = table(prof, rows), kernel_stats(prof)
    except Exception as e:  # noqa: BLE001 - another torch's event API: its own table then
        text, stats = f"({e})\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows), {}
    print(f"\n== {label}\n{text}", flush=True)
    if base is not None and stats:
        print(f"-- {label}, minus the plain decode step: {diff_table(base, stats, rows)}", flush=True)
    return stats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_kinds(args: argparse.Namespace) -> list[tuple[str, int, list[tuple[int, int]]]]:
    """(label, decode rows, [(chunk tokens, image rows)]) of each kind of step."""
    b, c = args.kind_batch, args.kind_chunk
    return [(f"decode {b}", b, []), (f"1 chunk of {2 * c}", 0, [(2 * c, 0)]), (f"4 chunks of {c}", 0, [(c, 0)] * 4),
            (f"16 chunks of {c // 8}", 0, [(c // 8, 0)] * 16),
            (f"decode {b} + 1 chunk of {c}", b, [(c, 0)]), (f"decode {b} + 2 chunks of {c}", b, [(c, 0)] * 2),
            (f"1 chunk of {2 * c}, {args.kind_image_rows} image rows", 0, [(2 * c, args.kind_image_rows)]),
            (f"decode {b} + 2 chunks of {c}, {c // 2} image rows", b, [(c, c // 2), (c, 0)])]


def kind_plan(runner, n_decode: int, chunks: list[tuple[int, int]], context: int, hidden: int) -> StepPlan:
    """A step of n_decode decode rows at `context` and fresh chunks, each sequence on its own slot and
    blocks; a chunk's image rows are the pads after its first 8 tokens."""
    bs, seqs, new, next_block = runner.pools.block_size, [], [], 1
    for i, (n, rows) in enumerate([(1, 0)] * n_decode + chunks):
        start = context if i < n_decode else 0
        nb = blocks_for(start + n, bs)
        table = tuple(range(next_block, next_block + nb))
        next_block += nb
        offsets = tuple(range(8, 8 + rows))
        ids = (decode_token(i),) if i < n_decode else tuple(1 + (t * 7) % 255 for t in range(n))
        seqs.append(ScheduledSeq(i + 1, ids, start, i < n_decode, table, True, 0, offsets))
        embeds = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(i)) if rows else None
        new.append(SlotRequest(i + 1, SamplingParams(), 0, (), (), (), (), embeds))
    return StepPlan(seqs=seqs, num_decode=n_decode, new=new)


def kinds_table(runner, args: argparse.Namespace, device: torch.device, hidden: int) -> None:
    """Host / wall / device time of each step kind through runner.logits (see the module docstring)."""
    print(f"\n{'step kind':<40} {'host ms':>8} {'wall ms':>8} {'kernels':>8} {'device ms':>9} {'searchsorted':>12} "
          f"graph-vs-padded/vs-eager")
    decode_stats = None  # the plain decode kind's kernels, which --kind-kernels subtracts from the mixed kinds
    for label, nd, chunks in step_kinds(args):
        plan = kind_plan(runner, nd, chunks, args.context, hidden)
        step = lambda: runner.logits(plan)  # noqa: E731
        for _ in range(2):  # warm: compilation, autotuning, graph buffers
            step()
        sync(device)
        searches, real = [0], torch.searchsorted

        def counted(*a, **k):
            searches[0] += 1
            return real(*a, **k)
        torch.searchsorted = counted
        try:
            step()
        finally:
            torch.searchsorted = real
        host, wall = [], []
        for _ in range(args.iters):
            sync(device)
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            sync(device)
            wall.append(time.perf_counter() - t0)
        kernels, busy = device_busy(step, device)
        med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
        print(f"{label:<40} {med(host):>8.2f} {med(wall):>8.2f} {kernels:>8} {busy:>9} {searches[0]:>12} "
              f"{graph_check(runner, plan)}", flush=True)
        if args.kind_kernels and device.type == "cuda":
            stats = profiled(step, args.rows, label, decode_stats if nd and chunks else None)
            decode_stats = stats if nd and not chunks else decode_stats


def graph_check(runner, plan: StepPlan) -> str:
    """Largest |logit| difference of the step's prefill chunks (fresh: their logits depend on their own
    tokens alone) between the prefill graph's replay and (a) the same padded buffers run eagerly (the
    capture itself: 0 expected), (b) the chunks run eagerly unpadded (other shapes, so other GEMM
    tilings: rounding), as 'a/b (|logits| max)'; '-' when the step replays no prefill graph."""
    nd = plan.num_decode
    chunks = plan.seqs[nd:]
    eager = getattr(runner, "_eager_reason", None)  # None: an older tree (gpu_traffic.sh's OLD_SRC)
    if not chunks or runner.prefill_graphs is None or eager is None or eager(plan.seqs[:nd], chunks):
        return "-"
    # the graphs the step replayed: their buffers hold its tables (a one-chunk step takes the one-chunk
    # graphs, a mixed step the mixed graphs, and the others still hold an earlier step's)
    mixed = runner._mixed_for(plan.seqs[:nd], chunks) if hasattr(runner, "_mixed_for") else None
    graphs = mixed or (runner._prefill_for(chunks) if hasattr(runner, "_prefill_for") else runner.prefill_graphs)
    replay = runner.logits(plan)[nd:].float().clone()
    size = graphs.size_for([len(c.token_ids) for c in chunks])
    first = getattr(graphs, "decode", 0)  # a mixed graph's chunk rows follow its decode rows
    padded = graphs.forward(graphs.batch(size))[first:first + len(chunks)].float()
    alone = runner.model(runner._batch(plan), runner.pools)[nd:].float()
    d = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return f"{d(replay, padded):.3g}/{d(replay, alone):.3g} ({alone.abs().max().item():.3g})"


def device_busy(step, device: torch.device) -> tuple[str, str]:
    """(kernels, their summed device ms) of one step, from torch.profiler; '-' on a CPU."""
    if device.type != "cuda":
        return "-", "-"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    times = [e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return str(len(times)), f"{sum(times) / 1e3:.3f}"


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

    def from_saved(fn):  # the chunk's row: the first (the padded forward has a row per chunk place)
        pools.copy_slot(save, slot)
        out = fn()[:1].float()
        pools.copy_slot(save, slot)
        return out

    pools.copy_slot(slot, save)
    alone = from_saved(lambda: runner.model(batch, pools))
    graph = from_saved(lambda: graphs.run([chunk]))
    padded = from_saved(lambda: graphs.forward(graphs.batch(graphs.size_for([len(chunk.token_ids)]))))
    t_eager = wall_ms(lambda: runner.model(batch, pools))
    t_graph = wall_ms(lambda: graphs.run([chunk]))
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
    ap.add_argument("--trace", metavar="DIR", help="write each decode step's Chrome trace there (decode_B<b>.json)")
    ap.add_argument("--max-model-len", type=int, help="the engine's max_model_len (its block-table width); default: what the steps need")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "mxfp4-as-bf16"],
                    help="routed experts of the random small model (bench/engine.py --experts)")
    ap.add_argument("--random-weights", default="small", choices=["tiny", "small"])
    ap.add_argument("--layers", type=int, help="decoder layers of the preset (K3's KDA/MLA pattern)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--step-kinds", action="store_true", help="only the table of host and device time per step kind")
    ap.add_argument("--kind-batch", type=int, default=64, help="--step-kinds: decode rows")
    ap.add_argument("--kind-chunk", type=int, default=256, help="--step-kinds: tokens of a prefill chunk")
    ap.add_argument("--kind-image-rows", type=int, default=256, help="--step-kinds: image rows of the image step")
    ap.add_argument("--iters", type=int, default=5, help="--step-kinds: timed runs of each kind (the median)")
    ap.add_argument("--kind-kernels", action="store_true", help="--step-kinds: each kind's top kernels too, and "
                    "what a kind with decode rows and chunks adds to the plain decode kind, kernel by kernel")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    ns = argparse.Namespace(checkpoint=None, random_weights=args.random_weights, seed=0, experts=args.experts,
                            layers=args.layers)
    device = torch.device(args.device)
    if device.type == "cpu" and args.random_weights == "tiny":
        torch.set_num_threads(1)  # tiny ops: more threads only contend
    print("$ python bench/profile_step.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {args.random_weights} x {args.layers or 'preset'} layers, {args.dtype}")
    model = build_model(ns, device, getattr(torch, args.dtype))
    after = [tuple(int(v) for v in a.split(":")) for a in args.after_prefix]
    longest = max([args.context + 1, args.prefill, 2 * args.kind_chunk] + [c + n for c, n in after])
    seqs = max(args.batch + [args.kind_batch + 4] if args.step_kinds else args.batch or [1])
    cfg = EngineConfig(max_num_seqs=seqs, max_model_len=max(longest + 64, args.max_model_len or 0),
                       enforce_eager=args.enforce_eager,
                       **({} if device.type == "cuda" else {"cpu_cache_gb": 1.0}))
    ex = InProcessExecutor(model, cfg)
    runner, bs = ex.runner, cfg.block_size
    if args.step_kinds:
        kinds_table(runner, args, device, model.cfg.text.hidden_size)
        return 0
    with torch.inference_mode():
        for b in args.batch:  # sequence i: slot i + 1, its own blocks
            chunks = decode_rows(b, args.context, bs, runner.pools.num_slots, runner.pools.num_blocks)
            if runner.graphs is not None:
                profiled(lambda: runner.graphs.run(chunks), args.rows, f"decode B{b} context {args.context} (graph)",
                         trace=args.trace and f"{args.trace}/decode_B{b}.json")
            else:
                batch = build_forward_batch(chunks, b, bs, device)
                profiled(lambda: model(batch, runner.pools), args.rows, f"decode B{b} context {args.context} (eager)",
                         trace=args.trace and f"{args.trace}/decode_B{b}.json")
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
