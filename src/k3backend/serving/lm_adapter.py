"""Everything behind `k3_lm`'s TritonPythonModel (SERVING.md §4, §6, §8, §9; ENGINE.md §8).

The engine runs in a process of its own (`engine.client.EngineClient`); this stub only turns
requests into token ids and token ids into responses, with a fixed number of threads whatever
the load:
- Triton's `execute()` parses cheaply, answers stop requests, registers one `RequestStream` per
  request and returns at once ([CFG-L2]);
- the prepare thread tokenizes and renders, then hands the request to the engine;
- the response thread reads the engine's per-step messages, detokenizes, builds at most one
  response per request per batch of steps (so a request whose sends fall behind gets its
  pending tokens in one response), sends, and polls cancellation. It is the only thread that
  touches a sender, and never after its final response: on 2.51 `is_cancelled()` on a finished
  request reads a freed response factory and crashes the server;
- the lifecycle thread: gauges, the server's shutdown ([HLT-9]), engine health ([HLT-5], [HLT-7]).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
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
from k3backend.serving.params import LmDefaults, generation_eos_ids, load_generation_defaults, parse_request
from k3backend.serving.registry import SHUTDOWN_ERROR, Registry
from k3backend.serving.responses import error_message, stop_request_response
from k3backend.serving.stream import Cancel, RequestStream
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
WARMUP_TIMEOUT_S = 600.0
MAX_POLLS_PER_S = 1000  # is_cancelled() calls per second, all requests together


class _Inbox:
    """The response thread's queue of local work, with a descriptor that wakes its `wait()`."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def put(self, item: Any) -> None:
        self._q.put(item)
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # already signalled

    def drain(self) -> list:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        items = []
        while True:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                return items


