"""The engine core on paged blocks and state slots: batching, preemption, prefix caching (float64).

Every request's tokens must equal the single-request reference loop (`generate`), whatever else
runs, whatever the pool sizes force (preemption by recompute) and whatever the prefix cache
serves. float64 makes the chunking and batching differences (last bits) irrelevant to argmax.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from k3backend.checkpoint import load_model
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore, describe_cap, prefill_cap
from k3backend.engine.request import FinishReason, Request
from k3backend.engine.runner import InProcessExecutor, prefill_graph_sizes
from k3backend.engine.sampling_params import SamplingParams
from test_engine import Completion, assert_idle, ckpt, new_core, one_thread, reference, run, tok  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def model64(ckpt):
    return load_model(ckpt, dtype=torch.float64, progress=False)


PAGED = {"block_size": 4, "snapshot_interval": 8}


def assert_each_alone(model, reqs: list[Request], outs: dict[str, Completion]) -> None:
    """Every request ended without an error (which names an engine failure) and equals its run alone."""
    for r in reqs:
        out = outs[r.request_id]
        assert out.error is None, f"{r.request_id}: {out.error!r}"
        assert out.token_ids == reference(model, r), r.request_id


def image_request(tok, rid: str, model, digest: str, seed: int, text: str = "look at this:") -> Request:
    pad = tok.media_pad_id
    ids = tok.encode(text, allow_special=True) + [pad] * 6 + tok.encode(" and say what you see.", allow_special=True)
    embeds = torch.randn(6, model.cfg.text.hidden_size, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    return Request(rid, ids, SamplingParams(max_tokens=6, temperature=0.0), image_embeds=embeds,
                   image_token_counts=(6,), image_hashes=(digest * 32,))


def test_sixteen_mixed_requests_with_images_equal_each_alone(model64, tok):
    """16 requests of mixed lengths, two with images, at most 5 running, a 24-token step budget:
    admissions, chunked prefills and decodes share steps; every request equals its run alone."""
    reqs = [Request(f"r{i}", tok.encode(f"request {i}: " + "xyz"[i % 3] * (3 + 5 * (i % 5)), allow_special=True),
                    SamplingParams(max_tokens=4 + i % 5, temperature=0.0 if i % 2 else 0.8, seed=1000 + i,
                                   top_k=0 if i % 3 else 20))
            for i in range(14)]
    reqs += [image_request(tok, "img-a", model64, "a", 1), image_request(tok, "img-b", model64, "b", 2)]
    core = new_core(model64, max_num_seqs=5, max_num_batched_tokens=24, **PAGED)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    assert core.stats().steps > 5


def test_padded_decode_steps_of_the_graph_buffers_change_no_output(model64, tok):
    """Decode steps through the static buffers of the CUDA-graph path, run eagerly on the CPU:
    B sequences padded to the next captured size with the null slot and block, and stale table
    columns once the longest prompt (the widest block table) finishes first; every request
    equals its run alone."""
    reqs = [Request(f"g{i}", tok.encode(f"graph {i}: " + "ab" * (1 + 3 * i), allow_special=True),
                    SamplingParams(max_tokens=17 - 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True))
            for i in range(5)]
    core = new_core(model64, max_num_seqs=6, max_num_batched_tokens=32, **PAGED)
    runner = core.executor.runner
    runner.graphs = runner.make_decode_graphs(core.cfg, capture=False)
    assert runner.graphs.sizes == (1, 2, 4, 8)
    calls = []
    run_graph = runner.graphs.run
    runner.graphs.run = lambda chunks, fix_ids=None: calls.append(len(chunks)) or run_graph(chunks, fix_ids)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    assert {3, 1} <= set(calls), calls  # padded (3 -> 4) and exact-size steps both ran


def staggered_requests(tok, name: str, n: int, letters: str, grow: int, tokens: int, more: int) -> list[Request]:
    """n requests, greedy and sampled in turn, whose prompt and output lengths differ with i % 4 and
    i % 3, so that they arrive, prefill and end in different steps; ids name[0] + i."""
    return [Request(f"{name[0]}{i}", tok.encode(f"{name} {i}: " + letters * (1 + grow * (i % 4)), allow_special=True),
                    SamplingParams(max_tokens=tokens + more * (i % 3), temperature=0.0 if i % 2 else 0.8, seed=i,
                                   ignore_eos=True))
            for i in range(n)]


def _record_prefill(runner, calls: list) -> None:
    """Record (chunk lengths, starts, image rows, graph size) of every prefill-graph step."""
    graphs, run_graph = runner.prefill_graphs, runner.prefill_graphs.run

    def run(chunks, mm_positions=(), mm_embeds=None):
        lengths = [len(c.token_ids) for c in chunks]
        calls.append((lengths, [c.start for c in chunks], len(mm_positions), graphs.size_for(lengths)))
        return run_graph(chunks, mm_positions, mm_embeds)
    graphs.run = run


def test_padded_prefill_chunks_of_the_graph_buffers_change_no_output(model64, tok):
    """Single-sequence prefill steps through the static buffers of the prefill-graph path, run
    eagerly on the CPU: each chunk followed by a padding sequence on the null slot and block up to
    the next size; chunks that start a prompt, continue it, or continue a cached prefix (shared
    prompts) take it, longer chunks do not. Every request equals its run alone."""
    shared = "a long shared system prompt, " * 2
    reqs = [Request(f"p{i}", tok.encode(text, allow_special=True),
                    SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.7, seed=i))
            for i, text in enumerate([shared + "first", "short", shared + "second question", "x" * 19,
                                      shared + "third"])]
    reqs.insert(2, image_request(tok, "p-img", model64, "c", 3))
    core = new_core(model64, max_num_seqs=1, max_num_batched_tokens=24, **PAGED)
    runner = core.executor.runner
    runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (2, 4), capture=False)
    calls = []
    _record_prefill(runner, calls)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    lengths = {n for (n,), _, _, _ in calls}
    assert {1, 3, 4} <= lengths and max(lengths) == 4, calls  # padded (1 -> 2, 3 -> 4), exact; 8-token chunks eager
    assert any(start > 0 and start % 8 for _, (start,), _, _ in calls), calls  # a chunk continuing its prompt
    assert core.stats().prefix_cache_hits > 0


def test_several_prefill_chunks_share_one_padded_graph_step_and_change_no_output(model64, tok):
    """Steps of several prefill chunks (new prompts of different lengths, a long prompt's next chunk,
    an image prompt) through the prefill graphs' buffers, eagerly on the CPU: chunk places a step
    leaves unused are one-token dummies, steps move between graph sizes (a larger graph's chunk
    place is a smaller one's padding row). Every request equals its run alone."""
    reqs = staggered_requests(tok, "several", 8, "mn", 3, 3, 3)
    reqs.insert(2, image_request(tok, "s-img", model64, "e", 5))
    reqs.insert(6, image_request(tok, "s-img2", model64, "f", 6, text="and this one:"))
    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=64, **PAGED)
    runner = core.executor.runner
    runner.graphs = runner.make_decode_graphs(core.cfg, capture=False)
    runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (16, 32, 64), capture=False)
    assert [runner.prefill_graphs.seqs(n) for n in (16, 32, 64)] == [1, 2, 4]
    calls, steps = [], []
    _record_prefill(runner, calls)
    graphed = runner._graphed
    runner._graphed = lambda decodes, chunks: steps.append(len(chunks)) or graphed(decodes, chunks)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    assert runner.prefill_graphs.batch(32).prefill_layout.padding_last, "the graph's padding sequence is marked"
    assert any(len(n) >= 3 for n, _, _, _ in calls), calls  # several chunks in one replay
    assert any(len(n) > 1 and rows for n, _, rows, _ in calls), calls  # image rows among other chunks
    assert any(len(n) < runner.prefill_graphs.seqs(size) for n, _, _, size in calls), calls  # dummy places
    sizes = [size for _, _, _, size in calls]
    assert any(a > b for a, b in zip(sizes, sizes[1:])), sizes  # a larger graph, then a smaller one
    assert core.stats().steps == len(steps)  # every step replayed


