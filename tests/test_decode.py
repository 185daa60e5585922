"""Stateful decoding: prefill then token-by-token decode with per-sequence caches equals the full forward."""

import pytest
import torch

from k3backend.checkpoint import RUNTIME_FP32_PARAMS
from k3backend.config import K3Config
from k3backend.model.lm import K3ForCausalLM
from k3backend.presets import preset_config, randomize_weights_
from poolutil import full_logits, lm_streams, one_prefill
from tolerances import PATH_FP32_ATOL, PATH_FP64_ATOL


def tiny_lm(dtype: torch.dtype, seed: int, **text_overrides) -> K3ForCausalLM:
    raw = preset_config("tiny")
    raw["text_config"].update(text_overrides)
    model = randomize_weights_(K3ForCausalLM(K3Config.from_dict(raw).text), seed)
    return model.to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def model(request):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    m = tiny_lm(request.param, seed=seed)
    m.seed = seed  # named in every failure: a fresh model per run, so a rare outlier can be rebuilt
    return m


def atol(model):
    return PATH_FP64_ATOL if model.lm_head.weight.dtype == torch.float64 else PATH_FP32_ATOL


def assert_close(got: torch.Tensor, want: torch.Tensor, model, tol: float | None = None) -> None:
    torch.testing.assert_close(got, want, atol=atol(model) if tol is None else tol, rtol=0,
                               msg=lambda m: f"{m}\n(tiny_lm seed {getattr(model, 'seed', None)})")


def run_chunks(model, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Logits of every position, computed chunk by chunk [bounds[k], bounds[k+1]) with the caches;
    single-token chunks after the first run as decode rows."""
    s = lm_streams(model, 1, len(ids))
    out = []
    for a, b in zip(bounds, bounds[1:]):
        decode = int(a > 0 and b - a == 1)
        out.append(model(s.batch([b - a], [ids[a:b].tolist()], num_decode=decode, all_logits=True), s.pools))
    assert s.pos == [len(ids)]
    return torch.cat(out)


@pytest.mark.parametrize("split", [1, 37, 64, 65])
def test_prefill_then_decode_equals_full_forward(model, split):
    ids = torch.randint(0, model.cfg.vocab_size, (90,))
    steps = run_chunks(model, ids, [0, split] + list(range(split + 1, len(ids) + 1)))
    assert_close(steps, full_logits(model, ids), model)


def test_chunked_prefill_equals_one_prefill(model):
    ids = torch.randint(0, model.cfg.vocab_size, (100,))
    parts = run_chunks(model, ids, [0, 30, 31, 100])
    assert_close(parts, full_logits(model, ids), model)


def test_batched_sequences_are_independent(model):
    """One flat step of sequences with different lengths (decode rows first, then prefill chunks)
    gives each sequence its own full-forward logits."""
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,)) for n in (23, 5, 40)]
    s = lm_streams(model, 3, 40)
    prefill = model(s.batch([len(q) - 1 for q in seqs], [q[:-1].tolist() for q in seqs], all_logits=True), s.pools)
    mixed_ids = [seqs[0][-1:].tolist(), seqs[1][-1:].tolist(), seqs[2][-1:].tolist()]
    decode = model(s.batch([1, 1, 1], mixed_ids, num_decode=3), s.pools)
    offset = 0
    for i, q in enumerate(seqs):
        full = full_logits(model, q)
        assert_close(prefill[offset:offset + len(q) - 1], full[:-1], model)
        assert_close(decode[i], full[-1], model)
        offset += len(q) - 1


def test_mixed_step_equals_the_two_run_separately(model):
    """Decode rows and prefill chunks in one forward give the logits they give in separate forwards."""
    a, b = (torch.randint(0, model.cfg.vocab_size, (n,)) for n in (12, 9))
    together = lm_streams(model, 2, 12)
    model(together.batch([11, 0], [a[:11].tolist(), []]), together.pools)
    mixed = model(together.batch([1, 9], [a[11:].tolist(), b.tolist()], num_decode=1), together.pools)
    apart = lm_streams(model, 2, 12)
    model(apart.batch([11, 0], [a[:11].tolist(), []]), apart.pools)
    dec = model(apart.batch([1, 0], [a[11:].tolist(), []], num_decode=1), apart.pools)
    pre = model(apart.batch([0, 9], [[], b.tolist()]), apart.pools)
    assert_close(mixed, torch.cat([dec, pre]), model)


def test_plain_residual_path_decodes_like_full_forward():
    """attn_res_block_size absent: the standard pre-norm path (§4.11) also decodes exactly."""
    model = tiny_lm(torch.float64, seed=3, attn_res_block_size=None)
    ids = torch.randint(0, model.cfg.vocab_size, (40,))
    steps = run_chunks(model, ids, [0, 20] + list(range(21, 41)))
    assert_close(steps, full_logits(model, ids), model, PATH_FP64_ATOL)


def test_bfloat16_sublayers_stay_close_to_float32():
    """Each bf16 sub-layer (spec rounding points, fp32 parameters where the spec keeps them) stays
    within bf16 rounding noise of its fp32 twin on the same input. Whole-model bf16 logits of a
    random toy model drift much further (errors compound chaotically over layers), so the bound is
    per sub-layer."""
    m32 = tiny_lm(torch.float32, seed=5)
    m16 = tiny_lm(torch.float32, seed=5).to(torch.bfloat16)
    fp32_params = dict(m32.named_parameters())
    for name, p in m16.named_parameters():  # the runtime keeps these parameters in fp32
        if name.endswith(RUNTIME_FP32_PARAMS):
            p.data = fp32_params[name].data.clone()
    x = torch.randn(32, m32.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    for i, (l32, l16) in enumerate(zip(m32.model.layers, m16.model.layers)):
        xn = l32.input_layernorm(x)
        a32 = one_prefill(l32.self_attn, xn)[0]
        a16 = one_prefill(l16.self_attn, xn.bfloat16())[0]
        assert a16.dtype == torch.bfloat16 and rel(a16, a32) < 0.03, f"layer {i} attention: {rel(a16, a32)}"
        xb = xn.bfloat16()  # both MLPs read the same (bf16) input: the fp32 routers then pick the same experts
        assert rel(l16.mlp(xb), l32.mlp(xb.float())) < 0.03, f"layer {i} mlp"
    out = full_logits(m16, torch.randint(0, m16.cfg.vocab_size, (16,)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
