"""Torch reference of the model's projections (no bias anywhere in the LM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, adds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """y = x·wᵀ in x's dtype (fp32 accumulation, one rounding: cuBLAS's on a GPU), then each of `adds`
    added in turn, rounding after each: the residual adds that end a layer."""
    y = F.linear(x, w)
    for a in adds:
        y = y + a
    return y