class LmServer:
    """The k3_lm model instance: parameters, engine client, threads, metrics. `close()` is idempotent."""

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
            enforce_eager=p.bool("enforce_eager"), gpu_memory_utilization=p.float("gpu_memory_utilization", lo=0.01, hi=1.0),
            cpu_cache_gb=p.float("cpu_cache_gb", lo=0.001))
        self.engine = EngineClient(self._core_spec(p, ckpt, engine_cfg, device, dtype, tp, ep))
        try:
            self._warm_up()
        except BaseException:
            self.engine.close(timeout=5)
            raise
        log.info("%s: stub pid %d, engine core pid %d", MODEL, os.getpid(), self.engine.ready.pid)
        log.info("%s: loaded %s (%s) in %.1f s", MODEL, ckpt, dtype, time.monotonic() - t0)

        self.metrics = m.lm_metrics(pb_utils, p.bool("REPORT_CUSTOM_METRICS"), p.str("metrics_prefix"), MODEL,
                                    version, self.max_model_len)
        self.registry = Registry(p.float("stop_tombstone_ttl_s", lo=0), p.int("max_queued_requests", lo=0))
        self._stats = EngineStats(workers_alive=self.engine.ready.workers_alive)
        self._steps_seen = 0  # engine messages read: the step watchdog's progress count
        self._ppid = os.getppid()
        self.server = lifecycle.ServerWatch(self._ppid)
        lifecycle.watch_parent(MODEL)  # [HLT-10]: a server that died without finalize
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._prepare_q: queue.SimpleQueue[RequestStream | None] = queue.SimpleQueue()
        self._inbox = _Inbox()
        self._responding = threading.Lock()  # the response thread's last drain vs execute()
        self._responder_alive = True
        self._guardian_fd = guardian.spawn(MODEL, stub_failure_action)
        self._threads = [threading.Thread(target=self._prepare_loop, name="k3-lm-prepare", daemon=True),
                         threading.Thread(target=self._respond_loop, name="k3-lm-respond", daemon=True),
                         threading.Thread(target=self._lifecycle_loop, name="k3-lm-lifecycle", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- Triton entry points ---------------------------------------------------------------

    def execute(self, requests: list) -> None:
        """Parse cheaply, answer stop requests, register the rest; never waits for generation."""
        for request in requests:
            sender = request.get_response_sender()
            client_id, stream, items = "", None, []
            try:
                client_id = request_id(request)
                if self._closed.is_set():
                    raise Unavailable(SHUTDOWN_ERROR)
                if request.is_cancelled():  # [CAN-2]: cancelled while k3_vision ran
                    raise Cancelled("request cancelled by client")
                parsed = parse_request(input_getter(self.pb, request), request_parameters(request), client_id,
                                       self.defaults)
                if parsed.is_stop:
                    matched = self.registry.stop(client_id)
                    for s in matched:
                        self.engine.abort(s.rid)
                    log.debug("%s: stop request %r matched %d running request(s)", MODEL, client_id, len(matched))
                    items = [("send", sender, client_id, stop_request_response(), None)]
                else:
                    stream = RequestStream(client_id, sender, parsed, self.tokenizer)
                    live = self.registry.open(stream)
                    # the response thread owns the sender from "open" on; a live tombstone cancels it ([CAN-7])
                    items = [("open", stream)] + ([] if live else [("cancel", stream, Cancel.STOP)])
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
                stream, items = None, [("send", sender, client_id, None, e)]
            with self._responding:
                if self._responder_alive:
                    for item in items:
                        self._inbox.put(item)
                    if stream is not None and len(items) == 1:
                        self._prepare_q.put(stream)
                    continue
            # after close(), no response thread: this sender is nobody else's
            if items[0][0] == "send":
                self._send(*items[0][1:], final=True)
            else:
                self.registry.forget(stream)
                self._send(sender, client_id, None, Unavailable(SHUTDOWN_ERROR), final=True)

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
        self._inbox.put(("shutdown",))
        self._prepare_q.put(None)
        self._inbox.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5 if t.name != "k3-lm-lifecycle" else 0.5)
        self.engine.close(timeout=self.shutdown_timeout_s)

    # ---- the prepare thread ----------------------------------------------------------------

    def _prepare_loop(self) -> None:
        """Tokenize and render each request, then hand it to the engine (or end it here)."""
        while (stream := self._prepare_q.get()) is not None:
            try:
                request = stream.prepare(eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                                         default_max_tokens=self.defaults.default_max_tokens)
            except Exception as e:  # noqa: BLE001 - every failure becomes this request's error response
                self._inbox.put(("fail", stream, e))
                continue
            with self.registry.lock:  # a stop or cancel either lands before this or finds the engine id
                if stream.cancel is not None:
                    self._inbox.put(("cancel", stream, stream.cancel))
                elif self.registry.closing or self.registry.failure is not None:
                    why = SHUTDOWN_ERROR if self.registry.closing else f"engine failed: {self.registry.failure}"
                    self._inbox.put(("fail", stream, Unavailable(why)))
                else:
                    self.registry.bind(stream, self.engine.add(request))

    # ---- the response thread ---------------------------------------------------------------

    def _respond_loop(self) -> None:
        """See the module docstring; `open_` holds the streams whose final response is not sent yet."""
        open_: dict[RequestStream, None] = {}
        stopping = False
        while not (stopping and not open_):
            wait([self._inbox, self.engine] if self.engine.readable else [self._inbox], self.period_s)
            touched: dict[RequestStream, None] = {}
            for item in self._inbox.drain():
                stopping = stopping or item is None
                if item is not None:
                    self._local(item, open_, touched)
            for message in self.engine.receive():
                self._engine_message(message, open_, touched)
            for stream in touched:
                self._respond(stream, open_)
            self._poll_cancellations(open_)
            if stopping and open_:  # after "shutdown" everything left is ended; do not wait for more
                for stream in list(open_):
                    stream.fail(Unavailable(SHUTDOWN_ERROR))
                    self._respond(stream, open_)
        with self._responding:  # what execute() queued meanwhile is answered here; later calls answer it there
            self._responder_alive = False
            touched: dict[RequestStream, None] = {}
            for item in self._inbox.drain():
                if item is not None:
                    self._local(item, open_, touched)
            for stream in list(open_):
                stream.fail(Unavailable(SHUTDOWN_ERROR))
                self._respond(stream, open_)

    def _local(self, item: tuple, open_: dict, touched: dict) -> None:
        kind = item[0]
        if kind == "open":
            open_[item[1]] = None
            item[1].last_poll = time.monotonic()
        elif kind == "send":  # a request that never got a stream: its one (final) response
            _, sender, client_id, outputs, error = item
            self._send(sender, client_id, outputs, error, final=True)
        elif kind == "fail":
            item[1].fail(item[2])
            touched[item[1]] = None
        elif kind == "cancel":
            item[1].cancel_now(item[2])
            touched[item[1]] = None
        elif kind == "shutdown":
            for stream in open_:
                stream.fail(Unavailable(SHUTDOWN_ERROR))
                touched[stream] = None

    def _engine_message(self, message: tuple, open_: dict, touched: dict) -> None:
        self._steps_seen += 1
        if message[0] == "failed":
            with self.registry.lock:
                self.registry.failure = message[1]
            log.error("%s: engine failed: %s", MODEL, message[1])
            for stream in open_:
                stream.fail(Unavailable(f"engine failed: {message[1]}"))
                touched[stream] = None
            return
        out: StepOutputs = message[1]
        self._stats = out.stats
        for rid, cached in zip(out.started.tolist(), out.cached.tolist()):
            stream = self.registry.by_rid(rid)
            if stream is not None and not stream.done:
                stream.on_started(out.time_ns, cached)
                self._count_admission(stream, out.time_ns)
        generated = 0
        for rid, token, finish in zip(out.ids.tolist(), out.tokens.tolist(), out.finish.tolist()):
            stream = self.registry.by_rid(rid)
            if stream is None or stream.done:
                continue  # ended here already (a stop string, a failure): the engine's news is moot
            touched[stream] = None
            try:
                if token >= 0:
                    generated += 1
                    if stream.on_token(token, out.logprobs.get(rid), FinishReason(finish), out.time_ns):
                        self.engine.abort(rid)  # a stop string ended it
                else:
                    stream.on_end(FinishReason(finish), out.errors.get(rid))
            except Exception as e:  # noqa: BLE001 - one request's defect must not stop the others
                log.error("%s: output processing failed for %r; it ends with INTERNAL", MODEL, stream.client_id,
                          exc_info=e)
                stream.fail(Internal(f"output processing failed: {type(e).__name__}: {e}"))
                self.engine.abort(rid)
        if generated:
            self.metrics.inc("generation_tokens_total", generated)

    def _respond(self, stream: RequestStream, open_: dict) -> None:
        """Send the stream's one response of this batch, if it has one."""
        try:
            response = stream.take_response()
        except Exception as e:  # noqa: BLE001 - a defect building it ends the request, at once
            log.error("%s: building a response of request %r failed", MODEL, stream.client_id, exc_info=e)
            stream.done = True
            if stream.rid:
                self.engine.abort(stream.rid)
            response = (None, Internal(f"response processing failed: {type(e).__name__}: {e}"), True)
        if response is None:
            return
        outputs, error, final = response
        if outputs is not None:
            self._count_response(stream, final)
        self._send(stream.sender, stream.client_id, outputs, error, final)
        if final:
            open_.pop(stream, None)
            self.registry.forget(stream)
            if error is None:
                self._count_final(stream)

    def _send(self, sender: Any, client_id: str, outputs: dict | None, error: Exception | None, final: bool) -> None:
        if error is not None:
            code, message = error_message(MODEL, error, client_id)
            if code == "CANCELLED":  # a direct cancellation counts as a finished request (§9)
                self.metrics.inc("request_success_total", finished_reason="cancelled")
            else:
                self.metrics.inc("request_failure_total", code=code)
            response = error_response(self.pb, code, message)
        else:
            response = data_response(self.pb, outputs)
        try:
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception:  # noqa: BLE001 - a vanished client must not stop other responses
            log.exception("%s: sending a response of request %r failed", MODEL, client_id)

    def _poll_cancellations(self, open_: dict) -> None:
        """[CAN-1]: ask each open sender `is_cancelled()` at most once per period, never after its final.

        Each ask is a round trip to the server, as a send is: beyond MAX_POLLS_PER_S in all the
        period stretches, so that polls never crowd out the responses (docs/parameters.md)."""
        now = time.monotonic()
        period = max(self.period_s, len(open_) / MAX_POLLS_PER_S)
        for stream in open_:
            if stream.done or now - stream.last_poll < period:
                continue
            stream.last_poll = now
            try:
                cancelled = stream.sender.is_cancelled()
            except Exception:  # noqa: BLE001
                cancelled = False
            if cancelled:
                stream.last_poll = float("inf")  # its final response is on its way; ask no more
                with self.registry.lock:  # before the engine id is bound, the prepare thread answers it
                    stream.cancel = Cancel.ABORT
                    rid = stream.rid
                if rid:
                    self.engine.abort(rid)

    # ---- metrics (response thread) -----------------------------------------------------------

    def _count_admission(self, stream: RequestStream, time_ns: int) -> None:
        """Prompt metrics and the queue time once the engine first scheduled the request ([TOK-3])."""
        n = len(stream.request.prompt_ids)
        self.metrics.inc("prompt_tokens_total", n)
        self.metrics.observe("request_prompt_tokens", n)
        if stream.parsed.images is not None:
            self.metrics.inc("image_tokens_total", sum(stream.parsed.images.token_counts))
        self.metrics.observe("request_queue_time_seconds", max(0.0, time_ns / 1e9 - stream.parsed.arrival_time))

    def _count_response(self, stream: RequestStream, final: bool) -> None:
        """Time to the first data response; one time-per-output-token observation per response: the
        mean over the tokens it covers (one token per engine step unless the client reads slower
        than the engine generates; then one observation covers several, docs/metrics.md)."""
        now = time.monotonic()
        if stream.first_sent is None:
            stream.first_sent = now
            self.metrics.observe("time_to_first_token_seconds", now - stream.arrival)
        last_ns, prev_ns, n = stream.last_token_ns, stream.metrics_token_ns, stream.tokens_since_response()
        start_ns = prev_ns or stream.first_token_ns
        intervals = n if prev_ns else n - 1
        if intervals > 0 and last_ns and start_ns:
            self.metrics.observe("time_per_output_token_seconds", max(0.0, (last_ns - start_ns) / 1e9 / intervals))
        stream.metrics_token_ns = last_ns or prev_ns

    def _count_final(self, stream: RequestStream) -> None:
        reason = stream.finish_reason
        if reason is not None:
            self.metrics.inc("request_success_total", finished_reason=reason.label)
        self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - stream.arrival)
        self.metrics.observe("request_generation_tokens", stream.num_tokens)

    # ---- the lifecycle thread --------------------------------------------------------------

    def _lifecycle_loop(self) -> None:
        """Gauges; the server's shutdown ([HLT-9]); engine failure ([HLT-5]) and a stuck step ([HLT-7])."""
        reported_failure = False
        gauges: dict[str, float] = {}
        warm = self._stats  # the warm-up request is not traffic
        totals = {"num_preemptions_total": warm.num_preemptions, "prefix_cache_queries_total": warm.prefix_cache_queries,
                  "prefix_cache_hits_total": warm.prefix_cache_hits}
        progress, since = self._steps_seen, time.monotonic()
        while not self._closed.wait(LIFECYCLE_PERIOD_S):
            if self.server.shutting_down():
                self._drain_and_close()
                return
            stats, failure = self._stats, self.registry.failure
            in_flight = self.registry.engine_in_flight()
            now = time.monotonic()
            if not in_flight or self._steps_seen != progress:
                progress, since = self._steps_seen, now
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

    def _warm_up(self) -> None:
        """One prefill and one decode through the engine core before the model reports ready ([HLT-1])."""
        ids = self.tokenizer.encode("warm up", allow_special=False)
        rid = self.engine.add(Request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            wait([self.engine], 1.0)
            for message in self.engine.receive():
                if message[0] == "failed":
                    raise RuntimeError(f"{MODEL}: warm-up failed: {message[1]}")
                out: StepOutputs = message[1]
                self._stats = out.stats
                for i in (out.ids == rid).nonzero()[0]:
                    if out.finish[i] == FinishReason.ERROR:
                        raise RuntimeError(f"{MODEL}: warm-up failed: {out.errors.get(rid)}")
                    if out.finish[i] != FinishReason.NONE:
                        return
        raise RuntimeError(f"{MODEL}: warm-up did not finish within {WARMUP_TIMEOUT_S:g} s")

    @staticmethod
    def _core_spec(p: ModelParams, ckpt: Path, cfg: EngineConfig, device: torch.device, dtype: torch.dtype, tp: int,
                   ep: int) -> CoreSpec:
        """The engine core's process: rank 0 itself for one rank, the coordinator of worker
        processes (one per rank) for several ([HLT-1])."""
        from k3backend.engine.workers import visible_gpu

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
        return CoreSpec(str(ckpt), cfg, str(dtype).removeprefix("torch."), device.type, tp, ep,
                        gpus=tuple(gpus) if gpus is not None else None,
                        gpu=visible_gpu(gpus[0]) if gpus is not None and tp == 1 else None, dist_backend=backend,
                        startup_timeout_s=p.float("startup_timeout_s", lo=1), step_timeout_s=cfg.step_timeout_s,
                        log_prefix=MODEL)

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
