"""The Python interpreter child processes (worker ranks, the stub's guardian) are started with."""

from __future__ import annotations

import sys
from pathlib import Path


def python_executable() -> str:
    """This environment's interpreter: inside a Triton Python-backend stub, which embeds Python,
    sys.executable can be the stub binary itself."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return str(Path(sys.prefix) / "bin" / "python3")
