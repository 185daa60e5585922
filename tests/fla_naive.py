"""fla-core's plain-torch reference modules, loaded by file path (`import fla.ops` needs a GPU)."""

import importlib.util
from pathlib import Path

FLA = Path(importlib.util.find_spec("fla").submodule_search_locations[0])


def load_fla(rel: str, name: str):
    """Execute fla/<rel> as a stand-alone module named `name`."""
    spec = importlib.util.spec_from_file_location(name, FLA / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
