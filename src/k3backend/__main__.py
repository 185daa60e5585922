"""Command line: `python -m k3backend {generate,make-checkpoint,hf-tokenizer,serve,openai,worker}`. Argument parsing only."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    import torch

    from k3backend.checkpoint import load_model
    from k3backend.detokenizer import IncrementalDetokenizer
    from k3backend.engine.sampling_params import SamplingParams
    from k3backend.generate import generate
    from k3backend.model.preprocess import load_image, preprocess_image
    from k3backend.presets import ensure_default_checkpoint
    from k3backend.tokenizer import IMAGE_PLACEHOLDER_TEXT, Tokenizer

    torch.set_num_threads(args.threads)
    ckpt = Path(args.checkpoint) if args.checkpoint else ensure_default_checkpoint()
    dtype = getattr(torch, args.dtype)
    model = load_model(ckpt, dtype=dtype, device=args.device)
    tok = Tokenizer.from_dir(ckpt)
    images = [load_image(Path(f)) for f in args.image]
    if args.raw:
        prompt = args.prompt
        if images and IMAGE_PLACEHOLDER_TEXT not in prompt and "<|media_pad|>" not in prompt:
            prompt = IMAGE_PLACEHOLDER_TEXT * len(images) + prompt
        ids = tok.encode_text_input(prompt)
    else:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
        ids = tok.render_chat([{"role": "user", "content": content}], thinking=args.thinking).ids
    embeds = None
    if images:
        processed = [preprocess_image(im, model.preprocess_cfg) for im in images]
        ids, _ = tok.expand_image_placeholders(ids, [p.size for p in processed], [p.num_tokens for p in processed])
        for i, p in enumerate(processed):
            print(f"image {i}: {p.size[0]}x{p.size[1]} -> grid {p.grid_thw}, {p.num_tokens} image tokens",
                  file=sys.stderr)
        embeds = torch.cat(model.vision.encode_images(processed))
    print(f"prompt: {len(ids)} tokens", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p, top_k=args.top_k)
    detok = IncrementalDetokenizer(tok, in_think=args.thinking and not args.raw)
    t0, n = time.perf_counter(), 0
    eos = model.cfg.eos_token_id or (tok.eos_id,)
    for step in generate(model, ids, params, eos_ids=eos, image_embeds=embeds):
        n += 1
        if step.token in eos:
            break
        sys.stdout.write(detok.push([step.token]).text)
        sys.stdout.flush()
    sys.stdout.write(detok.finish().text + "\n")
    dt = time.perf_counter() - t0
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    from k3backend.presets import make_checkpoint

    t0 = time.perf_counter()
    out = make_checkpoint(args.preset, args.out, seed=args.seed, experts=args.experts, text_only=args.text_only,
                          conditioned=args.conditioned)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"wrote {args.preset}{' text-only' if args.text_only else ''}{' conditioned' if args.conditioned else ''} checkpoint (seed {args.seed}, {args.experts} routed experts) to {out} in "
          f"{time.perf_counter() - t0:.1f} s, peak host memory {peak:.1f} GiB")
    return 0


def _hf_tokenizer(args: argparse.Namespace) -> int:
    from k3backend.hf_tokenizer import write_hf_tokenizer

    out = write_hf_tokenizer(Path(args.tokenizer), Path(args.out), default_thinking=args.default_thinking)
    print(f"wrote Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) to {out}")
    return 0


def _openai(args: argparse.Namespace) -> int:
    from k3backend.openai.options import API_KEY_ENV, api_key, gateway_argv, workers

    args.workers = workers(args.workers)
    if args.workers > 1:  # N copies of this command on one port, started and stopped together
        from k3backend.supervise import Child, run_together

        argv = [sys.executable, "-m", "k3backend", "openai", *gateway_argv(args, args.triton_url), "--reuse-port"]
        argv[argv.index("--workers") + 1] = "1"
        env = {**os.environ, API_KEY_ENV: api_key(args) or ""}
        return run_together([Child(f"gateway worker {i}", argv, env) for i in range(args.workers)])
    from k3backend.openai.app import GatewayConfig, serve

    return serve(GatewayConfig(
        triton_url=args.triton_url, host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=api_key(args), triton_model=args.triton_model, text_model=args.text_model or None,
        max_request_bytes=args.max_request_bytes,
        grpc_channels=args.grpc_channels, reuse_port=args.reuse_port))


def _worker(args: argparse.Namespace) -> int:
    from k3backend.engine.node_agent import run_node
    from k3backend.engine.nodes import NodePlan
    from k3backend.engine.workers import check_placement, resolve_backend
    from k3backend.serving.triton_io import resolve_device_dtype

    plan = NodePlan(args.nnodes, args.master_addr, args.master_port, args.dist_timeout_s)
    try:
        plan.check(args.tensor_parallel_size, args.node_rank)
        check_placement(args.placement, args.tensor_parallel_size, args.expert_parallel_size, args.nnodes)
        if args.node_rank == 0:
            raise ValueError("node_rank 0 is the Triton host (k3_lm itself); give this host 1..nnodes-1")
    except ValueError as e:
        print(f"k3backend worker: {e}", file=sys.stderr)
        return 2
    device, dtype = resolve_device_dtype(args.device, args.dtype, "worker")
    return run_node(args.checkpoint, plan, args.node_rank, args.tensor_parallel_size, args.expert_parallel_size,
                    device.type, str(dtype).removeprefix("torch."),
                    resolve_backend(args.dist_backend, device.type == "cuda"), args.placement)


def _from_env(*names: str) -> dict:
    """add_argument's default from the first of `names` set in the environment (torchrun and most
    launchers set them); required when none is."""
    value = next((os.environ[n] for n in names if os.environ.get(n)), None)
    return {"default": value, "required": value is None}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` goes to tritonserver, options included
        from k3backend.tritonserver import serve_main

        return serve_main(argv[1:])
    p = argparse.ArgumentParser(prog="k3backend", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion from a checkpoint (prefill + cached decode)")
    g.add_argument("--checkpoint", help="checkpoint directory (default: the built-in tiny checkpoint)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", action="append", default=[], help="image file; repeat for several")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="use the prompt verbatim instead of the K3 chat format")
    g.add_argument("--thinking", action="store_true", help="open a think element (chat format)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    g.set_defaults(fn=_generate)

    m = sub.add_parser("make-checkpoint", help="write a deterministic random-weight checkpoint")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4"],
                   help="routed experts in bf16, or in MXFP4 as the K3 release stores them (compressed-tensors)")
    m.add_argument("--text-only", action="store_true", help="a kimi_linear checkpoint: the language model alone")
    m.add_argument("--conditioned", action="store_true",
                   help="well-conditioned weights (stable routing, damped sub-layer outputs) for numerics checks")
    m.set_defaults(fn=_make_checkpoint)

    h = sub.add_parser("hf-tokenizer", help="write the Hugging Face tokenizer dir (for GenAI-Perf and the OpenAI "
                                            "frontend, docs/benchmarking.md) for a tiktoken.model + "
                                            "tokenizer_config.json dir")
    h.add_argument("--tokenizer", required=True, help="directory with tiktoken.model (e.g. a checkpoint)")
    h.add_argument("--out", required=True, help="output directory (may equal --tokenizer)")
    h.add_argument("--default-thinking", action="store_true",
                   help="the template's thinking default; match k3_lm's default_thinking parameter")
    h.set_defaults(fn=_hf_tokenizer)

    sub.add_parser("serve", help="run tritonserver on model_repository in the foreground (options pass through; "
                                 "--openai starts the OpenAI gateway beside it)")

    from k3backend.openai.options import add_options

    o = sub.add_parser("openai", help="serve the OpenAI API (chat, completions) in front of a running tritonserver")
    o.add_argument("--triton-url", required=True, help="tritonserver's gRPC endpoint, HOST:PORT (e.g. localhost:8001)")
    add_options(o)
    o.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for --workers' processes
    o.set_defaults(fn=_openai)

    w = sub.add_parser("worker", help="run this host's ranks of a k3_lm served from another host's tritonserver "
                                      "(docs/deployment.md); defaults from NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT")
    w.add_argument("--checkpoint", required=True, help="this host's copy of k3_lm's model_path")
    w.add_argument("--nnodes", type=int, **_from_env("NNODES"))
    w.add_argument("--node-rank", type=int, help="1..nnodes-1 (0 is the Triton host)",
                   **_from_env("NODE_RANK", "GROUP_RANK"))
    w.add_argument("--master-addr", help="the Triton host's address (k3_lm master_addr)", **_from_env("MASTER_ADDR"))
    w.add_argument("--master-port", type=int, **_from_env("MASTER_PORT"))
    w.add_argument("--tensor-parallel-size", type=int, required=True)
    w.add_argument("--expert-parallel-size", type=int, default=1)
    w.add_argument("--placement", default="tp", choices=["tp", "host_ep"],
                   help="k3_lm parallel_placement: tp (one TP group over every host) or host_ep (TP inside each "
                        "host, experts across hosts; expert-parallel-size = nnodes)")
    w.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    w.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16", "float64"])
    w.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"])
    w.add_argument("--dist-timeout-s", type=float, default=300.0,
                   help="how long to wait for the Triton host (and its answer) at the rendezvous")
    w.set_defaults(fn=_worker)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
