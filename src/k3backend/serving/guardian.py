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

The guardian also exits when the server itself is gone.
"""

from __future__ import annotations

import argparse
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
KILL_AFTER_S = 5.0


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
    """A normal finalize: the guardian exits quietly."""
    try:
        os.write(fd, GOODBYE)
        os.close(fd)
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
    data = b""
    while True:
        ready, _, _ = select.select([args.fd], [], [], 0.5)
        if not _alive(args.server_pid):
            return 0  # the server is gone: nothing left to protect
        if not ready:
            continue
        chunk = os.read(args.fd, 64)
        data += chunk
        if not chunk:
            break
    if data.startswith(GOODBYE) or not _alive(args.server_pid):
        return 0
    what = {"exit": "stopping the server so that its connections close and it can be restarted",
            "unload": f"unloading {args.model} and its dependents", "log": "no action"}[args.action]
    _log(f"{args.model}: its stub process (pid {args.stub_pid}) died; Triton cannot answer the requests it had "
         f"in flight or restart it; stub_failure_action={args.action}: {what}")
    if args.action == "exit":
        _stop_server(args.server_pid)
    elif args.action == "unload":
        _log(f"{args.model}: {_unload(args.server_pid, args.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
