"""Linear module of the LM's projections; the product lives in `kernels.linear`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3backend import kernels


class Linear(nn.Linear):
    """nn.Linear without bias (the checkpoint's names and layout) whose product is `kernels.linear`:
    a GEMV kernel at decode batch sizes, cuBLAS above. `adds`: residuals added in turn after the
    product (in the GEMV's epilogue where it runs); `gate`: the input times σ(gate) (in its prologue)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, adds: Sequence[torch.Tensor] = (),
                gate: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.linear(x, self.weight, adds, gate)
