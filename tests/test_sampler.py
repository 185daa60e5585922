"""The batched device sampler picks the reference sampler's token for every row ([SMP-6], [SMP-7], [LP-1])."""

from __future__ import annotations

import random

import pytest
import torch

from k3backend.engine.sampler import Sampler, SamplingRow
from k3backend.engine.sampler_ref import banned_ids, filter_probs, request_seed, sample, token_logprob
from k3backend.engine.sampling_params import SamplingParams
from k3backend.kernels.sample_ref import counter_uniform
from test_kernels_sample import mass_boundaries

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


def test_bf16_logits_are_sampled_as_their_float32_values():
    """The model's bf16 logits go to the kernels as they are where no row masks or penalises (no float32
    copy), and through a float32 copy where one does: either way each row draws the reference's token
    from the logits' float32 values, log-probs included."""
    rng = random.Random(11)
    plain = [SamplingRow(SamplingParams(temperature=t, top_p=p, top_k=k, seed=i, logprobs=lp), request_seed(i), 4)
             for i, (t, p, k, lp) in enumerate([(0.0, 1.0, 0, None), (1.0, 0.9, 0, 3), (0.7, 1.0, 20, None),
                                                 (1.3, 0.5, 5, 0)])]
    penalised = [random_row(rng) for _ in range(6)]
    logits = (torch.randn(10, V, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    for rows, refs in ((plain, [{}] * len(plain)), (tuple(r for r, _ in penalised), [f for _, f in penalised])):
        got = Sampler()(logits[:len(rows)], rows)
        for i, (row, ref) in enumerate(zip(rows, refs)):
            want = sample(logits[i].float(), row.params, row.seed, row.step, **ref)
            assert got.token_ids[i] == want, (i, row.params)
            if row.params.logprobs is not None:
                lp = token_logprob(logits[i].float(), want, row.params.logprobs)
                assert (got.logprobs[i].rank, got.logprobs[i].top) == (lp.rank, lp.top)


def test_seeded_draw_does_not_depend_on_the_batch():
    """[SMP-7]: the same request state gives the same token alone, first or last in a batch."""
    rng = random.Random(7)
    rows = [random_row(rng)[0] for _ in range(9)]
    target = SamplingRow(SamplingParams(temperature=0.9, seed=12345), request_seed(12345), 3)
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(3))
    alone = Sampler()(logits[-1:], [target]).token_ids[0]
    assert Sampler()(logits, rows + [target]).token_ids[-1] == alone
    assert Sampler()(torch.cat([logits[-1:], logits[:-1]]), [target] + rows).token_ids[0] == alone


def test_reference_draw_of_many_rows_equals_each_row_alone():
    """sample_ref draws DRAW_ROWS rows at a time: 70 rows (two chunks and a tail) give each row's own draw."""
    from k3backend.kernels import sample_ref

    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(70, V, generator=g) * 2, -1)
    seeds, steps = torch.randint(0, 2**62, (70,), generator=g), torch.randint(0, 1000, (70,), generator=g)
    got = sample_ref.race_draw(probs, seeds, steps)
    alone = [sample_ref.race_draw(probs[i:i + 1], seeds[i:i + 1], steps[i:i + 1]) for i in range(70)]
    assert sample_ref.DRAW_ROWS < 70 and torch.equal(got, torch.cat(alone))
    assert sample_ref.race_draw(probs[:0], seeds[:0], steps[:0]).shape == (0,)


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


# ---- top-k / top-p: the batched cut keeps the reference's set (on the CPU, kernels.top_k_top_p's
# sorted reference; tests/test_kernels_sample.py holds the sort-free kernel to it) ------------------


