"""Fuzz classes for images (SERVING.md §2.2 image inputs, §3 k3_vision, §4.2 precomputed embeddings).

Images travel through k3_ensemble (gRPC stream, /generate, /generate_stream) or go to k3_vision
directly (gRPC ModelInfer, HTTP /infer), as `image` base64, `image_url_input` data URIs or
`messages` parts; precomputed embeddings go to k3_lm. Every URL that is not a data URI is
refused by policy before any connection ([VIS-5]; remote URLs are off): the loopback ones point
at the harness's canary port, which counts connections so a broken policy shows.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import ml_dtypes
import numpy as np
from PIL import Image

from fuzz_gen import BAD, CORE, GEN_PROTOCOLS, OK, PLACEHOLDER, Case, Gen
from fuzz_wire import Request, Wire

EITHER = frozenset({"ok", "INVALID_ARG"})  # damage Pillow may or may not notice
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
VISION_PROTOCOLS = ("grpc_infer", "http_infer")
# /generate reads pixels from nested JSON lists and refuses shapes its parser cannot infer (500).
PIXEL_PROTOCOLS = ("grpc", "grpc_infer", "http_infer")


def encoded_image(g: Gen, fmt: str | None = None, size: tuple[int, int] | None = None) -> bytes:
    """A small random image file (small keeps the tower cheap on CPU)."""
    w, h = size or (g.rng.randint(8, 48), g.rng.randint(8, 48))
    pixels = np.random.default_rng(g.rng.randrange(2**32)).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return _save(Image.fromarray(pixels), fmt or g.choice(FORMATS))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{b64(data)}"


def image_target(g: Gen, kind: str, expect: frozenset[str], values: dict,
                 protocols: tuple[str, ...] = (*GEN_PROTOCOLS, *VISION_PROTOCOLS)) -> Case:
    """The image request `values` to k3_vision directly (ModelInfer, /infer) or through k3_ensemble
    (a cheap generation around them)."""
    protocol = g.choice(protocols)
    if protocol in VISION_PROTOCOLS:
        return g.case(kind, expect, values, model="k3_vision", protocol=protocol)
    return g.case(kind, expect, {**g.cheap(protocol), **values}, model="k3_ensemble", protocol=protocol)


def image_case(g: Gen, kind: str, expect: frozenset[str], sources: list[tuple[str, str]], *,
               how: str | None = None, placeholders: int | None = None, extra: dict | None = None,
               protocols: tuple[str, ...] = (*GEN_PROTOCOLS, *VISION_PROTOCOLS)) -> Case:
    """Send images, each ("url", URL) or ("base64", data), through k3_ensemble or to k3_vision.

    how: `image` / `image_url_input` tensors (a source of the other form is converted) or
    `messages` parts; `placeholders`: how many the prompt holds (default: one per image).
    """
    how = how or g.choice(("image", "image_url_input", "messages"))
    n = len(sources) if placeholders is None else placeholders
    values: dict = {}
    if how == "messages":
        parts = [{"type": "image_url", "image_url": {"url": v}} if k == "url" else {"type": "image", "image": v}
                 for k, v in sources][:n] + [{"type": "image"}] * max(0, n - len(sources))
        values.update(text_input="", messages=json.dumps([{"role": "user", "content": [
            *parts, {"type": "text", "text": "Describe."}]}]))
    else:
        items = [v if (k == "url") == (how == "image_url_input") else _convert(k, v) for k, v in sources]
        values.update(text_input=PLACEHOLDER * n + " Describe.", **{how: items})
        if not n:
            values["text_input"] = "Describe."
    values.update(extra or {})
    return image_target(g, kind, expect, values, protocols)


def _convert(kind: str, value: str) -> str:
    """A source in the other tensor's form: a base64 payload as a data URI, or a data URI's payload."""
    if kind == "base64":
        return "data:image/png;base64," + value
    return value.split(",", 1)[1] if value.startswith("data:") and "," in value else value


# ---- damaged image files ---------------------------------------------------------------------


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a one-pixel IDAT: refused from the header
    (max_image_pixels) before any pixel is decoded."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00")) + \
        chunk(b"IEND", b"")


def image_damaged(g: Gen) -> Case:
    """Truncated, bit-flipped, empty, junk or decompression-bomb image files."""
    fmt = g.choice(FORMATS)
    data = encoded_image(g, fmt)
    variant = g.choice(("truncated", "truncated-tail", "flipped", "junk", "empty", "header-only", "bomb",
                        "valid"))
    expect = BAD
    if variant == "truncated":
        data = data[: g.rng.randint(0, len(data) * 6 // 10)]
    elif variant == "truncated-tail":
        data, expect = data[: g.rng.randint(len(data) * 6 // 10, len(data) - 1)], EITHER
    elif variant == "flipped":
        spoiled = bytearray(data)
        for _ in range(g.rng.randint(1, 8)):
            spoiled[g.rng.randrange(len(spoiled))] ^= 1 << g.rng.randrange(8)
        data, expect = bytes(spoiled), EITHER
    elif variant == "junk":
        data = bytes(g.rng.randrange(256) for _ in range(g.rng.randint(1, 4000)))
    elif variant == "empty":
        data = b""
    elif variant == "header-only":
        data = data[:g.rng.randint(4, 40)]
    elif variant == "bomb":
        data = _bomb_png(g.choice((100_000, 65_535, 2**31 - 1)), g.choice((100_000, 65_535, 1)))
    else:
        expect = OK
    source = ("url", data_uri(data)) if g.chance(0.4) else ("base64", b64(data))
    return image_case(g, f"image/{variant}-{fmt}", expect, [source])


# (variant, how to make it from an RGB image, decodable): Pillow modes and formats of §2.2 decode;
# other formats are refused even when Pillow could read them.
MODES = (
    ("L", lambda im: _save(im.convert("L"), "PNG"), True), ("LA", lambda im: _save(im.convert("LA"), "PNG"), True),
    ("P", lambda im: _save(im.convert("P"), "PNG"), True),
    ("P-transparency", lambda im: _save(im.convert("P"), "PNG", transparency=0), True),
    ("RGBA", lambda im: _save(im.convert("RGBA"), "PNG"), True), ("1", lambda im: _save(im.convert("1"), "PNG"), True),
    ("I16", lambda im: _save(Image.fromarray((np.asarray(im.convert("L"), np.uint16) * 257)), "PNG"), True),
    ("CMYK-jpeg", lambda im: _save(im.convert("CMYK"), "JPEG"), True),
    ("progressive-jpeg", lambda im: _save(im, "JPEG", progressive=True), True),
    ("exif-rotated-jpeg", lambda im: _save(im, "JPEG", exif=_rotated_exif(im)), True),
    ("animated-gif", lambda im: _save(im, "GIF", save_all=True, append_images=[im.rotate(90), im]), True),
    ("animated-webp", lambda im: _save(im, "WEBP", save_all=True, append_images=[im.rotate(90)]), True),
    ("apng", lambda im: _save(im, "PNG", save_all=True, append_images=[im.rotate(180)]), True),
    ("RGBA-bmp", lambda im: _save(im.convert("RGBA"), "BMP"), True),
    ("tiff", lambda im: _save(im, "TIFF"), False), ("ico", lambda im: _save(im, "ICO"), False),
    ("ppm", lambda im: _save(im, "PPM"), False), ("tga", lambda im: _save(im, "TGA"), False),
)


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _rotated_exif(image: Image.Image) -> Image.Exif:
    exif = image.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90
    return exif


def image_modes(g: Gen) -> Case:
    """Pixel modes (gray, palette, alpha, 16-bit, CMYK), animation, EXIF rotation; other formats."""
    variant, make, decodable = g.choice(MODES)
    rgb = Image.open(io.BytesIO(encoded_image(g, "PNG", (g.rng.randint(8, 40), g.rng.randint(8, 40))))).convert("RGB")
    return image_case(g, f"mode/{variant}", OK if decodable else BAD, [("base64", b64(make(rgb)))])


def image_base64(g: Gen) -> Case:
    """`image` base64: standard alphabet, padding optional, whitespace ignored (§2.2)."""
    data = encoded_image(g)
    text = b64(data)
    variant, value, expect = g.choice((
        ("whitespace", "\n ".join(text[i:i + 60] for i in range(0, len(text), 60)), OK),
        ("no-padding", text.rstrip("="), OK),
        ("urlsafe", base64.urlsafe_b64encode(b"\xfb\xff" * 40 + data).decode(), BAD),
        ("bogus", "!!!!not base64!!!!", BAD), ("non-ascii", "\u00e9\u00e9" + text, BAD), ("empty", "", BAD),
        ("data-uri-as-base64", data_uri(data), EITHER),  # accepted leniently; the spec asks base64 only ("text", b64(b"hello, not an image"), BAD),
        ("huge-junk", b64(b"\x00" * 150_000), BAD), ("one-char", "A", BAD),
    ))
    how = g.choice(("image", "messages"))
    return image_case(g, f"base64/{variant}", expect, [("base64", value)], how=how)


def image_url(g: Gen) -> Case:
    """data URIs with the wrong media type or no ;base64, and every scheme that is refused
    ([VIS-5]); http(s) only to loopback (the canary) or private-range literals."""
    data = encoded_image(g, "PNG")
    canary = g.extras["canary_url"]  # http://127.0.0.1:<port>
    port = canary.rsplit(":", 1)[1]
    variant, url, expect = g.choice((
        ("data-text-plain", data_uri(data, "text/plain"), BAD), ("data-no-base64", "data:image/png," + b64(data), BAD),
        ("data-no-media", "data:;base64," + b64(data), BAD), ("data-svg", data_uri(b"<svg/>", "image/svg+xml"), BAD),
        ("data-jpeg-holds-png", data_uri(data, "image/jpeg"), EITHER),
        ("data-upper-case", "DATA:IMAGE/PNG;BASE64," + b64(data), EITHER),
        ("data-charset", "data:image/png;charset=utf-8;base64," + b64(data), EITHER),
        ("data-no-comma", "data:image/png;base64", BAD), ("file", "file:///etc/passwd", BAD),
        ("file-host", "file://localhost/etc/hostname", BAD), ("ftp", f"ftp://127.0.0.1:{port}/x.png", BAD),
        ("gopher", f"gopher://127.0.0.1:{port}/", BAD), ("javascript", "javascript:alert(1)", BAD),
        ("bare-path", "/etc/passwd", BAD), ("windows-path", "C:\\x.png", BAD), ("empty", "", BAD),
        ("loopback", f"{canary}/a.png", BAD), ("loopback-https", canary.replace("http:", "https:") + "/a.png", BAD),
        ("localhost", f"http://localhost:{port}/a.png", BAD), ("ipv6-loopback", f"http://[::1]:{port}/", BAD),
        ("decimal-ip", f"http://2130706433:{port}/", BAD), ("userinfo", f"http://user:pw@127.0.0.1:{port}/", BAD),
        ("upper-scheme", f"HTTP://127.0.0.1:{port}/", BAD), ("private-10", "http://10.0.0.1/a.png", BAD),
        ("private-192", "http://192.168.1.1/a.png", BAD), ("private-172", "https://172.16.0.1/a.png", BAD),
        ("link-local", "http://169.254.169.254/latest/meta-data/", BAD),
        ("long", f"{canary}/" + "a" * 60_000, BAD),
    ))
    how = g.choice(("image_url_input", "messages"))
    return image_case(g, f"url/{variant}", expect, [("url", url)], how=how)


def image_count(g: Gen) -> Case:
    """[IMG-2], [VIS-6]: placeholders must match images; at most max_images_per_request."""
    variant = g.choice(("more-placeholders", "fewer-placeholders", "no-image", "too-many", "type-image-parts",
                        "type-image-no-tensor", "media-pad", "framing-block"))
    data = encoded_image(g, "PNG", (12, 12))
    one = [("base64", b64(data))]
    how = g.choice(("image", "image_url_input"))
    kind = f"count/{variant}"
    if variant == "more-placeholders":
        return image_case(g, kind, BAD, one, how=how, placeholders=g.rng.randint(2, 4))
    if variant == "fewer-placeholders":
        return image_case(g, kind, BAD, one * 2, how=how, placeholders=g.choice((0, 1)))
    if variant == "no-image":
        return image_case(g, kind, BAD, [], how=how, placeholders=g.rng.randint(1, 3))
    if variant == "too-many":
        n = g.limits.max_images_per_request + g.rng.randint(1, 3)
        return image_case(g, kind, BAD, one * n, how=how)
    if variant.startswith("type-image"):  # {"type": "image"} parts take the image tensor's images
        tensor = {"image": [b64(data)]} if variant == "type-image-parts" else {}
        return image_case(g, kind, OK if tensor else BAD, [], how="messages", placeholders=1, extra=tensor)
    text = "<|media_pad|> what?" if variant == "media-pad" else \
        "<|media_begin|>image 5x5<|media_content|><|media_pad|><|media_end|> what?"
    return image_case(g, kind, OK, one, how=how, extra={"text_input": text})


def image_pixels(g: Gen) -> Case:
    """image_bytes_input [1, N, H, W, C] UINT8: C in {1, 3, 4} only; N images share H x W."""
    n, h, w = g.rng.randint(1, 2), g.choice((0, 1, 7, 28, 40)), g.choice((0, 1, 9, 28, 300))
    c = g.choice((1, 2, 3, 4, 5))
    pixels = np.random.default_rng(g.rng.randrange(2**32)).integers(0, 256, (1, n, h, w, c), dtype=np.uint8)
    expect = OK if c in (1, 3, 4) and h and w else BAD
    if expect == OK and min(h, w) == 1:
        expect = EITHER  # a one-pixel side: the resize rules may refuse it
    values = {"text_input": PLACEHOLDER * n + " Describe.", "image_bytes_input": pixels}
    # Not /generate: a JSON nested list does not carry the 5-D shape of an empty side.
    return image_target(g, f"pixels/c{c}-{h}x{w}", expect, values, PIXEL_PROTOCOLS)


def image_kinds(g: Gen) -> Case:
    """[VIS-4]: one image input kind per request; image tensors are not k3_lm inputs ([IN-1])."""
    data = encoded_image(g, "PNG", (10, 10))
    variant = g.choice(("image+url", "image+pixels", "messages-data+tensor", "image-to-k3_lm"))
    pixels = np.zeros((1, 1, 8, 8, 3), np.uint8)
    kind = f"kinds/{variant}"
    if variant == "image+url":
        return image_case(g, kind, BAD, [("base64", b64(data))], how="image",
                          extra={"image_url_input": [data_uri(data)]})
    if variant == "image+pixels":
        return image_case(g, kind, BAD, [("base64", b64(data))], how="image", extra={"image_bytes_input": pixels},
                          protocols=PIXEL_PROTOCOLS)
    if variant == "messages-data+tensor":
        return image_case(g, kind, BAD, [("base64", b64(data))], how="messages", extra={"image": [b64(data)]})
    name = g.choice(("image", "image_url_input", "image_bytes_input"))
    item = (b64(data) if name == "image" else data_uri(data)).encode()
    value = Wire("UINT8", pixels) if name == "image_bytes_input" else Wire("BYTES", np.array([[item]], np.object_))
    protocol = g.choice(("grpc", "http_generate"))
    values = g.cheap(protocol, text_input=PLACEHOLDER + " x", **{name: value})
    return g.case(f"kinds/{name}-to-k3_lm", CORE, values, model="k3_lm", protocol=protocol)


# ---- precomputed embeddings to k3_lm ([VIS-2], §4.2) --------------------------------------------


def _embeddings(g: Gen, n: int) -> dict:
    """A consistent set of the five internal image tensors for n images (wire shapes, batch 1)."""
    grids = [(1, 2 * g.rng.randint(1, 2), 2 * g.rng.randint(1, 2)) for _ in range(n)]
    counts = [h * w // 4 for _, h, w in grids]
    rows = sum(counts)
    embeds = np.random.default_rng(g.rng.randrange(2**32)).standard_normal((1, rows, g.limits.hidden_size))
    return {
        "image_embeds": embeds.astype(ml_dtypes.bfloat16),
        "image_token_counts": np.array([counts], np.int32),
        "image_grid_thw": np.array([grids], np.int64),
        "image_sizes": np.array([[(14 * w, 14 * h) for _, h, w in grids]], np.int32),
        "image_hashes": np.array([["%032x" % g.rng.randrange(2**128) for _ in range(n)]], dtype=object),
    }


def _spoil_embeddings(g: Gen, t: dict) -> tuple[str, frozenset[str]]:
    """Break one invariant of a valid set in place; returns (variant, answers)."""
    variant = g.choice(("rows+1", "rows-1", "width", "fp32", "fp16", "3d", "missing", "counts-grid", "grid-t",
                        "size-zero", "size-negative", "size-huge", "hash-upper", "hash-short", "hash-utf8", "nan", "inf",
                        "huge-values", "counts-length", "too-long", "valid"))
    e = t["image_embeds"]
    if variant == "rows+1":
        t["image_embeds"] = np.concatenate([e, e[:, :1]], axis=1)
    elif variant == "rows-1":
        t["image_embeds"] = e[:, 1:]
    elif variant == "width":
        t["image_embeds"] = np.zeros((1, e.shape[1], g.limits.hidden_size + g.choice((-1, 1, 64))), ml_dtypes.bfloat16)
    elif variant in ("fp32", "fp16", "3d"):
        array = e.astype(np.float32 if variant == "fp32" else np.float16) if variant != "3d" else e[:, None]
        t["image_embeds"] = Wire({"fp32": "FP32", "fp16": "FP16", "3d": "BF16"}[variant], array)
        return variant, CORE
    elif variant == "missing":
        del t[g.choice(sorted(t))]
    elif variant == "counts-grid":
        t["image_token_counts"] = t["image_token_counts"] + 1
        t["image_embeds"] = np.zeros((1, int(t["image_token_counts"].sum()), e.shape[2]), ml_dtypes.bfloat16)
    elif variant == "grid-t":
        t["image_grid_thw"][0, 0, 0] = 2
    elif variant == "size-huge":  # only the framing text `image WxH` shows it
        t["image_sizes"][0, 0] = (2**31 - 1, 2**31 - 1)
        return variant, OK
    elif variant in ("size-zero", "size-negative"):
        t["image_sizes"][0, 0, g.rng.randint(0, 1)] = 0 if variant == "size-zero" else -5
    elif variant == "hash-upper":
        t["image_hashes"][0, 0] = "ABCDEF" + t["image_hashes"][0, 0][6:]
    elif variant == "hash-short":
        t["image_hashes"][0, 0] = t["image_hashes"][0, 0][:31]
    elif variant == "hash-utf8":
        t["image_hashes"][0, 0] = b"\xff" * 32
    elif variant in ("nan", "inf", "huge-values"):  # legal shapes, hostile numbers: any non-INTERNAL answer
        fill = {"nan": np.nan, "inf": np.inf, "huge-values": 3e38}[variant]
        t["image_embeds"] = np.full(e.shape, fill, np.float32).astype(ml_dtypes.bfloat16)
        return variant, EITHER
    elif variant == "counts-length":
        t["image_token_counts"] = np.concatenate([t["image_token_counts"], [[1]]], axis=1).astype(np.int32)
    elif variant == "too-long":  # rows beyond max_model_len: refused before prefill
        h = 2 * int(np.ceil(np.sqrt(g.limits.max_model_len + 8)))
        t.update(_embeddings_for_grid(g, (1, h, h)))
    else:
        return variant, OK
    return variant, BAD


def _embeddings_for_grid(g: Gen, grid: tuple[int, int, int]) -> dict:
    count = grid[1] * grid[2] // 4
    return {"image_embeds": np.zeros((1, count, g.limits.hidden_size), ml_dtypes.bfloat16),
            "image_token_counts": np.array([[count]], np.int32), "image_grid_thw": np.array([[grid]], np.int64)}


def image_embeds(g: Gen) -> Case:
    """Precomputed embeddings sent to k3_lm directly over gRPC: valid, or one invariant broken."""
    n = g.rng.randint(1, 2)
    tensors = _embeddings(g, n)
    variant, expect = _spoil_embeddings(g, tensors)
    placeholders = n if g.chance(0.85) else n + 1
    if placeholders != n and expect == OK:
        expect = BAD
    values = {**g.cheap("grpc"), "text_input": PLACEHOLDER * placeholders + " x", **tensors}
    return Case(g.index, f"embeds/{variant}", "grpc", [Request("k3_lm", values, g.rid())], expect)


CLASSES = [(image_modes, 3), (image_damaged, 8), (image_base64, 4), (image_url, 6), (image_count, 5), (image_pixels, 4),
           (image_kinds, 3), (image_embeds, 6)]
