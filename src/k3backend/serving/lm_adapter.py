"""Everything behind `k3_lm`'s TritonPythonModel (SERVING.md §4, §6, §8, §9).

The vllm_backend shape: `execute()` parses cheaply and hands each request to the engine
(`Engine.add`, which tokenizes on its own thread and owns the one request registry, stop ids
and tombstones); it never waits for generation ([CFG-L2]). Engine events become responses on
the output thread and are sent by one response thread, which is also the only thread that asks a
sender `is_cancelled()`, and never after that sender's final response: on 2.51 that call on a
finished request reads a freed response factory and crashes the server. A lifecycle thread
watches the server (shutdown, a dead parent) and the engine's health.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3backend.config import ConfigError
from k3backend.engine.config import EngineConfig
from k3backend.engine.engine import SHUTDOWN_ERROR, Engine
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.request import FinishReason, RequestOutput
from k3backend.errors import Cancelled, Internal, Unavailable
from k3backend.serving import guardian, lifecycle
from k3backend.serving import metrics as m
from k3backend.serving.params import (
    LmDefaults,
    ParsedRequest,
    generation_eos_ids,
    load_generation_defaults,
    parse_request,
)
from k3backend.serving.prompt import build_request
from k3backend.serving.responses import ResponseBuilder, error_message, stop_request_response
from k3backend.serving.triton_io import (
    ModelParams,
    data_response,
    error_response,
    input_getter,
    request_id,
    request_parameters,
    resolve_device_dtype,
    setup_logging,
)

log = logging.getLogger(__name__)

MODEL = "k3_lm"
PARAMETERS = {  # SERVING.md §4.4 with defaults
    "model_path": "", "tokenizer_path": "", "device": "auto", "dtype": "auto", "gpu_device_ids": "",
    "tensor_parallel_size": "1", "expert_parallel_size": "1", "dist_backend": "auto", "max_model_len": "131072",
    "max_num_seqs": "256", "max_num_batched_tokens": "8192", "gpu_memory_utilization": "0.90", "cpu_cache_gb": "4",
    "enable_prefix_caching": "true", "enforce_eager": "false", "exclude_input_in_output": "true", "default_max_tokens": "16",
    "default_thinking": "false", "max_prompt_bytes": "8388608", "max_queued_requests": "0",
    "cancellation_check_period_ms": "100", "allow_stop_by_request_id": "true", "stop_tombstone_ttl_s": "30",
    "startup_timeout_s": "3600", "shutdown_timeout_s": "20", "step_timeout_s": "300",
    "unload_on_engine_failure": "true", "stub_failure_action": "exit", "REPORT_CUSTOM_METRICS": "true",
    "metrics_prefix": "k3", "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
}
LIFECYCLE_PERIOD_S = 0.25  # gauges, server shutdown and engine-health checks


@dataclass(eq=False)
class _InFlight:
    """One request between execute() and its final response."""

    client_id: str
    sender: Any
    parsed: ParsedRequest
    key: str = ""  # the engine's id, once added
    builder: ResponseBuilder | None = None
    admitted: bool = False  # prompt metrics counted
    scheduled: bool = False  # queue time observed
    num_output_tokens: int = 0
    done: bool = False  # its final response is queued: later events are ignored
    first_sent: float | None = None  # monotonic time of the first data response
    last_token_ns: int = 0
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Send:
    """One response for the response thread; `state` is None for a request the engine never saw."""

    sender: Any
    state: _InFlight | None
    outputs: dict | None = None  # a data response's outputs, or
    error: tuple[str, str] | None = None  # (code, message) of an error response
    final: bool = True


class LmServer:
    """The k3_lm model instance: parameters, engine, threads, metrics. `close()` is idempotent."""

    def __init__(self, model_config: dict, pb_utils: Any, *, version: str = "1") -> None:
        self.pb = pb_utils
        setup_logging()
        _check_instance_config(model_config)
        p = ModelParams(model_config, PARAMETERS, MODEL)
        tp, ep = p.int("tensor_parallel_size", lo=1), p.int("expert_parallel_size", lo=1)
        if tp % ep:
            raise ConfigError(f"{MODEL}: expert_parallel_size {ep} must divide tensor_parallel_size {tp}")
        self.period_s = p.int("cancellation_check_period_ms", lo=1) / 1000
        self.shutdown_timeout_s = p.float("shutdown_timeout_s", lo=0)
        self.unload_on_failure = p.bool("unload_on_engine_failure")
        stub_failure_action = p.choice("stub_failure_action", guardian.ACTIONS)
        self.max_model_len = p.int("max_model_len", lo=1)
        device, dtype = resolve_device_dtype(p.choice("device", ("auto", "cpu", "cuda")),
                                             p.choice("dtype", ("auto", "bfloat16", "float32", "float16", "float64")),
                                             MODEL)
        ckpt = self._checkpoint(p.str("model_path"))
        tok_dir = Path(p.str("tokenizer_path")) if p.str("tokenizer_path") else ckpt
        t0 = time.monotonic()
        from k3backend.checkpoint import load_config
        from k3backend.tokenizer import Tokenizer

        cfg = load_config(ckpt)
        if device.type == "cpu" and cfg.text.hidden_size < 1024:
            torch.set_num_threads(1)  # toy models: one thread beats several fighting over small ops
        self.tokenizer = Tokenizer.from_dir(tok_dir)
        text = cfg.text
        gen = load_generation_defaults(ckpt)
        log.info("%s: sampling defaults from generation_config.json: %s", MODEL, gen or "none")  # [CFG-L4]
        self.defaults = LmDefaults(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            default_max_tokens=p.int("default_max_tokens", lo=1), exclude_input_in_output=p.bool("exclude_input_in_output"),
            default_thinking=p.bool("default_thinking"), max_prompt_bytes=p.int("max_prompt_bytes", lo=1),
            allow_stop_by_request_id=p.bool("allow_stop_by_request_id"), **gen)
        own = tuple(cfg.eos_token_id) or (self.tokenizer.eos_id,)
        self.eos_ids = tuple(dict.fromkeys(own + generation_eos_ids(ckpt)))
        engine_cfg = EngineConfig(
            max_num_seqs=p.int("max_num_seqs", lo=1), max_model_len=self.max_model_len,
            max_num_batched_tokens=p.int("max_num_batched_tokens", lo=1),
            max_queued_requests=p.int("max_queued_requests", lo=0), step_timeout_s=p.float("step_timeout_s", lo=0.001),
            stop_tombstone_ttl_s=p.float("stop_tombstone_ttl_s", lo=0),
            prefix_caching=p.bool("enable_prefix_caching"), enforce_eager=p.bool("enforce_eager"),
            gpu_memory_utilization=p.float("gpu_memory_utilization", lo=0.01, hi=1.0),
            cpu_cache_gb=p.float("cpu_cache_gb", lo=0.001))
        self.engine = Engine(self._executor(p, ckpt, engine_cfg, device, dtype, tp, ep), self.tokenizer, engine_cfg)
        try:
            self._warm_up()
        except BaseException:
            self.engine.close(timeout=5)
            raise
        log.info("%s: stub pid %d", MODEL, os.getpid())
        if isinstance(self.engine.executor, InProcessExecutor):
            log.info("%s: worker rank 0 pid %d device %s (in process)", MODEL, os.getpid(), device)  # [HLT-1]
        log.info("%s: loaded %s (%s) in %.1f s", MODEL, ckpt, dtype, time.monotonic() - t0)

        self.metrics = m.lm_metrics(pb_utils, p.bool("REPORT_CUSTOM_METRICS"), p.str("metrics_prefix"), MODEL,
                                    version, self.max_model_len)
        self._ppid = os.getppid()
        self.server = lifecycle.ServerWatch(self._ppid)
        lifecycle.watch_parent(MODEL)  # [HLT-10]: a server that died without finalize
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._send_q: queue.SimpleQueue[_Send | _InFlight | None] = queue.SimpleQueue()
        self._guardian_fd = guardian.spawn(MODEL, stub_failure_action)
        self._threads = [threading.Thread(target=self._respond_loop, name="k3-lm-respond", daemon=True),
                         threading.Thread(target=self._lifecycle_loop, name="k3-lm-lifecycle", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- Triton entry points ---------------------------------------------------------------

    def execute(self, requests: list) -> None:
        """Parse cheaply, answer stop requests, hand the rest to the engine; never waits for generation."""
        for request in requests:
            sender = request.get_response_sender()
            client_id = ""
            try:
                client_id = request_id(request)
                if self._closed.is_set():
                    raise Unavailable(SHUTDOWN_ERROR)
                if request.is_cancelled():  # [CAN-2]: cancelled while k3_vision ran
                    raise Cancelled("request cancelled by client")
                parsed = parse_request(input_getter(self.pb, request), request_parameters(request), client_id,
                                       self.defaults)
                if parsed.is_stop:
                    matched = self.engine.stop(client_id)
                    log.debug("%s: stop request %r matched %d request(s)", MODEL, client_id, matched)
                    self._send_q.put(_Send(sender, None, stop_request_response()))
                    continue
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
                self._send_q.put(_Send(sender, None, error=self._error(e, client_id)))
                continue
            state = _InFlight(client_id, sender, parsed)
            self._send_q.put(state)  # the response thread owns the sender from here on: before any send
            try:
                state.key = self.engine.add(client_id, lambda s=state: self._prepare(s),
                                            lambda ev, s=state: self._on_output(s, ev))
            except Exception as e:  # noqa: BLE001 - closing, failed or full
                self._send_q.put(_Send(sender, state, error=self._error(e, client_id)))

    def close(self) -> None:
        """[HLT-9]: stop admitting, end in-flight requests (UNAVAILABLE), join threads and the engine."""
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        start = time.monotonic()
        self.engine.close(timeout=self.shutdown_timeout_s)  # in-flight requests get their final events
        self._send_q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.metrics.close()
        guardian.say_goodbye(self._guardian_fd)
        # Python-backend objects (senders, responses) must die while the stub can still talk to
        # the server: left to the interpreter's teardown they crash the exiting stub (SIGSEGV).
        gc.collect()
        log.info("%s: finalized in %.1f s", MODEL, time.monotonic() - start)

    # ---- engine callbacks (admission and output threads) -----------------------------------

    def _prepare(self, state: _InFlight):
        """Admission thread: tokenize, render, expand images; the builder of its responses."""
        request, echo = build_request(state.parsed, self.tokenizer, eos_ids=self.eos_ids,
                                      max_model_len=self.max_model_len,
                                      default_max_tokens=self.defaults.default_max_tokens)
        state.builder = ResponseBuilder(state.parsed, echo, num_input_tokens=len(request.prompt_ids),
                                        tokenizer=self.tokenizer)
        return request

    def _on_output(self, state: _InFlight, ev: RequestOutput) -> None:
        """Output thread: one event -> at most one response, queued for the response thread.

        Whatever fails here ends the request at once: its final response is the error, the engine
        drops it, and its later events are ignored."""
        if state.done:
            return
        try:
            self._count_admission(state, ev)
            if ev.token_ids:
                self._count_tokens(state, ev)
            builder = state.builder or ResponseBuilder(state.parsed, "", tokenizer=self.tokenizer)
            outputs = builder.on_event(ev)  # raises ev.error: the request's error response
        except Exception as e:  # noqa: BLE001
            state.done = True
            if not ev.finished:  # a defect here: the engine still runs the request
                log.error("%s: building a response of request %r failed", MODEL, state.client_id, exc_info=e)
                e = Internal(f"response processing failed: {type(e).__name__}: {e}")
                self.engine.abort(state.key)
            self._send_q.put(_Send(state.sender, state, error=self._error(e, state.client_id)))
            return
        state.done = ev.finished
        if outputs is not None:
            if state.first_sent is None:
                state.first_sent = time.monotonic()
                self.metrics.observe("time_to_first_token_seconds", state.first_sent - state.arrival)
            self._send_q.put(_Send(state.sender, state, outputs, final=ev.finished))
        if ev.finished:
            self.metrics.inc("request_success_total", finished_reason=ev.finish_reason.value)
            self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - state.arrival)
            self.metrics.observe("request_generation_tokens", state.num_output_tokens)

    def _count_admission(self, state: _InFlight, ev: RequestOutput) -> None:
        """Prompt metrics once the engine admitted the request (its events carry the prompt length,
        [TOK-3]); the queue time once it was first scheduled."""
        if ev.num_input_tokens and not state.admitted:
            state.admitted = True
            self.metrics.inc("prompt_tokens_total", ev.num_input_tokens)
            self.metrics.observe("request_prompt_tokens", ev.num_input_tokens)
            if state.parsed.images is not None:
                self.metrics.inc("image_tokens_total", sum(state.parsed.images.token_counts))
        if ev.first_scheduled_time_ns and not state.scheduled:
            state.scheduled = True
            self.metrics.observe("request_queue_time_seconds",
                                 max(0.0, ev.first_scheduled_time_ns / 1e9 - state.parsed.arrival_time))

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

    def _error(self, exc: BaseException, client_id: str) -> tuple[str, str]:
        code, message = error_message(MODEL, exc, client_id)
        if code == "CANCELLED":  # a direct cancellation counts as a finished request (§9)
            self.metrics.inc("request_success_total", finished_reason="cancelled")
        else:
            self.metrics.inc("request_failure_total", code=code)
        return code, message

    # ---- the response thread ---------------------------------------------------------------

    def _respond_loop(self) -> None:
        """Sends every response and polls cancellation ([CAN-1]) for the senders it owns.

        `open` holds the requests whose final response has not been sent; a sender is asked
        `is_cancelled()` at most once per period, and never after its final response.
        """
        open_: dict[_InFlight, float] = {}  # request -> monotonic time of its last cancellation check
        while True:
            try:
                item = self._send_q.get(timeout=self.period_s)
            except queue.Empty:
                item = False
            if item is None:
                break
            if isinstance(item, _InFlight):
                open_[item] = time.monotonic()
            elif item:
                self._send(item)
                if item.final:
                    open_.pop(item.state, None)
                elif item.state in open_ and time.monotonic() - open_[item.state] >= self.period_s:
                    self._check_cancelled(item.state, open_)
            now = time.monotonic()
            for state in [s for s, t in open_.items() if now - t >= self.period_s]:
                self._check_cancelled(state, open_)

    def _send(self, item: _Send) -> None:
        if item.error is not None:
            response = error_response(self.pb, *item.error)
        else:
            response = data_response(self.pb, item.outputs)
        try:
            item.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if item.final else 0)
        except Exception:  # noqa: BLE001 - a vanished client must not stop other responses
            log.exception("%s: sending a response of request %r failed", MODEL,
                          item.state.client_id if item.state else "")

    def _check_cancelled(self, state: _InFlight, open_: dict[_InFlight, float]) -> None:
        open_[state] = time.monotonic()
        try:
            cancelled = state.sender.is_cancelled()
        except Exception:  # noqa: BLE001
            cancelled = False
        if cancelled and state.key:
            open_[state] = float("inf")  # aborted: its final response is on its way; ask no more
            self.engine.abort(state.key)

    # ---- the lifecycle thread --------------------------------------------------------------

    def _lifecycle_loop(self) -> None:
        """Gauges; the server's shutdown ([HLT-9]); engine failure ([HLT-5])."""
        reported_failure = False
        gauges: dict[str, float] = {}
        warm = self.engine.stats()  # the warm-up request is not traffic
        totals = {"num_preemptions_total": warm.num_preemptions, "prefix_cache_queries_total": warm.prefix_cache_queries,
                  "prefix_cache_hits_total": warm.prefix_cache_hits}
        while not self._closed.wait(LIFECYCLE_PERIOD_S):
            if self.server.shutting_down():
                self._drain_and_close()
                return
            stats = self.engine.stats()
            for name, value in (("num_requests_running", stats.num_running),
                                ("num_requests_waiting", stats.num_waiting),
                                ("kv_cache_usage_perc", stats.kv_cache_usage),
                                ("state_slots_usage_perc", stats.state_slots_usage),
                                ("engine_healthy", float(stats.healthy)), ("workers_alive", stats.workers_alive)):
                if gauges.get(name) != value:
                    gauges[name] = value
                    self.metrics.set(name, value)
            for name, value in (("num_preemptions_total", stats.num_preemptions),
                                ("prefix_cache_queries_total", stats.prefix_cache_queries),
                                ("prefix_cache_hits_total", stats.prefix_cache_hits)):
                if value > totals[name]:
                    self.metrics.inc(name, value - totals[name])
                    totals[name] = value
            if not stats.healthy and not reported_failure:
                reported_failure = True
                log.error("%s: engine failed: %s", MODEL, stats.unhealthy_reason)
                if self.unload_on_failure:
                    self._self_unload()

    def _drain_and_close(self) -> None:
        """The server is shutting down: in-flight requests may finish until shortly before Triton's
        exit timeout; the rest get UNAVAILABLE in time for Triton to unload the models cleanly."""
        exit_timeout = self.server.exit_timeout_s
        drain = lifecycle.drain_seconds(exit_timeout)
        stats = self.engine.stats()
        log.info("%s: server is shutting down (exit timeout %.0f s): %d request(s) in flight may finish "
                 "within %.0f s, the rest get UNAVAILABLE", MODEL, exit_timeout,
                 stats.num_running + stats.num_waiting, drain)
        guardian.watch_shutdown(self._guardian_fd, exit_timeout + lifecycle.EXIT_GRACE_S)
        self.engine.close(timeout=self.shutdown_timeout_s, drain_s=drain)

    def _self_unload(self) -> None:
        """[HLT-5] item 2: in explicit model-control mode, unload k3_lm and its dependents.

        Only there: in other modes the call fails, and 2.51's stub can crash reading that error.
        """
        if not self.server.explicit:
            log.warning("%s: not in explicit model-control mode: readiness cannot be flipped on 2.51; "
                        "engine_healthy=0 and UNAVAILABLE errors report the failure", MODEL)
            return
        try:
            self.pb.unload_model(MODEL, unload_dependents=True)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not unload after the engine failure (%s); engine_healthy=0 reports it", MODEL, e)

    # ---- load helpers ----------------------------------------------------------------------

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
    def _executor(p: ModelParams, ckpt: Path, cfg: EngineConfig, device: torch.device, dtype: torch.dtype, tp: int,
                  ep: int):
        """Worker processes (one per rank) on GPUs and for TP > 1 ([HLT-1]); the engine in this
        process only for one CPU rank (tests, laptops)."""
        from k3backend.engine.runner import InProcessExecutor
        from k3backend.engine.workers import MultiProcessExecutor

        if device.type == "cpu" and tp == 1:
            return InProcessExecutor.load(ckpt, cfg, dtype=dtype, device=device)
        gpus = None
        if device.type == "cuda":
            listed = [g.strip() for g in p.str("gpu_device_ids").split(",") if g.strip()]
            gpus = [int(g) for g in listed] if listed else list(range(tp))
            if len(gpus) != tp or len(set(gpus)) != tp or min(gpus) < 0 or max(gpus) >= torch.cuda.device_count():
                raise ConfigError(f"{MODEL}: gpu_device_ids {p.str('gpu_device_ids')!r}: expected {tp} distinct "
                                  f"GPU ids below {torch.cuda.device_count()} (tensor_parallel_size {tp})")
        backend = p.choice("dist_backend", ("auto", "nccl", "gloo"))
        if backend == "nccl" and gpus is None:
            raise ConfigError(f"{MODEL}: dist_backend nccl needs GPUs (device is cpu)")
        return MultiProcessExecutor(str(ckpt), cfg, dtype=str(dtype).removeprefix("torch."), gpus=gpus, world_size=tp,
                                    ep_size=ep, backend=backend, startup_timeout_s=p.float("startup_timeout_s", lo=1),
                                    step_timeout_s=cfg.step_timeout_s)

    @staticmethod
    def _checkpoint(model_path: str) -> Path:
        if model_path:
            path = Path(model_path)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{MODEL}: model_path {path} has no config.json")
            return path
        from k3backend.presets import ensure_default_checkpoint

        return ensure_default_checkpoint()


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
