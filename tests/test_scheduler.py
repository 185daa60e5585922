"""The scheduler, driven step by step without a model, against a record of what the caches hold.

`CacheModel` executes each `StepPlan` the way `ModelRunner` does (freed slots dropped, new slots
registered, snapshot copies in, the forward, snapshot copies out), but instead of tensors it
records the stream prefix every KDA slot and every MLA block position was computed from. Each
row must then find exactly its own prefix in its slot and its blocks, and each sampling row the
runner's sampling state of its own request. A chunk that starts past its cache, a block reused
under another context, or a slot freed while its request still holds it fails at the step where
it happens, naming the request, the position and what the cache held instead.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from k3backend.engine.plan import PENDING, CacheCapacity, StepPlan
from k3backend.engine.request import Request
from k3backend.engine.sampling_params import SamplingParams
from k3backend.engine.scheduler import Scheduler, SchedulerConfig, Sequence, cap_at
from k3backend.kernels.varlen import KDA_CHUNK

PAD = 21  # the media pad id the fake requests use
_RIDS = itertools.count(1)
Item = tuple[int, object]  # one stream position: (token id, image row identity or None)


def make_seq(key: str, prompt: list[int], max_tokens: int = 8, image: str | None = None,
             repetition_penalty: float = 1.0) -> Sequence:
    """A bound sequence; `image`: a 32-hex-digit hash for the prompt's pad positions."""
    pads = prompt.count(PAD)
    return Sequence(next(_RIDS), Request(key, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1,
                                                                           repetition_penalty=repetition_penalty),
                                         image_embeds=torch.zeros(pads, 1) if pads else None,
                                         image_token_counts=(pads,) if pads else (),
                                         image_hashes=(image,) if pads else ()), pad_id=PAD)


def next_token(seq: Sequence) -> int:
    """The fake model's sample: a function of the request and the output position only, so a
    recomputed request continues exactly as it would have."""
    return 30 + (sum(map(ord, seq.request.request_id)) * 7 + seq.num_output * 13) % 60


def stream(seq: Sequence, end: int, pending: int | None = None) -> tuple[Item, ...]:
    """The first `end` positions of the request's stream, image rows told apart by hash and row;
    `pending`: the value of its PENDING token (drawn by the step in flight)."""
    r, pads = seq.request, {p: i for i, p in enumerate(seq.pads)}
    return tuple((pending if t == PENDING else t, (r.image_hashes[0], pads[p]) if p in pads else None)
                 for p, t in enumerate(seq.tokens(0, end)))


