"""Everything behind `k3_lm`'s TritonPythonModel (SERVING.md §4, §6, §8, §9).

`execute()` only parses and enqueues ([CFG-L2]); tokenization and engine admission run on the
admission thread; engine events become responses on the response thread (a slow client never
stalls the engine); a poller thread checks cancellation and refreshes gauges. Each request gets
a unique engine id, so a gRPC cancel aborts exactly one request while `stop` + request id
([CAN-3]) reaches every in-flight request that shares the client's id.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3backend.engine.engine import Engine, EngineConfig
from k3backend.engine.request import FinishReason, RequestOutput
from k3backend.errors import Cancelled, Unavailable
from k3backend.serving import metrics as m
from k3backend.serving.params import (
    LmDefaults,
    ParsedRequest,
    load_generation_defaults,
    parse_request,
)
from k3backend.serving.prompt import build_request
from k3backend.serving.responses import (
    ResponseBuilder,
    error_message,
    stop_request_response,
)
from k3backend.serving.triton_io import (
    ModelParams,
    data_response,
    error_response,
    input_getter,
    request_parameters,
    resolve_device_dtype,
    setup_logging,
)

log = logging.getLogger(__name__)

MODEL = "k3_lm"
PARAMETERS = {  # SERVING.md §4.4 with defaults
    "model_path": "", "tokenizer_path": "", "device": "auto", "dtype": "auto", "gpu_device_ids": "",
    "tensor_parallel_size": "1", "expert_parallel_size": "1", "dist_backend": "auto", "max_model_len": "131072",
    "max_num_seqs": "256", "max_num_batched_tokens": "8192", "gpu_memory_utilization": "0.90",
    "enable_prefix_caching": "true", "exclude_input_in_output": "true", "default_max_tokens": "16",
    "default_thinking": "false", "max_prompt_bytes": "8388608", "max_queued_requests": "0",
    "cancellation_check_period_ms": "100", "allow_stop_by_request_id": "true", "stop_tombstone_ttl_s": "30",
    "startup_timeout_s": "3600", "shutdown_timeout_s": "20", "step_timeout_s": "300",
    "unload_on_engine_failure": "true", "REPORT_CUSTOM_METRICS": "true", "metrics_prefix": "k3",
    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
}


@dataclass
class _InFlight:
    """One request between execute() and its final response."""

    client_id: str
    engine_id: str
    sender: Any
    parsed: ParsedRequest
    builder: ResponseBuilder | None = None
    num_input_tokens: int = 0
    client_cancelled: bool = False
    num_output_tokens: int = 0
    first_sent: float | None = None  # monotonic time of the first data response
    last_token_ns: int = 0
    arrival: float = field(default_factory=time.monotonic)


class LmServer:
    """The k3_lm model instance: parameters, engine, threads, metrics. `close()` is idempotent."""

    def __init__(self, model_config: dict, pb_utils: Any, *, version: str = "1") -> None:
        self.pb = pb_utils
        setup_logging()
        _check_instance_config(model_config)
        p = ModelParams(model_config, PARAMETERS, MODEL)
        if p.int("tensor_parallel_size", lo=1) != 1 or p.int("expert_parallel_size", lo=1) != 1:
            raise ValueError(f"{MODEL}: tensor_parallel_size/expert_parallel_size > 1 are not implemented yet "
                             "(the engine runs in one process)")
        self.period_s = p.int("cancellation_check_period_ms", lo=1) / 1000
        self.tombstone_ttl_s = p.float("stop_tombstone_ttl_s", lo=0)
        self.shutdown_timeout_s = p.float("shutdown_timeout_s", lo=0)
        self.unload_on_failure = p.bool("unload_on_engine_failure")
        self.max_model_len = p.int("max_model_len", lo=1)
        device, dtype = resolve_device_dtype(p.choice("device", ("auto", "cpu", "cuda")),
                                             p.choice("dtype", ("auto", "bfloat16", "float32", "float16", "float64")),
                                             MODEL)
        ckpt = self._checkpoint(p.str("model_path"))
        tok_dir = Path(p.str("tokenizer_path")) if p.str("tokenizer_path") else ckpt
        t0 = time.monotonic()
        from k3backend.checkpoint import load_model
        from k3backend.tokenizer import Tokenizer

        model = load_model(ckpt, dtype=dtype, device=device, progress=False)
        if device.type == "cpu" and model.cfg.text.hidden_size < 1024:
            torch.set_num_threads(1)  # toy models: one thread beats several fighting over small ops
        self.tokenizer = Tokenizer.from_dir(tok_dir)
        text = model.cfg.text
        gen = load_generation_defaults(ckpt)
        log.info("%s: sampling defaults from generation_config.json: %s", MODEL, gen or "none")  # [CFG-L4]
        self.defaults = LmDefaults(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            default_max_tokens=p.int("default_max_tokens", lo=1), exclude_input_in_output=p.bool("exclude_input_in_output"),
            default_thinking=p.bool("default_thinking"), max_prompt_bytes=p.int("max_prompt_bytes", lo=1),
            allow_stop_by_request_id=p.bool("allow_stop_by_request_id"), **gen)
        self.eos_ids = tuple(model.cfg.eos_token_id) or (self.tokenizer.eos_id,)
        self.eos_ids = tuple(dict.fromkeys(self.eos_ids + tuple(_generation_eos(ckpt))))
        self.engine = Engine(model, self.tokenizer, EngineConfig(
            max_num_seqs=p.int("max_num_seqs", lo=1), max_model_len=self.max_model_len,
            max_num_batched_tokens=p.int("max_num_batched_tokens", lo=1),
            max_queued_requests=p.int("max_queued_requests", lo=0), step_timeout_s=p.float("step_timeout_s", lo=0.001)))
        self._warm_up()
        log.info("%s: worker rank 0 pid %d device %s", MODEL, os.getpid(), device)  # [HLT-1]
        log.info("%s: loaded %s (%s) in %.1f s", MODEL, ckpt, dtype, time.monotonic() - t0)

        self.metrics = self._make_metrics(p, version)
        self._lock = threading.Lock()  # guards the maps below
        self._by_client: dict[str, set[str]] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._tombstones: dict[str, float] = {}  # client id -> expiry (monotonic)
        self._ids = itertools.count()
        self._admit_q: queue.Queue[_InFlight | None] = queue.Queue()
        self._send_q: queue.Queue[tuple[Any, Any, bool] | None] = queue.Queue()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=f, name=f"k3-lm-{n}", daemon=True)
                         for n, f in (("admit", self._admit_loop), ("send", self._send_loop), ("poll", self._poll_loop))]
        for t in self._threads:
            t.start()

    # ---- Triton entry points ---------------------------------------------------------------

    def execute(self, requests: list) -> None:
        """Parse cheaply, answer stop requests, enqueue the rest; never waits for generation."""
        for request in requests:
            sender = request.get_response_sender()
            client_id = request.request_id()
            try:
                if self._closed.is_set():
                    raise Unavailable("server shutting down")
                if request.is_cancelled():  # [CAN-2]: cancelled while k3_vision ran
                    raise Cancelled("request cancelled by client")
                parsed = parse_request(input_getter(self.pb, request), request_parameters(request), client_id,
                                       self.defaults)
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
                self._send_error(sender, e, client_id)
                continue
            if parsed.is_stop:
                self._stop(client_id)
                self._send_q.put((sender, data_response(self.pb, stop_request_response()), True))
                continue
            state = _InFlight(client_id, f"{client_id}#{next(self._ids)}", sender, parsed)
            with self._lock:
                tombstone = self._tombstones.pop(client_id, None) if client_id else None
                if tombstone is None or tombstone < time.monotonic():
                    self._inflight[state.engine_id] = state
                    self._by_client.setdefault(client_id, set()).add(state.engine_id)
                    tombstone = None
            if tombstone is not None:  # [CAN-7]: stopped before it arrived
                self._finish_tombstoned(state)
                continue
            self._admit_q.put(state)

    def close(self) -> None:
        """[HLT-9]: stop admitting, end in-flight requests (UNAVAILABLE), join threads and the engine."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.engine.close(timeout=self.shutdown_timeout_s)  # in-flight requests get ERROR events
        self._admit_q.put(None)
        for t in self._threads[:1] + self._threads[2:]:
            t.join(timeout=5)
        self._send_q.put(None)
        self._threads[1].join(timeout=5)
        self.metrics.close()

    # ---- threads ---------------------------------------------------------------------------

    def _admit_loop(self) -> None:
        """Tokenize, render and expand off the Triton thread, then hand the request to the engine."""
        while (state := self._admit_q.get()) is not None:
            try:
                if state.client_cancelled:
                    raise Cancelled("request cancelled by client")
                request, echo = build_request(state.parsed, self.tokenizer, eos_ids=self.eos_ids,
                                              max_model_len=self.max_model_len,
                                              default_max_tokens=self.defaults.default_max_tokens)
                request = dataclasses.replace(request, request_id=state.engine_id)
                state.num_input_tokens = len(request.prompt_ids)
                state.builder = ResponseBuilder(state.parsed, echo, num_input_tokens=state.num_input_tokens,
                                                tokenizer=self.tokenizer)
                self.engine.submit(request, lambda ev, s=state: self._on_output(s, ev))
            except Exception as e:  # noqa: BLE001
                self._forget(state)
                self._send_error(state.sender, e, state.client_id)
                continue
            self.metrics.inc("prompt_tokens_total", state.num_input_tokens)
            self.metrics.observe("request_prompt_tokens", state.num_input_tokens)
            if state.parsed.images is not None:
                self.metrics.inc("image_tokens_total", sum(state.parsed.images.token_counts))

    def _on_output(self, state: _InFlight, ev: RequestOutput) -> None:
        """Engine thread: one event -> at most one response, queued for the send thread."""
        try:
            if ev.token_ids:
                self._count_tokens(state, ev)
            if ev.token_ids and state.num_output_tokens == len(ev.token_ids) and ev.first_scheduled_time_ns:
                # the request's first tokens: observed once even when their text was held back
                self.metrics.observe("request_queue_time_seconds",
                                     max(0.0, ev.first_scheduled_time_ns / 1e9 - state.parsed.arrival_time))
            if ev.finished and ev.finish_reason is FinishReason.CANCELLED and state.client_cancelled:
                raise Cancelled("request cancelled by client")  # [CAN-1]: a gRPC cancel ends in an error
            outputs = state.builder.on_event(ev)
        except Exception as e:  # noqa: BLE001
            self._forget(state)
            self._send_error(state.sender, e, state.client_id)
            return
        if outputs is not None:
            if state.first_sent is None:
                state.first_sent = time.monotonic()
                self.metrics.observe("time_to_first_token_seconds", state.first_sent - state.arrival)
            self._send_q.put((state.sender, data_response(self.pb, outputs), ev.finished))
        if ev.finished:
            self._forget(state)
            self.metrics.inc("request_success_total", finished_reason=ev.finish_reason.value)
            self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - state.arrival)
            self.metrics.observe("request_generation_tokens", state.num_output_tokens)

    def _count_tokens(self, state: _InFlight, ev: RequestOutput) -> None:
        """Generation counter, and one time-per-output-token observation per token after the first.

        An event can cover several tokens (held-back text); their interval is spread evenly.
        """
        n = len(ev.token_ids)
        state.num_output_tokens += n
        self.metrics.inc("generation_tokens_total", n)
        prev = state.last_token_ns or ev.first_token_time_ns
        intervals = n if state.last_token_ns else n - 1
        if intervals > 0 and ev.last_token_time_ns and prev:
            per_token = max(0.0, (ev.last_token_time_ns - prev) / 1e9 / intervals)
            for _ in range(intervals):
                self.metrics.observe("time_per_output_token_seconds", per_token)
        state.last_token_ns = ev.last_token_time_ns or state.last_token_ns

    def _send_loop(self) -> None:
        while (item := self._send_q.get()) is not None:
            sender, response, final = item
            try:
                sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception:  # noqa: BLE001 - a vanished client must not stop other responses
                log.exception("%s: sending a response failed", MODEL)

    def _poll_loop(self) -> None:
        """[CAN-1] cancellation polling, tombstone expiry, gauges, engine-failure handling."""
        reported_failure = False
        while not self._closed.wait(self.period_s):
            with self._lock:
                states = list(self._inflight.values())
                now = time.monotonic()
                for cid in [c for c, t in self._tombstones.items() if t < now]:
                    del self._tombstones[cid]
            for state in states:
                if not state.client_cancelled and _is_cancelled(state.sender):
                    state.client_cancelled = True
                    self.engine.abort(state.engine_id)
            stats = self.engine.stats()
            self.metrics.set("num_requests_running", stats.num_running)
            self.metrics.set("num_requests_waiting", stats.num_waiting)
            self.metrics.set("engine_healthy", 1.0 if stats.healthy else 0.0)
            self.metrics.set("workers_alive", 1.0 if stats.healthy else 0.0)
            if not stats.healthy and not reported_failure:
                reported_failure = True
                log.error("%s: engine failed: %s", MODEL, stats.unhealthy_reason)
                if self.unload_on_failure:
                    self._self_unload()

    # ---- helpers ---------------------------------------------------------------------------

    def _stop(self, client_id: str) -> None:
        """[CAN-5]/[CAN-7]: stop every in-flight request with this id, or leave a tombstone."""
        with self._lock:
            engine_ids = list(self._by_client.get(client_id, ()))
            if not engine_ids:
                self._tombstones[client_id] = time.monotonic() + self.tombstone_ttl_s
        matched = sum(self.engine.stop(eid) for eid in engine_ids)
        log.debug("%s: stop request %r matched %d request(s)", MODEL, client_id, matched)
        if engine_ids and not matched:  # still being admitted: the engine has not seen them yet
            with self._lock:
                self._tombstones[client_id] = time.monotonic() + self.tombstone_ttl_s

    def _finish_tombstoned(self, state: _InFlight) -> None:
        builder = ResponseBuilder(state.parsed, "", tokenizer=self.tokenizer)
        ev = RequestOutput(state.engine_id, finished=True, finish_reason=FinishReason.CANCELLED)
        self.metrics.inc("request_success_total", finished_reason="cancelled")
        self._send_q.put((state.sender, data_response(self.pb, builder.on_event(ev)), True))

    def _forget(self, state: _InFlight) -> None:
        with self._lock:
            self._inflight.pop(state.engine_id, None)
            ids = self._by_client.get(state.client_id)
            if ids is not None:
                ids.discard(state.engine_id)
                if not ids:
                    del self._by_client[state.client_id]

    def _send_error(self, sender: Any, exc: BaseException, client_id: str) -> None:
        code, message = error_message(MODEL, exc, client_id)
        if code == "CANCELLED":  # a direct cancellation counts as a finished request (§9)
            self.metrics.inc("request_success_total", finished_reason="cancelled")
        else:
            self.metrics.inc("request_failure_total", code=code)
        self._send_q.put((sender, error_response(self.pb, code, message), True))

    def _self_unload(self) -> None:
        """[HLT-5] item 2: in explicit model-control mode, unload k3_lm and its dependents."""
        try:
            self.pb.unload_model(MODEL, unload_dependents=True)
        except Exception as e:  # noqa: BLE001 - not in explicit mode: readiness cannot be flipped on 2.51
            log.warning("%s: could not unload after the engine failure (%s); engine_healthy=0 reports it", MODEL, e)

    def _warm_up(self) -> None:
        """One prefill and one decode through the engine before the model reports ready ([HLT-1])."""
        from k3backend.engine.request import Request
        from k3backend.engine.sampling_params import SamplingParams

        done = threading.Event()
        events: list[RequestOutput] = []

        def on_output(ev: RequestOutput) -> None:
            events.append(ev)
            if ev.finished:
                done.set()

        ids = self.tokenizer.encode("warm up", allow_special=False)
        self.engine.submit(Request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
                           on_output)
        if not done.wait(600) or events[-1].finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"{MODEL}: warm-up failed: {events[-1].error if events else 'timed out'}")

    @staticmethod
    def _checkpoint(model_path: str) -> Path:
        if model_path:
            path = Path(model_path)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{MODEL}: model_path {path} has no config.json")
            return path
        from k3backend.presets import ensure_default_checkpoint

        return ensure_default_checkpoint()

    def _make_metrics(self, p: ModelParams, version: str) -> m.NullMetrics:
        if not p.bool("REPORT_CUSTOM_METRICS"):
            return m.NullMetrics()  # [MET-3]
        reg = m.TritonMetrics(self.pb, p.str("metrics_prefix"), model=MODEL, version=version)
        for name, desc in (("prompt_tokens_total", "Prompt tokens of admitted requests"),
                           ("generation_tokens_total", "Generated tokens"),
                           ("num_preemptions_total", "Sequences preempted and recomputed"),
                           ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
                           ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache"),
                           ("image_tokens_total", "Image pad positions admitted")):
            reg.counter(name, desc)
        reg.counter("request_success_total", "Requests finished with a data response, plus direct cancellations",
                    labels={"finished_reason": ("stop", "length", "cancelled")})
        reg.counter("request_failure_total", "Error final responses", labels={"code": m.ERROR_CODES})
        for name, desc in (("num_requests_running", "Sequences in the running batch"),
                           ("num_requests_waiting", "Admitted but not yet scheduled"),
                           ("kv_cache_usage_perc", "Fraction of MLA latent-cache pages in use"),
                           ("state_slots_usage_perc", "Fraction of KDA state slots in use"),
                           ("engine_healthy", "1 when the engine is healthy"),
                           ("workers_alive", "Live worker processes")):
            reg.gauge(name, desc)
        tok = m.token_buckets(self.max_model_len)
        for name, desc, buckets in (
                ("time_to_first_token_seconds", "Receipt to first data response", m.TTFT_BUCKETS),
                ("time_per_output_token_seconds", "Time per output token", m.TPOT_BUCKETS),
                ("e2e_request_latency_seconds", "Receipt to final response", m.E2E_BUCKETS),
                ("request_queue_time_seconds", "Receipt to first scheduling", m.TTFT_BUCKETS),
                ("request_prompt_tokens", "Prompt tokens per request", tok),
                ("request_generation_tokens", "Output tokens per request", tok)):
            reg.histogram(name, desc, buckets)
        reg.start()
        reg.set("engine_healthy", 1.0)
        reg.set("workers_alive", 1.0)
        return reg


