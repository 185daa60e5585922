"""What a dependency between two decode ops costs: a grid barrier inside one persistent kernel against a
kernel boundary (with and without programmatic dependent launch), in a CUDA graph as the decode step runs.

A batch-1 decode step is a chain of ~360 short kernels, most of them latency-bound (issue 17's 1.1 ms
target leaves ~1 µs a kernel above the bytes). A persistent kernel per layer block would replace kernel
boundaries by grid barriers; this measures that trade before anything is built on it.

    python3 bench/grid_barrier.py                      # a GPU; G programs (1 an SM and fewer), S stages

Each stage, every program reads what its neighbour wrote in the stage before and counts a mismatch: the
barrier (release on arrive, acquire on wait) must make those writes visible, as a kernel boundary does.
A spin limit ends a wait that never completes (counted, not hung). Prints µs per stage for each form.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from k3backend.kernels import pdl

SPIN_LIMIT = 1 << 22


@triton.jit
def _stage(buf, errors, s, p, G):
    """Stage s of program p: check the neighbour's stage s-1 value, then write this one."""
    if s > 0:
        q = (p + 1) % G
        seen = tl.load(buf + (s - 1) * G + q, volatile=True)
        tl.atomic_add(errors, (seen != (s - 1) * 1000 + q).to(tl.int32))
    tl.store(buf + s * G + p, s * 1000 + p)


@triton.jit
def _persistent_kernel(buf, counter, errors, G, S: tl.constexpr, LIMIT: tl.constexpr):
    """All S stages in one launch of G co-resident programs, a grid barrier after each: arrive with a release
    add once the program's threads are through the stage, wait with acquire loads (Triton turns the add of 0
    into `ld.global.gpu.acquire`, one thread, the result shared through shared memory)."""
    p = tl.program_id(0)
    for s in range(S):
        _stage(buf, errors, s, p, G)
        tl.debug_barrier()  # the program's threads are done with the stage (here one thread stores; a real one all)
        tl.atomic_add(counter, 1, sem="release", scope="gpu")
        spins = 0
        while (tl.atomic_add(counter, 0, sem="acquire", scope="gpu") < (s + 1) * G) & (spins < LIMIT):
            spins += 1
        tl.atomic_add(errors + 1, (spins >= LIMIT).to(tl.int32))


@triton.jit
def _stage_kernel(buf, errors, s, G, PDL: tl.constexpr):
    pdl.enter(PDL)
    _stage(buf, errors, s, tl.program_id(0), G)


def measure(G: int, S: int, iters: int) -> dict[str, tuple[float, list[int]]]:
    """Form -> (µs a stage, [neighbour mismatches, spin timeouts]) for G programs and S stages."""
    from kernels import time_fn

    dev = torch.device("cuda")
    buf = torch.zeros(S * G, dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    errors = torch.zeros(2, dtype=torch.int32, device=dev)

    def barrier() -> None:
        counter.zero_()
        _persistent_kernel[(G,)](buf, counter, errors, G, S=S, LIMIT=SPIN_LIMIT, num_warps=4)

    def launches(on: bool) -> None:
        for s in range(S):
            _stage_kernel[(G,)](buf, errors, s, G, PDL=on, launch_pdl=on, num_warps=4)

    out = {}
    for name, fn in (("barrier", barrier), ("PDL launches", lambda: launches(True)),
                     ("plain launches", lambda: launches(False))):
        errors.zero_()
        seconds = time_fn(fn, True, iters)
        torch.cuda.synchronize()
        out[name] = (seconds / S * 1e6, errors.tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("grid_barrier.py needs a GPU (under the interpreter the programs run one after another, so a "
                 "grid barrier cannot complete)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs, triton {triton.__version__}")
    for G in (sms, sms // 2, 32):
        for S in a.stages:
            row = measure(G, S, a.iters)
            print(f"G {G:4d} S {S:3d}  µs a stage: " + "  ".join(f"{n} {us:6.2f} {e}" for n, (us, e) in row.items()),
                  flush=True)
    print("[neighbour mismatches, spin timeouts] must be [0, 0]")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
