"""Reference sampler (SERVING.md [SMP-6]): masks, penalties, temperature, top-k, top-p, min-p, draw.

The definition of sampling for the project: the batched device sampler (`engine/sampler.py`)
must pick the same token for the same request state. The draw is an exponential race over the
filtered probabilities, argmax_i p_i / E_i with E_i = -log u_i (an exact sample of p), and the
uniforms u_i come from a counter-based hash of (seed, output position, token id): a request's
tokens depend only on its own seed and history, never on the batch it runs in ([SMP-7]).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import torch

from k3backend.engine.request import TokenLogprob
from k3backend.engine.sampling_params import SamplingParams
from k3backend.kernels.sample_ref import mass_units, race_draw


def as_int64(seed: int) -> int:
    """A uint64 seed (0 <= seed < 2**64) as the signed int64 with the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """Repetition over prompt+output tokens; frequency and presence over output tokens only."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if len(seen):
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long)
        c = torch.tensor([counts[i] for i in counts], dtype=logits.dtype)
        logits[ids] -= p.frequency_penalty * c + p.presence_penalty
    return logits


def banned_ids(p: SamplingParams, output_ids: Sequence[int], eos_ids: Sequence[int],
               bad_word_seqs: Sequence[Sequence[int]]) -> list[int]:
    """Token ids masked at this step: bad-word completions ([STP-6]) and, below min_tokens, EOS and stop ids."""
    banned = []
    for seq in bad_word_seqs:
        prefix = list(seq[:-1])
        if not prefix or list(output_ids[len(output_ids) - len(prefix):]) == prefix:
            banned.append(seq[-1])
    if len(output_ids) < p.min_tokens:
        banned += list(eos_ids) + list(p.stop_token_ids)
    return banned


def filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Steps 4–7: temperature, top-k, top-p (ties to the lower id), min-p. Returns unnormalised probs [V].

    Top-p's mass is counted in units of 2**-32 (`mass_units`): integer sums, exact in any order, so
    a cut that does not sort the vocabulary finds the same set.
    """
    probs = torch.softmax(logits / p.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)  # ties: lower id first
    V = probs.numel()
    k = p.top_k if 0 < p.top_k < V else V
    n = k
    if p.top_p < 1.0:
        mass = mass_units(sorted_probs[:k])
        need = math.ceil(p.top_p * float(mass.sum()))  # the smallest prefix whose mass reaches this
        n = min(k, int((mass.cumsum(0) < need).sum()) + 1)
    probs = torch.zeros_like(probs).scatter(0, order[:n], sorted_probs[:n])
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs


def sample(logits: torch.Tensor, p: SamplingParams, seed: int, step: int, *, prompt_ids: Sequence[int] = (),
           output_ids: Sequence[int] = (), eos_ids: Sequence[int] = (),
           bad_word_seqs: Sequence[Sequence[int]] = ()) -> int:
    """One token from fp32 logits [V] for one request ([SMP-6] steps 1–8); `seed` an int64, `step`
    the output position of the token (its draw's counter)."""
    logits = logits.float()
    ban = banned_ids(p, output_ids, eos_ids, bad_word_seqs)
    if ban:
        logits = logits.index_fill(0, torch.tensor(ban, dtype=torch.long), float("-inf"))
    logits = apply_penalties(logits, p, prompt_ids, output_ids)
    if p.greedy:
        return int(torch.argmax(logits))  # first maximum: ties to the lowest id
    probs = filter_probs(logits, p)
    return int(race_draw(probs[None], torch.tensor([seed]), torch.tensor([step]))[0])


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """[LP-1]..[LP-3] from the raw fp32 logits [V] (before penalties): rank 1-based, ties to the lower id."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    v = lp[token]
    rank = 1 + int((lp > v).sum()) + int((lp[:token] == v).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.sort(lp, descending=True, stable=True)  # stable: ties keep the lower id first
        top = list(zip(ids[:k].tolist(), vals[:k].tolist()))
    return TokenLogprob(token, float(v), rank, top)


def request_seed(seed: int | None) -> int:
    """The request's int64 draw seed: its own, else one from OS entropy at admission ([SMP-7])."""
    if seed is None:
        import os

        return as_int64(int.from_bytes(os.urandom(8), "little"))
    return as_int64(seed % 2**64)
