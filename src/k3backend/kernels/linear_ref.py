"""Torch reference of the model's projections (no bias anywhere in the LM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, adds: Sequence[torch.Tensor] = (),
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·wᵀ in x's dtype (fp32 accumulation, one rounding: cuBLAS's on a GPU), then each of `adds`
    added in turn, rounding after each: the residual adds that end a layer. gate [M, K]: the input is
    x ⊙ σ(gate) instead, each rounded (MLA's output gate, §6.4: bf(O ⊙ bf(σ(z))))."""
    if gate is not None:
        x = x * torch.sigmoid(gate)
    y = F.linear(x, w)
    for a in adds:
        y = y + a
    return y