class CacheModel:
    """What each slot and block position holds: the stream prefix it was computed from."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[Item, ...]] = {}  # KDA slot -> prefix its state is of
        self.blocks: dict[tuple[int, int], tuple[Item, ...]] = {}  # (block, offset) -> prefix ending there
        self.sampling: dict[int, tuple[str, list[int]]] = {}  # the runner's per-slot (request, output ids)
        self.drawn: dict[int, int] = {}  # slot -> the token the last step drew there (a PENDING input's value)

    def execute(self, plan: StepPlan, seqs: list[Sequence]) -> list[int]:
        """Run one plan; returns the sampled ids of its sampling rows, in order."""
        for slot in plan.freed:
            self.sampling.pop(slot, None)
        for new in plan.new:
            seq = next(s for sch, s in zip(plan.seqs, seqs) if sch.slot == new.slot)
            assert list(new.output_ids) == seq.output_ids, f"{seq.request.request_id}: admitted with output {new.output_ids}"
            assert tuple(new.prompt_ids) == (tuple(seq.request.prompt_ids) if seq.request.params.repetition_penalty
                                             != 1.0 else ()), f"{seq.request.request_id}: the sampler gets prompt {new.prompt_ids}"
            self.sampling[new.slot] = (seq.request.request_id, list(new.output_ids))
        for src, dst in plan.copies:
            self.slots[dst] = self.slots[src]
        used = [sch.slot for sch in plan.seqs]
        assert len(set(used)) == len(used), f"two rows share a slot: {used}"
        writes = {}
        for sch, seq in zip(plan.seqs, seqs):  # every row reads the cache as it was before the step
            end = sch.start + len(sch.token_ids)
            if PENDING in sch.token_ids:
                assert sch.token_ids == (PENDING,) and sch.slot in self.drawn, \
                    f"{seq.request.request_id}: PENDING in {sch} (only a decode row after its slot drew)"
            full = stream(seq, end, self.drawn.get(sch.slot))
            assert tuple(self.drawn.get(sch.slot) if t == PENDING else t for t in sch.token_ids) == \
                tuple(t for t, _ in full[sch.start:]), f"{seq.request.request_id}: wrong tokens at {sch.start}"
            assert sch.has_initial_state == (sch.start > 0)
            if sch.start:
                held = self.slots.get(sch.slot, ())
                whose = "this" if held == full[:len(held)] else "another"
                assert held == full[:sch.start], (f"{seq.request.request_id}: chunk starts at {sch.start} but slot {sch.slot} holds "
                                                  f"the state of {len(held)} tokens of {whose} stream")
            for p in range(sch.start):
                at = (sch.block_table[p // self.block_size], p % self.block_size)
                assert self.blocks.get(at) == full[:p + 1], (f"{seq.request.request_id}: position {p} in block {at[0]} was not "
                                                             f"computed from this prefix")
            for p in range(sch.start, end):
                at = (sch.block_table[p // self.block_size], p % self.block_size)
                assert at[0] != 0, f"{seq.request.request_id}: position {p} written into the null block"
                assert at not in writes, f"block {at[0]} written by two rows in one step"
                writes[at] = full[:p + 1]
            self.slots[sch.slot] = full
            for off, dst in sch.snapshots:  # taken inside the chunk by the layers' walk
                assert off % KDA_CHUNK == 0 and 0 < off < len(sch.token_ids), f"snapshot at offset {off} of {sch}"
                self.slots[dst] = full[:sch.start + off]
            if sch.sample:
                assert end == seq.num_prompt_tokens + seq.num_output, f"{seq.request.request_id}: samples at {end}"
                owner = self.sampling.get(sch.slot)
                assert owner is not None and owner[0] == seq.request.request_id, (
                    f"{seq.request.request_id} samples in slot {sch.slot}, whose sampling state the runner has "
                    f"{'dropped (plan.freed)' if owner is None else 'for ' + owner[0]}")
                assert owner[1][:len(seq.output_ids)] == seq.output_ids and len(owner[1]) == seq.num_output, \
                    f"{seq.request.request_id}: the runner's output ids {owner[1]}"
        self.blocks.update(writes)
        for src, dst in plan.snapshots:
            self.slots[dst] = self.slots[src]
        tokens = []
        self.drawn = {}
        for sch, seq in zip(plan.seqs, seqs):
            if sch.sample:
                tokens.append(next_token(seq))
                self.sampling[sch.slot][1].append(tokens[-1])
                self.drawn[sch.slot] = tokens[-1]
        return tokens


def held_refs(sched: Scheduler, outside: list[int] = ()) -> None:
    """Every block's reference count is the number of running sequences holding it."""
    sched.blocks.check([s.blocks for s in sched.running] + [outside])
    for s in sched.waiting:
        assert (s.blocks, s.slot) == ([], None), f"{s.request.request_id} waits holding blocks {s.blocks} / slot {s.slot}"


