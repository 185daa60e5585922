"""k3backend.supervise.run_together with real child processes: the exit code a stop reports."""

from __future__ import annotations

import signal
import subprocess
import sys

from serverutil import child_pids, wait_until

HANDLES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)"
IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def _supervisor(*children: str, kill_after_s: float = 60.0) -> subprocess.Popen:
    """A process running run_together over `python -c CODE` children (the `sleep` child: plain `sleep 60`)."""
    argvs = [["sleep", "60"] if c == "sleep" else [sys.executable, "-c", c] for c in children]
    code = ("import os, sys; from k3backend.supervise import Child, run_together; "
            f"sys.exit(run_together([Child(str(i), a, dict(os.environ)) for i, a in enumerate({argvs!r})], "
            f"kill_after_s={kill_after_s}))")
    p = subprocess.Popen([sys.executable, "-c", code])
    wait_until(lambda: len(child_pids(p.pid)) == len(children), 30, "the children to start")
    return p


def _ignores_sigterm(pid: int) -> bool:
    """Whether `pid` has set SIGTERM to ignored yet (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def test_a_stop_that_a_child_dies_of_is_a_clean_exit():
    """SIGTERM to the supervisor reaches a child with no handler yet (a gateway worker still importing):
    it dies of that SIGTERM, which is the stop asked for, so the run exits 0."""
    p = _supervisor(HANDLES_TERM, "sleep")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


def test_a_child_killed_after_ignoring_the_stop_is_an_error():
    p = _supervisor(IGNORES_TERM, kill_after_s=1.0)
    # before its handler is set the child would die of the SIGTERM, which is a clean stop, not this case
    wait_until(lambda: _ignores_sigterm(child_pids(p.pid)[0]), 30, "the child to ignore SIGTERM")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) != 0


def test_a_child_that_exits_by_itself_gives_its_code():
    p = _supervisor(HANDLES_TERM, "import sys, time; time.sleep(1); sys.exit(3)")
    assert p.wait(30) == 3
