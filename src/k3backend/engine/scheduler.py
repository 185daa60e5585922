"""Who runs this step: per-request bookkeeping (`Sequence`) and the scheduler that builds a `StepPlan`.

Spec: SERVING.md §5.5 (termination), §6 (cancellation); the engine contract's step rules:
continuous batching with every decoding sequence first and prefill chunks after them, all in one
forward, under `max_num_batched_tokens` (decode tokens count) and `max_num_seqs`; in a step
that decodes, the prompts longer than `prefill_cap` take at most its tokens for where their chunk
starts. A sequence is admitted only when a KDA slot and MLA blocks for its first chunk are free;
when a decoding sequence needs a block and none is free, or when no running sequence can take a step at all
(every one a prefill short of blocks), the newest running sequence is preempted: it gives up
its blocks and slot and is recomputed later from prompt + output so far, which changes none of
its output ([STR-7]).

Prefix caching (`prefix_caching`): prompt blocks are shared by content key
(`block_manager.chain_keys`); KDA state is reusable only where a snapshot was taken: at every
`snapshot_interval` tokens and at the last block boundary before the prompt's last token. A
snapshot point a whole number of KDA chunks (64 tokens) after its chunk's start is taken inside
the chunked walk (the layers copy the state and conv history there into the snapshot slot), so
it does not end the chunk; any other point ends the chunk, and the state is copied after the step.
A hit is the longest prefix whose blocks and snapshot both survive; at least the prompt's last
token is always computed (its logits start generation).

The scheduler decides who runs and which tokens; it builds no tensors. Not thread-safe: the
engine core's one loop calls it.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from k3backend.engine.batch import blocks_for
from k3backend.engine.block_manager import BlockManager, chain_keys
from k3backend.engine.plan import PENDING, CacheCapacity, ScheduledSeq, SlotRequest, StepPlan
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.sampler_ref import request_seed
from k3backend.engine.sampling_params import eos_sets
from k3backend.engine.state_slots import StateSlots
from k3backend.kernels.varlen import KDA_CHUNK


@dataclass(eq=False)
class Sequence:
    """One request inside the engine, from `EngineCore.add` until it leaves the scheduler.

    Its token stream is prompt + output; `num_computed` of them are in the caches. After the
    prompt it always has exactly one sampled token not yet fed to the model (the last output),
    until it finishes.
    """

    rid: int  # the id the serving layer added it with
    request: Request
    mask_eos: tuple[int, ...] = ()  # masked below min_tokens ([SMP-6] step 1): end_id, else the EOS set
    stop_eos: tuple[int, ...] = ()  # ends generation ([STP-1] check 1): mask_eos unless ignore_eos
    seed: int = 0  # int64 draw seed ([SMP-7])
    pad_id: int = -1  # the image pad id, to find the prompt's image positions
    cancelled: bool = False  # aborted: removed at the next step boundary
    output_ids: list[int] = field(default_factory=list)
    pending: int = 0  # tokens drawn by launched steps whose values the host has not seen yet
    finished: bool = False
    started: bool = False  # scheduled at least once
    num_computed: int = 0
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    keys: list[bytes] = field(default_factory=list)  # chain keys of the prompt's full blocks
    num_registered: int = 0  # prompt blocks whose keys are registered with the block manager
    pads: list[int] = field(default_factory=list)  # prompt positions of image pads
    counted: bool = False  # prefix-cache queries counted (first admission only)
    queued_at: float = 0.0  # monotonic time it was added (prefill_delay_s)

    def __post_init__(self) -> None:
        """EOS sets ([STP-2]), draw seed, image pad positions."""
        request = self.request
        self.mask_eos, self.stop_eos = eos_sets(request.params, request.eos_ids)
        self.seed = request_seed(request.params.seed)
        self.pads = [i for i, t in enumerate(request.prompt_ids) if t == self.pad_id] \
            if request.image_embeds is not None else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_output(self) -> int:
        """Output tokens drawn, pending ones included."""
        return len(self.output_ids) + self.pending

    @property
    def target(self) -> int:
        """Stream tokens to compute before decoding: the prompt, or all but the last output after a preemption."""
        return self.num_prompt_tokens + max(0, self.num_output - 1)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.target

    @property
    def decoding(self) -> bool:
        """Its last drawn token is to be fed; not when max_tokens are drawn (a pending one ends it)."""
        n = self.num_output
        return not self.prefilling and 0 < n < self.request.params.max_tokens and not self.finished

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Stream tokens [start, end); a pending output is PENDING (only a decode row's last one can be)."""
        n = self.num_prompt_tokens
        prompt = self.request.prompt_ids
        out = tuple(self.output_ids[max(0, start - n):max(0, end - n)])
        missing = max(0, end - n - len(self.output_ids)) - max(0, start - n - len(self.output_ids))
        return tuple(prompt[start:min(end, n)]) + out + (PENDING,) * missing

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token and run the id-level checks of [STP-1] (1: stop ids / EOS, 3: length).

        Stop strings (check 2) are matched by the serving layer, which then aborts the request.
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


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's settings the scheduler needs (EngineConfig holds their defaults and checks)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    snapshot_interval: int  # tokens between KDA prefix snapshots; a multiple of the block size
    # (chunk start, tokens), starts ascending: the prefill tokens that the prompts longer than the first
    # entry's take in a step that also decodes, where their chunk starts at most there (a chunk attends
    # to its prefix, so later ones cost more); () the step budget alone. A long prompt's chunks stall the
    # decoding requests for a bounded time; shorter prompts are admitted whole, so a burst of them is
    # not spread over extra steps (EngineCore sets it from measured step times: `prefill_cap`).
    prefill_cap: tuple[tuple[int, int], ...] = ()
    # While requests decode, new prompts wait up to this long (s) so that several share one prefill step
    # (its fixed cost is paid once); 0: admitted at once. Like a dynamic batcher's max queue delay.
    prefill_delay_s: float = 0.0