class Driver:
    """The engine's step loop (`EngineCore.step`) over a scheduler and a `CacheModel`; `overlap`: each
    step is scheduled before the previous one's tokens are known (async scheduling), except when a
    running request reads its token history (a repetition penalty here)."""

    def __init__(self, *, num_blocks: int, num_slots: int, block_size: int = 4, max_num_seqs: int = 4,
                 budget: int = 64, prefix_caching: bool = True, snapshot_interval: int = 8,
                 overlap: bool = False, prefill_cap: tuple[tuple[int, int], ...] = (),
                 prefill_delay: float = 0.0) -> None:
        cfg = SchedulerConfig(max_num_seqs, budget, prefix_caching, snapshot_interval, prefill_cap, prefill_delay)
        self.sched = Scheduler(cfg, CacheCapacity(num_blocks, num_slots, block_size))
        self.cache = CacheModel(block_size)
        self.done: dict[str, list[int]] = {}
        self.steps = 0
        self.outside: list[int] = []  # blocks taken from outside the scheduler (hog)
        self.overlap = overlap
        self.in_flight: list[tuple[Sequence, int]] | None = None  # (sequence, drawn token) of the last step
        self.pending_rows = 0  # decode rows fed a PENDING token
        self.now = 0.0  # the clock: one unit per step

    def hog(self) -> None:
        """Take every free block, so the next block any request needs preempts."""
        self.outside = self.sched.blocks.allocate(self.sched.blocks.num_free)

    def unhog(self) -> None:
        self.sched.blocks.release(self.outside)
        self.outside = []

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.sched.add(s, self.now)

    def step(self) -> tuple[StepPlan, list[Sequence]]:
        s = self.sched
        for seq in s.pop_cancelled():
            self.done[seq.request.request_id] = seq.output_ids
        if self.in_flight is not None and (not self.overlap or any(q.request.params.repetition_penalty != 1.0
                                                                   for q in s.all())):
            self.resolve()
        plan, seqs = s.schedule(self.now)
        self.now += 1.0
        if plan.empty and s.all() and self.in_flight is None:
            raise AssertionError(f"nothing scheduled with {len(s.running)} running, {len(s.waiting)} waiting, "
                                 f"{s.blocks.num_free} free blocks: no step can ever change that")
        self.pending_rows += sum(sch.token_ids == (PENDING,) for sch in plan.seqs)
        tokens = [len(sch.token_ids) for sch in plan.seqs]
        assert sum(tokens) <= s.cfg.max_num_batched_tokens, f"{tokens}: over the step budget"
        cap = s.cfg.prefill_cap if plan.num_decode else ()
        longs = [(sch.start, n) for sch, n, q in zip(plan.seqs[plan.num_decode:], tokens[plan.num_decode:],
                                                     seqs[plan.num_decode:]) if cap and cap[0][1] < q.target]
        assert not longs or sum(n for _, n in longs) <= cap_at(cap, max(a for a, _ in longs)), \
            f"{tokens}: {plan.num_decode} decode rows and long prompts' chunks {longs} beyond the cap {cap}"
        tokens = iter(self.cache.execute(plan, seqs))
        s.update(plan, seqs)
        drawn = []
        for sch, seq in zip(plan.seqs, seqs):
            assert seq.num_computed == sch.start + len(sch.token_ids)
            if sch.sample:
                seq.pending += 1
                drawn.append((seq, next(tokens)))
        if self.in_flight is not None:
            self.resolve()
        self.in_flight = drawn
        if not self.overlap:
            self.resolve()
        held_refs(s, self.outside)
        self.steps += 1
        return plan, seqs

    def resolve(self) -> None:
        """The step in flight's tokens reach the host (EngineCore._resolve)."""
        for seq, token in self.in_flight:
            seq.pending -= 1
            if not seq.finished and not seq.cancelled:
                seq.append_token(token)
        self.in_flight = None
        for seq in self.sched.remove_finished(waiting_too=True):
            self.done[seq.request.request_id] = seq.output_ids

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        while self.sched.all() or self.in_flight:
            assert self.steps < max_steps, f"no end after {max_steps} steps: {self.sched.num_preemptions} preemptions"
            self.step()
        assert self.sched.blocks.num_free == self.sched.blocks.capacity
        assert self.sched.slots.usage == 0
        return self.done


