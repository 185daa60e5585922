"""The Triton KDA kernels (kernels/kda.py, kda_chunk.py) equal their torch references (kernels/kda_ref.py).

Every check runs under TRITON_INTERPRET=1 in one child process (tests/interpret.py) with
K3_KERNELS=triton, at small odd sizes (K = 12, V = 10 pad to 16-wide tiles): varlen batches, slots in
a permuted order, zero and carried state, padding rows pointing at the null slot 0. Outputs are
poisoned (`interpret.poisoned_empty`: NaN, and a NaN guard past the end that no store may reach),
pool slots no row uses hold NaN, and every element is compared: the rows' slots against the
reference, the other slots against their NaN sentinels. Slot 0 is not compared (rows pointing at it
may scribble it, the contract allows that), except by the fused decode, whose kernels write no pool
for such rows: there slot 0 must come back as it was. The fused decode runs at every V split
(`v_blocks` 1, 2, 4, 8), also at K = V = 128, where the rule's blocks are 64 columns.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import pytest
import torch

from interpret import Cases, Checks, poisoned_empty
from tolerances import KERNEL, KERNEL_PREFILL

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
H, K, V, W, N = 3, 12, 10, 4, 9  # heads, key dim, value dim, conv width, pool slots
RULE_V_BLOCKS = 2  # what the rule picks at K = V = 128 (blocks of 64 columns)
SLOTS = [7, 2, 5, 3]  # the real rows' slots, permuted; slot 5 starts from zero state and history
UNUSED = [1, 4, 6, 8]  # slots no row points at: NaN sentinels


# ---------------------------------------------------------------- helpers (run in the child)
def acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def pool(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, fresh: list[int]) -> torch.Tensor:
    """A pool with random carried slots, zeroed `fresh` slots and NaN in the UNUSED ones."""
    p = rand(gen, *shape, scale=0.5).to(dtype)
    p[fresh] = 0
    p[UNUSED] = math.nan
    return p


def clone_all(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def assert_slots(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, slots: list[int], tol: dict,
                 what: str) -> None:
    """The rows' slots close to the reference; every slot no row uses unchanged (NaN sentinels)."""
    torch.testing.assert_close(got[slots], want[slots], **tol, msg=lambda m: f"{what}, the rows' slots: {m}")
    assert torch.equal(got[UNUSED].isnan(), before[UNUSED].isnan()), f"{what}: a slot no row uses was written"


def row_slice(t: torch.Tensor, extra: int = 5) -> torch.Tensor:
    """t's values as the rows of a wider buffer with NaN between them: the slices of the layer's one
    input GEMM that the ops take (a kernel that ignores the row stride reads NaN)."""
    n = t[0].numel()
    wide = torch.full((t.shape[0], n + extra), float("nan"), dtype=t.dtype)
    wide[:, :n] = t.reshape(t.shape[0], n)
    return wide[:, :n].view(t.shape)


def row_slots(pad: int) -> torch.Tensor:
    return torch.tensor(SLOTS + [0] * pad, dtype=torch.int32)


