"""Run Triton kernel checks under the interpreter (`TRITON_INTERPRET=1`) on the CPU, in a child process.

triton reads TRITON_INTERPRET when it is first imported, and another test module of the same pytest
process may already have imported it (transformers and fla probe for it); so the checks of a kernel
test module run in a fresh interpreter that sets the variable first. A kernel test module defines
plain functions that raise on a mismatch and lists its cases as `{case id: (function name, kwargs)}`
(kwargs of str, int, float, bool or None); `run_checks(__file__, cases)` imports that module in the
child, runs every case and returns `{case id: None | the traceback}`. One child per module keeps the
start-up cost (torch, triton) to once. `Checks` does the same for a module whose cases are its
argument-free `check_*` functions.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
import sys
import tempfile
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


def run_checks(module_file: str, cases: Cases, env: dict[str, str] | None = None,
               timeout: float = 600.0) -> dict[str, str | None]:
    """Run `cases` of `module_file` in a child with TRITON_INTERPRET=1 (plus `env`); one result per case.

    A case the child did not reach (it crashed or timed out) gets the child's exit status and stderr.
    """
    with tempfile.TemporaryDirectory() as tmp:
        cases_file, results_file = Path(tmp, "cases.json"), Path(tmp, "results.json")
        cases_file.write_text(json.dumps(cases))
        child_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(module_file), str(cases_file), str(results_file)],
                              env=child_env, capture_output=True, text=True, timeout=timeout)
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
    missing = f"the interpreter child exited with {proc.returncode} before this case:\n{proc.stderr[-4000:]}"
    return {case: results[case] if case in results else missing for case in cases}


def check_names(path: str | Path) -> list[str]:
    """The module's `check_*` functions, in file order, without importing it (collection stays cheap)."""
    tree = ast.parse(Path(path).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


class Checks:
    """A module whose cases are its argument-free `check_*` functions, run on the first assert:

        CHECKS = interpret.Checks(__file__, env={"K3_KERNELS": "triton"})

        @pytest.mark.parametrize("name", CHECKS.names)
        def test_under_interpreter(name):
            CHECKS.assert_passed(name)
    """

    def __init__(self, path: str | Path, env: dict[str, str] | None = None, timeout_s: float = 600.0) -> None:
        self.path, self.env, self.timeout_s = str(Path(path).resolve()), env, timeout_s
        self.names = [n.removeprefix("check_") for n in check_names(self.path)]
        self._results: dict[str, str | None] | None = None

    def assert_passed(self, name: str) -> None:
        if self._results is None:
            self._results = run_checks(self.path, {n: (f"check_{n}", {}) for n in self.names}, self.env,
                                       self.timeout_s)
        error = self._results[name]
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
