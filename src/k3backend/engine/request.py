"""What the server hands the engine, and what the engine hands back (the engine API's data types).

The serving layer hands `Engine.add(client_id, prepare, on_output)` a function that builds a
`Request` (token ids already rendered and image-expanded) and receives `RequestOutput` events on
that callback, from the engine's output thread, in order; exactly one event has `finished=True`
and it is the last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from k3backend.engine.sampling_params import SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"  # EOS / end_id, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # Engine.stop(request_id) or abort
    ERROR = "error"  # the request failed: the event carries `error`


@dataclass
class Request:
    """One generation request. `prompt_ids` are final (chat-rendered, image placeholders expanded).

    image_embeds: [Σ N_i, hidden] rows for the `<|media_pad|>` positions, in order, or None.
    eos_ids: the EOS set ([STP-2]); `params.end_id` replaces it, `params.ignore_eos` disables it.
    bad_word_seqs: token sequences from `params.bad_words` ([STP-6]), tokenized by the caller.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    image_embeds: torch.Tensor | None = None
    image_token_counts: tuple[int, ...] = ()  # N_i per image, in prompt order
    image_hashes: tuple[str, ...] = ()  # 32 hex characters per image: its prefix-cache identity ([IMG-4])
    bad_word_seqs: tuple[tuple[int, ...], ...] = ()
    split_reasoning: bool = False  # route think-element text to `reasoning` ([TXT-3])
    in_think: bool = False  # the prompt ended inside an open think element
    arrival_time: float = field(default_factory=time.time)  # wall clock, s since the epoch


@dataclass
class TokenLogprob:
    """Log-probability data of one generated token ([LP-1]..[LP-3])."""

    token: int
    logprob: float
    rank: int  # 1-based rank in the raw distribution, ties to the lower id
    top: list[tuple[int, float]]  # the `params.logprobs` most likely (id, logprob), descending


@dataclass
class RequestOutput:
    """A delta since the previous event of the same request ([STR-4], [STR-8]).

    text / reasoning: newly released visible text (may be empty on the final event);
    token_ids / logprobs: tokens sampled since the previous event (whether or not their text was held back).
    """

    request_id: str
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Why the request ended without a normal finish: a client-visible `K3Error` (INVALID_ARG at
    # admission, CANCELLED for an abort, UNAVAILABLE for an engine failure or shutdown) or, for a
    # defect, any other exception. Set only on the final event.
    error: Exception | None = None
    num_input_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
