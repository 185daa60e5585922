"""Helpers for tests that change, kill or watch a tritonserver: repository copies, pids, waiting."""

from __future__ import annotations

import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1] / "model_repository"


def repo_copy(dest: Path, **params: dict[str, str]) -> Path:
    """A copy of model_repository/ with `parameters` values replaced, e.g. k3_lm={"max_num_seqs": "1"}."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for model, values in params.items():
        cfg = dest / model / "config.pbtxt"
        text = cfg.read_text()
        for key, value in values.items():
            pattern = rf'(parameters {{ key: "{re.escape(key)}" value: {{ string_value: )"[^"]*"'
            text, n = re.subn(pattern, rf'\1"{value}"', text)
            assert n == 1, f"{model}: no parameter {key}"
        cfg.write_text(text)
    return dest


def log_pid(log_path: Path, pattern: str, last: bool = False) -> int:
    """The pid in the first (or last) server-log line matching `pattern`, whose group 1 is the pid."""
    found = re.findall(pattern, Path(log_path).read_text(errors="replace"))
    assert found, f"no line matching {pattern!r} in {log_path}"
    return int(found[-1] if last else found[0])


def stub_pid(log_path: Path, last: bool = False) -> int:
    """The k3_lm stub's pid (the last one after a reload with last=True)."""
    return log_pid(log_path, r"k3_lm: stub pid (\d+)", last)


def worker_pids(log_path: Path) -> dict[int, int]:
    """rank -> pid from the [HLT-1] lines of the k3_lm workers."""
    lines = re.findall(r"k3_lm: worker rank (\d+) pid (\d+) ", Path(log_path).read_text(errors="replace"))
    return {int(r): int(p) for r, p in lines}


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def describe(pid: int) -> str:
    """A process as /proc shows it (state, kernel wait channel, threads' states), for a failure message."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"pid {pid}: gone"
    name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[-1].split()
    states = {}
    for t in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            st = t.read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        states[st] = states.get(st, 0) + 1
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        wchan = "?"
    return f"pid {pid} ({name}): state {fields[0]}, ppid {fields[1]}, wchan {wchan or '-'}, threads by state {states}"


def proc_stats():
    """(pid, stat fields after the command name) of every live process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            yield int(stat.parent.name), fields


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the server's: its stubs and the k3_lm guardian)."""
    return [pid for pid, fields in proc_stats() if int(fields[2]) == pgid]


def child_pids(pid: int) -> list[int]:
    """Live children of `pid`."""
    return [child for child, fields in proc_stats() if int(fields[1]) == pid]


def wait_until(condition: Callable[[], object], timeout: float, what: str, period: float = 0.1) -> float:
    """Poll until `condition()` is truthy; returns the seconds it took, fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)
    return time.monotonic() - start


def ready_status(http_url: str, model: str) -> int | None:
    """HTTP status of the model's readiness endpoint, or None when the server does not answer."""
    try:
        with urllib.request.urlopen(f"{http_url}/v2/models/{model}/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def none_ready(http_url: str, *models: str) -> bool:
    """Every model answers its readiness endpoint, and none with 200."""
    return all(ready_status(http_url, m) not in (200, None) for m in models)


def load_repository_model(http_url: str, model: str, timeout: float = 300) -> None:
    """Load (or reload) `model` through the repository API (explicit model control); asserts 200."""
    req = urllib.request.Request(f"{http_url}/v2/repository/models/{model}/load", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
