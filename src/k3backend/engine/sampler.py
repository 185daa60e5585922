"""Reference sampler (SERVING.md [SMP-6]): masks, penalties, temperature, top-k, top-p, min-p, draw.

The definition of sampling for the project: a fused path must pick the same token for the same
uniform draw. The draw is inverse-CDF over token ids in ascending order with one `torch.rand`
from the request's own generator, so a request's tokens never depend on other requests.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from k3backend.engine.sampling_params import SamplingParams


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
    """Steps 4–7: temperature, top-k, top-p (ties to the lower id), min-p. Returns unnormalised probs [V]."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    order = torch.sort(probs, descending=True, stable=True).indices  # ties: lower id first
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k if 0 < p.top_k < probs.numel() else probs.numel()
    keep[order[:k]] = True
    if p.top_p < 1.0:
        top = probs[order[:k]]
        mass = torch.cumsum(top / top.sum(), dim=0)
        n = int(torch.searchsorted(mass, torch.tensor(p.top_p, dtype=mass.dtype)).item()) + 1
        keep[order[min(n, k):]] = False
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator, *, prompt_ids: Sequence[int] = (),
           output_ids: Sequence[int] = (), eos_ids: Sequence[int] = (),
           bad_word_seqs: Sequence[Sequence[int]] = ()) -> int:
    """One token from fp32 logits [V] for one request ([SMP-6] steps 1–8)."""
    logits = logits.float()
    ban = banned_ids(p, output_ids, eos_ids, bad_word_seqs)
    if ban:
        logits = logits.index_fill(0, torch.tensor(ban, dtype=torch.long), float("-inf"))
    logits = apply_penalties(logits, p, prompt_ids, output_ids)
    if p.greedy:
        return int(torch.argmax(logits))  # first maximum: ties to the lowest id
    probs = filter_probs(logits, p)
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=probs.numel() - 1))


def make_generator(seed: int | None) -> torch.Generator:
    """The request's own generator: from its seed, else from OS entropy at admission ([SMP-7])."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % 2**64)
    return g