def test_prefill_graphs_are_timed_on_a_chunk_that_does_the_work(model64):
    """The buffers that capture and `replay_ms` run (`_prepare`) hold a fresh chunk of the graph's size
    on slot 1, not only padding on the null slot, which kda_prefill skips: timed on padding, a graph
    would read too fast and raise the decode_stall_ms cap past what a real prompt's step takes."""
    from k3backend.model.cache import KDACache

    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=64, **PAGED)
    runner = core.executor.runner
    for max_seqs in (64, 1):  # the multi-chunk graphs and the one-chunk ones
        graphs = runner.make_prefill_graphs(core.cfg, (16, 32, 64), capture=False, max_seqs=max_seqs)
        states = [c.state for c in runner.pools.layers if isinstance(c, KDACache)]
        for size in (16, 64):
            for st in states:
                st.zero_()
            graphs._prepare(size)
            assert graphs.batch(size).prefill_layout.lens[0].item() == size
            with torch.inference_mode():
                graphs.run_eagerly(size)
            assert all(st[1].abs().amax() > 0 for st in states), f"size {size}: slot 1 got no KDA state"
            assert all(st[0].abs().amax() == 0 for st in states), f"size {size}: the null slot was written"
        # after a prefix (`time_prefill`'s later starts): the chunk reads slot 1's state and attends
        # to the prefix's latent rows (the null block's), so its logits change
        graphs._prepare(32)
        with torch.inference_mode():
            fresh = graphs.run_eagerly(32)[0].clone()
        graphs._prepare(32, prefix=200)
        lay = graphs.batch(32).prefill_layout
        assert lay.lens[0].item() == 32 and graphs.context_lens[graphs.decode].item() == 232
        assert graphs.has_initial_state[graphs.decode].item() and graphs.state_indices[graphs.decode].item() == 1
        with torch.inference_mode():
            after = graphs.run_eagerly(32)[0]
        assert not torch.equal(fresh, after)
    assert_idle(core)


