"""Races, shutdown and process faults against a real tritonserver (SERVING.md §6, §8).

Each finding of the robustness review is a test here: the crash of the server under finishing and
cancelled traffic, a stop that raced its target, SIGTERM with streams in flight, SIGKILL of the
k3_lm stub and of the server. Tests that kill or stop a server start a private one.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import threading
import time

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request

from k3client import http_post, make_inputs, metric, metrics, stream_one
from serverutil import REPO, alive, describe, group_pids, load_repository_model, log_pid, none_ready, repo_copy, stub_pid, wait_until

MODELS = ["k3_vision", "k3_lm", "k3_ensemble"]
LONG = {"max_tokens": 4000, "min_tokens": 4000, "ignore_eos": True, "stream": True, "return_finish_reason": True}


@pytest.fixture(scope="module", autouse=True)
def default_checkpoint(tmp_path_factory):
    os.environ["K3_DEFAULT_CHECKPOINT"] = str(tmp_path_factory.mktemp("ckpt") / "tiny-seed0")


class Watch:
    """One request on its own gRPC stream, watched from a callback: responses, error, final."""

    def __init__(self, url: str, model: str, values: dict, request_id: str) -> None:
        self.responses: list = []
        self.error: str | None = None
        self.final = threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer(model, make_inputs(values), request_id=request_id)

    def _on(self, result, error) -> None:
        if error is not None:
            self.error = str(error)
            self.final.set()
            return
        self.responses.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.final.set()

    def finish_reason(self) -> str | None:
        if not self.responses or "finish_reason" not in [o.name for o in self.responses[-1].get_response().outputs]:
            return None
        return self.responses[-1].as_numpy("finish_reason").reshape(-1)[0].decode()

    def close(self) -> None:
        try:
            self.client.stop_stream()
            self.client.close()
        except Exception:  # noqa: BLE001 - the server may be gone
            pass


# ---- races on a shared server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server(REPO, MODELS)


@pytest.mark.parametrize("model", ["k3_ensemble", "k3_lm"])
def test_stop_racing_its_target_is_never_lost(server, model):
    """Finding: a stop sent 1-3 ms after its target (before the target's first response) was answered
    OK, yet the target ran to `length` in 1-2 of 50 tries. Now every target ends cancelled."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(40):
            rid = f"race-{model}-{i}"
            client.async_stream_infer(model, make_inputs({"text_input": f"target {i}", **LONG, "max_tokens": 1024,
                                                          "min_tokens": 1024}), request_id=rid)
            if i % 2:
                time.sleep(0.001 * (i % 4))
            client.async_stream_infer(model, make_inputs({"text_input": "", "stop": True}), request_id=rid)
            finals, reasons = 0, []
            while finals < 2:
                result, error = results.get(timeout=60)
                assert error is None, error
                resp = result.get_response()
                if "finish_reason" in [o.name for o in resp.outputs]:
                    reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
                finals += resp.parameters["triton_final_response"].bool_param
            assert reasons[-1] == "cancelled", (rid, reasons)
    finally:
        client.stop_stream()
        client.close()


def test_stop_racing_its_target_over_http(server):
    statuses: dict[str, tuple[int, str]] = {}

    def target(rid: str) -> None:
        statuses[rid] = http_post(server.http_url, "/v2/models/k3_ensemble/generate",
                                  {"id": rid, "text_input": "target", "max_tokens": 1024, "min_tokens": 1024,
                                   "ignore_eos": True, "return_finish_reason": True, "return_num_output_tokens": True})

    for i in range(12):
        rid = f"http-race-{i}"
        t = threading.Thread(target=target, args=(rid,))
        t.start()
        time.sleep(0.001 * (i % 4))
        assert http_post(server.http_url, "/v2/models/k3_ensemble/generate",
                         {"id": rid, "text_input": "", "stop": True})[0] == 200
        t.join(60)
        status, body = statuses[rid]
        out = json.loads(body)
        assert status == 200 and out["finish_reason"] == "cancelled" and out["num_output_tokens"] < 1024, out


def test_finishing_and_cancelled_traffic_does_not_crash_the_server(triton_server, tmp_path):
    """Finding: tritonserver died with SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled: a poll thread
    asked finished requests is_cancelled() while another thread sent their final responses. A 1 ms
    cancellation period, short requests finishing all the time and streams cancelled mid-flight."""
    repo = repo_copy(tmp_path / "repo", k3_lm={"cancellation_check_period_ms": "1"})
    srv = triton_server(repo, ["k3_lm"], fresh=True)
    stop = time.monotonic() + 20
    errors: list[str] = []

    def worker(w: int) -> None:
        n = 0
        while time.monotonic() < stop:
            client = grpcclient.InferenceServerClient(srv.grpc_url)
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            rids = [f"w{w}-{n}-{k}" for k in range(6)]
            for k, rid in enumerate(rids):
                client.async_stream_infer("k3_lm", make_inputs({"text_input": rid, "max_tokens": 1 + k % 3,
                                                                "stream": bool(k % 2)}), request_id=rid)
            if n % 3 == 2:  # drop the stream with requests in flight
                time.sleep(0.01)
                client.stop_stream(cancel_requests=True)
            else:
                finals = 0
                while finals < len(rids):
                    result, error = got.get(timeout=60)
                    if error is not None:
                        errors.append(str(error))
                        finals += 1
                    else:
                        finals += result.get_response().parameters["triton_final_response"].bool_param
                client.stop_stream()
            client.close()
            n += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert srv.is_running(), srv.log_tail(40)
    assert not errors, errors[:3]
    assert "Signal (11)" not in srv.log_tail(400)
    m = metrics(srv.metrics_url)
    assert metric(m, "k3:request_failure_total", code="INTERNAL") == 0


# ---- shutdown and process faults (private servers) ---------------------------------------------

def test_sigterm_with_streams_in_flight_ends_them_and_exits_cleanly(triton_server):
    """Finding: SIGTERM with long streams in flight ended in SIGSEGV / heap corruption after the exit
    timeout, or a hang, and orphaned the k3_lm stub. [HLT-9]: streams get UNAVAILABLE before the exit
    timeout expires, Triton unloads the models, the server exits 0 within the exit timeout.

    The clients close their streams once their requests ended: on 2.51 an open gRPC stream keeps the
    models it used from unloading, and then no server can exit cleanly (see docs/operations.md)."""
    exit_timeout = 8
    srv = triton_server(REPO, MODELS, [f"--exit-timeout-secs={exit_timeout}"], fresh=True)
    watches = [Watch(srv.grpc_url, "k3_ensemble" if i % 2 else "k3_lm", {"text_input": f"long {i}", **LONG},
                     f"long-{i}") for i in range(4)]
    try:
        wait_until(lambda: all(w.responses for w in watches), 60, "every stream's first response")
        start = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        wait_until(lambda: all(w.final.is_set() for w in watches), exit_timeout, "every stream's final response")
        for w in watches:
            assert w.error and "UNAVAILABLE: server shutting down" in w.error, w.error
            w.close()
        code = srv.process.wait(exit_timeout + 20 + 5)
        took = time.monotonic() - start
        assert code == 0, srv.log_tail(60)
        log = srv.log_tail(400)
        for bad in ("Signal (11)", "Segmentation fault", "malloc", "Exit timeout expired"):
            assert bad not in log, log
        wait_until(lambda: not group_pids(srv.pid), 10, "the stubs and the guardian to exit")
        assert took < exit_timeout + 5, took
    finally:
        for w in watches:
            w.close()


class HttpStream:
    """One `generate_stream` over its own HTTP connection, read on a thread: its SSE events and how it
    ended ("eof": the server closed it after its last event, or the exception)."""

    def __init__(self, http_url: str, model: str, body: dict) -> None:
        host, port = http_url.removeprefix("http://").split(":")
        self.events: list[dict] = []
        self.end: str | None = None
        self.done = threading.Event()
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                          {"Content-Type": "application/json"})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.conn.getresponse():
                if line.startswith(b"data: "):
                    self.events.append(json.loads(line[6:]))
            self.end = "eof"
        except Exception as e:  # noqa: BLE001 - recorded: the test says what it expected
            self.end = repr(e)
        finally:
            self.conn.close()
            self.done.set()


