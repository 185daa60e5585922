"""What crosses from the scheduler to the model runner each step: plain, picklable data.

A `StepPlan` holds ints and the step's new sampling settings, never activations, callbacks or
engine objects, so the same plan can run in-process or be sent to worker processes. Per request
the runner keeps only what the plan indexes: a slot's sampling settings and token history
(penalties, bad words, min_tokens) from the `SlotRequest` that introduced it until the plan frees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3backend.engine.sampling_params import SamplingParams


PENDING = -1  # a decode row's input that the step before sampled and the host has not seen yet (the
# engine schedules while that step runs): the runner takes it from that step's ids on the device


@dataclass(frozen=True)
class SlotRequest:
    """A request entering a KDA slot (admission, or recompute after preemption)."""

    slot: int
    params: SamplingParams
    seed: int  # int64 draw seed ([SMP-7])
    eos_ids: tuple[int, ...]  # masked below min_tokens: end_id, else the EOS set
    bad_word_seqs: tuple[tuple[int, ...], ...]
    prompt_ids: tuple[int, ...]  # only for repetition penalties: () otherwise
    output_ids: tuple[int, ...]  # tokens sampled so far (after a preemption)
    image_embeds: torch.Tensor | None = None  # [Σ N_i, H]: the rows of the prompt's media pads


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's tokens this step: positions start..start+len(token_ids) of its stream."""

    slot: int
    token_ids: tuple[int, ...]
    start: int
    has_initial_state: bool
    block_table: tuple[int, ...]
    sample: bool  # draw a token from the last position's logits
    mm_first_row: int = 0  # the first image row used by this chunk
    mm_offsets: tuple[int, ...] = ()  # offsets in token_ids of the image pad positions
    snapshots: tuple[tuple[int, int], ...] = ()  # (offset, slot): KDA state after token_ids[:offset] into slot


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decode rows first
    num_decode: int = 0
    new: list[SlotRequest] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)  # slots whose sampling state the runner drops
    copies: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, slot) before the forward
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot) after the forward

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def chunks(self) -> list[ScheduledSeq]:
        """The prompt chunks (after the decode rows)."""
        return self.seqs[self.num_decode:]

    @property
    def prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.chunks)


@dataclass(frozen=True)
class CacheCapacity:
    """The sizes the pools were allocated with, which the scheduler schedules against."""

    num_blocks: int  # MLA latent blocks, null block included
    num_slots: int  # KDA slots, null slot included
    block_size: int