def test_prefill_steps_are_timed_at_later_chunk_starts_up_to_the_first_size_past_the_stall(model64):
    """`time_prefill` times every size from token 0, and at each later start of `timed_starts` the sizes
    up to the first whose step with the decode rows exceeds decode_stall_ms, each at that start or the
    latest its size allows (max_model_len - size). Here a made-up cost of 1 ms + 0.01 ms per token +
    4e-6 ms per token and prefix token stands in for the graphs' replays."""
    from k3backend.engine.runner import timed_starts

    assert timed_starts(131072, 32) == [2048, 4096, 8192, 16384, 32768, 65536, 131040]
    assert timed_starts(5000, 32) == [2048, 4096, 4968] and timed_starts(1024, 32) == [992]
    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=64, **PAGED)
    runner, calls = core.executor.runner, []

    class Graphs:
        sizes = (32, 64, 128, 256, 512)

        def replay_ms(self, device, reps=3, sizes=None, prefix=0):
            calls.append((prefix, tuple(sizes or self.sizes)))
            return {n: 1 + 0.01 * n + 4e-6 * n * prefix for n in (sizes or self.sizes)}

    runner.prefill_graphs, runner.decode_ms = Graphs(), 1.0
    cfg = replace(core.cfg, max_model_len=5000, decode_stall_ms=5.0)
    times = runner.time_prefill(cfg)
    assert list(times) == [0, 2048, 4096, 4968] and len(times[0]) == 5
    assert calls[1:] == [(2048, (32,)), (2048, (64,)), (2048, (128,)), (2048, (256,)),  # 256: 5.66 ms + 1 > 5
                         (4096, (32,)), (4096, (64,)), (4096, (128,)),  # 128: 4.38 ms
                         (4968, (32,)), (4936, (64,)), (4872, (128,))]  # a chunk of n starts by 5000 - n
    assert prefill_cap(times, cfg.decode_stall_ms, runner.decode_ms) == ((0, 256), (2048, 128), (4096, 64),
                                                                          (4968, 64))
    calls.clear()
    assert list(runner.time_prefill(replace(cfg, decode_stall_ms=0.0))) == [0]  # no cap: start 0 only
    assert calls == [(0, Graphs.sizes)]
    assert_idle(core)


def test_steps_of_one_chunk_take_the_one_chunk_prefill_graphs(model64, tok):
    """With the one-chunk graphs beside the multi-chunk ones (as `capture_graphs` makes them; here
    their buffers run eagerly on the CPU), a step of one prefill chunk replays a one-chunk graph (no
    dummy places) and a step of several the multi-chunk one, mixed steps included. Every request
    equals its run alone."""
    reqs = staggered_requests(tok, "one chunk", 7, "rs", 3, 2, 3)
    reqs.insert(4, image_request(tok, "o-img", model64, "b", 3))
    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=64, **PAGED)
    runner = core.executor.runner
    runner.graphs = runner.make_decode_graphs(core.cfg, capture=False)
    runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (16, 32, 64), capture=False)
    runner.prefill_single = runner.make_prefill_graphs(core.cfg, (16, 32, 64), capture=False, max_seqs=1)
    used = []
    for name in ("prefill_graphs", "prefill_single"):
        graphs = getattr(runner, name)
        graphs.run = lambda chunks, *rest, g=graphs, n=name, run_graph=graphs.run: \
            used.append((n, len(chunks))) or run_graph(chunks, *rest)
    outs = run(core, reqs[:1]) | run(core, reqs[1:])  # one prompt alone, then a wave that arrives together
    assert_each_alone(model64, reqs, outs)
    assert ("prefill_single", 1) in used and any(n == "prefill_graphs" and k > 1 for n, k in used), used
    assert all((n == "prefill_single") == (k == 1) for n, k in used), used


def test_mixed_steps_as_a_decode_and_a_prefill_replay_change_no_output(model64, tok):
    """Steps with decode rows and prefill chunks (requests admitted while others decode, with
    staggered lengths, an image prompt among them) run as the decode graphs' padded batch and then
    the prefill graphs' padded chunks, eagerly on the CPU. Every request equals its run alone."""
    reqs = staggered_requests(tok, "mixed", 7, "pq", 2, 3, 4)
    reqs.insert(3, image_request(tok, "m-img", model64, "d", 4))
    core = new_core(model64, max_num_seqs=3, max_num_batched_tokens=16, **PAGED)
    runner = core.executor.runner
    runner.graphs = runner.make_decode_graphs(core.cfg, capture=False)
    runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (4, 8, 16, 48), capture=False)  # 48: 3 places
    steps = []
    graphed = runner._graphed
    runner._graphed = lambda decodes, chunks: steps.append((len(decodes), len(chunks), any(s.mm_offsets for s in chunks))) \
        or graphed(decodes, chunks)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    assert any(d > 0 and c >= 1 for d, c, _ in steps), steps  # mixed steps split into two replays
    assert any(c == 0 for _, c, _ in steps), steps  # decode-only steps too
    assert any(img for _, _, img in steps), steps  # image rows in a replay
    assert core.stats().steps == len(steps)  # every step replayed (none needed a forward of its own)


