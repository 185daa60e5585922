"""The sampler's draw (SERVING.md [SMP-6] step 8) as an op: the exponential race over filtered
probabilities, argmax_i p_i / E_i with E_i = -log u_i.

The uniforms are splitmix64 of the counter (seed, output position, token id), so a row's draw
depends on its own seed and position only ([SMP-7]). `engine/sampler_ref.py` (one request) and
`engine/sampler.py` (the batch) both draw through these definitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic): multiplication wraps.
GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
MIX2 = -7723592293110705685  # 0x94D049BB133111EB
STEP = 0x632BE59BD9B4E019  # a second odd multiplier for the output position


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_bits(seeds: torch.Tensor, steps: torch.Tensor, n: int) -> torch.Tensor:
    """m [S, n] int64 in [0, 2**53) for rows (seed, step) and columns 0..n-1: splitmix64 of the counter."""
    col = torch.arange(n, dtype=torch.int64, device=seeds.device)
    z = (seeds[:, None] + steps[:, None] * STEP + col[None, :] * GOLDEN) * GOLDEN
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, n: int) -> torch.Tensor:
    """u [S, n] float64 in (0, 1): (m + 0.5) * 2**-53 of `counter_bits` (m + 0.5 rounds to even from 2**52)."""
    return (counter_bits(seeds, steps, n).to(torch.float64) + 0.5) * 2.0 ** -53


def softmax_rows(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[SMP-6] step 4: float32 softmax(x / temperature) of each row, x the logits as float32.
    logits [S, V] in any float dtype (bf16 and fp16 convert exactly); temperature [S] float32, > 0."""
    return torch.softmax(logits.float() / temperature.float()[:, None], dim=-1)


DRAW_ROWS = 32  # rows of a batch the reference draws at a time: bounds its [rows, V] float64 temporaries


def race_draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """ids [S] int64: argmax_i probs[s, i] / -log u[s, i] in float64 (ties to the lowest id).

    probs [S, V] float32 (filtered, zeros where excluded); seeds, steps [S] int64.
    """
    ids = []
    for r in range(0, probs.shape[0], DRAW_ROWS):
        u = counter_uniform(seeds[r:r + DRAW_ROWS], steps[r:r + DRAW_ROWS], probs.shape[1])
        ids.append(torch.argmax(probs[r:r + DRAW_ROWS].double() / -torch.log(u), dim=-1))
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=probs.device)


MASS_BITS = 32  # top-p mass in units of 2**-32: exact integer sums, the same in any order


def mass_units(probs: torch.Tensor) -> torch.Tensor:
    """floor(p * 2**32) as float64: the top-p mass of each probability, an integer (exact below 2**53)."""
    return torch.floor(probs.double() * 2.0 ** MASS_BITS)


def top_k_top_p(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """[SMP-6] steps 5-6 for rows of probabilities: zeros past each row's top-k and top-p.

    probs [S, V] float32 in [0, 1]; per row a top-k >= 1 (>= V: none) and a top-p (>= 1: none). A
    row keeps the first min(k, n) ids of its stable descending sort (ties: lower id first), n the
    smallest prefix whose mass reaches ceil(top_p * the top-k's mass), masses in `mass_units`.
    """
    V = probs.shape[1]
    top_k = torch.tensor(top_k, dtype=torch.int64, device=probs.device)
    top_p = torch.tensor(top_p, dtype=torch.float64, device=probs.device)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    pos = torch.arange(V, device=probs.device)[None, :]
    keep = pos < top_k[:, None]
    q = torch.where(keep, mass_units(sorted_probs), 0.0)
    target = torch.ceil(top_p[:, None] * q.sum(-1, keepdim=True))
    n = (q.cumsum(-1) < target).sum(-1, keepdim=True) + 1
    keep &= (pos < n) | (top_p[:, None] >= 1.0)
    return torch.zeros_like(probs).scatter(1, order, torch.where(keep, sorted_probs, 0.0))
