"""Norm and small-fusion cases for bench/kernels.py: kernels/norm.py against norm_ref.

T = 1, 64, 1024, 16384 tokens at hidden 2048 (the `small` preset) and 7168 (K3):
rms_norm; attn_res_mix and the fused attn_res_mix_norm over 5 (small: attn_res_block_size 6) and 9
(K3) candidate rows, the fused one at 1-64 tokens also with the warps `mix_warps` does not take
(`attn_res_mix_norm_w<warps>`);
gated_rms_norm over T x 16 heads x 128 (KDA o_norm). Bytes are one read of every input and one
write of the output. `--check` compares each case with its reference at tolerances.KERNEL and,
on a GPU, replays it from a CUDA graph (bit-equal to eager).
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels import Case
from kernels_mla import checker

WIDTHS = {"small": (2048, 5), "k3": (7168, 9)}  # hidden, AttnRes candidates
KDA_HEADS, HEAD_DIM = 16, 128


def cases(args) -> list[Case]:
    from k3backend.kernels import norm, norm_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(torch.bfloat16)  # noqa: E731
    tokens, widths = ([1, 5], {"smoke": (96, 3)}) if args.smoke else ([1, 64, 1024, 16384], WIDTHS)
    out: list[Case] = []

    def add(name: str, shape: str, fast, ref, a: tuple, nbytes: float, roundings: int = 1) -> None:
        out.append(Case("norm", name, shape, run=lambda: fast(*a), ref=lambda: ref(*a), bytes=nbytes,
                        check=checker(fast, ref, a, graph=True, roundings=roundings)))

    for wname, (H, n_rows) in widths.items():
        w, ns, wp = bf(H, scale=0.1) + 1, bf(H, scale=0.1) + 1, bf(1, H, scale=H ** -0.5)
        for T in tokens:
            x = bf(T, H)
            add(f"rms_norm/{wname}", f"T{T} H{H}", norm.rms_norm, norm_ref.rms_norm, (x, w, 1e-5), 2 * T * H * 2)
            rows = [bf(T, H) for _ in range(n_rows)]
            add(f"attn_res_mix/{wname}", f"T{T} H{H} n{n_rows}", norm.attn_res_mix, norm_ref.attn_res_mix,
                (rows, ns, wp, 1e-5), (n_rows + 1) * T * H * 2)
            add(f"attn_res_mix_norm/{wname}", f"T{T} H{H} n{n_rows}", norm.attn_res_mix_norm,
                norm_ref.attn_res_mix_norm, (rows, ns, wp, 1e-5, w, 1e-5), (n_rows + 1) * T * H * 2,
                roundings=2)  # the mix is rounded to bf16 before the norm (two roundings)
            rule = norm.mix_warps(triton.next_power_of_2(H), T)
            for warps in (4, 8, 16) if T <= norm.MIX_TILED_ROWS else ():  # mix_warps' alternatives
                if warps != rule:
                    add(f"attn_res_mix_norm_w{warps}/{wname}", f"T{T} H{H} n{n_rows}",
                        functools.partial(norm.attn_res_mix_norm_with, warps=warps), norm_ref.attn_res_mix_norm,
                        (rows, ns, wp, 1e-5, w, 1e-5), (n_rows + 1) * T * H * 2, roundings=2)
    D = HEAD_DIM if not args.smoke else 24
    wo = bf(D, scale=0.1) + 1
    for T in tokens:
        o, z = bf(T, KDA_HEADS, D), bf(T, KDA_HEADS, D, scale=3)
        add("gated_rms_norm/kda", f"T{T} H{KDA_HEADS} D{D}", norm.gated_rms_norm, norm_ref.gated_rms_norm,
            (o, z, wo, 1e-5), 3 * T * KDA_HEADS * D * 2)
    return out