def test_mixed_steps_replay_one_mixed_graph_and_change_no_output(model64, tok):
    """Steps with decode rows and prefill chunks through the mixed graphs' buffers (decode rows padded
    to the next captured batch size in front of the chunks, as one forward), eagerly on the CPU: fewer
    decode rows than the graph's, several chunks beside dummy places, a long prompt's chunk that
    samples nothing, image rows; steps that no mixed graph holds take the two replays. Every request
    equals its run alone."""
    reqs = staggered_requests(tok, "joint", 8, "uvw", 4, 3, 4)
    reqs.insert(6, image_request(tok, "j-img", model64, "7", 7))  # admitted while others decode
    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=40, **PAGED)
    runner = core.executor.runner
    runner.graphs = runner.make_decode_graphs(core.cfg, capture=False)
    runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (4, 8, 16, 32, 64), capture=False)
    runner.mixed = runner.make_mixed_graphs(core.cfg, (8, 16, 32), capture=False)
    assert list(runner.mixed) == [1, 2, 4] and [g.seqs(32) for g in runner.mixed.values()] == [2, 2, 2]
    calls, steps = [], []
    for d, graphs in runner.mixed.items():
        graphs.run = lambda chunks, mm_positions=(), mm_embeds=None, decodes=(), fix_ids=None, d=d, run_graph=graphs.run: \
            calls.append((len(decodes), d, [c.sample for c in chunks], len(mm_positions))) or \
            run_graph(chunks, mm_positions, mm_embeds, decodes, fix_ids)
    graphed = runner._graphed
    runner._graphed = lambda decodes, chunks: steps.append((len(decodes), len(chunks))) or graphed(decodes, chunks)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    assert any(b < d for b, d, _, _ in calls), calls  # padding decode rows
    assert any(len(sampled) >= 2 for _, _, sampled, _ in calls), calls  # several chunks in one mixed replay
    assert any(not all(sampled) for _, _, sampled, _ in calls), calls  # a chunk that samples nothing
    assert any(rows for _, _, _, rows in calls), calls  # image rows after the decode rows
    assert sum(1 for d, c in steps if d and c) > len(calls), (steps, calls)  # some mixed steps took two replays
    assert core.stats().steps == len(steps)  # every step replayed (none needed a forward of its own)


def test_prefill_graphs_of_the_runners_sizes_hold_their_padding_when_max_model_len_is_short(model64, tok):
    """The runner's own graph sizes (up to the first size at or above the step budget: several chunks
    fill a step whatever max_model_len is) when max_model_len is below the largest size's padded tokens:
    every size's warm-up step (all places dummies, the rest one padding sequence, as the capture runs
    it) and a prompt of max_model_len - 1 tokens run through the buffers. The padding sequence's block
    table must cover its length (it did not: a device-side assert that broke the GPU at start-up)."""
    core = new_core(model64, max_num_seqs=4, max_num_batched_tokens=96, max_model_len=40, **PAGED)
    runner = core.executor.runner
    runner.prefill_graphs = graphs = runner.make_prefill_graphs(core.cfg, prefill_graph_sizes(core.cfg), capture=False)
    assert graphs.max_tokens == 96 and graphs.padded_tokens(96) > core.cfg.max_model_len
    for size in graphs.sizes:  # what the capture's warm-up runs, largest first
        graphs._prepare(size)
        assert torch.isfinite(graphs.forward(graphs.batch(size))).all(), size
    ids = (tok.encode("fill the whole context window: " + "ab" * 40, allow_special=True) * 2)[:39]
    req = Request("full", ids, SamplingParams(max_tokens=1, temperature=0.0))
    assert_each_alone(model64, [req], run(core, [req]))


@pytest.mark.parametrize("graph_buffers", [False, True], ids=["eager", "prefill-graph-buffers"])
def test_prefix_snapshots_inside_chunks_give_the_same_output(model64, tok, graph_buffers):
    """16-token blocks, a snapshot every 64 tokens: long prompts run as few chunks, their snapshots at
    64, 128, ... taken inside the KDA walk (state and conv history into the snapshot slot) instead of
    ending a chunk; prompts sharing a beginning start from those snapshots. Every request equals its
    run alone, eagerly and through the prefill graphs' padded buffers."""
    shared = tok.encode("A shared beginning of a long prompt, repeated. " * 5, allow_special=True)[:150]
    reqs = [Request(f"w{i}", shared + tok.encode(tail, allow_special=True),
                    SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True))
            for i, tail in enumerate(["first question", " and a second, longer question about it", "third"])]
    core = new_core(model64, max_num_seqs=2, max_num_batched_tokens=512, block_size=16, snapshot_interval=64)
    runner = core.executor.runner
    if graph_buffers:
        runner.prefill_graphs = runner.make_prefill_graphs(core.cfg, (64, 128, 256, 512), capture=False)
    inside = []
    logits = runner.logits
    runner.logits = lambda plan: inside.extend(o for s in plan.seqs for o, _ in s.snapshots) or logits(plan)
    outs = {}
    for r in reqs:  # one after the other: the later ones find the first one's snapshots
        outs |= run(core, [r])
    assert_each_alone(model64, reqs, outs)
    assert inside and all(o % 64 == 0 for o in inside), inside
    assert core.stats().prefix_cache_hits >= 2 * 128, core.stats()


def test_preemption_under_a_tiny_pool_changes_no_output(model64, tok):
    """12 blocks of 4 tokens for 4 requests of 2-block prompts that grow to 8 blocks each: all are
    admitted, their decodes run out of blocks, the newest running request is preempted and
    recomputed, and every output equals its run alone."""
    reqs = [Request(f"p{i}", tok.encode(f"p{i}: go", allow_special=True),
                    SamplingParams(max_tokens=24, temperature=0.7, seed=i, ignore_eos=True)) for i in range(4)]
    core = new_core(model64, block_size=4, snapshot_interval=8, num_blocks=13, num_slots=6,
                        prefix_caching=False)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    stats = core.stats()
    assert stats.num_preemptions > 0
    assert (stats.kv_cache_usage, stats.state_slots_usage) == (0.0, 0.0)  # everything freed