def alone(seq: Sequence) -> list[int]:
    """The request's output with a roomy pool to itself (no preemption, no prefix cache)."""
    d = Driver(num_blocks=2 + -(-(seq.num_prompt_tokens + seq.request.params.max_tokens) // 4), num_slots=4,
               prefix_caching=False)
    d.add(make_seq(seq.request.request_id, seq.request.prompt_ids, seq.request.params.max_tokens,
                   seq.request.image_hashes[0] if seq.pads else None))
    return d.run()[seq.request.request_id]


# ---- computed-token counts across preemption -------------------------------------------------

STAGES = {  # when the pool runs dry, in terms of the victim's progress
    "first-chunk": lambda v: v.num_computed > 0,
    "mid-prefill": lambda v: v.num_computed >= 10 and not v.output_ids,
    "prefill-done": lambda v: len(v.output_ids) == 1,
    "decoding": lambda v: len(v.output_ids) == 3,
}


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_preempted_request_restarts_from_its_cache_at_every_stage(stage, caching):
    """`old` decodes while `victim` (20-token prompt, chunks of at most 6) runs; at `stage` every
    free block is taken, so old's next block preempts the newest request, victim. At that moment
    victim holds nothing and counts nothing computed; it resumes where its cache really ends
    (CacheModel), and both outputs equal their runs alone."""
    d = Driver(num_blocks=12, num_slots=3 + 2 * caching, max_num_seqs=2, budget=7, prefix_caching=caching)
    old, victim = make_seq("old", [5, 6, 7], max_tokens=20), make_seq("victim", list(range(40, 60)), max_tokens=6)
    d.add(old)
    d.step()
    d.add(victim)
    while not STAGES[stage](victim):
        d.step()
    seen = []
    preempt = d.sched._preempt

    def spy(seq: Sequence) -> None:
        preempt(seq)
        seen.append((seq.request.request_id, seq.num_computed, list(seq.blocks), seq.slot, seq.num_registered))

    d.sched._preempt = spy
    d.hog()
    while not seen:
        d.step()
    d.unhog()
    assert seen[0] == ("victim", 0, [], None, 0), f"preempted at {stage}: (request, computed, blocks, slot, registered)"
    out = d.run()
    assert out == {"old": alone(old), "victim": alone(victim)}


def test_prefills_short_of_blocks_with_nothing_decoding_preempt_the_newest():
    """Two prompts prefilled side by side (chunks end at every 4-token snapshot point) fill the pool
    before either is done, and nothing decodes, so no decode preempts. The step that could schedule
    nothing preempts the newer prompt instead, and both finish as alone."""
    d = Driver(num_blocks=10, num_slots=3, max_num_seqs=2, budget=6, snapshot_interval=4)
    first, second = make_seq("first", [40] * 25, max_tokens=1), make_seq("second", [41] * 31, max_tokens=4)
    d.add(first, second)
    seen = []
    preempt = d.sched._preempt
    d.sched._preempt = lambda seq: (seen.append((seq.request.request_id, seq.prefilling, seq.num_computed)), preempt(seq))
    out = d.run()
    assert out == {"first": alone(first), "second": alone(second)}
    assert seen and seen[0][:2] == ("second", True) and seen[0][2] > 0, seen


def test_the_same_ids_with_another_image_share_only_the_blocks_before_it():
    """[IMG-4]: image rows are part of the prefix keys. After a request with image a, the same ids
    with image b reuse the 8 tokens before the pads; the same ids with image a again reuse all
    but the last block, past the image."""
    ids = [50] * 8 + [PAD] * 4 + [51] * 9
    d = Driver(num_blocks=40, num_slots=8, snapshot_interval=4)
    seqs = [make_seq("a", ids, 3, "a" * 32), make_seq("b", ids, 3, "b" * 32), make_seq("a2", ids, 3, "a" * 32)]
    for seq in seqs:
        d.add(seq)
        d.run()
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 20]


# ---- leaks, and many requests against small pools ----------------------------------------------

def test_a_leaked_block_fails_the_next_step_naming_it():
    """A block still referenced when nothing runs would starve later requests (a hang): the next
    schedule() fails instead."""
    d = Driver(num_blocks=6, num_slots=3)
    d.add(make_seq("a", [5, 6, 7, 8, 9], max_tokens=2))
    d.run()
    leaked = d.sched.blocks.allocate(1)[0]  # a reference nobody will release
    d.add(make_seq("b", [5, 6], max_tokens=2))
    with pytest.raises(AssertionError, match=rf"no sequence is running but block {leaked} has 1 references but 0"):
        d.sched.schedule()


def test_snapshot_points_a_whole_number_of_kda_chunks_into_a_chunk_do_not_end_it():
    """Blocks of 16, a snapshot every 64 tokens: a 300-token prompt runs as [0, 288) with the snapshots
    at 64..256 taken inside the walk and the one at 288 (the last block boundary before its last
    token, not 64 tokens after a chunk start) ending the chunk, then [288, 300). A prompt sharing
    its first 200 tokens starts from the snapshot at 192; both equal their runs alone."""
    d = Driver(num_blocks=64, num_slots=12, block_size=16, budget=512, snapshot_interval=64)
    a = make_seq("a", [30 + i % 50 for i in range(300)], max_tokens=3)
    d.add(a)
    plan, _ = d.step()
    (sch,) = plan.seqs
    assert (sch.start, len(sch.token_ids)) == (0, 288)
    assert [off for off, _ in sch.snapshots] == [64, 128, 192, 256] and len(plan.snapshots) == 1
    plan, _ = d.step()
    assert [(s.start, len(s.token_ids), s.snapshots) for s in plan.seqs] == [(288, 12, ())]
    d.run()
    b = make_seq("b", a.request.prompt_ids[:200] + [31] * 40, max_tokens=3)
    d.add(b)
    d.run()
    assert b.num_cached_tokens == 192
    assert d.done["a"] == alone(a) and d.done["b"] == alone(b)


