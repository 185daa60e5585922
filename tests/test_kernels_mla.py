"""The Triton MLA kernels (kernels/mla.py) equal the torch references (kernels/mla_ref.py).

Run under TRITON_INTERPRET=1 in a subprocess (tests/interpret.py) at small odd sizes: heads 3 and 33
(two row tiles per sequence), dn 5, dr 12, r 40 (padded blocks), dv 7, block size 5, permuted block
tables wider than needed, unused pool rows poisoned with NaN, padding rows (a table of zeros,
context 1), cached prefix against none, split-KV counts 1..16, outputs poisoned before the kernels
write them. Every element is compared (tolerances.KERNEL).
"""

from __future__ import annotations


import pytest
import torch

from interpret import Checks, poisoned_empty, triton_and_reference
from tolerances import KERNEL

CHECKS = Checks(__file__)
DIMS = {"N": 3, "dn": 5, "dr": 12, "r": 40, "dv": 7, "bs": 5}


def paged_problem(prefix: list[int], chunk: list[int], dtype: torch.dtype, *, seed: int, N: int = DIMS["N"],
                  pad_rows: int = 0, stale: float | None = None, **dims: int) -> dict:
    """Sequences with `prefix[b]` cached rows and `chunk[b]` new ones (already written), in permuted
    blocks of a pool whose every row outside the sequences' contexts is NaN, except (stale) the rows
    of their blocks past the contexts: randn·stale there, finite as `mla_write` keeps a pool;
    `pad_rows` padding sequences (block table of zeros, context 1) at the end. `dims` overrides DIMS."""
    g = torch.Generator().manual_seed(seed)
    dims = {**DIMS, **dims}
    dn, dr, r, dv, bs = dims["dn"], dims["dr"], dims["r"], dims["dv"], dims["bs"]
    ctx = [p + c for p, c in zip(prefix, chunk)]
    need = [-(-n // bs) for n in ctx]
    num_blocks = sum(need) + 4
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    pool = torch.full((num_blocks, bs, r + dr), float("nan"))
    pool[0] = torch.randn(bs, r + dr, generator=g)  # padding rows read the null block
    tables, k = [], 0
    for n, nb in zip(ctx, need):
        tables.append(perm[k:k + nb])
        k += nb
        rows = torch.randn(n, r + dr, generator=g)
        if stale is not None:
            pool[tables[-1]] = torch.randn(nb, bs, r + dr, generator=g) * stale
        for p in range(n):
            pool[tables[-1][p // bs], p % bs] = rows[p]
    width = max(need) + 2
    tables += [[] for _ in range(pad_rows)]
    ctx += [1] * pad_rows
    chunk = list(chunk) + [1] * pad_rows
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(chunk).cumsum(0).tolist()], dtype=torch.int32)
    kv_b = torch.randn(N * (dn + dv), r, generator=g) * r ** -0.5
    q = torch.randn(int(cu[-1]), N, dn + dr, generator=g)
    c = lambda t: t.to(dtype)  # noqa: E731
    w = c(kv_b).view(N, dn + dv, r)
    return {"q_nope": c(q)[..., :dn], "q_pe": c(q)[..., dn:], "pool": c(pool), "cu_seqlens": cu,
            "block_tables": bt, "context_lens": torch.tensor(ctx, dtype=torch.int32), "kv_b": c(kv_b),
            "w_kc": w[:, :dn], "w_vc": w[:, dn:].transpose(1, 2), "scale": (dn + dr) ** -0.5}


def decode_args(p: dict) -> tuple:
    return (p["q_nope"], p["q_pe"], p["pool"], p["block_tables"], p["context_lens"], p["w_kc"], p["w_vc"], p["scale"])


def prefill_args(p: dict) -> tuple:
    return (p["q_nope"], p["q_pe"], p["pool"], p["cu_seqlens"], p["block_tables"], p["context_lens"], p["kv_b"],
            p["w_kc"], p["w_vc"], p["scale"])


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, (what, out.dtype, ref.dtype, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    torch.testing.assert_close(out, ref, **KERNEL[ref.dtype], msg=lambda m: f"{what}: {m}")


DECODE_CTX = [1, 4, 17, 38, 61]  # one sequence shorter than a block, one over 12 blocks


def check_decode_matches_reference() -> None:
    from k3backend.kernels import mla, mla_ref

    for dtype in (torch.float32, torch.bfloat16):
        p = paged_problem([n - 1 for n in DECODE_CTX], [1] * len(DECODE_CTX), dtype, seed=1, pad_rows=2)
        with poisoned_empty():
            out = mla.mla_decode(*decode_args(p))
        assert_matches(out, mla_ref.mla_decode(*decode_args(p)), f"decode {dtype}")


def check_decode_split_kv_writes_every_row() -> None:
    from k3backend.kernels import mla, mla_ref

    p = paged_problem([n - 1 for n in DECODE_CTX], [1] * len(DECODE_CTX), torch.bfloat16, seed=2, pad_rows=1)
    want = mla_ref.mla_decode(*decode_args(p))
    B, N, r = p["q_nope"].shape[0], DIMS["N"], DIMS["r"]
    for splits in (3, 11):  # 11: more splits than the short sequences have tiles (empty splits)
        o_hat = mla._empty_heads_major(B, N, r, p["q_nope"]).fill_(float("nan"))
        with poisoned_empty():  # the split partials: an empty split's are never written, so never read
            mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                                 p["context_lens"], p["scale"], o_hat, cu_seqlens=None, splits=splits,
                                 config=mla.decode_config(N))
        assert_matches(mla._unabsorb(o_hat, p["w_vc"]), want, f"decode, {splits} splits")


def check_decode_many_heads_uses_several_row_tiles() -> None:
    from k3backend.kernels import mla, mla_ref

    p = paged_problem([6, 12], [1, 1], torch.float32, seed=3, N=33)  # 33 heads: 2 tiles of 32 rows
    assert mla.decode_config(33)["BLOCK_M"] == 32
    assert_matches(mla.mla_decode(*decode_args(p)), mla_ref.mla_decode(*decode_args(p)), "decode, 33 heads")


def check_tma_tiles_match_reference() -> None:
    """Block size 32, 16-key tiles through TMA descriptors, partial last tiles included: their rows past
    each context (randn·1e4, finite as the pool always is) are read and must weigh nothing. NaN there
    (which `mla_write` never stores) would reach the output: the check really reads them."""
    from k3backend.kernels import mla, mla_ref

    tma = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "tma": True}
    dims = {"bs": 32, "r": 40, "dr": 16}  # rows of 56 values: 16-byte aligned for TMA
    for dtype in (torch.float32, torch.bfloat16):
        p = paged_problem([0, 15, 40, 70], [1, 1, 1, 1], dtype, seed=9, pad_rows=1, stale=1e4, **dims)
        assert mla._descriptors(p["pool"], 40, 16, 16) is not None
        want = mla_ref.mla_decode(*decode_args(p))
        B, N = p["q_nope"].shape[:2]
        for splits in (1, 3):
            o_hat = mla._empty_heads_major(B, N, 40, p["q_nope"]).fill_(float("nan"))
            mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                                 p["context_lens"], p["scale"], o_hat, cu_seqlens=None, splits=splits, config=tma)
            assert_matches(mla._unabsorb(o_hat, p["w_vc"]), want, f"decode TMA {dtype} {splits} splits")
    p = paged_problem([0, 20, 33], [9, 13, 4], torch.bfloat16, seed=10, stale=1e4, **dims)
    want = mla_ref.mla_prefill(*prefill_args(p))
    cached = torch.repeat_interleave(torch.tensor([False, True, True]), torch.tensor([9, 13, 4]))
    o_hat = mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                                 p["context_lens"], p["scale"], mla._empty_heads_major(26, N, 40, p["q_nope"]),
                                 cu_seqlens=p["cu_seqlens"], splits=1, config=tma, skip_fresh=True)
    assert_matches(mla._unabsorb(o_hat, p["w_vc"])[cached], want[cached], "prefill TMA")
    p = paged_problem([14], [1], torch.float32, seed=11, **dims)  # 15 keys: one partial tile, NaN past it
    o_hat = mla._empty_heads_major(1, N, 40, p["q_nope"])
    mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                         p["context_lens"], p["scale"], o_hat, cu_seqlens=None, splits=1, config=tma)
    assert torch.isnan(o_hat).all(), "TMA tiles should read (and be poisoned by) NaN rows past the context"