def test_prefix_hit_gives_the_same_output_and_counts_cached_tokens(model64, tok):
    system = tok.encode("You are a helpful assistant. " * 3, allow_special=True)
    first = Request("first", system + tok.encode("Q: one?", allow_special=True),
                    SamplingParams(max_tokens=5, temperature=0.0))
    second = Request("second", system + tok.encode("Q: two, please?", allow_special=True),
                     SamplingParams(max_tokens=5, temperature=0.9, seed=3))
    core = new_core(model64, **PAGED)
    out1 = run(core, [first])["first"]
    out2 = run(core, [second])["second"]
    assert out1.num_cached_tokens == 0
    common = next(i for i, (x, y) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if x != y)
    assert common > len(system)
    assert out2.num_cached_tokens == common // 8 * 8  # the last snapshot point inside the shared prefix
    assert out1.token_ids == reference(model64, first) and out2.token_ids == reference(model64, second)
    again = run(core, [replace(first, request_id="again")])["again"]  # the whole prompt but its last token
    assert again.num_cached_tokens == (len(first.prompt_ids) - 1) // 4 * 4
    assert again.token_ids == out1.token_ids
    s = core.stats()
    assert s.prefix_cache_queries == len(first.prompt_ids) * 2 + len(second.prompt_ids)
    assert s.prefix_cache_hits == out2.num_cached_tokens + again.num_cached_tokens


def test_same_text_with_another_image_reuses_nothing_past_the_image(model64, tok):
    core = new_core(model64, **PAGED)
    a = image_request(tok, "a", model64, "a", 1)
    b = replace(image_request(tok, "b", model64, "b", 2))  # same ids, other image and hash
    first_pad = a.prompt_ids.index(tok.media_pad_id)
    assert run(core, [a])["a"].token_ids == reference(model64, a)
    out_b = run(core, [b])["b"]
    assert out_b.num_cached_tokens <= first_pad and out_b.token_ids == reference(model64, b)
    out_a = run(core, [replace(a, request_id="a2")])["a2"]
    assert out_a.num_cached_tokens > first_pad + 6  # past the image: same hash, same rows
    assert out_a.token_ids == reference(model64, a)