def test_a_chunk_the_budget_cuts_ends_on_the_kda_grid_so_the_next_takes_its_snapshots_inside():
    """64-token blocks, a snapshot every 128 tokens, a step budget of 200: a 400-token prompt runs as
    [0, 192) (128 inside), [192, 392) (256 and 384 inside), [392, 400); cut at 200, the second chunk
    would start off the grid and end again at 256."""
    d = Driver(num_blocks=16, num_slots=8, block_size=64, budget=200, snapshot_interval=128)
    a = make_seq("a", [30 + i % 50 for i in range(400)], max_tokens=2)
    d.add(a)
    chunks = [d.step()[0].seqs[0] for _ in range(3)]
    assert [(c.start, len(c.token_ids), [o for o, _ in c.snapshots]) for c in chunks] == \
        [(0, 192, [128]), (192, 200, [64, 192]), (392, 8, [])]
    d.run()
    assert d.done["a"] == alone(a)


def chunks_beside_decodes(d: Driver, old: Sequence, new: Sequence) -> list[tuple[int, int]]:
    """(start, tokens) of `new`'s prefill chunks, added after `old`'s first step, until its first token;
    every step decodes `old` while it runs."""
    d.add(old)
    d.step()
    d.add(new)
    chunks = []
    while new.prefilling or not new.output_ids:
        plan, _ = d.step()
        assert plan.num_decode == (not old.finished)
        chunks += [(c.start, len(c.token_ids)) for c in plan.seqs[plan.num_decode:]]
    return chunks


def test_a_step_that_decodes_takes_at_most_the_prefill_cap_and_one_that_does_not_the_whole_budget():
    """decode_stall_ms's cap: while `old` decodes, a 40-token prompt advances by at most 6 prefill
    tokens a step (no prefix cache here, so no snapshot point cuts a chunk); once nothing
    decodes, a new prompt takes the whole budget of 64 in one step. Outputs equal their runs alone."""
    d = Driver(num_blocks=64, num_slots=6, budget=64, prefix_caching=False, prefill_cap=((0, 6),))
    old, new = make_seq("old", [5, 6, 7], max_tokens=12), make_seq("new", list(range(30, 70)), max_tokens=3)
    assert [n for _, n in chunks_beside_decodes(d, old, new)] == [6] * 6 + [4]
    d.run()
    alone_ = make_seq("alone", list(range(31, 71)), max_tokens=2)
    d.add(alone_)
    plan, _ = d.step()
    assert [len(c.token_ids) for c in plan.seqs] == [40]
    d.run()
    assert d.done["old"] == alone(old) and d.done["new"] == alone(new)


def test_beside_decodes_a_long_prompts_chunks_shrink_where_the_cap_says_later_starts_cost_more():
    """A cap of 8 tokens for chunks from up to token 16 and 4 from up to token 32 (and past it): while
    `old` decodes, a 40-token prompt advances 8, 8, 8 and then 4 at a time, since a chunk from token
    24 is budgeted at the 32 entry. The output equals its run alone."""
    d = Driver(num_blocks=64, num_slots=6, budget=64, prefix_caching=False, prefill_cap=((0, 8), (16, 8), (32, 4)))
    old, new = make_seq("old", [5, 6, 7], max_tokens=20), make_seq("new", list(range(30, 70)), max_tokens=3)
    assert chunks_beside_decodes(d, old, new) == [(0, 8), (8, 8), (16, 8), (24, 4), (28, 4), (32, 4), (36, 4)]
    d.run()
    assert d.done["old"] == alone(old) and d.done["new"] == alone(new)


