"""What the OpenAI gateway costs: TTFT and decode speed through it vs k3_ensemble over gRPC directly.

    .venv/bin/python bench/openai_overhead.py                                  # starts a server and a gateway
    python3 bench/openai_overhead.py --grpc-url localhost:8001 --concurrency 1 64 --max-tokens 128
    python3 bench/openai_overhead.py --grpc-url localhost:8001 --openai-url http://localhost:9000
    .venv/bin/python bench/openai_overhead.py --fake-step-ms 20 --concurrency 64     # the gateway alone

Both paths get the same greedy requests (`ignore_eos`, `min_tokens = max_tokens`, so every request is
exactly `--max-tokens` long), one gRPC stream or one SSE stream per request, in a closed loop of
`--concurrency` requests in flight, and in ABBA order (`--repeats` pairs) so drift hits both alike.
Prompts are distinct (a unique head), so neither path reuses the other's prefix cache. The load is
spread over `--client-procs` processes so the Python clients do not become the bottleneck. Prints
the command and versions, then one table; the `Δ` rows are the gateway against the direct path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
JSON = {"Content-Type": "application/json"}
FILLER = "the quick brown fox jumps over the lazy dog and keeps running through the long green field "


# sent, first response, last response (monotonic s), tokens, responses, and the serving path's legs in ms,
# wall clock: in = k3_lm's arrival_time_ns - sent, out = final response received - last_token_time_ns,
# first = first response received - first_token_time_ns. The final response is sent as soon as the last token
# is sampled; the first can wait for text (UTF-8 and markup hold-back), which differs from prompt to prompt,
# so `first` is exact against tests/fake_triton.py and noisier against k3_lm (alike on both paths).
Row = tuple[float, float, float, int, int, float, float, float]


@dataclass(frozen=True)
class Load:
    path: str  # "grpc" or "openai"
    url: str
    model: str  # Triton model (grpc) or served model name (openai)
    workers: int
    requests: int  # per worker
    max_tokens: int
    prompt_chars: int
    start_at: float  # time.monotonic() at which every process starts sending


def prompt(load: Load, i: int) -> str:
    head = f"{uuid.uuid4().hex} {load.path} {i}: "
    return (head + FILLER * (load.prompt_chars // len(FILLER) + 1))[: max(load.prompt_chars, len(head))]


async def via_grpc(client, load: Load, text: str) -> Row:
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        arr = np.array([[value.encode() if isinstance(value, str) else value]],
                       dtype={"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [tensor("text_input", text, "BYTES"), tensor("max_tokens", load.max_tokens, "INT32"),
              tensor("min_tokens", load.max_tokens, "INT32"), tensor("ignore_eos", True, "BOOL"),
              tensor("temperature", 0.0, "FP32"), tensor("stream", True, "BOOL"),
              tensor("return_num_output_tokens", True, "BOOL"), tensor("return_perf_metrics", True, "BOOL")]

    async def once():
        yield {"model_name": load.model, "inputs": inputs, "request_id": uuid.uuid4().hex}

    sent_ns, t0 = time.time_ns(), time.monotonic()
    first = first_ns = None
    n = events = 0
    async for result, error in client.stream_infer(once()):
        if error is not None:
            raise RuntimeError(error.message())
        t, last_ns = time.monotonic(), time.time_ns()
        first, first_ns = first or t, first_ns or last_ns
        events += 1
        n += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            times = {k: int(result.as_numpy(k).reshape(-1)[0])
                     for k in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns")}
            break
    return t0, first, t, n, events, *_legs_ms(sent_ns, first_ns, last_ns, times)


def _legs_ms(sent_ns: int, first_ns: int, last_ns: int, times: dict) -> tuple[float, float, float]:
    return ((times["arrival_time_ns"] - sent_ns) / 1e6, (last_ns - times["last_token_time_ns"]) / 1e6,
            (first_ns - times["first_token_time_ns"]) / 1e6)


async def via_openai(session, load: Load, text: str) -> Row:
    body = json.dumps({"model": load.model, "prompt": text, "max_tokens": load.max_tokens,
                       "min_tokens": load.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "return_perf_metrics": True}).encode()
    # Encoded before the clock starts, as via_grpc builds its tensors before it.
    sent_ns, t0 = time.time_ns(), time.monotonic()
    first = first_ns = last = last_ns = times = None
    n = events = 0
    async with session.post(load.url + "/v1/completions", data=body, headers=JSON) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
                continue
            last, last_ns = time.monotonic(), time.time_ns()
            first, first_ns = first or last, first_ns or last_ns
            events += 1
            times = event["choices"][0].get("perf_metrics") or times  # in the final chunk
    return t0, first, last, n, events, *_legs_ms(sent_ns, first_ns, last_ns, times)


async def run_load(load: Load) -> list[Row]:
    """One process's share: `workers` loops, each sending `requests` requests back to back."""
    out: list[Row] = []
    if load.path == "grpc":
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(load.url)
        send, close = (lambda i: via_grpc(client, load, prompt(load, i))), client.close
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
        send, close = (lambda i: via_openai(session, load, prompt(load, i))), session.close

    async def worker(w: int) -> None:
        for i in range(load.requests):
            out.append(await send(w * load.requests + i))

    await asyncio.sleep(max(0.0, load.start_at - time.monotonic()))
    try:
        await asyncio.gather(*(worker(w) for w in range(load.workers)))
    finally:
        await close()
    return out


