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


@triton.jit
def prefetch(ptrs, mask, PDL: tl.constexpr):
    """Ask L2 for the lines at ptrs (where mask) before `enter`, so that the loads after the wait hit L2, not
    HBM. Safe for any address the kernel will read: L2 is the GPU's point of coherence, so a line that the
    previous kernel is still writing is updated there. Without PDL there is nothing to overlap: a no-op."""
    if PDL:
        asm: tl.constexpr = "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }"
        tl.inline_asm_elementwise(asm, "=r,l,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, k_start, k_end, STEP: tl.constexpr, PDL: tl.constexpr):
    """`prefetch` of columns [k_start, k_end) of the rows that start at row_ptrs [R] (a weight the kernel then
    streams), a K step of STEP columns at a time."""
    if PDL:
        LINE: tl.constexpr = 1024 // row_ptrs.dtype.element_ty.primitive_bitwidth  # columns in 128 bytes
        j = tl.arange(0, STEP // LINE if STEP >= LINE else 1) * LINE
        for k in range(k_start, k_end, STEP):
            prefetch(row_ptrs[:, None] + (k + j)[None, :], (k + j < k_end)[None, :], PDL)


def early(rows: int) -> bool:
    """Whether the kernels that can load before the wait (the router's L2 prefetch, the down GEMV's ids and
    weights) do so for a step of this many rows. One H100, `small`, MXFP4 experts, decode graph replays (ms):
    batch 1 1.817 -> 1.750 with both and the LM head's GEMV, but batch 2 / 4 / 8 1.995 / 2.486 / 3.119 ->
    2.027 / 2.514 / 3.141, although each alone was within 0.5 % of the tree before (f20b695) there; 16-64 rows
    within 0.6 %."""
    return rows == 1