def test_long_prompts_in_one_step_share_the_cap_of_the_latest_chunk_start():
    """Two long prompts beside a decoding one, cap 8 up to token 16 and 6 up to 24 (and past it): `a`
    goes first; when its last 2 tokens start at 24, the step's long chunks share the 6 of that start,
    so `b` (from token 0, where 8 would do) takes 4. Outputs equal their runs alone."""
    d = Driver(num_blocks=96, num_slots=8, budget=64, prefix_caching=False, prefill_cap=((0, 8), (16, 8), (24, 6)))
    old = make_seq("old", [5, 6, 7], max_tokens=30)
    a, b = make_seq("a", list(range(30, 56)), max_tokens=2), make_seq("b", list(range(60, 80)), max_tokens=2)
    d.add(old)
    d.step()
    d.add(a, b)
    steps = []
    while b.prefilling or not b.output_ids:
        plan, seqs = d.step()
        assert plan.num_decode
        steps.append([(q.request.request_id, c.start, len(c.token_ids))
                      for c, q in zip(plan.seqs[plan.num_decode:], seqs[plan.num_decode:])])
    assert steps == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 8)], [("a", 24, 2), ("b", 0, 4)],
                     [("b", 4, 8)], [("b", 12, 8)]], steps
    d.run()
    assert all(d.done[q.request.request_id] == alone(q) for q in (old, a, b))


def test_beside_decodes_long_prompts_share_the_cap_and_short_ones_are_taken_whole():
    """Prompts longer than the cap (6) share 6 tokens a step while `old` decodes; three 5-token prompts
    that arrive with them are admitted whole in the same step, 15 prefill tokens beyond the cap, so a
    burst of short prompts is not spread over extra steps. Outputs equal their runs alone."""
    d = Driver(num_blocks=96, num_slots=8, max_num_seqs=6, budget=64, prefix_caching=False, prefill_cap=((0, 6),))
    old = make_seq("old", [5, 6, 7], max_tokens=16)
    d.add(old)
    d.step()
    longs = [make_seq(f"l{i}", list(range(30 + i, 50 + i)), max_tokens=2) for i in range(2)]
    shorts = [make_seq(f"s{i}", list(range(60 + 5 * i, 65 + 5 * i)), max_tokens=2) for i in range(3)]
    d.add(*longs, *shorts)
    plan, _ = d.step()
    assert [len(c.token_ids) for c in plan.seqs[plan.num_decode:]] == [6, 5, 5, 5]
    while any(q.prefilling for q in longs):
        plan, seqs = d.step()
        assert plan.num_decode and sum(len(c.token_ids) for c in plan.seqs[plan.num_decode:]) <= 6
    d.run()
    assert all(d.done[q.request.request_id] == alone(q) for q in [old, *longs, *shorts])


def test_while_requests_decode_new_prompts_wait_up_to_the_prefill_delay_to_share_a_step():
    """max_prefill_delay_ms, one clock unit per step, a delay of 3: while `old` decodes, prompts that
    arrive one step apart are held until the oldest has waited 3 steps, then prefilled in one step;
    prompts that fill the rest of the budget go at once; with nothing decoding nobody waits."""
    d = Driver(num_blocks=64, num_slots=8, max_num_seqs=6, budget=40, prefix_caching=False, prefill_delay=3.0)
    old = make_seq("old", [5, 6, 7], max_tokens=30)
    d.add(old)
    assert len(d.step()[0].seqs) == 1  # nothing decodes: admitted at once
    a, b = make_seq("a", list(range(30, 40)), max_tokens=2), make_seq("b", list(range(40, 50)), max_tokens=2)
    d.add(a)
    d.step()
    d.add(b)
    plans = [d.step()[0] for _ in range(3)]
    admitted = [[len(c.token_ids) for c in p.seqs[p.num_decode:]] for p in plans]
    assert admitted == [[], [], [10, 10]], admitted  # a queued at time 1, admitted at 4 (waited 3), b with it
    big = make_seq("big", list(range(50, 90)), max_tokens=2)  # 40 tokens: more than the budget left
    d.add(big)
    plan, _ = d.step()
    assert [len(c.token_ids) for c in plan.seqs[plan.num_decode:]] == [40 - plan.num_decode]  # at once
    d.run()
    assert all(d.done[s.request.request_id] == alone(s) for s in (old, a, b, big))


def test_overlapped_requests_waiting_for_their_last_token_are_not_preempted():
    """Overlapped steps: requests whose max_tokens-th token is in flight get no row (it ends them),
    and the empty plan that leaves is not taken for prefills stuck without blocks (no preemption)."""
    d = Driver(num_blocks=40, num_slots=6, overlap=True)
    seqs = [make_seq(f"q{i}", [40 + i] * (5 + i), max_tokens=3) for i in range(3)]
    d.add(*seqs)
    out = d.run()
    assert d.sched.num_preemptions == 0
    assert all(out[s.request.request_id] == alone(s) for s in seqs)
    assert d.pending_rows > 0


