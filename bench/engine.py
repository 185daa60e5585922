"""In-process engine-core throughput on a synthetic workload: output tokens/s, TTFT and inter-token latency.

    python bench/engine.py --random-weights tiny --concurrency 16 --num-requests 64
    python bench/engine.py --random-weights small --dtype bfloat16 --concurrency 64 --num-requests 256
    python bench/engine.py --checkpoint /path/to/ckpt --shared-prefix-len 2048 --shared-prefix-fraction 1.0
    python bench/engine.py --random-weights small --dtype bfloat16 --workload steady,staggered,long-prompt,images

A closed loop drives `EngineCore.step()` in this process (no serving layer, no process boundary)
and keeps `--concurrency` requests in flight until `--num-requests` have finished (after a short
warm-up). Prompt and output lengths are drawn around their means (`--*-std`); outputs are
exact (`ignore_eos`, min_tokens = max_tokens). `--shared-prefix-*` makes a fraction of the prompts
start with one common prefix (a system prompt), which the prefix cache should compute once.
`--random-weights PRESET` builds `tiny` or `small` in memory, drawn on the device, without a
checkpoint (`--experts mxfp4`: routed experts packed as in the K3 release; `mxfp4-as-bf16`: the same
weights dequantized, the 16-bit baseline); `--expert-stats` reports how evenly the routers spread
tokens over experts. `--workload` runs named traffic shapes instead of the length flags (`WORKLOADS`:
steady, staggered arrivals, long prompts, a share of requests with image rows) and ends with one
table of them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import sys
import time

import torch

from k3backend.engine.batch import SeqChunk, blocks_for
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore, describe_cap, prefill_cap
from k3backend.engine.cuda_graphs import spread_token
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.sampling_params import SamplingParams


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The checkpoint, or the preset with random weights drawn on the device; --experts mxfp4 keeps
    the routed experts packed (the K3 release's format), mxfp4-as-bf16 the same weights dequantized."""
    if args.checkpoint:
        from k3backend.checkpoint import load_model

        model = load_model(args.checkpoint, dtype=dtype, device=device, progress=True)
    else:
        from k3backend.checkpoint import empty_model
        from k3backend.config import K3Config, mxfp4_quantization_config
        from k3backend.presets import preset_config, randomize_weights_

        raw = preset_config(args.random_weights)
        if getattr(args, "layers", None):
            set_layers(raw, args.layers)
        if args.experts != "bf16":
            raw["quantization_config"] = mxfp4_quantization_config()
        model = randomize_weights_(empty_model(K3Config.from_dict(raw), dtype, device), args.seed)
    if args.experts == "mxfp4-as-bf16":
        dequantize_experts_(model, dtype)
    return model.eval().requires_grad_(False)


def set_layers(raw: dict, n: int) -> None:
    """The preset with n decoder layers in K3's pattern (MLA every 4th and the last, KDA the others):
    how host time grows with depth."""
    text = raw.get("text_config", raw)  # the small preset is text-only (its config is the text config)
    mla = sorted({i for i in range(4, n + 1, 4)} | {n})
    text["num_hidden_layers"] = n
    text["linear_attn_config"] = {**text["linear_attn_config"], "full_attn_layers": mla,
                                  "kda_layers": [i for i in range(1, n + 1) if i not in mla]}


@torch.no_grad()
def dequantize_experts_(model, dtype: torch.dtype) -> None:
    """Replace every packed MXFP4 expert layer by its exact values in dtype (one expert at a time):
    the same weights at 16 bits, the baseline the packed experts are measured against."""
    from k3backend.kernels import dequant_mxfp4
    from k3backend.model.moe import Experts

    for m in model.modules():
        if isinstance(m, Experts) and m.quant is not None:
            for w in ("w13", "w2"):
                packed, scale = getattr(m, w), getattr(m, f"{w}_scale")
                full = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype, device=packed.device)
                for e in range(packed.shape[0]):
                    full[e] = dequant_mxfp4(packed[e], scale[e], dtype)
                delattr(m, f"{w}_scale")
                setattr(m, w, torch.nn.Parameter(full, requires_grad=False))
            m.quant = None


