"""GEMV cases for bench/kernels.py: kernels/gemv.py's `linear` against cuBLAS (linear_ref) at the `small`
preset's projections (KDA in / f_b / o, MLA in / q_b / o with its gate, latent down / up, the dense MLP's
down), each with the residual adds the model gives it, and 1-64 rows (the GEMV to 8, the tensor-core
kernel above), where `linear_config` takes them; the reference's adds and gate are kernels of their own.
A case runs the op over enough distinct weights (at least 256 MB) that none is read from L2; bytes are
those weights. `--check` compares every element with cuBLAS at tolerances.KERNEL and replays a CUDA graph
(bit-equal to eager).

By hand, `python bench/kernels_gemv.py --tiles [--rows 1 2 4]`: the GEMV's launch variants (rows a program,
K step, warps) at 1-8 rows over the same projections and the LM head, each timed over distinct weights in a CUDA
graph and checked against cuBLAS: per shape the rule's launch (`linear_config`) first, marked "(chosen)", then
the others fastest first, the fastest marked *; exit status 1 if any check failed. `--smoke --tiles`: tiny
sizes under TRITON_INTERPRET=1 (checks only).
"""

from __future__ import annotations

import torch
import triton

from kernels import HBM_TBS, Case, time_fn
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


# --tiles: the vocabulary projection beside the layers' projections; variants keep the fp32 tile M·BN·BK at
# most 2,048 values a warp (16 registers a thread)
TILE_SHAPES = {**SHAPES, "lm_head": (163840, 2048, 0, False)}


def tile_variants(M: int, K: int, smoke: bool = False) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps) launches of the GEMV for M rows of a K-wide weight."""
    top = max(16, triton.next_power_of_2(K))
    return [(bn, bk, w) for bn in (4, 8, 16) for bk in ((32, 64, 128) if smoke else (256, 512, 1024, 2048))
            for w in (4, 8) if bk <= top and M * bn * bk <= 2048 * w]


def tiles_sweep(rows: list[int], iters: int, smoke: bool) -> int:
    """Time and check every `tile_variants` launch at each shape and row count; the number of failed checks."""
    import dataclasses

    from k3backend.kernels import gemv, linear_ref, pdl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    bf = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.05).to(torch.bfloat16)  # noqa: E731
    shapes = {"smoke": (40, 96, 1, False), "smoke_gated": (40, 96, 0, True)} if smoke else TILE_SHAPES
    failures = 0
    for name, (N, K, n_adds, gated) in shapes.items():
        ws = [bf(N, K) for _ in range(1 if smoke else max(2, min(64, (256 << 20) // (N * K * 2))))]
        for M in rows:
            rule = gemv.linear_config(M, N, K, gated, n_adds)
            if rule is None or rule.stages:
                continue
            x, adds, gate = bf(M, K), tuple(bf(M, N) for _ in range(n_adds)), bf(M, K) if gated else None
            chosen = (rule.block_n, rule.block_k, rule.warps)
            print(f"== {name} M{M} N{N} K{K}{f' +{n_adds}' if n_adds else ''}{' gated' if gated else ''} "
                  f"x{len(ws)}: the rule's launch {chosen}", flush=True)
            out = []
            for v in [chosen] + [v for v in tile_variants(M, K, smoke) if v != chosen]:
                cfg = dataclasses.replace(rule, block_n=v[0], block_k=v[1], warps=v[2], pdl=pdl.enabled(x.device))
                many = lambda op, cfg=cfg: torch.stack([op(x, w, cfg, adds, gate) for w in ws])  # noqa: E731
                check = checker(lambda: many(gemv.linear_with), lambda: many(lambda x, w, c, a, gt:
                                linear_ref.linear(x, w, a, gt)), (), roundings=2 if n_adds or gated else 1)
                try:
                    verdict = check()[:2]
                    t = float("nan") if smoke else time_fn(lambda many=many: many(gemv.linear_with), True, iters)
                except Exception as e:  # noqa: BLE001 - a launch that fails to compile or to check: report, go on
                    failures += 1
                    print(f"  {str(v):<16} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                out.append((t / len(ws), v, verdict))
            best = min((r[0] for r in out), default=float("nan"))
            for t, v, verdict in out[:1] + sorted(out[1:], key=lambda r: r[0]):
                timed = "(not timed)" if smoke else \
                    f"{t * 1e6:8.2f} us  {N * K * 2 / t / (HBM_TBS * 1e12):6.1%} of {HBM_TBS} TB/s"
                print(f"{'*' if t == best else ' '} {str(v):<16} {timed}  {verdict}"
                      f"{'  (chosen)' if v == chosen else ''}", flush=True)
    return failures


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="The GEMV's launch variants by hand (the timed cases run through "
                                             "bench/kernels.py --families gemv)")
    ap.add_argument("--tiles", action="store_true", required=True, help="time and check every launch variant")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4], help="rows of x (1-8: the GEMV)")
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed per variant")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (TRITON_INTERPRET=1 on a CPU), checks only")
    a = ap.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        ap.error("--tiles: no GPU here; --smoke runs tiny sizes under TRITON_INTERPRET=1")
    print("$ python bench/kernels_gemv.py " + " ".join(sys.argv[1:]), flush=True)
    sys.exit(1 if tiles_sweep(a.rows, a.iters, a.smoke) else 0)
