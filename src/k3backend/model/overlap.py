"""A branch of a layer on a side stream: work that does not depend on the main line's next kernels runs
beside them. The MoE layer's shared experts read only the layer input, so they run while the router and
the routed experts run on the current stream; a decode step's small kernels leave most SMs idle, and two
lines of them fill more. Inside a CUDA graph capture the branch becomes parallel graph nodes.

`K3_OVERLAP` (read once, here): `on`, the default, or `off`, which runs every branch inline, in order: the
same kernels with the same inputs, so the outputs are bit-equal (`B_ENV=K3_OVERLAP=off SAME=1
bench/gpu_ab.sh` checks the decode graphs' logits; on an H100 at `small` the branch took the decode
replays 5 % faster at batch 1 to 64).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

MODE = os.environ.get("K3_OVERLAP", "on").strip().lower()
if MODE not in ("on", "off"):
    raise ValueError(f"K3_OVERLAP must be on or off, got {MODE!r}")

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


class Branch:
    """`fn()` started on the device's side stream where the current stream is now; `join()` makes the current
    stream wait for it and returns its result. Memory: the branch's inputs stay alive in the caller until the
    join, and the side stream's next branch starts after the current stream has used this one's outputs, so
    the caching allocator never hands out a block that one stream still reads."""

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device) -> None:
        self.main = None
        if MODE == "off" or device.type != "cuda":
            self.out = fn()
            return
        self.main = torch.cuda.current_stream(device)
        side = _SIDE.get(device)
        if side is None:
            side = _SIDE[device] = torch.cuda.Stream(device)
        side.wait_stream(self.main)
        with torch.cuda.stream(side):
            self.out = fn()
        self.side = side

    def join(self) -> torch.Tensor:
        if self.main is not None:
            self.main.wait_stream(self.side)
        return self.out