def _shutdown_log_is_clean(srv) -> None:
    log = srv.log_tail(400)
    for bad in ("Signal (11)", "Segmentation fault", "Fatal Python error", "malloc", "Exit timeout expired"):
        assert bad not in log, log


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_shutdown_with_http_streams_in_flight_ends_them_and_exits_cleanly(triton_server, how):
    """Finding: with an HTTP stream in flight, 2.51 waited its whole exit timeout for the connection
    (it resets new connections meanwhile, which k3_lm's liveness probe took for a live server), then
    exited 1 without unloading the models (and the stubs crashed on Ctrl-C). Now the streams end with
    UNAVAILABLE, their connections close, the models unload and the server exits 0 within the exit
    timeout. Ctrl-C is SIGINT to the whole foreground process group, stubs and workers included."""
    exit_timeout = 8
    srv = triton_server(REPO, MODELS, [f"--exit-timeout-secs={exit_timeout}"], fresh=True)
    streams = [HttpStream(srv.http_url, model, {"text_input": f"long {model}", **LONG})
               for model in ("k3_ensemble", "k3_lm")]
    wait_until(lambda: all(s.events for s in streams), 60, "every stream's first event")
    code, took = _stop(srv, how, exit_timeout)
    for s in streams:
        assert s.done.wait(5), "a stream was not closed"
        assert s.end == "eof", s.end
        assert "UNAVAILABLE: server shutting down" in s.events[-1].get("error", ""), s.events[-1]
    _exited_cleanly(srv, code, took, exit_timeout)


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_shutdown_after_a_client_dropped_an_http_ensemble_stream_exits_cleanly(triton_server, how):
    """Finding: a client that closed its HTTP `generate_stream` to k3_ensemble mid-generation left the
    request generating in k3_lm (2.51 cancels an ensemble's later steps, never one in flight). At the
    next shutdown, with no HTTP connection open, 2.51 stopped its HTTP endpoint at once and the
    request's next response went to the freed endpoint: SIGSEGV within 0.1 s, every time. Now the
    request is drained and ended like one whose client is still there, and the server exits 0."""
    exit_timeout = 8
    srv = triton_server(REPO, MODELS, [f"--exit-timeout-secs={exit_timeout}"], fresh=True)
    endless = {**LONG, "max_tokens": 100_000, "min_tokens": 100_000}  # still generating at the signal
    dropped = HttpStream(srv.http_url, "k3_ensemble", {"text_input": "dropped", **endless})
    wait_until(lambda: dropped.events, 60, "the stream's first event")
    dropped.conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away; the request keeps generating
    assert dropped.done.wait(5)
    time.sleep(1.0)
    wait_until(lambda: metric(metrics(srv.metrics_url), "k3:num_requests_running") == 1, 5, "the request to run")
    _exited_cleanly(srv, *_stop(srv, how, exit_timeout), exit_timeout)


