"""The Triton draw (kernels/sample.py) picks the reference's token (sample_ref.race_draw) exactly.

Under TRITON_INTERPRET=1 in a subprocess (tests/interpret.py): vocabularies of 1, 7, 2049 (one
past a block) and 5000 ids; probabilities with zeros (filtered ids), uniform rows (the winner is
the largest uniform, so any bit of the hash that differs shows), seeds at the int64 extremes and
large output positions. The per-block partials start as NaN (`poisoned_empty`).
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