# ---------------------------------------------------------------- checks (run in the child)
def check_kda_decode_fused(dtype: str, lower_bound: float | None, seed: int, v_blocks: int | None = None,
                           kv: int | None = None, heads: int = H, rank: int | None = None, pad: int = 2,
                           fb_rows: int = 8) -> None:
    """The op with `v_blocks` (None: the rule's choice; > 1: the V-split and its norm launch) against the
    reference. kv: K = V = kv (the model's 128: the split's real block width) instead of the odd 12, 10.
    rank: f is f_a's rows [B, rank] (a slice of the input GEMM's) with f_b_weight [H·K, rank], the gate's GEMV
    in the kernel (B ≤ fb_rows, this call's limit: the kernel's path at more rows than the rule's) or before it.
    Rows on slot 0 (padding) must leave slot 0 of both pools as it was."""
    from k3backend.kernels import kda, kda_ref

    dt = DTYPES[dtype]
    a = acc(dt)
    Kd, Vd = (kv, kv) if kv else (K, V)
    gen = torch.Generator().manual_seed(seed)
    C = 2 * heads * Kd + heads * Vd
    si = row_slots(pad=pad)  # padding rows on the null slot
    B = si.shape[0]
    args = [rand(gen, B, C).to(dt), rand(gen, C, W, scale=0.5).to(a), pool(gen, (N, W - 1, C), dt, fresh=[5]),
            rand(gen, B, heads, Kd, scale=3).to(dt), rand(gen, heads * Kd, scale=0.5).to(a),
            torch.log(1 + 15 * torch.rand(heads, generator=gen, dtype=torch.float64)).to(a), lower_bound,
            rand(gen, B, heads).to(dt), rand(gen, B, heads, Vd).to(dt), (1 + 0.1 * rand(gen, Vd)).to(dt),
            pool(gen, (N, heads, Kd, Vd), a, fresh=[5]), si, 1e-5]
    low = {}
    if rank:
        args[3] = rand(gen, B, rank).to(dt)
        low = {"f_b_weight": rand(gen, heads * Kd, rank, scale=3 * rank ** -0.5).to(dt)}
    for i in (0, 7, 8) + ((3,) if rank else ()):  # xqkv, b, z (f_a): slices of the input GEMM's rows
        args[i] = row_slice(args[i])
    ref = clone_all(args)
    before_conv, before_S = args[2].clone(), args[10].clone()
    limit, kda.F_B_MAX_ROWS = kda.F_B_MAX_ROWS, fb_rows
    try:
        with poisoned_empty():
            y = kda.decode_fused_split(*args, v_blocks=v_blocks, **low)
    finally:
        kda.F_B_MAX_ROWS = limit
    y_ref = kda_ref.kda_decode_fused(*ref, **low)
    torch.testing.assert_close(y, y_ref, **KERNEL[dt], msg=lambda m: f"y (every row, padding rows too): {m}")
    assert_slots(args[10], ref[10], before_S, SLOTS, KERNEL[a], "S_pool")
    assert_slots(args[2], ref[2], before_conv, SLOTS, {"rtol": 0.0, "atol": 0.0}, "conv_pool")
    assert torch.equal(args[10][0], before_S[0]), "S_pool: a padding row (slot 0) wrote its slot"
    assert torch.equal(args[2][0], before_conv[0]), "conv_pool: a padding row (slot 0) wrote its slot"


def check_kda_decode(dtype: str, seed: int) -> None:
    from k3backend.kernels import kda, kda_ref, norm_ref

    a = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    si = row_slots(pad=1)
    B = si.shape[0]
    Vd = 37  # two V-blocks of 32, the second ragged
    q = (norm_ref.l2_norm(rand(gen, B, H, K)) * K ** -0.5).to(a)
    k = norm_ref.l2_norm(rand(gen, B, H, K)).to(a)
    g = (-5 * torch.sigmoid(rand(gen, B, H, K))).to(a)
    args = [q, k, rand(gen, B, H, Vd).to(a), g, torch.rand(B, H, generator=gen, dtype=torch.float64).to(a),
            pool(gen, (N, H, K, Vd), a, fresh=[5]), si]
    ref = clone_all(args)
    before = args[5].clone()
    with poisoned_empty():
        o = kda.kda_decode(*args)
    torch.testing.assert_close(o, kda_ref.kda_decode(*ref), **KERNEL[a], msg=lambda m: f"o: {m}")
    assert_slots(args[5], ref[5], before, SLOTS, KERNEL[a], "S_pool")


def check_short_conv(dtype: str, seed: int) -> None:
    from k3backend.kernels import kda, kda_ref

    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    C = 37
    lens = [5, 1, 30, 2]  # three token blocks of 16; chunks shorter than W−1 shift the history
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    has = torch.tensor([True, True, False, True])
    slots = [7, 2, 5, 3]
    args = [row_slice(rand(gen, sum(lens), C).to(dt)), rand(gen, C, W, scale=0.5).to(acc(dt)),
            pool(gen, (N, W - 1, C), dt, fresh=[]), cu, torch.tensor(slots, dtype=torch.int32), has]
    ref = clone_all(args)
    before = args[2].clone()
    with poisoned_empty():
        out = kda.short_conv(*args)
    torch.testing.assert_close(out, kda_ref.short_conv(*ref), **KERNEL[dt], msg=lambda m: f"out: {m}")
    assert_slots(args[2], ref[2], before, slots, {"rtol": 0.0, "atol": 0.0}, "conv_pool")


