"""Counts for a kernel's tail: work its grid's last program to finish does (the experts' sum after the down
GEMV, the route after the router GEMM, KDA's gated norm after a head's V blocks), a launch fewer on a decode
step's critical path. A program stores its results, waits for its threads (`tl.debug_barrier`), adds 1 to its
count (an acq_rel atomic: the program that sees n - 1 sees every other program's stores), and that program
does the tail, reading those stores past L1 (volatile loads), then sets the count back to 0.
"""

from __future__ import annotations

import torch


def done_count(w: torch.Tensor, n: int = 1) -> torch.Tensor | None:
    """n int32 counts, 0 between calls, for calls with the weight w, kept on w: one set per layer, so never shared by
    kernels in flight at once (unless one layer ran on two streams at once, which the model never does). None while
    a CUDA graph is being captured and w has none yet (then the caller launches the kernels without the tail; the
    engine's warm-up runs outside the capture first)."""
    done = getattr(w, "_k3_done", None)
    if done is None or done.device != w.device or done.numel() < n:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        # a graph captured with the old counts keeps their address: they must never be freed (and reused)
        w._k3_done_before = (*getattr(w, "_k3_done_before", ()), *(() if done is None else (done,)))
        done = w._k3_done = torch.zeros(max(n, 1), dtype=torch.int32, device=w.device)
    return done
