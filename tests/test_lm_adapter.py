"""k3_lm load-time checks ([CFG-L1], [CFG-L3]) without a server."""

import re
from pathlib import Path

import pytest

from k3backend.config import ConfigError
from k3backend.serving.lm_adapter import PARAMETERS, _check_instance_config
from k3backend.serving.triton_io import ModelParams, resolve_device_dtype

GOOD = {"max_batch_size": 1, "model_transaction_policy": {"decoupled": True},
        "instance_group": [{"kind": "KIND_MODEL", "count": 1}]}


@pytest.mark.parametrize("change, message", [
    ({"instance_group": [{"kind": "KIND_GPU", "count": 1}]}, "KIND_MODEL"),
    ({"instance_group": [{"kind": "KIND_MODEL", "count": 2}]}, "exactly one instance"),
    ({"model_transaction_policy": {"decoupled": False}}, "decoupled must be true"),
    ({"max_batch_size": 4}, "max_batch_size must be 1"),
], ids=["kind-gpu", "two-instances", "not-decoupled", "batch"])
def test_CFG_L1_wrong_instance_config_fails_the_load(change, message):
    _check_instance_config(GOOD)
    with pytest.raises(ValueError, match=message):
        _check_instance_config({**GOOD, **change})


def test_CFG_L3_unknown_or_unparsable_parameters_name_the_parameter():
    def cfg(**params):
        return {"parameters": {k: {"string_value": v} for k, v in params.items()}}

    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['max_num_seq'\]"):
        ModelParams(cfg(max_num_seq="4"), PARAMETERS, "k3_lm")
    p = ModelParams(cfg(max_num_seqs="four", default_thinking="maybe"), PARAMETERS, "k3_lm")
    with pytest.raises(ConfigError, match="parameter max_num_seqs: expected an integer"):
        p.int("max_num_seqs", lo=1)
    with pytest.raises(ConfigError, match="parameter default_thinking: expected true or false"):
        p.bool("default_thinking")
    assert ModelParams(cfg(), PARAMETERS, "k3_lm").int("default_max_tokens", lo=1) == 16
    p = ModelParams(cfg(gpu_memory_utilization="1.5"), PARAMETERS, "k3_lm")
    with pytest.raises(ConfigError, match=r"parameter gpu_memory_utilization: expected a finite number >= 0.01 and <= 1"):
        p.float("gpu_memory_utilization", lo=0.01, hi=1.0)


def test_repository_k3_lm_parameters_are_exactly_the_known_ones():
    """The shipped config.pbtxt lists every §4.4 parameter and nothing else."""
    text = (Path(__file__).resolve().parents[1] / "model_repository/k3_lm/config.pbtxt").read_text()
    keys = {line.split('"')[1] for line in text.splitlines() if line.startswith("parameters {")}
    assert keys == set(PARAMETERS)


