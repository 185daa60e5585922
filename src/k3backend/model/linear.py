"""The text model's projections: nn.Linear without bias whose product goes through `kernels.linear`,
the one place that picks cuBLAS or the few-row GEMV kernel (decode at small batch)."""

from __future__ import annotations

import torch
from torch import nn

from k3backend import kernels


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return kernels.linear(x, self.weight)
        return kernels.linear(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
