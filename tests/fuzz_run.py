"""The [ERR-5] isolation run, shared by tests/test_fuzz.py and bench/fuzz_soak.py.

- `fuzz_repository`: model_repository/ with `max_num_seqs=1`, so a valid stream's text cannot
  depend on what it was batched with ([ERR-5]), and small prompt limits, so oversize cases are
  cheap to refuse. Remote image URLs stay off: URL cases never leave loopback.
- `valid_jobs` / `run_valid` / `ValidTraffic`: greedy and seeded streams (ignore_eos,
  min_tokens = max_tokens) through k3_ensemble and k3_lm, text-only and with images, each
  checked against the same request sent alone: text, token count, UTF-8, one final response.
- `FuzzPool`: workers sending `Fuzzer` cases; `server_problems`: readiness, INTERNAL counters,
  idle gauges and the server log after the run. `Canary`: a loopback port no request may reach.
"""

from __future__ import annotations

import base64
import io
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from fuzz import Fuzzer, Tally, run_case
from fuzz_gen import PLACEHOLDER, Limits
from fuzz_wire import Request, Sender, Target, grpc_inputs, json_bytes
from k3client import metric, metrics
from serverutil import repo_copy

MODELS = ["k3_vision", "k3_lm", "k3_ensemble"]
LM_PARAMS = {"max_num_seqs": "1", "max_model_len": "4096", "max_prompt_bytes": "65536"}
LOG_ALARMS = ("Signal (", "Segmentation fault", "Traceback")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fuzz_repository(dest: Path, **lm_params: str) -> Path:
    """A repository copy for fuzzing; `lm_params` override LM_PARAMS (e.g. max_num_seqs)."""
    repo = repo_copy(dest, k3_lm={**LM_PARAMS, **lm_params})
    vision = (repo / "k3_vision" / "config.pbtxt").read_text()
    assert 'key: "allow_remote_image_urls" value: { string_value: "false" }' in vision, \
        "the fuzz sends private-range URLs: it needs remote image URLs off"
    return repo


def limits_of(repo: Path, checkpoint: Path) -> Limits:
    """The fuzz Limits of a repository made by `fuzz_repository` and its checkpoint."""
    text = json.loads((checkpoint / "config.json").read_text())["text_config"]
    lm = (repo / "k3_lm" / "config.pbtxt").read_text()

    def param(name: str) -> int:
        marker = f'key: "{name}" value: {{ string_value: "'
        return int(lm.split(marker, 1)[1].split('"', 1)[0])

    return Limits(max_prompt_bytes=param("max_prompt_bytes"), max_model_len=param("max_model_len"),
                  vocab_size=text["vocab_size"], hidden_size=text["hidden_size"])


class Canary:
    """A listening loopback socket that counts connections: image URLs pointing at it are refused
    by policy, so any hit means k3_vision fetched a URL it must not."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.hits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="fuzz-canary", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


# ---- valid streams -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValidJob:
    """A valid streaming request whose output is fixed (greedy or seeded) and whose length is
    exactly max_tokens ([STP-4])."""

    name: str
    model: str
    protocol: str  # grpc | http_stream
    values: dict
    max_tokens: int


def sample_png(seed: int = 3, size: tuple[int, int] = (40, 30)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def precomputed_embeddings(target: Target, png: bytes) -> dict[str, np.ndarray]:
    """k3_vision's five outputs for one image, as k3_lm inputs (§4.2: a direct client's images)."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        request = Request("k3_vision", {"text_input": PLACEHOLDER, "image": [base64.b64encode(png)]})
        result = client.infer("k3_vision", grpc_inputs(request))
        names = ("image_embeds", "image_token_counts", "image_grid_thw", "image_sizes", "image_hashes")
        return {name: result.as_numpy(name) for name in names}
    finally:
        client.close()


