"""The sm_90a compile tests again, under the Triton that the GPU image runs (3.6; the venv has 3.9).

The two versions lay out the same kernel differently (registers, shared memory, where a layout
conversion goes), and a kernel one accepts the other may refuse. scripts/setup-env installs the GPU's
Triton beside the venv (`<venv>/lib/triton-gpu`); a child pytest imports it first and runs every
`*hopper*` test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TRITON = Path(sys.prefix) / "lib" / "triton-gpu"
HOPPER_TEST = re.compile(r"^def (test_\w*hopper\w*)\(", re.M)


def hopper_tests() -> dict[Path, list[str]]:
    """Every other test file's sm_90a compile tests (`test_*hopper*`), by file."""
    found = {f: HOPPER_TEST.findall(f.read_text()) for f in sorted((ROOT / "tests").glob("test_*.py"))
             if f.resolve() != Path(__file__).resolve()}
    return {f: names for f, names in found.items() if names}


def test_kernels_compile_for_hopper_under_the_gpu_images_triton():
    spec = (GPU_TRITON / ".spec").read_text().strip() if (GPU_TRITON / ".spec").exists() else None
    assert spec and (GPU_TRITON / "triton" / "__init__.py").exists(), \
        f"no GPU Triton in {GPU_TRITON}: run scripts/setup-env"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(GPU_TRITON), str(ROOT / "src")]))
    env.pop("TRITON_INTERPRET", None)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert spec == f"triton=={version}", f"the child imports triton {version}, setup-env installed {spec}"
    tests = hopper_tests()
    n = sum(len(names) for names in tests.values())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "hopper",
                          *map(str, tests)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"sm_90a compile tests under triton {version} failed:\n{tail}"
    passed = re.search(r"\b(\d+) passed", run.stdout)  # a parametrized test passes once per case
    assert passed and int(passed.group(1)) >= n and "skipped" not in run.stdout, \
        f"expected the {n} compile tests to run:\n{tail}"
