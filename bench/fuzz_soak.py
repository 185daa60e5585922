"""Fuzz soak: valid streams at high concurrency mixed with hostile traffic for minutes ([ERR-5]).

    .venv/bin/python bench/fuzz_soak.py [--minutes 5] [--concurrency 16] [--fuzz-workers 8] [--seed 1]
    .venv/bin/python bench/fuzz_soak.py --url http://127.0.0.1:8000 [--grpc-url 127.0.0.1:8001]

Without --url it starts tritonserver on a copy of model_repository/ made for fuzzing
(tests/fuzz_run.py: max_num_seqs=1, so every valid stream must equal its alone run exactly;
--max-num-seqs N batches, and then texts are only reported, [SMP-7]). The fuzz cases are those
of tests/fuzz.py (the CI test runs a few hundred; this runs until the time is up). Prints the
command and versions, then requests by answer code and status, the valid streams, crashes and
hangs, and the RSS of tritonserver and its stubs over time (read from /proc). Exit status 1
when anything was wrong. Off by default: nothing in CI runs it.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzz import Fuzzer  # noqa: E402
from fuzz_gen import Limits  # noqa: E402
from fuzz_run import (  # noqa: E402
    MODELS,
    Canary,
    FuzzPool,
    ValidTraffic,
    fuzz_repository,
    internal_count,
    limits_of,
    log_size,
    precomputed_embeddings,
    run_valid,
    sample_png,
    server_problems,
    valid_jobs,
)
from fuzz_wire import Target  # noqa: E402
from serverutil import group_pids  # noqa: E402


class RssSampler:
    """RSS (MiB) of a process group every `period_s`: tritonserver and its Python-backend stubs."""

    def __init__(self, pgid: int, period_s: float) -> None:
        self.pgid, self.period_s = pgid, period_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss", daemon=True)
        self._start = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def sample(self) -> None:
        rss = {}
        for pid in group_pids(self.pgid):
            name, mib = _process(pid)
            if name:
                rss[name] = rss.get(name, 0.0) + mib
        self.samples.append((time.monotonic() - self._start, rss))

    def table(self) -> str:
        names = sorted({n for _, rss in self.samples for n in rss})
        lines = [f"{'t (s)':>7} " + " ".join(f"{n:>16}" for n in names)]
        for t, rss in self.samples:
            lines.append(f"{t:>7.0f} " + " ".join(f"{rss.get(n, 0):>16.0f}" for n in names))
        return "\n".join(lines)


def _process(pid: int) -> tuple[str, float]:
    """(name, RSS MiB) of a pid: `tritonserver`, the stub's instance name (k3_lm_0_0, ...) or the
    guardian; ("", 0) if it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "", 0.0
    rss = next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)
    exe = Path(argv[0].decode(errors="replace")).name
    if exe == "triton_python_backend_stub" and len(argv) > 9:
        return argv[8].decode(errors="replace"), rss  # the instance name argument
    if b"k3backend.serving.guardian" in argv:
        return "k3_lm guardian", rss
    return exe or "?", rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16, help="valid streams in flight")
    ap.add_argument("--fuzz-workers", type=int, default=8, help="threads sending fuzz cases")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per valid stream")
    ap.add_argument("--timeout", type=float, default=180.0, help="an answer later than this is a hang")
    ap.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    ap.add_argument("--url", help="HTTP URL of a running server (default: start one)")
    ap.add_argument("--grpc-url", help="gRPC host:port of that server (default: its HTTP port + 1)")
    ap.add_argument("--metrics-url", help="its metrics URL (default: HTTP port + 2, /metrics)")
    ap.add_argument("--server-pid", type=int, help="a running server's pid, for RSS (its process group)")
    ap.add_argument("--log", type=Path, help="a running server's log, scanned for crashes and tracebacks")
    ap.add_argument("--max-num-seqs", type=int, default=1, help="k3_lm max_num_seqs of the server started here")
    ap.add_argument("--known-defects", action="store_true",
                    help="also send the cases of known, unfixed server defects (tests/fuzz_protocol.py)")
    args = ap.parse_args()
    print("command:", " ".join(sys.argv))
    print(f"python {platform.python_version()}, tritonclient {metadata.version('tritonclient')}, "
          f"torch {metadata.version('torch')}, {platform.machine()}, server: {args.url or 'started here'}")

    server = None
    if args.url:
        host, port = args.url.removeprefix("http://").rsplit(":", 1)
        grpc_url = args.grpc_url or f"{host}:{int(port) + 1}"
        metrics_url = args.metrics_url or f"http://{host}:{int(port) + 2}/metrics"
        target, limits, pgid, log = Target(args.url, grpc_url), Limits(), args.server_pid, args.log
    else:
        server, limits = start_server(args.max_num_seqs)
        target, metrics_url = Target(server.http_url, server.grpc_url), server.metrics_url
        pgid, log = server.pid, server.log_path
    try:
        return soak(args, target, limits, metrics_url, pgid, log)
    finally:
        if server is not None:
            server.stop()