def check_kda_prefill(dtype: str, gate: str, seed: int, heads: int = 2, kdim: int = 20, vdim: int = V,
                      trans: bool = False, state_bv: int | None = None) -> None:
    """Varlen chunks: one over a chunk boundary with a short last chunk (and a prefix snapshot at that
    boundary, into slot 3), a single token, a fresh one, and padding (a sequence on the null slot 0,
    as a captured graph's unused places: zero output, slot 0 untouched). v is a strided view (the model's is a slice of the conv output). dtype is v's (the model's); q, k,
    g, beta and the state are in its accumulation dtype. `steep`: a softplus-like gate whose Γ drops by
    more than 80 within 16 rows, so the diagonal blocks take the elementwise path. `lb5` drops by about
    40 over 16 rows, which hides what one 16-row block contributes to the next but one; `gentle` (about
    3 over a chunk) shows every block's terms. The default K = 20
    gives the intra kernel two channel slices of 16, the second ragged; heads 22 at K = V = 64 take
    `prefill_rule`'s wide tiles (64 channels a slice, V blocks of 64 once B·H ≥ 64). trans: the state kernel's
    transposed walk (its TRANS knob); state_bv: its V blocks (the rule's narrow ones, several a head)."""
    from k3backend.kernels import kda_chunk, kda_ref, norm_ref, varlen

    dt = DTYPES[dtype]
    a = acc(dt)
    gen = torch.Generator().manual_seed(seed)
    H, K, V = heads, kdim, vdim
    if kdim >= 64:
        rule = kda_chunk.prefill_rule(K, V, 4, H, 4, 132)
        assert (rule["intra"]["BKC"], rule["solve"]["BC"], rule["state"]["BV"]) == (64, 64, 64 if 4 * H >= 64 else 32)
    lens = [65, 1, 14, 20]  # the first ends in a one-row chunk; the last is padding
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots, has = [7, 2, 5, 0], torch.tensor([True, True, False, False])
    q = (norm_ref.l2_norm(rand(gen, T, H, K)) * K ** -0.5).to(a)
    k = norm_ref.l2_norm(rand(gen, T, H, K)).to(a)
    rows = rand(gen, T, 2 * H * V + 3).to(dt)
    v = rows[:, 3:3 + H * V].view(T, H, V)
    g = {"lb5": lambda: -5 * torch.sigmoid(2 * rand(gen, T, H, K)),
         "gentle": lambda: -0.1 * torch.sigmoid(2 * rand(gen, T, H, K)),
         "steep": lambda: -8 * torch.exp(2 * rand(gen, T, H, K))}[gate]()
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64).to(a)
    args = [q, k, v, g.to(a), beta, pool(gen, (N, H, K, V), a, fresh=[]), cu, torch.tensor(slots, dtype=torch.int32),
            has]
    # a prefix snapshot inside the first sequence, after its first KDA chunk, into slot 3
    table, ends, snap_slots = varlen.snapshot_tables(lens, [[(64, 3)], [], [], []], varlen.num_chunks(T, len(lens)))
    layout = varlen.varlen_layout(cu, T, snapshots=(torch.tensor(table, dtype=torch.int32), torch.tensor(ends),
                                                    torch.tensor(snap_slots)))
    ref = clone_all(args)
    before = args[5].clone()
    with poisoned_empty():
        if trans:
            knobs = {"TRANS": True} if state_bv is None else {"TRANS": True, "BV": state_bv}
            o, launches = kda_chunk._prefill_launches(*args, layout=layout, knobs={"state": knobs})
            for launch in launches:
                launch.run()
        else:
            o = kda_chunk.kda_prefill(*args, layout=layout)
    torch.testing.assert_close(o, kda_ref.kda_prefill(*ref, layout=layout), **KERNEL_PREFILL[dt],
                               msg=lambda m: f"o: {m}")
    assert torch.equal(o[T - lens[-1]:], torch.zeros_like(o[T - lens[-1]:])), "padding: o not zero"
    assert_slots(args[5], ref[5], before, slots[:-1] + [3], KERNEL_PREFILL[dt], "S_pool")
    assert torch.equal(args[5][0], before[0]) and torch.equal(ref[5][0], before[0]), "padding wrote slot 0"


