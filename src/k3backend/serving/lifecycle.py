"""What a Python-backend stub can learn about the tritonserver around it (SERVING.md §8).

Triton 2.51 tells a Python model nothing about shutdown until `finalize`, and it calls
`finalize` only once no request is in flight: when `--exit-timeout-secs` expires first, the
server exits without unloading its models, which crashed it (SIGSEGV, heap corruption) and
orphaned the stubs. So `k3_lm` watches for the shutdown itself and ends its requests in time:

- `server_is_shutting_down()`: during shutdown Triton answers every readiness query with
  "Server not ready", which `pb_utils.is_model_ready` raises;
- `server_exit_timeout_s()`: the `--exit-timeout-secs` of the parent tritonserver, read from
  its command line, to know how long in-flight requests may still run;
- `parent_alive()`: the stub's own parent watch only notices a parent that was reaped;
  a crashed server that its launcher has not waited for yet is a zombie, and counts as dead here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_EXIT_TIMEOUT_S = 30.0  # tritonserver's default --exit-timeout-secs
SHUTDOWN_MARGIN_S = 5.0  # finish every response this long before Triton's exit timeout expires


def server_command_line(pid: int) -> list[str]:
    """argv of process `pid` (empty if it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def server_option(argv: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in `argv` (the last one wins, as in Triton)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def server_exit_timeout_s(pid: int) -> float:
    raw = server_option(server_command_line(pid), "exit-timeout-secs")
    try:
        return float(raw) if raw is not None else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def drain_seconds(exit_timeout_s: float) -> float:
    """How long in-flight requests may keep running once shutdown began."""
    return max(0.0, exit_timeout_s - SHUTDOWN_MARGIN_S)


def parent_alive(ppid: int) -> bool:
    """The stub's parent (tritonserver) still runs: not reaped (re-parented) and not a zombie."""
    if os.getppid() != ppid:
        return False
    try:
        stat = Path(f"/proc/{ppid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def server_is_shutting_down(pb_utils: Any, model: str) -> bool | None:
    """True when `model` is not ready (the server shuts down, or the model unloads), False while
    it is ready, None if this backend cannot tell.

    `model` is also not ready while it is still loading, so the caller trusts True only after
    it has once seen False.
    """
    try:
        return not pb_utils.is_model_ready(model)
    except AttributeError:
        return None  # a backend without the model-readiness API
    except Exception as e:  # noqa: BLE001 - 2.51 raises "Server not ready" during shutdown
        log.debug("is_model_ready(%s) raised %s", model, e)
        return True
