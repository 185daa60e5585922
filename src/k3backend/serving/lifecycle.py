"""What a Python-backend stub can learn about the tritonserver around it (SERVING.md §8).

Triton 2.51 tells a Python model nothing about shutdown until `finalize`, and it calls
`finalize` only once no request of the model is in flight: when `--exit-timeout-secs` expires
first, the server exits without unloading its models, which crashed it (SIGSEGV, heap
corruption) and orphaned the stubs. So `k3_lm` watches for the shutdown itself and ends its
requests in time. The stub cannot ask through `pb_utils`: during shutdown `is_model_ready`
answers with an error, and 2.51's stub reads that error after the server freed it (the stub
dies of SIGSEGV). It asks the server's own HTTP liveness endpoint on loopback instead, whose
listener closes the moment shutdown begins:

- `ServerWatch.shutting_down()`: True once `/v2/health/live` stops answering 200 after it did;
- `ServerWatch.exit_timeout_s`: the server's `--exit-timeout-secs`, from its command line, to know
  how long in-flight requests may still run;
- `ServerWatch.release()`: the watch holds a connection to that endpoint open while the server is
  live, so that 2.51 keeps the endpoint up at shutdown until the stub has sent its last response
  (a response reaching a stopped HTTP endpoint crashes the server: `_Hold`);
- `parent_alive()`: the stub's own parent watch only notices a parent that was reaped; a crashed
  server that its launcher has not waited for yet is a zombie, and counts as dead here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_EXIT_TIMEOUT_S = 30.0  # tritonserver's default --exit-timeout-secs
# Every response is sent this long before Triton's exit timeout expires: the HTTP endpoint must still
# stop (the held connection's settle, then its 1 s polls) and the models unload after that, or the
# server exits with exit(1). That took 5.4-6.3 s here (2-core CPU, T = 8 and 30).
SHUTDOWN_MARGIN_S = 8.0
SHUTDOWN_MARGIN_FRACTION = 0.25
# A healthy server is gone this long after its exit timeout (measured from the shutdown's start);
# the k3_lm guardian kills one that is not (a stream held open: see guardian.py).
EXIT_GRACE_S = 5.0
# From a stub's last response sent to the server's HTTP endpoint letting go of it (ServerWatch.release):
# the server passes a response on to the endpoint's threads asynchronously.
RESPONSE_SETTLE_S = 1.0
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever http_proxy says
# How a probe fails once the endpoint is shutting down: refused (listener closed) or reset (2.51
# refuses new connections while it waits for open ones).
_CLOSED = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def server_command_line(pid: int) -> list[str]:
    """argv of process `pid` (empty if it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def server_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name=value` or `--name value` in `argv` (the last one wins, as in Triton)."""
    value = default
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def server_http_url(argv: list[str]) -> str | None:
    """http://host:port of the server's HTTP endpoint, reached over loopback; None when disabled."""
    if (server_option(argv, "allow-http", "true") or "").lower() in ("false", "0", "no"):
        return None
    host = server_option(argv, "http-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("0.0.0.0", "", None) else host
    return f"http://{host}:{server_option(argv, 'http-port', '8000')}"


def drain_seconds(exit_timeout_s: float) -> float:
    """How long in-flight requests may keep running once shutdown began."""
    return max(0.0, exit_timeout_s - max(SHUTDOWN_MARGIN_S, SHUTDOWN_MARGIN_FRACTION * exit_timeout_s))


def parent_alive(ppid: int) -> bool:
    """The stub's parent (tritonserver) still runs: not reaped (re-parented) and not a zombie."""
    if os.getppid() != ppid:
        return False
    try:
        stat = Path(f"/proc/{ppid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


class ServerWatch:
    """The parent tritonserver as seen from its stub: options, liveness, control mode."""

    def __init__(self, ppid: int) -> None:
        argv = server_command_line(ppid)
        self.url = server_http_url(argv)
        raw = server_option(argv, "exit-timeout-secs")
        try:
            self.exit_timeout_s = float(raw) if raw is not None else DEFAULT_EXIT_TIMEOUT_S
        except ValueError:
            self.exit_timeout_s = DEFAULT_EXIT_TIMEOUT_S
        self.explicit = (server_option(argv, "model-control-mode", "none") or "").lower() == "explicit"
        self._seen_live = False
        self._failures = 0  # liveness probes failed in a row
        self._hold = _Hold()
        if self.url is None:
            log.warning("tritonserver runs without HTTP: requests still in flight at shutdown cannot be ended "
                        "before --exit-timeout-secs expires")

    def shutting_down(self) -> bool:
        """True once the server's liveness endpoint, which answered 200, has failed twice in a row.

        Shutdown shows in two ways on 2.51: while HTTP connections are still open the endpoint
        resets every new connection (it waits up to the exit timeout for the open ones), then its
        listener closes (refused). An HTTP error status counts too. The endpoint answers only after
        all models loaded, so a load is never taken for a shutdown; a slow answer (a timeout)
        proves nothing and counts as live; two probes in a row guard against a one-off failure.
        """
        if self.url is None:
            return False
        live = self._probe()
        if live:
            self._seen_live = True  # only ever set (confirm_live sets it from another thread)
            self._hold.keep(self.url)
        self._failures = 0 if live else self._failures + 1
        return self._seen_live and self._failures >= 2

    def confirm_live(self) -> None:
        """Probe now if the server was never seen live (called with each request until it was: Triton
        routes requests only once it is live). A shutdown that began before the first periodic probe
        answered went unseen (a SIGTERM right after start-up, with streams in flight: nothing drained
        them and the server crashed at its exit timeout). Only an answer counts, as in the periodic
        probe: a probe that cannot reach the server must not be taken for a shutdown."""
        if self.url is not None and not self._seen_live and self._probe():
            self._failures, self._seen_live = 0, True  # an answer: the refusals before it were the start-up's
            self._hold.keep(self.url)

    def release(self, last_send: float) -> None:
        """Let the server's HTTP endpoint stop once the responses this stub sent, the last at monotonic
        time `last_send`, had time to reach it: the stub sends no more (idempotent)."""
        self._hold.release(settle_s=RESPONSE_SETTLE_S - (time.monotonic() - last_send))

    def _probe(self) -> bool:
        try:
            with _DIRECT.open(f"{self.url}/v2/health/live", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False  # "Server exiting"
        except urllib.error.URLError as e:
            return not isinstance(e.reason, _CLOSED)
        except _CLOSED:  # a reset while reading the answer (http.client.RemoteDisconnected)
            return False
        except OSError:
            return True  # a timeout: unknown


class _Hold:
    """One idle connection to the server's HTTP endpoint, open while the server is live.

    On SIGTERM 2.51 waits for its open HTTP connections to close, then stops the endpoint and frees
    its threads; a response that reaches the endpoint after that crashes the server (SIGSEGV). A
    client still connected holds the endpoint up for its own responses, but one that closed its
    connection mid-stream leaves a k3_ensemble request generating in k3_lm (2.51 cancels an
    ensemble's later steps, not one in flight), and with no connection open its next response came
    after the stop. Counted as a connection like any client's, this one keeps the endpoint up until
    the stub released it after its last response. It sends nothing; the server never closes an
    idle connection, and one found closed is opened again at the next probe."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._released = False
        self._warned = False
        self._lock = threading.Lock()

    def keep(self, url: str) -> None:
        """Hold a connection to http://host:port `url` (the server just answered there) unless one is open."""
        with self._lock:
            if self._released or self._open():
                return
            host, _, port = url.removeprefix("http://").rpartition(":")
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=2)
                self._sock.setblocking(False)  # `_open` peeks without waiting
            except OSError as e:
                self._sock = None
                if not self._warned:
                    self._warned = True
                    log.warning("could not hold a connection to the server's HTTP endpoint (%s): a response sent "
                                "at shutdown to a client that has gone may crash the server", e)

    def release(self, settle_s: float) -> None:
        with self._lock:
            self._released = True
            if self._sock is not None:
                time.sleep(max(0.0, settle_s))
                self._sock.close()
                self._sock = None

    def _open(self) -> bool:
        """The held connection is still open: no end of stream (nor error) waiting on it."""
        if self._sock is None:
            return False
        try:
            alive = self._sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except OSError:
            alive = False
        if not alive:
            self._sock.close()
            self._sock = None
        return alive


def watch_parent(model: str, period_s: float = 0.5) -> threading.Thread:
    """A daemon thread that ends this stub when tritonserver is gone ([HLT-10]); for stubs without
    a lifecycle loop of their own (k3_vision)."""
    ppid = os.getppid()

    def run() -> None:
        while parent_alive(ppid):
            time.sleep(period_s)
        log.error("%s: tritonserver (pid %d) is gone; exiting", model, ppid)
        os._exit(1)

    t = threading.Thread(target=run, name=f"{model}-parent-watch", daemon=True)
    t.start()
    return t