def check_decode_takes_tma_tiles_where_the_pool_allows() -> None:
    """K3's decode layout (16 heads, block size 64): `mla_decode` picks DECODE_TMA (64-key tiles), contexts
    ending inside a tile and on a tile's end, stale rows past them; other block sizes keep pointer tiles."""
    from k3backend.kernels import mla, mla_ref

    dims = {"bs": 64, "r": 40, "dr": 16}
    p = paged_problem([0, 62, 63, 64, 100, 191], [1] * 6, torch.bfloat16, seed=12, N=16, pad_rows=1, stale=1e4,
                      **dims)
    assert mla.tma_fits(p["pool"], 40, 64) and mla.decode_config(16, True) == mla.DECODE_TMA
    assert not mla.tma_fits(p["pool"][:, :32], 40, 64) and not mla.decode_config(16, False)["tma"]
    with poisoned_empty():
        out = mla.mla_decode(*decode_args(p))
    assert_matches(out, mla_ref.mla_decode(*decode_args(p)), "decode, DECODE_TMA tiles")


def check_decode_random_layouts_match_reference() -> None:
    """Seeded random decode problems: block sizes 16 / 32 / 64, TMA tiles of 16-64 keys dividing them and
    32-key pointer tiles, contexts on and beside tile ends, 1-40 splits, stale rows of 1e4·randn past each
    context, fp32 and bf16."""
    import random

    from k3backend.kernels import mla, mla_ref

    rng = random.Random(34)
    for case in range(24):
        bs = rng.choice([16, 32, 64])
        bn = rng.choice([n for n in (16, 32, 64) if bs % n == 0] + [32])
        tma = bs % bn == 0 and rng.random() < 0.7
        cfg = {"BLOCK_M": 16, "BLOCK_N": bn, "num_warps": 4, "num_stages": 2, "tma": tma}
        ctx = [rng.choice([1, bn - 1, bn, bn + 1, 2 * bn - 1, 20 * bn + 3, rng.randint(1, 300)])
               for _ in range(rng.randint(1, 5))]
        dtype = rng.choice([torch.float32, torch.bfloat16])
        splits = rng.choice([1, 2, 3, 5, 16, 24, 40])  # > mla.REDUCE_SPLITS: the reduce's later steps rescale
        p = paged_problem([n - 1 for n in ctx], [1] * len(ctx), dtype, seed=100 + case, stale=1e4, bs=bs, r=40, dr=16)
        assert not tma or mla._descriptors(p["pool"], 40, 16, bn) is not None
        B, N = p["q_nope"].shape[:2]
        o_hat = mla._empty_heads_major(B, N, 40, p["q_nope"]).fill_(float("nan"))
        mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                             p["context_lens"], p["scale"], o_hat, cu_seqlens=None, splits=splits, config=cfg)
        assert_matches(mla._unabsorb(o_hat, p["w_vc"]), mla_ref.mla_decode(*decode_args(p)),
                       f"case {case}: block {bs}, {cfg}, contexts {ctx}, {splits} splits, {dtype}")


