"""Run a test module's kernel checks in a fresh Python process under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET once, when it is first imported, and another test module may already
have imported it in this pytest process; so the checks run in a subprocess of their own. One
subprocess runs every check of a module (the imports cost seconds); each pytest test then reports
its own check's outcome.

    CHECKS = interpret.Checks(__file__)        # module level

    @CHECKS.register
    def check_decode_matches_reference(): ...  # plain function, runs in the subprocess

    def test_decode_matches_reference(): CHECKS.result("check_decode_matches_reference")
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

_RUNNER = r"""
import importlib.util, json, sys, time, traceback
path, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
spec = importlib.util.spec_from_file_location("_interpreted_checks", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
out = {}
for name in names:
    t0 = time.perf_counter()
    try:
        getattr(mod, name)()
        out[name] = {"ok": True, "s": time.perf_counter() - t0}
    except BaseException:
        out[name] = {"ok": False, "s": time.perf_counter() - t0, "error": traceback.format_exc()}
print("@@CHECKS@@" + json.dumps(out))
"""


@contextlib.contextmanager
def poisoned_empty():
    """Inside the block torch.empty returns NaN-filled floating tensors: an op that leaves an element
    of a buffer it allocated unwritten then fails its comparison."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


class Checks:
    """The interpreted checks of one test module, run together once, on the first `result()`."""

    def __init__(self, module_file: str, timeout_s: float = 600.0) -> None:
        self.path = str(Path(module_file).resolve())
        self.timeout_s = timeout_s
        self.names: list[str] = []
        self._results: dict[str, dict] | None = None
        self._failure = ""

    def register(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.names.append(fn.__name__)
        return fn

    def _run(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", _RUNNER, self.path, *self.names], env=env, text=True,
                              capture_output=True, timeout=self.timeout_s)
        marker = [line for line in proc.stdout.splitlines() if line.startswith("@@CHECKS@@")]
        if proc.returncode != 0 or not marker:
            self._results = {}
            self._failure = (f"interpreted checks exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
            return
        self._results = json.loads(marker[-1][len("@@CHECKS@@"):])

    def result(self, name: str) -> None:
        """Fail the calling test unless check `name` passed in the interpreted run."""
        if name not in self.names:
            raise KeyError(f"{name} is not a registered check of {self.path}")
        if self._results is None:
            self._run()
        r = self._results.get(name)
        if r is None:
            pytest.fail(self._failure or f"{name}: no result", pytrace=False)
        if not r["ok"]:
            pytest.fail(f"{name} (TRITON_INTERPRET=1, {r['s']:.1f} s):\n{r['error']}", pytrace=False)
