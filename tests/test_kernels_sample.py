"""The Triton draw and top-k/top-p cut (kernels/sample.py) equal their references exactly.

Under TRITON_INTERPRET=1 in a subprocess (tests/interpret.py). The draw (sample_ref.race_draw):
vocabularies of 1, 7, 2049 (one past a block) and 5000 ids; probabilities with zeros (filtered ids),
uniform rows (the winner is the largest uniform, so any bit of the hash that differs shows), seeds at
the int64 extremes and large output positions; the float32 screen within its error bound, and blocks
it cannot order (near ties, subnormal rows, zeros) left to float64. The cut (sample_ref.top_k_top_p, every element
torch.equal): smooth, coarse-grid (many equal probabilities at every cut) and bf16-rounded logits,
zeros, top-k from 1 to past the vocabulary, top-p from a few ids to nearly all and at the exact
integer mass of a prefix, rows with both; with the shipped tiles and with small blocks, so rows span
many blocks, chunks and lists; seeded random rows, tiles and pass widths, subnormal rows among them.
The softmax with temperature (sample_ref.softmax_rows) within a few float32 ulps. Buffers the
kernels allocate start as NaN (`poisoned_empty`).
"""

from __future__ import annotations

import pytest
import torch

from interpret import Checks, poisoned_empty

CHECKS = Checks(__file__, env={"K3_KERNELS": "triton"})


def draw_both(probs: torch.Tensor, seeds: list[int], steps: list[int]) -> None:
    from k3backend.kernels import sample, sample_ref

    s, t = torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64)
    with poisoned_empty():
        got = sample.race_draw(probs, s, t)
    want = sample_ref.race_draw(probs, s, t)
    assert got.dtype == torch.int64 and torch.equal(got, want), (list(probs.shape), got.tolist(), want.tolist())


def check_draw_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    extremes = [0, 1, -1, 2**63 - 1, -2**63, 12345678901234567]
    for V in (1, 7, 2049, 5000):
        S = len(extremes)
        probs = torch.rand(S, V, generator=g)
        probs[torch.rand(S, V, generator=g) < 0.5] = 0.0  # filtered ids
        probs[:, 0] = torch.where(probs[:, 0] > 0, probs[:, 0], 0.25)  # at least one id left
        draw_both(probs, extremes, [0, 1, 2**40, 7, 3, 2**62])
        draw_both(torch.full((S, V), 1.0 / V), extremes, list(range(S)))  # uniform: argmax of u


def check_many_rows_and_ties() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(40, 3000, generator=g).bfloat16().float(), dim=-1)  # bf16 logits: tied probs
    draw_both(probs, [int(x) for x in torch.randint(-2**63, 2**63 - 1, (40,), generator=g)], list(range(0, 400, 10)))
    from k3backend.kernels import sample

    assert sample.race_draw(torch.zeros(0, 9), torch.zeros(0, dtype=torch.int64),
                            torch.zeros(0, dtype=torch.int64)).shape == (0,)


