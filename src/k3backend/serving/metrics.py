"""Triton custom metrics for k3_vision and k3_lm (SERVING.md §9), updated off the request path.

`TritonMetrics` registers `<prefix>:<name>` families through `pb_utils.MetricFamily` (counter,
gauge and histogram: the 2.51 Python backend has all three), every series labelled with `model`
and `version` as vllm_backend does. Updates are queued and applied by one drain thread [MET-2]:
each metric update is a round trip to the Triton process. `NullMetrics` takes the same calls and
does nothing: with `REPORT_CUSTOM_METRICS=false` no family is registered [MET-3].

    metrics = TritonMetrics(pb_utils, "k3", model="k3_vision", version="1")
    metrics.counter("vision_images_total", "Images encoded")
    metrics.counter("request_failure_total", "Error responses", labels={"code": ERROR_CODES})
    metrics.histogram("vision_encode_seconds", "Encode time per request", TTFT_BUCKETS)
    metrics.start()
    metrics.inc("request_failure_total", code="INVALID_ARG"); metrics.observe("vision_encode_seconds", 0.2)
    metrics.close()
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# [MET-1] buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)
VISION_ENCODE_BUCKETS = TTFT_BUCKETS
ERROR_CODES = ("INVALID_ARG", "UNSUPPORTED", "UNAVAILABLE", "CANCELLED", "INTERNAL")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1-2-5 buckets up to max_model_len (request_prompt_tokens, request_generation_tokens)."""
    out: list[float] = []
    for exp in itertools.count():
        for m in (1, 2, 5):
            if m * 10 ** exp > max_model_len:
                return tuple(out)
            out.append(float(m * 10 ** exp))
    raise AssertionError("unreachable")


class NullMetrics:
    """Metrics switched off: every call is accepted and ignored."""

    def counter(self, name: str, description: str, labels: dict[str, Sequence[str]] | None = None) -> None: ...
    def gauge(self, name: str, description: str, labels: dict[str, Sequence[str]] | None = None) -> None: ...
    def histogram(self, name: str, description: str, buckets: Sequence[float]) -> None: ...
    def start(self) -> None: ...
    def inc(self, name: str, value: float = 1.0, **labels: str) -> None: ...
    def set(self, name: str, value: float, **labels: str) -> None: ...
    def observe(self, name: str, value: float, **labels: str) -> None: ...
    def close(self) -> None: ...