def _stop(srv, how: str, exit_timeout: float) -> tuple[int, float]:
    """SIGTERM to the server, or Ctrl-C (SIGINT to its whole process group); its exit status and time."""
    start = time.monotonic()
    if how == "sigterm":
        os.kill(srv.pid, signal.SIGTERM)
    else:
        os.killpg(srv.pid, signal.SIGINT)
    code = srv.process.wait(exit_timeout + 20 + 5)
    return code, time.monotonic() - start


def _exited_cleanly(srv, code: int, took: float, exit_timeout: float) -> None:
    assert code == 0, srv.log_tail(60)
    _shutdown_log_is_clean(srv)
    assert took < exit_timeout + 1, took
    wait_until(lambda: not group_pids(srv.pid), 10, "the stubs and the guardian to exit")


def test_a_grpc_stream_held_open_and_never_read_does_not_keep_the_server_alive(triton_server):
    """Finding: a gRPC client that never closed its stream (nor read it) kept tritonserver alive for
    over 10 minutes after Ctrl-C, then crashed it (grpc_cq_begin_op assertion) when the client died.
    2.51 itself cannot exit while such a stream is open (k3_lm cannot unload and the gRPC endpoint
    waits without limit), so the k3_lm guardian kills the server at exit timeout + 5 s. A well-behaved
    stream beside it still gets its UNAVAILABLE final response."""
    exit_timeout = 8
    srv = triton_server(REPO, MODELS, [f"--exit-timeout-secs={exit_timeout}"], fresh=True)
    hold = threading.Event()
    request = _get_inference_request("k3_lm", make_inputs({"text_input": "held", **LONG}), "", "held", None, 0,
                                     False, False, 0, None, None)

    def requests():
        yield request
        hold.wait()  # the stream's request side never ends

    channel = grpc.insecure_channel(srv.grpc_url)
    unread = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())  # never read
    polite = Watch(srv.grpc_url, "k3_lm", {"text_input": "polite", **LONG}, "polite")
    try:
        wait_until(lambda: polite.responses, 60, "the polite stream's first response")
        wait_until(lambda: metric(metrics(srv.metrics_url), "k3:num_requests_running") == 2, 10,
                   "the held request to run")
        start = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        assert polite.final.wait(exit_timeout), "the polite stream got no final response"
        assert polite.error and "UNAVAILABLE: server shutting down" in polite.error, polite.error
        polite.close()
        code = srv.process.wait(exit_timeout + 20 + 5)
        took = time.monotonic() - start
        assert took < exit_timeout + 20 + 5, took
        if code != 0:
            assert code == -signal.SIGKILL, srv.log_tail(60)
            assert "waits without limit for client streams that are still open" in srv.log_tail(100)
        wait_until(lambda: not group_pids(srv.pid), 10, "every process of the server")
    finally:
        hold.set()
        unread.cancel()
        channel.close()
        polite.close()


