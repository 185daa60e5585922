"""Everything behind `k3_lm`'s TritonPythonModel (SERVING.md §4, §6, §8, §9; ENGINE.md §8).

The engine runs in a process of its own (`engine.client.EngineClient`); this stub only turns
requests into token ids and token ids into responses, with a fixed number of threads whatever
the load:
- Triton's `execute()` answers stop requests and queues the others with their senders, then
  returns ([CFG-L2]): Triton hands it one request per call, a round trip to the server each, so
  nothing else waits on it;
- the prepare thread, in arrival order, parses, registers one `RequestStream` per request,
  tokenizes and renders, then hands the request to the engine;
- the response thread (`serving.responder`) reads the engine's per-step messages and sends the
  responses, and is the only thread that touches a sender;
- the lifecycle thread: gauges, the server's shutdown ([HLT-9]), engine health ([HLT-5], [HLT-7]).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from k3backend.config import ConfigError
from k3backend.engine.client import EngineClient
from k3backend.engine.config import EngineConfig
from k3backend.engine.core_process import CoreSpec
from k3backend.engine.outputs import EngineStats, StepOutputs
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.sampling_params import SamplingParams
from k3backend.errors import Cancelled, Internal, Unavailable
from k3backend.serving import guardian, lifecycle
from k3backend.serving import metrics as m
from k3backend.serving.params import (LmDefaults, generation_eos_ids, is_stop, load_generation_defaults,
                                      parse_request)
from k3backend.serving.registry import SHUTDOWN_ERROR, Registry
from k3backend.serving.responder import Responder
from k3backend.serving.responses import stop_request_response
from k3backend.serving.stream import Cancel, RequestStream
from k3backend.serving.triton_io import (
    ModelParams,
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
    "tensor_parallel_size": "1", "expert_parallel_size": "1", "dist_backend": "auto", "nnodes": "1", "node_rank": "0",
    "master_addr": "", "master_port": "29500", "dist_timeout_s": "300", "parallel_placement": "tp",
    "max_model_len": "131072",
    "max_num_seqs": "256", "max_num_batched_tokens": "8192", "gpu_memory_utilization": "0.90", "cpu_cache_gb": "4",
    "enable_prefix_caching": "true", "enforce_eager": "false", "async_scheduling": "true", "decode_stall_ms": "40",
    "max_prefill_delay_ms": "0",
    "exclude_input_in_output": "true", "default_max_tokens": "16",
    "default_thinking": "false", "max_prompt_bytes": "8388608", "max_queued_requests": "0",
    "cancellation_check_period_ms": "100", "allow_stop_by_request_id": "true", "stop_tombstone_ttl_s": "30",
    "startup_timeout_s": "3600", "shutdown_timeout_s": "20", "step_timeout_s": "300",
    "unload_on_engine_failure": "true", "stub_failure_action": "exit", "REPORT_CUSTOM_METRICS": "true",
    "metrics_prefix": "k3", "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
}
LIFECYCLE_PERIOD_S = 0.25  # gauges, server shutdown and engine-health checks
WARMUP_TIMEOUT_S = 600.0


class LmServer:
    """The k3_lm model instance: parameters, engine client, threads, metrics. `close()` is idempotent."""

    def __init__(self, model_config: dict, pb_utils: Any, *, version: str = "1") -> None:
        self.pb = pb_utils
        setup_logging()
        # The stub process is this instance's alone. With Python's 5 ms GIL switch interval, the response
        # thread waits up to 5 ms after each Triton send while the prepare thread renders a burst of arrivals;
        # at 0.2 ms, served at 256 streams on the H200, TTFT p50 was 243-269 ms against 291-316 (three runs of
        # each on two machines, bench/serving_load.py); throughput and 64 streams were unchanged within noise.
        sys.setswitchinterval(2e-4)
        _check_instance_config(model_config)
        p = ModelParams(model_config, PARAMETERS, MODEL)
        tp, ep = p.int("tensor_parallel_size", lo=1), p.int("expert_parallel_size", lo=1)
        if tp % ep:
            raise ConfigError(f"{MODEL}: expert_parallel_size {ep} must divide tensor_parallel_size {tp}")
        self.period_s = p.int("cancellation_check_period_ms", lo=1) / 1000
        self.shutdown_timeout_s = p.float("shutdown_timeout_s", lo=0)
        self.step_timeout_s = p.float("step_timeout_s", lo=0.001)
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
        from k3backend.tokenizer import Tokenizer, check_tokenizer_matches

        cfg = load_config(ckpt)
        self.tokenizer = Tokenizer.from_dir(tok_dir)
        check_tokenizer_matches(cfg, self.tokenizer)  # every id the model samples must detokenize
        text = cfg.text
        gen = load_generation_defaults(ckpt)
        log.info("%s: sampling defaults from generation_config.json: %s", MODEL, gen or "none")  # [CFG-L4]
        self.defaults = LmDefaults(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            default_max_tokens=p.int("default_max_tokens", lo=1), exclude_input_in_output=p.bool("exclude_input_in_output"),
            default_thinking=p.bool("default_thinking"), max_prompt_bytes=p.int("max_prompt_bytes", lo=1),
            allow_stop_by_request_id=p.bool("allow_stop_by_request_id"),
            has_vision=cfg.vision is not None, model_type=cfg.model_type, **gen)
        own = tuple(cfg.eos_token_id) or (self.tokenizer.eos_id,)
        self.eos_ids = tuple(dict.fromkeys(own + generation_eos_ids(ckpt)))
        engine_cfg = EngineConfig(
            max_num_seqs=p.int("max_num_seqs", lo=1), max_model_len=self.max_model_len,
            max_num_batched_tokens=p.int("max_num_batched_tokens", lo=1),
            step_timeout_s=self.step_timeout_s, prefix_caching=p.bool("enable_prefix_caching"),
            enforce_eager=p.bool("enforce_eager"), async_scheduling=p.bool("async_scheduling"),
            decode_stall_ms=p.float("decode_stall_ms", lo=0.0),
            max_prefill_delay_ms=p.float("max_prefill_delay_ms", lo=0.0),
            gpu_memory_utilization=p.float("gpu_memory_utilization", lo=0.01, hi=1.0),
            cpu_cache_gb=p.float("cpu_cache_gb", lo=0.001))
        self.engine = EngineClient(self._core_spec(p, ckpt, engine_cfg, device, dtype, tp, ep))
        try:
            warm_stats = self._warm_up()
        except BaseException:
            self.engine.close(timeout=5)
            raise
        log.info("%s: stub pid %d, engine core pid %d", MODEL, os.getpid(), self.engine.ready.pid)
        log.info("%s: loaded %s (%s) in %.1f s", MODEL, ckpt, dtype, time.monotonic() - t0)

        self.metrics = m.lm_metrics(pb_utils, p.bool("REPORT_CUSTOM_METRICS"), p.str("metrics_prefix"), MODEL,
                                    version, self.max_model_len)
        self.registry = Registry(p.float("stop_tombstone_ttl_s", lo=0), p.int("max_queued_requests", lo=0))
        self._ppid = os.getppid()
        self.server = lifecycle.ServerWatch(self._ppid)
        lifecycle.watch_parent(MODEL)  # [HLT-10]: a server that died without finalize
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._prepare_q: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()  # (request, sender, receipt times)
        self._accepting, self._accepting_lock = True, threading.Lock()  # the prepare thread takes requests
        self._guardian_fd = guardian.spawn(MODEL, stub_failure_action)
        self.responder = Responder(pb_utils, self.engine, self.registry, self.metrics, self.period_s, warm_stats)
        self._preparer = threading.Thread(target=self._prepare_loop, name="k3-lm-prepare", daemon=True)
        self._threads = [self._preparer,
                         threading.Thread(target=self._lifecycle_loop, name="k3-lm-lifecycle", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- Triton entry points ---------------------------------------------------------------

    def execute(self, requests: list) -> None:
        """Hand each request to the prepare thread, which parses it there: Triton gives this thread one
        request per call, so each call is a round trip to the server and parsing here would add to it.
        Stop requests are answered here, so that they never wait behind other requests' tokenization
        ([CAN-5]); one whose target is still queued leaves a tombstone, which ends it when it opens."""
        self.server.confirm_live()
        for request in requests:
            sender = request.get_response_sender()
            received = time.time(), time.monotonic()  # receipt: the request's arrival in metrics
            with self._accepting_lock:  # the prepare thread takes whatever is queued before it stops
                if self._accepting and not self._stop(request):
                    self._prepare_q.put((request, sender, *received))
                    continue
            self._open(request, sender, *received)  # a stop, or shutting down: answered at once

    def _stop(self, request: Any) -> bool:
        try:
            return is_stop(input_getter(request))
        except Exception:  # noqa: BLE001 - a malformed stop flag: _open answers the error at once
            return True

    def close(self) -> None:
        """[HLT-9]: stop admitting, end in-flight requests (UNAVAILABLE), join threads and the engine."""
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        start = time.monotonic()
        self._shut_down(drain_s=0.0)
        self.metrics.close()
        guardian.say_goodbye(self._guardian_fd)
        # Python-backend objects (senders, responses) must die while the stub can still talk to
        # the server: left to the interpreter's teardown they crash the exiting stub (SIGSEGV).
        gc.collect()
        log.info("%s: finalized in %.1f s", MODEL, time.monotonic() - start)

    def _shut_down(self, drain_s: float) -> None:
        """Refuse new requests, let those in flight run up to `drain_s`, end the rest with
        UNAVAILABLE, then stop the threads and the engine core. Safe to call twice."""
        with self.registry.lock:
            first = not self.registry.closing
            self.registry.closing = True
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and len(self.registry):
            time.sleep(0.05)
        if not first:
            return
        with self._accepting_lock:  # execute() answers from now on; the prepare thread ends what is queued
            self._accepting = False
            self._prepare_q.put(None)
        self.responder.put(("shutdown",), None)
        if not self.responder.join(timeout=5):
            log.warning("%s: responses are still being sent 5 s into the shutdown; the HTTP endpoint is held "
                        "until the last one is", MODEL)
        threading.Thread(target=self._release_when_sent, name="k3-lm-release", daemon=True).start()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5 if t.name != "k3-lm-lifecycle" else 0.5)
        self.engine.close(timeout=self.shutdown_timeout_s, reader_gone=lambda: not self.responder.alive)

    def _release_when_sent(self) -> None:
        """Let the HTTP endpoint stop once the last response is sent (one that reaches a stopped endpoint
        crashes 2.51): the response thread's, and the prepare thread's for requests still queued, which
        it answers itself once the response thread ended. A send stuck for ever keeps the endpoint until
        the exit timeout, which ends the server without a crash."""
        self.responder.join(timeout=None)
        self._preparer.join()  # it ends at the None that _shut_down queued
        while not self.responder.quiet():  # execute() answering a late arrival
            time.sleep(0.01)
        self.server.release(self.responder.last_send)

    # ---- the prepare thread ----------------------------------------------------------------

    def _prepare_loop(self) -> None:
        """Parse, tokenize and render each request in arrival order, then hand it to the engine (or end
        it here). A defect with one request ends that request with INTERNAL, never this thread: every
        request queued behind it would wait for ever."""
        while (item := self._prepare_q.get()) is not None:
            stream = None
            try:
                stream = self._open(*item)
                if stream is not None:
                    self._admit(stream)
            except Exception as e:  # noqa: BLE001
                log.exception("%s: preparing a request failed; it ends with INTERNAL", MODEL)
                if stream is not None:
                    self.responder.put(("fail", stream, Internal(f"preparing the request failed: "
                                                                 f"{type(e).__name__}: {e}")))

    def _admit(self, stream: RequestStream) -> None:
        """Tokenize and render an opened request, then hand it to the engine (or end it)."""
        try:
            request = stream.prepare(eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                                     default_max_tokens=self.defaults.default_max_tokens)
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
            self.responder.put(("fail", stream, e))
            return
        with self.registry.lock:  # a stop or cancel either lands before this or finds the engine id
            if stream.cancel is not None:
                self.responder.put(("cancel", stream, stream.cancel))
            elif self.registry.closing or self.registry.failure is not None:
                why = SHUTDOWN_ERROR if self.registry.closing else f"engine failed: {self.registry.failure}"
                self.responder.put(("fail", stream, Unavailable(why)))
            else:
                self.registry.bind(stream, self.engine.add(request))

    def _open(self, request: Any, sender: Any, received: float, received_mono: float) -> RequestStream | None:
        """Parse one request: a stop is answered, a generation request gets its stream (registered, and
        handed to the response thread, which owns the sender from then on); None when it has ended.
        received / received_mono: when execute() got it (wall clock / monotonic), its arrival in metrics."""
        client_id, stream, items = "", None, []
        try:
            client_id = request_id(request)
            if self._closed.is_set() or self.registry.closing:
                raise Unavailable(SHUTDOWN_ERROR)
            if request.is_cancelled():  # [CAN-2]: cancelled while k3_vision ran or while queued here
                raise Cancelled("request cancelled by client")
            parsed = replace(parse_request(input_getter(request), request_parameters(request), client_id,
                                           self.defaults), arrival_time=received)
            if parsed.is_stop:
                matched = self.registry.stop(client_id)
                for s in matched:
                    self.engine.abort(s.rid)
                log.debug("%s: stop request %r matched %d running request(s)", MODEL, client_id, len(matched))
                items = [("send", sender, client_id, stop_request_response(), None)]
            else:
                stream = RequestStream(client_id, sender, parsed, self.tokenizer, arrival=received_mono)
                live = self.registry.open(stream)
                # the response thread owns the sender from "open" on; a live tombstone cancels it ([CAN-7])
                items = [("open", stream)] + ([] if live else [("cancel", stream, Cancel.STOP)])
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
            stream, items = None, [("send", sender, client_id, None, e)]
        if self.responder.put(*items):
            return stream if stream is not None and len(items) == 1 else None
        if items[0][0] == "send":  # the response thread has ended: this sender is nobody else's
            self.responder.send(*items[0][1:], final=True)
        else:
            self.registry.forget(stream)
            self.responder.send(sender, client_id, None, Unavailable(SHUTDOWN_ERROR), final=True)
        return None

    # ---- the lifecycle thread --------------------------------------------------------------

    def _lifecycle_loop(self) -> None:
        """Gauges; the server's shutdown ([HLT-9]); engine failure ([HLT-5]) and a stuck step ([HLT-7])."""
        reported_failure = False
        gauges: dict[str, float] = {}
        warm = self.responder.stats  # the warm-up request is not traffic
        totals = {"num_preemptions_total": warm.num_preemptions, "prefix_cache_queries_total": warm.prefix_cache_queries,
                  "prefix_cache_hits_total": warm.prefix_cache_hits}
        progress, since = self.responder.steps_seen, time.monotonic()
        while not self._closed.wait(LIFECYCLE_PERIOD_S):
            if self.server.shutting_down():
                self._drain_and_close()
                return
            stats, failure = self.responder.stats, self.registry.failure
            in_flight = self.registry.engine_in_flight()
            now = time.monotonic()
            if not in_flight or self.responder.steps_seen != progress:
                progress, since = self.responder.steps_seen, now
            elif now - since > self.step_timeout_s and failure is None:
                self.engine.kill(f"engine step made no progress for {now - since:.0f} s "
                                 f"(step_timeout_s {self.step_timeout_s:g})")
            healthy = failure is None and self.engine.failure is None
            for name, value in (("num_requests_running", stats.num_running),
                                ("num_requests_waiting", stats.num_waiting + self.registry.num_preparing()),
                                ("kv_cache_usage_perc", stats.kv_cache_usage),
                                ("state_slots_usage_perc", stats.state_slots_usage),
                                ("engine_healthy", float(healthy)),
                                ("workers_alive", stats.workers_alive if healthy else 0)):
                if gauges.get(name) != value:
                    gauges[name] = value
                    self.metrics.set(name, value)
            for name, value in (("num_preemptions_total", stats.num_preemptions),
                                ("prefix_cache_queries_total", stats.prefix_cache_queries),
                                ("prefix_cache_hits_total", stats.prefix_cache_hits)):
                if value > totals[name]:
                    self.metrics.inc(name, value - totals[name])
                    totals[name] = value
            if not healthy and not reported_failure and failure is not None:
                reported_failure = True
                if self.unload_on_failure:
                    self._self_unload()

    def _drain_and_close(self) -> None:
        """The server is shutting down: in-flight requests may finish until shortly before Triton's
        exit timeout; the rest get UNAVAILABLE in time for Triton to unload the models cleanly."""
        exit_timeout = self.server.exit_timeout_s
        drain = lifecycle.drain_seconds(exit_timeout)
        log.info("%s: server is shutting down (exit timeout %.0f s): %d request(s) in flight may finish "
                 "within %.0f s, the rest get UNAVAILABLE", MODEL, exit_timeout, len(self.registry), drain)
        guardian.watch_shutdown(self._guardian_fd, exit_timeout + lifecycle.EXIT_GRACE_S)
        self._shut_down(drain_s=drain)

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

    def _warm_up(self) -> EngineStats:
        """One prefill and one decode through the engine core before the model reports ready ([HLT-1]);
        returns the engine's stats after it (the warm-up is not traffic)."""
        ids = self.tokenizer.encode("warm up", allow_special=False)
        rid = self.engine.add(Request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            wait([self.engine], 1.0)
            for message in self.engine.receive():
                if message[0] == "failed":
                    raise RuntimeError(f"{MODEL}: warm-up failed: {message[1]}")
                out: StepOutputs = message[1]
                for i in (out.ids == rid).nonzero()[0]:
                    if out.finish[i] == FinishReason.ERROR:
                        raise RuntimeError(f"{MODEL}: warm-up failed: {out.errors.get(rid)}")
                    if out.finish[i] != FinishReason.NONE:
                        return out.stats
        raise RuntimeError(f"{MODEL}: warm-up did not finish within {WARMUP_TIMEOUT_S:g} s")

    @staticmethod
    def _core_spec(p: ModelParams, ckpt: Path, cfg: EngineConfig, device: torch.device, dtype: torch.dtype, tp: int,
                   ep: int) -> CoreSpec:
        """The engine core's process: rank 0 itself for one rank, the coordinator of worker
        processes (one per rank) for several ([HLT-1])."""
        from k3backend.engine.nodes import NodePlan
        from k3backend.engine.workers import PLACEMENTS, check_placement, visible_gpu

        nodes = NodePlan(p.int("nnodes", lo=1), p.str("master_addr"), p.int("master_port", lo=1, hi=65535),
                         p.float("dist_timeout_s", lo=0.001))
        node_rank = p.int("node_rank", lo=0)
        placement = p.choice("parallel_placement", PLACEMENTS)
        try:
            nodes.check(tp, node_rank)
            check_placement(placement, tp, ep, nodes.nnodes)
        except ValueError as e:
            raise ConfigError(f"{MODEL}: {e}") from None
        if node_rank != 0:
            raise ConfigError(f"{MODEL}: node_rank {node_rank}: the Triton host is node 0; the other hosts run "
                              "`python -m k3backend worker --node-rank R ...`")
        local = tp // nodes.nnodes  # ranks on this host
        gpus = None
        if device.type == "cuda":
            listed = [g.strip() for g in p.str("gpu_device_ids").split(",") if g.strip()]
            gpus = [int(g) for g in listed] if listed else list(range(local))
            if (len(gpus) != local or len(set(gpus)) != local or min(gpus) < 0
                    or max(gpus) >= torch.cuda.device_count()):
                raise ConfigError(f"{MODEL}: gpu_device_ids {p.str('gpu_device_ids')!r}: expected {local} distinct "
                                  f"GPU ids below {torch.cuda.device_count()} (tensor_parallel_size {tp}, "
                                  f"nnodes {nodes.nnodes})")
        backend = p.choice("dist_backend", ("auto", "nccl", "gloo"))
        if backend == "nccl" and gpus is None:
            raise ConfigError(f"{MODEL}: dist_backend nccl needs GPUs (device is cpu)")
        return CoreSpec(str(ckpt), cfg, str(dtype).removeprefix("torch."), device.type, tp, ep,
                        gpus=tuple(gpus) if gpus is not None else None,
                        gpu=visible_gpu(gpus[0]) if gpus is not None and tp == 1 else None, dist_backend=backend,
                        startup_timeout_s=p.float("startup_timeout_s", lo=1), step_timeout_s=cfg.step_timeout_s,
                        log_prefix=MODEL, nodes=nodes if nodes.nnodes > 1 else None, placement=placement)

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
