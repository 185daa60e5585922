"""Feed-forward layers (K3_LM.md §7): dense GLU MLP and the (latent) MoE with shared experts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3backend import kernels
from k3backend.config import MXFP4, MXFP4_GROUP, TextConfig
from k3backend.model.linear import Linear
from k3backend.model.norm import RMSNorm
from k3backend.model.overlap import Branch
from k3backend.model.parallel import SINGLE, Parallel, ParallelConfigError, add_in_turn, packed_rows


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

    def __init__(self, cfg: TextConfig, hidden: int, intermediate: int, par: Parallel = SINGLE,
                 what: str = "intermediate_size") -> None:
        """Under TP gate and up are column-split (this rank's rows [gate_r ; up_r] keep SiTU pairs
        aligned) and down row-split (§9.2)."""
        super().__init__()
        self.par = par
        n = par.split(intermediate, what)
        self.gate_up_proj = Linear(hidden, 2 * n)
        self.down_proj = Linear(n, hidden)
        self.act = make_act(cfg, routed=False)

    def packing(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint name -> (packed parameter, first row, end row), relative to this module."""
        n = self.down_proj.in_features
        return packed_rows("gate_up_proj.weight", [("gate_proj.weight", n), ("up_proj.weight", n)])

    def shards(self) -> dict[str, tuple[int, int, int]]:
        n, r = self.down_proj.in_features, self.par.tp_rank
        return {"gate_proj.weight": (0, r * n, (r + 1) * n), "up_proj.weight": (0, r * n, (r + 1) * n),
                "down_proj.weight": (1, r * n, (r + 1) * n)}

    def forward(self, x: torch.Tensor, *, fp32_front: bool = False, reduce: bool = True,
                adds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """fp32_front: feed the activation the unrounded GEMM output (SGLang's fused MoE front, §7.6).
        reduce=False leaves this rank's partial sum (the MoE reduces it with the routed latent).
        adds: the residual, added in turn after the reduction."""
        h = kernels.glu_linear(x, self.gate_up_proj.weight, self.act, fp32_front)
        return self.par.row_parallel(self.down_proj, h, adds) if reduce else self.down_proj(h)  # §9.3 item 3


class Gate(nn.Module):
    """Router weights: `gate.weight [E, D]` and `e_score_correction_bias [E]`, both kept in fp32
    (the router computes in fp32; a bf16 checkpoint's weights convert exactly)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class Experts(nn.Module):
    """Routed expert weights stacked per layer: w13 [E_r, 2I_r, D] = [w1 ; w3], w2 [E_r, D, I_r].

    The checkpoint's per-expert `experts.{e}.w1/w2/w3` tensors are stacked at load time. This rank
    holds experts [e0, e0 + E_r) of its expert group (EP) and the intermediate slice of its moe-TP
    rank in each (w1/w3 rows, w2 columns; §9.2, §9.4).

    quant "mxfp4" (§7.7): the checkpoint's `weight_packed` / `weight_scale` stay packed, 4.25 bits
    a weight: w13 [E_r, 2I_r, D/2] and w2 [E_r, D, I_r/2] uint8 (two E2M1 codes a byte, low nibble
    first), w13_scale [E_r, 2I_r, D/32] and w2_scale [E_r, D, I_r/32] uint8 (E8M0 exponents). The
    experts op expands them in registers; nothing is dequantized in memory.
    """

    def __init__(self, num_experts: int, dim: int, intermediate: int, par: Parallel = SINGLE,
                 quant: str | None = None) -> None:
        super().__init__()
        self.par, self.quant = par, quant
        n_local = par.split(num_experts, "num_experts", par.ep_size)
        i_local = par.split(intermediate, "moe_intermediate_size", par.moe_tp_size)
        self.e0 = par.ep_rank * n_local  # global id of the first local expert
        self.intermediate = i_local
        if quant is None:
            self.w13 = nn.Parameter(torch.zeros(n_local, 2 * i_local, dim))
            self.w2 = nn.Parameter(torch.zeros(n_local, dim, i_local))
            return
        if quant != MXFP4:
            raise ValueError(f"routed experts: unknown storage {quant!r}")
        if i_local % MXFP4_GROUP:
            raise ParallelConfigError(f"moe_intermediate_size / moe-TP = {i_local} is not a multiple of the MXFP4 "
                                      f"group {MXFP4_GROUP} (tensor_parallel_size {par.tp_size}, "
                                      f"expert_parallel_size {par.ep_size})")
        def u8(*shape: int) -> nn.Parameter:  # integer parameters cannot require grad
            return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)

        self.w13, self.w13_scale = u8(n_local, 2 * i_local, dim // 2), u8(n_local, 2 * i_local, dim // MXFP4_GROUP)
        self.w2, self.w2_scale = u8(n_local, dim, i_local // 2), u8(n_local, dim, i_local // MXFP4_GROUP)

    def local_expert(self, e: int) -> int | None:
        """This rank's index of global expert e, or None when another expert group holds it."""
        return e - self.e0 if self.e0 <= e < self.e0 + self.w13.shape[0] else None

    def shard(self, w: str) -> tuple[int, int, int]:
        """(dim, start, end) of checkpoint tensor experts.{e}.{w} this rank loads: its intermediate slice
        (for MXFP4, of the unpacked matrix: the loader maps it to bytes and groups)."""
        n, r = self.intermediate, self.par.moe_tp_rank
        return (1 if w == "w2" else 0, r * n, (r + 1) * n)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: kernels.Activation,
                scaling: float, norm: RMSNorm | None = None) -> torch.Tensor:
        """x [T, D], weights / local ids [T, k] -> this rank's Σ over its experts [T, D] (§7.4), then `norm` of it."""
        how = (act, scaling, None, 0.0) if norm is None else (act, scaling, norm.weight, norm.eps)
        ep = self.par.ep_size  # the kernels' tiles expect 1/ep of the assignments here
        if self.quant is None:
            return kernels.experts(x, weights, ids, self.w13, self.w2, *how, ep=ep)
        return kernels.experts_mxfp4(x, weights, ids, self.w13, self.w13_scale, self.w2, self.w2_scale, *how, ep=ep)


