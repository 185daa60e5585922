"""K3 building blocks (K3_LM.md §2.4, §4, §6, §7, §13) against independent references.

The expected values come from transcriptions of the spec written here (loops over tokens, heads and
experts, in the spec's own order) and from fla-core's `fla/ops/attnres/naive.py` (loaded by file
path: `import fla.ops` needs triton and a GPU). Our code is used only as the thing under test,
except that the whole-stack test calls our attention and MLP sub-layers as black boxes and
transcribes the Attention-Residual stream around them.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from k3backend import kernels
from k3backend.config import K3Config, TextConfig
from k3backend.model.lm import K3TextModel
from k3backend.model.mla import MLA
from k3backend.model.moe import MoE
from k3backend.presets import preset_config
from fla_naive import load_fla
from poolutil import Streams, one_prefill, params
from tolerances import tol

F64 = torch.float64
BF16 = torch.bfloat16


FLA_ATTNRES = load_fla("ops/attnres/naive.py", "fla_attnres_naive")


def tiny_text(**overrides) -> TextConfig:
    return dataclasses.replace(K3Config.from_dict(preset_config("tiny")).text, **overrides)


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random parameters at scales that keep activations O(1); in place, keeps each dtype."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=F64)
            if name.endswith("A_log"):
                v = torch.log(1 + 15 * torch.rand(p.shape, generator=g, dtype=F64))
            elif name.endswith(("dt_bias", "conv1d.weight")):
                v = 0.5 * r
            elif name.endswith("norm.weight"):
                v = 1 + 0.1 * r
            elif name.endswith("e_score_correction_bias"):
                v = 0.1 * r
            elif name.endswith("embed_tokens.weight"):
                v = r
            else:
                v = r / math.sqrt(p.shape[-1])
            p.copy_(v)
    return module


def randn(*shape, seed: int, dtype=F64, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)).to(dtype)


# ---------------------------------------------------------------- spec transcriptions
def acc(x: torch.Tensor) -> torch.dtype:
    """The spec's "fp32" arithmetic dtype: fp32, or fp64 for fp64 tensors."""
    return F64 if x.dtype == F64 else torch.float32


def spec_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§2.2: bf(x32 · 1/sqrt(mean(x32²) + eps) · w32), one rounding."""
    a = acc(x)
    x32 = x.to(a)
    r = 1 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + eps)
    return (x32 * r * w.to(a)).to(x.dtype)


def spec_situ(gu: torch.Tensor, beta: float, lam: float | None) -> torch.Tensor:
    """§2.4 in the input's arithmetic dtype, unrounded: β·tanh(g/β)·σ(g) · λ·tanh(u/λ)."""
    D = gu.shape[-1] // 2
    g, u = gu[..., :D], gu[..., D:]
    gate_out = beta * torch.tanh(g / beta) * torch.sigmoid(g)  # σ of the uncapped g
    up_out = u if lam is None else lam * torch.tanh(u / lam)
    return gate_out * up_out


def spec_mix(rows: list[torch.Tensor], ns: torch.Tensor, wp: torch.Tensor, eps: float) -> torch.Tensor:
    """§4.2: s_j = (Σ_h r_jh·cw_h)/sqrt(mean_h r_jh² + eps), cw = ns ⊙ wp; softmax; Σ_j p_j r_j in order j."""
    a = acc(rows[0])
    cw = ns.to(a) * wp.reshape(-1).to(a)
    r32 = [r.to(a) for r in rows]
    s = torch.stack([(r * cw).sum(-1) / torch.sqrt((r * r).mean(-1) + eps) for r in r32])  # [n+1, T]
    e = torch.exp(s - s.max(0).values)
    p = e / e.sum(0)
    mix = p[0, :, None] * r32[0]
    for j in range(1, len(rows)):
        mix = mix + p[j, :, None] * r32[j]
    return mix.to(rows[0].dtype)