def random_workload(rng: random.Random, n: int, block: int = 4, few_penalties: bool = False) -> list[tuple[int, Sequence]]:
    """(arrival step, request): prompts built from a few `block`-token blocks, so that requests share
    beginnings, repeat blocks after other beginnings, and carry one of two images; a repetition
    penalty on half of them (few_penalties: a tenth, so that overlapped steps are not all waited for)."""
    blocks = [[rng.randrange(30, 90) for _ in range(block)] for _ in range(4)]
    out = []
    for i in range(n):
        ids = [t for _ in range(rng.randrange(1, 7)) for t in rng.choice(blocks)]
        image = None
        if rng.random() < 0.25:
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = [PAD] * rng.choice([3, 4, 6])
            image = rng.choice("ab") * 32
        ids += [rng.randrange(30, 90) for _ in range(rng.randrange(0, 4))]
        penalty = rng.choice([1.0, 1.3])
        if few_penalties and rng.random() < 0.8:
            penalty = 1.0
        out.append((rng.randrange(0, 3 * n), make_seq(f"r{i}", ids, rng.randrange(1, 12), image, penalty)))
    return sorted(out, key=lambda x: x[0])


def run_random(seed: int, long: bool = False, overlap: bool = False) -> Driver:
    """One random workload (random_workload) with random cancellations on a random small pool; long:
    prompts of 32-token pieces on 16-token blocks with snapshots every 64 or 128 tokens, so that
    snapshot points fall inside chunks a whole number of KDA chunks in (taken there) or not (cut)."""
    rng = random.Random(seed)
    bs = 16 if long else 4
    work = random_workload(rng, 10, 32 if long else 4, few_penalties=overlap)
    requests = {s.request.request_id: s for _, s in work}
    longest = max(s.num_prompt_tokens + s.request.params.max_tokens for s in requests.values())
    d = Driver(num_blocks=1 + -(-longest // bs) + rng.randrange(0, 6), num_slots=rng.randrange(3, 7),
               block_size=bs, max_num_seqs=rng.randrange(1, 5),
               budget=rng.randrange(40, 300) if long else rng.randrange(3, 20), prefix_caching=seed % 3 != 0,
               snapshot_interval=rng.choice([64, 128] if long else [4, 8]), overlap=overlap,
               prefill_cap=random.Random(-seed).choice([(), ((0, 1),), ((0, 5),), ((0, 33), (8, 9), (40, 2)),
                                                        ((0, 64),)]),  # own draws: the workload stays
               prefill_delay=random.Random(seed + 7919).choice([0.0, 0.0, 2.0, 5.0]))
    step, cancelled = 0, set()
    while work or d.sched.all() or d.in_flight:
        while work and work[0][0] <= step:
            d.add(work.pop(0)[1])
        if d.sched.running and rng.random() < 0.03:
            victim = rng.choice(d.sched.running)
            victim.cancelled = True
            cancelled.add(victim.request.request_id)
        if d.sched.all() or d.in_flight:
            d.step()
        step += 1
        assert step < 3000, "no end after 3000 steps"
    assert d.sched.blocks.num_free == d.sched.blocks.capacity and d.sched.slots.usage == 0
    assert d.done.keys() == requests.keys()
    for key, out in d.done.items():
        want = alone(requests[key])
        assert out == want[:len(out)] if key in cancelled else out == want, key
    return d


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@OVERLAP
@pytest.mark.parametrize("seed", range(60))
def test_random_requests_on_small_pools_read_only_their_own_cache(seed, overlap):
    """Random arrivals, cancellations, budgets and pool sizes (tight pools: many preemptions,
    prefix hits on repeated blocks and images): every step reads only its own cache (CacheModel),
    block references always match their holders, no step is empty while requests wait, and every
    request ends with its output alone (a prefix of it when cancelled). `overlap`: each step is
    scheduled before the last one's tokens are known, its decode rows fed PENDING."""
    d = run_random(seed, overlap=overlap)
    assert (d.pending_rows > 0) == overlap


@OVERLAP
@pytest.mark.parametrize("seed", range(20))
def test_random_long_prompts_with_snapshots_inside_chunks_read_only_their_own_cache(seed, overlap):
    """The same with prompts of up to 200 tokens on 16-token blocks, snapshots every 64 or 128."""
    run_random(seed, long=True, overlap=overlap)