class Scheduler:
    """Waiting (FIFO) and running sequences, the block manager and the state slots."""

    def __init__(self, cfg: SchedulerConfig, capacity: CacheCapacity) -> None:
        self.cfg = cfg
        self.bs = capacity.block_size
        if cfg.snapshot_interval % self.bs:
            raise ValueError(f"snapshot_interval {cfg.snapshot_interval} must be a multiple of the block size {self.bs}")
        self.blocks = BlockManager(capacity.num_blocks, self.bs)
        self.slots = StateSlots(capacity.num_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = self.prefix_queries = self.prefix_hits = 0
        self._freed: list[int] = []  # slots released since the last plan
        self._snapshots: list[tuple[bytes, int]] = []  # taken by the plan in flight
        self._now = 0.0  # the time schedule() was called at

    # ---- membership ----------------------------------------------------------------------------

    def add(self, seq: Sequence, now: float | None = None) -> None:
        seq.queued_at = time.monotonic() if now is None else now
        self.waiting.append(seq)

    def all(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def pop_cancelled(self) -> list[Sequence]:
        """Remove every sequence marked for cancellation (queued or running), its resources freed."""
        cancelled = [s for s in self.all() if s.cancelled]
        if cancelled:
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
            self.running = [s for s in self.running if not s.cancelled]
            for seq in cancelled:
                self._release(seq)
        return cancelled

    def pop_all(self) -> list[Sequence]:
        """Every sequence, removed: the engine is failing or closing. The pools start over instead of
        taking each release, which would raise again on the state that failed the step (a double
        free) and leave the requests unanswered."""
        seqs = self.all()
        self.waiting.clear()
        self.running = []
        self.blocks = BlockManager(self.blocks.num_blocks, self.bs)
        self.slots = StateSlots(self.slots.num_slots)
        return seqs

    def remove_finished(self, waiting_too: bool = False) -> list[Sequence]:
        """Running sequences that finished, removed and released; waiting_too: queued ones too (a token
        in flight when it was preempted ended it)."""
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
        if waiting_too and any(s.finished for s in self.waiting):
            done += [s for s in self.waiting if s.finished]
            self.waiting = deque(s for s in self.waiting if not s.finished)
        for seq in done:
            self._release(seq)
        return done

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.bs) <= self.blocks.capacity

    # ---- the step ------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> tuple[StepPlan, list[Sequence]]:
        """The next step's plan and, in the plan's order, the sequence of each scheduled row."""
        if not self.running:
            self._check_idle()
        self._now = time.monotonic() if now is None else now
        plan, seqs = self._plan()
        # Nothing scheduled: either every running sequence is a prefill short of blocks, and the newest
        # gives its blocks to the older ones; or some wait for a token in flight (max_tokens drawn), which
        # ends them without another step.
        while plan.empty and any(s.prefilling for s in self.running):
            self._preempt(self.running[-1])
            plan, seqs = self._plan()
        # slots freed up to now, preemptions and failed admissions of this step included: the
        # runner drops them before it registers `plan.new`, which may hand one straight back out
        plan.freed, self._freed = self._freed, []
        return plan, seqs

    def _plan(self) -> tuple[StepPlan, list[Sequence]]:
        plan = StepPlan()
        seqs: list[Sequence] = []
        budget = self.cfg.max_num_batched_tokens
        for seq in list(self.running):  # decodes first, oldest first
            if budget <= 0:
                break
            if seq.decoding and seq in self.running and self._grow_or_preempt(seq, plan):
                self._add(plan, seqs, seq, seq.num_computed, seq.num_computed + 1, sample=True)
                budget -= 1
        plan.num_decode = len(seqs)
        # With decode rows, the prompts longer than the cap share the cap's prefill tokens a step, so each
        # of their many chunks stalls the decoding requests for a bounded time; a short prompt is taken whole.
        share = _LongShare(self.cfg.prefill_cap if plan.num_decode else ())
        for seq in self.running:  # prefills in progress (fresh or recompute)
            room, long = share.room(seq, budget)
            if seq.prefilling and room > 0:
                n = self._prefill(plan, seqs, seq, room)
                budget -= n
                share.took(seq, n, long)
        if plan.num_decode and self._delay_prefill(budget):
            return plan, seqs
        for seq in list(itertools.islice(self.waiting, self.cfg.max_num_seqs)):  # a bounded look past long ones
            if seq.pending or len(self.running) >= self.cfg.max_num_seqs or budget <= 0:
                break  # pending: preempted with a token in flight, recomputed once it is known
            room, long = share.room(seq, budget)
            if room <= 0:
                continue  # the long prompts' share is spent: shorter ones behind it still go
            n = self._admit(plan, seqs, seq, room)
            if not n:
                break
            budget -= n
            share.took(seq, n, long)
        return plan, seqs

    def _delay_prefill(self, budget: int) -> bool:
        """prefill_delay_s: hold the waiting prompts back while the oldest has waited less and they do
        not fill the step's remaining budget (then waiting longer gains nothing)."""
        delay = self.cfg.prefill_delay_s
        if not delay or not self.waiting or self._now - self.waiting[0].queued_at >= delay:
            return False
        for seq in self.waiting:
            budget -= seq.num_prompt_tokens
            if budget <= 0:
                return False
        return True

    def update(self, plan: StepPlan, seqs: list[Sequence]) -> None:
        """After the step ran: count computed tokens, publish computed prompt blocks and snapshots."""
        for sch, seq in zip(plan.seqs, seqs):
            seq.num_computed = sch.start + len(sch.token_ids)
            if self.cfg.prefix_caching:
                done = min(seq.num_computed, seq.num_prompt_tokens) // self.bs
                for i in range(seq.num_registered, min(done, len(seq.keys))):
                    self.blocks.register(seq.blocks[i], seq.keys[i])
                seq.num_registered = max(seq.num_registered, min(done, len(seq.keys)))
        for key, slot in self._snapshots:
            self.slots.add_snapshot(key, slot)
        self._snapshots = []

    # ---- helpers -------------------------------------------------------------------------------

    def _add(self, plan: StepPlan, seqs: list[Sequence], seq: Sequence, start: int, end: int, sample: bool,
             snapshots: tuple[tuple[int, int], ...] = ()) -> None:
        first = bisect.bisect_left(seq.pads, start)
        last = bisect.bisect_left(seq.pads, min(end, seq.num_prompt_tokens))
        plan.seqs.append(ScheduledSeq(seq.slot, seq.tokens(start, end), start, start > 0, tuple(seq.blocks), sample,
                                      mm_first_row=first, mm_offsets=tuple(p - start for p in seq.pads[first:last]),
                                      snapshots=snapshots))
        seqs.append(seq)

    def _prefill(self, plan: StepPlan, seqs: list[Sequence], seq: Sequence, budget: int) -> int:
        """Schedule the next chunk of `seq`; returns its token count (0 when blocks ran out)."""
        start = seq.num_computed
        end = self._chunk_end(seq, start, self._budget_end(seq, start, min(seq.target, start + budget)))
        if not self._grow(seq, end):
            return 0
        inside = self._take_snapshots(plan, seq, start, end)
        # the prompt's last token samples the first output; a recompute's chunk samples nothing
        self._add(plan, seqs, seq, start, end, sample=end == seq.target and not seq.output_ids, snapshots=inside)
        return end - start

    def _admit(self, plan: StepPlan, seqs: list[Sequence], seq: Sequence, budget: int) -> int:
        """Start `seq` in a free slot, from its longest cached prefix; 0 when no slot or blocks are free."""
        slot = self.slots.allocate()
        if slot is None:
            return 0
        seq.slot = slot
        hit, snapshot = self._prefix_hit(seq)
        seq.num_computed = hit
        n = self._prefill(plan, seqs, seq, budget)
        if not n:  # no blocks for its first chunk: it waits
            self._release(seq)
            seq.num_computed = 0
            return 0
        if hit:
            plan.copies.append((snapshot, slot))  # before the forward: the slot starts from the snapshot
        if not seq.counted:
            seq.counted, seq.num_cached_tokens = True, hit
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += hit
        self.waiting.remove(seq)
        self.running.append(seq)
        r = seq.request
        plan.new.append(SlotRequest(slot, r.params, seq.seed, seq.mask_eos, r.bad_word_seqs,
                                    tuple(r.prompt_ids) if r.params.reads_prompt else (), tuple(seq.output_ids),
                                    r.image_embeds))
        return n

    def _prefix_hit(self, seq: Sequence) -> tuple[int, int]:
        """(cached prompt tokens, snapshot slot) of the longest reusable prefix, its blocks taken;
        (0, 0) for none."""
        if not self.cfg.prefix_caching:
            return 0, 0
        if not seq.keys:
            usable = (seq.num_prompt_tokens - 1) // self.bs  # the last prompt token is always computed
            seq.keys = chain_keys(seq.request.prompt_ids, self.bs, usable, _image_keys(seq))
        cached = self.blocks.cached(seq.keys)
        for j in range(len(cached), 0, -1):
            snapshot = self.slots.snapshot(seq.keys[j - 1])
            if snapshot is not None:
                self.blocks.take(cached[:j])
                seq.blocks, seq.num_registered = cached[:j], j
                return j * self.bs, snapshot
        return 0, 0

    def _snapshot_points(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The snapshot points of `seq` in (start, end]: multiples of snapshot_interval up to the last
        block boundary before the prompt's last token, and that boundary (prefix caching only)."""
        if not self.cfg.prefix_caching or not seq.keys:
            return []
        interval, last = self.cfg.snapshot_interval, len(seq.keys) * self.bs
        points = list(range((start // interval + 1) * interval, min(end, last) + 1, interval))
        return points + [last] if start < last <= end and last not in points else points

    def _budget_end(self, seq: Sequence, start: int, end: int) -> int:
        """A chunk that the step budget cuts before a snapshot point ends on the KDA chunk grid where
        it can: then the next chunk starts on it and takes its snapshots inside the walk."""
        if end == seq.target or not self._snapshot_points(seq, end, seq.target):
            return end
        aligned = end - end % KDA_CHUNK
        return aligned if aligned > start else end

    def _chunk_end(self, seq: Sequence, start: int, end: int) -> int:
        """Cut the chunk [start, end) at the first snapshot point inside it that the chunked walk
        cannot take (not a whole number of KDA chunks after start)."""
        return next((p for p in self._snapshot_points(seq, start, end - 1) if (p - start) % KDA_CHUNK), end)

    def _take_snapshots(self, plan: StepPlan, seq: Sequence, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """Reserve a snapshot slot for each new snapshot point of the chunk [start, end): the one at its
        end is copied after the step (plan.snapshots); those inside it, returned as (offset, slot), are
        taken by the layers' walk."""
        inside = []
        for p in self._snapshot_points(seq, start, end):
            key = seq.keys[p // self.bs - 1]
            if self.slots.snapshot(key) is not None or any(k == key for k, _ in self._snapshots):
                continue
            dst = self.slots.reserve_snapshot()
            if dst is None:
                break
            if p == end:
                plan.snapshots.append((seq.slot, dst))
            else:
                inside.append((p - start, dst))
            self._snapshots.append((key, dst))
        return tuple(inside)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` stream tokens; False (nothing taken) if not enough are free."""
        need = blocks_for(num_tokens, self.bs) - len(seq.blocks)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        seq.blocks.extend(new)
        return True

    def _grow_or_preempt(self, seq: Sequence, plan: StepPlan) -> bool:
        """A block for the decode token of `seq`, preempting the newest running sequences for it."""
        while not self._grow(seq, seq.num_computed + 1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Give up blocks and slot; recompute prompt + output later ([STR-7]: output unchanged)."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _check_idle(self) -> None:
        """Nothing runs, so nothing may hold a block or a slot: a leak would starve every later
        request (a hang); this fails the step instead, naming the blocks."""
        if self.blocks.num_free != self.blocks.capacity:
            self.blocks.check((), "no sequence is running but ")  # O(num_blocks): only to name them
        assert self.slots.usage == 0, f"no sequence is running but {self.slots.usage:.0%} of the KDA slots are held"

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []
        seq.num_registered = 0
        if seq.slot is not None:
            self.slots.release(seq.slot)
            self._freed.append(seq.slot)
            seq.slot = None


@dataclass
class _LongShare:
    """The cap's tokens that the long prompts of a step share, budgeted as if every chunk started where
    the latest one does: a chunk's cost grows with its start, and the cap only falls with it."""

    cap: tuple[tuple[int, int], ...]
    latest: int = 0  # the latest start of the step's long chunks so far
    used: int = 0

    def room(self, seq: Sequence, budget: int) -> tuple[int, bool]:
        """Prefill tokens `seq` may take, and whether it is a long prompt (one that shares the cap)."""
        if not self.cap or seq.target <= self.cap[0][1]:
            return budget, False
        return min(budget, cap_at(self.cap, max(self.latest, seq.num_computed)) - self.used), True

    def took(self, seq: Sequence, n: int, long: bool) -> None:
        """`seq` was given a chunk of n tokens from seq.num_computed (its prefix hit counted)."""
        if long and n:
            self.latest, self.used = max(self.latest, seq.num_computed), self.used + n


def cap_at(cap: tuple[tuple[int, int], ...], start: int) -> int:
    """The cap's tokens for a chunk from `start`: those of the first entry at or after it (the last
    entry's past them all)."""
    return next((n for s, n in cap if s >= start), cap[-1][1])


def _image_keys(seq: Sequence) -> dict[int, bytes] | None:
    """Prompt position -> identity of the image row there ([IMG-4]): the image's hash and the row
    within it. Without hashes (an in-process caller) each request's images count as unique."""
    if not seq.pads:
        return None
    r = seq.request
    if len(r.image_hashes) != len(r.image_token_counts) or sum(r.image_token_counts) != len(seq.pads):
        return {pos: b"rid" + seq.rid.to_bytes(8, "little", signed=True) + pos.to_bytes(8, "little") for pos in seq.pads}
    keys = [bytes.fromhex(h) + i.to_bytes(4, "little") for h, n in zip(r.image_hashes, r.image_token_counts)
            for i in range(n)]
    return dict(zip(seq.pads, keys))
