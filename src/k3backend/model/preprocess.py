"""Kimi-K3 image preprocessing with Pillow (K3_VISION.md §2, reference path (A)).

decode -> NaViT resize rule (§2.2) -> Pillow bicubic resize (§2.3) -> transparency composited
onto a chessboard (§2.4) -> pad bottom/right with 0 (§2.5) -> normalise (§2.6) -> 14x14 patches
in row-major order (§2.7).

One deliberate difference from Moonshot's `media_utils.py`: that file resizes the image in its
decoded mode, so a palette ("P") image is resized with NEAREST (Pillow forces it) and CMYK is
resized before conversion. Here, as in SGLang's `to_chw_uint8`, the image is first converted to
RGB or RGBA (§2.1) and then resized bicubically.

`image_num_tokens` / `grid_for_size` need only the original size, so the tokenizer side can count
`<|media_pad|>` tokens without touching pixels.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from k3backend.config import ConfigError, read_json_object

_PATTERNS = ("chessboard", "white", "black", "gray")
_FILL_STAGES = ("after_resize", "before_resize")
_SOLID_BG = {"white": 255, "black": 0, "gray": 128}


@dataclass(frozen=True)
class TransparentBgConfig:
    """`transparent_bg_config` (§1.2, §2.4): what shows through transparent pixels."""

    pattern: str = "chessboard"
    chessboard_square_size: int = 8
    chessboard_square_on_top_left: bool = True  # top-left square is white
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180

    def __post_init__(self) -> None:
        p = "transparent_bg_config."
        _need_type(p + "pattern", self.pattern, str)
        if self.pattern not in _PATTERNS:
            raise ConfigError(f"{p}pattern: expected one of {list(_PATTERNS)}, got {self.pattern!r}")
        _need_type(p + "chessboard_square_on_top_left", self.chessboard_square_on_top_left, bool)
        _need_int(p + "chessboard_square_size", self.chessboard_square_size, lo=1)
        _need_int(p + "chessboard_white_value", self.chessboard_white_value, lo=0, hi=255)
        _need_int(p + "chessboard_gray_value", self.chessboard_gray_value, lo=0, hi=255)

    def background(self, height: int, width: int) -> np.ndarray:
        """uint8 [height, width, 3]: cell(y, x) = (y//s + x//s) mod 2, gray where it is 1 (§2.4)."""
        if self.pattern != "chessboard":
            return np.full((height, width, 3), _SOLID_BG[self.pattern], dtype=np.uint8)
        s = self.chessboard_square_size
        cell = (np.arange(height)[:, None] // s + np.arange(width)[None, :] // s) % 2  # [h, w]
        gray_cell = 1 if self.chessboard_square_on_top_left else 0
        bg = np.where(cell == gray_cell, self.chessboard_gray_value, self.chessboard_white_value)
        return np.repeat(bg.astype(np.uint8)[:, :, None], 3, axis=2)


@dataclass(frozen=True)
class PreprocessConfig:
    """`preprocessor_config.json` -> `media_proc_cfg` (§1.2), K3 values as defaults."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # None: no compositing, alpha is dropped at decode.
    transparent_bg_config: TransparentBgConfig | None = field(default_factory=TransparentBgConfig)
    transparent_bg_fill_stage: str = "after_resize"

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            _need_int(name, getattr(self, name), lo=1)
        if self.fixed_output_tokens is not None:
            _need_int("fixed_output_tokens", self.fixed_output_tokens, lo=1)
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if isinstance(v, list):  # frozen: coerce once so the config stays hashable
                object.__setattr__(self, name, v := tuple(v))
            if not (isinstance(v, tuple) and len(v) == 3
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
                raise ConfigError(f"{name}: expected 3 finite numbers, got {v!r}")
        if any(s == 0 for s in self.image_std):
            raise ConfigError(f"image_std: must be non-zero, got {self.image_std!r}")
        if self.transparent_bg_config is not None and not isinstance(self.transparent_bg_config, TransparentBgConfig):
            raise ConfigError(f"transparent_bg_config: expected TransparentBgConfig or None, "
                              f"got {type(self.transparent_bg_config).__name__}")
        _need_type("transparent_bg_fill_stage", self.transparent_bg_fill_stage, str)
        if self.transparent_bg_fill_stage not in _FILL_STAGES:
            raise ConfigError(f"transparent_bg_fill_stage: expected one of {list(_FILL_STAGES)}, "
                              f"got {self.transparent_bg_fill_stage!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PreprocessConfig":
        """Parse `media_proc_cfg` (or a whole preprocessor_config.json holding one).

        Unknown keys are ignored (the file carries video and processor-class keys); missing keys
        take the K3 defaults; a known key of the wrong type raises `ConfigError` naming it.
        """
        if isinstance(d.get("media_proc_cfg"), dict):
            d = d["media_proc_cfg"]
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
        mks = kw.get("merge_kernel_size")
        if isinstance(mks, list):  # the tower config spells it [2, 2]
            if len(mks) != 2 or mks[0] != mks[1]:
                raise ConfigError(f"merge_kernel_size: expected an int or a square [m, m], got {mks!r}")
            kw["merge_kernel_size"] = mks[0]
        for name in ("image_mean", "image_std"):
            if name in kw:
                if not isinstance(kw[name], list):
                    raise ConfigError(f"{name}: expected a list of 3 numbers, got {kw[name]!r}")
                kw[name] = tuple(kw[name])
        if "transparent_bg_config" in kw and kw["transparent_bg_config"] is not None:
            bg = kw["transparent_bg_config"]
            if not isinstance(bg, dict):
                raise ConfigError(f"transparent_bg_config: expected an object or null, got {bg!r}")
            bg_known = {f.name for f in fields(TransparentBgConfig)}
            kw["transparent_bg_config"] = TransparentBgConfig(**{k: v for k, v in bg.items() if k in bg_known})
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "PreprocessConfig":
        """Read `preprocessor_config.json` (a checkpoint directory is also accepted)."""
        path = Path(path)
        raw = read_json_object(path, "preprocessor_config.json")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    def to_json(self, path: str | Path) -> None:
        """Write the checkpoint layout `{"media_proc_cfg": {...}}` that `from_json` reads back."""
        Path(path).write_text(json.dumps({"media_proc_cfg": self.to_dict()}, indent=2) + "\n")


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready for the tower, plus what the prompt and the cache key need."""

    pixel_values: torch.Tensor  # [gh*gw, 3, p, p] float32, patches row-major (§2.7)
    grid_thw: tuple[int, int, int]  # (1, gh, gw)
    size: tuple[int, int]  # (W0, H0) as decoded, written into the prompt (§6.3)
    num_tokens: int  # N = gh*gw/4 (or fixed_output_tokens)
    resized_uint8: np.ndarray  # [Hp, Wp, 3] uint8: resized, composited, padded; for hashing


def navit_resize(w0: int, h0: int, cfg: PreprocessConfig) -> tuple[int, int, int, int]:
    """(new_w, new_h, pad_w, pad_h) by the NaViT rule (§2.2), the reference's exact arithmetic.

    s1 uses the floored patch counts of the original, so the final patch count may exceed
    in_patch_limit slightly (8000x6000 -> 65712 patches); that is the reference behaviour.
    """
    for name, v in (("width", w0), ("height", h0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"image {name}: expected a positive integer, got {v!r}")
    p, m, side = cfg.patch_size, cfg.merge_kernel_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, w0 // p) * max(1.0, h0 // p)))
    s2 = side * p / w0
    s3 = side * p / h0
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(w0 * scale)), side * p)
    new_h = min(max(1, int(h0 * scale)), side * p)
    f = m * p
    pad_w = (f - new_w % f) % f
    pad_h = (f - new_h % f) % f
    for name, n in (("width", new_w + pad_w), ("height", new_h + pad_h)):
        if n // p > side:  # the tower's RoPE table is side x side patches (§2.2 step 8, §4.7)
            raise ValueError(f"image {w0}x{h0}: padded {name} {n} px is {n // p} patches > "
                             f"patch_limit_on_one_side {side}")
    return new_w, new_h, pad_w, pad_h


def grid_for_size(w0: int, h0: int, cfg: PreprocessConfig) -> tuple[int, int, int]:
    """grid_thw = (1, gh, gw) for an original W0 x H0 image, without decoding pixels."""
    new_w, new_h, pad_w, pad_h = navit_resize(w0, h0, cfg)
    return 1, (new_h + pad_h) // cfg.patch_size, (new_w + pad_w) // cfg.patch_size


def image_num_tokens(w0: int, h0: int, cfg: PreprocessConfig) -> int:
    """N, the number of `<|media_pad|>` tokens (= tower output rows) for a W0 x H0 image."""
    if cfg.fixed_output_tokens is not None:
        return cfg.fixed_output_tokens
    _, gh, gw = grid_for_size(w0, h0, cfg)
    return (gh // cfg.merge_kernel_size) * (gw // cfg.merge_kernel_size)


def load_image(data: bytes | str | Path) -> Image.Image:
    """Decode encoded image bytes or a file with Pillow (EXIF orientation is not applied, §2.1)."""
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data)
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image: cannot decode ({e})") from None
    return image


def preprocess_image(image: Image.Image, cfg: PreprocessConfig | None = None) -> ProcessedImage:
    """Pillow image -> `ProcessedImage` (§2.1-§2.7); `cfg` defaults to the K3 values."""
    cfg = cfg or PreprocessConfig()
    w0, h0 = image.size
    new_w, new_h, pad_w, pad_h = navit_resize(w0, h0, cfg)
    bg = cfg.transparent_bg_config

    mode = "RGBA" if bg is not None and has_alpha(image) else "RGB"
    if image.mode != mode:
        image = image.convert(mode)
    if image.mode == "RGBA" and cfg.transparent_bg_fill_stage == "before_resize":
        image = Image.fromarray(composite_on_background(np.asarray(image), bg))
    # Pillow's bicubic is antialiased and premultiplies alpha for RGBA (§2.3).
    pixels = np.asarray(image.resize((new_w, new_h), Image.Resampling.BICUBIC))  # [h, w, 3|4] uint8
    if pixels.shape[2] == 4:
        pixels = composite_on_background(pixels, bg)  # [h, w, 3]
    padded = np.pad(pixels, ((0, pad_h), (0, pad_w), (0, 0)), constant_values=0)  # [Hp, Wp, 3]

    x = normalize(padded, cfg.image_mean, cfg.image_std)  # [Hp, Wp, 3] float32
    p = cfg.patch_size
    gh, gw = padded.shape[0] // p, padded.shape[1] // p
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    num_tokens = cfg.fixed_output_tokens or (gh // cfg.merge_kernel_size) * (gw // cfg.merge_kernel_size)
    return ProcessedImage(
        pixel_values=torch.from_numpy(np.ascontiguousarray(patches)),
        grid_thw=(1, gh, gw),
        size=(w0, h0),
        num_tokens=num_tokens,
        resized_uint8=padded,
    )


def has_alpha(image: Image.Image) -> bool:
    """An alpha band or palette/tRNS transparency on a non-RGB image (§2.1, SGLang's test)."""
    return image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)


def composite_on_background(rgba: np.ndarray, bg: TransparentBgConfig) -> np.ndarray:
    """uint8 [h, w, 4] -> uint8 [h, w, 3]: trunc(a*RGB + (1-a)*background) in float32 (§2.4).

    The float32 arithmetic and the truncating cast are the reference's; they matter where the
    exact result is an integer and float32 lands just below it.
    """
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0  # [h, w, 1]
    background = bg.background(rgba.shape[0], rgba.shape[1])  # [h, w, 3] uint8
    out = alpha * rgba[:, :, :3] + (1 - alpha) * background  # float32
    return np.clip(out, 0, 255).astype(np.uint8)


def normalize(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 [..., 3] -> float32 (x/255 - mean) * (1/std) with the reference's roundings (§2.6).

    x/255 is taken in float64 and rounded to float32; mean and 1/std are float64, applied in
    place to the float32 array, as Moonshot's `normalize` does.
    """
    x = (pixels / 255.0).astype(np.float32)
    x -= np.asarray(mean, dtype=np.float64)
    x *= 1.0 / np.asarray(std, dtype=np.float64)
    return x


def _need_type(name: str, value: Any, typ: type) -> None:
    if not isinstance(value, typ):
        raise ConfigError(f"{name}: expected {typ.__name__}, got {value!r}")


def _need_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{name}: expected an integer in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
