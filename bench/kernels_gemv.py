"""GEMV cases for bench/kernels.py: kernels/gemv.py's `linear` against cuBLAS (linear_ref) at the `small`
preset's projections (KDA in / f_b / o, MLA in / q_b / o with its gate, latent down / up, the dense MLP's
down), each with the residual adds the model gives it, and 1-64 rows (the GEMV to 8, the tensor-core
kernel above), where `linear_config` takes them; the reference's adds and gate are kernels of their own.
A case runs the op over enough distinct weights (at least 256 MB) that none is read from L2; bytes are
those weights. `--check` compares every element with cuBLAS at tolerances.KERNEL and replays a CUDA graph
(bit-equal to eager).
"""

from __future__ import annotations

import torch

from kernels import Case
from kernels_mla import checker

SHAPES = {"kda_in": (8336, 2048, 0, False), "kda_f_b": (2048, 128, 0, False), "o_proj": (2048, 2048, 1, False),
          "mla_in": (3392, 2048, 0, False), "mla_q_b": (3072, 768, 0, False), "mla_o": (2048, 2048, 1, True),
          "latent_down": (1024, 2048, 0, False), "latent_up": (2048, 1024, 2, False),
          "mlp_down": (2048, 8192, 1, False)}  # (N, K, residual adds, MLA's output gate)


def cases(args) -> list[Case]:
    from k3backend.kernels import gemv, linear_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    bf = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.05).to(torch.bfloat16)  # noqa: E731
    shapes, rows, budget = ({"smoke": (40, 96, 1, False), "smoke_gated": (40, 96, 0, True)}, (1, 3, 20), 1) \
        if args.smoke else (SHAPES, (1, 2, 4, 8, 16, 32, 64), 256 << 20)
    out: list[Case] = []
    for name, (N, K, n_adds, gated) in shapes.items():
        ws = [bf(N, K) for _ in range(max(1, min(64, budget // (N * K * 2))))]
        for M in rows:
            if gemv.linear_config(M, N, K, gated, n_adds) is None:
                continue
            x, adds, gate = bf(M, K), tuple(bf(M, N) for _ in range(n_adds)), bf(M, K) if gated else None
            many = lambda op, x=x, ws=ws, adds=adds, gate=gate: torch.stack(  # noqa: E731
                [op(x, w, adds, gate) for w in ws])
            what = f"M{M} N{N} K{K}{f' +{n_adds}' if n_adds else ''}{' gated' if gated else ''} x{len(ws)}"
            out.append(Case("gemv", f"linear/{name}", what,
                            run=lambda many=many: many(gemv.linear), ref=lambda many=many: many(linear_ref.linear),
                            bytes=len(ws) * N * K * 2,
                            check=checker(lambda x, ws, many=many: many(gemv.linear),
                                          lambda x, ws, many=many: many(linear_ref.linear), (x, ws), graph=True,
                                          roundings=2 if n_adds or gated else 1)))  # a flipped product rounding
    return out
