"""Run Triton kernel checks under the interpreter (`TRITON_INTERPRET=1`) on the CPU, in a child process.

triton reads TRITON_INTERPRET when it is first imported, and another test module of the same pytest
process may already have imported it (transformers and fla probe for it); so the checks of a kernel
test module run in a fresh interpreter that sets the variable first. A kernel test module defines
plain functions that raise on a mismatch and names its cases `{case id: (function name, kwargs)}`
(kwargs of str, int, float, bool or None), or lets them default to its argument-free `check_*`
functions, in a module attribute `CHECKS = Checks(__file__, ...)`. One child per module imports it,
runs every case and returns `{case id: None | the traceback}`, which keeps the start-up cost (torch,
triton) to once. conftest starts the selected modules' children early, at low priority (`prestart`).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

Cases = dict[str, tuple[str, dict[str, Any]]]

_CHILD = r"""
import importlib.util, json, sys, traceback
import torch
torch.set_num_threads(1)
module_file, cases_file, results_file = sys.argv[1:4]
sys.path.insert(0, str(__import__("pathlib").Path(module_file).parent))
spec = importlib.util.spec_from_file_location("interpreted_checks", module_file)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
results = {}
for case, (fn, kwargs) in json.load(open(cases_file)).items():
    try:
        getattr(mod, fn)(**kwargs)
        results[case] = None
    except Exception:
        results[case] = traceback.format_exc()
    json.dump(results, open(results_file, "w"))
"""


class Child:
    """One interpreter child running `cases` of `module_file`: started at most once, by `start` (at
    low priority from `prestart`'s thread, which fills a core the serial suite leaves idle) or by the
    first `results` call. Its output goes to files, so a child nobody waits on yet cannot block."""

    def __init__(self, module_file: str | Path, cases: Cases, env: dict[str, str] | None = None,
                 timeout_s: float = 600.0) -> None:
        self.module_file, self.cases, self.env, self.timeout_s = str(module_file), cases, env, timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._results: dict[str, str | None] | None = None
        self._stopped = False

    def start(self, *, low_priority: bool = False) -> subprocess.Popen | None:
        """The child's process, started now if it was not; None once `stop` ran (the session ended)."""
        with self._lock:
            if self._stopped:
                return None
            if self._proc is None:
                self._tmp = tempfile.TemporaryDirectory()
                tmp = Path(self._tmp.name)
                (tmp / "cases.json").write_text(json.dumps(self.cases))
                with open(tmp / "stderr", "w") as err:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-c", _CHILD, self.module_file, str(tmp / "cases.json"),
                         str(tmp / "results.json")],
                        env={**os.environ, "TRITON_INTERPRET": "1", **(self.env or {})},
                        stdout=subprocess.DEVNULL, stderr=err)
                if low_priority:  # (not preexec_fn: unsafe in a process with threads)
                    os.setpriority(os.PRIO_PROCESS, self._proc.pid, 19)
            return self._proc

    def results(self) -> dict[str, str | None]:
        """{case: None | the traceback}; a case the child did not reach (it crashed or ran past
        `timeout_s` from this call) gets the child's exit status and stderr."""
        proc = self.start()
        assert proc is not None, "results() after the session ended"
        with self._lock:
            if self._results is None:
                try:
                    proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                tmp = Path(self._tmp.name)
                done = tmp / "results.json"
                results = json.loads(done.read_text()) if done.exists() else {}
                if len(results) < len(self.cases):  # the child died (or was killed) before the rest
                    missing = (f"the interpreter child exited with {proc.returncode} before this case:\n"
                               f"{(tmp / 'stderr').read_text()[-4000:]}")
                    results = {case: results.get(case, missing) for case in self.cases}
                self._results = results
                self._tmp.cleanup()
            return self._results

    def stop(self) -> None:
        """Kill the child if it still runs, and start none after this (the session ends before a test
        waited for it: `prestart`'s thread must not start the next child then)."""
        with self._lock:
            self._stopped = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()