def check_kda_prefill_inputs(dtype: str, lower_bound: float | None, seed: int) -> None:
    """q̂, k̂, g and β of 37 tokens (two 16-row blocks and a ragged third) from row-strided slices, as the
    layer passes them (q and k columns of the conv output, f and b of the input GEMM's rows)."""
    from k3backend.kernels import kda_chunk, kda_ref

    dt = DTYPES[dtype]
    a = acc(dt)
    gen = torch.Generator().manual_seed(seed)
    T = 37
    qk = row_slice(rand(gen, T, 2, H, K, scale=2).to(dt))
    q, k = qk[:, 0], qk[:, 1]
    f, b = row_slice(rand(gen, T, H, K, scale=3).to(dt)), row_slice(rand(gen, T, H, scale=2).to(dt))
    args = [q, k, f, b, rand(gen, H * K, scale=0.5).to(a),
            torch.log(1 + 15 * torch.rand(H, generator=gen, dtype=torch.float64)).to(a), lower_bound, K ** -0.5]
    ok, why = kda_chunk.kda_prefill_inputs_supports(*args)
    assert ok, why
    with poisoned_empty():
        got = kda_chunk.kda_prefill_inputs(*args)
    for name, x, y in zip(("q", "k", "g", "beta"), got, kda_ref.kda_prefill_inputs(*args)):
        assert x.dtype == y.dtype == a, f"{name}: {x.dtype}, reference {y.dtype}"
        torch.testing.assert_close(x, y, **KERNEL[a], msg=lambda m: f"{name}: {m}")


