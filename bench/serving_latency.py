"""Time to first token and decode speed: k3_ensemble vs k3_lm over gRPC vs the engine in-process.

    .venv/bin/python bench/serving_latency.py [--requests 20] [--max-tokens 64] [--url HOST:PORT]

Without --url it starts tritonserver on model_repository/ (the built-in tiny checkpoint) itself.
Requests run one at a time with the same prompts and greedy decoding on every path, so the
columns differ only by the serving path. Prints the command, versions, and one table.
"""

from __future__ import annotations

import argparse
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"Benchmark prompt number {i}: tell me about the weather." for i in range(50)]


def grpc_tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    np_type = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}[dtype]
    arr = np.array([[value.encode() if isinstance(value, str) else value]], dtype=np_type)
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def via_grpc(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, total s, output tokens) of one streamed request, measured at the client."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    inputs = [grpc_tensor("text_input", prompt, "BYTES"), grpc_tensor("max_tokens", max_tokens, "INT32"),
              grpc_tensor("min_tokens", max_tokens, "INT32"), grpc_tensor("ignore_eos", True, "BOOL"),
              grpc_tensor("temperature", 0.0, "FP32"), grpc_tensor("stream", True, "BOOL"),
              grpc_tensor("return_num_output_tokens", True, "BOOL")]
    t0 = time.perf_counter()
    client.async_stream_infer(model, inputs)
    first, n = None, 0
    while True:
        t, r, e = q.get(timeout=300)
        if e is not None:
            raise RuntimeError(str(e))
        first = first or t
        n += int(r.as_numpy("num_output_tokens").reshape(-1)[0])
        if r.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return first - t0, t - t0, n


def via_engine(core, tokenizer, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """One request through the engine core in process: (TTFT, last token, tokens) as via_grpc."""
    from k3backend.engine.core import run_requests
    from k3backend.engine.request import Request
    from k3backend.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    via_engine.ids = getattr(via_engine, "ids", 0) + 1
    t0 = time.monotonic()
    out = run_requests(core, [Request("bench", tokenizer.encode_text_input(prompt), params)], via_engine.ids)[0]
    return out.first_token_s - t0, out.last_token_s - t0, len(out.token_ids)


def summarize(rows: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    ttft = [r[0] for r in rows]
    decode_rate = [(r[2] - 1) / (r[1] - r[0]) for r in rows if r[1] > r[0]]
    return statistics.median(ttft) * 1e3, statistics.quantiles(ttft, n=10)[-1] * 1e3, statistics.median(decode_rate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    args = ap.parse_args()
    print("command:", " ".join(sys.argv))
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} torch threads")
    prompts = PROMPTS[: args.requests]

    server = None
    url = args.url
    if url is None:
        from k3backend.tritonserver import TritonServer

        server = TritonServer(ROOT / "model_repository", Path(tempfile.mkdtemp()), models=["k3_ensemble"])
        server.start()
        url = server.grpc_url
    try:
        results = {}
        for model in ("k3_ensemble", "k3_lm"):
            via_grpc(url, model, prompts[0], 4)  # warm
            results[model] = [via_grpc(url, model, p, args.max_tokens) for p in prompts]
    finally:
        if server is not None:
            server.stop()

    from k3backend.engine.config import EngineConfig
    from k3backend.engine.core import EngineCore
    from k3backend.engine.runner import InProcessExecutor
    from k3backend.presets import ensure_default_checkpoint
    from k3backend.tokenizer import Tokenizer

    from k3backend.serving.triton_io import resolve_device_dtype

    device, dtype = resolve_device_dtype("auto", "auto", "bench")  # what k3_lm picks with its default parameters
    if device.type == "cpu":
        torch.set_num_threads(1)  # as k3_lm does for toy models on CPU
    ckpt = ensure_default_checkpoint()
    tok = Tokenizer.from_dir(ckpt)
    cfg = EngineConfig()  # k3_lm's defaults
    core = EngineCore(InProcessExecutor.load(ckpt, cfg, dtype=dtype, device=device), cfg)
    print(f"engine in-process: {device} {dtype}")
    via_engine(core, tok, prompts[0], 4)
    results["engine in-process"] = [via_engine(core, tok, p, args.max_tokens) for p in prompts]
    core.executor.close()

    base = summarize(results["engine in-process"])
    print(f"\n{args.requests} sequential requests, {args.max_tokens} output tokens each, greedy, streaming\n")
    print(f"{'path':<20} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'decode tok/s':>13} {'TTFT vs engine':>15}")
    for name, rows in results.items():
        p50, p90, rate = summarize(rows)
        print(f"{name:<20} {p50:>12.2f} {p90:>12.2f} {rate:>13.1f} {p50 - base[0]:>+13.2f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