def _process(load: Load) -> list[Row]:
    return asyncio.run(run_load(load))


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process and its children (the --workers processes) on this host; 0 if unknown."""
    from serverutil import proc_stats

    if pid is None:
        return 0.0
    ticks = sum(int(f[11]) + int(f[12]) for p, f in proc_stats() if p == pid or int(f[1]) == pid)
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cpu_rate(pid: int | None, window_s: float = 1.5) -> float:
    """CPU seconds per second of an idle gateway: the least of three windows, because `--workers`
    children may still be starting (importing) in the first ones."""
    rates = []
    for _ in range(3):
        before = cpu_seconds(pid)
        time.sleep(window_s)
        rates.append((cpu_seconds(pid) - before) / window_s)
    return min(rates)


def measure(pool, path: str, url: str, model: str, concurrency: int, requests: int, args,
            gateway_pid: int | None = None) -> dict:
    procs = min(args.client_procs, concurrency)
    shares = [concurrency // procs + (p < concurrency % procs) for p in range(procs)]
    start = time.monotonic() + 0.5
    loads = [Load(path, url, model, w, max(1, requests // concurrency), args.max_tokens, args.prompt_chars, start)
             for w in shares]
    cpu = cpu_seconds(gateway_pid)
    rows = [r for part in pool.map(_process, loads) for r in part]
    cpu = cpu_seconds(gateway_pid) - cpu
    ttft = [(r[1] - r[0]) * 1e3 for r in rows]
    decode = [(r[3] - 1) / (r[2] - r[1]) for r in rows if r[3] > 1 and r[2] > r[1]]
    wall = max(r[2] for r in rows) - min(r[0] for r in rows)
    legs = [(r[5], r[6], r[7]) for r in rows]
    bad = [r[3] for r in rows if r[3] != args.max_tokens]
    if bad:
        raise RuntimeError(f"{path}: {len(bad)} requests returned other than {args.max_tokens} tokens: {bad[:5]}")
    return {"requests": len(rows), "ttft": ttft, "legs": legs, "decode": decode, "wall": wall, "cpu": cpu,
            "tokens": sum(r[3] for r in rows), "responses": sum(r[4] for r in rows)}


def summary(results: list[dict]) -> dict:
    ttft = [x for r in results for x in r["ttft"]]
    legs = [x for r in results for x in r["legs"]]
    decode = [x for r in results for x in r["decode"]]
    total = {k: sum(r[k] for r in results) for k in ("requests", "tokens", "wall", "responses", "cpu")}
    return {**total, "p50": statistics.median(ttft), "p90": float(np.percentile(ttft, 90)),
            "serving": statistics.median(a + b for a, b, _ in legs), "in": statistics.median(a for a, _, _ in legs),
            "out": statistics.median(b for _, b, _ in legs), "first": statistics.median(f for _, _, f in legs),
            "outside": statistics.median(a + f for a, _, f in legs),
            "decode": statistics.median(decode), "throughput": total["tokens"] / total["wall"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc-url", help="tritonserver gRPC HOST:PORT (default: start one on model_repository/)")
    ap.add_argument("--openai-url", help="a running gateway http://HOST:PORT (default: start one for --grpc-url)")
    ap.add_argument("--triton-model", default="k3_ensemble")
    ap.add_argument("--served-model-name", default="k3")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per run (4 runs per repeat: ABBA); default max(8, 2 x concurrency)")
    ap.add_argument("--repeats", type=int, default=1, help="ABBA pairs per concurrency (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=128)
    ap.add_argument("--client-procs", type=int, default=4, help="load-generating processes (default %(default)s)")
    ap.add_argument("--gateway-args", default="", help="extra arguments for a gateway this bench starts")
    ap.add_argument("--gateway-pid", type=int, help="pid of the --openai-url gateway on this host, for its CPU time")
    ap.add_argument("--fake-step-ms", type=float,
                    help="instead of tritonserver, tests/fake_triton.py: every request one token per this many ms, "
                         "in lockstep; the gateway's own cost without a model's CPU and noise")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops what it started
    print("command:", " ".join(sys.argv))
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("tritonclient", "grpcio", "aiohttp"))
    print(f"python {platform.python_version()}, {versions}, {platform.machine()}, {mp.cpu_count()} CPUs")

    from gatewayutil import Gateway

    tmp = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    server = gateway = fake = None
    grpc_url, openai_url = args.grpc_url, args.openai_url
    try:
        if grpc_url is None and args.fake_step_ms:
            from k3backend.tritonserver import free_port

            port = free_port()
            fake = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_triton.py"), "--port", str(port),
                                     "--step-ms", str(args.fake_step_ms)], stdout=subprocess.PIPE, text=True)
            print(fake.stdout.readline().strip())  # listening
            grpc_url = f"127.0.0.1:{port}"
        elif grpc_url is None:
            from k3backend.tritonserver import TritonServer

            server = TritonServer(ROOT / "model_repository", tmp, models=[args.triton_model]).start()
            grpc_url = server.grpc_url
        if openai_url is None:
            gateway = Gateway(grpc_url, tmp / "gateway.log", "--triton-model", args.triton_model,
                              "--served-model-name", args.served_model_name, *args.gateway_args.split())
            openai_url = gateway.url
        gateway_pid = gateway.process.pid if gateway is not None else args.gateway_pid
        idle_rate = idle_cpu_rate(gateway_pid)  # gRPC's and asyncio's own polling, subtracted below
        print(f"server {grpc_url} ({args.triton_model}), gateway {openai_url}; {args.max_tokens} output tokens, "
              f"prompt {args.prompt_chars} characters, greedy, streaming\n")
        table = []
        with mp.get_context("spawn").Pool(args.client_procs) as pool:
            paths = {"grpc": (grpc_url, args.triton_model), "openai": (openai_url, args.served_model_name)}
            for c in args.concurrency:
                n = args.requests or max(8, 2 * c)
                for path, (url, model) in paths.items():  # warm-up: compile, connect, fill nothing
                    measure(pool, path, url, model, min(c, 4), min(c, 4), args)
                got = {"grpc": [], "openai": []}
                for _ in range(args.repeats):
                    for path in ("grpc", "openai", "openai", "grpc"):
                        url, model = paths[path]
                        got[path].append(measure(pool, path, url, model, c, n, args, gateway_pid))
                table.append((c, summary(got["grpc"]), summary(got["openai"])))
    finally:
        if gateway is not None:
            gateway.stop()
        if server is not None:
            server.stop()
        if fake is not None:
            fake.terminate()
            fake.wait()
    print(f"{'concurrency':>11}  {'path':<22} {'requests':>8} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
          f"{'serving p50 ms':>14} {'in p50':>7} {'first p50':>9} {'in+first p50':>12} {'out p50':>7} {'decode tok/s/req':>16} "
          f"{'output tok/s':>12}")
    for c, direct, gw in table:
        for name, s in ((f"{args.triton_model} gRPC", direct), ("OpenAI gateway", gw)):
            print(f"{c:>11}  {name:<22} {s['requests']:>8} {s['p50']:>11.2f} {s['p90']:>11.2f} {s['serving']:>14.2f} "
                  f"{s['in']:>7.2f} {s['first']:>9.2f} {s['outside']:>12.2f} {s['out']:>7.2f} {s['decode']:>16.1f} {s['throughput']:>12.1f}")
        print(f"{'':>11}  {'gateway Δ':<22} {'':>8} {gw['p50'] - direct['p50']:>+11.2f} {gw['p90'] - direct['p90']:>+11.2f} "
              f"{gw['serving'] - direct['serving']:>+14.2f} {gw['in'] - direct['in']:>+7.2f} "
              f"{gw['first'] - direct['first']:>+9.2f} {gw['outside'] - direct['outside']:>+12.2f} {gw['out'] - direct['out']:>+7.2f} "
              f"{100 * (gw['decode'] / direct['decode'] - 1):>+15.1f}% {100 * (gw['throughput'] / direct['throughput'] - 1):>+11.1f}%")
    print("\nserving = the time each request spends outside k3_lm, from k3_lm's return_perf_metrics times: in = k3_lm "
          "arrival - sent,\nout = final response received - last token sampled; what a path adds to TTFT, without the "
          "engine's queueing and prefill noise.\nfirst = first response received - first token sampled: in + first is "
          "the TTFT outside the engine (against the fake, whose\nlockstep steps make TTFT itself jump by a whole step "
          "when a request misses one).")
    if gateway_pid is not None:
        print(f"\ngateway CPU beyond its idle {1e3 * idle_rate:.1f} ms/s (what it needs at any speed of the model):")
        for c, _, gw in table:
            busy = max(0.0, gw["cpu"] - idle_rate * gw["wall"])
            print(f"  concurrency {c}: {1e3 * busy / gw['requests']:.2f} ms per request, "
                  f"{1e6 * busy / gw['responses']:.0f} us per streamed response, {100 * busy / gw['wall']:.1f} % of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