def check_layer_steps(dtype: str) -> None:
    """A KDA layer over prefill, decode and mixed steps: with every registered fast op (each call must be
    accepted by its verifier, and each op must run) it equals the same steps on the references."""
    from k3backend import kernels
    from k3backend.checkpoint import RUNTIME_FP32_PARAMS
    from k3backend.config import K3Config
    from k3backend.model.kda import KDA
    from k3backend.presets import preset_config
    from poolutil import Streams

    dt = DTYPES[dtype]
    cfg = dataclasses.replace(K3Config.from_dict(preset_config("tiny")).text, v_head_dim=12)
    torch.manual_seed(5)
    layer = KDA(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.5 * torch.randn(p.shape))
    layer = layer.to(dt)
    for name, p in layer.named_parameters():  # the loader keeps these fp32 (checkpoint.param_dtype)
        if name.endswith(RUNTIME_FP32_PARAMS):
            p.data = p.data.to(acc(dt))
    steps = [([5, 3, 0], 0), ([1, 1, 0], 2), ([1, 1, 7], 2), ([1, 1, 1], 3)]  # (lens, num_decode)
    x = torch.randn(sum(sum(lens) for lens, _ in steps), cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    calls = dict.fromkeys(kernels.FAST_OPS, 0)
    refs = {name: getattr(kernels, name).__wrapped__ for name in kernels.FAST_OPS}

    def accepted(name: str):
        mod = importlib.import_module(kernels.FAST_OPS[name])

        def op(*args, **kwargs):
            ok, reason = getattr(mod, f"{name}_supports")(*args, **kwargs)
            if not ok and name == "linear":  # by design a kernel for decode rows only (cuBLAS above)
                return refs[name](*args, **kwargs)
            assert ok, f"{name} declines the model's call: {reason}"
            calls[name] += 1
            return getattr(mod, name)(*args, **kwargs)
        return op

    outs, dispatchers = {}, {name: getattr(kernels, name) for name in kernels.FAST_OPS}
    for mode in ("triton", "ref"):
        for name in kernels.FAST_OPS:
            setattr(kernels, name, accepted(name) if mode == "triton" else refs[name])
        streams, ys, t = Streams([layer], 3, 16, dtype=dt), [], 0
        with torch.no_grad():
            for lens, nd in steps:
                batch = streams.batch(lens, num_decode=nd)
                ys.append(layer(x[t:t + batch.num_tokens].to(dt), batch, streams.cache))
                t += batch.num_tokens
        outs[mode] = (torch.cat(ys), streams.cache.state, streams.cache.conv)
    for name, op in dispatchers.items():
        setattr(kernels, name, op)
    unused = [name for name in ("kda_decode_fused", "short_conv", "kda_prefill_inputs", "kda_prefill", "linear")
              if not calls[name]]
    assert not unused, f"the layer never called {unused}"
    (y, S, conv), (y_ref, S_ref, conv_ref) = outs["triton"], outs["ref"]
    torch.testing.assert_close(y, y_ref, **KERNEL_PREFILL[dt], msg=lambda m: f"layer output: {m}")
    torch.testing.assert_close(S[1:], S_ref[1:], **KERNEL_PREFILL[dt], msg=lambda m: f"S_pool: {m}")  # slot 0: null
    # the raw projections (linear's GEMV at decode rows sums in another order than the reference)
    torch.testing.assert_close(conv[1:], conv_ref[1:], **KERNEL_PREFILL[dt], msg=lambda m: f"conv_pool: {m}")


CASES: Cases = {
    # every split of V (1: one program a head; 2, 4, 8: blocks of 8, 4, 2 of the 16-wide tile, the last ragged)
    **{f"decode_fused-{d}-{gate}-v{nv}": ("check_kda_decode_fused",
                                          {"dtype": d, "lower_bound": lb, "seed": i, "v_blocks": nv})
       for i, (d, (gate, lb), nv) in enumerate((d, g, nv) for d in DTYPES for g in (("lb5", -5.0), ("softplus", None))
                                               for nv in (1, 2, 4, 8))},
    # K = V = 128: the rule's choice at the bench's shapes (the model's calls) and the other splits the bench times
    **{f"decode_fused-k128-{d}-v{nv}": ("check_kda_decode_fused", {"dtype": d, "lower_bound": -5.0, "seed": 60 + i,
                                                                   "v_blocks": nv, "kv": 128, "heads": 2})
       for i, (d, nv) in enumerate((d, nv) for d in ("fp32", "bf16")
                                   for nv in (1, RULE_V_BLOCKS, 4, 8))},
    # f_b_proj in the kernel (6 rows under a limit of 8): an odd rank (a ragged 32-column step), the model's 128
    # at K = V = 128; and 10 rows past the limit (the GEMM first)
    **{f"decode_fused-fb-{d}-r{r}-b{4 + pad}": ("check_kda_decode_fused",
                                               {"dtype": d, "lower_bound": -5.0, "seed": 70 + i, "rank": r, "pad": pad,
                                                **({"kv": 128, "heads": 2} if r == 128 else {})})
       for i, (d, r, pad) in enumerate((("fp64", 37, 2), ("bf16", 37, 2), ("bf16", 128, 2), ("bf16", 37, 6)))},
    # 6 rows past a limit of 2: the `linear` op (its GEMV) first, as the rule runs 3-8 rows
    "decode_fused-fb-bf16-r37-b6-linear": ("check_kda_decode_fused", {"dtype": "bf16", "lower_bound": -5.0, "seed": 74,
                                                                      "rank": 37, "pad": 2, "fb_rows": 2}),
    **{f"decode-{d}": ("check_kda_decode", {"dtype": d, "seed": 20 + i}) for i, d in enumerate(("fp64", "fp32"))},
    **{f"short_conv-{d}": ("check_short_conv", {"dtype": d, "seed": 30 + i}) for i, d in enumerate(DTYPES)},
    **{f"prefill-{d}-{gate}": ("check_kda_prefill", {"dtype": d, "gate": gate, "seed": 40 + i})
       for i, (d, gate) in enumerate((("fp64", "lb5"), ("fp64", "steep"), ("bf16", "lb5"), ("fp64", "gentle"),
                                      ("bf16", "gentle")))},
    "prefill-bf16-tiles": ("check_kda_prefill", {"dtype": "bf16", "gate": "lb5", "seed": 43, "heads": 22, "kdim": 64,
                                                 "vdim": 64}),
    **{f"prefill-{d}-trans": ("check_kda_prefill", {"dtype": d, "gate": "gentle", "seed": 47, "trans": True})
       for d in ("fp64", "bf16")},
    "prefill-bf16-trans-bv16": ("check_kda_prefill", {"dtype": "bf16", "gate": "gentle", "seed": 48, "vdim": 40,
                                                      "trans": True, "state_bv": 16}),
    **{f"inputs-{d}-{gate}": ("check_kda_prefill_inputs", {"dtype": d, "lower_bound": lb, "seed": 50 + i})
       for i, (d, (gate, lb)) in enumerate((d, g) for d in DTYPES for g in (("lb5", -5.0), ("softplus", None))
                                           if d != "fp32" or g[1] is not None)},
    "layer-fp32": ("check_layer_steps", {"dtype": "fp32"}),
}


CHECKS = Checks(__file__, env={"K3_KERNELS": "triton"}, cases=CASES)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    return CHECKS.results()


def _cases(prefix: str) -> list[str]:
    return [c for c in CASES if c.startswith(prefix + "-")]


@pytest.mark.parametrize("case", _cases("decode_fused"))
def test_kda_decode_fused_matches_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", _cases("decode"))
def test_kda_decode_matches_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", _cases("short_conv"))
def test_short_conv_matches_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", _cases("prefill"))
def test_kda_prefill_matches_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", _cases("inputs"))
def test_kda_prefill_inputs_match_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", _cases("layer"))
def test_kda_layer_steps_through_fast_ops_equal_reference(case, interpreted):
    assert interpreted[case] is None, interpreted[case]


# ---------------------------------------------------------------- verifiers (this process, no kernel runs)
def _decode_fused_args(K: int = 12, V: int = 10, conv_dtype: torch.dtype = torch.float32) -> list:
    B, C = 2, 2 * H * K + H * V
    bf, f32 = torch.bfloat16, torch.float32
    return [torch.zeros(B, C, dtype=bf), torch.zeros(C, W, dtype=conv_dtype), torch.zeros(N, W - 1, C, dtype=bf),
            torch.zeros(B, H, K, dtype=bf), torch.zeros(H * K), torch.zeros(H), -5.0, torch.zeros(B, H, dtype=bf),
            torch.zeros(B, H, V, dtype=bf), torch.ones(V, dtype=bf), torch.zeros(N, H, K, V, dtype=f32),
            torch.ones(B, dtype=torch.int32), 1e-5]


@pytest.mark.parametrize("args, reason", [
    pytest.param(_decode_fused_args(conv_dtype=torch.bfloat16), "conv_weight: expected float32 [102, 4], got bfloat16",
                 id="bf16_conv_weight"),
    pytest.param(_decode_fused_args(K=256, V=128), "state tile K×V = 256×128 is larger than one program holds",
                 id="tile_too_large"),
])
def test_kda_decode_fused_declines_what_it_cannot_run_and_says_why(args, reason):
    from k3backend.kernels import kda

    ok, why = kda.kda_decode_fused_supports(*args)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="kda_decode_fused: "):
        kda.kda_decode_fused(*args)