FAULTY_LM = '''"""k3_lm with faults injected into one request's output processing (tests/test_lm_faults.py).

A request whose stop strings include a marker fails on its third token: "<fault:detokenizer>" inside
the engine's detokenization, "<fault:response>" inside the adapter's response building.
"""
import json

import triton_python_backend_utils as pb_utils

from k3backend.detokenizer import IncrementalDetokenizer
from k3backend.serving import responses
from k3backend.serving.lm_adapter import LmServer

_push = IncrementalDetokenizer.push
_on_event = responses.ResponseBuilder.on_event
_init = responses.ResponseBuilder.__init__


def push(self, ids, **kw):
    self._fault_count = getattr(self, "_fault_count", 0) + 1
    if "<fault:detokenizer>" in self._stops and self._fault_count == 3:
        raise RuntimeError("injected detokenizer fault")
    return _push(self, ids, **kw)


def init(self, parsed, *a, **kw):
    _init(self, parsed, *a, **kw)
    self._fault = "<fault:response>" in parsed.sampling.stop
    self._fault_count = 0


def on_event(self, ev):
    self._fault_count += len(ev.token_ids)
    if self._fault and self._fault_count >= 3:
        raise RuntimeError("injected response fault")
    return _on_event(self, ev)


IncrementalDetokenizer.push = push
responses.ResponseBuilder.__init__ = init
responses.ResponseBuilder.on_event = on_event


class TritonPythonModel:
    def initialize(self, args):
        self.server = LmServer(json.loads(args["model_config"]), pb_utils, version=args["model_version"])

    def execute(self, requests):
        self.server.execute(requests)

    def finalize(self):
        self.server.close()
'''


def test_a_failure_inside_output_processing_ends_that_request_with_internal_at_once(triton_server, tmp_path):
    """Finding: an exception while detokenizing a request's tokens was logged once per token and the
    client never got a response, not even a final one. Now a failure in the engine's output
    processing or in the adapter's response building ends that request with INTERNAL naming the
    cause, within 1 s, logged once; a concurrent request is unaffected (equal to its run alone)."""
    repo = repo_copy(tmp_path / "repo")
    (repo / "k3_lm" / "1" / "model.py").write_text(FAULTY_LM)
    srv = triton_server(repo, ["k3_lm"], fresh=True)
    healthy = {"text_input": "healthy", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "stream": True,
               "return_log_probs": True, "return_num_output_tokens": True}
    alone = stream_one(srv.grpc_url, "k3_lm", healthy)
    assert alone.final and alone.error is None and alone.total("num_output_tokens") == 48
    for where, cause in (("detokenizer", "output processing failed: RuntimeError: injected detokenizer fault"),
                         ("response", "response processing failed: RuntimeError: injected response fault")):
        faulty = Watch(srv.grpc_url, "k3_lm", {"text_input": f"faulty {where}", **LONG, "stop_words": [f"<fault:{where}>"]},
                       f"faulty-{where}")
        beside = Watch(srv.grpc_url, "k3_lm", healthy, f"beside-{where}")
        try:
            start = time.monotonic()
            assert faulty.final.wait(60), "the faulty request never ended"
            assert faulty.error and f"k3_lm: INTERNAL: {cause}" in faulty.error, faulty.error
            assert time.monotonic() - start < 1.5  # its first three tokens take ~0.1 s here
            assert beside.final.wait(60) and beside.error is None, beside.error
            got = [r.as_numpy("output_log_probs").reshape(-1).tolist() for r in beside.responses]
            # the same tokens: fp32 log-probs of a batch of two round differently from a batch of one
            assert sum(got, []) == pytest.approx(sum((r["output_log_probs"].reshape(-1).tolist()
                                                      for r in alone.responses), []), abs=1e-4)
        finally:
            faulty.close()
            beside.close()
    wait_until(lambda: metric(metrics(srv.metrics_url), "k3:num_requests_running") == 0, 5,
               "the faulty requests to leave the engine")
    m = metrics(srv.metrics_url)
    assert metric(m, "k3:request_failure_total", code="INTERNAL") == 2
    log = srv.log_tail(2000)
    assert log.count("output processing failed for") == 1, log
    assert log.count("building a response of request") == 1, log
    assert srv.is_running()


