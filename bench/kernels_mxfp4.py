"""The w4a16 MXFP4 experts kernel (kernels/moe.py experts_mxfp4, K3_LM.md §7.7) at real sizes, beside
the bf16 experts kernel on the same weights dequantized (issue 18's targets), on one GPU.

    python bench/kernels_mxfp4.py                 # memory, check, time: one table per shape
    python bench/kernels_mxfp4.py --sweep         # then tiles and the expansions, one change at a time
    TRITON_INTERPRET=1 python bench/kernels_mxfp4.py --smoke --sweep   # tiny sizes on a CPU: the harness

Shapes: `small` (E 64 top-6, latent D 1024, I 1024) and K3 (E 896 top-16, D 3584, I 3072: 15.7 GB packed,
59 GB dequantized, one layer), at T ∈ {1, 16, 64, 256, 2048, 8192, 16384} tokens, routed as in
bench/kernels_moe.py (a per-expert popularity skew). Weights: random codes and exponents by
make-checkpoint's rule; the bf16 copy is their exact dequantization. Each kernel is timed over up to 8 copies of
the layer's weights in turn (`hit7/64x8`: 7 of 64 experts hit, 8 copies), so that the experts read add up to
200 MB packed: one set of the few experts that a decode call hits fits in L2 (50 MB), a model's layers do not.

Columns: ms of experts_mxfp4, with each in-register expansion (d0 tl.dot_scaled, d1 through fp32, d2 the
PTX bit placement, d3 the same with the 2^126 in the scale, expandE all E experts expanded to bf16 first; the
first row is what experts_mxfp4_config picks, the one the engine runs); TB/s in packed bytes (codes + exponents of
the experts hit, plus x and the output; the 1-64 token target is >= 70 % of 4.27 TB/s, the measured copy
ceiling); TFLOP/s of the useful 2·T·k·3·I·D (the 8-16 K target is >= 450); x bf16 = the bf16 kernel's time / this
one's (the 1-64 token target is >= 2.5); check: every element within 2 bf16 ulps of the row's largest |output|
against moe_ref.experts_mxfp4 (dequantize exactly, then the bf16 reference op), and how many
elements differ at all from the bf16 kernel on the dequantized weights (only accumulation order
separates the two).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import HBM_TBS, Case, time_fn  # noqa: E402
from kernels_moe import CHECK_ULPS, K3, SITU, SMALL, Shape  # noqa: E402

from k3backend.kernels import moe_ref  # noqa: E402

TOKENS = (1, 16, 64, 256, 2048, 8192, 16384)
SMOKE = Shape("smoke", 7, 3, 96, 64, 300)


class MxLayer:
    """One MoE layer's routed experts as MXFP4 codes + exponents and as their bf16 values, seeded."""

    def __init__(self, s: Shape, device: str) -> None:
        from k3backend.presets import random_tensor

        g = torch.Generator(device=device).manual_seed(0)
        self.s, self.device, self.gen = s, device, g
        shapes = {"w13": (s.E, 2 * s.I, s.D // 2), "w13_scale": (s.E, 2 * s.I, s.D // 32),
                  "w2": (s.E, s.D, s.I // 2), "w2_scale": (s.E, s.D, s.I // 32)}
        self.mx = {n: random_tensor(f"experts.{n}", shape, torch.uint8, g, device) for n, shape in shapes.items()}
        self.bf16 = {w: self._dequant(w) for w in ("w13", "w2")}
        self.scales = (self.mx["w13_scale"], self.mx["w2_scale"])
        self.popularity = torch.randn(s.E, generator=g, device=device) * 0.15
        self.bias = torch.randn(s.E, generator=g, device=device) * 0.01
        self._copies: list[tuple] = []

    def _dequant(self, w: str) -> torch.Tensor:
        packed, scale = self.mx[w], self.mx[f"{w}_scale"]
        out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.bfloat16, device=self.device)
        for e in range(packed.shape[0]):  # one expert at a time: no fp32 copy of 59 GB
            out[e] = moe_ref.dequant_mxfp4(packed[e], scale[e], torch.bfloat16)
        return out

    def inputs(self, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.randn(T, self.s.E, generator=self.gen, device=self.device) + self.popularity
        w, ids = moe_ref.route(logits, self.bias, self.s.k, 1, 1, True, 1.0)
        return torch.randn(T, self.s.D, generator=self.gen, device=self.device).bfloat16(), w, ids

    def mx_args(self, x, w, ids) -> tuple:
        m = self.mx
        return x, w, ids, m["w13"], m["w13_scale"], m["w2"], m["w2_scale"], SITU, 1.0

    def bf16_args(self, x, w, ids) -> tuple:
        return x, w, ids, self.bf16["w13"], self.bf16["w2"], SITU, 1.0

    def copies(self, hit: int) -> list[tuple]:
        """Weight sets (w13, w2, scales, bf16 w13, bf16 w2) to time calls over in turn: the layer's own, then clones at
        other addresses until the experts a call hits add up to ROTATE_BYTES packed (at most 8 sets), so a call
        reads HBM as in a model of many layers, not the L2 that one layer's few experts fit in (one set on a CPU)."""
        n = min(8, max(1, math.ceil(ROTATE_BYTES / _bytes_flops(self.s, 0, hit)[0]))) if self.device == "cuda" else 1
        m, b = self.mx, self.bf16
        own = (m["w13"], m["w2"], self.scales, b["w13"], b["w2"])
        while len(self._copies) < n - 1:
            self._copies.append(tuple(t.clone() if isinstance(t, torch.Tensor) else tuple(u.clone() for u in t)
                                      for t in own))
        return [own] + self._copies[:n - 1]

    def memory(self) -> str:
        packed = sum(t.nbytes for t in self.mx.values())
        full = sum(t.nbytes for t in self.bf16.values())
        codes = self.mx["w13"].nbytes + self.mx["w2"].nbytes
        return (f"{self.s.name}: expert memory of one layer: MXFP4 {packed / 1e9:.3f} GB (codes {codes / 1e9:.3f} + "
                f"exponents), bf16 {full / 1e9:.3f} GB: {packed / full:.4f}x (4.25/16 = {4.25 / 16:.4f})")


ROTATE_BYTES = 200e6  # packed expert bytes that timed calls cycle through: 4x the H100's and H200's 50 MB of L2


def timed(sets: list[tuple], call, iters: int) -> float:
    """Seconds per call(*set), the calls over `sets` in turn in one CUDA graph."""
    return time_fn(lambda: [call(*w) for w in sets], True, iters) / len(sets)


def _bytes_flops(s: Shape, T: int, hit: int) -> tuple[float, float]:
    packed_expert = 3 * s.I * s.D * (0.5 + 1 / 32)
    return hit * packed_expert + 2 * T * s.D * 2, 2.0 * T * s.k * 3 * s.I * s.D


def check(layer: MxLayer, args: tuple, cfg=None) -> str:
    """Every element against dequantize-then-reference; bit differences from the bf16 kernel."""
    from k3backend.kernels import moe

    x, w, ids = args[:3]
    s = layer.s
    cfg = cfg or moe.experts_mxfp4_config(x.shape[0], s.k, s.E, s.D, s.I, *layer.scales)
    run = lambda: moe.experts_with(x, w, ids, layer.mx["w13"], layer.mx["w2"], SITU, 1.0, cfg,  # noqa: E731
                                   layer.scales)
    got = run()
    assert torch.equal(got, run()), "experts_mxfp4: two runs differ (row placement must not matter)"
    want = moe_ref.experts_mxfp4(*layer.mx_args(x, w, ids))
    assert not got.isnan().any(), "experts_mxfp4: NaN in the output"
    ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-6) * 2.0 ** -7
    worst = ((got.float() - want.float()).abs() / ulp).max().item()
    assert worst <= CHECK_ULPS, f"experts_mxfp4: max error {worst:.2f} bf16 ulps > {CHECK_ULPS}"
    bf16 = moe.experts(*layer.bf16_args(x, w, ids))
    return f"max {worst:.2f} ulp <= {CHECK_ULPS}; {(got != bf16).float().mean().item():.2%} differ from the bf16 kernel"


def _math(cfg):
    """What runs: the GEMV kernels read decode 0 as 1 (they have no tl.dot_scaled)."""
    return dataclasses.replace(cfg, decode=max(cfg.decode, 1)) if cfg.gemv else cfg


def table(layer: MxLayer, tokens: list[int], do_check: bool, iters: int) -> list[str]:
    """Check and time experts_mxfp4 as experts_mxfp4_config picks it, then the MMA tiles with each expansion and
    the GEMV kernels (d1, d2) where it or the bf16 experts take them, and the bf16 kernel at each T;
    returns the table rows."""
    from k3backend.kernels import moe

    s, rows = layer.s, []
    for T in tokens:
        x, w, ids = layer.inputs(T)
        hit = int(torch.unique(ids).numel())
        nbytes, flops = _bytes_flops(s, T, hit)
        chosen = moe.experts_mxfp4_config(T, s.k, s.E, s.D, s.I, *layer.scales)
        sets = layer.copies(hit)
        t_bf = timed(sets, lambda _, __, ___, b13, b2: moe.experts(x, w, ids, b13, b2, SITU, 1.0), iters)
        gemv = chosen.gemv or moe.experts_config(T, s.k, s.E, s.D, s.I).gemv  # where either rule takes them
        tiles = moe.experts_config(T, s.k, s.E, s.D, s.I, mxfp4=True) if chosen.expand else chosen  # in registers
        variants = [dataclasses.replace(tiles, gemv=None, decode=d) for d in (0, 1, 2, 3)]
        variants += [dataclasses.replace(tiles, gemv=gemv, decode=d) for d in (1, 2, 3)] if gemv else []
        variants += [dataclasses.replace(tiles, fragments=None)] if tiles.fragments else []  # moe.py's tiles
        for cfg in [chosen] + [v for v in variants if _math(v) != _math(chosen)]:
            shape = f"T{T} hit{hit}/{s.E}x{len(sets)} " + \
                (f"gemv{cfg.gemv[:2]}" if cfg.gemv else f"BM{cfg.block_m}") + \
                (" frag" if cfg.fragments and not cfg.gemv and cfg.decode >= 2 else "") + \
                (f" expand{cfg.expand}" if cfg.expand else f" d{cfg.decode}")
            try:
                status = check(layer, (x, w, ids), cfg) if do_check else ""
            except AssertionError as e:
                status = f"FAILED {e}"
            try:
                t = timed(sets, lambda w13, w2, sc, _, __: moe.experts_with(x, w, ids, w13, w2, SITU, 1.0, cfg, sc),
                          iters)
            except Exception as e:  # noqa: BLE001 - an expansion that does not compile here: report, go on
                rows.append(f"{'experts_mxfp4_' + s.name:<20} {shape:<26} FAILED {type(e).__name__}: {str(e)[:200]}")
                print(rows[-1], flush=True)
                continue
            rows.append(f"{'experts_mxfp4_' + s.name:<20} {shape:<26} {t * 1e3:>9.3f} {nbytes / t / 1e12:>6.2f} "
                        f"{nbytes / t / 1e12 / HBM_TBS:>6.1%} {flops / t / 1e12:>8.1f} {t_bf * 1e3:>9.3f} "
                        f"{t_bf / t:>7.2f}x  {status}")
            print(rows[-1], flush=True)
    return rows


HEADER = (f"{'case':<20} {'shape (d: expansion)':<26} {'ms':>9} {'TB/s':>6} {'%HBM':>6} {'TFLOP/s':>8} "
          f"{'bf16 ms':>9} {'x bf16':>8}  check")


def candidates(cfg) -> list:
    """The chosen tiles and expansion, then one change at a time."""
    r = dataclasses.replace
    (ubn, ubk, uw, us), (dbn, dbk, dw, ds) = cfg.up, cfg.down
    if cfg.gemv:  # the GEMV kernels' tiles (BLOCK_N, BLOCK_K, warps, stages), decode 2 and 3; the tiles below vary
        # only what the GEMV branch ignores
        gemvs = [(bn, bk, w, st) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) for st in (1, 2)]
        return [cfg] + [r(cfg, gemv=g, decode=d) for g in gemvs for d in (2, 3) if (g, d) != (cfg.gemv, cfg.decode)]
    out = [cfg] + [r(cfg, decode=d) for d in (0, 1, 2, 3) if d != cfg.decode]
    t = r(cfg, fragments=None)  # moe.py's tiles: what the changes below vary
    out += [r(t, up=(ubn, bk, uw, us), down=(dbn, bk, dw, ds)) for bk in (64, 128, 256) if bk != ubk]
    out += [r(t, up=(ubn, ubk, uw, st), down=(dbn, dbk, dw, st)) for st in (2, 3, 5) if st != us]
    out += [r(t, up=(bn, ubk, uw, us), down=(bn, dbk, dw, ds)) for bn in (32, 64, 128) if bn != ubn]
    out += [r(t, up=(ubn, ubk, w, us), down=(dbn, dbk, w, ds)) for w in (4, 8) if w != uw]
    if cfg.block_m >= 64:
        out += [r(cfg, block_m=bm) for bm in (64, 128) if bm != cfg.block_m] + [r(cfg, group_m=16)]
    if cfg.fragments:  # moe_fragments' tiles (up BN, warps, down BN, warps), and moe.py's
        out += [r(cfg, fragments=f) for f in ((32, 2, 64, 2), (128, 4, 64, 2), (64, 4, 128, 4), (64, 4, 64, 4), None)]
    if cfg.block_m == 32:  # the next tier's tiles, with each expansion
        out += [r(cfg, block_m=64, up=(128, 64, 4, 4), down=(128, 64, 4, 4), decode=d) for d in (0, 2, 3)]
    return out


def sweep(layer: MxLayer, tokens: list[int], iters: int) -> None:
    """Time experts_with over the candidates at each T; the fastest marked *, one line per candidate."""
    from k3backend.kernels import moe

    s = layer.s
    for T in tokens:
        x, w, ids = layer.inputs(T)
        nbytes, flops = _bytes_flops(s, T, int(torch.unique(ids).numel()))
        results = []
        chosen = moe.experts_mxfp4_config(T, s.k, s.E, s.D, s.I, *layer.scales)
        # the in-register tiles (experts_config's MXFP4 tiles where the rule expands first), and expanded first
        # (all experts, then 16 at a time), the rule's choice first
        tiles = moe.experts_config(T, s.k, s.E, s.D, s.I, mxfp4=True) if chosen.expand else chosen
        bf16 = moe.experts_config(T, s.k, s.E, s.D, s.I)
        expanded = ([dataclasses.replace(bf16, expand=e, gemv=None) for e in (s.E, 16)]
                    if tiles.block_m >= 64 or s is SMOKE else [])
        first = [chosen] if chosen.expand else []
        sets = layer.copies(int(torch.unique(ids).numel()))
        for cfg in first + [c for c in candidates(tiles) + expanded if c not in first]:
            try:
                t = timed(sets, lambda w13, w2, sc, _, __: moe.experts_with(x, w, ids, w13, w2, SITU, 1.0, cfg, sc),
                          iters)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: report, go on
                print(f"  {s.name} T{T} {cfg}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
                continue
            results.append((t, cfg))
        best = min(t for t, _ in results) if results else 0
        for t, cfg in results:
            print(f"{'*' if t == best else ' '} {s.name} T{T:<6} {t * 1e3:9.3f} ms {nbytes / t / 1e12:5.2f} TB/s "
                  f"{flops / t / 1e12:6.1f} TFLOP/s  BM{cfg.block_m} up{cfg.up} down{cfg.down} G{cfg.group_m} "
                  f"decode{cfg.decode}" + (f" fragments{cfg.fragments}" if cfg.fragments else "")
                  + (f" expand{cfg.expand}" if cfg.expand else "")
                  + (f" gemv{cfg.gemv}" if cfg.gemv else "") + f" ({len(sets)} weight sets)", flush=True)


def cases(args: argparse.Namespace) -> list[Case]:
    """bench/kernels.py --families mxfp4: the mxfp4 kernel per T; its `ref` is the bf16 kernel on the
    dequantized weights, so the table's `vs ref` column is the speed-up over it."""
    from k3backend.kernels import moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for shape in ((SMOKE,) if args.smoke else (SMALL, K3)):
        layer = MxLayer(shape, device)
        for T in ((1, 5, 61) if args.smoke else TOKENS):
            x, w, ids = layer.inputs(T)
            nbytes, flops = _bytes_flops(shape, T, int(torch.unique(ids).numel()))
            out.append(Case(family="mxfp4", name=f"experts_mxfp4_{shape.name}", shape=f"T{T}",
                            run=lambda a=layer.mx_args(x, w, ids): moe.experts_mxfp4(*a),
                            ref=lambda a=layer.bf16_args(x, w, ids): moe.experts(*a), bytes=nbytes, flops=flops,
                            check=lambda layer=layer, a=(x, w, ids): check(layer, a)))
    return out


def main(argv: list[str] | None = None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["small", "k3"], choices=["small", "k3"])
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="then time tile and expansion variants")
    ap.add_argument("--sweep-tokens", type=int, nargs="*", default=[1, 16, 64, 256, 512, 8192, 16384])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter runs of the harness)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("$ python bench/kernels_mxfp4.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"triton {triton.__version__}; ceiling {HBM_TBS} TB/s")
    shapes = [SMOKE] if args.smoke else [{"small": SMALL, "k3": K3}[n] for n in args.shapes]
    tokens = [1, 5, 61] if args.smoke else args.tokens
    rows, failed = [], False
    for shape in shapes:
        t0 = time.monotonic()
        layer = MxLayer(shape, device)
        print(f"{layer.memory()} (built in {time.monotonic() - t0:.0f} s)", flush=True)
        print(HEADER)
        rows += [layer.memory(), HEADER] + table(layer, tokens, not args.no_check, args.iters)
        if args.sweep:
            sweep(layer, [5] if args.smoke else args.sweep_tokens, args.iters)
        failed |= any("FAILED" in r for r in rows)
        del layer
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n" + "\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