@pytest.mark.parametrize("f, f_b_weight, reason", [
    ((2, 12), (H * 12, 11), "f_b_weight: expected bfloat16 [36, 12], got"),
    ((2, 300), (H * 12, 300), "f_a's width 300 > 256"),
    ((2, H, 12), (H * 12, 12), "expected f [B, R]"),
    ((2, 12), (H * 12, 12, 1), "f_b_weight [H·K, R]"),
], ids=["rank_mismatch", "rank_too_wide", "f_not_rows", "weight_3d"])
def test_kda_decode_fused_with_f_b_declines_what_it_cannot_run_and_says_why(f, f_b_weight, reason):
    """With f_b_weight, f is f_a's rows [B, R] and the weight [H·K, R] of the model dtype, R at most 256."""
    from k3backend.kernels import kda

    args = _decode_fused_args()
    args[3] = torch.zeros(*f, dtype=torch.bfloat16)
    w = torch.zeros(*f_b_weight, dtype=torch.bfloat16)
    ok, why = kda.kda_decode_fused_supports(*args, f_b_weight=w)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="kda_decode_fused: "):
        kda.kda_decode_fused(*args, f_b_weight=w)
    args[3] = torch.zeros(2, 12, dtype=torch.bfloat16)
    ok, why = kda.kda_decode_fused_supports(*args, f_b_weight=torch.zeros(H * 12, 12, dtype=torch.bfloat16))
    assert ok or why.startswith("tensors on cpu"), why  # the shapes themselves pass (only the device may not)


def test_kda_decode_fused_rule_splits_v_in_blocks_of_64():
    """The model's calls take the rule's v_blocks and warps; the interpreter cases above check those at K = V = 128."""
    from k3backend.kernels import kda

    assert [kda.decode_fused_plan(v) for v in (10, 64, 128, 256)] == [1, 1, RULE_V_BLOCKS, 4]
    assert kda.decode_fused_warps(128, 128, RULE_V_BLOCKS) == 4 and kda.decode_fused_warps(128, 128, 1) == 8


@pytest.mark.parametrize("lens, heads, want", [
    # (intra warps, solve warps, state BV, state stages, state TRANS) as measured best (prefill_rule's docstring)
    ([256], 16, (4, 4, 32, 3, False)), ([4096], 16, (1, 2, 16, 3, True)), ([256] * 4, 16, (4, 4, 64, 3, False)),
    ([1024] * 4, 16, (1, 2, 64, 3, False)), ([32] * 16, 16, (4, 4, 64, 2, True)), ([8192], 96, (1, 2, 64, 2, True)),
    ([2048] * 4, 12, (1, 2, 64, 2, True)), ([8192], 12, (1, 2, 16, 3, True)), ([2048], 12, (4, 4, 32, 3, False))])
