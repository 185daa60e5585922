"""The Triton norms and small fusions (kernels/norm.py) equal the torch references (norm_ref).

Run under TRITON_INTERPRET=1 in a subprocess (tests/interpret.py) at small odd sizes: widths 1, 7,
200, 300, 2048; 1 and 37 rows; strided inputs (a column slice, as kv_a_layernorm gets); fp32 input
with a bf16 weight (the plain path's add-norm); 1, 2, 5 and 9 Attention-Residual candidates. Every buffer the ops allocate starts as NaN (`poisoned_empty`), so an
element a kernel forgets to write fails. Tolerances: tolerances.KERNEL.
"""

from __future__ import annotations


import torch

from interpret import Checks, poisoned_empty, triton_and_reference
from tolerances import KERNEL

CHECKS = Checks(__file__)
DTYPES = (torch.float32, torch.bfloat16)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, (what, out.dtype, ref.dtype, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    torch.testing.assert_close(out, ref, **KERNEL[ref.dtype], msg=lambda m: f"{what}: {m}")


def check_rms_norm_matches_reference() -> None:
    from k3backend.kernels import norm, norm_ref

    for dtype in DTYPES:
        for T, D in ((1, 1), (37, 7), (5, 200), (3, 2048)):
            x, w = randn(T, D, seed=D, dtype=dtype), randn(D, seed=D + 1, dtype=dtype, scale=0.1) + 1
            with poisoned_empty():
                out = norm.rms_norm(x, w, 1e-5)
            assert_matches(out, norm_ref.rms_norm(x, w, 1e-5), f"rms_norm {dtype} [{T}, {D}]")
        lat = randn(9, 3, 52, seed=1, dtype=dtype)[..., :40]  # a strided slice, like lat[:, :r]
        w = randn(40, seed=2, dtype=dtype)
        assert_matches(norm.rms_norm(lat, w, 5e-2), norm_ref.rms_norm(lat, w, 5e-2), f"rms_norm strided {dtype}")
    s, w = randn(11, 200, seed=3), randn(200, seed=4, dtype=torch.bfloat16)  # fp32 sum, bf16 weight (§4.11)
    assert_matches(norm.rms_norm(s, w, 1e-5), norm_ref.rms_norm(s, w, 1e-5), "rms_norm fp32 x, bf16 w")


def check_gated_rms_norm_matches_reference() -> None:
    from k3backend.kernels import norm, norm_ref

    for dtype in DTYPES:
        for T, H, D in ((1, 1, 128), (13, 3, 128), (7, 5, 7)):
            o, z = randn(T, H, D, seed=5, dtype=dtype), randn(T, H, D, seed=6, dtype=dtype, scale=3)
            w = randn(D, seed=7, dtype=dtype, scale=0.1) + 1
            with poisoned_empty():
                g = norm.gated_rms_norm(o, z, w, 1e-5)
            assert_matches(g, norm_ref.gated_rms_norm(o, z, w, 1e-5), f"gated_rms_norm {dtype} [{T}, {H}, {D}]")


def check_attn_res_mix_and_mix_norm_match_reference() -> None:
    from k3backend.kernels import norm, norm_ref

    for dtype in DTYPES:
        for n, T, H in ((1, 3, 300), (2, 1, 300), (5, 37, 300), (9, 4, 2048), (3, 70, 300)):  # 70: row by row
            rows = [randn(T, H, seed=10 + j, dtype=dtype, scale=1 + j) for j in range(n)]
            ns, wp = randn(H, seed=8, dtype=dtype, scale=0.1) + 1, randn(1, H, seed=9, dtype=dtype, scale=H ** -0.5)
            ow = randn(H, seed=10, dtype=dtype, scale=0.1) + 1
            with poisoned_empty():
                out, normed = norm.attn_res_mix(rows, ns, wp, 1e-5), norm.attn_res_mix_norm(rows, ns, wp, 1e-5, ow, 3e-5)
            assert_matches(out, norm_ref.attn_res_mix(rows, ns, wp, 1e-5), f"attn_res_mix {dtype} n={n} [{T}, {H}]")
            assert_matches(normed, norm_ref.attn_res_mix_norm(rows, ns, wp, 1e-5, ow, 3e-5),
                           f"attn_res_mix_norm {dtype} n={n} [{T}, {H}]")
    rows = [randn(6, 300, seed=20), randn(6, 340, seed=21)[:, :300]]  # different row strides: copied
    ns, wp = randn(300, seed=22), randn(1, 300, seed=23, scale=0.05)
    assert_matches(norm.attn_res_mix(rows, ns, wp, 1e-5), norm_ref.attn_res_mix(rows, ns, wp, 1e-5), "mixed strides")


def check_mla_latent_matches_reference() -> None:
    """mla_latent: the pool rows [rms_norm(c_kv) ; k_pe] at their slots (every other row untouched) and
    rms_norm(q_a), from strided slices of one in-projection output as MLA takes them; without a q LoRA too;
    NaN and Inf stored as 0."""
    from k3backend.kernels import mla_ref, norm

    Q, R, dr, G = 48, 40, 12, 20
    for dtype in DTYPES:
        for T, with_q in ((1, True), (5, True), (3, False)):
            what = f"mla_latent {dtype} T={T} q={with_q}"
            proj = randn(T, Q + R + dr + G, seed=20 + T, dtype=dtype)
            q_a, lat = proj[:, :Q], proj[:, Q:Q + R + dr]
            qw, kvw = randn(Q, seed=21, dtype=dtype, scale=0.1) + 1, randn(R, seed=22, dtype=dtype, scale=0.1) + 1
            slots = torch.randperm(4 * 8, generator=torch.Generator().manual_seed(T))[:T]
            args = (q_a, qw, 1e-5) if with_q else (None, None, 0.0)
            pools = [torch.full((4, 8, R + dr), float("nan"), dtype=dtype) for _ in range(2)]
            ok, why = norm.mla_latent_supports(*args, lat, kvw, 1e-6, pools[0], slots)
            assert ok, why
            with poisoned_empty():
                got = norm.mla_latent(*args, lat, kvw, 1e-6, pools[0], slots)
            want = mla_ref.mla_latent(*args, lat, kvw, 1e-6, pools[1], slots)
            rows = pools[0].view(-1, R + dr)
            assert_matches(rows[slots], pools[1].view(-1, R + dr)[slots], f"{what}: rows")
            assert torch.equal(rows[slots][:, R:], lat[:, R:]), f"{what}: k_pe must be copied as it is"
            others = torch.ones(rows.shape[0], dtype=torch.bool)
            others[slots] = False
            assert rows[others].isnan().all(), f"{what}: a row outside slot_mapping written"
            if with_q:
                assert_matches(got, want, f"{what}: q")
            else:
                assert got is None and want is None
        # NaN / Inf in the latent: stored as 0, so the pool stays finite (mla_write: TMA decode reads stale rows)
        lat = randn(3, R + dr, seed=30, dtype=dtype)
        lat[0, 3], lat[1, R + 2], lat[2, R + 5] = float("nan"), float("inf"), float("-inf")
        pools = [torch.zeros(4, 8, R + dr, dtype=dtype) for _ in range(2)]
        slots = torch.tensor([5, 17, 30])
        with poisoned_empty():
            norm.mla_latent(None, None, 0.0, lat, kvw, 1e-6, pools[0], slots)
        mla_ref.mla_latent(None, None, 0.0, lat, kvw, 1e-6, pools[1], slots)
        for pool, who in zip(pools, ("kernel", "reference")):
            rows = pool.view(-1, R + dr)[slots]
            assert torch.isfinite(pool).all(), f"mla_latent {dtype} {who}: a non-finite value stored"
            assert (rows[0, :R] == 0).all() and torch.equal(rows[0, R:], lat[0, R:]), f"{who}: NaN c_kv row"
            assert rows[1, R + 2] == 0 and rows[2, R + 5] == 0 and (rows[1:, :R] != 0).any(), f"{who}: Inf k_pe"
        assert torch.equal(pools[0], pools[1]), f"mla_latent {dtype}: kernel and reference store different rows"


def check_tiny_model_through_the_switch_matches_reference() -> None:
    """A whole tiny K3 text model (AttnRes mixes, RMSNorms, SiTU MLP, KDA norms, MLA) with
    K3_KERNELS=triton (these kernels under the interpreter) equals K3_KERNELS=ref, fp32."""
    from k3backend.config import K3Config
    from k3backend.model.lm import K3TextModel
    from k3backend.presets import preset_config
    from poolutil import lm_streams

    cfg = K3Config.from_dict(preset_config("tiny")).text
    model = K3TextModel(cfg)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, w in sorted(model.named_parameters()):
            scale = 1.0 if name.endswith("embed_tokens.weight") else w.shape[-1] ** -0.5
            base = 1.0 if name.endswith("norm.weight") else 0.0
            w.copy_(base + scale * torch.randn(w.shape, generator=g) * (0.1 if base else 1.0))
    lm = type("LM", (), {"model": model, "lm_head": torch.nn.Linear(1, 1)})()  # what lm_streams reads
    x = torch.randn(9, cfg.hidden_size, generator=g)

    def forward() -> torch.Tensor:
        s = lm_streams(lm, 1, 9)
        return model(x, s.batch([9]), s.pools)

    fast, ref, seen = triton_and_reference(forward)
    for op in ("rms_norm", "gated_rms_norm", "kda_prefill_inputs", "attn_res_mix_norm", "mla_latent", "mla_prefill"):
        assert any(f"{op} runs its Triton kernel" in m for m in seen), (op, seen)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_rms_norm_matches_reference():
    CHECKS.assert_passed("rms_norm_matches_reference")


def test_gated_rms_norm_matches_reference():
    CHECKS.assert_passed("gated_rms_norm_matches_reference")


def test_attn_res_mix_and_mix_norm_match_reference():
    CHECKS.assert_passed("attn_res_mix_and_mix_norm_match_reference")


def test_mla_latent_matches_reference():
    CHECKS.assert_passed("mla_latent_matches_reference")


def test_tiny_model_through_the_switch_matches_reference():
    CHECKS.assert_passed("tiny_model_through_the_switch_matches_reference")


# ---- in-process: no kernel launches -------------------------------------------------------------

def test_verifiers_decline_what_the_kernels_cannot_do():
    from k3backend.kernels import norm

    ok, why = norm.rms_norm_supports(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    assert not ok and ("float64" in why or "GPU" in why), why
    ok, why = norm.attn_res_mix_supports([torch.zeros(2, 8)] * 17, torch.ones(8), torch.ones(1, 8), 1e-5)
    assert not ok and "17 candidate rows" in why, why


def test_kernels_compile_for_hopper_without_spills():
    """At K3 sizes (hidden 7168, 9 AttnRes candidates, SiTU I 4224) with the wrappers' launch choices,
    the kernels compile for sm_90a with no register spills (the mix re-reads its rows rather than
    keeping 9 of them live)."""
    from sm90 import compile_sm90

    from k3backend.kernels import norm

    H = 7168
    runs = []
    for h, n, tokens in ((H, 9, 1), (H, 9, 1024), (2048, 5, 1)):  # K3, and `small` on its 8 warps at 1 token
        block_h, block_j = triton_next_pow2(h), triton_next_pow2(n)
        warps = norm.mix_warps(block_h, tokens)
        runs.append((f"attn_res_mix_norm H {h} T {tokens}", norm._attn_res_mix_kernel, warps,
                     dict(rows=("*bf16",) * n, norm_w_ptr="*bf16", proj_w_ptr="*bf16", out_w_ptr="*bf16",
                          out_ptr="*bf16", n_rows=64, s_r=h, s_o=h, eps=1e-5, out_eps=1e-5),
                     dict(H=h, BLOCK_H=block_h, NUM=n, BLOCK_J=block_j,
                          CHUNK=norm.mix_chunk(tokens, block_h, block_j, warps), NORM=True, INTERPRET=False)))
    for D, kind in ((H, 0), (128, 1)):
        block_d, block_rows, warps = norm.row_config(D, 64)
        runs.append((f"row norm {kind}", norm._row_norm_kernel, warps,
                     dict(x_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", n_rows=64, s_x=D, s_z=D, s_y=D,
                          eps=1e-5),
                     dict(D=D, BLOCK_D=block_d, BLOCK_ROWS=block_rows, KIND=kind, INTERPRET=False)))
    runs.append(("mla_latent", norm._mla_latent_kernel, 4,  # K3: q_lora 1536, r 512 + dr 64
                 dict(q_ptr="*bf16", qw_ptr="*bf16", qo_ptr="*bf16", lat_ptr="*bf16", kvw_ptr="*bf16",
                      pool_ptr="*bf16", slot_ptr="*i64", s_q=3392, s_l=3392, s_qo=1536, q_eps=1e-6,
                      kv_eps=1e-6),
                 dict(Q=1536, R=512, W=576, BLOCK_Q=2048, BLOCK_W=1024, HAS_Q=True, INTERPRET=False)))
    for what, kernel, warps, args, constexprs in runs:
        c = compile_sm90(kernel, args, constexprs, num_warps=warps, num_stages=1, enable_fp_fusion=False)
        assert c.stack == 0, f"{what}: {c}"


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