class TritonMetrics(NullMetrics):
    """Metric families of one model instance; see the module docstring.

    Register every family, with every value of its extra labels, before `start()`: series are
    created on the calling thread, and an update for an unregistered series is a bug (logged
    once, dropped) rather than a new series created on the drain thread.
    """

    def __init__(self, pb_utils: Any, prefix: str, *, model: str, version: str) -> None:
        self._pb = pb_utils
        self.prefix = prefix
        self._base = {"model": model, "version": str(version)}
        self._families: list[Any] = []  # deleted after their metrics (pb_utils requires that order)
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._queue: queue.Queue[tuple[str, str, float, tuple] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._warned: set[tuple] = set()

    def counter(self, name: str, description: str, labels: dict[str, Sequence[str]] | None = None) -> None:
        self._register(name, description, self._pb.MetricFamily.COUNTER, labels)

    def gauge(self, name: str, description: str, labels: dict[str, Sequence[str]] | None = None) -> None:
        self._register(name, description, self._pb.MetricFamily.GAUGE, labels)

    def histogram(self, name: str, description: str, buckets: Sequence[float]) -> None:
        family = self._family(name, description, self._pb.MetricFamily.HISTOGRAM)
        self._series[(name, ())] = family.Metric(labels=dict(self._base), buckets=list(buckets))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._drain, name=f"{self.prefix}-metrics", daemon=True)
        self._thread.start()

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._queue.put(("increment", name, float(value), tuple(sorted(labels.items()))))

    def set(self, name: str, value: float, **labels: str) -> None:
        self._queue.put(("set", name, float(value), tuple(sorted(labels.items()))))

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._queue.put(("observe", name, float(value), tuple(sorted(labels.items()))))

    def close(self) -> None:
        """Apply what is queued, stop the thread, then release series before their families."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._series.clear()
        self._families.clear()

    def _family(self, name: str, description: str, kind: Any) -> Any:
        family = self._pb.MetricFamily(name=f"{self.prefix}:{name}", description=description, kind=kind)
        self._families.append(family)
        return family

    def _register(self, name: str, description: str, kind: Any, labels: dict[str, Sequence[str]] | None) -> None:
        family = self._family(name, description, kind)
        keys = sorted(labels or {})
        for values in itertools.product(*((labels or {})[k] for k in keys)):
            extra = tuple(zip(keys, values))
            self._series[(name, extra)] = family.Metric(labels={**self._base, **dict(extra)})

    def _drain(self) -> None:
        """Apply updates in batches: increments of one series are summed and gauges keep their last
        value, so a busy engine costs one round trip per series and batch rather than per update."""
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while not self._queue.empty() and len(batch) < 4096:
                batch.append(self._queue.get_nowait())
            if None in batch:
                stop = True
                batch = batch[:batch.index(None)]
            merged: dict[tuple[str, tuple], float] = {}  # (op, series) -> summed increment / last value
            for op, name, value, labels in batch:
                key = (op, (name, labels))
                if op == "observe":
                    self._apply(op, key[1], value)
                else:
                    merged[key] = merged.get(key, 0.0) + value if op == "increment" else value
            for (op, series), value in merged.items():
                self._apply(op, series, value)

    def _apply(self, op: str, key: tuple, value: float) -> None:
        series = self._series.get(key)
        if series is None:
            if key not in self._warned:
                self._warned.add(key)
                logger.error("metric %s:%s%s is not registered; update dropped", self.prefix, key[0], dict(key[1]))
            return
        try:
            getattr(series, op)(value)
        except Exception:  # a metric must never take the model down
            logger.exception("metric %s:%s update failed", self.prefix, key[0])


def lm_metrics(pb_utils: Any, enabled: bool, prefix: str, model: str, version: str,
               max_model_len: int) -> NullMetrics:
    """The §9 families of k3_lm, registered and started ([MET-3]: none when disabled)."""
    if not enabled:
        return NullMetrics()
    reg = TritonMetrics(pb_utils, prefix, model=model, version=version)
    for name, desc in (("prompt_tokens_total", "Prompt tokens of admitted requests"),
                       ("generation_tokens_total", "Generated tokens"),
                       ("num_preemptions_total", "Sequences preempted and recomputed"),
                       ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
                       ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache"),
                       ("image_tokens_total", "Image pad positions admitted")):
        reg.counter(name, desc)
    reg.counter("request_success_total", "Requests finished with a data response, plus direct cancellations",
                labels={"finished_reason": ("stop", "length", "cancelled")})
    reg.counter("request_failure_total", "Error final responses", labels={"code": ERROR_CODES})
    for name, desc in (("num_requests_running", "Sequences in the running batch"),
                       ("num_requests_waiting", "Admitted but not yet scheduled"),
                       ("kv_cache_usage_perc", "Fraction of MLA latent-cache pages in use"),
                       ("state_slots_usage_perc", "Fraction of KDA state slots in use"),
                       ("engine_healthy", "1 when the engine is healthy"),
                       ("workers_alive", "Live worker processes")):
        reg.gauge(name, desc)
    tok = token_buckets(max_model_len)
    for name, desc, buckets in (
            ("time_to_first_token_seconds", "Receipt to first data response", TTFT_BUCKETS),
            ("time_per_output_token_seconds", "Time per output token", TPOT_BUCKETS),
            ("e2e_request_latency_seconds", "Receipt to final response", E2E_BUCKETS),
            ("request_queue_time_seconds", "Receipt to first scheduling", TTFT_BUCKETS),
            ("request_prompt_tokens", "Prompt tokens per request", tok),
            ("request_generation_tokens", "Output tokens per request", tok)):
        reg.histogram(name, desc, buckets)
    reg.start()
    reg.set("engine_healthy", 1.0)
    reg.set("workers_alive", 1.0)
    return reg
