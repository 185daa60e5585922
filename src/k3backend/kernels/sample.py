"""Triton draw for the batched sampler: `race_draw` (kernels/sample_ref.py) in one pass over probs.

The reference materialises the [S, V] float64 uniforms of the splitmix64 counter hash (a dozen
int64 passes over the vocabulary) before its argmax; here each program hashes its block of token
ids in registers (uint64 arithmetic, the same bits), forms p / -log u in float64 and keeps its
block's maximum; a second, tiny argmax over the blocks picks the token. Ties go to the lowest id,
as torch.argmax's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3backend.kernels.norm import interpreting

BLOCK = 2048  # token ids per program: 80 programs per row at V = 163,840


@triton.jit
def _race_kernel(p_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr, V, s_p, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    ok = col < V
    p = tl.load(p_ptr + r.to(tl.int64) * s_p + col, mask=ok, other=0.0).to(tl.float64)
    seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + r).to(tl.uint64, bitcast=True)
    # sample_ref's STEP, GOLDEN, MIX1, MIX2 as the uint64 bits they stand for there
    z = (seed + step * 0x632BE59BD9B4E019 + col.to(tl.uint64) * 0x9E3779B97F4A7C15) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
    ratio = tl.where(ok, p / -tl.log(u), -1.0)
    best = tl.argmax(ratio, axis=0, tie_break_left=True)
    tl.store(val_ptr + r * NB + blk, tl.max(ratio, axis=0))
    tl.store(idx_ptr + r * NB + blk, (blk * BLOCK + best).to(tl.int64))


def race_draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """ids [S] int64: argmax_i probs[s, i] / -log u[s, i] (`sample_ref.race_draw`)."""
    S, V = probs.shape
    if S == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    nb = triton.cdiv(V, BLOCK)
    vals = torch.empty(S, nb, dtype=torch.float64, device=probs.device)
    idx = torch.empty(S, nb, dtype=torch.int64, device=probs.device)
    _race_kernel[(S, nb)](probs, seeds, steps, vals, idx, V, probs.stride(0), nb, BLOCK=BLOCK, num_warps=4)
    return idx.gather(1, vals.argmax(1, keepdim=True))[:, 0]


def race_draw_supports(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> tuple[bool, str]:
    if not interpreting() and not all(t.is_cuda for t in (probs, seeds, steps)):
        return False, "tensors not on a GPU (the kernel needs CUDA, or TRITON_INTERPRET=1)"
    if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(-1) != 1:
        return False, f"probs must be a float32 [S, V] tensor with contiguous rows, got {probs.dtype} {list(probs.shape)}"
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        return False, f"seeds / steps must be int64, got {seeds.dtype} / {steps.dtype}"
    return True, ""
