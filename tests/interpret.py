"""Run a test module's `check_*` functions under the Triton interpreter, in a fresh process.

triton reads TRITON_INTERPRET once, when it is imported, and another test module may already have
imported it in this pytest process; so the kernel checks run in a child process that sets the flag
before anything imports triton. The child imports the test module by path, runs every `check_*`
function (all of them, even after a failure) and prints one JSON line per check; the parent turns each
line into one pytest test. Nothing skips: a check that cannot run fails with the child's output.

In a test module:

    CHECKS = interpret.Checks(__file__, env={"K3_KERNELS": "triton"})

    @pytest.mark.parametrize("name", CHECKS.names)
    def test_under_interpreter(name):
        CHECKS.assert_passed(name)

    def check_route_ids_equal_reference(): ...   # runs in the child, with TRITON_INTERPRET=1

Run one module's checks by hand: `TRITON_INTERPRET=1 python tests/interpret.py tests/test_x.py [name ...]`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

PREFIX = "check_"
MARK = "interpret-check: "


def check_names(path: str | Path) -> list[str]:
    """The module's `check_*` functions, in file order, without importing it (collection stays cheap)."""
    tree = ast.parse(Path(path).read_text())
    return [n.name[len(PREFIX):] for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(PREFIX)]


class Checks:
    """The interpreted checks of one test module; the child process runs once, on the first assert."""

    def __init__(self, path: str | Path, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> None:
        self.path = Path(path).resolve()
        self.env = env or {}
        self.timeout_s = timeout_s
        self.names = check_names(self.path)
        self._results: dict[str, dict] | None = None
        self._output = ""

    def _run(self) -> dict[str, dict]:
        env = {**os.environ, **self.env, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.path)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout_s)
            self._output = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            self._output = f"timed out after {self.timeout_s:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
        results = {}
        for line in self._output.splitlines():
            if line.startswith(MARK):
                r = json.loads(line[len(MARK):])
                results[r["name"]] = r
        return results

    def assert_passed(self, name: str) -> None:
        if self._results is None:
            self._results = self._run()
        r = self._results.get(name)
        if r is None:
            pytest.fail(f"check {name!r} did not report (child process output follows)\n{self._output[-6000:]}",
                        pytrace=False)
        if not r["ok"]:
            pytest.fail(f"check {name!r} failed under TRITON_INTERPRET=1 ({r['seconds']:.1f} s):\n{r['error']}",
                        pytrace=False)


def _main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    path = Path(argv[0]).resolve()
    sys.path.insert(0, str(path.parent))  # the test module's siblings (tolerances, ...), as pytest does
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py: tiny sizes, a shared 2-core machine
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wanted = argv[1:] or check_names(path)
    failed = 0
    for name in wanted:
        start = time.perf_counter()
        try:
            getattr(module, PREFIX + name)()
            ok, error = True, ""
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            ok, error = False, traceback.format_exc()
            failed += 1
        result = {"name": name, "ok": ok, "error": error, "seconds": time.perf_counter() - start}
        print(MARK + json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