def spec_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
               renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """§7.3 and §13, one token at a time: sigmoid scores; bias only for choosing; groups ranked by the
    sum of their two largest biased scores; ties to the lowest id. Returns (weights, ids), sorted by id."""
    T, E = logits.shape
    s = torch.sigmoid(logits)
    c = s + bias.to(s.dtype)
    per = E // n_group
    ws, ids = [], []
    for t in range(T):
        allowed = list(range(E))
        if n_group > 1:
            def group_score(gi: int) -> float:
                top = sorted(range(gi * per, (gi + 1) * per), key=lambda e: (-c[t, e].item(), e))[:2]
                return (c[t, top[0]] + c[t, top[1]]).item()  # summed in the scores' dtype
            groups = sorted(range(n_group), key=lambda gi: (-group_score(gi), gi))[:topk_group]
            allowed = [e for gi in sorted(groups) for e in range(gi * per, (gi + 1) * per)]
        sel = sorted(sorted(allowed, key=lambda e: (-c[t, e].item(), e))[:top_k])
        w = s[t, sel]
        if renormalize:
            w = w / w.sum()
        ws.append(w * scaling)
        ids.append(torch.tensor(sel))
    return torch.stack(ws), torch.stack(ids)


def by_id(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing results in expert-id order per token (the order of the selected ids is unspecified, §7.3)."""
    order = ids.argsort(-1)
    return w.gather(1, order), ids.gather(1, order)


# ---------------------------------------------------------------- SiTU (§2.4)
@pytest.mark.parametrize("beta,lam", [(4.0, 25.0), (1.0, None), (2.5, 7.0)], ids=["k3_b4_l25", "b1_no_cap", "b2.5_l7"])
@pytest.mark.parametrize("dtype", [F64, BF16], ids=["fp64", "bf16"])
def test_situ_matches_spec_formula(dtype, beta, lam):
    gu = randn(5, 2 * 24, seed=1, scale=8.0, dtype=dtype)  # wide range: both caps active
    got = kernels.situ_and_mul(gu, beta, lam, dtype)
    want = spec_situ(gu.to(acc(gu)), beta, lam).to(dtype)  # fp32 math, one rounding in bf16
    torch.testing.assert_close(got, want, **tol(dtype))


def test_situ_sigmoid_reads_uncapped_gate():
    g = torch.tensor([6.0, 10.0, -8.0, 30.0], dtype=F64)
    gu = torch.cat([g, torch.ones_like(g)])
    got = kernels.situ_and_mul(gu, 4.0, None, F64)
    torch.testing.assert_close(got, 4 * torch.tanh(g / 4) * torch.sigmoid(g), **tol(F64))
    capped = 4 * torch.tanh(g / 4)
    assert not torch.allclose(got, capped * torch.sigmoid(capped)), "σ must read the uncapped g (§2.4)"


def test_situ_without_linear_beta_leaves_up_uncapped():
    g = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    u = torch.tensor([1000.0, -300.0, 0.5], dtype=F64)
    got = kernels.situ_and_mul(torch.cat([g, u]), 4.0, None, F64)
    torch.testing.assert_close(got, 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u, **tol(F64))


def test_situ_output_is_bounded_by_beta_times_lambda():
    gu = randn(4, 64, seed=2, scale=1e4)
    out = kernels.situ_and_mul(gu, 4.0, 25.0, F64)
    assert out.abs().max() <= 100.0, "|SiTU| <= β·λ = 100 (§2.4; equality only by saturation)"


def test_situ_reduces_to_silu_and_mul_for_large_caps():
    gu = randn(6, 2 * 16, seed=3, scale=3.0)
    g, u = gu.chunk(2, dim=-1)
    silu_spec = g * torch.sigmoid(g) * u  # §2.3
    torch.testing.assert_close(kernels.situ_and_mul(gu, 1e7, 1e7, F64), silu_spec, **tol(F64))
    torch.testing.assert_close(kernels.silu_and_mul(gu, F64), silu_spec, **tol(F64))


# ---------------------------------------------------------------- router (§7.3, §13)
def test_route_bias_selects_but_weights_use_unbiased_scores():
    s = torch.tensor([[0.9, 0.8, 0.7, 0.1]], dtype=F64)
    logits = torch.log(s / (1 - s))  # σ(logits) = s
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=F64)  # lifts expert 3 into the top 2
    w, ids = by_id(*kernels.route(logits, bias, 2, 1, 1, True, 1.0))
    assert ids.tolist() == [[0, 3]], "selection uses s + bias"
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.1]], dtype=F64), **tol(F64),
                               msg="weights are the unbiased scores, renormalised")


@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (True, 2.5), (False, 2.5)],
                         ids=["renorm", "renorm_scaled", "no_renorm_scaled"])
@pytest.mark.parametrize("groups", [(1, 1, 4), (4, 2, 4), (4, 1, 3), (8, 3, 5)],
                         ids=["ungrouped", "4groups_keep2", "4groups_keep1", "8groups_keep3"])
def test_route_matches_spec_transcription(groups, renormalize, scaling):
    n_group, topk_group, top_k = groups
    logits = randn(40, 16, seed=4, dtype=torch.float32, scale=2.0)  # router logits are fp32 (§7.3)
    bias = randn(16, seed=5, dtype=torch.float32, scale=0.3)
    got = by_id(*kernels.route(logits, bias, top_k, n_group, topk_group, renormalize, scaling))
    want = spec_route(logits, bias, top_k, n_group, topk_group, renormalize, scaling)
    assert torch.equal(got[1], want[1]), "selected experts differ from the §7.3 rule"
    torch.testing.assert_close(got[0], want[0], **tol(torch.float32))


def test_topk_expert_ties_go_to_lowest_id():
    logits = torch.zeros(1, 8, dtype=F64)
    bias = torch.tensor([0.0, 0.2, 0.0, 0.2, 0.2, 0.0, 0.2, 0.0], dtype=F64)  # four tied at the top
    w, ids = by_id(*kernels.route(logits, bias, 3, 1, 1, True, 1.0))
    assert ids.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(w, torch.full((1, 3), 1 / 3, dtype=F64), **tol(F64))


def test_grouped_topk_ranks_groups_by_sum_of_two_largest_biased_scores():
    # group 0 holds the single best expert (0.5+0.45) but group 1 has the larger top-2 sum.
    logits = torch.zeros(1, 8, dtype=F64)  # s = 0.5 everywhere: the weights stay uniform
    bias = torch.tensor([0.45, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0, 0.0], dtype=F64)
    w, ids = by_id(*kernels.route(logits, bias, 2, 2, 1, True, 1.0))
    assert ids.tolist() == [[4, 5]], "groups must be ranked by the sum of their two largest biased scores"
    torch.testing.assert_close(w, torch.full((1, 2), 0.5, dtype=F64), **tol(F64))


def test_grouped_topk_group_ties_go_to_lowest_group_id():
    logits = torch.zeros(2, 12, dtype=F64)
    # three groups of 4 with equal top-2 sums (0.3+0.1); token 1 lifts group 2 above the others.
    bias = torch.tensor([[0.0, 0.3, 0.1, 0.0, 0.1, 0.0, 0.0, 0.3, 0.3, 0.0, 0.1, 0.0],
                         [0.0, 0.3, 0.1, 0.0, 0.1, 0.0, 0.0, 0.3, 0.3, 0.0, 0.15, 0.0]], dtype=F64)
    ids = [by_id(*kernels.route(logits[t:t + 1], bias[t], 3, 3, 2, True, 1.0))[1].tolist()[0] for t in range(2)]
    assert ids[0] == [1, 2, 7], "tied groups 0, 1, 2: keep groups 0 and 1"
    assert ids[1] == [1, 8, 10], "group 2 best, then the tie between 0 and 1 goes to group 0"


# ---------------------------------------------------------------- latent MoE (§7.2–7.6)
def spec_moe_fp64(moe: MoE, h: torch.Tensor, cfg: TextConfig) -> torch.Tensor:
    """§7.3–7.5 in float64, one token and one expert at a time. Returns bf(up + shared) (no prefix add)."""
    p = params(moe)
    I = cfg.moe_intermediate_size
    beta_routed = cfg.activation_situ_beta if cfg.activation_situ_beta is not None else 4.0
    beta_dense = cfg.activation_situ_beta if cfg.activation_situ_beta is not None else 1.0
    lam = cfg.activation_situ_linear_beta
    logits = h @ p["gate.weight"].T
    w, ids = spec_route(logits, p["gate.e_score_correction_bias"], cfg.num_experts_per_token,
                        cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, cfg.routed_scaling_factor)
    zl = h @ p["routed_expert_down_proj.weight"].T
    lat = torch.zeros(h.shape[0], zl.shape[1], dtype=h.dtype)
    for t in range(h.shape[0]):
        for we, e in zip(w[t], ids[t].tolist()):
            w1, w3 = p["experts.w13"][e, :I], p["experts.w13"][e, I:]  # w13 = [w1 ; w3]: gate first
            a = spec_situ(torch.cat([zl[t] @ w1.T, zl[t] @ w3.T]), beta_routed, lam)
            lat[t] += we * (a @ p["experts.w2"][e].T)
    lat_n = spec_rms_norm(lat, p["routed_expert_norm.weight"], cfg.rms_norm_eps)
    up = lat_n @ p["routed_expert_up_proj.weight"].T
    sh_gu = torch.cat([h @ p["shared_experts.gate_proj.weight"].T, h @ p["shared_experts.up_proj.weight"].T], -1)
    sh = spec_situ(sh_gu, beta_dense, lam) @ p["shared_experts.down_proj.weight"].T
    return up + sh


@pytest.mark.parametrize("scaling", [1.0, 2.5], ids=["scale1", "scale2.5"])
def test_latent_moe_matches_spec_transcription(scaling):
    cfg = tiny_text(routed_scaling_factor=scaling, rms_norm_eps=1e-2)
    moe = randomize_(MoE(cfg).to(F64), seed=31)
    h = randn(9, cfg.hidden_size, seed=32)
    torch.testing.assert_close(moe(h), spec_moe_fp64(moe, h, cfg), **tol(F64))


def spec_moe_bf16(moe: MoE, h: torch.Tensor, cfg: TextConfig, hf_combine: bool = False) -> torch.Tensor:
    """§7.3–7.6 in bf16 with the spec's rounding points. GEMMs are `F.linear` on bf16 tensors (fp32
    accumulation, one rounding) or on fp32 tensors where the spec keeps fp32.

    hf_combine: round a·W2ᵀ before multiplying by w_e in bf16 ([HF], §11.9) instead of SGLang's one rounding.
    """
    bf = lambda x: x.to(BF16)  # noqa: E731
    f32 = torch.float32
    p = params(moe)
    I = cfg.moe_intermediate_size
    lam = cfg.activation_situ_linear_beta
    logits = F.linear(h.to(f32), p["gate.weight"].to(f32))  # fp32 router logits
    w, ids = spec_route(logits, p["gate.e_score_correction_bias"], cfg.num_experts_per_token,
                        cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, 1.0)
    zl = F.linear(h, p["routed_expert_down_proj.weight"])  # bf(h·W_downᵀ)
    lat32 = torch.zeros(h.shape[0], zl.shape[1], dtype=f32)
    for t in range(h.shape[0]):
        for we, e in zip(w[t], ids[t].tolist()):  # ids ascending: fp32 sum in expert-id order
            g1 = F.linear(zl[t:t + 1], p["experts.w13"][e, :I])  # bf16
            u1 = F.linear(zl[t:t + 1], p["experts.w13"][e, I:])
            a = bf(spec_situ(torch.cat([g1, u1], -1).to(f32), cfg.activation_situ_beta, lam))
            if hf_combine:
                y = bf(F.linear(a, p["experts.w2"][e]) * bf(we))
            else:
                y = bf(we * F.linear(a.to(f32), p["experts.w2"][e].to(f32)))  # weight on the fp32 accumulator
            lat32[t] += y[0].to(f32)
    lat = bf(cfg.routed_scaling_factor * lat32)
    lat_n = spec_rms_norm(lat, p["routed_expert_norm.weight"], cfg.rms_norm_eps)
    up = F.linear(lat_n, p["routed_expert_up_proj.weight"])
    w_gu = torch.cat([p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"]])
    gu32 = F.linear(h.to(f32), w_gu.to(f32))  # fused front: SiTU reads the fp32 GEMM output (§7.6)
    sh = F.linear(bf(spec_situ(gu32, cfg.activation_situ_beta, lam)), p["shared_experts.down_proj.weight"])
    return bf(up.to(f32) + sh.to(f32))


def test_latent_moe_bf16_rounds_where_the_spec_rounds():
    """Bit-equal to a bf16 transcription of §7.4–7.6. The fp32 accumulation order of the expert GEMMs is
    unspecified (§0), so a different BLAS could flip a last bit; on this fixed case both orders agree."""
    cfg = tiny_text()
    moe = randomize_(MoE(cfg), seed=33).to(BF16)
    moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()  # fp32 in the checkpoint
    h = randn(8, cfg.hidden_size, seed=34, dtype=BF16)
    got = moe(h)
    want = spec_moe_bf16(moe, h, cfg)
    assert not torch.equal(spec_moe_bf16(moe, h, cfg, hf_combine=True), want), \
        "test case too small: HF's combine rounding gives the same bits, so this test could not fail"
    torch.testing.assert_close(got, want, **tol(BF16),
                               msg="bf16 MoE must round y_e once per expert after the weight, sum in fp32, round once")


# ---------------------------------------------------------------- MLA (§6)
def spec_mla(layer: MLA, x: torch.Tensor, cfg: TextConfig) -> torch.Tensor:
    """§6.1–6.4 for one fresh sequence, fp64, head by head (MHA form, NoPE, causal)."""
    p = params(layer)
    N, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    T = x.shape[0]
    c_q = spec_rms_norm(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (c_q @ p["q_b_proj.weight"].T).view(T, N, dn + dr)  # head-major, nope rows first
    lat = x @ p["kv_a_proj_with_mqa.weight"].T
    c_kv = spec_rms_norm(lat[:, :r], p["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = lat[:, r:]  # not normalised, not rotated, shared by all heads
    z = x @ p["g_proj.weight"].T
    W = p["kv_b_proj.weight"]
    O = torch.zeros(T, N * dv, dtype=x.dtype)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(N):
        W_UK = W[h * (dn + dv): h * (dn + dv) + dn]  # [dn, r]
        W_UV = W[h * (dn + dv) + dn: (h + 1) * (dn + dv)]  # [dv, r]
        k_nope, v = c_kv @ W_UK.T, c_kv @ W_UV.T
        logits = (q[:, h, :dn] @ k_nope.T + q[:, h, dn:] @ k_pe.T) * (dn + dr) ** -0.5
        logits = logits.masked_fill(~causal, float("-inf"))
        O[:, h * dv:(h + 1) * dv] = torch.softmax(logits, -1) @ v
    O = O * torch.sigmoid(z)  # output gate before o_proj (§6.4)
    return O @ p["o_proj.weight"].T


def mla_layer(seed: int, dtype: torch.dtype = F64) -> tuple[MLA, TextConfig]:
    cfg = tiny_text(rms_norm_eps=5e-2)  # far from 1e-6: a hard-coded latent-norm eps would show
    return randomize_(MLA(cfg).to(dtype), seed=seed), cfg


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
def test_mla_layer_matches_spec_transcription(dtype):
    """fp64: the same math. fp32: our fp32 layer against the float64 transcription of its own weights."""
    layer, cfg = mla_layer(41, dtype)
    x = randn(11, cfg.hidden_size, seed=42, dtype=dtype)
    out, _ = one_prefill(layer, x)
    want = spec_mla(copy.deepcopy(layer).double(), x.double(), cfg)
    torch.testing.assert_close(out, want.to(dtype), **tol(dtype))


@pytest.mark.parametrize("split", [[6, 5], [7, 1, 1, 1, 1], [1, 10]],
                         ids=["two_prefills", "prefill_decode", "one_then_ten"])
def test_mla_chunks_over_latent_cache_equal_one_prefill(split):
    # Later chunks find a cached prefix and take the absorbed form (§6.3); 1-token chunks after the
    # first go through the decode op.
    layer, cfg = mla_layer(43)
    T = sum(split)
    x = randn(T, cfg.hidden_size, seed=44)
    streams, outs = Streams([layer], 1, T, dtype=F64), []
    for k, part in enumerate(x.split(split)):
        decode = int(k > 0 and part.shape[0] == 1)
        outs.append(layer(part, streams.batch([part.shape[0]], num_decode=decode), streams.cache))
    torch.testing.assert_close(torch.cat(outs), spec_mla(layer, x, cfg), **tol(F64))
    assert streams.latent(0).shape == (T, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_mla_batched_decode_and_prefill_equal_separate_calls():
    """A varlen step with two decode rows and two prefill chunks (one with a cached prefix) equals each alone."""
    layer, cfg = mla_layer(47)
    D = cfg.hidden_size
    first = [randn(n, D, seed=60 + i) for i, n in enumerate([5, 3, 0, 6])]
    lens = [1, 1, 7, 4]
    x = randn(sum(lens), D, seed=59)
    batched = Streams([layer], 4, 16, dtype=F64)
    layer(torch.cat([f for f in first if len(f)]), batched.batch([len(f) for f in first]), batched.cache)
    out = layer(x, batched.batch(lens, num_decode=2), batched.cache)
    for i, part in enumerate(x.split(lens)):
        alone = Streams([layer], 1, 16, dtype=F64)
        if len(first[i]):
            layer(first[i], alone.batch([len(first[i])]), alone.cache)
        want = layer(part, alone.batch([len(part)], num_decode=int(i < 2)), alone.cache)
        torch.testing.assert_close(out[sum(lens[:i]):sum(lens[:i + 1])], want, **tol(F64))
        torch.testing.assert_close(batched.latent(i), alone.latent(0), **tol(F64))


def test_mla_absorbed_equals_mha():
    N, dn, dr, dv, r, T, S = 3, 16, 8, 12, 20, 4, 9  # 4 new queries over 9 keys (5 cached)
    q_nope, q_pe = randn(T, N, dn, seed=45), randn(T, N, dr, seed=46)
    c_kv, k_pe = randn(S, r, seed=47), randn(S, dr, seed=48)
    kv_b = randn(N * (dn + dv), r, seed=49, scale=r ** -0.5)
    w = kv_b.view(N, dn + dv, r)
    w_kc, w_vc = w[:, :dn], w[:, dn:].transpose(1, 2)  # W_UK,h [dn, r]; W_UV,hᵀ [r, dv] (§6.3)
    scale = (dn + dr) ** -0.5
    mha = kernels.mla_mha(q_nope, q_pe, c_kv, k_pe, kv_b, scale)
    torch.testing.assert_close(kernels.mla_absorbed(q_nope, q_pe, c_kv, k_pe, w_kc, w_vc, scale), mha, **tol(F64))


# ---------------------------------------------------------------- Attention Residuals (§4)
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("n_rows", [1, 2, 5], ids=lambda n: f"{n}rows")
def test_attn_res_mix_matches_spec_formula(n_rows, dtype):
    H = 64
    rows = [randn(7, H, seed=50 + j, dtype=dtype, scale=1 + j) for j in range(n_rows)]
    ns, wp = 1 + randn(H, seed=60, scale=0.1, dtype=dtype), randn(1, H, seed=61, scale=H ** -0.5, dtype=dtype)
    got = kernels.attn_res_mix(rows, ns, wp, 1e-5)
    torch.testing.assert_close(got, spec_mix(rows, ns, wp, 1e-5), **tol(dtype))


@pytest.mark.parametrize("with_out_norm", [False, True], ids=["mix", "mix_then_norm"])
def test_attn_res_mix_matches_fla_naive_attnres(with_out_norm):
    # fla: k = RMSNorm_ns(r), p = softmax(k·query), o = Σ p r; optionally RMSNorm(o) with the same eps.
    H, dtype, eps = 64, torch.float32, 1e-5
    rows = [randn(2, 5, H, seed=70 + j, dtype=dtype, scale=1 + j) for j in range(4)]
    ns, wp, ow = (1 + randn(H, seed=80, scale=0.1, dtype=dtype), randn(1, H, seed=81, scale=H ** -0.5, dtype=dtype),
                  1 + randn(H, seed=82, scale=0.1, dtype=dtype))
    got = kernels.attn_res_mix([r.view(-1, H) for r in rows], ns, wp, eps).view(2, 5, H)
    if with_out_norm:
        got = kernels.rms_norm(got, ow, eps)
    want = FLA_ATTNRES.naive_attnres(wp.view(-1), rows, ns, ow if with_out_norm else None, rms_eps=eps)
    torch.testing.assert_close(got, want, **tol(dtype))


def spec_stack(model: K3TextModel, x: torch.Tensor) -> torch.Tensor:
    """§4.10 reference algorithm. Attention and MLP sub-layers are our modules, called as black boxes
    with fresh state; the stream, bank, mixes and norms are transcribed here."""
    cfg = model.cfg
    S, eps = cfg.attn_res_block_size, cfg.rms_norm_eps
    w = lambda m: m.weight.detach()  # noqa: E731
    bank: list[torch.Tensor] = []
    X = x  # running prefix: the embedding at the start
    for i, layer in enumerate(model.layers):
        if not bank:
            a_in = spec_rms_norm(X, w(layer.input_layernorm), eps)
        else:
            mixed = spec_mix(bank + [X], w(layer.self_attention_res.norm), w(layer.self_attention_res.proj), eps)
            a_in = spec_rms_norm(mixed, w(layer.input_layernorm), eps)
        if i % S == 0:
            bank.append(X)
            P = None
        else:
            P = X
        A = one_prefill(layer.self_attn, a_in)[0]
        Q = A if P is None else P + A
        mixed = spec_mix(bank + [Q], w(layer.mlp_res.norm), w(layer.mlp_res.proj), eps)
        m_in = spec_rms_norm(mixed, w(layer.post_attention_layernorm), eps)
        X = layer.mlp(m_in) + Q
    assert len(bank) == math.ceil(cfg.num_hidden_layers / S)
    mixed = spec_mix(bank + [X], w(model.output_attn_res.norm), w(model.output_attn_res.proj), eps)
    return spec_rms_norm(mixed, w(model.norm), eps)


def tiny_stack(seed: int) -> K3TextModel:
    return randomize_(K3TextModel(tiny_text()).to(F64), seed=seed).requires_grad_(False)


def run_stack(model: K3TextModel, x: torch.Tensor) -> torch.Tensor:
    streams = Streams([layer.self_attn for layer in model.layers], 1, x.shape[0], dtype=x.dtype)
    return model(x, streams.batch([x.shape[0]]), streams.pools)


def test_decoder_stack_matches_attn_res_reference_algorithm():
    model = tiny_stack(seed=91)
    x = randn(7, model.cfg.hidden_size, seed=92)  # input embeddings
    torch.testing.assert_close(run_stack(model, x), spec_stack(model, x), **tol(F64))


def test_mix_row_counts_follow_block_schedule(monkeypatch):
    """§4.4 table: layer i's attention side mixes ⌈i/S⌉ bank rows + prefix (no mix at i = 0), the MLP
    side ⌊i/S⌋ + 1 bank rows + prefix; the output side all ⌈L/S⌉ bank rows + prefix."""
    model = tiny_stack(seed=93)
    S, L = model.cfg.attn_res_block_size, model.cfg.num_hidden_layers
    seen: dict[tuple[str, int], int] = {}

    def spy(key, mix_norm):
        return lambda rows, norm: (seen.__setitem__(key, len(rows)), mix_norm(rows, norm))[1]

    for i, layer in enumerate(model.layers):
        monkeypatch.setattr(layer.self_attention_res, "mix_norm", spy(("attn", i), layer.self_attention_res.mix_norm))
        monkeypatch.setattr(layer.mlp_res, "mix_norm", spy(("mlp", i), layer.mlp_res.mix_norm))
    monkeypatch.setattr(model.output_attn_res, "mix_norm", spy(("out", L), model.output_attn_res.mix_norm))
    run_stack(model, randn(3, model.cfg.hidden_size, seed=94))
    want = {("attn", i): math.ceil(i / S) + 1 for i in range(1, L)}
    want |= {("mlp", i): i // S + 2 for i in range(L)}
    want[("out", L)] = math.ceil(L / S) + 1
    assert seen == want


def test_k3_overlap_switch():
    """K3_OVERLAP (model/overlap.py) is read once at import: on (the default) and off are taken, a bad value
    fails the import with the variable's name; on a CPU a branch runs inline, so join() returns fn's own result."""
    import os
    import subprocess
    import sys

    code = ("import torch; from k3backend.model.overlap import MODE, Branch; t = torch.ones(2); "
            "b = Branch(lambda: t, t.device); print(MODE, b.main is None, b.join() is t)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("K3_OVERLAP", None)
    for mode in ("off", "on", None):
        run = subprocess.run([sys.executable, "-c", code], env=env if mode is None else {**env, "K3_OVERLAP": mode},
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [mode or "on", "True", "True"], run.stdout
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "K3_OVERLAP": "both"}, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "K3_OVERLAP must be on or off" in bad.stderr, bad.stderr[-500:]