def test_auto_device_and_dtype_on_cpu():
    device, dtype = resolve_device_dtype("auto", "auto", "k3_lm")
    import torch

    if not torch.cuda.is_available():
        assert (device.type, dtype) == ("cpu", torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16", "k3_lm")[1] == torch.bfloat16


# ---- the adapter's threads against a real engine-core process (a stand-in pb_utils) -----------------

def test_a_request_probes_the_server_at_once_until_it_was_seen_live():
    """The liveness probe fails the same way before the server listens and once it shuts down, so a
    failure counts only after an answer. The periodic probe runs every 0.25 s: a SIGTERM right after
    start-up, with streams in flight, came before it (test_lm_faults' HTTP-stream shutdown, 2 of 24
    runs): no drain, and the server crashed at its exit timeout. So a request probes at once while
    the server was never seen live; an unreachable server is still never taken for a shutdown."""
    import http.server
    import socket
    import threading

    from k3backend.serving.lifecycle import ServerWatch

    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once it is closed: probes are refused
    watch = ServerWatch(os.getpid())
    watch.url = f"http://127.0.0.1:{port}"
    watch.confirm_live()
    assert not any(watch.shutting_down() for _ in range(3))  # never answered: not a shutdown
    server = http.server.HTTPServer(("127.0.0.1", port), Live)
    try:
        thread = threading.Thread(target=server.handle_request)  # one answer, then the listener closes
        thread.start()
        watch.confirm_live()
        thread.join(5)
    finally:
        server.server_close()
    assert [watch.shutting_down(), watch.shutting_down()] == [False, True]  # refused twice in a row


def test_the_watch_holds_one_connection_to_a_live_server_until_released():
    """At shutdown 2.51 stops its HTTP endpoint once no connection is open, and a response reaching
    it after that crashes the server (test_lm_faults: a client that dropped its k3_ensemble stream).
    So while the server answers, the watch holds one idle connection of its own (opened again if
    the server closed it), and lets it go only when told that no response is left to send."""
    import http.server
    import threading

    from k3backend.serving import lifecycle

    open_now, opened, lock = [0], [0], threading.Lock()

    class Live(http.server.BaseHTTPRequestHandler):
        def setup(self):
            super().setup()
            with lock:
                open_now[0] += 1
                opened[0] += 1

        def finish(self):
            super().finish()
            with lock:
                open_now[0] -= 1

        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Live)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        watch = lifecycle.ServerWatch(os.getpid())
        watch.url = f"http://127.0.0.1:{server.server_address[1]}"
        assert not watch.shutting_down()
        assert _settles(lambda: open_now[0] == 1), open_now  # the probe's connection closed, the hold's not
        t0 = time.monotonic()
        assert not any(watch.shutting_down() for _ in range(3))
        assert time.monotonic() - t0 < 1.0  # the hold's check does not wait
        assert _settles(lambda: open_now[0] == 1) and opened[0] == 5, (open_now, opened)  # 4 probes, 1 hold
        watch._hold._sock.close()  # as if the server had closed it: the next probe holds a new one
        assert _settles(lambda: open_now[0] == 0)
        assert not watch.shutting_down() and _settles(lambda: open_now[0] == 1), open_now
        t0 = time.monotonic()
        watch.release(last_send=t0 - 0.4)  # a response 0.4 s ago: the rest of the settle
        assert lifecycle.RESPONSE_SETTLE_S - 0.4 <= time.monotonic() - t0 < lifecycle.RESPONSE_SETTLE_S
        assert _settles(lambda: open_now[0] == 0), open_now
        assert not watch.shutting_down() and _settles(lambda: open_now[0] == 0), open_now  # released for good
    finally:
        server.shutdown()
        server.server_close()


def test_the_guardian_stops_a_server_that_is_already_gone_quietly():
    """The stub dies when the server does: stopping that server must not raise (it did: a traceback)."""
    from k3backend.serving import guardian

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    guardian._stop_server(child.pid)  # reaped: no such process