# fresh 9 (expanded form), prefix 6 + 4, prefix 11 + 1, fresh 1, prefix 3 + 7
PREFIX, CHUNK = [0, 6, 11, 0, 3], [9, 4, 1, 1, 7]


def check_prefill_matches_reference() -> None:
    from k3backend.kernels import mla, mla_ref

    for dtype in (torch.float32, torch.bfloat16):
        p = paged_problem(PREFIX, CHUNK, dtype, seed=4)
        with poisoned_empty():
            out = mla.mla_prefill(*prefill_args(p))
        assert_matches(out, mla_ref.mla_prefill(*prefill_args(p)), f"prefill {dtype}")


def check_prefill_expanded_prefix_matches_reference() -> None:
    """Chunks of at least PREFIX_MIN_LEN tokens (4 here) see their cached prefix up-projected in the
    workspace while the prefixes fit PREFIX_TOKENS (20 here): 6 + 4 and 3 + 7 do; 11 + 1 is too short,
    15 + 5 and 2 + 6 are past the workspace (absorbed form). The workspace is NaN outside the rows
    written, and every output element is compared with the reference (absorbed everywhere)."""
    from k3backend.kernels import mla, mla_ref, varlen

    prefix, chunk = PREFIX + [15, 2], CHUNK + [5, 6]
    saved = mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN
    mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = 20, 4
    try:
        for dtype in (torch.float32, torch.bfloat16):
            p = paged_problem(prefix, chunk, dtype, seed=11)
            args = prefill_args(p)
            layout = varlen.varlen_layout(p["cu_seqlens"], int(p["cu_seqlens"][-1]), p["context_lens"],
                                          p["block_tables"], DIMS["bs"])
            pcu, mha = layout.expanded_prefix(mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN)
            assert pcu.tolist() == [0, 0, 6, 6, 6, 9, 9, 9], pcu.tolist()
            want_mha = [x == 0 or (x, c) in ((6, 4), (3, 7)) for x, c in zip(prefix, chunk)]
            assert mha.tolist() == torch.repeat_interleave(torch.tensor(want_mha), torch.tensor(chunk)).tolist()
            with poisoned_empty():
                out = mla.mla_prefill(*args, layout=layout)
            if dtype == torch.float32:
                assert_matches(out, mla_ref.mla_prefill(*args), "prefill, expanded prefixes, fp32")
                T, N, r = p["q_nope"].shape[0], DIMS["N"], DIMS["r"]  # the absorbed kernel skips those chunks
                o_hat = mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"],
                                             p["block_tables"], p["context_lens"], p["scale"],
                                             torch.full((T, N, r), float("nan")), cu_seqlens=p["cu_seqlens"],
                                             splits=1, config=mla.PREFILL_LATENT, skip_fresh=True, prefix_cu=pcu)
                assert torch.isnan(o_hat[mha]).all() and torch.isfinite(o_hat[~mha]).all()
                continue
            # bf16: the expanded form rounds k and v where the reference's absorbed form rounds q̂ and ô,
            # so both are held to the same bound against the fp32 reference on the same values: 2 bf16
            # ulps of the row's largest output
            exact = mla_ref.mla_prefill(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                          for a in args))
            bound = exact.abs().amax(-1, keepdim=True) * 2.0 ** -6
            for what, got in (("kernels", out), ("bf16 reference", mla_ref.mla_prefill(*args))):
                excess = ((got.float() - exact).abs() - bound).max().item()
                assert excess <= 0, f"prefill, expanded prefixes, bf16 {what}: {excess} over 2 ulps of the row"
    finally:
        mla.PREFIX_TOKENS, mla.PREFIX_MIN_LEN = saved