# name -> its runs (flags of this script); the text of each issue-16 workload. Warm-ups: the first run of
# a process compiles and captures, so the first workload of a list warms up with a full wave.
WORKLOADS: dict[str, list[dict]] = {
    "steady": [dict(concurrency=64, num_requests=192, prompt_len=284, output_len=128)],  # admitted together
    # requests end and arrive at different times; 16 generations, so that the run's drain (the last 64
    # ending one by one, below the concurrency) is a small part: at 256 requests it cost 11 % of tok/s
    "staggered": [dict(concurrency=64, num_requests=1024, prompt_len=256, prompt_len_std=64.0, output_len=128,
                       output_len_std=48.0)],
    "long-prompt": [dict(concurrency=16, num_requests=32, prompt_len=8192, output_len=64),
                    dict(concurrency=1, num_requests=3, prompt_len=4096, output_len=1)],
    # half the requests carry one image of 256 rows (448 x 448 pixels: 32 x 32 patches merged 2 x 2)
    "images": [dict(concurrency=64, num_requests=192, prompt_len=284, output_len=128, image_share=0.5,
                    image_rows=256)],
}


def workload(args: argparse.Namespace, vocab: int, pad_id: int) -> list[tuple[list[int], int, int]]:
    """Random prompt ids (never the image pad outside an image), output lengths and image rows: a share
    `image_share` of the prompts carries `image_rows` pads after its first 16 tokens."""
    rng = random.Random(args.seed)
    draw = lambda: next(t for t in iter(lambda: rng.randrange(vocab), None) if t != pad_id)  # noqa: E731
    prefix = [draw() for _ in range(args.shared_prefix_len)]
    out = []
    for _ in range(args.num_requests + args.warmup):
        n_in = max(1, int(rng.gauss(args.prompt_len, args.prompt_len_std)))
        n_out = max(1, int(rng.gauss(args.output_len, args.output_len_std)))
        ids = [draw() for _ in range(n_in)]
        rows = args.image_rows if args.image_rows and rng.random() < args.image_share else 0
        ids = ids[:16] + [pad_id] * rows + ids[16:]
        if prefix and rng.random() < args.shared_prefix_fraction:
            ids = prefix + ids
        out.append((ids, n_out, rows))
    return out


def image_request(rid: int, ids: list[int], params: SamplingParams, rows: int, hidden: int,
                  dtype: torch.dtype) -> Request:
    """A request whose `rows` image pads get random projector rows (distinct per request: no prefix hits)."""
    embeds = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rid)).to(dtype)
    return Request(f"bench-{rid}", ids, params, image_embeds=embeds, image_token_counts=(rows,),
                   image_hashes=(f"{rid:032x}",))


def run(core: EngineCore, jobs: list[tuple[list[int], int, int]], concurrency: int, first_id: int,
        hidden: int = 0, dtype: torch.dtype = torch.float32, turnaround: tuple[float, float] = (0.0, 0.0),
        temperature: float = 1.0, top_p: float = 1.0) -> dict:
    """Closed loop over the engine core's steps: per-request TTFT, inter-token intervals, tokens.

    turnaround (s): a finished request's client sends its next one that much later, plus the second
    value times its place among the requests that finished in the same step: a model of the served
    path, where each final response and each new request cross gRPC and the stub one after another
    (0, 0: the next request is added before the very next step)."""
    pending = list(enumerate(jobs, first_id))[::-1]
    live: dict[int, list[float]] = {}  # id -> [sent, time of its last token]
    clients = [time.monotonic()] * concurrency  # when each client sends its next request
    ttft, itl, tokens, done = [], [], 0, 0
    full = None  # (s, tokens) when a client first had no request left to send: the end of full concurrency
    images = sum(1 for _, _, rows in jobs if rows)
    start = time.monotonic()
    while pending or live:
        if not live and pending:  # every client is between requests: wait for the first to send
            time.sleep(max(0.0, min(clients) - time.monotonic()))
        now = time.monotonic()
        while pending and clients and min(clients) <= now:
            sent = min(clients)  # TTFT counts from here, as a served client's does from its send
            clients.remove(sent)
            rid, (ids, n_out, rows) = pending.pop()
            p = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=temperature,
                               top_p=top_p, seed=rid)
            core.add(rid, image_request(rid, ids, p, rows, hidden, dtype) if rows else Request(f"bench-{rid}", ids, p))
            live[rid] = [sent, 0.0]
        out = core.step()
        now, finished = time.monotonic(), 0
        for rid, token, finish in zip(out.ids.tolist(), out.tokens.tolist(), out.finish.tolist()):
            state = live[rid]
            if token >= 0:
                tokens += 1
                (itl if state[1] else ttft).append(now - (state[1] or state[0]))
                state[1] = now
            if finish:
                if finish == FinishReason.ERROR:
                    print(f"request {rid} failed: {out.errors.get(rid)}", file=sys.stderr)
                del live[rid]
                done += 1
                clients.append(now + turnaround[0] + finished * turnaround[1])
                finished += 1
        if full is None and not pending and len(live) < concurrency:
            full = (now - start, tokens)
    wall = time.monotonic() - start
    full = full if full and full[0] > 0 and len(jobs) > concurrency else (wall, tokens)
    return {"wall": wall, "ttft": ttft, "itl": itl, "tokens": tokens, "n": done, "images": images,
            "full_tok_s": full[1] / full[0]}


