"""RMSNorm module (K3_LM.md §2.2); the math lives in `kernels.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from k3backend import kernels


class RMSNorm(nn.Module):
    """Single-rounding RMSNorm: bf(x32·rsqrt(mean(x32²)+eps)·w32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)
