"""The Triton draw (kernels/sample.py) picks the reference's token (sample_ref.race_draw) exactly.

Under TRITON_INTERPRET=1 in a subprocess (tests/interpret.py): vocabularies of 1, 7, 2049 (one
past a block) and 5000 ids; probabilities with zeros (filtered ids), uniform rows (the winner is
the largest uniform, so any bit of the hash that differs shows), seeds at the int64 extremes and
large output positions. The per-block partials start as NaN (`poisoned_empty`). The top-p threshold pass (bisection over
float32 bits, exact integer mass) finds the reference's cut value on smooth, tied and banned rows.
"""

from __future__ import annotations

import pytest
import torch

from interpret import Checks, poisoned_empty

CHECKS = Checks(__file__, env={"K3_KERNELS": "triton"})


def draw_both(probs: torch.Tensor, seeds: list[int], steps: list[int]) -> None:
    from k3backend.kernels import sample, sample_ref

    s, t = torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64)
    with poisoned_empty():
        got = sample.race_draw(probs, s, t)
    want = sample_ref.race_draw(probs, s, t)
    assert got.dtype == torch.int64 and torch.equal(got, want), (list(probs.shape), got.tolist(), want.tolist())


def check_draw_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    extremes = [0, 1, -1, 2**63 - 1, -2**63, 12345678901234567]
    for V in (1, 7, 2049, 5000):
        S = len(extremes)
        probs = torch.rand(S, V, generator=g)
        probs[torch.rand(S, V, generator=g) < 0.5] = 0.0  # filtered ids
        probs[:, 0] = torch.where(probs[:, 0] > 0, probs[:, 0], 0.25)  # at least one id left
        draw_both(probs, extremes, [0, 1, 2**40, 7, 3, 2**62])
        draw_both(torch.full((S, V), 1.0 / V), extremes, list(range(S)))  # uniform: argmax of u


def check_many_rows_and_ties() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(40, 3000, generator=g).bfloat16().float(), dim=-1)  # bf16 logits: tied probs
    draw_both(probs, [int(x) for x in torch.randint(-2**63, 2**63 - 1, (40,), generator=g)], list(range(0, 400, 10)))
    from k3backend.kernels import sample

    assert sample.race_draw(torch.zeros(0, 9), torch.zeros(0, dtype=torch.int64),
                            torch.zeros(0, dtype=torch.int64)).shape == (0,)


def check_top_p_threshold_matches_reference() -> None:
    """The bisection over float32 bits finds the reference's cut value and the units above it:
    smooth and tied rows, cuts at the first id, in the body and at the last nonzero id, zeros
    (banned ids), a vocabulary of one and of one past a block; inactive rows give (0.0, 0)."""
    from k3backend.kernels import sample, sample_ref

    g = torch.Generator().manual_seed(2)
    for V in (1, 7, 4097):
        logits = torch.cat([torch.randn(4, V, generator=g) * 3, torch.round(torch.randn(4, V, generator=g))])
        logits[1, 1::3] = float("-inf")  # banned ids: zero probability
        probs = torch.softmax(logits, dim=-1)
        total = sample_ref.prob_mass(probs).sum(-1)
        frac = torch.tensor([0.9, 0.999, 1.0, 1e-9, 0.5, 0.95, 0.3, 0.7], dtype=torch.float64)
        need = torch.ceil(frac * total.double()).long()
        active = torch.tensor([True, True, True, True, True, False, True, True])
        with poisoned_empty():
            got = sample.top_p_threshold(probs, need, active)
        want = sample_ref.top_p_threshold(probs, need, active)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (V, got, want)


def check_sampler_top_p_through_the_kernel_keeps_the_reference_set() -> None:
    """The batched sampler with 4 candidates: its wide nuclei take their cut from the Triton pass."""
    from k3backend.engine import sampler
    from k3backend.engine.sampler_ref import filter_probs
    from k3backend.engine.sampling_params import SamplingParams

    sampler.CANDIDATES = 4
    logits = torch.round(torch.randn(6, 300, generator=torch.Generator().manual_seed(3)))
    params = [SamplingParams(top_p=t, temperature=1.5) for t in (0.9, 0.5, 0.99, 0.2)] + [
        SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.9)]
    probs = sampler.Sampler._top_k_top_p(torch.softmax(logits / 1.5, dim=-1), params)
    for i, q in enumerate(params):
        want = filter_probs(logits[i], SamplingParams(top_k=q.top_k, top_p=q.top_p, temperature=1.5))
        assert torch.equal(probs[i], want), i


def test_kernels_compile_for_hopper():
    """The interpreter runs what a GPU compile refuses (a global that is not a tl.constexpr): both
    kernels compile for sm_90a as their wrappers launch them, without spills."""
    from sm90 import compile_sm90

    from k3backend.kernels import sample

    runs = [(sample._threshold_kernel, dict(p_ptr="*fp32", need_ptr="*i64", act_ptr="*i8", bits_ptr="*i32",
                                            above_ptr="*i64", V=163840, s_p=163840),
             dict(BLOCK=sample.THRESHOLD_BLOCK), 8),
            (sample._race_kernel, dict(p_ptr="*fp32", seed_ptr="*i64", step_ptr="*i64", val_ptr="*fp64",
                                       idx_ptr="*i64", V=163840, s_p=163840, NB=163840 // sample.BLOCK),
             dict(BLOCK=sample.BLOCK), 4)]
    for kernel, args, constexprs, warps in runs:
        c = compile_sm90(kernel, args, constexprs, num_warps=warps, num_stages=1)
        assert c.stack == 0, f"{kernel.fn.__name__}: {c}"


@pytest.mark.parametrize("name", CHECKS.names)
def test_under_interpreter(name: str) -> None:
    CHECKS.assert_passed(name)
