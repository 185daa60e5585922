"""Kimi Delta Attention layer (K3_LM.md §5): projections, short conv, gates, recurrence, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from k3backend import kernels
from k3backend.config import TextConfig
from k3backend.model.cache import ForwardBatch, KDAState
from k3backend.model.norm import RMSNorm

O_NORM_EPS = 1e-5  # hard-coded in SGLang whatever rms_norm_eps says (§5.7)


class KDA(nn.Module):
    """One KDA layer. Parameter names follow the checkpoint (`self_attn.*`, §8.1).

    Two output-gate variants: full rank (`g_proj`, K3) or low rank (`g_a_proj`/`g_b_proj`,
    Kimi-Linear); two forget gates: lower-bounded (K3) or softplus (Kimi-Linear).
    """

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        lac = cfg.linear_attn_config
        self.H, self.K, self.V = lac.num_heads, lac.head_dim, cfg.kda_v_head_dim
        self.W = lac.short_conv_kernel_size
        self.lower_bound = lac.gate_lower_bound
        self.full_rank_gate = lac.use_full_rank_gate
        D, P, PV = cfg.hidden_size, self.H * self.K, self.H * self.V
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, PV, bias=False)
        # Depthwise conv weights [C, 1, W], fp32 on disk and in SGLang; nn.Conv1d only holds them.
        self.q_conv1d = nn.Conv1d(P, P, self.W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, self.W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(PV, PV, self.W, groups=PV, bias=False)
        self.b_proj = nn.Linear(D, self.H, bias=False)
        self.f_a_proj = nn.Linear(D, self.K, bias=False)
        self.f_b_proj = nn.Linear(self.K, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.H))  # one per head; checkpoints pad it (§13)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        if self.full_rank_gate:
            self.g_proj = nn.Linear(D, PV, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, self.K, bias=False)
            self.g_b_proj = nn.Linear(self.K, PV, bias=False)
        self.o_norm = RMSNorm(self.V, O_NORM_EPS)  # weight shared by all heads; applied gated below
        self.o_proj = nn.Linear(PV, D, bias=False)

    @property
    def conv_channels(self) -> int:
        return 2 * self.H * self.K + self.H * self.V

    def new_state(self, dtype: torch.dtype, device: torch.device) -> KDAState:
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return KDAState(conv=torch.zeros(self.W - 1, self.conv_channels, dtype=dtype, device=device),
                        S=torch.zeros(self.H, self.K, self.V, dtype=state_dtype, device=device))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: list[KDAState]) -> torch.Tensor:
        """x: [T, D] normed attention input (flat over the batch). Returns [T, D]; updates `states`."""
        T = x.shape[0]
        H, K, V = self.H, self.K, self.V
        xqkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3P] raw rows
        z = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))  # [T, PV]
        b = self.b_proj(x)  # [T, H]
        f = self.f_b_proj(self.f_a_proj(x)).view(T, H, K)  # [T, H, K]
        g = kernels.kda_gate(f, self.dt_bias, self.A_log, self.lower_bound)  # [T, H, K] fp32
        beta = torch.sigmoid(b.to(g.dtype))  # [T, H]
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)  # [3P, W]

        outs = []
        offsets = torch.tensor([0] + batch.seq_lens).cumsum(0).tolist()
        for i, st in enumerate(states):
            sl = slice(offsets[i], offsets[i + 1])
            qkv, st.conv = kernels.short_conv(xqkv[sl], conv_w, st.conv)  # bf(silu(conv))
            q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
            n = q.shape[0]
            q = kernels.l2_norm(q.view(n, H, K)) * K ** -0.5
            k = kernels.l2_norm(k.view(n, H, K))
            v = v.view(n, H, V)
            core = kernels.kda_recurrent if n == 1 else kernels.kda_chunked
            o, st.S = core(q, k, v, g[sl], beta[sl], st.S)
            outs.append(o.to(x.dtype))  # out_t = bf(o_t)
        o = torch.cat(outs, dim=0)  # [T, H, V]
        y = kernels.gated_rms_norm(o, z.view(T, H, V), self.o_norm.weight, O_NORM_EPS)
        return self.o_proj(y.reshape(T, H * V))
