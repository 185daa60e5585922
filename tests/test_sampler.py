"""The batched device sampler picks the reference sampler's token for every row ([SMP-6], [SMP-7], [LP-1])."""

from __future__ import annotations

import random

import pytest
import torch

from k3backend.engine.sampler import Sampler, SamplingRow
from k3backend.engine.sampler_ref import banned_ids, request_seed, sample, token_logprob
from k3backend.engine.sampling_params import SamplingParams
from k3backend.kernels.sample_ref import counter_uniform

V = 257


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=64, min_tokens=rng.choice([0, 0, 5]), temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 1, 5, 40, 300]), top_p=rng.choice([1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.05]), repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, -0.4]),
        seed=rng.randrange(2**64), stop_token_ids=(3,), logprobs=rng.choice([None, 0, 4]))


def random_row(rng: random.Random) -> tuple[SamplingRow, dict]:
    p = random_params(rng)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 20))]
    out = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
    bad = ((7,), (out[-1], 9)) if out else ((7,),)
    eos = (2,)
    row = SamplingRow(p, request_seed(p.seed), len(out), tuple(banned_ids(p, out, eos, bad)), prompt, out)
    return row, {"prompt_ids": prompt, "output_ids": out, "eos_ids": eos, "bad_word_seqs": bad}


@pytest.mark.parametrize("seed", range(4))
def test_batched_sampler_equals_the_reference_row_by_row(seed):
    rng = random.Random(seed)
    rows, refs = zip(*[random_row(rng) for _ in range(24)])
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 11] = logits[:, 12]  # a tie: the lower id wins
    got = Sampler()(logits, rows)
    for i, (row, ref) in enumerate(zip(rows, refs)):
        want = sample(logits[i], row.params, row.seed, row.step, **ref)
        assert got.token_ids[i] == want, (i, row.params)
        if row.params.logprobs is None:
            assert got.logprobs[i] is None
        else:
            lp = token_logprob(logits[i], want, row.params.logprobs)
            g = got.logprobs[i]
            assert (g.token, g.rank, [t for t, _ in g.top]) == (lp.token, lp.rank, [t for t, _ in lp.top])
            assert g.logprob == pytest.approx(lp.logprob, abs=1e-6)


def test_seeded_draw_does_not_depend_on_the_batch():
    """[SMP-7]: the same request state gives the same token alone, first or last in a batch."""
    rng = random.Random(7)
    rows = [random_row(rng)[0] for _ in range(9)]
    target = SamplingRow(SamplingParams(temperature=0.9, seed=12345), request_seed(12345), 3)
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(3))
    alone = Sampler()(logits[-1:], [target]).token_ids[0]
    assert Sampler()(logits, rows + [target]).token_ids[-1] == alone
    assert Sampler()(torch.cat([logits[-1:], logits[:-1]]), [target] + rows).token_ids[0] == alone


def test_draws_follow_the_distribution():
    """The exponential race is an exact sample: frequencies over many positions match p."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = SamplingParams(temperature=1.0)
    logits = torch.log(probs)
    counts = torch.zeros(4)
    for step in range(4000):
        counts[sample(logits, p, 99, step)] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.025)


def test_counter_uniform_is_in_the_open_unit_interval_and_keyed():
    u = counter_uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 50000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], counter_uniform(torch.tensor([1]), torch.tensor([0]), 50000)[0])