def turnaround(spec: str) -> tuple[float, float]:
    """One --turnaround-ms entry, "A/B" or "A" (ms) -> seconds."""
    a, _, b = str(spec).partition("/")
    return float(a) / 1e3, float(b or 0) / 1e3


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def count_experts(model) -> list[torch.Tensor]:
    """Tokens per expert of every MoE layer, counted by forward hooks that re-run the router on the
    layer's input (for --expert-stats only: one host sync per layer and step)."""
    from k3backend import kernels
    from k3backend.model.moe import MoE

    counts = []
    for module in model.modules():
        if isinstance(module, MoE):
            c = torch.zeros(module.experts.w13.shape[0], dtype=torch.long)
            counts.append(c)

            def hook(m, inputs, output, c=c):
                _, ids = kernels.router(inputs[0], m.gate.weight, m.gate.e_score_correction_bias, m.top_k, m.n_group,
                                        m.topk_group, m.renormalize, 1.0)
                c += torch.bincount(ids.flatten().cpu(), minlength=c.numel())

            module.register_forward_hook(hook)
    return counts


def spread(counts: list[torch.Tensor]) -> str:
    """max / mean tokens per expert, per MoE layer (1.0 is perfectly even)."""
    ratios = [float(c.max() / c.float().mean()) for c in counts if c.sum() > 0]
    return f"max/mean tokens per expert: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f} " \
           f"over {len(ratios)} layers" if ratios else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint")
    src.add_argument("--random-weights", choices=["tiny", "small"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", default="64", help="a comma list runs one workload per entry (one model load)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--concurrency", default="16", help="a comma list, zipped with --num-requests and --output-len")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prompt-len-std", type=float, default=0.0)
    ap.add_argument("--output-len", default="128", help="a comma list, zipped with --concurrency")
    ap.add_argument("--output-len-std", type=float, default=0.0)
    ap.add_argument("--shared-prefix-len", type=int, default=0)
    ap.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    ap.add_argument("--image-share", type=float, default=0.0, help="fraction of the requests with an image")
    ap.add_argument("--image-rows", type=int, default=0, help="image rows (media pads) of such a request")
    ap.add_argument("--workload", help="a comma list of named workloads (" + ", ".join(WORKLOADS) + "): each sets "
                    "the concurrency, request count and lengths itself")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--snapshot-interval", type=int, default=EngineConfig.snapshot_interval,
                    help="tokens between KDA prefix snapshots (each one ends a prefill chunk)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode and prefill)")
    ap.add_argument("--async-scheduling", choices=["on", "off", "both"], default="on",
                    help="off: every step waits for the previous one's ids; both: each workload overlapped, then not")
    ap.add_argument("--decode-stall-ms", default=str(EngineConfig.decode_stall_ms),
                    help="k3_lm's decode_stall_ms (0: off); a comma list runs each workload once per value")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature of every request (default 1, seeded; 0: greedy, as the requests of "
                         "bench/serving_load.py, for a served-against-in-process comparison)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top_p of every sampled request (default 1: off)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="GPU: warn (once per line) for every operation that makes the host wait for the device "
                         "implicitly during the measured runs (a pageable copy, .item(), nonzero); explicit waits, "
                         "as for the step's sampled ids, are not reported")
    ap.add_argument("--turnaround-ms", default="0",
                    help="A or A/B, a comma list zipped with --concurrency: a finished request's client sends its "
                         "next one A ms later, plus B ms per request that finished before it in the same step (a "
                         "model of the served path's round trip; default 0: at once)")
    ap.add_argument("--max-prefill-delay-ms", default=str(EngineConfig.max_prefill_delay_ms),
                    help="k3_lm's max_prefill_delay_ms (0: off); a comma list runs each workload once per value")
    ap.add_argument("--expert-stats", action="store_true")
    ap.add_argument("--experts", choices=["bf16", "mxfp4", "mxfp4-as-bf16"], default="bf16",
                    help="--random-weights: routed experts in bf16, packed MXFP4, or MXFP4 weights dequantized to "
                         "bf16 (the same values at 16 bits); --checkpoint: mxfp4-as-bf16 dequantizes its MXFP4 experts")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="> 1: worker processes (one per rank; needs --checkpoint); reports the coordination time")
    ap.add_argument("--expert-parallel-size", type=int, default=1)
    ap.add_argument("--placement", default="tp", choices=["tp", "host_ep"],
                    help="k3_lm parallel_placement (one host here: host_ep is tp with expert-parallel-size 1)")
    ap.add_argument("--save-decode-logits", metavar="FILE",
                    help="after the runs, torch.save {batch size: logits} of one replay of each decode graph on "
                         "graph_times' fixed step (compare two builds or K3_PDL=on/off bit for bit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="--workload: request counts times this (a quick run)")
    args = ap.parse_args(argv)
    runs = workloads(args)  # a bad --workload or list fails before the model loads
    if args.async_scheduling == "both":  # side by side on one model and engine: overlapped, then waited, each on
        runs = [argparse.Namespace(**{**vars(w), "overlap": o, "seed": w.seed + (0 if o else 500),  # prompts of its own
                                      "name": f"{w.name or 'run'} ({'async' if o else 'sync'})"})  # (no prefix hits)
                for w in runs for o in (True, False)]
    stalls = [float(v) for v in args.decode_stall_ms.split(",")]
    delays = [float(v) for v in args.max_prefill_delay_ms.split(",")]
    for key, label, values in (("stall_ms", "stall", stalls), ("delay_ms", "delay", delays)):
        if len(values) > 1:  # side by side on one model: each value on prompts of its own (no prefix hits)
            runs = [argparse.Namespace(**{**vars(w), key: ms, "seed": w.seed + 700 * i,
                                          "name": f"{w.name or 'run'} ({label} {ms:g} ms)"})
                    for w in runs for i, ms in enumerate(values)]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")  # cache, kernels, graphs

    from k3backend.engine.runner import InProcessExecutor
    from k3backend.serving.triton_io import resolve_device_dtype

    device, dtype = resolve_device_dtype(args.device, args.dtype, "bench")
    if device.type == "cpu":
        torch.set_num_threads(1 if args.random_weights == "tiny" else torch.get_num_threads())
    print("$ python bench/engine.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), dtype {dtype}, "
          f"torch {torch.__version__}")
    t0 = time.monotonic()
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, prefix_caching=not args.no_prefix_caching,
                       snapshot_interval=args.snapshot_interval,
                       enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling != "off",
                       decode_stall_ms=max(stalls), max_prefill_delay_ms=delays[0])  # timed up to the largest
    counts, model = [], None
    if args.tensor_parallel_size > 1:
        from k3backend.engine.workers import MultiProcessExecutor

        if not args.checkpoint:
            ap.error("--tensor-parallel-size > 1 loads its shards from --checkpoint")
        gpus = list(range(args.tensor_parallel_size)) if device.type == "cuda" else None
        executor = MultiProcessExecutor(args.checkpoint, cfg, dtype=str(dtype).removeprefix("torch."), gpus=gpus,
                                        world_size=args.tensor_parallel_size, ep_size=args.expert_parallel_size,
                                        placement=args.placement)
    else:
        from k3backend.checkpoint import weight_summary

        model = build_model(args, device, dtype)
        print(f"weights: {weight_summary(model)}")
        executor = InProcessExecutor(model, cfg)
        counts = count_experts(model) if args.expert_stats else []
    info = executor.info
    core = EngineCore(executor, cfg)
    print(f"model ready in {time.monotonic() - t0:.1f} s")
    first, results = 1, []
    for w in runs:
        core.overlap = getattr(w, "overlap", core.overlap) and executor.overlap
        if hasattr(w, "delay_ms"):  # the scheduler is idle between workloads
            core.sched.cfg = dataclasses.replace(core.sched.cfg, prefill_delay_s=w.delay_ms / 1e3)
        if hasattr(w, "stall_ms"):
            core.sched.cfg = dataclasses.replace(core.sched.cfg, prefill_cap=prefill_cap(
                executor.prefill_ms, w.stall_ms, executor.decode_ms))
            cap = core.sched.cfg.prefill_cap
            print(f"decode_stall_ms {w.stall_ms:g}: steps that decode take at most "
                  f"{describe_cap(cap) if cap else cfg.max_num_batched_tokens} tokens of longer prompts", flush=True)
        jobs = workload(w, info.vocab_size, info.media_pad_id)
        run(core, jobs[:w.warmup], min(w.concurrency, w.warmup), first, info.hidden_size, dtype,
            temperature=args.temperature, top_p=args.top_p)
        before, coord0 = core.stats(), getattr(executor, "coordination_s", 0.0)
        if args.sync_debug and device.type == "cuda":  # every op that waits for the device warns, with its line
            torch.cuda.set_sync_debug_mode("warn")
        r = run(core, jobs[w.warmup:], w.concurrency, first + w.warmup, info.hidden_size, dtype,
                turnaround(w.turnaround_ms), args.temperature, args.top_p)
        if args.sync_debug and device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        first += len(jobs)
        after, coord = core.stats(), getattr(executor, "coordination_s", 0.0) - coord0
        report(w, r, before, after, coord, executor, counts)
        results.append((w, r))
        if model is not None:
            print(roofline(model, w, r))
        if args.workload:  # the table so far after each run: a time limit still leaves the finished ones
            print(summary(results))
    if model is not None:
        if args.save_decode_logits:
            save_decode_logits(executor, args.save_decode_logits)
        print(graph_times(executor))
    executor.close()
    return 0


