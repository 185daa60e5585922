"""The step's prefill layout (kernels/varlen.py) is built once per step and shared by every layer's
varlen ops, and changes no output (ENGINE.md §3, issue 16 item 2).

The tables against a host-side walk of the same batch run here; the model-level checks run under
TRITON_INTERPRET=1 in one child (tests/interpret.py) with the varlen fast ops (short_conv,
kda_prefill and, at fp32, mla_prefill: the Triton MLA takes no fp64) and the references for
everything else. Mixed steps (several prefill chunks, one longer than a KDA chunk, chunks that
continue a cached prefix, decode rows) give every sequence the logits of its fresh forward alone,
the layout is built once per step (two searchsorted calls a step instead of two per KDA layer and
one per MLA layer), and each planted mutation of the shared layout changes the logits, which shows
the layers read the one layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from interpret import Checks
from k3backend.engine.batch import SeqChunk, build_forward_batch
from k3backend.kernels.varlen import KDA_CHUNK

# (lens of sequences 0..3, order, num_decode): two fresh chunks, one over a KDA chunk; then a decode
# row, a chunk continuing its cached prefix, a fresh one and a fresh one-token chunk (the prefill
# graphs' dummy places); then three decode rows and a chunk continuing the one-token prefix
STEPS = [([66, 9, 0, 0], [0, 1], 0), ([6, 1, 10, 1], [1, 0, 2, 3], 1), ([1, 1, 1, 5], [0, 1, 2, 3], 3)]
VARLEN_OPS = ("short_conv", "kda_prefill", "mla_prefill")
MUTATIONS = {  # name: layout -> mutated layout, each in bounds; KDA's tables at fp64, MLA's at fp32
    "seq_ids": lambda lay: dataclasses.replace(lay, seq_ids=lay.seq_ids.flip(0)),
    "first_chunk": lambda lay: dataclasses.replace(lay, first_chunk=lay.first_chunk.roll(1)),
    "prefix": lambda lay: dataclasses.replace(lay, prefix=lay.prefix.roll(1)),
    "latent_rows": lambda lay: dataclasses.replace(lay, latent_rows=lay.latent_rows.roll(1)),
}
MUTATED = {"fp64": ("seq_ids", "first_chunk"), "fp32": ("prefix", "latent_rows")}


def test_layout_tables_equal_a_host_walk_of_the_batch():
    """Random varlen steps (decode rows first, chunks with and without cached prefix): each table
    equals what the batch's host ints say."""
    gen = torch.Generator().manual_seed(3)
    bs = 4
    for _ in range(20):
        nd = int(torch.randint(0, 3, (), generator=gen))
        n = int(torch.randint(1, 5, (), generator=gen))
        chunks = []
        for i in range(nd + n):
            start = int(torch.randint(0, 9, (), generator=gen))
            length = 1 if i < nd else int(torch.randint(1, 2 * KDA_CHUNK + 3, (), generator=gen))
            table = [100 * (i + 1) + j for j in range(-(-(start + length) // bs))]
            chunks.append(SeqChunk([0] * length, start, i + 1, start > 0, table))
        lay = build_forward_batch(chunks, nd, bs, torch.device("cpu")).prefill_layout
        prefill = chunks[nd:]
        seq = [b for b, c in enumerate(prefill) for _ in c.token_ids]
        pos = [p for c in prefill for p in range(c.start, c.start + len(c.token_ids))]
        assert lay.seq_ids.tolist() == seq
        assert lay.positions.tolist() == pos
        assert lay.prefix.tolist() == [c.start for c in prefill]
        assert lay.latent_rows.tolist() == [prefill[b].block_table[p // bs] * bs + p % bs for b, p in zip(seq, pos)]
        starts = [(b, sum(len(c.token_ids) for c in prefill[:b]) + o)
                  for b, c in enumerate(prefill) for o in range(0, len(c.token_ids), KDA_CHUNK)]
        real = [(s, t) for s, t in zip(lay.chunk_seq.tolist(), lay.chunk_start.tolist()) if s >= 0]
        assert real == starts and lay.num_chunks >= len(starts)
        assert lay.first_chunk.tolist() == [next(i for i, (s, _) in enumerate(starts) if s == b)
                                            for b in range(len(prefill))]
        assert lay.tile_offsets(4, 32).tolist() == [0] + list(torch.tensor(
            [-(-4 * len(c.token_ids) // 32) for c in prefill]).cumsum(0).tolist())
        draw = lambda hi: int(torch.randint(0, hi, (), generator=gen))  # noqa: E731
        capacity, min_len = draw(12), len(prefill[draw(n)].token_ids) + draw(2)  # a chunk's length, or one more
        cu, mha = lay.expanded_prefix(capacity, min_len)
        width, used = [], 0  # the host walk: long enough chunks, in order, while their prefixes fit
        for c in prefill:
            want = c.start if len(c.token_ids) >= min_len else 0
            used += want
            width.append(want if used <= capacity else 0)
        assert cu.tolist() == [0] + list(torch.tensor(width).cumsum(0).tolist()), (capacity, min_len)
        assert mha.tolist() == [width[b] == prefill[b].start for b in seq]


def test_a_decode_only_step_has_no_layout():
    chunks = [SeqChunk([1], 3, 1, True, [1]), SeqChunk([2], 0, 2, False, [2])]
    assert build_forward_batch(chunks, 2, 4, torch.device("cpu")).prefill_layout is None


# ---------------------------------------------------------------- model-level checks (in the child)

def _run_steps(dtype: str, mutations=(), counts: dict | None = None) -> tuple[dict[str, list[torch.Tensor]],
                                                                             list[torch.Tensor]]:
    """({"": logits of every position of each sequence over STEPS, and the same with each of
    `mutations` applied to every step's layout}, each sequence's fresh forward alone on the references),
    the steps with the varlen ops on their fast path (each call accepted), the rest on the references."""
    import importlib

    from k3backend import kernels
    from k3backend.engine import batch as batch_mod
    from poolutil import full_logits, lm_streams

    dt = {"fp64": torch.float64, "fp32": torch.float32}[dtype]
    fast = VARLEN_OPS if dt == torch.float32 else VARLEN_OPS[:2]
    saved = {name: getattr(kernels, name) for name in kernels.FAST_OPS}

    def accepted(name: str):
        mod = importlib.import_module(kernels.FAST_OPS[name])

        def op(*args, **kwargs):
            ok, reason = getattr(mod, f"{name}_supports")(*args, **kwargs)
            assert ok, f"{name} declines the model's call: {reason}"
            return getattr(mod, name)(*args, **kwargs)
        return op

    build, searchsorted = batch_mod.varlen_layout, torch.searchsorted

    mutate = None

    def counted_build(*args, **kwargs):
        counts["layouts"] += 1
        lay = build(*args, **kwargs)
        return MUTATIONS[mutate](lay) if mutate else lay

    def counted_search(*args, **kwargs):
        counts["searchsorted"] += 1
        return searchsorted(*args, **kwargs)

    counts = counts if counts is not None else {}
    counts.update(layouts=0, searchsorted=0)
    model = _small_lm(dt)
    gen = torch.Generator().manual_seed(12)
    total = [sum(lens[i] for lens, _, _ in STEPS) for i in range(4)]
    ids = [torch.randint(0, 400, (n,), generator=gen) for n in total]
    for name in kernels.FAST_OPS:
        setattr(kernels, name, accepted(name) if name in fast else saved[name].__wrapped__)
    batch_mod.varlen_layout, torch.searchsorted = counted_build, counted_search
    out = {}
    try:
        for mutate in ("", *mutations):
            s = lm_streams(model, 4, max(total))
            rows: list[list[torch.Tensor]] = [[] for _ in range(4)]
            with torch.no_grad():
                for lens, order, nd in STEPS:
                    step_ids = [ids[i][s.pos[i]:s.pos[i] + lens[i]].tolist() for i in range(4)]
                    logits = model(s.batch(lens, step_ids, num_decode=nd, order=order, all_logits=True), s.pools)
                    for i, part in zip(order, logits.split([lens[i] for i in order])):
                        rows[i].append(part)
            out[mutate] = [torch.cat(r) for r in rows]
            if not mutate:
                counted = dict(counts)
        batch_mod.varlen_layout, torch.searchsorted = build, searchsorted
        for name, op in saved.items():
            setattr(kernels, name, op.__wrapped__)
        with torch.no_grad():
            alone = [full_logits(model, x) for x in ids]
        counts.update(counted)
    finally:
        batch_mod.varlen_layout, torch.searchsorted = build, searchsorted
        for name, op in saved.items():
            setattr(kernels, name, op)
    return out, alone


def _small_lm(dt: torch.dtype):
    """tiny with three layers (KDA, KDA, MLA) of two heads: the interpreter's time grows with each."""
    from k3backend.presets import preset_config
    from test_decode import tiny_lm

    lac = {**preset_config("tiny")["text_config"]["linear_attn_config"], "kda_layers": [1, 2], "full_attn_layers": [3],
           "num_heads": 2}
    return tiny_lm(dt, seed=11, num_hidden_layers=3, linear_attn_config=lac, num_attention_heads=2,
                   num_key_value_heads=2)


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _check_steps(dtype: str, atol: float) -> dict[str, int]:
    """Every sequence's logits over the mixed steps equal its fresh forward alone; each of the dtype's
    planted layout mutations breaks that. Returns the unmutated run's counts."""
    counts: dict[str, int] = {}
    got, alone = _run_steps(dtype, mutations=MUTATED[dtype], counts=counts)
    d = _max_diff(got[""], alone)
    assert d <= atol, f"max |logit difference| {d:.3g} > {atol}"
    for name in MUTATED[dtype]:
        d = _max_diff(got[name], alone)
        assert not d <= 1e-2, f"the layout with {name} mutated changes the logits by {d:.3g} only: unread?"
    return counts


def check_mixed_steps_equal_each_alone_and_layout_mutations_break_them_fp64() -> None:
    """short_conv and kda_prefill on their fast path (the Triton MLA takes no fp64)."""
    from tolerances import PATH_FP64_ATOL

    counts = _check_steps("fp64", PATH_FP64_ATOL)
    # one layout per step (each has prefill rows), two searchsorted each; built per layer it was 2 per
    # KDA layer and 1 per MLA layer: 5 a step here, 17 in tiny, 42 in small
    assert counts == {"layouts": len(STEPS), "searchsorted": 2 * len(STEPS)}, counts


def check_mixed_steps_equal_each_alone_and_layout_mutations_break_them_fp32() -> None:
    """mla_prefill on its fast path too."""
    from tolerances import PATH_FP32_ATOL

    _check_steps("fp32", PATH_FP32_ATOL)


def check_mixed_steps_with_expanded_prefixes_fp32() -> None:
    """mla_prefill with chunks of 2+ tokens attending to their cached prefix in the expanded form, in
    a workspace of 12 rows (some prefixes past it stay absorbed); the prefix mutation still breaks it."""
    from tolerances import PATH_FP32_ATOL

    from k3backend.kernels import mla

    saved = mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN
    mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = 12, 2
    try:
        _check_steps("fp32", PATH_FP32_ATOL)
    finally:
        mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = saved


CHECKS = Checks(__file__, env={"K3_KERNELS": "triton"})


@pytest.mark.parametrize("name", CHECKS.names)
def test_under_interpreter(name):
    CHECKS.assert_passed(name)
