"""Project rule: code, docs and scripts name no package registry's host (pip's default index needs
no URL; a PyTorch CUDA wheel index is the user's choice, described in prose, docker/README.md).

The pattern is built from name fragments so that this file does not name a host itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTRY_WORDS = ("pypi", "pythonhosted", "pytorch", "npmjs", "debian", "ubuntu", "anaconda", "conda")
HOST = re.compile(r"\b[\w.-]*(?:" + "|".join(REGISTRY_WORDS) + r")[\w-]*\.(?:org|com|io|net|dev)\b", re.IGNORECASE)


def test_no_package_registry_host_is_named():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    hits = []
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        hits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in HOST.finditer(text)]
    assert not hits, "package registry hosts named (describe them in prose instead):\n" + "\n".join(hits)
