"""Single-request generation: prefill with a fresh cache, then cached token-by-token decode.

The serving engine (`k3backend.engine`) batches many requests; this is the plain loop the CLI
uses and the reference the engine's outputs are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from k3backend.engine.sampler import make_generator, sample
from k3backend.engine.sampling_params import SamplingParams
from k3backend.model.cache import ForwardBatch
from k3backend.model.k3 import K3Model


@dataclass(frozen=True)
class Step:
    """One sampled token and its raw log-probability (log-softmax of the fp32 logits, [LP-1])."""

    token: int
    logprob: float


@torch.inference_mode()
def generate(model: K3Model, prompt_ids: Sequence[int], params: SamplingParams, *, eos_ids: Sequence[int] = (),
             image_embeds: torch.Tensor | None = None) -> Iterator[Step]:
    """Yield sampled tokens until EOS / a stop token id (after min_tokens) or max_tokens.

    Stop strings are matched by the caller on detokenized text ([STP-3]).
    """
    mask_eos = (params.end_id,) if params.end_id is not None else tuple(eos_ids)  # end_id replaces the set
    stop_eos = () if params.ignore_eos else mask_eos
    device = model.language_model.lm_head.weight.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    cache = model.new_cache()
    gen = make_generator(params.seed)
    last = torch.tensor([len(ids) - 1], device=device)
    logits = model(ids, ForwardBatch.single(len(ids), cache), image_embeds=image_embeds, logits_rows=last)[0]
    out: list[int] = []
    while True:
        logits32 = logits.float().cpu()
        token = sample(logits32, params, gen, prompt_ids=prompt_ids, output_ids=out,
                       eos_ids=mask_eos)
        out.append(token)
        yield Step(token, float(torch.log_softmax(logits32, -1)[token]))
        if len(out) >= params.min_tokens and (token in params.stop_token_ids or token in stop_eos):
            return
        if len(out) >= params.max_tokens:
            return
        # generated ids are plain tokens: a sampled <|media_pad|> carries no image row
        logits = model.language_model(torch.tensor([token], device=device), ForwardBatch.single(1, cache))[0]
