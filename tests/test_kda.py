"""KDA building blocks (K3_LM.md §2.5, §5) against independent references.

References: fla-core's naive KDA functions (`fla/ops/kda/naive.py`, loaded by file path because
`import fla.ops` needs triton and a GPU; the naive gates of `fla/ops/kda/gate.py` are taken out of
that file's syntax tree, since the file itself imports triton), and transcriptions of the spec's
formulas written here. Nothing here calls our code to build an expected value.

fla's naive KDA casts to `torch.float` (fp32). For float64 comparisons it is loaded a second time
with `torch.float` meaning float64 (`_TorchWithFloat64`), which runs fla's own algorithm unchanged
at higher precision.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from k3backend import kernels
from k3backend.config import K3Config, TextConfig
from k3backend.model.kda import KDA
from k3backend.presets import preset_config
from fla_naive import FLA, load_fla
from poolutil import Streams, one_prefill, params
from tolerances import SCALAR_FP64, tol

DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")]


# ---------------------------------------------------------------- fla, loaded by file path


class _TorchWithFloat64:
    """`torch` as fla's naive KDA module sees it, with `torch.float` meaning float64."""

    float = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _fla_naive_kda() -> dict[torch.dtype, object]:
    fp32 = load_fla("ops/kda/naive.py", "fla_kda_naive_fp32")
    fp64 = load_fla("ops/kda/naive.py", "fla_kda_naive_fp64")
    fp64.torch = _TorchWithFloat64()
    return {torch.float32: fp32, torch.float64: fp64}


def _fla_naive_gates() -> dict[str, object]:
    """`naive_kda_gate` and `naive_kda_lowerbound_gate`, verbatim from gate.py, without its triton imports."""
    path = FLA / "ops/kda/gate.py"
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("naive_")]
    ns = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return {n.name: ns[n.name] for n in body}


FLA_KDA = _fla_naive_kda()
FLA_GATES = _fla_naive_gates()


# ---------------------------------------------------------------- spec transcriptions
def spec_l2(x: torch.Tensor) -> torch.Tensor:
    """§2.6: x / sqrt(Σ_d x_d² + 1e-6)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def spec_softplus(s: torch.Tensor) -> torch.Tensor:
    """§2.8: log(1 + e^x) for x ≤ 20, else x."""
    return torch.where(s <= 20, torch.log(1 + torch.exp(torch.clamp(s, max=20))), s)


def spec_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lb: float | None) -> torch.Tensor:
    """§5.3 per token t, head h, channel d. f: [T, H, K]; dt_bias: [H·K]; A_log: [H]."""
    T, H, K = f.shape
    g = torch.empty_like(f)
    for h in range(H):
        s = f[:, h, :] + dt_bias[h * K:(h + 1) * K]
        if lb is not None:
            g[:, h, :] = lb * torch.sigmoid(torch.exp(A_log[h]) * s)
        else:
            g[:, h, :] = -torch.exp(A_log[h]) * spec_softplus(s)
    return g


def spec_short_conv(x: torch.Tensor, w: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """§2.5: y_t[c] = silu(Σ_{j=0..3} w[c,j]·x_{t−3+j}[c]) in fp32 (fp64 for fp64 input), then bf(·).

    history: the raw rows x_{−3}, x_{−2}, x_{−1} before this call. Row p of `rows` is x_{p−3}.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    W = w.shape[1]
    rows = torch.cat([history, x]).to(acc)
    w = w.to(acc)
    out = []
    for t in range(x.shape[0]):
        y = w[:, 0] * rows[t]
        for j in range(1, W):
            y = y + w[:, j] * rows[t + j]  # x_{t−3+j} is row t + j
        out.append(F.silu(y))
    return torch.stack(out).to(x.dtype)


