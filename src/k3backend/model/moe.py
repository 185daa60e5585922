"""Feed-forward layers (K3_LM.md §7): dense GLU MLP and the (latent) MoE with shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3backend import kernels
from k3backend.config import TextConfig
from k3backend.model.norm import RMSNorm


def make_act(cfg: TextConfig, *, routed: bool) -> kernels.Activation:
    """The GLU activation of [.., 2I] -> [.., I] as data: SiTU with the config's (β, λ), or SiLU (§2.3, §2.4)."""
    if cfg.hidden_act == "silu":
        return kernels.Activation("silu")
    beta, lam = cfg.situ_betas(routed)
    return kernels.Activation("situ", beta, lam)


class MLP(nn.Module):
    """GLU MLP: down(act(gate(x), up(x))). Dense layers and the shared experts (§7.1, §7.5).

    gate_proj and up_proj are packed into gate_up_proj = [gate ; up], their runtime layout.
    """

    def __init__(self, cfg: TextConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = make_act(cfg, routed=False)

    def packing(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint name -> (packed parameter, first row, end row), relative to this module."""
        n = self.down_proj.in_features
        return {"gate_proj.weight": ("gate_up_proj.weight", 0, n), "up_proj.weight": ("gate_up_proj.weight", n, 2 * n)}

    def forward(self, x: torch.Tensor, *, fp32_front: bool = False) -> torch.Tensor:
        """fp32_front: feed the activation the unrounded GEMM output (SGLang's fused MoE front, §7.6)."""
        return self.down_proj(kernels.glu_linear(x, self.gate_up_proj.weight, self.act, fp32_front))


class Gate(nn.Module):
    """Router weights: `gate.weight [E, D]` and `e_score_correction_bias [E]`, both kept in fp32
    (the router computes in fp32; a bf16 checkpoint's weights convert exactly)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class Experts(nn.Module):
    """Routed expert weights stacked per layer: w13 [E, 2I, D] = [w1 ; w3], w2 [E, D, I].

    The checkpoint's per-expert `experts.{e}.w1/w2/w3` tensors are stacked at load time.
    """

    def __init__(self, num_experts: int, dim: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, dim))
        self.w2 = nn.Parameter(torch.zeros(num_experts, dim, intermediate))


class MoE(nn.Module):
    """Sigmoid-routed MoE, optionally latent (§7.2–7.5). Returns bf(routed_up + shared), without the prefix add.

    Latent (K3): zl = bf(h·W_downᵀ) → experts in the latent → bf(Σ) → RMSNorm → up-projection.
    Plain (Kimi-Linear): experts at the hidden size, output routed + shared.
    """

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        D, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor
        latent = cfg.routed_expert_hidden_size
        self.gate = Gate(E, D)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(D, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, D, bias=False)
            self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.latent = latent is not None
        self.experts = Experts(E, latent or D, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts)
                               if cfg.num_shared_experts > 0 else None)
        self.act = make_act(cfg, routed=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, D] normed MLP input. Returns [T, D]."""
        a = kernels.acc_dtype(h)
        logits = F.linear(h.to(a), self.gate.weight.to(a))  # fp32 router logits [T, E] (no copy: fp32 at load)
        w, ids = kernels.route(logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                               self.topk_group, self.renormalize, 1.0)
        zl = self.routed_expert_down_proj(h) if self.latent else h  # [T, latent]
        out = kernels.experts(zl, w, ids, self.experts.w13, self.experts.w2, self.act, self.scaling)
        if self.latent:
            if self.routed_expert_norm is not None:
                out = self.routed_expert_norm(out)
            out = self.routed_expert_up_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h, fp32_front=self.latent)
        return out