def test_prefix_caching_off_computes_everything(model64, tok):
    prompt = tok.encode("the same prompt twice, long enough for blocks", allow_special=True)
    core = new_core(model64, prefix_caching=False, **PAGED)
    outs = [run(core, [Request(f"x{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0))])[f"x{i}"]
            for i in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0] and outs[0].token_ids == outs[1].token_ids
    assert core.stats().prefix_cache_hits == 0


def test_a_request_that_can_never_fit_fails_fast(model64, tok):
    core = new_core(model64, block_size=4, num_blocks=9, num_slots=4, max_model_len=1024)
    out = run(core, [Request("big", [65] * 20, SamplingParams(max_tokens=20))])["big"]
    assert out.finish is FinishReason.ERROR and out.error[0] == "INVALID_ARG"
    assert "does not fit in the cache (32 tokens)" in out.error[1]
    assert core.stats().steps == 0


# ---- faults the tests above could not see (issue 21) --------------------------------------------

def test_repeated_blocks_after_a_shared_beginning_reuse_only_their_own_prefix(model64, tok):
    """Prefix-cache keys chain: a block of tokens that repeats is cached once per context. After a
    prompt of one block repeated five times, prompts sharing its first two or four blocks reuse the
    last snapshot point inside what they share (8 and 16 tokens), not a later copy of the repeated
    block; one with another first block reuses nothing. Each equals its run alone."""
    head, rep, tail = [70, 71, 72, 73], [80, 81, 82, 83], [90, 91, 92]
    first = Request("first", head + rep * 5 + tail, SamplingParams(max_tokens=6, temperature=0.0))
    shares = {  # request -> (prompt, cached tokens)
        "two-blocks": (head + rep * 2 + [95, 96, 97, 98] + rep, 8),
        "four-blocks": (head + rep * 3 + [95, 96] + rep, 16),
        "other-head": ([75, 76, 77, 78] + rep * 4 + tail, 0),
    }
    core = new_core(model64, **PAGED)
    assert run(core, [first])["first"].token_ids == reference(model64, first)
    for rid, (ids, cached) in shares.items():
        req = Request(rid, ids, SamplingParams(max_tokens=6, temperature=0.0))
        out = run(core, [req])[rid]
        assert out.error is None, f"{rid}: {out.error!r}"
        assert (out.num_cached_tokens, out.token_ids) == (cached, reference(model64, req)), rid


CHUNKED_PREEMPTION = {
    # one 40-token prompt beside a decoding request, no spare KDA slot: preempted mid-prefill, it is
    # re-admitted in the same step into the slot it just gave up
    "one-prefill": ([40], {"num_blocks": 13, "num_slots": 3, "max_num_seqs": 2, "prefix_caching": False}),
    # two prompts prefilled side by side (chunks end at snapshot points): both run out of blocks
    # with nothing decoding, and only preempting the newer lets the older go on
    "two-prefills": ([38, 14], {"num_blocks": 13, "num_slots": 6, "max_num_seqs": 3, "prefix_caching": True}),
}


@pytest.mark.parametrize("case", list(CHUNKED_PREEMPTION))
def test_preemption_during_a_chunked_prefill_changes_no_output(model64, tok, case):
    """Long prompts prefilled at most 7 tokens a step beside a decoding request, in 12 blocks of 4:
    the pool runs dry while a prompt is part done, so it is preempted mid-prefill and recomputed
    later. Every output equals its run alone, and everything is freed at the end."""
    lengths, pools = CHUNKED_PREEMPTION[case]
    reqs = [Request("decoding", tok.encode("go:", allow_special=True),
                    SamplingParams(max_tokens=23, temperature=0.7, seed=5, ignore_eos=True))]
    reqs += [Request(f"long{i}", list(range(100 + 40 * i, 100 + 40 * i + n)),
                     SamplingParams(max_tokens=6 - 5 * i, temperature=0.0, ignore_eos=True))
             for i, n in enumerate(lengths)]
    core = new_core(model64, block_size=4, snapshot_interval=8, max_num_batched_tokens=7, **pools)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    stats = core.stats()
    assert stats.num_preemptions > 0 and (stats.kv_cache_usage, stats.state_slots_usage) == (0.0, 0.0)


def test_strong_repetition_penalty_covers_the_prompt(model64, tok):
    """Greedy with repetition_penalty 3.0 equals the reference sampler's loop. The prompt ends where
    the unpenalized greedy continuation repeats one of its tokens, so the prompt's tokens alone
    change the first token (nothing is generated yet): a sampler not handed the prompt ids differs.
    The first of a few prompts whose continuation repeats that way (on this random model) is used."""
    for text in ("1 2 3 4 5 6", "a b c d e f", "the cat sat on the mat", "xy" * 8, "0 1 0 1 0 1"):
        ids = tok.encode(text, allow_special=True)
        cont = reference(model64, Request("c", ids, SamplingParams(max_tokens=48, temperature=0.0)))
        k = next((i for i, t in enumerate(cont) if t in ids + cont[:i]), None)
        if k is None:
            continue
        plain = Request("plain", ids + cont[:k], SamplingParams(max_tokens=8, temperature=0.0))
        penalized = replace(plain, request_id="penalized", params=replace(plain.params, repetition_penalty=3.0))
        want = reference(model64, penalized)
        if want[0] != reference(model64, plain)[0]:
            break
    else:
        pytest.fail("no prompt whose greedy continuation a repetition penalty on the prompt changes")
    assert reference(model64, plain)[0] in plain.prompt_ids
    core = new_core(model64)
    assert run(core, [penalized])["penalized"].token_ids == want


# ---- overlapped (async) scheduling -------------------------------------------------------------

def _count_pending_rows(core) -> list[int]:
    """Count the decode rows fed a PENDING token (the runner takes it on the device)."""
    runner, fed = core.executor.runner, []
    feed = runner._feed
    runner._feed = lambda ids, decodes: fed.append(sum(s.token_ids[0] < 0 for s in decodes)) or feed(ids, decodes)
    return fed


def _overlap_requests(tok, model) -> list[Request]:
    shared = "a shared beginning for the prefix cache, "
    params = [SamplingParams(max_tokens=9, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7, top_k=30),
              SamplingParams(max_tokens=7, temperature=0.9, seed=8, top_p=0.8, min_tokens=5),
              SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3),  # reads its history: waited for
              SamplingParams(max_tokens=11, temperature=0.7, seed=9, min_p=0.05, logprobs=1),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=1.1, seed=10)]
    reqs = [Request(f"o{i}", tok.encode((shared if i % 3 == 0 else "") + f"overlap {i}: " + "uv" * (1 + i % 4),
                                        allow_special=True), p, eos_ids=(tok.eos_id,))
            for i, p in enumerate(params)]
    return reqs + [image_request(tok, "o-img", model, "9", 9)]


def test_overlapped_steps_give_the_tokens_of_waited_steps(model64, tok):
    """Async scheduling: each step is scheduled and launched before the previous one's tokens reach
    the host (decode rows fed PENDING, taken from the drawn ids on the device), on a pool tight
    enough to preempt, with prefix hits, an image, min_tokens, log-probs, a penalty request (whose
    steps wait) and half the requests ending on a stop id that no length predicts (the overlapped
    run has already scheduled their next row, which is dropped). Tokens, finish reasons and
    log-probs equal the run that waits for every step."""
    reqs = _overlap_requests(tok, model64)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=24, num_blocks=24, num_slots=9, **PAGED)
    first = run(new_core(model64, async_scheduling=False, **cfg), reqs)
    reqs = [replace(r, params=replace(r.params, stop_token_ids=(first[r.request_id].token_ids[3],))) if i % 2 else r
            for i, r in enumerate(reqs)]
    waited = run(new_core(model64, async_scheduling=False, **cfg), reqs)
    core = new_core(model64, **cfg)
    assert not core.overlap  # on a CPU there is nothing to overlap, but the path is the same
    core.overlap = True
    fed = _count_pending_rows(core)
    over = run(core, reqs)
    again = run(core, reqs)  # the same requests once more: prompts from the prefix cache
    assert_idle(core)
    assert sum(fed) > 20, fed
    assert core.stats().num_preemptions > 0 and core.stats().prefix_cache_hits > 0
    for r, out in [(r, out) for out in (over, again) for r in reqs]:
        a, b = waited[r.request_id], out[r.request_id]
        assert (b.token_ids, b.finish, b.error) == (a.token_ids, a.finish, a.error), r.request_id
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert (x.token, x.rank, [t for t, _ in x.top]) == (y.token, y.rank, [t for t, _ in y.top])
            assert abs(x.logprob - y.logprob) < 1e-9
    assert sum(c.finish == FinishReason.STOP for c in waited.values()) >= 3


