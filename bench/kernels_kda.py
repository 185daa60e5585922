"""KDA kernels at real sizes for bench/kernels.py: the fused decode step, the plain recurrent step, the
varlen conv and the chunked prefill, each beside its torch reference and fla-core.

Sizes (K3_LM §0.1): K = V = 128, conv width 4, bf16 activations, fp32 state; heads 16 (the `small`
preset), 12 (K3 at TP 8) and 96 (K3 full width). Decode at B ∈ {1, 16, 64, 256} sequences on permuted
slots of a pool with spare slots; prefill T = 8192 tokens as 2 sequences (one carrying state).
`decode_fused` is the model's call (kernels/kda.py `decode_fused_plan` picks the V split); the
`decode_fused_v{n}w{w}` rows at H 16, B ∈ {1, 16, 64, 128, 256} force n V-blocks and w warps (v1w8: one
program a head, as before the split), each checked, beside fla: the figures that set the rule.
`--smoke`: tiny sizes, for TRITON_INTERPRET=1 on a CPU.

By hand, `python bench/kernels_kda.py`:
- `--sm90`: every KDA kernel compiled for sm_90a with its registers, spills and shared memory (no GPU).
- `--tiles`: each of the chunked prefill's three kernels (intra, solve, state) timed alone over launch
  variants (its tile BKC / BC / BV, num_warps, num_stages; one change at a time from the rule's, a few tile
  x warps pairs, and the state kernel's walk, TRANS on and off), in µs per CUDA-graph replay, at TILE_SHAPES
  (one prompt of 256, 4,096 and 8,192 tokens, 4 x 256, 4 x 1,024, 16 x 32 at 16 heads; 8,192 tokens at 96
  heads; `--seqs BxL`, `--heads H` choose others; `--kernels intra` sweeps one). A table per shape and
  kernel: the rule's launch (`prefill_rule`) first, marked "(chosen)", then the others fastest first, the
  fastest marked *. Every variant runs once on the default launch's inputs with its outputs poisoned (NaN),
  and everything it writes is compared with the default launch's: the same entries written, each tensor
  within TILES_REL of its largest |value|, else the row says FAILED (and the run exits 1). `--smoke
  --tiles`: sequences of 70 and 40 tokens, one head, K = V = 32, the tiles alone, under TRITON_INTERPRET=1.

fla baselines, converted to fla's conventions and never changing ours:
- decode fused: fla's decode pipeline, five launches: `causal_conv1d_update` for q, k and v (fla's
  per-projection conv caches [B, D, W]), `fused_recurrent_kda_fwd` (the pool-indexed in-place entry of
  `fused_recurrent_kda`: ssm_state_indices, gate, l2 norms and beta sigmoid in its kernel), then the
  sigmoid-gated RMSNorm `layer_norm_gated_fwd`.
- decode: `fused_recurrent_kda_fwd` on the same prepared q, k, v, g, beta and pool.
- short conv: fla's varlen `causal_conv1d` (initial states [N, D, W] gathered per sequence).
- prefill: `chunk_kda` on prepared inputs (q, k l2-normalised in bf16, as fla's own layer feeds it).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels import Case

from k3backend.kernels import kda_ref
from k3backend.kernels.norm_ref import l2_norm

KV = 128
W = 4
LB = -5.0
REL_BF16 = 8e-3  # tests/tolerances.py KERNEL_REL_BF16: a few bf16 last bits flip at real size
REL_PREFILL = 2e-2  # chunked prefill: bf16 tensor-core products over 8192 tokens vs the fp32 reference
# (v_blocks, num_warps) of kda_decode_fused timed side by side: one program a head, then 2, 4, 8 V-blocks
DECODE_FUSED_VARIANTS = ((1, 8), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4))
# --tiles: (sequences, tokens each, heads) of the prefill, and the launch keywords each kernel is timed
# at besides the rule's (merged over the rule's: one change at a time, then tile x warps pairs)
TILE_SHAPES = ((1, 256, 16), (1, 4096, 16), (1, 8192, 16), (4, 256, 16), (4, 1024, 16), (16, 32, 16), (1, 8192, 96))
TILE_VARIANTS = {
    "intra": [*(dict(BKC=t) for t in (16, 32, 64)), *(dict(num_warps=w) for w in (1, 2, 4, 8)),
              *(dict(num_stages=s) for s in (1, 2)), dict(BKC=32, num_warps=8), dict(BKC=64, num_warps=8),
              dict(BKC=16, num_warps=2), dict(BKC=16, num_warps=1), dict(BKC=32, num_warps=1)],
    "solve": [*(dict(BC=t) for t in (16, 32, 64)), *(dict(num_warps=w) for w in (1, 2, 4, 8)),
              *(dict(num_stages=s) for s in (1, 2)), dict(BC=32, num_warps=8), dict(BC=64, num_warps=8),
              dict(BC=16, num_warps=2), dict(BC=32, num_warps=1)],
    "state": [*(dict(BV=t) for t in (8, 16, 32, 64)), *(dict(num_warps=w) for w in (2, 4, 8)),
              dict(TRANS=True, num_warps=8), dict(TRANS=False, num_warps=8), dict(TRANS=False, num_warps=4),
              *(dict(num_stages=s) for s in (1, 2, 3)), dict(BV=16, num_warps=2), dict(BV=8, num_warps=2),
              dict(BV=64, num_warps=8), dict(BV=32, num_warps=8), dict(TRANS=True), dict(TRANS=True, BV=64),
              dict(TRANS=True, BV=64, num_stages=1), dict(TRANS=True, BV=64, num_stages=2),
              dict(TRANS=True, BV=128, num_stages=1), dict(TRANS=False), dict(TRANS=False, num_stages=1),
              dict(TRANS=False, BV=32, num_stages=1)],
}
# the interpreter ignores warps and stages
SMOKE_TILE_VARIANTS = {"intra": [dict(BKC=32)], "solve": [dict(BC=32)], "state": [dict(BV=16), dict(TRANS=True)]}
TILES_REL = 1e-2  # a variant against the rule's launch: summation order and a few flipped bf16 roundings


def _fla(what: str, device: str, module: str, name: str) -> Callable | None:
    """fla-core's `name` from `module` on a GPU, or None where fla-core is not installed (said once per case):
    ours are timed without the baseline."""
    if device != "cuda":
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        print(f"  kda/{what}: fla baseline left out ({e})")
        return None


def _tried(what: str, fn: Callable[[], object] | None) -> Callable[[], object] | None:
    """fn, once it has run (our conversions to fla's conventions may not fit another fla version): a
    baseline that raises is reported and left out rather than ending the run."""
    if fn is None:
        return None
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure of the baseline: report it, time the rest
        print(f"  kda/{what}: fla baseline left out ({type(e).__name__}: {e})")
        return None
    return fn


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _assert_rel(what: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> str:
    assert not got.isnan().any(), f"{what}: NaN in the kernel's output"
    r = _rel(got, want)
    assert r <= bound, f"{what}: relative error {r:.2e} > {bound:.0e}"
    return f"{what} rel {r:.1e}"


class _Decode:
    """Fresh random decode inputs for B sequences on permuted slots 1..N-1 of pools with spare slots."""

    def __init__(self, B: int, H: int, K: int, V: int, device: str, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        bf, f32 = torch.bfloat16, torch.float32

        def r(*s: int, dtype: torch.dtype = bf, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)

        self.B, self.H, self.K, self.V = B, H, K, V
        C = 2 * H * K + H * V
        N = B + 1 + max(1, B // 4)
        self.slots = (torch.randperm(N - 1, generator=gen, device=device)[:B] + 1).to(torch.int32)
        # xqkv, z and b as the model has them: slices of one input GEMM's rows [q;k;v ; g ; f_a ; b]
        rows = r(B, C + H * V + K + H)
        xqkv, z, b = rows[:, :C], rows[:, C:C + H * V].view(B, H, V), rows[:, C + H * V + K:]
        self.args = [xqkv, r(C, W, dtype=f32, scale=0.5), r(N, W - 1, C), r(B, H, K, scale=3),
                     r(H * K, dtype=f32, scale=0.5), torch.log(1 + 15 * torch.rand(H, generator=gen, device=device)),
                     LB, b, z, 1 + r(V, scale=0.1), r(N, H, K, V, dtype=f32, scale=0.1), self.slots, 1e-5]

    def copy(self) -> list:
        """The inputs as they are (read only, strided), fresh copies of the pools the op updates."""
        return [a.clone() if i in (2, 10) else a for i, a in enumerate(self.args)]

    @property
    def state_bytes(self) -> float:
        return self.B * self.H * self.K * self.V * 4 * 2  # read + write, fp32

    @property
    def io_bytes(self) -> float:
        B, H, K, V = self.B, self.H, self.K, self.V
        C = 2 * H * K + H * V
        return 2 * (B * C + 2 * B * (W - 1) * C + B * H * K + B * H + 2 * B * H * V)  # bf16 rows, history r+w


def _decode_fused_case(B: int, H: int, label: str, device: str, variant: tuple[int, int] | None = None,
                       timed_ref: bool = True) -> Case:
    """The fused decode at B, H; `variant` (v_blocks, num_warps) forced, else the op's own rule. Every
    case checks the padding-free rows' slots of both pools and y against the reference."""
    from k3backend.kernels import kda

    d = _Decode(B, H, KV, KV, device, seed=B * 1000 + H)
    mine, ref = d.copy(), d.copy()
    knobs = dict(zip(("v_blocks", "num_warps"), variant)) if variant else {}
    name = f"decode_fused{label}" + (f"_v{variant[0]}w{variant[1]}" if variant else "")

    def check() -> str:
        a, b = d.copy(), d.copy()
        y, y_ref = kda.decode_fused_split(*a, **knobs), kda_ref.kda_decode_fused(*b)
        s = d.slots.long()
        assert torch.equal(a[2][s], b[2][s]), "conv_pool: the rows' slots differ from the reference"
        return ", ".join((_assert_rel("y", y, y_ref, REL_BF16), _assert_rel("S", a[10][s], b[10][s], REL_BF16)))

    fla = _tried(f"decode_fused B{B} H{H}", _fla_decode_fused(d, device))
    return Case("kda", name, f"B{B} H{H} K{KV} V{KV}", run=lambda: kda.decode_fused_split(*mine, **knobs),
                ref=(lambda: kda_ref.kda_decode_fused(*ref)) if timed_ref else None, fla=fla,
                bytes=d.state_bytes + d.io_bytes, check=check)


def _fla_decode_fused(d: _Decode, device: str) -> Callable[[], object] | None:
    """fla's five-launch decode on the same inputs (its own conv caches, our state pool layout)."""
    if device != "cuda":
        return None
    try:
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:  # no fla-core on this machine: time ours without it
        print(f"  kda/decode_fused: fla baseline left out ({e})")
        return None

    xqkv, w, _, f, dt_bias, A_log, lb, b, z, w_o, S_pool, si, eps = d.copy()
    b, z = b.contiguous(), z.contiguous()  # fla's views want whole tensors
    B, H, K, V = d.B, d.H, d.K, d.V
    xs = [t.contiguous() for t in xqkv.split([H * K, H * K, H * V], dim=-1)]
    ws = [t.contiguous() for t in w.split([H * K, H * K, H * V], dim=0)]
    caches = [torch.randn(B, t.shape[1], W, device=device).to(t.dtype) for t in xs]
    cu = torch.arange(B + 1, device=device, dtype=torch.long)

    def run() -> torch.Tensor:
        q, k, v = (causal_conv1d_update(x, c, weight=wt, activation="silu")[0] for x, c, wt in zip(xs, caches, ws))
        o, _ = fused_recurrent_kda_fwd(q=q.view(1, B, H, K), k=k.view(1, B, H, K), v=v.view(1, B, H, V),
                                       g=f.view(1, B, H, K), beta=b.view(1, B, H), A_log=A_log, dt_bias=dt_bias,
                                       initial_state=S_pool, inplace_final_state=True, cu_seqlens=cu,
                                       ssm_state_indices=si, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, lower_bound=lb)
        return layer_norm_gated_fwd(o.view(B * H, V), z.view(B * H, V), w_o, None, activation="sigmoid", eps=eps,
                                    is_rms_norm=True)[0]

    return run


def _prepared(B: int, H: int, K: int, V: int, device: str, seed: int) -> list[torch.Tensor]:
    """q, k (l2-normalised fp32, q scaled), v (bf16), g (lower-bounded log-decay), beta, as the model has them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q = l2_norm(r(B, H, K)) * K ** -0.5
    k = l2_norm(r(B, H, K))
    g = LB * torch.sigmoid(r(B, H, K) * 2 + 2)  # mostly slow decay, as trained gates are
    return [q, k, r(B, H, V).bfloat16(), g, torch.sigmoid(r(B, H))]


def _decode_case(B: int, H: int, device: str) -> Case:
    from k3backend.kernels import kda

    d = _Decode(B, H, KV, KV, device, seed=7 + B)
    prep = _prepared(B, H, KV, KV, device, seed=B)
    S_pool, si = d.args[10], d.slots
    mine, ref, theirs = S_pool.clone(), S_pool.clone(), S_pool.clone()

    def check() -> str:
        a, b = S_pool.clone(), S_pool.clone()
        o, o_ref = kda.kda_decode(*prep, a, si), kda_ref.kda_decode(*prep, b, si)
        return ", ".join((_assert_rel("o", o, o_ref, 1e-5), _assert_rel("S", a[si.long()], b[si.long()], 1e-5)))

    fla = None
    fused_recurrent_kda_fwd = _fla("decode", device, "fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd")
    if fused_recurrent_kda_fwd is not None:
        q, k, v, g, beta = (t[None] for t in prep)
        cu = torch.arange(B + 1, device=device, dtype=torch.long)
        fla = lambda: fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=theirs,  # noqa: E731
                                              inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=si)
    bytes_ = d.state_bytes + B * H * (3 * KV * 4 + KV * 2 + KV * 4)
    return Case("kda", "decode", f"B{B} H{H} K{KV} V{KV}", run=lambda: kda.kda_decode(*prep, mine, si),
                ref=lambda: kda_ref.kda_decode(*prep, ref, si), fla=_tried(f"decode B{B} H{H}", fla), bytes=bytes_,
                check=check)


def _varlen(T: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences, the first continuing from its slot, the second from zero: cu, slots, has_initial_state."""
    cu = torch.tensor([0, T // 4 + 3, T], dtype=torch.int32, device=device)
    return cu, torch.tensor([3, 1], dtype=torch.int32, device=device), torch.tensor([True, False], device=device)


def _short_conv_case(T: int, H: int, device: str) -> Case:
    from k3backend.kernels import kda

    gen = torch.Generator(device=device).manual_seed(T + H)
    C = 3 * H * KV
    x = torch.randn(T, C + 2 * H * KV, generator=gen, device=device).bfloat16()[:, :C]  # a slice, as in the model
    w = torch.randn(C, W, generator=gen, device=device) * 0.5
    pool = torch.randn(5, W - 1, C, generator=gen, device=device).bfloat16()
    cu, slots, has = _varlen(T, device)
    mine, ref = pool.clone(), pool.clone()

    def check() -> str:
        a, b = pool.clone(), pool.clone()
        out, out_ref = kda.short_conv(x, w, a, cu, slots, has), kda_ref.short_conv(x, w, b, cu, slots, has)
        assert torch.equal(a, b), "conv_pool differs from the reference"
        return _assert_rel("out", out, out_ref, REL_BF16)

    fla = None
    causal_conv1d = _fla("short_conv", device, "fla.modules.causal_conv1d", "causal_conv1d")
    if causal_conv1d is not None:
        h0 = torch.zeros(2, C, W, device=device, dtype=torch.bfloat16)  # fla's state: the last W inputs
        h0[0, :, 1:] = pool[3].T
        cu_long = cu.long()
        fla = lambda: causal_conv1d(x[None], w, initial_state=h0, output_final_state=True,  # noqa: E731
                                    activation="silu", cu_seqlens=cu_long)
    return Case("kda", "short_conv", f"T{T} C{C} (H{H})", run=lambda: kda.short_conv(x, w, mine, cu, slots, has),
                ref=lambda: kda_ref.short_conv(x, w, ref, cu, slots, has), fla=_tried(f"short_conv T{T} H{H}", fla),
                bytes=2 * T * C * 2, check=check, graph=False)


def _prefill_args(T: int, H: int, K: int, V: int, device: str) -> list[torch.Tensor]:
    """q, k, g, beta as the model has them (fp32), v a bf16 view into the conv output rows."""
    q, k, _, g, beta = _prepared(T, H, K, V, device, seed=T + H)
    rows = torch.randn(T, H * (2 * K + V), generator=torch.Generator(device=device).manual_seed(1), device=device)
    v = rows.bfloat16()[:, 2 * H * K:].view(T, H, V)
    return [q, k, v, g, beta]


def _prefill_case(T: int, H: int, device: str) -> Case:
    from k3backend.kernels import kda_chunk as kda

    args = _prefill_args(T, H, KV, KV, device)
    q, k, v, g, beta = args
    cu, slots, has = _varlen(T, device)
    pool = torch.randn(5, H, KV, KV, generator=torch.Generator(device=device).manual_seed(2), device=device) * 0.1
    mine, ref = pool.clone(), pool.clone()

    def check() -> str:
        a, b = pool.clone(), pool.clone()
        o, o_ref = kda.kda_prefill(*args, a, cu, slots, has), kda_ref.kda_prefill(*args, b, cu, slots, has)
        return ", ".join((_assert_rel("o", o, o_ref, REL_PREFILL),
                          _assert_rel("S", a[slots.long()], b[slots.long()], REL_PREFILL)))

    fla = None
    chunk_kda = _fla("prefill", device, "fla.ops.kda", "chunk_kda")
    if chunk_kda is not None:
        qb, kb, vb = q.bfloat16()[None], k.bfloat16()[None], v.contiguous()[None]  # fla's layer feeds bf16 q, k
        h0 = torch.stack([pool[3], torch.zeros_like(pool[3])])
        fla = lambda: chunk_kda(qb, kb, vb, g[None], beta[None], scale=1.0, initial_state=h0,  # noqa: E731
                                output_final_state=True, cu_seqlens=cu.long())
    # at least: q, k, g, o (fp32), v (bf16) and the two sequences' states read and written
    bytes_ = T * H * KV * (4 * 4 + 2) + T * H * 4 + 2 * 2 * H * KV * KV * 4
    flops = T * H * 2 * (64 * 2 * KV + 64 * 2 * KV + 3 * KV * KV + 64 * KV)  # A_kk + A_qk, w + u, state + output
    return Case("kda", "prefill", f"T{T} H{H} K{KV} V{KV}", run=lambda: kda.kda_prefill(*args, mine, cu, slots, has),
                ref=lambda: kda_ref.kda_prefill(*args, ref, cu, slots, has), fla=_tried(f"prefill T{T} H{H}", fla),
                bytes=bytes_, flops=flops, check=check, graph=False)


def cases(args: argparse.Namespace) -> list[Case]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        return [_decode_fused_case(3, 2, "", device), *(_decode_fused_case(3, 2, "", device, v, timed_ref=False)
                                                         for v in ((1, 8), (2, 4), (4, 4))),
                _decode_case(3, 2, device), _short_conv_case(40, 1, device), _prefill_case(80, 1, device)]
    keep = lambda name: args.match in f"kda/{name}"  # noqa: E731 - --match: build only what will run
    out = []
    for H, label in ((16, ""), (12, "_tp8"), (96, "")):
        out += [_decode_fused_case(B, H, label, device) for B in (1, 16, 64, 256) if keep(f"decode_fused{label}")]
    out += [_decode_fused_case(B, 16, "", device, v, timed_ref=False) for B in (1, 16, 64, 128, 256)
            for v in DECODE_FUSED_VARIANTS if keep(f"decode_fused_v{v[0]}w{v[1]}")]
    out += [_decode_case(B, 16, device) for B in (16, 256) if keep("decode")]
    out += [_short_conv_case(8192, H, device) for H in (16, 96) if keep("short_conv")]
    out += [_prefill_case(8192, H, device) for H in (12, 16, 96) if keep("prefill")]
    return out


def _tile_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest |got − want| of each pair relative to its want's largest |value|, the worst pair:
    inf where the two are not NaN (unwritten: both ran on poisoned outputs) in the same entries."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        nan = b.isnan()
        if not torch.equal(a.isnan(), nan):
            return float("inf")
        if bool(nan.all()):
            continue
        a, b = a[~nan], b[~nan]
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def _tile_verdict(err: float) -> str:
    return "ok" if err <= TILES_REL else f"FAILED (> {TILES_REL:.0e})"  # NaN fails too


def _tile_label(knobs: dict) -> str:
    """The tile, warps and stages of a launch ("s-": triton's default stages; "T": the state's TRANS walk)."""
    tile = next(f"{k}{v}" for k, v in knobs.items() if k in ("BKC", "BC", "BV"))
    return f"{tile} w{knobs['num_warps']} s{knobs.get('num_stages', '-')}" + (" T" if knobs.get("TRANS") else "")


def tiles_sweep(shapes: Sequence[tuple[Sequence[int], int]], iters: int, smoke: bool,
                kernels: Sequence[str] = tuple(TILE_VARIANTS)) -> int:
    """Time each chunked-prefill kernel alone over its launch variants at each (sequence lengths, heads)
    of `shapes`, each variant checked against the rule's launch (see the module docstring); the number
    of variants that failed their check. `kernels`: the ones swept."""
    from kernels import time_fn

    from k3backend.kernels import kda_chunk
    from k3backend.kernels.varlen import varlen_layout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dim = 32 if smoke else KV
    variants = SMOKE_TILE_VARIANTS if smoke else TILE_VARIANTS
    failures = 0
    for lens, H in shapes:
        B, T = len(lens), sum(lens)
        q, k, v, g, beta = _prefill_args(T, H, dim, dim, device)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        slots = torch.arange(1, B + 1, dtype=torch.int32, device=device)
        has = torch.ones(B, dtype=torch.bool, device=device)
        pool = torch.randn(B + 2, H, dim, dim, generator=torch.Generator(device=device).manual_seed(3),
                           device=device) * 0.1
        args = (q, k, v, g, beta)
        ok, why = kda_chunk.kda_prefill_supports(*args, pool, cu, slots, has)
        assert ok, why
        lay = varlen_layout(cu, T)

        def launches(knobs: dict | None = None) -> list:
            """Fresh buffers and a fresh copy of the pool; every output poisoned but the pool."""
            S = pool.clone()
            out = kda_chunk._prefill_launches(*args, S, cu, slots, has, lay, knobs)[1]
            for launch in out:
                for t in launch.writes:
                    if t is not S:
                        t.fill_(float("nan"))
            return out

        rule = launches()
        want = []
        for launch in rule:
            launch.run()
            want.append([t.clone() for t in launch.writes])
        assert not want[2][0].isnan().any(), "the rule's launch left NaN in o"
        seqs = f"{B}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
        print(f"== {seqs} H{H} K{dim} V{dim}: the rule's launches "
              + ", ".join(f"{r.name} {_tile_label(r.knobs)}" for r in rule), flush=True)
        for i, chosen in enumerate(rule):
            if chosen.name not in kernels:
                continue
            tried, rows = [], []
            for change in [{}] + variants[chosen.name]:
                knobs = {**chosen.knobs, **change}
                if knobs in tried:
                    continue
                tried.append(knobs)
                try:
                    mine = launches({chosen.name: knobs})
                    for launch, outs in zip(mine[:i], want):  # its inputs: the rule's outputs of the kernels before
                        for t, w in zip(launch.writes, outs, strict=True):
                            t.copy_(w)
                    mine[i].run()
                    err = _tile_err(mine[i].writes, want[i])
                    t = time_fn(mine[i].run, True, iters)
                except Exception as e:  # noqa: BLE001 - a launch that does not compile or fit: report, go on
                    print(f"  {chosen.name:<5} {_tile_label(knobs):<16} failed: {type(e).__name__}: {str(e)[:100]}",
                          flush=True)
                    failures += not change  # the rule's own launch must run
                    continue
                rows.append((t, knobs, err))
            if not rows:
                continue
            best = min(r[0] for r in rows)
            for t, knobs, err in rows[:1] + sorted(rows[1:], key=lambda r: r[0]):
                verdict = _tile_verdict(err)
                failures += verdict != "ok"
                print(f"{'*' if t == best else ' '} {chosen.name:<5} {_tile_label(knobs):<16} {t * 1e6:9.1f} us  "
                      f"err {err:.1e} {verdict}" + ("  (chosen)" if knobs == chosen.knobs else ""), flush=True)
    return failures


def compile_sm90() -> None:
    """Compile every KDA kernel at the K3 shapes for sm_90a with triton's own ptxas and print its
    registers, spills and shared memory: no GPU needed (the interpreter never compiles)."""
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3backend.kernels import kda, kda_chunk

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def build(name: str, fn, sig: dict, const: dict, num_warps: int, num_stages: int = 3) -> None:
        const = {"PDL": True, **const} if "PDL" in fn.arg_names else const  # compiled as launched on Hopper
        signature = {a: "constexpr" if a in const else sig[a] for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig.get(a, "").startswith("*")}
        k = triton.compile(ASTSource(fn, signature, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # the cubin's own figures: no second ptxas run
            f.write(k.asm["cubin"])
            f.flush()
            out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, check=True).stdout
        usage = dict(re.findall(r"(REG|STACK):(\d+)", out))
        print(f"{name:<34} {num_warps} warps  {usage['REG']:>3} registers  stack {usage['STACK']:>3} B (spills)  "
              f"smem {k.metadata.shared} B")

    H, K = 16, KV
    C = 3 * H * K
    bf = dict(ACC=tl.float32, DOT=tl.bfloat16, PREC="tf32", BITS=False)
    p = lambda names, t: dict.fromkeys(names.split(), t)  # noqa: E731
    fused = {**p("xqkv conv_pool f f_b b z o_norm_weight y", "*bf16"),
             **p("conv_weight dt_bias A_log S_pool", "*fp32"), "state_indices": "*i32", **p("s_x s_b s_z s_f", "i32")}
    for nv, warps in DECODE_FUSED_VARIANTS:
        for fb in (False, True):  # f_b_proj's GEMV before the kernel, or in it (rank K: K3's f_a width)
            build(f"kda_decode_fused v{nv}" + " f_b" * fb, kda._kda_decode_fused_kernel, fused,
                  dict(H=H, K=K, V=K, W=W, BK=K, BV=K // nv, BW=W, NV=nv, SPLIT=nv > 1, F_B=fb, R=K, BR=K,
                       USE_LOWER_BOUND=True, LOWER_BOUND=LB, SCALE=K ** -0.5, EPS=1e-5, ACC=tl.float32, BITS=False),
                  warps)
    build("kda_decode_fused norm", kda._kda_decode_norm_kernel, fused,
          dict(H=H, K=K, V=K, W=W, BK=K, BV=K, BW=W, EPS=1e-5, ACC=tl.float32, BITS=False), 4)
    build("kda_decode", kda._kda_decode_kernel, {**p("q k g beta S_pool o", "*fp32"), "v": "*bf16",
                                                 "state_indices": "*i32"},
          dict(H=H, K=K, V=K, BK=K, BV=32, ACC=tl.float32), 4)
    conv = {**p("x conv_pool out", "*bf16"), "weight": "*fp32", **p("seq_ids cu_seqlens state_indices", "*i32"),
            "has_initial_state": "*i1", "T": "i32", "s_x": "i32"}
    build("short_conv", kda._short_conv_kernel, conv, dict(C=C, W=W, BT=16, BC=128, ACC=tl.float32, BITS=False), 4)
    build("short_conv history", kda._short_conv_history_kernel, conv, dict(C=C, W=W, BW=W, BC=128), 4)
    build("kda_prefill inputs", kda_chunk._kda_inputs_kernel,
          {**p("q k f b", "*bf16"), **p("dt_bias A_log q_out k_out g_out beta_out", "*fp32"),
           **p("T s_q s_k s_f s_b", "i32")},
          dict(H=H, K=K, BK=K, ROWS=16, SCALE=K ** -0.5, USE_LOWER_BOUND=True, LOWER_BOUND=LB, ACC=tl.float32), 4)
    idx = {"chunk_seq": "*i32", "chunk_start": "*i64", "cu_seqlens": "*i32", "state_indices": "*i32"}
    for chunks in (1, 1024 // H):  # the rule's two launches: below and from 1,024 chunk·heads
        rule = kda_chunk.prefill_rule(K, K, 1, H, chunks, 132)
        build("kda_prefill intra", kda_chunk._kda_intra_kernel,
              {**p("q k g beta Akk gl", "*fp32"), **p("Aqk kb qg kg", "*bf16"), **idx,
               **p("stride_q stride_k stride_g", "i32")}, dict(H=H, K=K, BKC=rule["intra"]["BKC"], **bf),
              rule["intra"]["num_warps"])
        build("kda_prefill solve", kda_chunk._kda_solve_kernel,
              {**p("Akk beta", "*fp32"), **p("kb v w u", "*bf16"), **idx, "stride_v": "i32"},
              dict(H=H, K=K, V=K, BC=rule["solve"]["BC"], **bf), rule["solve"]["num_warps"])
    state = {**p("w u qg kg Aqk", "*bf16"), **p("gl S_pool o", "*fp32"), **p("state_indices cu_seqlens", "*i32"),
             "has_initial_state": "*i1", "first_chunk": "*i64", "chunk_snapshot": "*i32"}
    for stages, bv in ((1, 32), (3, 32), (1, 64), (3, 64), (2, 64)):  # prefill_rule's V blocks and stages
        for snap in (False, True):
            for trans in (False, True):
                build(f"kda_prefill state (BV {bv}, {stages} stage{', snapshots' if snap else ''}"
                      f"{', transposed' if trans else ''})", kda_chunk._kda_state_kernel, state,
                      dict(H=H, K=K, V=K, BK=K, BV=bv, SNAP=snap, TRANS=trans, **bf), 4, stages)


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(description="KDA kernels by hand: --sm90 or --tiles (the timed cases run through "
                                             "bench/kernels.py --families kda)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sm90", action="store_true", help="compile every KDA kernel for sm_90a (no GPU needed)")
    mode.add_argument("--tiles", action="store_true", help="the chunked prefill's kernels over launch variants")
    ap.add_argument("--seqs", nargs="*", metavar="BxL", help="--tiles: B sequences of L tokens (default TILE_SHAPES)")
    ap.add_argument("--heads", type=int, nargs="*", help="--tiles: heads (with --seqs, or the default sequences)")
    ap.add_argument("--iters", type=int, default=50, help="--tiles: graph replays timed per variant")
    ap.add_argument("--kernels", nargs="*", default=list(TILE_VARIANTS), choices=list(TILE_VARIANTS),
                    help="--tiles: the kernels swept (default all three)")
    ap.add_argument("--smoke", action="store_true", help="--tiles: tiny sizes (TRITON_INTERPRET=1 on a CPU)")
    a = ap.parse_args()
    if a.sm90:
        compile_sm90()
        sys.exit()
    if not a.smoke and not torch.cuda.is_available():
        ap.error("--tiles: no GPU here; --smoke runs tiny sizes under TRITON_INTERPRET=1")
    import triton

    print("$ python bench/kernels_kda.py " + " ".join(sys.argv[1:]))
    print(f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    if a.smoke:
        shapes = [([70, 40], 1)]
    elif a.seqs or a.heads:
        seqs = ([tuple(map(int, s.split("x"))) for s in a.seqs] if a.seqs
                else [(b, n) for b, n, h in TILE_SHAPES if h == 16])
        shapes = [([n] * b, h) for b, n in seqs for h in a.heads or [16]]
    else:
        shapes = [([n] * b, h) for b, n, h in TILE_SHAPES]
    sys.exit(1 if tiles_sweep(shapes, a.iters, a.smoke, a.kernels) else 0)
