"""Programmatic dependent launch (Hopper and later). A kernel launched with `launch_pdl=True` may start
while the kernel before it in the stream is still running, so its launch and its loads of constant
data (weights) overlap that kernel's tail. It calls `enter` before it reads anything an earlier kernel
wrote or writes anything. `K3_PDL` (read once, here; `on` by default) turns it off: `off` launches
every kernel plainly, for an A/B measurement or a driver that mishandles it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


MODE = os.environ.get("K3_PDL", "on").strip().lower()
if MODE not in ("on", "off"):
    raise ValueError(f"K3_PDL must be on or off, got {MODE!r}")


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (K3_PDL on, sm_90+, compiled, not interpreted)."""
    if MODE == "off" or device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible, then let
    the next kernel launch: it starts at most one kernel ahead. Releasing it before the wait (so chains of
    small kernels could launch ahead and hold SM slots while waiting) made decode replays at 4-32 rows
    6-12 % slower than without PDL on the H200 (`small`); in this order every batch size gained."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_args(device: torch.device) -> dict[str, bool]:
    """A kernel's `PDL` constexpr and Triton's `launch_pdl` option, on or off together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}