def _settles(condition, timeout_s: float = 5.0) -> bool:
    """`condition()` holds within `timeout_s`, and still does 0.3 s later."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            time.sleep(0.3)
            if condition():
                return True
        time.sleep(0.05)
    return False


import os  # noqa: E402 - the fast checks above need none of these
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from google.protobuf import json_format, text_format  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402

from fake_pb import FakePbUtils, FakeSender  # noqa: E402
from k3backend.presets import make_checkpoint  # noqa: E402
from serverutil import alive, wait_until  # noqa: E402

REPO_CONFIG = Path(__file__).resolve().parents[1] / "model_repository" / "k3_lm" / "config.pbtxt"


def lm_config(**params: str) -> dict:
    proto = text_format.Parse(REPO_CONFIG.read_text(), model_config_pb2.ModelConfig())
    cfg = json_format.MessageToDict(proto, preserving_proto_field_name=True)
    # never "exit": the guardian would stop this test process's parent, taking it for a server
    for k, v in {"stub_failure_action": "log", "cpu_cache_gb": "0.25", "max_model_len": "4096", **params}.items():
        cfg["parameters"][k] = {"string_value": v}
    return cfg


@pytest.fixture(scope="module")
def lm_ckpt(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("lm_adapter"))


def start(ckpt, **params):
    from k3backend.serving.lm_adapter import LmServer

    return LmServer(lm_config(model_path=str(ckpt), **params), FakePbUtils)


def ask(server, text: str, sender: FakeSender | None = None, request_id: str = "", **inputs) -> FakeSender:
    arrays = {"text_input": np.array([[text.encode()]], dtype=object)}
    for name, value in inputs.items():
        dtype = np.bool_ if isinstance(value, bool) else np.float32 if isinstance(value, float) else np.int32
        arrays[name] = np.array([[value]], dtype=dtype)
    req = FakePbUtils.Request(arrays, request_id, sender=sender)
    server.execute([req])
    return req.sender


def joined(sender: FakeSender, name: str = "text_output") -> str:
    return "".join(o[name].reshape(-1)[0].decode() for o in sender.outputs() if name in o)


def counted(sender: FakeSender) -> list[int]:
    return [int(o["num_output_tokens"].reshape(-1)[0]) for o in sender.outputs()]


def test_a_client_that_reads_slowly_gets_coalesced_responses(lm_ckpt):
    """ENGINE.md §8: when sends fall behind the engine, a response carries every token since the
    previous one (num_output_tokens > 1), in order, none lost: the streamed text equals the
    non-streamed one, and the counts sum to the total. The engine never waits for the client."""
    server = start(lm_ckpt)
    try:
        common = {"max_tokens": 60, "min_tokens": 60, "ignore_eos": True, "temperature": 0.0,
                  "return_num_output_tokens": True}
        whole = ask(server, "coalesce", **common)
        assert whole.final.wait(60) and whole.error is None
        slow = ask(server, "coalesce", FakeSender(delay_s=0.05), stream=True, **common)
        assert slow.final.wait(120) and slow.error is None
        assert joined(slow) == joined(whole) and sum(counted(slow)) == 60
        assert max(counted(slow)) > 1 and len(counted(slow)) < 60, counted(slow)
        assert slow.flags[-1] == FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL and not slow.after_final
    finally:
        server.close()


def test_a_new_requests_first_response_goes_before_the_others_responses(lm_ckpt):
    """Each send is a round trip to the server, so under load a response round takes a while; a new
    request's first token must not wait behind it. Three streaming requests decode while the response
    thread is held in a send (a gate); a new request arrives and its tokens are drawn meanwhile.
    Once the gate opens, the round in progress ends and the next one sends the new request's first
    response before any other request's."""
    server = start(lm_ckpt)
    gate, log = threading.Event(), []
    try:
        # few tokens: the engine core finishes them and goes idle rather than filling the pipe to the
        # held response thread (a full pipe would stop it before the new request's tokens)
        common = {"max_tokens": 24, "min_tokens": 24, "ignore_eos": True, "temperature": 0.0, "stream": True}
        old = [ask(server, f"old {i}", FakeSender(gate=gate, log=log, name=f"old{i}"), **common) for i in range(3)]
        time.sleep(1.0)  # their first tokens: the response thread is now held in one of their sends
        # not streamed: its one response is final, so no held-back text ([STR-3]) can delay it
        new = ask(server, "new", FakeSender(log=log, name="new"), max_tokens=2, temperature=0.0)
        time.sleep(1.5)  # the engine goes on meanwhile: the new request's tokens, the old ones' last
        held = len(log)
        gate.set()
        assert new.final.wait(60) and new.error is None
        after = [name for name, _ in log[held:]]
        first_new = after.index("new")
        # the round in progress finishes (each old request at most once), then the new round starts with "new"
        assert len(set(after[:first_new])) == len(after[:first_new]) <= 3, after[:first_new + 4]
    finally:
        gate.set()
        server.close()
    assert all(s.final.is_set() and not s.after_final for s in old)