def valid_jobs(embeddings: dict[str, np.ndarray], png: bytes, max_tokens: int) -> list[ValidJob]:
    """Greedy and seeded streams through both models and protocols, text-only and with images."""
    exact = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True, "stream": True,
             "return_num_output_tokens": True, "return_finish_reason": True}
    greedy, seeded = {"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 4242}
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    chat = json.dumps([{"role": "user", "content": [{"type": "image", "image": base64.b64encode(png).decode()},
                                                    {"type": "text", "text": "What is in the picture?"}]}])
    jobs = [
        ("ensemble-text-greedy", "k3_ensemble", "grpc", {"text_input": "The capital of France is", **greedy}),
        ("lm-text-greedy", "k3_lm", "grpc", {"text_input": "Once upon a time", **greedy}),
        ("ensemble-image-greedy", "k3_ensemble", "grpc",
         {"text_input": PLACEHOLDER + " Describe it.", "image_url_input": [uri], **greedy}),
        ("lm-embeds-greedy", "k3_lm", "grpc", {"text_input": "Look: " + PLACEHOLDER, **embeddings, **greedy}),
        ("lm-text-seeded", "k3_lm", "grpc", {"text_input": "Roll the dice:", **seeded}),
        ("ensemble-chat-image-http", "k3_ensemble", "http_stream", {"text_input": "", "messages": chat, **greedy}),
        ("ensemble-text-seeded-http", "k3_ensemble", "http_stream", {"text_input": "Pick a word:", **seeded}),
    ]
    return [ValidJob(name, model, protocol, {**values, **exact}, max_tokens) for name, model, protocol, values in jobs]


@dataclass
class ValidResult:
    """One valid stream as received."""

    job: ValidJob
    deltas: list[str] = field(default_factory=list)
    tokens: int = 0
    finals: int = 0  # responses flagged final (gRPC) / events with a finish_reason (HTTP)
    finish: str = ""
    error: str = ""
    notes: list[str] = field(default_factory=list)  # protocol violations seen while receiving

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def problems(self, expected_text: str | None) -> list[str]:
        out = [f"{self.job.name}: {note}" for note in self.notes]
        if self.error:
            out.append(f"{self.job.name}: error {self.error[:300]}")
        if self.finals != 1:
            out.append(f"{self.job.name}: {self.finals} final responses")
        if self.tokens != self.job.max_tokens:
            out.append(f"{self.job.name}: num_output_tokens sum {self.tokens}, expected {self.job.max_tokens}")
        if self.finish != "length":
            out.append(f"{self.job.name}: finish_reason {self.finish!r}, expected 'length'")
        if expected_text is not None and self.text != expected_text:
            out.append(f"{self.job.name}: text differs from the request sent alone:\n"
                       f"      alone {expected_text!r}\n      now   {self.text!r}")
        return out


def run_valid(job: ValidJob, target: Target, request_id: str, timeout_s: float) -> ValidResult:
    if job.protocol == "grpc":
        return _valid_grpc(job, target, request_id, timeout_s)
    return _valid_http(job, target, request_id, timeout_s)


def _valid_grpc(job: ValidJob, target: Target, request_id: str, timeout_s: float) -> ValidResult:
    result = ValidResult(job)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(target.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(job.model, grpc_inputs(Request(job.model, job.values)), request_id=request_id)
        deadline = time.monotonic() + timeout_s
        while not result.finals and not result.error:
            try:
                response, error = got.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                result.error = f"no final response within {timeout_s:.0f} s"
                client.stop_stream(cancel_requests=True)
                return result
            if error is not None:
                result.error = str(error)
            else:
                _take_grpc_response(result, response)
        client.stop_stream()
        while not got.empty():
            got.get()
            result.notes.append("a response after the final one")
    finally:
        client.close()
    return result


def _take_grpc_response(result: ValidResult, response) -> None:
    final = response.get_response().parameters["triton_final_response"].bool_param
    try:
        delta = response.as_numpy("text_output").reshape(-1)[0].decode("utf-8")  # [STR-5]
    except UnicodeDecodeError as e:
        result.notes.append(f"text_output not UTF-8: {e}")
        delta = ""
    if not delta and not final:
        result.notes.append("an empty non-final response ([STR-3])")
    result.deltas.append(delta)
    result.tokens += int(response.as_numpy("num_output_tokens").reshape(-1)[0])
    finish = response.as_numpy("finish_reason").reshape(-1)[0].decode()
    if finish and not final:
        result.notes.append(f"finish_reason {finish!r} on a non-final response")
    if final:
        result.finals += 1
        result.finish = finish


def _valid_http(job: ValidJob, target: Target, request_id: str, timeout_s: float) -> ValidResult:
    result = ValidResult(job)
    body = json_bytes({"id": request_id, **job.values})
    req = urllib.request.Request(f"{target.http_url}/v2/models/{job.model}/generate_stream", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        result.error = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
        return result
    except Exception as e:  # noqa: BLE001 - timeouts, connections: the job failed
        result.error = f"{type(e).__name__}: {e}"
        return result
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        result.notes.append(f"response not UTF-8: {e}")
        return result
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            result.error = event["error"]
            continue
        result.deltas.append(event["text_output"])
        result.tokens += int(event["num_output_tokens"])
        if event["finish_reason"]:
            result.finals += 1
            result.finish = event["finish_reason"]
    return result


class ValidTraffic:
    """`concurrency` threads sending valid jobs round-robin until `stop()`; every result is checked
    against `expected` (the job's text when sent alone)."""

    def __init__(self, target: Target, jobs: list[ValidJob], expected: dict[str, str], concurrency: int,
                 timeout_s: float) -> None:
        self.target, self.jobs, self.expected, self.timeout_s = target, jobs, expected, timeout_s
        self.results: list[ValidResult] = []
        self.problems: list[str] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"valid-{i}", daemon=True)
                         for i in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def _loop(self, worker: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                n, self._next = self._next, self._next + 1
            job = self.jobs[n % len(self.jobs)]
            try:
                result = run_valid(job, self.target, f"valid-{n}-{job.name}", self.timeout_s)
            except Exception as e:  # noqa: BLE001 - e.g. the server went away: the stream failed
                result = ValidResult(job, error=f"{type(e).__name__}: {e}")
            with self._lock:
                self.results.append(result)
                self.problems += result.problems(self.expected[job.name])

    def summary(self) -> str:
        done = {job.name: sum(r.job is job for r in self.results) for job in self.jobs}
        return (f"{len(self.results)} valid streams ({', '.join(f'{k} {v}' for k, v in done.items())}); "
                f"{len(self.problems)} problems")


# ---- fuzz workers ------------------------------------------------------------------------------


class FuzzPool:
    """`workers` threads sending cases `start`, `start + 1`, ... until `count` cases were sent or
    `deadline` (monotonic) passed; the answers go to `tally`."""

    def __init__(self, target: Target, fuzzer: Fuzzer, workers: int, timeout_s: float, *,
                 count: int | None = None, deadline: float | None = None) -> None:
        self.target, self.fuzzer, self.workers, self.timeout_s = target, fuzzer, workers, timeout_s
        self.count, self.deadline = count, deadline
        self.tally = Tally()
        self._next = 0
        self._lock = threading.Lock()

    def run(self) -> Tally:
        threads = [threading.Thread(target=self._loop, name=f"fuzz-{i}", daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.tally

    def _take(self) -> int | None:
        with self._lock:
            if self.count is not None and self._next >= self.count:
                return None
            if self.deadline is not None and time.monotonic() >= self.deadline:
                return None
            self._next += 1
            return self._next - 1

    def _loop(self) -> None:
        sender = Sender(self.target, self.timeout_s)
        try:
            while (index := self._take()) is not None:
                self.tally.add(run_case(self.fuzzer.case(index), sender), self.fuzzer.seed)
        finally:
            sender.close()


# ---- the server after the run --------------------------------------------------------------------


def log_size(log_path: Path) -> int:
    return Path(log_path).stat().st_size


def log_alarms(log_path: Path, offset: int) -> list[str]:
    """Server-log lines since `offset` that mean a crash or an unexpected error: signals,
    segfaults, Python tracebacks (an INTERNAL is logged with one, [ERR-3])."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    return [f"server log: {line[:300]}" for line in lines if any(alarm in line for alarm in LOG_ALARMS)]


def internal_count(metrics_url: str) -> float:
    """k3:request_failure_total{code="INTERNAL"} of both models."""
    return metric(metrics(metrics_url), "k3:request_failure_total", code="INTERNAL")


def server_problems(target: Target, metrics_url: str, log_path: Path | None, log_offset: int,
                    internal_before: float, idle_timeout_s: float = 20.0) -> list[str]:
    """[ERR-4]/[ERR-3] after a run: every model ready, no INTERNAL counted since the run began,
    the engine healthy and idle again (nothing leaked), no crash or traceback in the log (when
    there is one to read)."""
    problems = []
    for model in MODELS:
        status = _status(f"{target.http_url}/v2/models/{model}/ready")
        if status != 200:
            problems.append(f"{model} ready: {status}")
    deadline = time.monotonic() + idle_timeout_s
    while True:
        m = metrics(metrics_url)
        busy = {name: metric(m, f"k3:{name}") for name in ("num_requests_running", "num_requests_waiting")}
        if not any(busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    if any(busy.values()):
        problems.append(f"engine not idle {idle_timeout_s:.0f} s after the run: {busy}")
    internal = metric(m, "k3:request_failure_total", code="INTERNAL") - internal_before
    if internal:
        problems.append(f'k3:request_failure_total{{code="INTERNAL"}} went up by {internal:g}')
    if metric(m, "k3:engine_healthy") != 1:
        problems.append("k3:engine_healthy is not 1")
    return problems + (log_alarms(log_path, log_offset) if log_path else [])


def _status(url: str) -> int | None:
    try:
        with _DIRECT.open(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None
