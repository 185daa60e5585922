"""Attention Residuals (K3_LM.md §4): the score weights of one aggregation point."""

from __future__ import annotations

import torch
from torch import nn

from k3backend import kernels
from k3backend.model.norm import RMSNorm


class ResScore(nn.Module):
    """One aggregation point's `*_res_norm` (score norm weight) and `*_res_proj` ([1, H]) (§4.1).

    `mix(rows)` is the pre-norm softmax-weighted mixture of the candidate rows (§4.2); the score
    norm is used only for scoring, the mixture is over the raw rows.
    """

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(hidden, 1, bias=False)

    def mix(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return kernels.attn_res_mix(rows, self.norm.weight, self.proj.weight, self.norm.eps)

    def mix_norm(self, rows: list[torch.Tensor], norm: RMSNorm) -> torch.Tensor:
        """`norm(mix(rows))`, the sub-layer input, as one op (a kernel fuses the two)."""
        return kernels.attn_res_mix_norm(rows, self.norm.weight, self.proj.weight, self.norm.eps, norm.weight, norm.eps)