def test_a_finished_requests_final_response_goes_before_the_others_next_responses(lm_ckpt):
    """In a closed loop a final response frees a client to send its next request, so after the round's
    first responses it goes before the others. Four long requests stream (one, B, through a gate); a
    short one joins, and its first send closes the gate, so the response thread is held in B's send
    while the short one ends. Once the gate opens, the round in progress ends (each long request once)
    and the next round starts with the short request's final, not with B again."""
    gate, log = threading.Event(), []

    class ClosesTheGate(FakeSender):
        def send(self, response=None, flags=0) -> None:
            if not self.responses:
                gate.clear()
            super().send(response, flags)

    server = start(lm_ckpt)
    gate.set()
    long = {"max_tokens": 400, "min_tokens": 400, "ignore_eos": True, "temperature": 0.0, "stream": True}
    try:
        old = [ask(server, "b", FakeSender(gate=gate, log=log, name="B"), **long)]
        old += [ask(server, f"o{i}", FakeSender(log=log, name=f"O{i}"), **long) for i in range(3)]
        wait_until(lambda: {n for n, _ in log} == {"B", "O0", "O1", "O2"}, 60, "the long requests' first responses")
        short = ask(server, "s", ClosesTheGate(log=log, name="S"), max_tokens=16, min_tokens=16, ignore_eos=True,
                    temperature=0.0, stream=True)
        wait_until(lambda: not gate.is_set(), 60, "the short request's first response")
        time.sleep(2.0)  # its last tokens meanwhile (about 16 steps); the response thread is held in B's send
        assert not short.final.is_set()
        held = len(log)
        gate.set()
        assert short.final.wait(60) and short.error is None
        after = log[held:]
        final = next(i for i, (name, flags) in enumerate(after)
                     if name == "S" and flags & FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        before = [name for name, _ in after[:final]]
        assert len(set(before)) == len(before) <= 4, [name for name, _ in after[:final + 5]]
    finally:
        gate.set()
        server.close()
    assert all(s.final.is_set() and not s.after_final for s in old + [short])


def test_a_requests_arrival_is_its_receipt_by_execute_not_its_turn_in_the_prepare_queue(lm_ckpt, monkeypatch):
    """Parsing runs on the prepare thread, after execute() queued the request; arrival_time_ns (and the
    TTFT and queue-time metrics built on it) must still count from receipt: here parsing is held 0.5 s."""
    from k3backend.serving import lm_adapter

    parse = lm_adapter.parse_request
    monkeypatch.setattr(lm_adapter, "parse_request", lambda *a: time.sleep(0.5) or parse(*a))
    server = start(lm_ckpt)
    try:
        sent = time.time_ns()
        s = ask(server, "arrival", max_tokens=2, temperature=0.0, return_perf_metrics=True)
        assert s.final.wait(60) and s.error is None
        arrival = int(s.outputs()[-1]["arrival_time_ns"].reshape(-1)[0])
        assert sent <= arrival < sent + 0.2e9, (arrival - sent) / 1e9
    finally:
        server.close()


def test_a_stop_request_does_not_wait_behind_other_requests_being_parsed(lm_ckpt, monkeypatch):
    """[CAN-5]: a stop ends its target within a check period plus a step, even when the prepare
    thread is busy (here each generation request takes 1.5 s to parse): stops are answered by
    execute() itself. A stop whose target is still queued there ends it through the tombstone."""
    from k3backend.serving import lm_adapter

    parse = lm_adapter.parse_request
    slow = lambda get, *a: time.sleep(1.5 * (get("stop") is None)) or parse(get, *a)  # noqa: E731
    server = start(lm_ckpt)
    try:
        target = ask(server, "target", request_id="t1", max_tokens=400, min_tokens=400, ignore_eos=True,
                     temperature=0.0, stream=True)
        wait_until(lambda: len(target.responses) > 0, 30, "the target's first response")
        monkeypatch.setattr(lm_adapter, "parse_request", slow)
        ask(server, "blocker", max_tokens=2)  # the prepare thread now parses this for 1.5 s
        queued = ask(server, "queued", request_id="t2", max_tokens=400, stream=True)
        t0 = time.monotonic()
        stop1, stop2 = ask(server, "", request_id="t1", stop=True), ask(server, "", request_id="t2", stop=True)
        assert stop1.final.wait(5) and stop2.final.wait(5) and stop1.error is None and stop2.error is None
        assert target.final.wait(30) and target.error is None
        assert time.monotonic() - t0 < 1.0, f"the target ended {time.monotonic() - t0:.2f} s after its stop"
        assert queued.final.wait(30) and queued.error is None and not queued.after_final  # ended by its tombstone
        assert joined(queued) == ""
    finally:
        server.close()


def test_a_defect_while_preparing_one_request_ends_it_and_not_the_prepare_thread(lm_ckpt, monkeypatch):
    """Every request queued behind a request whose preparation fails unexpectedly (here: the handover
    to the engine raises once) is still served; the victim itself ends with INTERNAL."""
    server = start(lm_ckpt)
    try:
        bind, calls = server.registry.bind, []

        def flaky(stream, rid):
            calls.append(rid)
            if len(calls) == 1:
                raise RuntimeError("planted")
            return bind(stream, rid)

        monkeypatch.setattr(server.registry, "bind", flaky)
        victim = ask(server, "victim", max_tokens=2, temperature=0.0)
        after = ask(server, "after", max_tokens=2, temperature=0.0)
        assert victim.final.wait(30) and "planted" in victim.error.message
        assert after.final.wait(30) and after.error is None and len(calls) == 2
    finally:
        server.close()


def test_a_dead_engine_core_ends_every_request_with_unavailable_at_once(lm_ckpt):
    server = start(lm_ckpt)
    try:
        senders = [ask(server, f"long {i}", max_tokens=3000, min_tokens=3000, ignore_eos=True, stream=True)
                   for i in range(3)]
        wait_until(lambda: all(s.responses for s in senders), 60, "every stream's first response")
        os.kill(server.engine.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        for s in senders:
            assert s.final.wait(5), "a request got no final response"
            assert s.error.code == FakePbUtils.TritonError.UNAVAILABLE
            assert re.search(r"k3_lm: UNAVAILABLE: engine failed: engine core process pid \d+ exited \(signal 9\)",
                             s.error.message), s.error.message
            assert not s.after_final
        assert time.monotonic() - killed < 5
        late = ask(server, "after")
        assert late.final.wait(5) and "engine is not healthy" in late.error.message
    finally:
        server.close()


def test_a_failure_of_the_response_loop_itself_ends_every_open_request(lm_ckpt, monkeypatch):
    """A defect outside any one request's processing (here: the cancellation polls) stops the
    response thread; every open request still gets a final UNAVAILABLE naming it, and later
    requests are answered rather than queued for a thread that is gone."""
    server = start(lm_ckpt)
    try:
        senders = [ask(server, f"long {i}", max_tokens=3000, min_tokens=3000, ignore_eos=True, stream=True)
                   for i in range(2)]
        wait_until(lambda: all(s.responses for s in senders), 60, "every stream's first response")

        def broken(open_):
            raise RuntimeError("injected loop fault")

        monkeypatch.setattr(server.responder, "_poll_cancellations", broken)
        for s in senders:
            assert s.final.wait(5), "a request got no final response"
            assert s.error.code == FakePbUtils.TritonError.UNAVAILABLE
            assert "response thread failed: RuntimeError: injected loop fault" in s.error.message, s.error.message
            assert not s.after_final
        late = ask(server, "after")
        assert late.final.wait(5) and late.error is not None
    finally:
        server.close()


def test_a_stuck_engine_step_fails_its_requests_within_step_timeout(lm_ckpt):
    """[HLT-7]: the engine core stops making progress (SIGSTOP here): after step_timeout_s the stub
    kills it and every request ends with UNAVAILABLE saying so."""
    server = start(lm_ckpt, step_timeout_s="1")
    try:
        s = ask(server, "stuck", max_tokens=3000, min_tokens=3000, ignore_eos=True, stream=True)
        wait_until(lambda: s.responses, 60, "the first response")
        pid = server.engine.process.pid
        os.kill(pid, signal.SIGSTOP)
        assert s.final.wait(10)
        assert "engine step made no progress for" in s.error.message and "step_timeout_s 1" in s.error.message
        wait_until(lambda: not alive(pid), 5, "the stuck engine core to be killed")
    finally:
        server.close()


def test_close_ends_in_flight_requests_with_unavailable_and_leaves_no_process(lm_ckpt):
    server = start(lm_ckpt, max_num_seqs="1")
    running = ask(server, "a", max_tokens=3000, min_tokens=3000, ignore_eos=True, stream=True)
    queued = ask(server, "b", max_tokens=3000, min_tokens=3000, ignore_eos=True, stream=True)
    wait_until(lambda: running.responses, 60, "the first response")
    pid = server.engine.process.pid
    server.close()
    for s in (running, queued):
        assert s.final.is_set() and s.error.message == "k3_lm: UNAVAILABLE: server shutting down"
        assert not s.after_final
    assert not alive(pid)
    server.close()  # idempotent
    late = ask(server, "late")
    assert late.final.wait(5) and "server shutting down" in late.error.message


def test_the_http_endpoint_stays_held_while_final_responses_are_still_being_sent(lm_ckpt):
    """The held HTTP connection is let go only after the response thread sent its last response: a
    response that reaches a stopped endpoint crashes 2.51. Here a send blocks past the 5 s that the
    shutdown waits for the response thread (it let go at 5 s, with the final response unsent)."""
    server = start(lm_ckpt)
    gate = threading.Event()
    released = []
    server.server.release = lambda last_send: released.append(gate.is_set())
    stuck = ask(server, "a", sender=FakeSender(gate=gate), max_tokens=3000, min_tokens=3000, ignore_eos=True,
                stream=True)
    wait_until(server.registry.engine_in_flight, 30, "the request in the engine")  # its sends: the responder's
    closing = threading.Thread(target=server.close, daemon=True)
    closing.start()
    time.sleep(6.5)
    assert released == [], "let go while a response was still being sent"
    gate.set()
    wait_until(lambda: released, 30, "the release after the last response")
    assert released == [True] and stuck.final.is_set()
    assert stuck.error.message == "k3_lm: UNAVAILABLE: server shutting down"
    closing.join(30)
    assert not closing.is_alive()


def test_the_http_endpoint_stays_held_while_the_prepare_thread_answers_what_was_queued(lm_ckpt):
    """Requests still queued at shutdown are answered by the prepare thread itself once the response
    thread has ended; the held connection waits for those sends too. Here the prepare thread is busy
    with one request while the shutdown ends the response thread, and the queued one's send blocks."""
    server = start(lm_ckpt)
    entered, busy, gate = threading.Event(), threading.Event(), threading.Event()
    released = []
    server.server.release = lambda last_send: released.append(gate.is_set())
    admit = server._admit

    def slow_admit(stream):
        entered.set()
        busy.wait(30)
        admit(stream)

    server._admit = slow_admit
    first = ask(server, "a", max_tokens=4)
    queued = ask(server, "b", sender=FakeSender(gate=gate), max_tokens=4)
    # the prepare thread holds the first request before the shutdown: had it not dequeued it yet, both would
    # be answered as refused arrivals, the queued one by the response thread (CI saw that on a loaded machine)
    assert entered.wait(30), "the prepare thread did not take the first request"
    closing = threading.Thread(target=server.close, daemon=True)
    closing.start()
    assert server.responder.join(timeout=30), "the response thread did not end"
    busy.set()
    time.sleep(1.5)
    assert released == [], "let go while the prepare thread was still sending"
    gate.set()
    wait_until(lambda: released, 30, "the release after the prepare thread's send")
    assert released == [True] and first.final.is_set() and queued.final.is_set()
    assert queued.error.message == "k3_lm: UNAVAILABLE: server shutting down"
    closing.join(30)
    assert not closing.is_alive()


def test_setup_logging_leaves_a_test_processs_exit_status_alone():
    """The stub exits at once at interpreter teardown (os._exit(0)); any other process, a test run
    above all, must keep its exit status."""
    code = "from k3backend.serving.triton_io import setup_logging; setup_logging(); raise SystemExit(3)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 3


def test_a_tokenizer_that_does_not_cover_the_vocabulary_fails_the_load(lm_ckpt, tmp_path):
    """Every id the model can sample must detokenize: a config.json vocabulary larger than the
    tokenizer's is refused at load, naming both numbers, before any weight is read."""
    import json
    import shutil

    from k3backend.config import ConfigError

    bad = tmp_path / "bad"
    shutil.copytree(lm_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.setdefault("text_config", cfg)["vocab_size"] = 1024
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"tokenizer: 512 token ids \(256 ranks \+ 256 specials\) but "
                                          r"text_config.vocab_size is 1024"):
        start(bad)
