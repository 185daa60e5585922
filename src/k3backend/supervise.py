"""Run several server processes as one: `k3backend serve --openai` (tritonserver + the gateway).

Each child runs in its own session, so a terminal's Ctrl-C reaches them only through this
process: SIGINT or SIGTERM here becomes one SIGTERM to every child, and when any child exits the
others get SIGTERM too. A child still running `kill_after_s` after its SIGTERM is killed, and
every child's process group is swept at the end (the Triton Python-backend stubs live in
tritonserver's), so nothing outlives the command. Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Child:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str]


def run_together(children: Sequence[Child], kill_after_s: float = 60.0) -> int:
    """Run the children until one exits or a signal arrives; returns the first exit code that
    ended the run (the signalled run: the first non-zero code, else 0; death by the SIGTERM sent counts
    as 0)."""
    procs: list[tuple[Child, subprocess.Popen]] = []
    stopping: list[float] = []  # when the SIGTERMs went out (empty: not yet)
    first_code: list[int] = []

    def stop_all(*_: object) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            for child, p in procs:
                if p.poll() is None:
                    logger.info("stopping %s (pid %d)", child.name, p.pid)
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for child in children:
            procs.append((child, subprocess.Popen(list(child.argv), env=dict(child.env), stdin=subprocess.DEVNULL,
                                                  start_new_session=True)))
        while any(p.poll() is None for _, p in procs):
            for child, p in procs:
                if p.poll() is not None and not stopping:
                    logger.info("%s exited with code %d", child.name, p.returncode)
                    first_code.append(p.returncode)
                    stop_all()
            if stopping and time.monotonic() - stopping[0] > kill_after_s:
                for child, p in procs:
                    if p.poll() is None:
                        logger.warning("%s (pid %d) still running %.0f s after SIGTERM: killing", child.name,
                                       p.pid, kill_after_s)
                        _kill_group(p)
            time.sleep(0.1)
    finally:
        stop_all()
        for _, p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(kill_after_s)
            _kill_group(p)
            p.wait()
        for s, handler in old.items():
            signal.signal(s, handler)
    # a child that died of our SIGTERM (one still starting, before its handler) stopped as asked
    codes = [0 if p.returncode == -signal.SIGTERM else p.returncode for _, p in procs]
    return first_code[0] if first_code else next((c for c in codes if c), 0)


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
