"""Who runs this step: per-request bookkeeping (`Sequence`) and the FIFO scheduler with chunked prefill.

Spec: SERVING.md §5.5 (termination STP-1..STP-5), §5.6–5.7 (text deltas, hold-back, STR-3),
§5.9 (token accounting), §6.3 (stop convention). The scheduler decides only who runs and how many
prompt tokens each prefills; it builds no tensors (the engine turns a `StepPlan` into forwards).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from k3backend.engine.request import FinishReason, Request, RequestOutput
from k3backend.model.cache import SequenceCache


class Cancel(str, Enum):
    STOP = "stop"  # stop convention ([CAN-5]): held-back text flushed, finish_reason cancelled
    ABORT = "abort"  # direct client cancel ([CAN-1]): ends with a CANCELLED error
    DONE = "done"  # a stop string ended it on the output thread: remove, emit nothing more


@dataclass(eq=False)
class Sequence:
    """One request inside the engine, from `Engine.add` until it leaves the scheduler.

    Until `bind()` the request is still being prepared (tokenized) and only `key`, `client_id`
    and `cancel` matter: a stop or abort can already reach it ([CAN-5] at every interleaving).
    `num_computed`: prompt tokens already scheduled for prefill. After prefill the sequence always
    has exactly one sampled token not yet fed to the model (the last of `output_ids`), until it finishes.
    """

    key: str  # the engine's unique id of this request
    client_id: str  # the client's request id: what stop requests match ([CAN-3])
    on_output: Callable[[RequestOutput], None]
    prepare: Callable[[], Request] | None = None
    request: Request | None = None
    mask_eos: tuple[int, ...] = ()  # masked below min_tokens ([SMP-6] step 1): end_id, else the EOS set
    stop_eos: tuple[int, ...] = ()  # ends generation ([STP-1] check 1): mask_eos unless ignore_eos
    cancel: Cancel | None = None
    num_computed: int = 0
    num_pads_computed: int = 0  # media-pad positions already prefilled: the next image row to use
    output_ids: list[int] = field(default_factory=list)
    cache: SequenceCache | None = None
    generator: torch.Generator | None = None
    finished: bool = False
    first_scheduled_time_ns: int = 0

    def bind(self, request: Request) -> None:
        """The prepared request; derives the EOS sets once ([STP-2])."""
        p = request.params
        self.request, self.prepare = request, None
        self.mask_eos = (p.end_id,) if p.end_id is not None else tuple(request.eos_ids)
        self.stop_eos = () if p.ignore_eos else self.mask_eos

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

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token and run the id-level checks of [STP-1] (1: stop ids / EOS, 3: length).

        Stop strings (check 2) are matched on the output thread, which ends the request itself.
        """
        p = self.request.params
        self.output_ids.append(token)
        n = len(self.output_ids)
        if n >= p.min_tokens and (token in p.stop_token_ids or token in self.stop_eos):
            self.finished = True
            return FinishReason.STOP  # [STP-2]: the terminating token produces no text
        if n >= p.max_tokens:
            self.finished = True
            return FinishReason.LENGTH
        return None

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

    def remove_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
        return done

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
