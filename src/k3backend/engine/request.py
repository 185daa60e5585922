"""What the engine core takes and what it hands back, by token id (ENGINE.md §8).

The engine never sees text: the serving layer renders and tokenizes a prompt into a `Request`
(image placeholders already expanded), and turns the ids of `engine.outputs.StepOutputs` back
into text itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from k3backend.engine.sampling_params import SamplingParams


class FinishReason(IntEnum):
    """How a request ended (0: it did not, this step). The values travel in int8 arrays."""

    NONE = 0
    STOP = 1  # EOS / end_id or a stop token id ([STP-1] 1); stop strings are the serving layer's
    LENGTH = 2  # max_tokens reached
    CANCELLED = 3  # aborted by the serving layer (a client stop or cancel, a stop string, a failure there)
    ERROR = 4  # refused at admission (its validation) or failed with the engine: see the error

    @property
    def label(self) -> str:
        """The client-visible `finish_reason`: stop, length, cancelled."""
        return self.name.lower()


@dataclass
class Request:
    """One generation request. `prompt_ids` are final (chat-rendered, image placeholders expanded).

    image_embeds: [Σ N_i, hidden] rows for the `<|media_pad|>` positions, in order, or None.
    eos_ids: the EOS set ([STP-2]); `params.end_id` replaces it, `params.ignore_eos` disables it.
    bad_word_seqs: token sequences from `params.bad_words` ([STP-6]), tokenized by the caller.
    request_id: for logs only; the engine keys requests by the int id they are added with.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    image_embeds: torch.Tensor | None = None
    image_token_counts: tuple[int, ...] = ()  # N_i per image, in prompt order
    image_hashes: tuple[str, ...] = ()  # 32 hex characters per image: its prefix-cache identity ([IMG-4])
    bad_word_seqs: tuple[tuple[int, ...], ...] = ()
    arrival_time: float = field(default_factory=time.time)  # wall clock, s since the epoch


@dataclass
class TokenLogprob:
    """Log-probability data of one generated token ([LP-1]..[LP-3])."""

    token: int
    logprob: float
    rank: int  # 1-based rank in the raw distribution, ties to the lower id
    top: list[tuple[int, float]]  # the `params.logprobs` most likely (id, logprob), descending
