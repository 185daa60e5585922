"""Closed-loop streaming load through a running tritonserver, as a user would measure it.

    python bench/serving_load.py --url localhost:8001 --model k3_lm --concurrency 64 --num-requests 256 \\
        --prompt-len 284 --output-len 128 --tokenizer /path/to/ckpt

`--concurrency` gRPC streams (spread over `--procs` client processes, so the client is never the
bottleneck) each send one request, read it to its final response, and send the next, until
`--num-requests` have finished after `--warmup` more. Requests are greedy with ignore_eos and
min_tokens = max_tokens, so every one produces exactly `--output-len` tokens; prompts are random
words, cut to `--prompt-len` tokens with the checkpoint's tokenizer (`k3_lm` is sent `text_input`
verbatim; the lengths it sees are printed). Per request: TTFT (send to first response) and,
per response, its interval spread over the tokens it carries (`num_output_tokens`: a response
can carry several when the client reads slower than the engine). Prints one line: output tok/s,
TTFT p50/p99, ITL p50/p99, responses per token. With `--metrics-url`, a second line splits the mean
TTFT: k3_lm's own time to first token and its queue time (receipt to the first step with the
request) over the measured requests, from its metrics, the rest being the client and gRPC.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import random
import sys
import threading
import time

import numpy as np

WORDS = ("the of and to in is that for it as with was on be by at this from or have an they which one you were "
         "her all she there would their we him been has when who will more no if out so said what up its about "
         "into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way").split()


def prompts(tokenizer_dir: str, n: int, length: int, seed: int, std: float = 0.0) -> list[str]:
    """n random-word prompts of `length` tokens each, or of gauss(length, std) tokens (at least 1) each."""
    from k3backend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        want = max(1, int(rng.gauss(length, std))) if std else length
        ids: list[int] = []
        while len(ids) < want:
            ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(want * 2)), allow_special=False)
        out.append(tok.decode(ids[:want]))
    n = [len(tok.encode_text_input(t)) for t in out]
    print(f"prompts: {len(out)} of {min(n)}..{max(n)} tokens (mean {sum(n) / len(n):.1f}) as k3_lm tokenizes them")
    return out


def _client(url: str, model: str, jobs: list[tuple[str, int]], streams: int, results: mp.Queue, ready: mp.Queue,
            go) -> None:
    import tritonclient.grpc as grpcclient

    def inputs(text: str, n_out: int) -> list:
        values = {"text_input": np.array([[text.encode()]], dtype=object),
                  "max_tokens": np.array([[n_out]], dtype=np.int32), "min_tokens": np.array([[n_out]], dtype=np.int32),
                  "temperature": np.array([[0.0]], dtype=np.float32), "ignore_eos": np.array([[True]]),
                  "stream": np.array([[True]]), "return_num_output_tokens": np.array([[True]])}
        out = []
        for name, arr in values.items():
            dtype = {np.object_: "BYTES", np.int32: "INT32", np.float32: "FP32", np.bool_: "BOOL"}[arr.dtype.type]
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            out.append(t)
        return out

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for j in jobs:
        todo.put(j)

    def connect() -> tuple:
        client = grpcclient.InferenceServerClient(url)
        got: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: got.put((time.monotonic(), result, error)))
        return client, got

    def stream(k: int, client, got: queue.SimpleQueue) -> None:
        n = 0
        while True:
            try:
                text, n_out = todo.get_nowait()
            except queue.Empty:
                break
            t0 = time.monotonic()
            client.async_stream_infer(model, inputs(text, n_out), request_id=f"load-{k}-{n}")
            n += 1
            times, tokens, error = [], [], None
            while True:
                t, result, error = got.get()
                if error is not None:
                    break
                r = result.get_response()
                if r.outputs:
                    times.append(t)
                    tokens.append(int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
                if r.parameters["triton_final_response"].bool_param:
                    break
            results.put((t0, times, tokens, None if error is None else str(error)))
        client.stop_stream()
        client.close()

    # every stream open before the clock starts: the first wave leaves at once, as in bench/engine.py
    connected = [connect() for _ in range(streams)]
    ready.put(streams)
    go.wait()
    threads = [threading.Thread(target=stream, args=(k, *c)) for k, c in enumerate(connected)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(url: str, model: str, jobs: list[tuple[str, int]], concurrency: int, procs: int) -> list[tuple]:
    """Each (prompt, output tokens) job once, `concurrency` at a time; one row per job."""
    ctx = mp.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = max(1, min(procs, concurrency))
    share = [jobs[i::procs] for i in range(procs)]
    streams = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    workers = [ctx.Process(target=_client, args=(url, model, share[i], streams[i], results, ready, go))
               for i in range(procs)]
    for w in workers:
        w.start()
    for _ in workers:  # every client imported and its streams open before the clock starts
        ready.get(timeout=120)
    go.set()
    out = [results.get() for _ in jobs]
    for w in workers:
        w.join()
    return out


def server_means(metrics_url: str) -> dict[str, tuple[float, float]]:
    """k3_lm's (sum, count) of the TTFT and queue-time histograms, from its Prometheus text."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds"):
        parts = []
        for suffix in ("_sum", "_count"):
            rows = [ln for ln in text.splitlines() if f":{name}{suffix}{{" in ln and 'model="k3_lm"' in ln]
            parts.append(float(rows[0].rsplit(" ", 1)[1]) if rows else float("nan"))
        out[name] = (parts[0], parts[1])
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def summarize(rows: list[tuple]) -> dict:
    errors = [r[3] for r in rows if r[3]]
    ttft = [r[1][0] - r[0] for r in rows if r[1]]
    itl = []
    for t0, times, tokens, _ in rows:
        for prev, t, n in zip(times, times[1:], tokens[1:]):
            itl += [(t - prev) / n] * n
    start, end = min(r[0] for r in rows), max(r[1][-1] for r in rows if r[1])
    n_tokens = sum(sum(r[2]) for r in rows)
    return {"tok/s": n_tokens / (end - start), "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99),
            "itl50": pct(itl, 50), "itl99": pct(itl, 99), "responses/token": sum(len(r[1]) for r in rows) / n_tokens,
            "errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--model", default="k3_lm")
    ap.add_argument("--tokenizer", required=True, help="checkpoint (or tokenizer) directory")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=0, help="requests before the measured ones (default: concurrency)")
    ap.add_argument("--prompt-len", type=int, default=284)
    ap.add_argument("--prompt-len-std", type=float, default=0.0, help="spread of the prompt lengths (gauss, as "
                    "bench/engine.py draws them: with the two spreads requests end and arrive at different times)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-std", type=float, default=0.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics-url", default="", help="Triton's metrics endpoint, e.g. localhost:8002 (splits TTFT)")
    args = ap.parse_args(argv)
    warm = args.warmup or args.concurrency
    texts = prompts(args.tokenizer, warm + args.num_requests, args.prompt_len, args.seed, args.prompt_len_std)
    rng = random.Random(args.seed + 1)
    outs = [max(1, int(rng.gauss(args.output_len, args.output_len_std))) if args.output_len_std else args.output_len
            for _ in texts]
    jobs = list(zip(texts, outs))
    run(args.url, args.model, jobs[:warm], min(args.concurrency, warm), args.procs)
    before = server_means(args.metrics_url) if args.metrics_url else {}
    rows = run(args.url, args.model, jobs[warm:], args.concurrency, args.procs)
    s = summarize(rows)
    spread = lambda n, std: f"{n}±{std:g}" if std else f"{n}"  # noqa: E731
    print(f"served {args.model}: concurrency {args.concurrency}, {args.num_requests} requests, prompt "
          f"{spread(args.prompt_len, args.prompt_len_std)}, output {spread(args.output_len, args.output_len_std)}: "
          f"{s['tok/s']:.1f} tok/s, TTFT p50 {s['ttft50'] * 1e3:.1f} p99 "
          f"{s['ttft99'] * 1e3:.1f} ms, ITL p50 {s['itl50'] * 1e3:.2f} p99 {s['itl99'] * 1e3:.2f} ms, "
          f"{s['responses/token']:.2f} responses per token, {len(s['errors'])} errors")
    if before:
        time.sleep(0.5)  # metrics go through a queue drained by a thread
        after = server_means(args.metrics_url)
        mean = {k: (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1) for k in after}
        client = [r[1][0] - r[0] for r in rows if r[1]]
        print(f"  TTFT mean {sum(client) / len(client) * 1e3:.1f} ms at the client = k3_lm "
              f"{mean['time_to_first_token_seconds'] * 1e3:.1f} ms (queue {mean['request_queue_time_seconds'] * 1e3:.1f}"
              f" ms, then steps until the first token) + client and gRPC")
    for e in s["errors"][:5]:
        print("  error:", e, file=sys.stderr)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