def start_server(max_num_seqs: int):
    from k3backend.presets import ensure_default_checkpoint
    from k3backend.tritonserver import TritonServer

    work = Path(tempfile.mkdtemp(prefix="k3-fuzz-soak-"))
    repo = fuzz_repository(work / "repo", max_num_seqs=str(max_num_seqs))
    server = TritonServer(repo, work / "server", models=MODELS)
    server.start()
    print(f"tritonserver pid {server.pid}, log {server.log_path}")
    return server, limits_of(repo, ensure_default_checkpoint())


def soak(args: argparse.Namespace, target: Target, limits: Limits, metrics_url: str, pgid: int | None,
         log: Path | None) -> int:
    png = sample_png()
    jobs = valid_jobs(precomputed_embeddings(target, png), png, args.max_tokens)
    alone = {job.name: run_valid(job, target, f"alone-{job.name}", args.timeout) for job in jobs}
    exact = args.url is None and args.max_num_seqs == 1
    offset, internal = (log_size(log) if log else 0), internal_count(metrics_url)
    rss = RssSampler(pgid, args.rss_every) if pgid else None
    canary = Canary()
    valid = ValidTraffic(target, jobs, {n: r.text for n, r in alone.items()}, args.concurrency, args.timeout)
    start = time.monotonic()
    if rss:
        rss.start()
    valid.start()
    fuzzer = Fuzzer(args.seed, limits, {"canary_url": canary.url}, known_defects=args.known_defects)
    pool = FuzzPool(target, fuzzer, args.fuzz_workers, args.timeout, deadline=start + args.minutes * 60)
    tally = pool.run()
    valid.stop()
    canary.close()
    took = time.monotonic() - start
    if rss:
        rss.stop()
    problems = server_problems(target, metrics_url, log, offset, internal)
    valid_problems = valid.problems if exact else [p for p in valid.problems if "differs" not in p]
    print(f"\n{took / 60:.1f} min, seed {args.seed}, {args.fuzz_workers} fuzz workers, "
          f"{args.concurrency} valid streams in flight\n")
    print(tally.table())
    print(f"\n{valid.summary()}; texts {'must equal' if exact else 'compared with'} the alone runs: "
          f"{sum('differs' in p for p in valid.problems)} differ")
    crashes = sum("Signal (" in p or "Segmentation" in p or "ready" in p for p in problems)
    hangs = tally.count("hang") + sum("no final response" in p for p in valid.problems)
    print(f"crashes {crashes} / hangs {hangs} / INTERNAL {tally.count('INTERNAL')} / "
          f"canary hits {canary.hits} / valid streams exact: {not valid.problems if exact else 'not checked'}")
    if rss:
        print("\nRSS (MiB) of tritonserver and its stubs\n" + rss.table())
    if not exact:
        for line in [p for p in valid.problems if "differs" in p][:5]:
            print("note (batching may change the last bits, [SMP-7]):", line)
    failures = [line for _, line in tally.failed] + valid_problems + problems
    failures += [f"{canary.hits} connection(s) to a refused loopback URL"] if canary.hits else []
    for line in failures[:30]:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