def test_kda_prefill_rule_takes_the_measured_launches(lens, heads, want):
    from k3backend.kernels import kda_chunk, varlen

    NC = varlen.num_chunks(sum(lens), len(lens))
    rule = kda_chunk.prefill_rule(128, 128, len(lens), heads, NC, 132)
    assert (rule["intra"]["num_warps"], rule["solve"]["num_warps"], rule["state"]["BV"],
            rule["state"]["num_stages"], rule["state"]["TRANS"]) == want
    assert (rule["intra"]["BKC"], rule["solve"]["BC"]) == (32 if want[0] == 1 else 64, 64)


@pytest.mark.parametrize("lens, heads, launch", [
    ([8192], 12, (16, 8, True)), ([4096], 16, (16, 8, True)), ([4096] * 2, 16, (32, 8, True)),
    ([4096] * 2, 12, (32, 8, True)), ([2048], 16, (32, 4, False)), ([256], 16, (32, 4, False)),
    ([1024] * 4, 16, (64, 4, False)), ([2048] * 4, 12, (64, 4, True)), ([8192], 96, (64, 4, True))])
def test_kda_prefill_rule_gives_long_sequences_narrow_v_blocks_on_8_warps_within_one_wave(lens, heads, launch):
    """(state BV, warps, TRANS): the transposed walk on 8 warps with V blocks of 16, else 32, where those programs
    fit one wave of 132 SMs and the sequences are long (64 chunks or more): 15-25 % faster at 12 and 16 heads of 1 x
    4,096 / 8,192 and 2 x 4,096 tokens; shorter sequences and fuller grids keep their launches (prefill_rule's
    docstring)."""
    from k3backend.kernels import kda_chunk, varlen

    NC = varlen.num_chunks(sum(lens), len(lens))
    state = kda_chunk.prefill_rule(128, 128, len(lens), heads, NC, 132)["state"]
    assert (state["BV"], state["num_warps"], state["TRANS"]) == launch, state


def test_kda_prefill_rule_leaves_a_graphs_padding_sequence_out():
    """A captured graph's layout marks its padding sequence (padding_last), which does no work (it is on
    the null slot); kda_prefill's launch rule counts the other sequences: a mixed graph of 4 chunk places
    takes the 4-sequence state launch (3 stages), not the 5-sequence one (past one wave: the transposed walk)."""
    from k3backend.kernels import kda_chunk, varlen

    lens, H, K = [256, 1, 1, 1, 16], 16, 128
    T, B = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = k = g = torch.zeros(T, H, K)
    args = (q, k, torch.zeros(T, H, K, dtype=torch.bfloat16), g, torch.zeros(T, H), torch.zeros(2, H, K, K), cu,
            torch.tensor([1, 0, 0, 0, 0], dtype=torch.int32), torch.zeros(B, dtype=torch.bool))
    nc = varlen.num_chunks(T, B)
    knobs = {}
    for padded in (True, False):
        _, launches = kda_chunk._prefill_launches(*args, layout=varlen.varlen_layout(cu, T, padding_last=padded))
        knobs[padded] = launches[2].knobs
        assert knobs[padded] == kda_chunk.prefill_rule(K, K, B - padded, H, nc, 132)["state"]
    assert (knobs[True]["num_stages"], knobs[True]["TRANS"], knobs[False]["TRANS"]) == (3, False, True), knobs


@pytest.mark.parametrize("v_blocks, reason", [(3, "v_blocks = 3: expected a power of two from 1 to 16"),
                                               (32, "v_blocks = 32: expected a power of two from 1 to 16"),
                                               (0, "v_blocks = 0")])
def test_kda_decode_fused_declines_a_split_it_cannot_run(v_blocks, reason):
    from k3backend.kernels import kda

    ok, why = kda.decode_fused_split_supports(*_decode_fused_args(), v_blocks=v_blocks)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="kda_decode_fused: "):
        kda.decode_fused_split(*_decode_fused_args(), v_blocks=v_blocks)


def test_cpu_tensors_are_declined_unless_interpreting():
    from k3backend.kernels import kda

    ok, why = kda.kda_decode_fused_supports(*_decode_fused_args())
    assert ok if kda._INTERPRET else (not ok and "not a GPU (and TRITON_INTERPRET is not set)" in why), why