def test_killed_stub_stops_the_server_so_streams_end(triton_server):
    """Finding: after SIGKILL of the k3_lm stub in-flight streams hung, readiness stayed 200. Triton 2.51
    cannot answer a dead stub's requests, so by default (stub_failure_action=exit) the guardian stops
    the server: the streams end with an error instead of hanging, and no process is left."""
    srv = triton_server(REPO, MODELS, fresh=True)
    watches = [Watch(srv.grpc_url, model, {"text_input": "long", **LONG}, f"k-{model}")
               for model in ("k3_lm", "k3_ensemble")]
    try:
        wait_until(lambda: all(w.responses for w in watches), 60, "first responses")
        os.kill(stub_pid(srv.log_path), signal.SIGKILL)
        took = wait_until(lambda: all(w.final.is_set() for w in watches), 15, "the streams to end")
        assert all(w.error for w in watches), [w.error for w in watches]
        srv.process.wait(15)
        assert "its stub process" in srv.log_tail(200) and "stub_failure_action=exit" in srv.log_tail(200)
        wait_until(lambda: not group_pids(srv.pid), 10, "every process of the server")
        assert took < 15
    finally:
        for w in watches:
            w.close()


def test_killed_stub_in_explicit_mode_unloads_and_reloads(triton_server, tmp_path):
    """stub_failure_action=unload: k3_lm and k3_ensemble report not-ready within 5 s; a load restores them."""
    repo = repo_copy(tmp_path / "repo", k3_lm={"stub_failure_action": "unload"})
    srv = triton_server(repo, ["k3_ensemble"], ["--model-control-mode=explicit", "--load-model=k3_ensemble"],
                        fresh=True)
    os.kill(stub_pid(srv.log_path), signal.SIGKILL)
    wait_until(lambda: none_ready(srv.http_url, "k3_lm", "k3_ensemble"), 5, "k3_lm and k3_ensemble to be not ready")
    load_repository_model(srv.http_url, "k3_ensemble", timeout=120)
    status, body = http_post(srv.http_url, "/v2/models/k3_ensemble/generate", {"text_input": "back", "max_tokens": 2})
    assert status == 200, body


@pytest.mark.parametrize("frozen", [False, True])
def test_killed_server_leaves_no_process(triton_server, frozen):
    """[HLT-10]: SIGKILL of tritonserver: the k3_lm stub (even while the dead server is an unreaped
    zombie) and its guardian exit within 10 s. Frozen: the stub's own parent watch cannot run (a
    thread blocked in a call into the dead server can hold the GIL; here the stub is SIGSTOPped),
    so its guardian ends it once the server is gone. `stop()` then removes the stub regions the
    killed server left in /dev/shm."""
    srv = triton_server(REPO, MODELS, fresh=True)
    watch = Watch(srv.grpc_url, "k3_lm", {"text_input": "long", **LONG}, "orphan")
    try:
        wait_until(lambda: watch.responses, 60, "the first response")
        stub = stub_pid(srv.log_path)
        guardian = log_pid(srv.log_path, r"k3_lm: guardian pid (\d+)")
        regions = srv.shm_regions()
        assert regions, f"no stub region named {srv.shm_prefix}* in /dev/shm"
        if frozen:
            os.kill(stub, signal.SIGSTOP)
        os.kill(srv.pid, signal.SIGKILL)
        try:
            wait_until(lambda: not alive(stub) and not alive(guardian), 10, "the k3_lm stub and guardian to exit")
        except AssertionError as e:  # say which one and what it is doing (a flake seen once under load)
            tail = srv.log_path.read_text(errors="replace").splitlines()[-15:]
            raise AssertionError("\n".join([str(e), describe(srv.pid), describe(stub), describe(guardian), *tail]))
        assert not frozen or "did not exit within" in srv.log_path.read_text(errors="replace")
        srv.process.wait(5)  # reap: the other stubs see their parent gone
        wait_until(lambda: not group_pids(srv.pid), 10, "every process of the server")
        # A stub that exits by itself may unlink its region; the killed (frozen) one cannot.
        assert not frozen or any(r.exists() for r in regions), "no region left to test stop() with"
        srv.stop()
        assert srv.shm_regions() == [], "a killed server's stub regions outlived stop()"
    finally:
        watch.close()