def test_a_cancel_while_a_step_is_in_flight_ends_the_request_with_a_prefix_of_its_tokens(model64, tok):
    """Cancels at every step of an overlapped run: each request ends once, CANCELLED, with a prefix
    of its uncancelled output (a token drawn after the cancel is dropped), and nothing stays held."""
    reqs = _overlap_requests(tok, model64)[:6]
    cfg = dict(max_num_seqs=3, max_num_batched_tokens=24, **PAGED)
    full = run(new_core(model64, async_scheduling=False, **cfg), reqs)
    for at in range(1, 9):
        core = new_core(model64, **cfg)
        core.overlap = True
        victims = {r.request_id for r in reqs[at % 3::3]}
        out = run(core, reqs, hook=lambda step, core, rids: step == at and [core.abort(rids[v]) for v in victims])
        assert_idle(core)
        for r in reqs:
            got, want = out[r.request_id], full[r.request_id]
            assert got.token_ids == want.token_ids[:len(got.token_ids)], (at, r.request_id)
            if r.request_id not in victims:
                assert got.token_ids == want.token_ids and got.finish == want.finish, (at, r.request_id)
            else:
                assert got.finish in (FinishReason.CANCELLED, want.finish), (at, r.request_id)


def test_min_tokens_counts_a_token_still_in_flight(model64, tok):
    """A stop id is banned below min_tokens; in an overlapped step the token before the one being drawn
    may still be on the device, and it counts. The stop id is the token a greedy request draws at the
    first position it may (min_tokens): it ends the request there, overlapped or not."""
    base = Request("m", tok.encode("count the tokens in flight: " + "ab" * 3, allow_special=True),
                   SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    free = run(new_core(model64, async_scheduling=False, **PAGED), [base])["m"].token_ids
    at = next(i for i in range(3, 16) if free[i] not in free[:i])  # first drawn at `at`: the ban changes nothing before
    req = replace(base, params=replace(base.params, min_tokens=at, stop_token_ids=(free[at],)))
    core = new_core(model64, **PAGED)
    core.overlap = True
    fed = _count_pending_rows(core)
    got = run(core, [req])["m"]
    assert sum(fed) >= at - 1
    assert (got.token_ids, got.finish) == (free[:at + 1], FinishReason.STOP)


def test_prefill_cap_is_the_largest_measured_step_within_the_stall():
    times = {0: {32: 1.5, 256: 6.0, 2048: 29.0, 4096: 55.0}}
    assert prefill_cap(times, 30.0) == ((0, 2048),)
    assert prefill_cap(times, 6.0) == ((0, 256),)
    assert prefill_cap(times, 0.5) == ((0, 32),)  # none fits: the smallest, so prompts still advance
    assert prefill_cap(times, 0.0) == () and prefill_cap({}, 30.0) == ()  # off; unmeasured (CPU)
    assert prefill_cap(times, 30.0, decode_ms=1.5) == ((0, 256),)  # the decode rows' time counts too
    assert prefill_cap(times, 30.0, decode_ms=1.0) == ((0, 2048),)
    # later chunk starts, timed up to the first size past the stall: each start's own largest fit,
    # never more than an earlier start's (a start timed faster than an earlier one is noise)
    times |= {2048: {32: 2.0, 256: 8.0, 2048: 33.0}, 8192: {32: 4.0, 256: 31.0}, 16384: {32: 1.0, 256: 7.0},
              30000: {32: 35.0}}
    assert prefill_cap(times, 30.0) == ((0, 2048), (2048, 256), (8192, 32), (16384, 32), (30000, 32))
    assert describe_cap(prefill_cap(times, 30.0)) == "2048 (256 from token 2048, 32 from token 8192)"


def test_the_stall_cap_from_measured_steps_bounds_prefill_beside_decodes_and_changes_no_output(model64, tok):
    """An executor that measured its prefill steps (here: given times) and decode_stall_ms 5: steps
    that decode carry at most 16 prefill tokens, the 60-token prompts advance in such chunks while
    the short ones decode, and every request equals its run alone."""
    cfg = EngineConfig(max_model_len=1024, cpu_cache_gb=0.25, max_num_seqs=4, max_num_batched_tokens=64,
                       decode_stall_ms=5.0, **PAGED)
    executor = InProcessExecutor(model64, cfg)
    executor.prefill_ms = {0: {8: 1.0, 16: 4.0, 64: 50.0}}
    core = EngineCore(executor, cfg)
    assert core.sched.cfg.prefill_cap == ((0, 16),)
    reqs = [Request(f"s{i}", tok.encode(f"short {i}", allow_special=True), SamplingParams(max_tokens=12, temperature=0.0))
            for i in range(2)]
    reqs += [Request(f"l{i}", tok.encode("a long prompt " * 5 + str(i), allow_special=True),
                     SamplingParams(max_tokens=4, temperature=0.0)) for i in range(2)]
    launched = []
    launch = executor.launch
    executor.launch = lambda plan: launched.append(plan) or launch(plan)
    outs = run(core, reqs)
    assert_each_alone(model64, reqs, outs)
    mixed = [sum(len(s.token_ids) for s in p.seqs[p.num_decode:]) for p in launched if p.num_decode]
    assert mixed and max(mixed) <= 16 and any(n > 16 for p in launched if not p.num_decode
                                                 for n in [sum(len(s.token_ids) for s in p.seqs)])


def test_an_overlapped_engine_waits_for_a_long_step_in_a_call_of_its_own(model64, tok):
    """Async scheduling reports a step's tokens with the next call. A step measured to be long (here:
    more than 8 prefill tokens, given times; 30 ms still fits decode_stall_ms) is waited for by the next call, which schedules nothing:
    a request that arrives while it runs joins the very next step. The step before a long one reports
    in the call that launches the long one, so a decoding request's token does not wait for both.
    Short steps still overlap, and every request equals its run alone."""
    def core_with(times, **paged):
        cfg = EngineConfig(max_model_len=1024, cpu_cache_gb=0.25, **paged)
        executor = InProcessExecutor(model64, cfg)
        executor.prefill_ms = times
        core = EngineCore(executor, cfg)
        core.overlap = True
        launched = []
        launch = executor.launch
        executor.launch = lambda plan: launched.append(plan) or launch(plan)
        return core, launched

    def news(out) -> dict[int, int]:
        return {rid: int(n) for rid, n in zip(*np.unique(out.ids[out.tokens >= 0], return_counts=True))}

    params = SamplingParams(max_tokens=5, temperature=0.0)
    long = Request("long", tok.encode("a prompt of some thirty tokens or so, long enough", allow_special=True), params)
    late = Request("late", tok.encode("one that arrives while the long one runs", allow_special=True), params)
    core, launched = core_with({0: {8: 1.0, 64: 30.0}})  # 64-token blocks: a prompt is one chunk
    core.add(1, long)
    assert news(core.step()) == {} and len(launched) == 1  # launched, not waited for
    core.add(2, late)  # arrives while it runs
    assert news(core.step()) == {1: 1} and len(launched) == 1  # its news alone: nothing scheduled
    core.step()
    assert launched[1].num_decode == 1 and len(launched[1].seqs) == 2  # long's first decode; late joins at once
    core, launched = core_with({})  # unmeasured: every step overlaps, news one call later
    core.add(1, long)
    assert news(core.step()) == {} and news(core.step()) == {1: 1} and len(launched) == 2

    short = Request("short", tok.encode("hi", allow_special=True), SamplingParams(max_tokens=8, temperature=0.0))
    assert len(short.prompt_ids) <= 8
    core, launched = core_with({0: {8: 1.0, 64: 30.0}})
    core.add(1, short)
    assert news(core.step()) == {}  # its prefill, light
    assert news(core.step()) == {1: 1}  # its first decode launched, the prefill's news
    core.add(2, long)
    assert news(core.step()) == {1: 1} and len(launched) == 3  # the long step launched: the decode's news now
    assert news(core.step()) == {1: 1, 2: 1} and len(launched) == 3  # the long step's, alone
    core, _ = core_with({0: {8: 1.0, 64: 30.0}}, **PAGED)  # chunks of 8 (light) and of more (heavy)
    fed = _count_pending_rows(core)
    outs = run(core, _overlap_requests(tok, model64))
    assert_each_alone(model64, _overlap_requests(tok, model64), outs)
    assert max(fed) > 0  # decode steps still overlap


def test_step_trace_accounts_for_every_prompt_token_and_decode_row(model64, tok, tmp_path, monkeypatch):
    """K3_STEP_TRACE: one JSON line per step; over a run the lines add up to the requests added and
    first scheduled, every prompt token not served by the prefix cache prefilled once and every later
    token decoded once."""
    import json

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("K3_STEP_TRACE", str(path))
    core = new_core(model64, max_num_batched_tokens=16, **PAGED)
    reqs = [Request(f"t{i}", tok.encode(f"request number {i} " * (i + 1), allow_special=True),
                    SamplingParams(max_tokens=3 + i, min_tokens=3 + i, temperature=0.0))
            for i in range(4)]
    outs = run(core, reqs)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(steps) == core.steps
    assert sum(s["added"] for s in steps) == sum(s["new"] for s in steps) == len(reqs)
    cached = sum(outs[r.request_id].num_cached_tokens for r in reqs)  # prefix hits are not prefilled
    assert sum(s["prefill"] for s in steps) == sum(len(r.prompt_ids) for r in reqs) - cached
    assert max(s["decode"] + s["prefill"] for s in steps) <= 16  # the step budget
    assert sum(s["decode"] for s in steps) == sum(len(outs[r.request_id].token_ids) - 1 for r in reqs)
    assert all(s["t"] <= n["t"] for s, n in zip(steps, steps[1:])) and steps[0]["waiting"] >= 0
    with_prompt = sum(1 for s in steps if s["prefill"])  # bench/step_trace.py reads the same lines
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "step_trace.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert f"steps with prompt tokens         {with_prompt} (" in out, out


def _agreed_rank(rank: int, path: str, out) -> None:
    import torch.distributed as dist

    from k3backend.engine.runner import agreed

    dist.init_process_group("gloo", store=dist.FileStore(path, 2), world_size=2, rank=rank)
    out.put((rank, agreed({32: 1.0 + rank, 64: 5.0 - rank}, torch.device("cpu"))))
    dist.destroy_process_group()


def test_ranks_time_prefill_steps_with_the_slowest_ranks_times(tmp_path):
    """`time_prefill` stops at the first size past the stall; ranks replay the same graphs, so they
    must stop together: `agreed` gives every rank of a real gloo group the slowest rank's times."""
    import multiprocessing as mp

    from k3backend.engine.runner import agreed

    assert agreed({32: 1.0}, torch.device("cpu")) == {32: 1.0}  # no process group: as measured
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agreed_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: {32: 2.0, 64: 5.0}, 1: {32: 2.0, 64: 5.0}}
