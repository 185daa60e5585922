"""Who runs this step: per-request bookkeeping (`Sequence`) and the FIFO scheduler with chunked prefill.

Spec: SERVING.md §5.5 (termination STP-1..STP-5), §5.6–5.7 (text deltas, hold-back, STR-3),
§5.9 (token accounting), §6.3 (stop convention). The scheduler decides only who runs and how many
prompt tokens each prefills; it builds no tensors (the engine turns a `StepPlan` into forwards).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from k3backend.detokenizer import IncrementalDetokenizer
from k3backend.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from k3backend.model.cache import SequenceCache
from k3backend.tokenizer import Tokenizer


class Cancel(str, Enum):
    STOP = "stop"  # stop convention ([CAN-5]): held-back text flushed
    ABORT = "abort"  # direct client cancel ([CAN-1]): the adapter answers with a CANCELLED error


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: prompt progress, outputs, and what the next event must carry.

    `num_computed`: prompt tokens already scheduled for prefill. After prefill the sequence always
    has exactly one sampled token not yet fed to the model (the last of `output_ids`), until it finishes.
    """

    request: Request
    on_output: Callable[[RequestOutput], None]
    detok: IncrementalDetokenizer
    mask_eos: tuple[int, ...]  # masked below min_tokens ([SMP-6] step 1): end_id, else the EOS set
    stop_eos: tuple[int, ...]  # ends generation ([STP-1] check 1): mask_eos unless ignore_eos
    num_computed: int = 0
    num_pads_computed: int = 0  # media-pad positions already prefilled: the next image row to use
    output_ids: list[int] = field(default_factory=list)
    cache: SequenceCache | None = None
    generator: torch.Generator | None = None
    cancel: Cancel | None = None
    finished: bool = False  # the final event is built (it may not be sent yet)
    final_sent: bool = False  # the final event went to `on_output`
    # the next event: tokens since the previous event and text released since then ([STR-8])
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_text: str = ""
    pending_reasoning: str = ""
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0

    @classmethod
    def create(cls, request: Request, on_output: Callable[[RequestOutput], None], tokenizer: Tokenizer) -> Sequence:
        """Raises ValueError for options the detokenizer rejects (e.g. an empty stop string)."""
        p = request.params
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=p.skip_special_tokens, stop_strings=p.stop,
                                       include_stop_str_in_output=p.include_stop_str_in_output,
                                       split_reasoning=request.split_reasoning, in_think=request.in_think)
        mask_eos = (p.end_id,) if p.end_id is not None else tuple(request.eos_ids)
        return cls(request, on_output, detok, mask_eos, () if p.ignore_eos else mask_eos)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def decoding(self) -> bool:
        """Prefill done and a sampled token waits to be fed ([STP-1] has not ended it)."""
        return not self.prefilling and bool(self.output_ids) and not self.finished

    def append_token(self, token: int, logprob: TokenLogprob | None) -> FinishReason | None:
        """Record a sampled token, run the termination checks of [STP-1] in order, release text."""
        p = self.request.params
        now = time.time_ns()
        self.first_token_time_ns = self.first_token_time_ns or now
        self.last_token_time_ns = now
        self.output_ids.append(token)
        self.pending_ids.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        n = len(self.output_ids)
        if n >= p.min_tokens and (token in p.stop_token_ids or token in self.stop_eos):
            return FinishReason.STOP  # [STP-2]: the terminating token produces no text
        delta = self.detok.push([token], check_stops=n >= p.min_tokens)  # [STP-5]
        self.pending_text += delta.text
        self.pending_reasoning += delta.reasoning
        if delta.stopped:
            return FinishReason.STOP
        if n >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def take_output(self, finish: FinishReason | None = None, *, flush: bool = True,
                    error: str | None = None) -> RequestOutput | None:
        """The next event, or None when there is nothing visible to send yet ([STR-3]).

        `finish` makes it the final event; `flush` releases held-back text first ([STR-6]).
        """
        if finish is not None:
            self.finished = True
            if flush:
                delta = self.detok.finish()
                self.pending_text += delta.text
                self.pending_reasoning += delta.reasoning
        elif not (self.pending_text or self.pending_reasoning):
            return None  # the token's text is held back: carry its id into the next event
        out = RequestOutput(
            request_id=self.request_id, text=self.pending_text, reasoning=self.pending_reasoning,
            token_ids=self.pending_ids,
            logprobs=self.pending_logprobs if self.request.params.logprobs is not None else None,
            finished=finish is not None, finish_reason=finish, error=error,
            num_input_tokens=self.num_prompt_tokens, arrival_time_ns=int(self.request.arrival_time * 1e9),
            first_scheduled_time_ns=self.first_scheduled_time_ns, first_token_time_ns=self.first_token_time_ns,
            last_token_time_ns=self.last_token_time_ns)
        self.pending_ids, self.pending_logprobs, self.pending_text, self.pending_reasoning = [], [], "", ""
        return out

    def free(self) -> None:
        self.cache = None
        self.generator = None


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of `seq` to prefill this step; `last` when it completes the prompt."""

    seq: Sequence
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == self.seq.num_prompt_tokens


@dataclass
class StepPlan:
    admitted: list[Sequence]  # newly running: need a cache and a generator before the forward
    prefill: list[PrefillChunk]
    decode: list[Sequence]  # one pending token each

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """FIFO admission up to `max_num_seqs` running; prompts prefilled within a per-step token budget.

    Sequences still prefilling get the budget first (oldest first), then new ones are admitted while
    budget is left, so an admitted request always starts prefilling in the step that admits it.
    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def all(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def pop_cancelled(self) -> list[Sequence]:
        """Remove and return every sequence marked for cancellation (queued or running)."""
        cancelled = [s for s in self.all() if s.cancel is not None]
        if cancelled:
            self.waiting = deque(s for s in self.waiting if s.cancel is None)
            self.running = [s for s in self.running if s.cancel is None]
        return cancelled

    def pop_all(self) -> list[Sequence]:
        seqs = self.all()
        self.waiting.clear()
        self.running = []
        return seqs

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        chunks: list[PrefillChunk] = []
        decode = [s for s in self.running if s.decoding]

        def take(seq: Sequence) -> None:
            nonlocal budget
            n = min(budget, seq.num_prompt_tokens - seq.num_computed)
            chunks.append(PrefillChunk(seq, seq.num_computed, seq.num_computed + n))
            seq.num_computed += n
            budget -= n

        for seq in self.running:
            if seq.prefilling and budget > 0:
                take(seq)
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            take(seq)
        return StepPlan(admitted, chunks, decode)