class MoE(nn.Module):
    """Sigmoid-routed MoE, optionally latent (§7.2–7.5). Returns bf(routed_up + shared), without the prefix add.

    Latent (K3): zl = bf(h·W_downᵀ) → experts in the latent → bf(Σ) → RMSNorm → up-projection (on one rank
    the norm runs in the experts' last kernel; under TP or host_ep after the all-reduce of the partial sums).
    Plain (Kimi-Linear): experts at the hidden size, output routed + shared.
    """

    def __init__(self, cfg: TextConfig, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.par = par
        D, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor
        latent = cfg.routed_expert_hidden_size
        self.gate = Gate(E, D)
        if latent is not None:
            self.routed_expert_down_proj = Linear(D, latent)
            self.routed_expert_up_proj = Linear(latent, D)
            self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.latent = latent is not None
        self.experts = Experts(E, latent or D, cfg.moe_intermediate_size, par, cfg.routed_expert_quant)
        self.shared_experts = (MLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts, par,
                                   "moe_intermediate_size * num_shared_experts") if cfg.num_shared_experts > 0 else None)
        self.act = make_act(cfg, routed=True)

    def forward(self, h: torch.Tensor, adds: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """h: [T, D] normed MLP input. Returns [T, D], plus `adds` (the residual, added in turn).

        Routing runs identically on every rank; each rank's experts see global ids shifted to its
        own (others' fall outside and are skipped); the partial sums are reduced before the latent
        norm, together with the shared experts' partials, in one all-reduce (§9.3 item 4), over
        every host's ranks under placement host_ep (`Parallel.moe_share`).
        """
        shared = None if self.shared_experts is None else Branch(  # beside the router and the routed experts
            lambda: self.shared_experts(h, fp32_front=self.latent, reduce=False), h.device)
        route = (h, self.gate.weight, self.gate.e_score_correction_bias)
        how = (self.top_k, self.n_group, self.topk_group, self.renormalize, 1.0)
        if self.latent:  # [T, k] weights and ids (fp32 logits inside), and zl [T, latent]: both read h
            w, ids, zl = kernels.moe_front(*route, self.routed_expert_down_proj.weight, *how)
        else:
            (w, ids), zl = kernels.router(*route, *how), h
        local_ids = ids - self.experts.e0 if self.experts.e0 else ids
        norm = self.routed_expert_norm if self.latent else None
        late = norm if self.par.moe_reduces else None  # a rank's partial sum: the norm waits for the all-reduce
        out = self.experts(zl, w, local_ids, self.act, self.scaling, norm if late is None else None)
        shared = None if shared is None else self.par.moe_share(shared.join())
        if not self.latent:
            return add_in_turn(self.par.all_reduce(out if shared is None else out + shared, moe=True), adds)
        if shared is None:
            out = self.par.all_reduce(out, moe=True)
        else:
            out, shared = self.par.all_reduce_pair(out, shared, moe=True)
        if late is not None:
            out = late(out)
        return self.routed_expert_up_proj(out, adds if shared is None else (shared, *adds))  # bf(bf(up + sh) + ...)