def test_kda_prefill_declines_rows_that_are_not_contiguous_per_head():
    from k3backend.kernels import kda_chunk

    T = 5
    q = torch.zeros(T, H, 2 * K)[:, :, :K]  # a strided last-but-one dimension
    args = [q, torch.zeros(T, H, K), torch.zeros(T, H, V), torch.zeros(T, H, K), torch.zeros(T, H),
            torch.zeros(N, H, K, V), torch.tensor([0, T], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.bool)]
    ok, why = kda_chunk.kda_prefill_supports(*args)
    assert not ok and "contiguous [H, D] rows" in why, why


def test_every_kda_kernel_compiles_for_hopper():
    """bench/kernels_kda.py --sm90 compiles each KDA kernel (and variant) for sm_90a without a GPU: the
    interpreter accepts code the compiler refuses (a global that is not a constexpr, an argument the listing
    does not know), which a GPU run would find only at its first launch."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "kernels_kda.py"
    run = subprocess.run([sys.executable, str(bench), "--sm90"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [line for line in run.stdout.splitlines() if " warps " in line]
    assert len(listed) >= 10 and all("registers" in line for line in listed), run.stdout


def _bench_kda(monkeypatch):
    """bench/kernels_kda.py as a module (it imports its neighbour bench/kernels.py)."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("bench_kernels_kda", bench / "kernels_kda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiles_smoke(*extra: str) -> str:
    """stdout of bench/kernels_kda.py --tiles --smoke (under the interpreter), which must exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "kernels_kda.py"
    run = subprocess.run([sys.executable, str(bench), "--tiles", "--smoke", *extra], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def test_tiles_sweep_runs_under_the_interpreter_and_checks_every_variant():
    """bench/kernels_kda.py --tiles --smoke: a table for each of the prefill's three kernels, the rule's
    launch first and bit-equal to itself, every other variant run, compared and within its bound."""
    out = _tiles_smoke()
    lines = out.splitlines()
    assert any(line.startswith("== 70+40 H1 K32 V32: the rule's launches intra") for line in lines), out
    for kernel in ("intra", "solve", "state"):
        rows = [line for line in lines if line[2:].startswith(kernel + " ")]
        assert len(rows) >= 2 and " us  err " in rows[0], out
        assert rows[0].endswith("err 0.0e+00 ok  (chosen)"), rows[0]
        assert all(" ok" in row and "(chosen)" not in row for row in rows[1:]), rows
        assert sum(row.startswith("*") for row in rows) >= 1, rows


def test_tiles_sweep_kernels_option_sweeps_only_those():
    """--kernels state: the state kernel's table only (the others still run once, as its inputs)."""
    out = _tiles_smoke("--kernels", "state")
    rows = [line[2:].split()[0] for line in out.splitlines() if line[:2] in ("  ", "* ")]
    assert rows and set(rows) == {"state"}, out


def test_tiles_check_fails_a_variant_whose_outputs_differ(monkeypatch):
    """The sweep's comparison: equal outputs and rounding pass; a changed value, an entry written that
    the rule's launch left unwritten (NaN in both ran on poisoned outputs) or the reverse, and NaN fail."""
    kda_bench = _bench_kda(monkeypatch)
    err, verdict, bound = kda_bench._tile_err, kda_bench._tile_verdict, kda_bench.TILES_REL
    gen = torch.Generator().manual_seed(0)
    want = [torch.randn(40, 3, 16, generator=gen).bfloat16(), torch.randn(40, 3, 16, generator=gen)]
    want[0][35:] = math.nan  # rows the kernel does not write
    same = [t.clone() for t in want]
    assert err(same, want) == 0.0 and verdict(0.0) == "ok"
    rounded = [want[0], want[1] * (1 + 1e-5)]
    assert 0 < err(rounded, want) <= bound and verdict(err(rounded, want)) == "ok"
    changed = [want[0].clone(), want[1]]
    changed[0][7, 1, 3] += 0.05 * want[0][:35].float().abs().max()
    assert bound < err(changed, want) < 1 and verdict(err(changed, want)).startswith("FAILED")
    extra = [want[0].clone(), want[1]]
    extra[0][36] = 0
    missing = [want[0], want[1].clone()]
    missing[1][0, 0, 0] = math.nan
    for got in (extra, missing):
        assert err(got, want) == math.inf and verdict(err(got, want)).startswith("FAILED")
    assert verdict(math.nan).startswith("FAILED")
