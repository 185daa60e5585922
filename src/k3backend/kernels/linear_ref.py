"""Torch reference of the model's projections (no bias anywhere in the LM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x·wᵀ in x's dtype (fp32 accumulation, one rounding: cuBLAS's on a GPU)."""
    return F.linear(x, w)
