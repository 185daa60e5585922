"""The response thread of `k3_lm`: engine news and local work in, responses out (ENGINE.md §8).

One thread owns every response sender from the moment the prepare thread hands it over ("open") to its
final response, and is the only one that sends or asks `is_cancelled()`: on 2.51 that call on a
finished request reads a freed response factory and crashes the server, so it is never made after
a final. Each wake-up it drains what the other threads queued (`put`), reads every step message
the engine core sent meanwhile, then sends at most one response per request, first responses
first, then final ones: a request whose sends fell behind gets all its pending tokens in one
response. It also keeps the metrics that responses decide (time to first token, time per output
token, successes and failures) and the engine's latest `EngineStats` for the gauges.

Work items: ("open", stream), ("send", sender, client_id, outputs, error) for a request that never
got a stream, ("fail", stream, error), ("cancel", stream, Cancel), ("shutdown",); None ends the
thread once every open stream got its final response.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from k3backend.engine.client import EngineClient
from k3backend.engine.outputs import EngineStats, StepOutputs
from k3backend.engine.request import FinishReason
from k3backend.errors import Internal, Unavailable
from k3backend.serving.registry import SHUTDOWN_ERROR, Registry
from k3backend.serving.responses import error_message
from k3backend.serving.stream import Cancel, RequestStream
from k3backend.serving.triton_io import data_response, error_response

log = logging.getLogger(__name__)

MODEL = "k3_lm"
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



class Responder:
    """The response thread and what it owns; `put()` hands it work, `join()` waits for its end."""

    def __init__(self, pb_utils: Any, engine: EngineClient, registry: Registry, metrics: Any, period_s: float,
                 stats: EngineStats) -> None:
        self.pb, self.engine, self.registry, self.metrics, self.period_s = pb_utils, engine, registry, metrics, period_s
        self.stats = stats  # the engine's latest, for the gauges
        self.steps_seen = 0  # engine messages read: the step watchdog's progress count
        self.last_send = -float("inf")  # monotonic time of the last response sent, by any thread
        self._sending = 0  # sends in progress, by any thread (see `quiet`)
        self._send_lock = threading.Lock()
        self.inbox = _Inbox()
        self._lock = threading.Lock()  # put() against the thread's last drain
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="k3-lm-respond", daemon=True)
        self._thread.start()

    def put(self, *items: Any) -> bool:
        """Queue work for the thread; False once it ended (the caller then answers itself: the
        senders in `items` are nobody else's)."""
        with self._lock:
            if not self.alive:
                return False
            for item in items:
                self.inbox.put(item)
            return True

    def quiet(self) -> bool:
        """No send in progress on any thread: `last_send` is then the last response to reach the server."""
        with self._send_lock:
            return self._sending == 0

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread's end; whether it ended (`alive` turns False before its last sends)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        """The loop, then every request still open gets its final response: after a shutdown, or with
        UNAVAILABLE when the loop itself failed (a defect outside any one request's processing)."""
        open_: dict[RequestStream, None] = {}  # the streams whose final response is not sent yet
        error = Unavailable(SHUTDOWN_ERROR)
        try:
            self._loop(open_)
        except Exception as e:  # noqa: BLE001 - reported once; no request may be left without its final
            log.exception("%s: the response thread failed; every open request ends with UNAVAILABLE", MODEL)
            error = Unavailable(f"k3_lm response thread failed: {type(e).__name__}: {e}")
        with self._lock:  # what was queued meanwhile is answered here; later calls to put() get False
            self.alive = False
            touched: dict[RequestStream, None] = {}
            for item in self.inbox.drain():
                if item is not None:
                    self._local(item, open_, touched)
            for stream in list(open_):
                stream.fail(error)
                self._respond(stream, open_)

    def _loop(self, open_: dict) -> None:
        """See the module docstring."""
        stopping = False
        while not (stopping and not open_):
            wait([self.inbox, self.engine] if self.engine.readable else [self.inbox], self.period_s)
            touched: dict[RequestStream, None] = {}
            for item in self.inbox.drain():
                stopping = stopping or item is None
                if item is not None:
                    self._local(item, open_, touched)
            for message in self.engine.receive():
                self._engine_message(message, open_, touched)
            # first responses first, then final ones: a new request's first token does not wait behind the
            # others' sends (each a round trip to the server), nor does the client whose request ended
            for stream in sorted(touched, key=lambda st: (st.first_sent is not None, not st.done)):
                self._respond(stream, open_)
            self._poll_cancellations(open_)
            if stopping and open_:  # after "shutdown" everything left is ended; do not wait for more
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
            self.send(sender, client_id, outputs, error, final=True)
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
        self.steps_seen += 1
        if message[0] == "failed":
            with self.registry.lock:
                self.registry.failure = message[1]
            log.error("%s: engine failed: %s", MODEL, message[1])
            for stream in open_:
                stream.fail(Unavailable(f"engine failed: {message[1]}"))
                touched[stream] = None
            return
        out: StepOutputs = message[1]
        self.stats = out.stats
        for rid, cached in zip(out.started.tolist(), out.cached.tolist()):
            stream = self.registry.by_rid(rid)
            if stream is not None and not stream.done:
                stream.on_started(out.scheduled_ns, cached)
                self._count_admission(stream, out.scheduled_ns)
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
        self.send(stream.sender, stream.client_id, outputs, error, final)
        if final:
            open_.pop(stream, None)
            self.registry.forget(stream)
            if error is None:
                self._count_final(stream)

    def send(self, sender: Any, client_id: str, outputs: dict | None, error: Exception | None, final: bool) -> None:
        """Send one response. Every thread's sends go through here (the prepare thread and execute()
        answer directly once this thread ended), so that the shutdown knows when the last one left."""
        with self._send_lock:
            self._sending += 1
        try:
            self._send(sender, client_id, outputs, error, final)
        finally:
            with self._send_lock:
                self._sending -= 1
                self.last_send = time.monotonic()

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

    # ---- metrics ---------------------------------------------------------------------------------

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
