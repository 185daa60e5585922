"""Programmatic dependent launch (Hopper and later). A kernel launched with `launch_pdl=True` may start
while the kernel before it in the stream is still running, so its launch and its loads of constant
data (weights) overlap that kernel's tail. It must call `wait` before it reads anything an earlier
kernel wrote or writes anything; `launch_next` lets the kernel after it start the same way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (sm_90+, compiled, not interpreted)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (it waits for this one to finish before its reads)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def launch_args(device: torch.device) -> dict[str, bool]:
    """A kernel's `PDL` constexpr and Triton's `launch_pdl` option, on or off together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}
