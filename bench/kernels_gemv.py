"""GEMV cases for bench/kernels.py: kernels/gemv.py's `linear` against cuBLAS (linear_ref) at the `small`
preset's projections (KDA in / f_b / o, MLA in / q_b, latent down / up, the dense MLP's down) and 1, 2,
4 and 8 rows, where `linear_config` takes them. A case runs the op over enough distinct weights (at
least 256 MB) that none is read from L2; bytes are those weights. `--check` compares every element with
cuBLAS at tolerances.KERNEL and replays a CUDA graph (bit-equal to eager).
"""

from __future__ import annotations

import torch

from kernels import Case
from kernels_mla import checker

SHAPES = {"kda_in": (8336, 2048), "kda_f_b": (2048, 128), "o_proj": (2048, 2048), "mla_in": (3392, 2048),
          "mla_q_b": (3072, 768), "latent_down": (1024, 2048), "latent_up": (2048, 1024), "mlp_down": (2048, 8192)}


def cases(args) -> list[Case]:
    from k3backend.kernels import gemv, linear_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    bf = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.05).to(torch.bfloat16)  # noqa: E731
    shapes, rows, budget = ({"smoke": (40, 96)}, (1, 3), 1) if args.smoke else (SHAPES, (1, 2, 4, 8), 256 << 20)
    out: list[Case] = []
    for name, (N, K) in shapes.items():
        ws = [bf(N, K) for _ in range(max(1, min(64, budget // (N * K * 2))))]
        for M in rows:
            if gemv.linear_config(M, N, K) is None:
                continue
            x = bf(M, K)
            many = lambda op, x=x, ws=ws: torch.stack([op(x, w) for w in ws])  # noqa: E731
            out.append(Case("gemv", f"linear/{name}", f"M{M} N{N} K{K} x{len(ws)}",
                            run=lambda many=many: many(gemv.linear), ref=lambda many=many: many(linear_ref.linear),
                            bytes=len(ws) * N * K * 2,
                            check=checker(lambda x, ws, many=many: many(gemv.linear),
                                          lambda x, ws, many=many: many(linear_ref.linear), (x, ws), graph=True)))
    return out