def screen_ratios(p: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw's float32 screen ratio and float64 ratio of probabilities p [N] and uniform bits m [N] (int64)."""
    global sample  # a module global: a jit function reads names from there, not from closures
    import triton
    import triton.language as tl

    from k3backend.kernels import sample

    @triton.jit
    def both(p_ptr, m_ptr, r32_ptr, r64_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        p, m = tl.load(p_ptr + i), tl.load(m_ptr + i).to(tl.uint64, bitcast=True)
        tl.store(r32_ptr + i, sample._ratio32(p, m))
        tl.store(r64_ptr + i, sample._ratio(p, m))

    k, n = len(p), triton.next_power_of_2(len(p))
    r32, r64 = torch.empty(n), torch.empty(n, dtype=torch.float64)
    both[(1,)](torch.nn.functional.pad(p, (0, n - k)), torch.nn.functional.pad(m, (0, n - k)), r32, r64, N=n)
    return r32[:k], r64[:k]


def check_draw_screen_within_its_bound() -> None:
    """The draw's float32 ratio is within 2**-20 of the float64 one wherever that is at least
    SCREEN_FLOOR: uniforms at both ends of (0, 1) (m near 0, near 2**52 where float64 starts rounding
    m + 0.5, near 2**53 where -log u is down to 2**-53) and random ones; probabilities from 1 to subnormal."""
    from k3backend.kernels import sample

    g = torch.Generator().manual_seed(5)
    edges = [0, 1, 2, 3, 2**20, 2**51, 2**52 - 2, 2**52 - 1, 2**52, 2**52 + 1, 2**52 + 2, 2**53 - 5, 2**53 - 4,
             2**53 - 3, 2**53 - 2]
    ms = torch.tensor(edges + torch.randint(0, 2**53, (1024 - len(edges),), generator=g).tolist(), dtype=torch.int64)
    for p in (torch.ones(1024), torch.rand(1024, generator=g), torch.rand(1024, generator=g) * 1e-30,
              torch.full((1024,), 1e-38)):
        r32, r64 = screen_ratios(p, ms)
        trusted = r64 >= sample.SCREEN_FLOOR.value
        err = (r32.double() / r64 - 1).abs()[trusted]
        assert trusted.any() and err.max() <= 2.0 ** -20, (err.max().item(), ms[trusted][err.argmax()].item())


def check_draw_falls_back_where_the_screen_cannot_tell() -> None:
    """Blocks whose two largest ratios float32 orders wrongly (found among probabilities made
    proportional to -log u, so every ratio ties within float32's rounding), rows of such near ties,
    rows of subnormal probabilities, blocks of zeros and a row of zeros: every winner the reference's,
    with small blocks so one row spans many of them."""
    import itertools

    from k3backend.kernels import sample
    from k3backend.kernels.sample_ref import counter_bits, counter_uniform

    g = torch.Generator().manual_seed(9)
    V = 700
    seeds = [int(x) for x in torch.randint(-2**63, 2**63 - 1, (6,), generator=g)]
    steps = list(range(3, 9))
    m = counter_bits(torch.tensor(seeds), torch.tensor(steps), V)
    u = counter_uniform(torch.tensor(seeds), torch.tensor(steps), V)
    tied = (-torch.log(u) * (1 + 1e-9 * torch.randn(6, V, generator=g, dtype=torch.float64)) / 40).float()
    flipped = torch.zeros(6, V)  # per row a pair in one block of 64 that float32 orders the wrong way round
    for row in range(6):
        r32, r64 = screen_ratios(tied[row], m[row])
        order = torch.argsort(r64, descending=True).tolist()
        blocks = [[i for i in order if i // 64 == blk] for blk in range(V // 64 + 1)]
        pairs = [pair for ids in blocks for pair in itertools.pairwise(ids)]
        wrong = [(a, b) for a, b in pairs if r32[a] < r32[b] and r64[a] > r64[b]]
        assert wrong, f"row {row}: no pair that float32 orders wrongly; the test data no longer tests the fallback"
        a, b = wrong[0]
        flipped[row, [a, b]] = tied[row, [a, b]]
    sub = torch.rand(6, V, generator=g) * 1e-39
    zeros = torch.zeros(6, V)
    zeros[torch.arange(5), torch.randint(0, V, (5,), generator=g)] = torch.rand(5, generator=g)  # row 5: none
    block = sample.BLOCK
    sample.BLOCK = 64
    try:
        for probs in (flipped, tied, sub, zeros, torch.cat([flipped[:2], sub[:2], zeros[4:]])):
            draw_both(probs, seeds, steps)
    finally:
        sample.BLOCK = block


def cut_both(probs: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    from k3backend.kernels import sample, sample_ref

    with poisoned_empty():
        got = sample.top_k_top_p(probs, ks, ps)
    want = sample_ref.top_k_top_p(probs, ks, ps)
    bad = [i for i in range(len(ks)) if not torch.equal(got[i], want[i])]
    assert not bad, [(i, ks[i], ps[i], int((got[i] > 0).sum()), int((want[i] > 0).sum())) for i in bad[:5]]


def cut_rows(V: int, seed: int) -> torch.Tensor:
    """Probabilities of smooth, coarse-grid and bf16-rounded logits (4 rows each), every 7th id zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, V, generator=g) * 3
    x[4:8] = torch.round(x[4:8] / 2)
    x[8:] = x[8:].bfloat16().float()
    probs = torch.softmax(x, -1)
    probs[:, ::7] = 0.0
    return probs


def mass_boundaries(probs: torch.Tensor, k: int, prefixes=(0, 1, 2, 3, 5, 8)) -> list[float]:
    """top_p at the exact mass (`mass_units`) of each prefix of the top-k's stable descending order,
    and the doubles just below and above it: the cut moves by one id across each."""
    import math

    from k3backend.kernels.sample_ref import mass_units

    q = mass_units(torch.sort(probs, descending=True, stable=True).values[:k])
    out = []
    for j in prefixes:
        exact = float(q[:j + 1].sum()) / float(q.sum())
        out += [exact, math.nextafter(exact, 0.0), math.nextafter(exact, 1.0)]
    return [t for t in out if 0.0 < t < 1.0]


def check_cut_matches_reference() -> None:
    V = 5000  # two blocks of the shipped tiles
    probs = cut_rows(V, 2)
    ks = [1, 3, 17, 40, V, V + 5, 2, 300, V, 50, 4999, V]
    ps = [1.0, 0.05, 0.5, 0.9, 0.99, 0.999999, 0.9, 1.0, 0.3, 0.95, 0.7, 1.0]
    cut_both(probs, ks, ps)
    cut_both(probs, [V] * 12, ps)  # top-p alone: one phase
    cut_both(probs, ks, [1.0] * 12)  # top-k alone, by count
    cut_both(probs[:0], [], [])
    cut_both(probs[:3], [V] * 3, [1.0] * 3)  # nothing to cut
    cut_both(torch.softmax(torch.randn(2, 1, generator=torch.Generator().manual_seed(3)), -1), [1, 1], [0.5, 1.0])
    tiny = torch.tensor([[3e-40, 7e-40, 7e-40, 1e-45], [0.0] * 4])  # no mass in units of 2**-32: the top id
    cut_both(tiny.repeat(2, 1), [4, 4, 2, 1], [0.5, 0.5, 1e-7, 0.9])  # alone (the first of two equal ones)


def check_cut_at_mass_boundaries_and_ties() -> None:
    V = 700
    probs = cut_rows(V, 4)
    for row, k in ((0, V), (5, V), (9, 40), (6, 12)):  # smooth, tied, bf16; the last two also cut by top-k
        ps = mass_boundaries(probs[row], k)
        cut_both(probs[row].expand(len(ps), V).contiguous(), [k] * len(ps), ps)
    x = torch.full((V,), -1e4)
    tied = [200, 13, 77, 5, 150, 99, 31, 250, 650, 699]
    x[tied] = 0.0
    x[40] = 1.0
    tie_probs = torch.softmax(x, -1)
    cut_both(tie_probs.expand(6, V).contiguous(), [3, V, V, 6, 4, V], [1.0, 0.5, 0.7, 0.6, 0.9, 0.999])
    ps = mass_boundaries(tie_probs, V)  # targets that end exactly inside the ten equal ids
    cut_both(tie_probs.expand(len(ps), V).contiguous(), [V] * len(ps), ps)


def check_cut_small_blocks() -> None:
    """Blocks of 256 ids in chunks of 64: a row spans 8 blocks, its lists several programs, and a
    block's list several steps of 64."""
    from k3backend.kernels import sample

    block, tile, step = sample.CUT_BLOCK, sample.CUT_TILE, sample.LIST_CHUNK
    sample.CUT_BLOCK, sample.CUT_TILE, sample.LIST_CHUNK = 256, 512, 64  # a block's list in several steps
    try:
        V = 2000
        probs = cut_rows(V, 6)
        flat = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(7)) * 0.3, -1)
        cut_both(probs, [V, 40, 1, V, V + 1, 300, V, 2, 999, V, 17, V], [0.9, 0.9, 1.0, 0.5, 0.99, 1.0, 0.05,
                                                                          0.9, 0.8, 0.999999, 0.6, 0.95])
        cut_both(flat, [V, V, 100, V], [0.9, 0.5, 0.9, 0.999])  # most ids in play for several passes
    finally:
        sample.CUT_BLOCK, sample.CUT_TILE, sample.LIST_CHUNK = block, tile, step


def check_cut_random_rows() -> None:
    """Seeded random cases against the reference: rows smooth, tied, with zeros, underflowing or
    subnormal (no mass in 2**-32 units), random top-k and top-p, tiles and pass widths."""
    import random

    from k3backend.kernels import sample

    saved = sample.CUT_BLOCK, sample.CUT_TILE, sample.WRITE_CHUNK, sample.WIDTHS, sample.LIST_CHUNK
    rng, g = random.Random(11), torch.Generator().manual_seed(11)
    try:
        for kind in ("smooth", "tied", "zeros", "underflow", "subnormal", "smooth", "tied", "zeros"):
            sample.CUT_BLOCK, sample.CUT_TILE = rng.choice([64, 128]), rng.choice([256, 512])
            sample.WRITE_CHUNK, sample.LIST_CHUNK = rng.choice([16, 64]), rng.choice([16, 1024])  # list steps
            sample.WIDTHS = rng.choice([(3,) * 10, (3, 3, 3, 7, 7, 7), (2, 4, 4, 4, 4, 4, 4, 4), (6,) * 5])
            S, V = rng.randint(2, 4), rng.choice([1, 7, 65, 300])
            x = torch.randn(S, V, generator=g) * rng.choice([0.3, 3.0])
            probs = torch.softmax(torch.round(x) if kind == "tied" else x * (60 if kind == "underflow" else 1), -1)
            if kind == "zeros":
                probs[torch.rand(S, V, generator=g) < 0.5] = 0.0
            if kind == "subnormal":
                probs = torch.rand(S, V, generator=g) * 1e-39
            ks = [rng.choice([1, 2, rng.randint(1, V), V, V + 3]) for _ in range(S)]
            cut_both(probs, ks, [rng.choice([1.0, 0.9, rng.random(), 1e-7]) for _ in range(S)])
    finally:
        sample.CUT_BLOCK, sample.CUT_TILE, sample.WRITE_CHUNK, sample.WIDTHS, sample.LIST_CHUNK = saved


def check_softmax_matches_torch() -> None:
    """softmax_rows against torch.softmax(x.float() / t) within 32 float32 ulps of each probability (torch's
    CPU softmax takes a faster exp, good to 20 ulps), each row summing to 1: bf16,
    fp16 and fp32 logits, temperatures 0.25-3, -inf at banned ids and over a whole block, a row of -inf
    only (NaN, as torch gives), one id, no rows; shipped blocks and blocks of 64 (rows of many blocks)."""
    from k3backend.kernels import sample, sample_ref

    g = torch.Generator().manual_seed(21)
    block = sample.SOFTMAX_BLOCK
    try:
        for size in (block, 64):
            sample.SOFTMAX_BLOCK = size
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for S, V in ((5, 1000), (3, 1), (0, 50), (4, block + 3)):
                    x = (torch.randn(S, V, generator=g) * 4).to(dtype)
                    if S >= 3 and V > 200:
                        x[0, ::7] = float("-inf")
                        x[1, 64:192] = float("-inf")  # whole blocks of 64
                        x[2] = float("-inf")
                    t = torch.tensor([0.25, 1.0, 3.0, 0.7, 1.3][:S], dtype=torch.float32)
                    ok, why = sample.softmax_rows_supports(x, t)
                    assert ok, why
                    with poisoned_empty():
                        got = sample.softmax_rows(x, t)
                    want = sample_ref.softmax_rows(x, t)
                    assert got.dtype == torch.float32 and got.shape == want.shape
                    assert torch.equal(got.isnan(), want.isnan()), f"{dtype} S{S} V{V}: NaN rows differ"
                    ok_rows = ~want.isnan().any(1)
                    err = (got[ok_rows] - want[ok_rows]).abs()
                    bound = 32 * 2.0 ** -24 * want[ok_rows] + 2.0 ** -140  # and subnormals' absolute steps
                    assert (err <= bound).all(), f"{dtype} S{S} V{V} block {sample.SOFTMAX_BLOCK}: " \
                                                 f"worst {(err / bound).max():.2f}x the bound"
                    assert ((got[ok_rows].double().sum(1) - 1).abs() < 1e-5).all(), f"{dtype} S{S} V{V}: sums"
    finally:
        sample.SOFTMAX_BLOCK = block


def test_softmax_kernels_compile_for_hopper():
    """Both softmax passes compile for sm_90a at the K3 vocabulary from bf16 logits, without spills; the
    row count is not specialised (a new batch size compiles nothing)."""
    from sm90 import compile_sm90

    from k3backend.kernels import sample

    V, S = 163840, 64
    nb = V // sample.SOFTMAX_BLOCK
    c = compile_sm90(sample._softmax_stats_kernel, dict(x_ptr="*bf16", t_ptr="*fp32", stats_ptr="*fp32", V=V, s_x=V,
                                                        S=S, NB=nb), dict(BLOCK=sample.SOFTMAX_BLOCK, GPU=True),
                     num_warps=4, num_stages=1)
    assert c.stack == 0, c
    c = compile_sm90(sample._softmax_write_kernel, dict(x_ptr="*bf16", t_ptr="*fp32", stats_ptr="*fp32",
                                                        out_ptr="*fp32", V=V, s_x=V, s_o=V, S=S, NB=nb),
                     dict(BLOCK=sample.SOFTMAX_BLOCK, NB_P2=64, GPU=True), num_warps=4, num_stages=1)
    assert c.stack == 0, c
    for kernel in (sample._softmax_stats_kernel, sample._softmax_write_kernel):
        assert "S" in {p.name for p in kernel.params if p.do_not_specialize}, kernel.fn.__name__


def test_cut_kernels_compile_for_hopper():
    """Every variant `top_k_top_p` launches compiles for sm_90a at the K3 vocabulary without spills."""
    from sm90 import compile_sm90

    from k3backend.kernels import sample

    P, V, S = len(sample.WIDTHS), 163840, 64
    args = dict(src_ptr="*fp32", s_src=V, len_ptr="*i32", dst_ptr="*fp32", V=V, kp_ptr="*fp64", tot="*fp64",
                st="*fp64", done_ptr="*i32", S=S, i=3, shift=9)
    variants = {(i == 0, i == P - 1, i >= 2, 1 <= i < P - 1, w) for i, w in enumerate(sample.WIDTHS)}
    for first, last, from_list, to_list, w in sorted(variants):
        for ph, ran_a in ((0, True), (1, True), (1, False)):
            constexprs = dict(PH=ph, FIRST=first, LAST=last, RAN_A=ran_a, FROM_LIST=from_list, TO_LIST=to_list,
                              P=P, D=w, FMAX=1 << max(sample.WIDTHS), BLOCK=sample.CUT_BLOCK,
                              CHUNK=min(sample.CUT_TILE >> w, sample.CUT_BLOCK),
                              LIST_CHUNK=min(sample.LIST_CHUNK, sample.CUT_BLOCK), STAGES=sample.CUT_STAGES)
            c = compile_sm90(sample._cut_pass, args, constexprs, num_warps=sample.CUT_WARPS, num_stages=1)
            assert c.stack == 0, (first, last, from_list, to_list, w, ph, ran_a, c)
    tiles = dict(BLOCK=sample.CUT_BLOCK, CHUNK=min(sample.WRITE_CHUNK, sample.CUT_BLOCK))
    nb = V // sample.CUT_BLOCK
    c = compile_sm90(sample._cut_ties, dict(prob_ptr="*fp32", s_p=V, ties_ptr="*i32", V=V, st="*fp64", S=S, NB=nb),
                     tiles, num_warps=4, num_stages=1)
    assert c.stack == 0, c
    args = dict(prob_ptr="*fp32", s_p=V, out_ptr="*fp32", s_o=V, ties_ptr="*i32", V=V, st="*fp64", S=S, NB=nb)
    c = compile_sm90(sample._cut_apply, args, dict(NB_P2=64, **tiles), num_warps=4, num_stages=1)
    assert c.stack == 0, c


def test_cut_kernels_compile_once_for_every_batch_size():
    """Triton compiles a variant per class of an int argument (1, a multiple of 16, other): the row
    count and pass index must not be specialised, or a batch of a new size compiles mid-run (on the
    H200, before they were not: TTFT p50 2.2 s instead of 0.15 at 64 streams with top-p)."""
    from k3backend.kernels import sample

    for kernel, varying in ((sample._cut_pass, {"S", "i", "shift"}), (sample._cut_ties, {"S", "NB"}),
                            (sample._cut_apply, {"S", "NB"})):
        assert varying <= {p.name for p in kernel.params if p.do_not_specialize}, kernel.fn.__name__


def test_draw_kernel_compiles_for_hopper():
    """The interpreter runs what a GPU compile refuses (a global that is not a tl.constexpr, seen on
    the H200): the draw compiles for sm_90a as `race_draw` launches it, without spills."""
    from sm90 import compile_sm90

    from k3backend.kernels import sample

    args = dict(p_ptr="*fp32", seed_ptr="*i64", step_ptr="*i64", val_ptr="*fp64", idx_ptr="*i64", V=163840,
                s_p=163840, NB=163840 // sample.BLOCK)
    c = compile_sm90(sample._race_kernel, args, dict(BLOCK=sample.BLOCK), num_warps=4, num_stages=1)
    assert c.stack == 0, c


@pytest.mark.parametrize("name", CHECKS.names)
def test_under_interpreter(name: str) -> None:
    CHECKS.assert_passed(name)
