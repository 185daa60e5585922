"""Image preprocessing, MoonViT3d tower and projector against K3_VISION.md §2, §4, §5.

The tower is checked against `ref_*` functions below: a direct float64 transcription of the spec
formulas (explicit loops / einsum), sharing no code with `k3backend.model.vision`.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3backend.config import K3Config, VisionConfig
from k3backend.model import vision
from k3backend.model.preprocess import (
    PreprocessConfig,
    TransparentBgConfig,
    grid_for_size,
    image_num_tokens,
    load_image,
    navit_resize,
    preprocess_image,
)
from k3backend.model.vision import K3VisionModel, apply_rope_2d, rope_2d_freqs, tpool_patch_merger
from k3backend.presets import preset_config

F64_TOL = dict(rtol=1e-10, atol=1e-10)  # float64 model vs float64 transcription
K3 = PreprocessConfig()


def tiny_cfg() -> VisionConfig:
    return K3Config.from_dict(preset_config("tiny")).vision


def rgb_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def random_model(cfg: VisionConfig, seed: int, dtype: torch.dtype = torch.float64) -> K3VisionModel:
    """Fresh weights from their own generator: N(0, 1/fan_in) matrices, norms 1 + N(0, 0.1²)."""
    g = torch.Generator().manual_seed(seed)
    model = K3VisionModel(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("pos_emb.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))
    return model


# =============================================================================================
# §2.2 NaViT resize rule
# =============================================================================================

# original W x H -> new w x h, pad w/h, grid, N tokens (the §2.2 table)
NAVIT_TABLE = [
    ((10, 10), (10, 10), (18, 18), (1, 2, 2), 1),
    ((640, 480), (640, 480), (4, 24), (1, 36, 46), 414),
    ((1024, 768), (1024, 768), (12, 16), (1, 56, 74), 1036),
    ((1920, 1080), (1920, 1080), (12, 12), (1, 78, 138), 2691),
    ((4000, 3000), (4000, 3000), (4, 24), (1, 216, 286), 15444),
    ((8000, 6000), (4142, 3107), (2, 1), (1, 222, 296), 16428),
    ((7168, 7168), (3584, 3584), (0, 0), (1, 256, 256), 16384),
    ((20000, 500), (7168, 179), (0, 17), (1, 14, 512), 1792),
]


@pytest.mark.parametrize("size,new,pad,grid,n", NAVIT_TABLE, ids=[f"{r[0][0]}x{r[0][1]}" for r in NAVIT_TABLE])
def test_navit_resize_matches_spec_table(size, new, pad, grid, n):
    assert navit_resize(*size, K3) == (*new, *pad)
    assert grid_for_size(*size, K3) == grid
    assert image_num_tokens(*size, K3) == n
    assert grid[1] * grid[2] == 4 * n


def test_navit_grid_for_sglang_example_and_1080p():
    assert grid_for_size(322, 224, K3) == (1, 16, 24)
    assert grid_for_size(1920, 1080, K3) == (1, 78, 138)
    assert image_num_tokens(1920, 1080, K3) == 2691


def test_fixed_output_tokens_overrides_token_count():
    cfg = PreprocessConfig(fixed_output_tokens=7)
    assert image_num_tokens(640, 480, cfg) == 7
    assert grid_for_size(640, 480, cfg) == (1, 36, 46)


def test_navit_resize_rejects_empty_size():
    with pytest.raises(ValueError, match="width"):
        navit_resize(0, 10, K3)


# =============================================================================================
# §2.1, §2.3-2.7 preprocessing
# =============================================================================================


def test_preprocess_shapes_padding_normalisation_and_patch_order():
    img = rgb_image(100, 70, seed=1)  # no resize; pads to 112 x 84
    out = preprocess_image(img, K3)
    assert out.grid_thw == (1, 6, 8) and out.num_tokens == 12 and out.size == (100, 70)
    assert out.pixel_values.shape == (48, 3, 14, 14) and out.pixel_values.dtype == torch.float32
    assert out.resized_uint8.shape == (84, 112, 3) and out.resized_uint8.dtype == np.uint8
    np.testing.assert_array_equal(out.resized_uint8[:70, :100], np.asarray(img))
    assert (out.resized_uint8[70:] == 0).all() and (out.resized_uint8[:, 100:] == 0).all()

    x = torch.from_numpy(out.resized_uint8).float()
    expected = ((x / 255 - 0.5) / 0.5).permute(2, 0, 1)  # [3, Hp, Wp]
    gw = 8
    for i, j in [(0, 0), (2, 5), (5, 7)]:
        torch.testing.assert_close(out.pixel_values[i * gw + j], expected[:, 14 * i:14 * i + 14, 14 * j:14 * j + 14],
                                   rtol=0, atol=0)
    image = out.pixel_values.view(6, 8, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 84, 112)
    assert (image[:, 70:] == -1.0).all() and (image[:, :, 100:] == -1.0).all()


def test_normalisation_of_every_byte_value_is_x_over_127_5_minus_1():
    px = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)
    out = preprocess_image(Image.fromarray(px, "RGB"), K3)  # pads to 28 x 28: 2 x 2 patches
    image = out.pixel_values.view(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
    want = (torch.from_numpy(px).float() / 255 - 0.5) / 0.5  # [16, 16, 3]
    torch.testing.assert_close(image[:, :16, :16], want.permute(2, 0, 1), rtol=0, atol=0)


def test_downscaled_image_is_pillow_bicubic_resize():
    cfg = PreprocessConfig(in_patch_limit=64)
    img = rgb_image(300, 200, seed=2)
    new_w, new_h, pad_w, pad_h = navit_resize(300, 200, cfg)
    assert (new_w, new_h) == (139, 93)
    out = preprocess_image(img, cfg)
    np.testing.assert_array_equal(out.resized_uint8[:new_h, :new_w],
                                  np.asarray(img.resize((new_w, new_h), Image.Resampling.BICUBIC)))
    assert out.resized_uint8.shape == (new_h + pad_h, new_w + pad_w, 3)


def _chessboard_expectation(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.where(((y // 8) + (x // 8)) % 2 == 1, 180, 255)


def test_transparent_rgba_is_composited_on_chessboard_after_resize():
    rgba = np.zeros((200, 300, 4), dtype=np.uint8)
    rgba[..., :3] = 77  # colour under alpha 0 must not show
    cfg = PreprocessConfig(in_patch_limit=64)  # forces a resize to 139 x 93
    out = preprocess_image(Image.fromarray(rgba, "RGBA"), cfg)
    px = out.resized_uint8
    assert (px[0:8, 0:8] == 255).all()  # top-left square white
    assert (px[0:8, 8:16] == 180).all() and (px[8:16, 0:8] == 180).all()
    assert (px[8:16, 8:16] == 255).all()
    np.testing.assert_array_equal(px[:93, :139, 0], _chessboard_expectation(93, 139))
    assert (px[93:] == 0).all() and (px[:, 139:] == 0).all()  # padding is black, not chessboard


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
def test_partial_alpha_blends_with_truncation(stage):
    h, w = 20, 30
    alpha = np.tile(np.linspace(0, 255, w).astype(np.uint8), (h, 1))
    rgba = np.zeros((h, w, 4), dtype=np.uint8)
    rgba[..., 0], rgba[..., 1], rgba[..., 2], rgba[..., 3] = 200, 100, 0, alpha
    cfg = PreprocessConfig(transparent_bg_fill_stage=stage)  # same size: no resize, both stages agree
    out = preprocess_image(Image.fromarray(rgba, "RGBA"), cfg)
    bg = _chessboard_expectation(h, w)[..., None].astype(np.uint8)
    a = alpha[..., None].astype(np.float32) / 255.0
    want = (a * rgba[..., :3] + (1 - a) * bg).astype(np.uint8)  # §2.4, (A)'s uint8 cast
    np.testing.assert_array_equal(out.resized_uint8[:h, :w], want)
    np.testing.assert_array_equal(out.resized_uint8[:h, 0], bg[:, 0].repeat(3, 1))  # alpha 0
    assert (out.resized_uint8[:h, w - 1] == [200, 100, 0]).all()  # alpha 255


def test_palette_image_with_transparency_keeps_alpha():
    img = Image.new("P", (20, 20), 0)
    img.putpalette([10, 20, 30, 250, 0, 0] + [0] * 762)
    img.paste(1, (10, 0, 20, 20))  # right half: opaque red
    img.info["transparency"] = 0  # left half: transparent
    out = preprocess_image(img, K3)
    px = out.resized_uint8
    np.testing.assert_array_equal(px[:20, :10, 1], _chessboard_expectation(20, 10))
    assert (px[:20, 10:20] == [250, 0, 0]).all()

    del img.info["transparency"]
    opaque = preprocess_image(img, K3).resized_uint8
    assert (opaque[:20, :10] == [10, 20, 30]).all()


def test_la_image_keeps_alpha_and_grayscale_becomes_rgb():
    la = Image.fromarray(np.zeros((16, 16, 2), dtype=np.uint8), "LA")
    assert (preprocess_image(la, K3).resized_uint8[:8, 8:16] == 180).all()

    gray = np.random.default_rng(3).integers(0, 256, (30, 40), dtype=np.uint8)
    out = preprocess_image(Image.fromarray(gray, "L"), K3)
    for c in range(3):
        np.testing.assert_array_equal(out.resized_uint8[:30, :40, c], gray)


def test_no_background_config_drops_alpha():
    rgba = np.zeros((16, 16, 4), dtype=np.uint8)
    rgba[..., 0] = 90
    out = preprocess_image(Image.fromarray(rgba, "RGBA"), PreprocessConfig(transparent_bg_config=None))
    assert (out.resized_uint8[:16, :16] == [90, 0, 0]).all()


def test_load_image_decodes_bytes_and_names_garbage():
    buf = io.BytesIO()
    rgb_image(30, 20, seed=6).save(buf, format="PNG")
    img = load_image(buf.getvalue())
    assert img.size == (30, 20) and preprocess_image(img, K3).size == (30, 20)
    with pytest.raises(ValueError, match="cannot decode"):
        load_image(b"not an image")


def test_1080p_image_gives_2691_tokens():
    out = preprocess_image(rgb_image(1920, 1080, seed=4), K3)
    assert out.pixel_values.shape == (10764, 3, 14, 14)
    assert out.grid_thw == (1, 78, 138) and out.num_tokens == 2691 and out.size == (1920, 1080)


@pytest.mark.parametrize("size", [(10, 10), (322, 224), (333, 517)], ids=str)
def test_token_helpers_agree_with_preprocess(size):
    out = preprocess_image(rgb_image(*size, seed=5), K3)
    assert out.grid_thw == grid_for_size(*size, K3)
    assert out.num_tokens == image_num_tokens(*size, K3)


# --------------------------------------------------------------------------- config JSON


def test_preprocess_config_json_round_trip_and_unknown_keys(tmp_path):
    raw = {"auto_map": {"AutoProcessor": "x"}, "media_proc_cfg": {
        "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "temporal_merge_kernel_size": 4, "config_type": "moonvit",
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                  "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                  "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize"}}
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(raw))
    cfg = PreprocessConfig.from_json(path)
    assert cfg == PreprocessConfig(in_patch_limit=16384)
    cfg.to_json(tmp_path / "out.json")
    assert PreprocessConfig.from_json(tmp_path / "out.json") == cfg
    assert PreprocessConfig.from_json(tmp_path / "out.json").transparent_bg_config == TransparentBgConfig()


@pytest.mark.parametrize("key,value", [
    ("patch_size", "14"),
    ("in_patch_limit", 1.5),
    ("fixed_output_tokens", "none"),
    ("image_mean", [0.5, "a", 0.5]),
    ("image_std", 0.5),
    ("transparent_bg_fill_stage", 3),
    ("transparent_bg_config", "chessboard"),
], ids=lambda v: str(v))
def test_preprocess_config_wrong_type_names_the_key(tmp_path, key, value):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"media_proc_cfg": {key: value}}))
    with pytest.raises(ValueError, match=key):
        PreprocessConfig.from_json(path)


def test_preprocess_config_nested_wrong_type_names_the_key(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"transparent_bg_config": {"chessboard_square_size": 8.5}}))
    with pytest.raises(ValueError, match="chessboard_square_size"):
        PreprocessConfig.from_json(path)


# =============================================================================================
# Transcription of §4 in float64 (no code shared with the module)
# =============================================================================================


def ref_rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_gelu_tanh(u):
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


def ref_gelu_erf(u):
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def ref_bilinear_weights(n_out: int, n_in: int) -> torch.Tensor:
    """[n_out, n_in]: align_corners=False source coordinate, clamped at 0, linear between neighbours."""
    a = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        a[i, i0] += 1 - lam
        a[i, i1] += lam
    return a


def ref_pos_2d(table, h, w):
    H, W, d = table.shape
    if (h, w) == (H, W):
        return table.reshape(H * W, d)
    a_h, a_w = ref_bilinear_weights(h, H), ref_bilinear_weights(w, W)
    return torch.einsum("ia,jb,abd->ijd", a_h, a_w, table).reshape(h * w, d)


def ref_time_table(t, d):
    out = torch.zeros(t, d, dtype=torch.float64)
    for tau in range(t):
        for k in range(d // 2):
            omega = 10000 ** (-k / (d // 2))
            out[tau, k], out[tau, d // 2 + k] = math.sin(tau * omega), math.cos(tau * omega)
    return out


def ref_rope(x, t, h, w):
    """x [t·h·w, H, D]: pair m = 2k turns by column·θ_k, m = 2k+1 by row·θ_k; θ_k = 10000^(-4k/D)."""
    D = x.shape[-1]
    n = torch.arange(t * h * w) % (h * w)
    row, col = (n // w).double(), (n % w).double()
    out = x.clone()
    for m in range(D // 2):
        theta = 10000 ** (-4 * (m // 2) / D)
        phi = ((col if m % 2 == 0 else row) * theta)[:, None]  # [n, 1]
        a, b = x[..., 2 * m], x[..., 2 * m + 1]
        out[..., 2 * m] = a * torch.cos(phi) - b * torch.sin(phi)
        out[..., 2 * m + 1] = a * torch.sin(phi) + b * torch.cos(phi)
    return out


def ref_merge(x, t, h, w):
    """[t·h·w, d] -> [h/2·w/2, 4, d], token I·(w/2)+J = rows (2I+a, 2J+b), (a,b) in (0,0),(0,1),(1,0),(1,1)."""
    tokens = []
    for I in range(h // 2):
        for J in range(w // 2):
            subs = [torch.stack([x[tau * h * w + (2 * I + a) * w + 2 * J + b] for tau in range(t)]).mean(0)
                    for a, b in ((0, 0), (0, 1), (1, 0), (1, 1))]
            tokens.append(torch.stack(subs))
    return torch.stack(tokens)


def ref_projector(merged, sd, eps):
    u = merged.reshape(merged.shape[0], -1)
    z = ref_gelu_erf(u @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return ref_rms_norm(z, sd["mm_projector.post_norm.weight"], eps)


def ref_image(pixels, grid, sd, cfg):
    """One image through the tower and projector, straight from §4.1-§4.11."""
    t, h, w = grid
    eps = torch.finfo(torch.float32).eps
    nh, D = cfg.vt_num_attention_heads, cfg.head_dim
    x = pixels.reshape(len(pixels), -1) @ sd["vision_tower.patch_embed.proj.weight"].reshape(cfg.vt_hidden_size, -1).T
    pos = ref_pos_2d(sd["vision_tower.patch_embed.pos_emb.weight"], h, w)
    if t > 1:
        pos = (pos[None] + ref_time_table(t, cfg.vt_hidden_size)[:, None]).reshape(t * h * w, -1)
    x = x + pos
    for i in range(cfg.vt_num_hidden_layers):
        p = f"vision_tower.encoder.blocks.{i}."
        y = ref_rms_norm(x, sd[p + "norm0.weight"], eps)
        qkv = y @ sd[p + "wqkv.weight"].T
        q, k, v = (qkv[:, j * nh * D:(j + 1) * nh * D].reshape(-1, nh, D) for j in range(3))
        q, k = ref_rope(q, t, h, w), ref_rope(k, t, h, w)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D), dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(-1, nh * D)
        x = x + o @ sd[p + "wo.weight"].T
        y = ref_rms_norm(x, sd[p + "norm1.weight"], eps)
        x = x + ref_gelu_tanh(y @ sd[p + "mlp.fc0.weight"].T) @ sd[p + "mlp.fc1.weight"].T
    x = ref_rms_norm(x, sd["vision_tower.encoder.final_layernorm.weight"], eps)
    return ref_projector(ref_merge(x, t, h, w), sd, cfg.projector_ln_eps)


# =============================================================================================
# §4 tower and projector
# =============================================================================================


@pytest.mark.parametrize("grid,head_dim", [((1, 3, 5), 8), ((2, 2, 4), 24), ((1, 6, 2), 128)], ids=str)
def test_rope_2d_layout_even_pairs_column_odd_pairs_row(grid, head_dim):
    t, h, w = grid
    x = torch.randn(t * h * w, 3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    got = apply_rope_2d(x, rope_2d_freqs([grid], head_dim, torch.float64))
    # fully explicit per-element loop for one head
    want = x.clone()
    for n in range(t * h * w):
        r, c = (n % (h * w)) // w, (n % (h * w)) % w
        for m in range(head_dim // 2):
            phi = (c if m % 2 == 0 else r) * 10000 ** (-4 * (m // 2) / head_dim)
            a, b = x[n, 0, 2 * m].item(), x[n, 0, 2 * m + 1].item()
            want[n, 0, 2 * m] = a * math.cos(phi) - b * math.sin(phi)
            want[n, 0, 2 * m + 1] = a * math.sin(phi) + b * math.cos(phi)
    torch.testing.assert_close(got[:, 0], want[:, 0], **F64_TOL)
    torch.testing.assert_close(got, ref_rope(x, t, h, w), **F64_TOL)


@pytest.mark.parametrize("hw", [(6, 10), (16, 16), (20, 36), (2, 2)], ids=str)
def test_pos_emb_interpolation_matches_bilinear_formula(hw):
    model = random_model(tiny_cfg(), seed=21)
    pos_emb = model.vision_tower.patch_embed.pos_emb
    got = pos_emb([(1, *hw)])
    want = ref_pos_2d(pos_emb.weight.detach(), *hw)
    torch.testing.assert_close(got, want, **F64_TOL)
    if hw == (16, 16):
        assert torch.equal(got, pos_emb.weight.flatten(0, 1))  # the table as is, no interpolation


def test_pos_emb_time_term_for_video_grid():
    model = random_model(tiny_cfg(), seed=22)
    pos_emb = model.vision_tower.patch_embed.pos_emb
    got = pos_emb([(3, 4, 6)]).view(3, 24, -1)
    space = ref_pos_2d(pos_emb.weight.detach(), 4, 6)
    torch.testing.assert_close(got, space[None] + ref_time_table(3, 32)[:, None], **F64_TOL)


def test_merge_order_is_top_left_top_right_bottom_left_bottom_right():
    t, h, w, d = 1, 4, 6, 5
    x = torch.randn(t * h * w, d, dtype=torch.float64)
    got = tpool_patch_merger(x, [(t, h, w)])
    assert got.shape == (6, 4, d)
    assert torch.equal(got, ref_merge(x, t, h, w))
    # token (I=1, J=2) = rows 2..3, columns 4..5 of the patch grid
    assert torch.equal(got[1 * 3 + 2], torch.stack([x[2 * w + 4], x[2 * w + 5], x[3 * w + 4], x[3 * w + 5]]))


def test_tpool_on_two_frames_is_mean_of_each_frames_merge():
    h, w, d = 4, 6, 8
    x = torch.randn(2 * h * w, d, dtype=torch.float64)
    both = tpool_patch_merger(x, [(2, h, w)])
    frames = [tpool_patch_merger(x[i * h * w:(i + 1) * h * w], [(1, h, w)]) for i in range(2)]
    torch.testing.assert_close(both, (frames[0] + frames[1]) / 2, rtol=0, atol=1e-15)


def test_identical_frames_without_time_term_encode_like_the_still_image(monkeypatch):
    """With T excluded (§4.3.4), two equal frames see duplicated keys: softmax is unchanged, the rows of
    both frames equal the still image's, and the temporal mean (§4.10) gives the still image's tokens."""
    monkeypatch.setattr(vision, "sincos_time_table", lambda t, d, dtype, device=None: torch.zeros(t, d, dtype=dtype, device=device))
    model = random_model(tiny_cfg(), seed=23)
    pixels = torch.randn(24, 3, 14, 14, dtype=torch.float64, generator=torch.Generator().manual_seed(24))
    with torch.inference_mode():
        video = model(torch.cat([pixels, pixels]), [(2, 4, 6)])
        still = model(pixels, [(1, 4, 6)])
    torch.testing.assert_close(video, still, **F64_TOL)


def test_projector_matches_spec():
    cfg = tiny_cfg()
    model = random_model(cfg, seed=31)
    merged = torch.randn(7, 4, cfg.vt_hidden_size, dtype=torch.float64)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    torch.testing.assert_close(model.mm_projector(merged), ref_projector(merged, sd, cfg.projector_ln_eps), **F64_TOL)


@contextlib.contextmanager
def math_path_in_small_blocks(monkeypatch, scores: int):
    """SDPA restricted to its math path (the one that materialises scores), with a block budget of
    `scores`; yields the [H, rows, keys] of every SDPA call."""
    calls: list[tuple[int, int, int]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-3], q.shape[-2], k.shape[-2]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(vision, "ATTENTION_BLOCK_SCORES", scores)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with sdpa_kernel(SDPBackend.MATH):
        yield calls


@pytest.mark.parametrize("path", ["fused", "math-blocked"])
def test_full_model_matches_spec_transcription_float64(path, monkeypatch):
    cfg = tiny_cfg()
    model = random_model(cfg, seed=41)
    grids = [(1, 4, 6), (1, 16, 16), (2, 4, 4), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(42))
    with contextlib.ExitStack() as stack, torch.inference_mode():
        if path == "math-blocked":  # 256 patches x 2 heads: blocks of 9 query rows
            calls = stack.enter_context(math_path_in_small_blocks(monkeypatch, scores=5000))
        got = model(pixels, grids)
        assert torch.equal(model(pixels, torch.tensor(grids)), got)  # grid_thws as int64 [B, 3] too
        with pytest.raises(ValueError, match="host ints expected"):  # not from a device: that would sync
            model(pixels, torch.tensor(grids, device="meta"))
    if path == "math-blocked":
        assert max(h * rows * keys for h, rows, keys in calls) <= 5000
        assert (cfg.vt_num_attention_heads, 9, 256) in calls and len(calls) > 2 * cfg.vt_num_hidden_layers * len(grids)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    want, off = [], 0
    for t, h, w in grids:
        want.append(ref_image(pixels[off:off + t * h * w], (t, h, w), sd, cfg))
        off += t * h * w
    assert got.shape == (6 + 64 + 4 + 1, cfg.text_hidden_size)
    torch.testing.assert_close(got, torch.cat(want), **F64_TOL)


def test_attention_rows_do_not_depend_on_the_query_blocks(monkeypatch):
    """Query blocks change where each SDPA call starts, not any row's softmax: the blocked math path
    equals one unblocked call (float64), and the same image always gets the same blocks."""
    g = torch.Generator().manual_seed(81)
    q, k, v = (torch.randn(300, 2, 24, dtype=torch.float64, generator=g) for _ in range(3))
    whole = vision.image_attention(q, k, v)
    assert whole.shape == (300, 48)
    with math_path_in_small_blocks(monkeypatch, scores=2 * 300 * 7) as calls:
        blocked = vision.image_attention(q, k, v)
        assert torch.equal(vision.image_attention(q, k, v), blocked)
    assert calls[:43] == [(2, 7, 300)] * 42 + [(2, 6, 300)]  # 300 = 42 * 7 + 6
    torch.testing.assert_close(blocked, whole, **F64_TOL)


def test_large_image_tower_memory_is_linear_in_patches():
    """A 16384-patch image (a 1792x1792 px one) through the tiny tower: its attention scores alone
    would be 2 heads x 16384² x 4 bytes = 2 GiB per layer; the peak RSS must stay far below that.
    Run in a fresh process so that the peak is this forward's."""
    code = textwrap.dedent("""
        import resource, torch
        from k3backend.config import K3Config
        from k3backend.model.vision import K3VisionModel
        from k3backend.presets import preset_config
        torch.set_num_threads(1)
        model = K3VisionModel(K3Config.from_dict(preset_config("tiny")).vision).float()
        pixels = torch.randn(128 * 128, 3, 14, 14)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with torch.inference_mode():
            out = model(pixels, [(1, 128, 128)])
        assert out.shape == (64 * 64, 64) and bool(torch.isfinite(out).all())
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = int(proc.stdout.split()[-1])
    assert grew < 512 << 20, f"peak RSS grew by {grew / 2**20:.0f} MiB for 16384 patches"


def test_tower_rmsnorm_matches_torch_rmsnorm_with_eps_unset():
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(64, 32) * 3).to(dtype)
        ours = vision.RMSNorm(32, vision.TOWER_NORM_EPS).to(dtype)
        theirs = torch.nn.RMSNorm(32).to(dtype)
        with torch.no_grad():
            w = torch.randn(32).to(dtype)
            ours.weight.copy_(w), theirs.weight.copy_(w)
            assert torch.equal(ours(x), theirs(x)), dtype


def test_images_do_not_interact_bitwise_float32():
    """Packed A+B gives A's and B's rows bit for bit (no cross-image attention, no batch statistics).

    The projector rows are checked for images of >= 12 merged tokens: this CPU BLAS takes another
    GEMM kernel for 1-11 rows that are not a multiple of 4, so a lone tiny image differs in the last
    bit there; the tower rows (always a multiple of 4 patches) are checked for every size.
    """
    model = random_model(tiny_cfg(), seed=51, dtype=torch.float32)
    grids = [(1, 8, 10), (1, 6, 8), (1, 2, 2), (1, 4, 6)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=torch.Generator().manual_seed(52))
    parts = pixels.split([t * h * w for t, h, w in grids])
    with torch.inference_mode():
        tower_all = model.vision_tower(pixels, grids).split([h * w // 4 for _, h, w in grids])
        for part, grid, rows in zip(parts, grids, tower_all):
            assert torch.equal(model.vision_tower(part, [grid]), rows), grid
        both = model(torch.cat(parts[:2]), grids[:2])
        a, b = model(parts[0], grids[:1]), model(parts[1], grids[1:2])
    assert torch.equal(both, torch.cat([a, b]))


def test_bfloat16_forward_tracks_float32():
    model = random_model(tiny_cfg(), seed=61, dtype=torch.float32)
    grids = [(1, 6, 8), (1, 16, 16)]
    pixels = torch.randn(304, 3, 14, 14, generator=torch.Generator().manual_seed(62))
    with torch.inference_mode():
        ref = model(pixels, grids)
        got = model.to(torch.bfloat16)(pixels, grids)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    rel = (got.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel


def test_encode_640x480_image_through_tiny_tower():
    cfg = tiny_cfg()
    model = random_model(cfg, seed=71, dtype=torch.float32)
    images = [preprocess_image(rgb_image(640, 480, seed=72), K3), preprocess_image(rgb_image(322, 224, seed=73), K3)]
    with torch.inference_mode():
        rows = model.encode_images(images)
    assert [r.shape for r in rows] == [(414, cfg.text_hidden_size), (96, cfg.text_hidden_size)]
    assert all(torch.isfinite(r).all() for r in rows)


@pytest.mark.parametrize("pixels,grids,match", [
    (torch.zeros(24, 3, 14, 12), [(1, 4, 6)], "pixel_values"),
    (torch.zeros(20, 3, 14, 14), [(1, 4, 6)], "Σ t·h·w"),
    (torch.zeros(15, 3, 14, 14), [(1, 3, 5)], "merge kernel"),
    (torch.zeros(120, 3, 14, 14), [(5, 4, 6)], "init_pos_emb_time"),
], ids=["patch-shape", "count", "odd-grid", "too-many-frames"])
def test_bad_inputs_name_the_problem(pixels, grids, match):
    with pytest.raises(ValueError, match=match):
        K3VisionModel(tiny_cfg())(pixels, grids)


# =============================================================================================
# §5 checkpoint names
# =============================================================================================


def test_state_dict_matches_checkpoint_table_for_full_size_k3():
    expected = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    for i in range(27):
        p = f"vision_tower.encoder.blocks.{i}."
        expected |= {p + "norm0.weight": (1024,), p + "norm1.weight": (1024,), p + "wqkv.weight": (4608, 1024),
                     p + "wo.weight": (1024, 1536), p + "mlp.fc0.weight": (4096, 1024),
                     p + "mlp.fc1.weight": (1024, 4096)}
    with torch.device("meta"):
        model = K3VisionModel(VisionConfig())
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected
    assert sum(k.startswith("vision_tower.") for k in got) == 165
    assert sum(k.startswith("mm_projector.") for k in got) == 3