def workloads(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace per run of the named --workload list, else per entry of the comma lists
    (--concurrency, --num-requests, --output-len)."""
    if args.workload:
        names = args.workload.split(",")
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown:
            raise SystemExit(f"--workload: unknown {unknown}; known: {', '.join(WORKLOADS)}")
        base = {**vars(args), "prompt_len_std": 0.0, "output_len_std": 0.0, "image_share": 0.0, "image_rows": 0}
        runs = [(n, spec) for n in names for spec in WORKLOADS[n]]
        scale = args.scale
        return [argparse.Namespace(**{**base, **spec, "num_requests": max(1, int(spec["num_requests"] * scale)),
                                      "warmup": max(1, int((spec["concurrency"] if i == 0 else
                                                            min(spec["concurrency"], 16)) * scale)),
                                      "name": name, "seed": args.seed + 1000 * i})
                for i, (name, spec) in enumerate(runs)]
    lists = {k: [int(v) for v in str(getattr(args, k)).split(",")] for k in ("concurrency", "num_requests",
                                                                            "output_len")}
    lists["turnaround_ms"] = str(args.turnaround_ms).split(",")
    n = max(map(len, lists.values()))
    if any(len(v) not in (1, n) for v in lists.values()):
        raise SystemExit(f"--concurrency, --num-requests, --output-len, --turnaround-ms: lists of one length, "
                         f"got {lists}")
    return [argparse.Namespace(**{**vars(args), **{k: v[i if len(v) > 1 else 0] for k, v in lists.items()},
                                  "seed": args.seed + 1000 * i, "name": ""})  # other prompts: no prefix hits on the
            for i in range(n)]                                                 # last workload's


def report(args: argparse.Namespace, r: dict, before, after, coord: float, executor, counts) -> None:
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    images = f", {r['images']} with an image of {args.image_rows} rows" if args.image_rows else ""
    print(f"\n{args.name + ': ' if args.name else ''}{r['n']} requests, concurrency {args.concurrency}, prompt "
          f"{args.prompt_len}±{args.prompt_len_std:g}, output {args.output_len}±{args.output_len_std:g}, shared prefix "
          f"{args.shared_prefix_len} x {args.shared_prefix_fraction:g}{images}, preemptions "
          f"{after.num_preemptions - before.num_preemptions}"
          f"{'' if turnaround(args.turnaround_ms) == (0, 0) else f', client turnaround {args.turnaround_ms} ms'}"
          f"{', greedy' if args.temperature == 0 else ''}{f', top_p {args.top_p:g}' if args.top_p < 1 else ''}")
    if counts:
        print(f"expert load: {spread(counts)}")
    steps = after.steps - before.steps
    if args.tensor_parallel_size > 1 and steps:
        ping = statistics.median(executor.ping() for _ in range(20))
        print(f"coordination (plan out to {args.tensor_parallel_size} ranks, ids back, not computing): "
              f"{coord / steps * 1e3:.3f} ms per step of {r['wall'] / steps * 1e3:.2f} ms ({steps} steps); "
              f"empty round trip {ping * 1e3:.3f} ms")
    print(f"{'output tok/s':>12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} "
          f"{'prefix hit':>10}")
    print(f"{r['tokens'] / r['wall']:>12.1f} {pct(r['ttft'], 50) * 1e3:>12.1f} {pct(r['ttft'], 99) * 1e3:>12.1f} "
          f"{pct(r['itl'], 50) * 1e3:>11.2f} {pct(r['itl'], 99) * 1e3:>11.2f} "
          f"{(hits / queries if queries else 0):>10.1%}")


def summary(results: list[tuple[argparse.Namespace, dict]]) -> str:
    """One line per workload run: the table the traffic benchmarks compare (bench/gpu_traffic.sh)."""
    lines = [f"\n{'workload':<12} {'conc':>4} {'prompt':>9} {'output':>8} {'images':>7} {'tok/s':>9} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms) {'full tok/s':>10}"]
    for w, r in results:
        images = f"{w.image_rows}x{w.image_share:g}" if w.image_rows else "-"
        lines.append(f"{w.name:<12} {w.concurrency:>4} {f'{w.prompt_len}±{w.prompt_len_std:g}':>9} "
                     f"{f'{w.output_len}±{w.output_len_std:g}':>8} {images:>7} {r['tokens'] / r['wall']:>9.1f} "
                     f"{pct(r['ttft'], 50) * 1e3:>9.1f} {pct(r['ttft'], 99) * 1e3:>9.1f} "
                     f"{pct(r['itl'], 50) * 1e3:>8.2f} {pct(r['itl'], 99) * 1e3:>8.2f}       "
                     f"{r['full_tok_s']:>10.1f}")
    lines.append("full tok/s: until the first request with no successor to send ends (the rest is the run's "
                 "drain, below the concurrency)")
    return "\n".join(lines)


DECODE_CONTEXT = 256  # tokens before each row of the decode steps that graph_times replays


decode_token = spread_token  # the token of decode row `row`: a different one per row


def decode_rows(b: int, context: int, block_size: int, num_slots: int, num_blocks: int) -> list[SeqChunk]:
    """b decode rows at `context` tokens: row i on slot i + 1 and blocks of its own, token decode_token(i),
    carrying state. Slots and blocks wrap around where the pools hold fewer (rows then share them)."""
    nb = blocks_for(context + 1, block_size)
    return [SeqChunk([decode_token(i)], context, 1 + i % (num_slots - 1), True,
                     [1 + (i * nb + j) % (num_blocks - 1) for j in range(nb)]) for i in range(b)]


@torch.inference_mode()  # the graphs' buffers were made in inference mode
def set_decode_context(graphs, pools, b: int, context: int = DECODE_CONTEXT) -> list[SeqChunk]:
    """Make the decode graphs' buffers the step of decode_rows(b, context) (padded to b's captured size
    as the engine pads) and zero what its rows read in the pools: the KDA state and conv history of
    their slots and the latent rows of their blocks, and the null slot and block that the padding rows
    read (a decode row reads its slot's state: the padding rows' values, and with them which experts
    the step runs, came from whatever wrote the null slot last, and moved the real rows' last bits).
    A replay then computes the same values, MoE routing included, whatever ran before. Overwrites
    those slots and blocks: for after the run. Returns the rows."""
    from k3backend.model.cache import KDACache

    rows = decode_rows(b, context, pools.block_size, pools.num_slots, pools.num_blocks)
    graphs._fill(rows, graphs._size_for(b))
    device = graphs.input_ids.device
    slots = torch.tensor(sorted({0} | {r.slot for r in rows}), device=device)
    blocks = torch.tensor(sorted({0} | {n for r in rows for n in r.block_table}), device=device)
    for cache in pools.layers:
        if isinstance(cache, KDACache):
            cache.state[slots] = 0
            cache.conv[slots] = 0
        else:
            cache.latent[blocks] = 0
    return rows


def save_decode_logits(executor, path: str, context: int = DECODE_CONTEXT) -> None:
    """torch.save {b: fp32 logits [b, V]} of one replay of each captured decode graph on the fixed step
    of `set_decode_context` (the same inputs whatever ran before)."""
    graphs = getattr(getattr(executor, "runner", None), "graphs", None)
    if graphs is None or not graphs.graphs:
        print("decode logits: no decode graphs to save")
        return
    context = min(context, graphs.block_tables.shape[1] * graphs.block_size - 1)
    out = {}
    for b, g in sorted(graphs.graphs.items()):
        set_decode_context(graphs, executor.runner.pools, b, context)
        g.replay()
        out[b] = graphs.outputs[b][:b].float().cpu()
    torch.save(out, path)
    print(f"decode logits of batch sizes {sorted(out)} saved to {path}")


def graph_times(executor, context: int = DECODE_CONTEXT) -> str:
    """Device time of one replay of each captured decode graph (the step without the host's part), on
    a defined step (`set_decode_context`), measured after the run: its figures do not depend on the
    workloads that ran before."""
    runner = getattr(executor, "runner", None)
    graphs = getattr(runner, "graphs", None)
    if graphs is None or not graphs.graphs:
        return "decode graphs: none"
    context = min(context, graphs.block_tables.shape[1] * graphs.block_size - 1)  # max_model_len allows it
    times, shared = [], False
    for b, g in sorted(graphs.graphs.items()):
        rows = set_decode_context(graphs, runner.pools, b, context)
        shared |= len({r.slot for r in rows}) < b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(f"B{b} {start.elapsed_time(end) / 10:.3f}")
    return (f"decode graph replay at context {context} (row i: slot i + 1, token 1 + 37i mod 255; KDA state and "
            f"MLA rows zeroed{', rows share slots' if shared else ''}), device ms per step: " + ", ".join(times))


def roofline(model, args: argparse.Namespace, r: dict) -> str:
    """The measured ITL and TTFT beside the roofline floors of a decode step at batch = concurrency
    (mid-output context) and of one prompt's prefill (bench/roofline.py)."""
    from roofline import step_floor

    c, ctx = args.concurrency, args.prompt_len + args.output_len // 2
    dec = step_floor(model, c, [ctx] * c).seconds
    pre = step_floor(model, args.prompt_len, [args.prompt_len]).seconds
    itl, ttft = pct(r["itl"], 50), pct(r["ttft"], 50)
    b = step_floor(model, c, [ctx] * c)
    return (f"roofline floor (4.27 TB/s, 788 TFLOP/s): decode step at batch {c}, context {ctx}: {dec * 1e3:.3f} ms "
            f"({c / dec:.0f} tok/s, {b.bytes / 1e9:.2f} GB, routed experts {b.expert_bytes / b.bytes:.0%}), ITL p50 = "
            f"{itl / dec:.1f}x floor; prefill of {args.prompt_len} tokens: "
            f"{pre * 1e3:.2f} ms ({args.prompt_len / pre:.0f} tok/s), TTFT p50 = {ttft / pre:.1f}x floor")


if __name__ == "__main__":
    sys.exit(main())
