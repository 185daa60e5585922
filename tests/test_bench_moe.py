"""bench/kernels_moe.py's per-kernel split of the experts op (`--per-kernel`): kernels grouped by part."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kernels_moe  # noqa: E402


def test_parts_group_kernels_by_name_and_average_over_calls():
    kernels = [("_up_kernel", 40.0), ("_align_count_kernel", 3.0), ("_align_place_kernel", 5.0),
               ("_down_kernel", 20.0), ("_up_kernel", 44.0), ("_sum_kernel", 6.0),
               ("void at::native::index_elementwise_kernel", 8.0), ("_expand_kernel", 2.0)]
    got = kernels_moe.parts_us(kernels, calls=2)
    assert got == {"up": 42.0, "down": 10.0, "align": 4.0, "other": 4.0, "sum": 3.0, "expand": 1.0}, got
    assert list(got) == ["up", "down", "align", "other", "sum", "expand"], got  # largest first