def _is_cancelled(sender: Any) -> bool:
    try:
        return bool(sender.is_cancelled())
    except Exception:  # noqa: BLE001 - a sender whose request already completed
        return False


def _generation_eos(ckpt: Path) -> list[int]:
    """EOS ids from generation_config.json, joined to the config's ([STP-2])."""
    import json

    path = ckpt / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _check_instance_config(cfg: dict) -> None:
    """[CFG-L1]: one KIND_MODEL instance, decoupled, max_batch_size 1; a clear load error otherwise."""
    groups = cfg.get("instance_group") or []
    kinds = {g.get("kind") for g in groups}
    if kinds & {"KIND_GPU", "KIND_CPU"}:
        raise ValueError(f"{MODEL}: instance_group must be KIND_MODEL (one instance owns all its GPUs), got {kinds}")
    if sum(int(g.get("count", 1)) for g in groups) != 1:
        raise ValueError(f"{MODEL}: exactly one instance is supported, got instance_group {groups}")
    if not (cfg.get("model_transaction_policy") or {}).get("decoupled"):
        raise ValueError(f"{MODEL}: model_transaction_policy.decoupled must be true")
    if cfg.get("max_batch_size") != 1:
        raise ValueError(f"{MODEL}: max_batch_size must be 1, got {cfg.get('max_batch_size')}")
