"""MLA attention cases for bench/kernels.py: the Triton `mla_decode` / `mla_prefill` (kernels/mla.py)
against their torch references (kernels/mla_ref.py).

Shapes (K3_LM §6): dn 128, dr 64, dv 128, r 512, latent rows of 576 bf16 in pool blocks of 64.
Heads: 16 (the `small` preset) and 12 (K3's 96 heads at TP = 8). Decode at batch 1, 16, 64, 256
with every sequence at context 1000 (a partial last key tile), 1K, 4K, 16K (bytes = the latent rows
read, B·ctx·576·2); prefill chunks of 2K and 8K tokens, fresh (expanded form) and after an 8K cached
prefix (absorbed form), and one fresh 16K-token prompt (no reference: its [N, T, S] scores would take
~50 GB). Extra `decode[...]` rows at batch 64 / 16K time alternative tile configurations for tuning.
`--check` compares every case with the reference at tolerances.KERNEL[bf16], and on a GPU
replays each decode case from a CUDA graph (bit-equal to eager, no host sync in the op).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kernels import Case

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tolerances import KERNEL  # noqa: E402

WIDTHS = {"small": 16, "k3tp8": 12}
DN, DR, DV, R, BS = 128, 64, 128, 512, 64
# (config, splits) alternatives to kernels/mla.py's decode tiles (DECODE_TMA on a GPU) and split count, at B64 ctx16K
TUNING = {
    "bn32-w4-ptr": ({"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "tma": False}, None),
    "bn64-w8-tma": ({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "tma": True}, None),
    "bn64-w8-s3-tma": ({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "tma": True}, None),
    "bn64-w8-p8": ({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "tma": False, "p8": True}, None),
    "default-2splits": (None, 2),
    "default-8splits": (None, 8),
    "default-16splits": (None, 16),
}


def _problem(N: int, prefix: list[int], chunk: list[int], dims: dict, device: str, seed: int) -> dict:
    """Sequences with prefix[b] cached and chunk[b] new latent rows (already written), each in its own
    run of pool blocks (in reverse order, so tables are not the identity); block 0 is the null block."""
    g = torch.Generator(device=device).manual_seed(seed)
    dn, dr, dv, r, bs = dims["dn"], dims["dr"], dims["dv"], dims["r"], dims["bs"]
    ctx = [p + c for p, c in zip(prefix, chunk)]
    need = [-(-n // bs) for n in ctx]
    pool = torch.randn(1 + sum(need), bs, r + dr, generator=g, device=device, dtype=torch.bfloat16)
    width, start, tables = max(need), 1, []
    for nb in need:
        tables.append(list(range(start + nb - 1, start - 1, -1)) + [0] * (width - nb))
        start += nb
    T = sum(chunk)
    q = torch.randn(T, N, dn + dr, generator=g, device=device, dtype=torch.bfloat16)
    kv_b = (torch.randn(N * (dn + dv), r, generator=g, device=device) * r ** -0.5).to(torch.bfloat16)
    w = kv_b.view(N, dn + dv, r)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return {"q_nope": q[..., :dn], "q_pe": q[..., dn:], "pool": pool, "cu_seqlens": i32([0, *torch.tensor(chunk)
                                                                                         .cumsum(0).tolist()]),
            "block_tables": i32(tables), "context_lens": i32(ctx), "kv_b": kv_b, "w_kc": w[:, :dn],
            "w_vc": w[:, dn:].transpose(1, 2), "scale": (dn + dr) ** -0.5}


def _decode_args(p: dict) -> tuple:
    return (p["q_nope"], p["q_pe"], p["pool"], p["block_tables"], p["context_lens"], p["w_kc"], p["w_vc"], p["scale"])


def _prefill_args(p: dict) -> tuple:
    return (p["q_nope"], p["q_pe"], p["pool"], p["cu_seqlens"], p["block_tables"], p["context_lens"], p["kv_b"],
            p["w_kc"], p["w_vc"], p["scale"])


def checker(fast, ref, args: tuple, graph: bool = False, roundings: int = 1):
    """A Case.check: every element of fast(*args) against ref(*args) at KERNEL of the output dtype,
    times `roundings` (an op whose reference rounds twice on the way, where one flipped first rounding
    moves the result by two ulps); `graph` (on a GPU): also replay fast(*args) from a CUDA graph,
    bit-equal to eager."""
    def check() -> str:
        out, want = fast(*args), ref(*args)
        tol = {k: v * roundings for k, v in KERNEL[want.dtype].items()}
        torch.testing.assert_close(out, want, **tol)
        diff = (out.float() - want.float()).abs()
        note = f"ok: max|d| {diff.max().item():.1e}, |ref| <= {want.float().abs().max().item():.2f} " \
               f"(rtol {tol['rtol']:.1e}, atol {tol['atol']:.1e})"
        if graph and torch.cuda.is_available():
            g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fast(*args)  # warm-up on the capture stream
                with torch.cuda.graph(g, stream=s):
                    replayed = fast(*args)
            torch.cuda.current_stream().wait_stream(s)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, out), "CUDA-graph replay differs from eager"
            note += ", graph replay = eager"
        return note
    return check


def cases(args) -> list[Case]:
    from k3backend.kernels import mla, mla_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        dims = {"dn": 16, "dr": 16, "dv": 16, "r": 64, "bs": 16}
        widths, batches, ctxs = {"smoke": 4}, [1, 3], [40]
        prefills = [([0], [24]), ([20], [9])]
    else:
        dims = {"dn": DN, "dr": DR, "dv": DV, "r": R, "bs": BS}
        widths, batches, ctxs = WIDTHS, [1, 16, 64, 256], [1000, 1024, 4096, 16384]  # 1000: a partial last tile
        prefills = [([0], [2048]), ([0], [8192]), ([8192], [2048]), ([8192], [8192]), ([0], [16384])]
    row_bytes = (dims["r"] + dims["dr"]) * 2
    out: list[Case] = []
    for wname, N in widths.items():
        for B in batches:
            for ctx in ctxs:
                p = _problem(N, [ctx - 1] * B, [1] * B, dims, device, seed=B + ctx)
                a = _decode_args(p)
                out.append(Case("mla", f"decode/{wname}", f"B{B} ctx{ctx} N{N}",
                                run=lambda a=a: mla.mla_decode(*a), ref=lambda a=a: mla_ref.mla_decode(*a),
                                bytes=B * ctx * row_bytes, flops=2.0 * B * N * ctx * (2 * dims["r"] + dims["dr"]),
                                check=checker(mla.mla_decode, mla_ref.mla_decode, a, graph=True)))
        for prefix, chunk in prefills:
            p = _problem(N, prefix, chunk, dims, device, seed=sum(chunk))
            a = _prefill_args(p)
            T, S = chunk[0], prefix[0] + chunk[0]
            fresh = prefix[0] == 0
            per_pair = (dims["dn"] + dims["dr"] + dims["dv"]) if fresh else (2 * dims["r"] + dims["dr"])
            flops = 2.0 * N * per_pair * (T * (T + 1) / 2 + T * prefix[0])  # causal pairs
            big = T * S * N * 4 > 1.2e10  # the reference's fp32 scores alone (it holds ~3 such tensors)
            out.append(Case("mla", f"prefill/{wname}/{'fresh' if fresh else 'cached'}", f"T{T} prefix{prefix[0]} N{N}",
                            run=lambda a=a: mla.mla_prefill(*a), ref=None if big else lambda a=a: mla_ref.mla_prefill(*a),
                            bytes=S * row_bytes, flops=flops, graph=False,
                            check=None if big else checker(mla.mla_prefill, mla_ref.mla_prefill, a)))
    # tile configurations and split counts at the target shape (smoke: two of them, tiny)
    B, ctx, N = (3, 40, 4) if args.smoke else (64, 16384, WIDTHS["small"])
    a = _decode_args(_problem(N, [ctx - 1] * B, [1] * B, dims, device, seed=7))
    for name, (cfg, splits) in list(TUNING.items())[::4] if args.smoke else TUNING.items():
        fn = lambda *a, cfg=cfg, splits=splits: mla.decode(*a, config=cfg, splits=splits)  # noqa: E731
        out.append(Case("mla", f"decode[{name}]", f"B{B} ctx{ctx} N{N}", run=lambda a=a, fn=fn: fn(*a),
                        bytes=B * ctx * row_bytes, flops=2.0 * B * N * ctx * (2 * dims["r"] + dims["dr"]),
                        check=checker(fn, mla_ref.mla_decode, a)))
    return out


# (cached prefix, chunk) pairs for --prefix-forms: around the rule's PREFIX_MIN_LEN and up to 16 K
PREFIX_FORMS = [(1024, 16), (1024, 64), (1024, 256), (1024, 1024), (3072, 1024), (7168, 32), (7168, 64),
                (7168, 256), (7168, 1024), (15360, 1024), (8192, 2048), (0, 256), (0, 1024)]


def prefix_forms(iters: int, smoke: bool) -> None:
    """One chunk after a cached prefix in each of mla_prefill's two forms (kernels/mla.py PREFIX_MIN_LEN):
    ms of the op (graph replays), and each form's largest error against the fp32 reference on the same
    values, in bf16 ulps (2^-8) of the row's largest output. A fresh chunk (prefix 0) shows what the
    expansion kernel costs when it has nothing to do (its programs return at once)."""
    from kernels import time_fn

    from k3backend.kernels import mla, mla_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = {"dn": 16, "dr": 16, "dv": 16, "r": 64, "bs": 16} if smoke else \
        {"dn": DN, "dr": DR, "dv": DV, "r": R, "bs": BS}
    forms = [(40, 9), (0, 24)] if smoke else PREFIX_FORMS
    saved = mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN
    print(f"{'prefix':>7} {'chunk':>6} {'absorbed ms':>12} {'expanded ms':>12} {'speed-up':>9} "
          f"{'err absorbed':>13} {'err expanded':>13}  (N {WIDTHS['small']}, errors in bf16 ulps of the row max)")
    try:
        for P, L in forms:
            a = _prefill_args(_problem(4 if smoke else WIDTHS["small"], [P], [L], dims, device, seed=P + L))
            exact = mla_ref.mla_prefill(*(x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in a))
            ulp = exact.abs().amax(-1, keepdim=True) * 2.0 ** -8
            res = []
            for tokens in (0, max(P, saved[0])):
                mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = tokens, 1
                err = ((mla.mla_prefill(*a).float() - exact).abs() / ulp).max().item()
                res.append((time_fn(lambda: mla.mla_prefill(*a), True, iters), err))
            (ta, ea), (te, ee) = res
            print(f"{P:>7} {L:>6} {ta * 1e3:>12.3f} {te * 1e3:>12.3f} {ta / te:>8.2f}x {ea:>13.2f} {ee:>13.2f}",
                  flush=True)
    finally:
        mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = saved


# (batch, context) of --decode-sweep: the engine's decode steps at short and mid contexts
DECODE_SWEEP = [(64, 384), (64, 1000), (64, 4096), (64, 16384), (256, 384), (256, 4096), (16, 1024), (1, 384),
                (1, 4096), (1, 16384)]


def decode_sweep(iters: int, smoke: bool, table_blocks: int = 512) -> None:
    """mla_decode's tiles and split counts at the DECODE_SWEEP shapes, 16 heads, block tables
    `table_blocks` wide as the engine has them (512: max_model_len 32K), so the split count is the one
    the engine's graphs use: kernels/mla.py decode_tiles and decode_splits first, then the split count
    alone changed, then other tiles at the chosen split count and at half and twice it; the 10 fastest.
    Each row: µs (graph replays), latent bytes read per µs, largest error relative to the output's max."""
    from kernels import time_fn

    from k3backend.kernels import mla, mla_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = {"dn": 16, "dr": 16, "dv": 16, "r": 64, "bs": 16} if smoke else \
        {"dn": DN, "dr": DR, "dv": DV, "r": R, "bs": BS}
    N, shapes = (4, [(3, 40)]) if smoke else (WIDTHS["small"], DECODE_SWEEP)
    for B, ctx in shapes:
        p = _problem(N, [ctx - 1] * B, [1] * B, dims, device, seed=B + ctx)
        bt = p["block_tables"]
        pad = max(0, (8 if smoke else table_blocks) - bt.shape[1])
        p["block_tables"] = torch.cat([bt, bt.new_zeros(B, pad)], 1)
        a = _decode_args(p)
        want = mla_ref.mla_decode(*a).float()
        base = mla.decode_tiles(N, p["pool"], dims["r"])
        chosen = mla.decode_splits(base, B, N, p["block_tables"].shape[1] * dims["bs"], a[0].device)
        variants = [("chosen", None, None)] + [(f"splits{s}", None, s) for s in (1, 2, 3, 4, 6, 8, 16, 32, 64)
                                               if s != chosen]
        for bn, w, st, tma in [(32, 4, 2, False), (32, 4, 3, False), (64, 4, 2, True), (64, 8, 2, True),
                               (64, 8, 3, True)]:
            cfg = dict(base, BLOCK_N=bn, num_warps=w, num_stages=st, tma=tma)
            name = f"bn{bn} w{w} st{st}{' tma' if tma else ''}"
            variants += [(f"{name} splits{s}", cfg, s) for s in sorted({chosen, chosen * 2, max(1, chosen // 2)})]
        rows = []
        for name, cfg, splits in variants:
            run = lambda cfg=cfg, splits=splits: mla.decode(*a, config=cfg, splits=splits)  # noqa: E731
            try:
                err = (run().float() - want).abs().max().item() / want.abs().max().item()
                rows.append((time_fn(run, True, iters), name, err))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: report, go on
                print(f"B{B} ctx{ctx} {name}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
        best = min(r[0] for r in rows)
        print(f"== B{B} ctx{ctx} N{N}, table {p['block_tables'].shape[1]} blocks, chosen {base} splits {chosen}")
        nbytes = B * ctx * (dims["r"] + dims["dr"]) * 2  # the latent rows read
        for t, name, err in [rows[0]] + sorted(rows[1:])[:10]:
            print(f"{'*' if t == best else ' '} {name:<26} {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s  "
                  f"rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="mla_prefill's two forms after a cached prefix, or mla_decode's "
                                             "tiles and split counts (the other MLA cases run through "
                                             "bench/kernels.py --families mla)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prefix-forms", action="store_true")
    mode.add_argument("--decode-sweep", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    (decode_sweep if args.decode_sweep else prefix_forms)(args.iters, args.smoke)