def prestart(children: list[Child]) -> threading.Thread:
    """Run `children` one after another at nice 19 on a daemon thread, in the order the session will
    need them. The suite runs its tests serially, mostly waiting on servers, so this fills the idle
    core; a test that needs a child first starts it itself."""
    def run() -> None:
        for child in children:
            proc = child.start(low_priority=True)
            if proc is None:  # the session ended
                return
            proc.wait()

    thread = threading.Thread(target=run, name="interpreter-prestart", daemon=True)
    thread.start()
    return thread


def check_names(path: str | Path) -> list[str]:
    """The module's `check_*` functions, in file order, without importing it (collection stays cheap)."""
    tree = ast.parse(Path(path).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


class Checks(Child):
    """A test module's interpreter child, as its module attribute `CHECKS` (which conftest prestarts
    for the selected modules). Its cases are the module's argument-free `check_*` functions unless
    `cases` names them:

        CHECKS = interpret.Checks(__file__, env={"K3_KERNELS": "triton"})

        @pytest.mark.parametrize("name", CHECKS.names)
        def test_under_interpreter(name):
            CHECKS.assert_passed(name)
    """

    def __init__(self, path: str | Path, env: dict[str, str] | None = None, timeout_s: float = 600.0,
                 cases: Cases | None = None) -> None:
        path = Path(path).resolve()
        if cases is None:
            cases = {n.removeprefix("check_"): (n, {}) for n in check_names(path)}
        super().__init__(path, cases, env, timeout_s)
        self.names = list(cases)

    def assert_passed(self, name: str) -> None:
        error = self.results()[name]
        if error is not None:
            pytest.fail(f"check {name!r} failed under TRITON_INTERPRET=1:\n{error}", pytrace=False)


def triton_and_reference(run: Callable[[], Any]) -> tuple[Any, Any, list[str]]:
    """run() with K3_KERNELS=triton (the switch reloaded, so every op takes its Triton kernel where its
    verifier accepts the call), then again inside `kernels.reference_ops()`. Returns (triton result,
    reference result, the switch's log lines); the switch is left as the environment had it."""
    import importlib
    import logging

    import k3backend.kernels

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("k3backend.kernels")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = os.environ.get("K3_KERNELS")
    os.environ["K3_KERNELS"] = "triton"
    try:
        kernels = importlib.reload(k3backend.kernels)
        fast = run()
        with kernels.reference_ops():
            ref = run()
    finally:
        if before is None:
            os.environ.pop("K3_KERNELS")
        else:
            os.environ["K3_KERNELS"] = before
        importlib.reload(k3backend.kernels)
        logger.removeHandler(handler)
    return fast, ref, seen


GUARD = 4096  # NaN elements after each poisoned buffer (at least its own size): what a store past its end hits


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside the block torch.empty and torch.empty_like return NaN-filled floating tensors, each
    followed by a NaN guard region. An op that leaves an element of a buffer it allocated unwritten
    then fails its comparison; one that writes past the end (a store without its mask) fails here
    with an assertion instead of corrupting memory (under the interpreter: crashing the child)."""
    import torch

    real, real_like = torch.empty, torch.empty_like
    guarded: list[tuple[torch.Tensor, int, list[int]]] = []

    def poison(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        n = t.numel()
        buf = real(n + max(GUARD, n), dtype=t.dtype, device=t.device).fill_(float("nan"))
        guarded.append((buf, n, list(t.shape)))
        return buf.as_strided(t.size(), t.stride())  # the layout torch chose (dense: spans exactly n)

    torch.empty = lambda *args, **kwargs: poison(real(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poison(real_like(*args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real, real_like
    for buf, n, shape in guarded:
        past = int((~buf[n:].isnan()).sum())
        assert past == 0, (f"wrote {past} elements past the end of a {shape} {buf.dtype} buffer allocated "
                           f"with torch.empty or empty_like (a store without its mask?)")