def kda_inputs(T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int, with_state: bool):
    """Fresh q, k (l2-normalised, q NOT scaled), v, lower-bounded log-decay g, post-sigmoid beta, S0."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = spec_l2(r(T, H, K)), spec_l2(r(T, H, K)), r(T, H, V)
    gate = -5.0 * torch.sigmoid(2 * r(T, H, K))  # in (−5, 0), §5.3
    beta = torch.sigmoid(r(T, H))
    S0 = r(H, K, V) if with_state else torch.zeros(H, K, V, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, gate, beta, S0)]


def fla_run(fn_name: str, q, k, v, g, beta, S0, **kw):
    """Call a fla naive KDA function on our [T, H, ·] tensors (batch of one)."""
    mod = FLA_KDA[q.dtype]
    o, S = getattr(mod, fn_name)(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                                 initial_state=S0[None], output_final_state=True, **kw)
    return o[0], S[0]


# ---------------------------------------------------------------- recurrence and chunked form
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("T", [1, 37, 130], ids=lambda t: f"T{t}")
def test_recurrent_matches_fla_naive_recurrent(T, with_state, dtype):
    q, k, v, g, beta, S0 = kda_inputs(T, 3, 12, 10, dtype, seed=T, with_state=with_state)
    o, S = kernels.kda_recurrent(q * q.shape[-1] ** -0.5, k, v, g, beta, S0.clone())  # ours takes scaled q
    o_ref, S_ref = fla_run("naive_recurrent_kda", q, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_ref, **tol(dtype))
    torch.testing.assert_close(S, S_ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("T", [1, 17, 37, 130], ids=lambda t: f"T{t}")
def test_chunked_equals_recurrent_with_initial_state(T, chunk_size, dtype):
    q, k, v, g, beta, S0 = kda_inputs(T, 3, 12, 10, dtype, seed=100 + T, with_state=True)
    q = q * q.shape[-1] ** -0.5
    o_c, S_c = kernels.kda_chunked(q, k, v, g, beta, S0.clone(), chunk_size=chunk_size)
    o_r, S_r = kernels.kda_recurrent(q, k, v, g, beta, S0.clone())
    torch.testing.assert_close(o_c, o_r, **tol(dtype))
    torch.testing.assert_close(S_c, S_r, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,chunk_size", [(64, 16), (128, 64)], ids=["T64-chunk16", "T128-chunk64"])
def test_chunked_matches_fla_naive_chunk(T, chunk_size, dtype):
    # fla's naive_chunk_kda asserts T % chunk_size == 0; other T are covered by the test above.
    q, k, v, g, beta, S0 = kda_inputs(T, 2, 12, 10, dtype, seed=7, with_state=True)
    o, S = kernels.kda_chunked(q * q.shape[-1] ** -0.5, k, v, g, beta, S0.clone(), chunk_size=chunk_size)
    o_ref, S_ref = fla_run("naive_chunk_kda", q, k, v, g, beta, S0, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, **tol(dtype))
    torch.testing.assert_close(S, S_ref, **tol(dtype))


# ---------------------------------------------------------------- forget gate
def gate_inputs(T: int, H: int, K: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    f = 3 * torch.randn(T, H, K, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(H * K, generator=g, dtype=torch.float64)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64))  # exp(A_log) in [1, 16]
    return f.to(dtype), dt_bias.to(dtype), A_log.to(dtype)


def test_lower_bound_gate_matches_spec_formula():
    f, dt_bias, A_log = gate_inputs(9, 3, 8, torch.float64, seed=1)
    g = kernels.kda_gate(f, dt_bias, A_log, lower_bound=-5.0)
    torch.testing.assert_close(g, spec_gate(f, dt_bias, A_log, -5.0), **tol(torch.float64))
    assert (g >= -5).all() and (g <= 0).all(), "lower-bounded log-decay must lie in [lb, 0] (§5.3; ends by saturation)"


def test_lower_bound_gate_matches_fla_naive_lowerbound_gate():
    f, dt_bias, A_log = gate_inputs(9, 3, 8, torch.float32, seed=2)
    g = kernels.kda_gate(f, dt_bias, A_log, lower_bound=-5.0)
    ref = FLA_GATES["naive_kda_lowerbound_gate"](f, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(g, ref, **tol(torch.float32))


def test_softplus_gate_matches_spec_formula():
    f, dt_bias, A_log = gate_inputs(9, 3, 8, torch.float64, seed=3)
    g = kernels.kda_gate(f, dt_bias, A_log, lower_bound=None)
    torch.testing.assert_close(g, spec_gate(f, dt_bias, A_log, None), **tol(torch.float64))


def test_softplus_gate_matches_fla_naive_gate():
    f, dt_bias, A_log = gate_inputs(9, 3, 8, torch.float32, seed=4)
    g = kernels.kda_gate(f, dt_bias, A_log, lower_bound=None)
    torch.testing.assert_close(g, FLA_GATES["naive_kda_gate"](f, A_log, dt_bias), **tol(torch.float32))


def test_softplus_gate_is_linear_above_threshold_20():
    # s = f + dt_bias with dt_bias = 0, so s is exactly the chosen value; e^{-20} ≈ 2e-9 separates the branches.
    s = torch.tensor([-30.0, -1.0, 0.0, 19.5, 20.0, 20.0 + 2**-40, 20.5, 25.0, 40.0], dtype=torch.float64)
    H = 2
    f = s.view(-1, 1, 1).expand(-1, H, 1).contiguous()  # [T, H, K=1]
    A_log = torch.tensor([0.0, math.log(7.0)], dtype=torch.float64)
    g = kernels.kda_gate(f, torch.zeros(H, dtype=torch.float64), A_log, lower_bound=None)
    A = torch.exp(A_log)
    above = s > 20
    linear = -(A[None, :] * s[:, None])  # [T, H]
    logexp = -(A[None, :] * torch.log1p(torch.exp(s))[:, None])
    assert torch.equal(g[above, :, 0], linear[above]), "softplus must return x itself for x > 20 (§2.8)"
    torch.testing.assert_close(g[~above, :, 0], logexp[~above], **SCALAR_FP64,
                               msg="softplus must be log(1+e^x) for x <= 20, including x == 20 (§2.8)")
    assert ((logexp - linear)[~above & (s >= 19.5)].abs() > 1e-9).all()  # the two branches are distinguishable


# ---------------------------------------------------------------- short convolution
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("with_history", [False, True], ids=["sequence_start", "cached_history"])
def test_short_conv_matches_spec_formula(with_history, dtype):
    g = torch.Generator().manual_seed(11)
    T, C, W = 9, 13, 4
    x = torch.randn(T, C, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    w = w if dtype == torch.float64 else w.float()  # conv weights are fp32 parameters (§5.2)
    hist = (torch.randn(W - 1, C, generator=g, dtype=torch.float64) if with_history
            else torch.zeros(W - 1, C, dtype=torch.float64)).to(dtype)
    y, new_hist = kernels.short_conv_seq(x, w, hist)
    torch.testing.assert_close(y, spec_short_conv(x, w, hist), **tol(dtype))
    assert torch.equal(new_hist, x[-(W - 1):]), "the conv cache holds the last W−1 raw (pre-conv) rows (§5.2)"


def test_short_conv_last_tap_multiplies_current_token():
    T, C = 6, 3
    x = torch.arange(1.0, T * C + 1, dtype=torch.float64).view(T, C) / 10
    zeros = torch.zeros(3, C, dtype=torch.float64)
    w_now = torch.zeros(C, 4, dtype=torch.float64)
    w_now[:, 3] = 1.0
    w_oldest = torch.zeros(C, 4, dtype=torch.float64)
    w_oldest[:, 0] = 1.0
    torch.testing.assert_close(kernels.short_conv_seq(x, w_now, zeros)[0], F.silu(x), **tol(torch.float64),
                               msg="w[:, 3] must multiply the current token x_t (§2.5)")
    shifted = torch.cat([zeros, x])[:T]  # x_{t−3}, zeros before the sequence start
    torch.testing.assert_close(kernels.short_conv_seq(x, w_oldest, zeros)[0], F.silu(shifted), **tol(torch.float64),
                               msg="w[:, 0] must multiply x_{t−3} (§2.5)")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_short_conv_in_chunks_carrying_history_equals_one_call(dtype):
    g = torch.Generator().manual_seed(12)
    T, C, W = 11, 7, 4
    x = torch.randn(T, C, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    w = w if dtype == torch.float64 else w.float()  # conv weights are fp32 parameters (§5.2)
    zeros = torch.zeros(W - 1, C, dtype=dtype)
    y_full, h_full = kernels.short_conv_seq(x, w, zeros)
    hist, outs = zeros, []
    for part in x.split([1, 2, 5, 3]):  # chunks shorter than W−1 included
        y, hist = kernels.short_conv_seq(part, w, hist)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), y_full, **tol(dtype))  # fp64: SIMD tails may differ by an ulp
    assert torch.equal(hist, h_full)


# ---------------------------------------------------------------- the whole KDA layer
def tiny_text() -> TextConfig:
    return K3Config.from_dict(preset_config("tiny")).text


def kda_config(variant: str) -> TextConfig:
    """K3 (full-rank output gate, lb = −5) or Kimi-Linear (low-rank g_a/g_b gate, softplus forget gate).

    rms_norm_eps is set far from 1e-5 and v_head_dim != head_dim, so a layer that read the config eps
    for o_norm, or mixed up K and V, would fail.
    """
    cfg = tiny_text()
    lac = cfg.linear_attn_config
    if variant == "low_rank_softplus":
        lac = dataclasses.replace(lac, use_full_rank_gate=False, gate_lower_bound=None)
    return dataclasses.replace(cfg, linear_attn_config=lac, rms_norm_eps=0.1, v_head_dim=12)


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random parameters at scales that keep activations O(1); in place, keeps each dtype."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("A_log"):
                v = torch.log(1 + 15 * torch.rand(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("dt_bias"):
                v = 0.5 * r
            elif name.endswith("conv1d.weight"):
                v = r / 2
            elif name.endswith("norm.weight"):
                v = 1 + 0.1 * r
            else:
                v = r / math.sqrt(p.shape[-1])
            p.copy_(v)
    return module


def spec_kda_layer(layer: KDA, x: torch.Tensor, lb: float | None, full_rank_gate: bool):
    """§5.11 (recurrent form, one sequence, fresh state), fp64.

    Returns (out [T, D], S [H, K, V], conv rows [3, 3P])."""
    p = params(layer)
    H, K = layer.H, layer.K
    V = p["v_proj.weight"].shape[0] // H
    T = x.shape[0]
    lin = lambda a, name: a @ p[name].T  # noqa: E731
    xq, xk, xv = lin(x, "q_proj.weight"), lin(x, "k_proj.weight"), lin(x, "v_proj.weight")
    z = lin(x, "g_proj.weight") if full_rank_gate else lin(lin(x, "g_a_proj.weight"), "g_b_proj.weight")
    b = lin(x, "b_proj.weight")
    f = lin(lin(x, "f_a_proj.weight"), "f_b_proj.weight")
    conv_w = {c: p[f"{c}_conv1d.weight"][:, 0, :] for c in "qkv"}  # [C, 4]
    raw = {"q": xq, "k": xk, "v": xv}
    hist = {c: torch.zeros(3, raw[c].shape[1], dtype=x.dtype) for c in "qkv"}
    S = torch.zeros(H, K, V, dtype=x.dtype)
    o = torch.zeros(T, H, V, dtype=x.dtype)
    for t in range(T):
        conv = {}
        for c in "qkv":
            window = torch.cat([hist[c], raw[c][t:t + 1]])  # rows x_{t−3} .. x_t
            conv[c] = F.silu((conv_w[c] * window.T).sum(-1))
            hist[c] = window[1:]
        for h in range(H):
            s = f[t, h * K:(h + 1) * K] + p["dt_bias"][h * K:(h + 1) * K]
            if lb is not None:
                g = lb * torch.sigmoid(torch.exp(p["A_log"][h]) * s)
            else:
                g = -torch.exp(p["A_log"][h]) * spec_softplus(s)
            beta = torch.sigmoid(b[t, h])
            qh = spec_l2(conv["q"][h * K:(h + 1) * K]) * K ** -0.5
            kh = spec_l2(conv["k"][h * K:(h + 1) * K])
            vh = conv["v"][h * V:(h + 1) * V]
            S[h] = torch.exp(g)[:, None] * S[h]
            u = beta * (vh - S[h].T @ kh)
            S[h] = S[h] + torch.outer(kh, u)
            o[t, h] = S[h].T @ qh
    # §2.7 gated RMSNorm per head, eps 1e-5 whatever rms_norm_eps says (§5.7)
    zz = z.view(T, H, V)
    y = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * p["o_norm.weight"] * torch.sigmoid(zz)
    out = y.reshape(T, H * V) @ p["o_proj.weight"].T
    return out, S, torch.cat([hist["q"], hist["k"], hist["v"]], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["k3_full_rank_lower_bound", "low_rank_softplus"])
def test_kda_layer_matches_spec_pseudocode(variant, dtype):
    """fp64: the same math. fp32: our fp32 layer against the float64 transcription of its own weights."""
    cfg = kda_config(variant)
    layer = randomize_(KDA(cfg).to(dtype), seed=21)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(22), dtype=torch.float64).to(dtype)
    out, streams = one_prefill(layer, x)
    lac = cfg.linear_attn_config
    ref, S_ref, conv_ref = spec_kda_layer(copy.deepcopy(layer).double(), x.double(), lac.gate_lower_bound,
                                          lac.use_full_rank_gate)
    torch.testing.assert_close(out, ref.to(dtype), **tol(dtype))
    torch.testing.assert_close(streams.state(0), S_ref.to(streams.state(0).dtype), **tol(dtype))
    torch.testing.assert_close(streams.conv(0), conv_ref.to(dtype), **tol(dtype))


@pytest.mark.parametrize("variant", ["k3_full_rank_lower_bound", "low_rank_softplus"])
@pytest.mark.parametrize("split", [[20, 17], [13] + [1] * 7 + [17]], ids=["two_prefills", "prefill_decode_prefill"])
def test_kda_prefill_in_chunks_with_state_equals_one_prefill(variant, split):
    """Single-token chunks after the first go through the decode op, longer ones through prefill."""
    cfg = kda_config(variant)
    layer = randomize_(KDA(cfg).to(torch.float64), seed=23)
    T = sum(split)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(24), dtype=torch.float64)
    ref, whole = one_prefill(layer, x)
    streams, outs = Streams([layer], 1, T, dtype=torch.float64), []
    for k, part in enumerate(x.split(split)):
        decode = int(k > 0 and part.shape[0] == 1)
        outs.append(layer(part, streams.batch([part.shape[0]], num_decode=decode), streams.cache))
    torch.testing.assert_close(torch.cat(outs), ref, **tol(torch.float64))
    torch.testing.assert_close(streams.state(0), whole.state(0), **tol(torch.float64))
    assert torch.equal(streams.conv(0), whole.conv(0))


def test_kda_batched_sequences_equal_separate_calls():
    """One varlen step over a decode row and two prefill chunks equals each sequence alone."""
    cfg = kda_config("k3_full_rank_lower_bound")
    layer = randomize_(KDA(cfg).to(torch.float64), seed=25)
    D = cfg.hidden_size
    first = torch.randn(4, D, generator=torch.Generator().manual_seed(27), dtype=torch.float64)
    lens = [1, 5, 9]  # sequence 0 decodes (after a 4-token prefill), 1 and 2 prefill
    x = torch.randn(sum(lens), D, generator=torch.Generator().manual_seed(26), dtype=torch.float64)
    batched = Streams([layer], 3, 16, dtype=torch.float64)
    layer(first, batched.batch([4, 0, 0]), batched.cache)
    out = layer(x, batched.batch(lens, num_decode=1), batched.cache)
    for i, part in enumerate(x.split(lens)):
        alone = Streams([layer], 1, 16, dtype=torch.float64)
        if i == 0:
            layer(first, alone.batch([4]), alone.cache)
        want = layer(part, alone.batch([part.shape[0]], num_decode=int(i == 0)), alone.cache)
        torch.testing.assert_close(out[sum(lens[:i]):sum(lens[:i + 1])], want, **tol(torch.float64))
        torch.testing.assert_close(batched.state(i), alone.state(0), **tol(torch.float64))
        torch.testing.assert_close(batched.conv(i), alone.conv(0), **tol(torch.float64))  # GEMM shapes differ