def check_prefill_all_fresh_and_all_cached() -> None:
    from k3backend.kernels import mla, mla_ref

    for prefix, chunk in (([0, 0], [13, 6]), ([8, 2], [3, 9])):
        p = paged_problem(prefix, chunk, torch.bfloat16, seed=5)
        assert_matches(mla.mla_prefill(*prefill_args(p)), mla_ref.mla_prefill(*prefill_args(p)), f"prefill {prefix}")


def check_prefill_kernels_write_exactly_their_rows() -> None:
    """The expanded kernel writes the fresh chunks' rows, the latent one the others (any split count)."""
    from k3backend.kernels import mla

    p = paged_problem(PREFIX, CHUNK, torch.float32, seed=6)
    T, N, r, dv = p["q_nope"].shape[0], DIMS["N"], DIMS["r"], DIMS["dv"]
    fresh = torch.repeat_interleave(torch.tensor([x == 0 for x in PREFIX]), torch.tensor(CHUNK))
    want = mla.mla_prefill(*prefill_args(p))
    lat = torch.cat([p["pool"][p["block_tables"][b, torch.arange(n) // DIMS["bs"]].long(), torch.arange(n) % DIMS["bs"]]
                     [n - c:] for b, (n, c) in enumerate(zip(p["context_lens"].tolist(), CHUNK))])
    kv = (lat[:, :r] @ p["kv_b"].t()).view(T, N, -1)
    o = mla.mha_attention(p["q_nope"], p["q_pe"], kv, lat[:, r:], p["cu_seqlens"], p["context_lens"], dv, p["scale"],
                          torch.full((T, N, dv), float("nan")))
    assert torch.isfinite(o[fresh]).all() and torch.isnan(o[~fresh]).all()
    torch.testing.assert_close(o[fresh].reshape(-1, N * dv), want[fresh], **KERNEL[torch.float32])
    for splits in (1, 3):
        o_hat = mla.latent_attention(mla._absorb(p["q_nope"], p["w_kc"]), p["q_pe"], p["pool"], p["block_tables"],
                                     p["context_lens"], p["scale"], torch.full((T, N, r), float("nan")),
                                     cu_seqlens=p["cu_seqlens"], splits=splits, config=mla.PREFILL_LATENT,
                                     skip_fresh=True)
        skipped = o_hat[fresh]
        assert torch.isfinite(o_hat[~fresh]).all(), splits
        assert (torch.isnan(skipped) if splits == 1 else skipped == 0).all(), splits
        torch.testing.assert_close(mla._unabsorb(o_hat, p["w_vc"])[~fresh], want[~fresh],
                                   **KERNEL[torch.float32])


def check_mla_layer_steps_through_the_switch_match_reference() -> None:
    """model/mla.py through kernels/__init__ with K3_KERNELS=triton: prefill, a mixed step (decode rows
    and a chunk over a cached prefix), decode; the same outputs as K3_KERNELS=ref. Blocks of 4 and of 64
    (decode in DECODE_TMA's tiles, the pool's rows written by the fused mla_latent)."""
    from k3backend.config import K3Config
    from k3backend.kernels import mla
    from k3backend.model.mla import MLA
    from k3backend.presets import preset_config
    from poolutil import Streams

    cfg = K3Config.from_dict(preset_config("tiny")).text
    layer = MLA(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, w in sorted(layer.named_parameters()):
            w.copy_(torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5 + (1.0 if w.dim() == 1 else 0.0))
    batches = [([7, 5, 3], 0), ([1, 1, 4], 2), ([1, 1, 1], 3)]
    xs = [torch.randn(sum(lens), cfg.hidden_size, generator=g) for lens, _ in batches]

    for bs in (4, 64):
        def steps() -> list[torch.Tensor]:
            s = Streams([layer], 3, 16, dtype=torch.float32, block_size=bs)
            assert mla.tma_fits(s.cache.latent, cfg.kv_lora_rank, mla.DECODE_TMA["BLOCK_N"]) == (bs == 64)
            return [layer(x, s.batch(lens, num_decode=nd), s.cache) for x, (lens, nd) in zip(xs, batches)]

        fast, ref, seen = triton_and_reference(steps)
        for op in ("mla_decode", "mla_prefill"):
            assert any(f"{op} runs its Triton kernel" in m for m in seen), (op, seen)
        for k, (a, b) in enumerate(zip(fast, ref)):
            torch.testing.assert_close(a, b, **KERNEL[torch.float32], msg=lambda m: f"block {bs}, step {k}: {m}")


def test_mla_layer_steps_through_the_switch_match_reference():
    CHECKS.assert_passed("mla_layer_steps_through_the_switch_match_reference")


def test_decode_matches_reference():
    CHECKS.assert_passed("decode_matches_reference")


def test_decode_split_kv_writes_every_row():
    CHECKS.assert_passed("decode_split_kv_writes_every_row")


def test_decode_many_heads_uses_several_row_tiles():
    CHECKS.assert_passed("decode_many_heads_uses_several_row_tiles")


def test_tma_tiles_match_reference():
    CHECKS.assert_passed("tma_tiles_match_reference")


def test_decode_random_layouts_match_reference():
    CHECKS.assert_passed("decode_random_layouts_match_reference")


def test_decode_takes_tma_tiles_where_the_pool_allows():
    CHECKS.assert_passed("decode_takes_tma_tiles_where_the_pool_allows")


def test_prefill_matches_reference():
    CHECKS.assert_passed("prefill_matches_reference")


def test_prefill_expanded_prefix_matches_reference():
    CHECKS.assert_passed("prefill_expanded_prefix_matches_reference")


def test_prefill_all_fresh_and_all_cached():
    CHECKS.assert_passed("prefill_all_fresh_and_all_cached")


def test_prefill_kernels_write_exactly_their_rows():
    CHECKS.assert_passed("prefill_kernels_write_exactly_their_rows")


# ---- in-process: no kernel launches -------------------------------------------------------------

def test_verifiers_decline_what_the_kernels_cannot_do():
    from k3backend.kernels import mla

    p = paged_problem([4], [1], torch.float64, seed=7)
    ok, why = mla.mla_decode_supports(*decode_args(p))
    assert not ok and ("float64" in why or "GPU" in why), why
    p = paged_problem([4], [1], torch.bfloat16, seed=7)
    p["pool"] = p["pool"].float()
    ok, why = mla.mla_decode_supports(*decode_args(p))
    assert not ok and ("pool is torch.float32" in why or "GPU" in why), why


def test_wrapper_names_a_wrong_shape():
    from k3backend.kernels import mla

    p = paged_problem([4], [1], torch.float32, seed=8)
    p["pool"] = p["pool"][..., :-1]
    with pytest.raises(ValueError, match=r"pool: expected shape \[\d+, 5, 52\], got \[\d+, 5, 51\]"):
        mla.mla_decode(*decode_args(p))


def _latent_args(config: dict, N: int, T: int, split: bool) -> dict:
    """A K3-sized launch of the latent kernel (r 512, dr 64, block size 64), as compile_sm90 takes it."""
    r, bn = 512, config["BLOCK_N"]
    desc = lambda w: f"tensordesc<bf16[{bn}, {w}]>" if config["tma"] else "*bf16"  # noqa: E731
    return dict(q_ptr="*bf16", qpe_ptr="*bf16", pool_ptr="*bf16", ckv_desc=desc(512), kpe_desc=desc(64), bt_ptr="*i32",
                ctx_ptr="*i32", cu_ptr="*i32", tile_cu_ptr="*i32", pcu_ptr="*i32",
                out_ptr="*fp32" if split else "*bf16",
                lse_ptr="*fp32", scale=0.07, B=64, N=N, num_splits=4, tiles_per_seq=1, s_qt=r, s_qh=T * r,
                s_pt=N * 192, s_ph=192, s_blk=64 * 576, s_row=576, s_bt=256, s_os=T * N * r, s_ot=N * r, s_oh=r,
                s_ls=T * N, s_lt=N, s_lh=1)


def test_configs_compile_for_hopper_without_spills():
    """The shipped tile configurations at K3 sizes compile for sm_90a (no GPU needed) with no register
    spills (but 8 B for DECODE_TMA) and within the 227 KB of shared memory a program may use."""
    from sm90 import compile_sm90

    from k3backend.kernels import mla

    latent = {"BLOCK_SIZE": 64, "R": 512, "DR": 64, "BLOCK_R": 512, "BLOCK_DR": 64, "F32_DOT": False, "SPLIT_P": True,
              "INTERPRET": False, "SEARCH": mla.SEARCH, "PREFIX": False}
    runs = []
    for cfg in (mla.decode_config(16, tma=True), mla.decode_config(16)):
        runs.append((f"decode (tma {cfg['tma']})", mla._latent_attn_kernel, _latent_args(cfg, 16, 64, True), cfg,
                     {**latent, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "DECODE": True,
                      "SKIP_FRESH": False, "SPLIT": True, "USE_TMA": cfg["tma"]}))
    cfg = mla.PREFILL_LATENT  # also decode_config(N > 16)
    assert {k: v for k, v in mla.decode_config(32).items()} == cfg
    runs.append(("prefill latent", mla._latent_attn_kernel, _latent_args(cfg, 16, 4096, False), cfg,
                 {**latent, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "DECODE": False, "SKIP_FRESH": True,
                  "SPLIT": False, "USE_TMA": cfg["tma"], "PREFIX": True}))
    cfg, N = mla.PREFILL_MHA, 16
    mha_args = dict(qn_ptr="*bf16", qp_ptr="*bf16", kv_ptr="*bf16", kpe_ptr="*bf16", cu_ptr="*i32", ctx_ptr="*i32",
                    tile_cu_ptr="*i32", out_ptr="*bf16", pool_ptr="*bf16", bt_ptr="*i32", pcu_ptr="*i32",
                    ws_ptr="*bf16", scale=0.07, B=2, s_nt=N * 192, s_nh=192, s_pt=N * 192,
                    s_ph=192, s_kt=N * 256, s_kh=256, s_et=576, s_ot=N * 128, s_oh=128, s_blk=64 * 576, s_row=576,
                    s_bt=256, s_wt=N * 256, s_wh=256)
    for prefix in (False, True):
        runs.append((f"prefill mha (prefix {prefix})", mla._mha_kernel, mha_args, cfg,
                     {"DN": 128, "DR": 64, "DV": 128, "BLOCK_DN": 128, "BLOCK_DR": 64, "BLOCK_DV": 128,
                      "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "F32_DOT": False, "SPLIT_P": True,
                      "INTERPRET": False, "SEARCH": mla.SEARCH, "PREFIX": prefix, "R": 512, "BLOCK_SIZE": 64}))
    cfg = mla.EXPAND
    runs.append(("prefix expansion", mla._expand_kernel,
                 dict(pool_ptr="*bf16", bt_ptr="*i32", pcu_ptr="*i32", w_ptr="*bf16", ws_ptr="*bf16", B=8,
                      s_blk=64 * 576, s_row=576, s_bt=256, s_wn=512, s_wt=N * 256), cfg,
                 {"NOUT": N * 256, "R": 512, "BLOCK_SIZE": 64, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                  "BLOCK_K": cfg["BLOCK_K"], "SEARCH": mla.SEARCH, "F32_DOT": False, "INTERPRET": False}))
    for what, kernel, args, cfg, constexprs in runs:
        c = compile_sm90(kernel, args, constexprs, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        spill = 8 if cfg.get("tma") else 0  # DECODE_TMA under triton 3.6: 8 B, measured faster than none (mla.py)
        assert c.stack <= spill and c.smem <= 227 * 1024 and 3 in c.mma, f"{what} {cfg}: {c}"
    c = compile_sm90(mla._latent_reduce_kernel,
                     dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", N=16, num_splits=4, s_os=64 * 16 * 512,
                          s_ot=16 * 512, s_oh=512, s_ls=64 * 16, s_lt=16, s_lh=1, s_t=16 * 512, s_h=512),
                     {"R": 512, "BLOCK_R": 512, "BLOCK_S": mla.REDUCE_SPLITS, "INTERPRET": False}, num_warps=4,
                     num_stages=2)
    assert c.stack == 0, f"split reduce: {c}"
