"""A small process that outlives the `k3_lm` stub to report its death (SERVING.md §8.3).

When the stub dies (SIGKILL, the OOM killer), Triton 2.51 does not notice it for decoupled
models: the stub's in-flight requests never get a final response (their response factories
died with the stub), `/v2/models/k3_lm/ready` stays 200, new requests get "Stub process is not
healthy" errors and there is no restart. Nothing inside the stub can act after its death, so
the stub starts this guardian at load and keeps the write end of a pipe it never writes to
except to say goodbye at a normal `finalize`. EOF without the goodbye means the stub died,
and the guardian does what `stub_failure_action` says:

- `exit` (default): log, then stop the server (SIGTERM, SIGKILL 5 s later). Connections close,
  so in-flight requests end with an error instead of hanging, and an orchestrator restarts it;
- `unload`: log, then unload k3_lm and its dependents through the server's HTTP endpoint
  (explicit model-control mode only): readiness turns non-200, new requests get NOT_FOUND,
  a reload brings k3_lm back; in-flight requests still hang (Triton 2.51 cannot end them);
- `log`: only log.

It is also the bound on the server's exit. Once `k3_lm` sees the server shutting down it
says `shutdown <seconds>` on the pipe: every request was answered by then, and a healthy 2.51
exits within its exit timeout. But 2.51 waits without limit for client streams still open (a
gRPC stream that is never closed, or whose responses are never read: grpc::Server::Shutdown has
no deadline there, and unread responses keep k3_lm from unloading), so a server still alive
after that many seconds is killed (SIGKILL), with one line saying why.

The guardian exits when the server itself is gone, after making sure the stub is gone too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from k3backend.interpreter import python_executable
from k3backend.serving.lifecycle import server_command_line, server_http_url

log = logging.getLogger(__name__)

ACTIONS = ("exit", "unload", "log")
GOODBYE = b"bye\n"
SHUTDOWN = b"shutdown"
KILL_AFTER_S = 5.0
STUB_GRACE_S = 2.0  # the stub's parent watch needs 0.5 s; then the guardian ends it


def spawn(model: str, action: str) -> int:
    """Start the guardian of this stub; returns the pipe fd to `say_goodbye()` on at finalize."""
    if action not in ACTIONS:
        raise ValueError(f"stub_failure_action must be one of {list(ACTIONS)}, got {action!r}")
    read_fd, write_fd = os.pipe()
    os.set_inheritable(read_fd, True)
    cmd = [python_executable(), "-m", "k3backend.serving.guardian", "--fd", str(read_fd), "--stub-pid", str(os.getpid()),
           "--server-pid", str(os.getppid()), "--model", model, "--action", action]
    proc = subprocess.Popen(cmd, pass_fds=(read_fd,), stdin=subprocess.DEVNULL, close_fds=True)
    os.close(read_fd)
    log.info("%s: guardian pid %d (stub_failure_action=%s)", model, proc.pid, action)
    return write_fd


def say_goodbye(fd: int) -> None:
    """A normal finalize: the guardian exits quietly (unless the server is shutting down)."""
    _say(fd, GOODBYE)
    try:
        os.close(fd)
    except OSError:
        pass


def watch_shutdown(fd: int, within_s: float) -> None:
    """The server began to shut down: it must be gone within `within_s` seconds."""
    _say(fd, SHUTDOWN + f" {within_s:.3f}\n".encode())


def _say(fd: int, message: bytes) -> None:
    try:
        os.write(fd, message)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _log(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR k3backend.serving.guardian: {message}\n")
    sys.stderr.flush()


def _unload(server_pid: int, model: str) -> str:
    url = server_http_url(server_command_line(server_pid))
    if url is None:
        return "the server has no HTTP endpoint (--allow-http=false)"
    req = urllib.request.Request(f"{url}/v2/repository/models/{model}/unload",
                                 data=json.dumps({"parameters": {"unload_dependents": True}}).encode(),
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return f"unloaded {model} and its dependents (HTTP {r.status})"
    except Exception as e:  # noqa: BLE001 - e.g. not explicit model-control mode
        body = e.read().decode(errors="replace") if hasattr(e, "read") else ""
        return f"could not unload {model}: {e} {body}".strip()


def _stop_server(server_pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone by itself meanwhile (its stub died because it did)
        os.kill(server_pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_S
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3backend.serving.guardian")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--stub-pid", type=int, required=True)
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--action", choices=ACTIONS, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; its shutdown says goodbye
    lines, deadline, goodbye = _Lines(), None, False
    while _alive(args.server_pid):
        if deadline is not None and time.monotonic() > deadline:
            _kill_stuck_server(args.server_pid, args.model)
            return 0
        if lines.eof:  # the stub is gone: only the shutdown deadline is left to watch
            time.sleep(0.25)
            continue
        for line in lines.read(args.fd, timeout=0.5):
            if line.startswith(SHUTDOWN) and deadline is None:
                deadline = time.monotonic() + float(line.split()[1])
            goodbye = goodbye or line == GOODBYE.strip()
        if lines.eof and deadline is None:
            if goodbye:
                return 0
            _stub_died(args)
            return 0
    _end_orphaned_stub(args.stub_pid, args.model)  # the server is gone: nothing left to protect
    return 0


class _Lines:
    """The pipe from the stub, split into lines; `eof` once the stub closed it or died."""

    def __init__(self) -> None:
        self.buf, self.eof = b"", False

    def read(self, fd: int, timeout: float) -> list[bytes]:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return []
        chunk = os.read(fd, 256)
        self.eof = not chunk
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return done + ([self.buf] if self.eof and self.buf else [])


def _stub_died(args: argparse.Namespace) -> None:
    what = {"exit": "stopping the server so that its connections close and it can be restarted",
            "unload": f"unloading {args.model} and its dependents", "log": "no action"}[args.action]
    _log(f"{args.model}: its stub process (pid {args.stub_pid}) died; Triton cannot answer the requests it had "
         f"in flight or restart it; stub_failure_action={args.action}: {what}")
    if args.action == "exit":
        _stop_server(args.server_pid)
    elif args.action == "unload":
        _log(f"{args.model}: {_unload(args.server_pid, args.model)}")


def _end_orphaned_stub(stub_pid: int, model: str) -> None:
    """[HLT-10] once the server is gone: the stub's own parent watch is a Python thread, and under load
    a stub outlived its dead server by more than 10 s with every thread in a futex wait (a thread
    stuck in a call into the dead server is the likely cause), so a stub still here after a grace is
    killed. It is ours while it is our parent."""
    deadline = time.monotonic() + STUB_GRACE_S
    while os.getppid() == stub_pid and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.getppid() == stub_pid:
        _log(f"{model}: tritonserver is gone and its stub process (pid {stub_pid}) did not exit within "
             f"{STUB_GRACE_S:.0f} s; killing it (SIGKILL)")
        try:
            os.kill(stub_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_stuck_server(server_pid: int, model: str) -> None:
    _log(f"{model}: tritonserver (pid {server_pid}) is still running after its exit timeout: Triton 2.51 waits "
         "without limit for client streams that are still open (a gRPC stream never closed, or one whose "
         "responses are not read); every request was answered; killing it (SIGKILL)")
    try:
        os.kill(server_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