def batched_filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Steps 4-7 of the batched sampler (as `Sampler._draw` runs them) for rows of logits."""
    temp = torch.tensor([q.temperature for q in params])[:, None]
    probs = Sampler._top_k_top_p(torch.softmax(logits / temp, dim=-1), params)
    min_p = torch.tensor([q.min_p for q in params])[:, None]
    return torch.where(probs < min_p * probs.max(-1, keepdim=True).values, 0.0, probs)


def assert_filters_equal(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    got = batched_filter(logits, params)
    for i, q in enumerate(params):
        want = filter_probs(logits[i], q)
        assert torch.equal(got[i], want), (i, q, (got[i] != want).nonzero()[:, 0].tolist()[:10])


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid: most probabilities have many equal ids, at every cut."""
    g = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(rows, vocab, generator=g) * 1.5)


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_keeps_the_reference_set(seed):
    """Smooth, tied and bf16-rounded logits; top-k from 1 to past the vocabulary; top-p from a few
    ids to nearly all; min-p."""
    rng = random.Random(seed)
    params = [SamplingParams(temperature=rng.choice([0.3, 1.0, 2.5]), top_k=rng.choice([0, 0, 1, 3, 17, 40, 300]),
                             top_p=rng.choice([1.0, 0.05, 0.5, 0.9, 0.99, 0.999999]),
                             min_p=rng.choice([0.0, 0.0, 0.1])) for _ in range(32)]
    top_k_only = [SamplingParams(temperature=q.temperature, top_k=q.top_k, min_p=q.min_p) for q in params]
    g = torch.Generator().manual_seed(seed)
    for logits in (torch.randn(32, V, generator=g) * 3, tied_logits(32, V, seed),
                   torch.randn(32, V, generator=g).bfloat16().float()):
        assert_filters_equal(logits, params)
        assert_filters_equal(logits, top_k_only)


def boundary_top_ps(logits: torch.Tensor, temperature: float, top_k: int) -> list[float]:
    """top_p at the mass of a prefix of the reference's order over the top-k's, and the doubles beside it."""
    k = top_k if 0 < top_k < len(logits) else len(logits)
    return mass_boundaries(torch.softmax(logits / temperature, dim=-1), k, (0, 1, 2, 5, 9, 20))


def test_top_p_at_a_cumulative_boundary():
    for logits in (torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2, tied_logits(1, V, 6)[0]):
        for temperature, top_k in ((1.0, 0), (0.7, 12), (1.3, 300)):
            params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=t)
                      for t in boundary_top_ps(logits, temperature, top_k)]
            assert_filters_equal(logits.expand(len(params), V), params)


def test_ties_at_the_cut_keep_the_lower_ids():
    """Eight equal ids share the mass below id 40's: top-k 3 and the top-p cuts take the lowest of them."""
    logits = torch.full((V,), -1e4)
    tied = [200, 13, 77, 5, 150, 99, 31, 250]
    logits[tied] = 0.0
    logits[40] = 1.0
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_p=0.7)]
    got = batched_filter(logits.expand(3, V), params)
    assert (got[0] > 0).nonzero()[:, 0].tolist() == [5, 13, 40]
    alone = batched_filter(logits.expand(2, V), [SamplingParams(top_k=3), SamplingParams(top_k=6)])
    assert [(row > 0).nonzero()[:, 0].tolist() for row in alone] == [[5, 13, 40], [5, 13, 31, 40, 77, 99]]
    for row, q, n_tied in ((got[1], params[1], 3), (got[2], params[2], 5)):
        assert torch.equal(row, filter_probs(logits, q))
        assert (row > 0).nonzero()[:, 0].tolist() == sorted([40] + sorted(tied)[:n_tied])


@pytest.mark.parametrize("seed", range(3))
def test_mixed_batch_equals_the_reference(seed):
    """Greedy, temperature-only, top-k, top-p and min-p rows in one batch with bans and penalties,
    tied logits: every row draws the reference's token, and its top log-probs are the reference's,
    ties to the lower id."""
    rng = random.Random(100 + seed)
    rows, refs = zip(*[random_row(rng) for _ in range(40)])
    logits = tied_logits(len(rows), V, seed) * 0.5  # flat: top-p 0.9 keeps ~200 ids
    got = Sampler()(logits, rows)
    for i, (row, ref) in enumerate(zip(rows, refs)):
        want = sample(logits[i], row.params, row.seed, row.step, **ref)
        assert got.token_ids[i] == want, (i, row.params)
        if row.params.logprobs is not None:
            lp = token_logprob(logits[i], want, row.params.logprobs)
            g = got.logprobs[i]
            assert (g.rank, g.top) == (lp.rank, lp.top)
