"""One sequence without an engine: the full forward of a prompt, and the plain generation loop.

The serving engine (`k3backend.engine`) batches many requests; `generate` is the loop the CLI
uses and the reference the engine's outputs are compared with: prefill the prompt into fresh
pools, then decode token by token, sampling with the reference sampler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from k3backend.engine.batch import SeqChunk, blocks_for, build_forward_batch
from k3backend.engine.sampler_ref import request_seed, sample
from k3backend.engine.sampling_params import SamplingParams, eos_sets
from k3backend.model.cache import CachePools, ForwardBatch
from k3backend.model.k3 import K3Model

BLOCK_SIZE = 64
SLOT = 1  # the one sequence's KDA slot (0 is the null slot)


@dataclass(frozen=True)
class Step:
    """One sampled token and its raw log-probability (log-softmax of the fp32 logits, [LP-1])."""

    token: int
    logprob: float


def _pools(model: K3Model, num_tokens: int) -> tuple[CachePools, list[int]]:
    """Fresh pools for one sequence of up to num_tokens, and its block table."""
    n = blocks_for(num_tokens, BLOCK_SIZE)
    return CachePools.allocate(model.language_model, 2, n + 1, BLOCK_SIZE), list(range(1, n + 1))


def _prefill_batch(model: K3Model, ids: Sequence[int], table: list[int],
                   image_embeds: torch.Tensor | None) -> ForwardBatch:
    device = model.language_model.lm_head.weight.device
    pads = [i for i, t in enumerate(ids) if t == model.cfg.media_placeholder_token_id]
    rows = 0 if image_embeds is None else image_embeds.shape[0]
    if len(pads) != rows:
        raise ValueError(f"the prompt has {len(pads)} image pad positions but the images give {rows} embeddings")
    mm = image_embeds.to(device) if pads else None
    return build_forward_batch([SeqChunk(list(ids), 0, SLOT, False, table)], 0, BLOCK_SIZE, device, pads, mm)


@torch.inference_mode()
def full_forward(model: K3Model, input_ids: Sequence[int] | torch.Tensor,
                 image_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [T, V] at every position of one fresh sequence (image rows over its media pads)."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    pools, table = _pools(model, len(ids))
    batch = _prefill_batch(model, ids, table, image_embeds)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(ids), device=batch.input_ids.device))
    return model(batch, pools)


@torch.inference_mode()
def generate(model: K3Model, prompt_ids: Sequence[int], params: SamplingParams, *, eos_ids: Sequence[int] = (),
             image_embeds: torch.Tensor | None = None,
             bad_word_seqs: Sequence[Sequence[int]] = ()) -> Iterator[Step]:
    """Yield sampled tokens until EOS / a stop token id (after min_tokens) or max_tokens.

    Stop strings are matched by the caller on detokenized text ([STP-3]).
    """
    mask_eos, stop_eos = eos_sets(params, tuple(eos_ids))
    device = model.language_model.lm_head.weight.device
    pools, table = _pools(model, len(prompt_ids) + params.max_tokens)
    seed = request_seed(params.seed)
    logits = model(_prefill_batch(model, prompt_ids, table, image_embeds), pools)[0]
    out: list[int] = []
    while True:
        logits32 = logits.float().cpu()
        token = sample(logits32, params, seed, len(out), prompt_ids=prompt_ids, output_ids=out, eos_ids=mask_eos,
                       bad_word_seqs=bad_word_seqs)
        out.append(token)
        yield Step(token, float(torch.log_softmax(logits32, -1)[token]))
        if len(out) >= params.min_tokens and (token in params.stop_token_ids or token in stop_eos):
            return
        if len(out) >= params.max_tokens:
            return
        # generated ids are plain tokens: a sampled <|media_pad|> carries no image row
        pos = len(prompt_ids) + len(out) - 1
        batch = build_forward_batch([SeqChunk([token], pos, SLOT, True, table)], 1, BLOCK_SIZE, device)
        logits = model(batch, pools)[0]
