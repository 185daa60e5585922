"""k3backend.serving.images: request image inputs -> Pillow images (SERVING.md §2.2, §3, §5.2).

Every decode path, the limits, the URL policy against local HTTP servers, placeholder counting
and the image hash. No Triton here: tests/test_vision_server.py runs the real server.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from k3backend.errors import InvalidArgument, Unavailable
from k3backend.model.preprocess import PreprocessConfig, preprocess_image
from k3backend.serving.images import (
    FORMATS, ONLY_ONE_KIND, ImageLimits, ImageReader, ImageSource, UrlFetcher, UrlPolicy, address_refusal,
    check_placeholder_count, collect_sources, count_placeholders, decode_base64, image_hash, load_pixels,
    message_image_parts, preprocess_digest,
)
from k3backend.serving.prompt import parse_messages
from k3backend.tokenizer import Tokenizer, write_tiny_tokenizer

CANNOT_DECODE = "image 0: cannot decode image data (PNG, JPEG, WebP, GIF or BMP expected)"


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    c = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)
    return Image.fromarray(a[:, :, 0] if c == 1 else a, mode)


def reader(**limits) -> ImageReader:
    return ImageReader(ImageLimits(**limits), UrlFetcher(UrlPolicy()))


def read(sources: list[ImageSource], **limits) -> list[Image.Image]:
    return [load_pixels(im, i) for i, im in enumerate(reader(**limits).open_all(sources))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


# ---- decode paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_base64_of_every_accepted_format_decodes(fmt: str) -> None:
    data = encode(noise(33, 17), fmt)
    (image,) = read([ImageSource("base64", base64.b64encode(data).decode())])
    assert image.size == (33, 17)
    assert image.format == fmt


def test_base64_padding_optional_and_whitespace_ignored() -> None:
    data = encode(noise(8, 9), "PNG")
    text = base64.b64encode(data).decode().rstrip("=")
    spaced = "\n".join(text[i:i + 10] for i in range(0, len(text), 10)) + " \t"
    assert decode_base64(spaced, 0) == data


@pytest.mark.parametrize("bad", ["ab$d", "a", "-_-_"], ids=["bad-char", "bad-length", "urlsafe-alphabet"])
def test_invalid_base64_is_invalid_arg(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^image 0: not valid base64"):
        decode_base64(bad, 0)


def test_data_uri_in_image_url_input() -> None:
    data = encode(noise(20, 10), "PNG")
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    (image,) = read([ImageSource("url", uri)])
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize("uri", ["data:text/plain;base64,aGk=", "data:image/png,rawbytes", "data:image/png;base64"],
                         ids=["not-image", "not-base64", "no-comma"])
def test_data_uri_needs_image_type_and_base64(uri: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^image 0: data URI must be data:image/<type>;base64"):
        read([ImageSource("url", uri)])


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "/tmp/a.png", "gopher://x"])
def test_other_schemes_are_never_accepted(url: str) -> None:
    fetcher = UrlFetcher(UrlPolicy(allow_remote=True, allow_private=True))
    with pytest.raises(InvalidArgument, match=r"^image 0: (URL scheme '\w+'|a URL without a scheme) is not accepted"):
        ImageReader(ImageLimits(), fetcher).open_all([ImageSource("url", url)])


@pytest.mark.parametrize("channels,mode", [(1, "L"), (3, "RGB"), (4, "RGBA")])
def test_raw_pixels_with_1_3_or_4_channels(channels: int, mode: str) -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (2, 7, 5, channels), dtype=np.uint8)
    images = read(collect_sources(None, None, pixels, None))
    assert [im.mode for im in images] == [mode, mode]
    assert images[1].size == (5, 7)
    assert np.array_equal(np.asarray(images[1]).reshape(7, 5, channels), pixels[1])


def test_raw_pixels_with_2_channels_are_invalid_arg() -> None:
    with pytest.raises(InvalidArgument, match=r"image_bytes_input: expected \[N, H, W, C\] with C in \{1, 3, 4\}"):
        collect_sources(None, None, np.zeros((1, 4, 4, 2), np.uint8), None)


def test_gif_takes_the_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    (image,) = read([ImageSource("base64", base64.b64encode(buf.getvalue()).decode())])
    assert image.convert("RGB").getpixel((3, 3)) == (255, 0, 0)


@pytest.mark.parametrize("data", [b"not an image at all", encode(noise(8, 8), "PNG")[:40],
                                  encode(noise(8, 8), "TIFF")], ids=["garbage", "truncated-png", "tiff"])
def test_undecodable_image_message(data: bytes) -> None:
    with pytest.raises(InvalidArgument) as e:
        read([ImageSource("base64", base64.b64encode(data).decode())])
    assert str(e.value) == CANNOT_DECODE
    assert "TIFF" not in FORMATS


def test_messages_parts_in_order_with_tensor_references() -> None:
    png = base64.b64encode(encode(noise(4, 4), "PNG")).decode()
    uri = "data:image/png;base64," + png
    messages, _ = parse_messages(
        '[{"role": "system", "content": "s"},'
        ' {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "' + uri + '"}},'
        ' {"type": "text", "text": "a"}, {"type": "image_url", "image_url": "http://h/x.png"},'
        ' {"type": "image", "image": "' + png + '"}, {"type": "image"}]}]')
    assert message_image_parts(messages) == [
        ImageSource("url", "data:image/png;base64," + png), ImageSource("url", "http://h/x.png"),
        ImageSource("base64", png), None]


def test_messages_not_json_is_invalid_arg() -> None:
    with pytest.raises(InvalidArgument, match=r"^messages is not valid JSON: Expecting"):  # k3_lm's parser
        parse_messages('[{"role": "user",')


@pytest.mark.parametrize("present", [("url", "b64"), ("url", "pixels"), ("b64", "pixels")])
def test_two_image_inputs_are_invalid_arg(present: tuple[str, str]) -> None:
    kw = {"url": [b"data:image/png;base64,AA"], "b64": [b"AA"], "pixels": np.zeros((1, 2, 2, 3), np.uint8)}
    args = [kw[k] if k in present else None for k in ("url", "b64", "pixels")]
    with pytest.raises(InvalidArgument) as e:
        collect_sources(*args, None)
    assert str(e.value) == ONLY_ONE_KIND


def test_messages_embedded_image_plus_tensor_is_invalid_arg() -> None:
    parts = [ImageSource("base64", "AA"), None]
    with pytest.raises(InvalidArgument, match="^" + ONLY_ONE_KIND):
        collect_sources(None, [b"AA"], None, parts)


def test_messages_image_parts_take_tensor_images_in_order() -> None:
    sources = collect_sources(None, [b"AAA", b"BBB"], None, [None, None])
    assert sources == [ImageSource("base64", "AAA"), ImageSource("base64", "BBB")]


# ---- limits -------------------------------------------------------------------------------------


def test_more_images_than_allowed_is_invalid_arg() -> None:
    png = base64.b64encode(encode(noise(4, 4), "PNG")).decode()
    with pytest.raises(InvalidArgument, match=r"^3 images, more than max_images_per_request 2$"):
        reader(max_images_per_request=2).open_all([ImageSource("base64", png)] * 3)


def test_image_bytes_limits_per_image_and_total() -> None:
    data = encode(noise(64, 64), "PNG")
    src = ImageSource("base64", base64.b64encode(data).decode())
    read([src], max_image_bytes=len(data))
    with pytest.raises(InvalidArgument, match=rf"^image 0: more than max_image_bytes {len(data) - 1} bytes$"):
        read([src], max_image_bytes=len(data) - 1)
    with pytest.raises(InvalidArgument, match=r"^image 1: the images exceed max_total_image_bytes"):
        read([src, src], max_total_image_bytes=2 * len(data) - 1)


def test_decompression_bomb_refused_from_the_header_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(Image.new("L", (4000, 3000)), "PNG")  # 12 Mpx that compress to a few KB
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self.size))
    want = r"^image 0: 4000x3000 is 12000000 pixels, more than max_image_pixels 11999999$"
    with pytest.raises(InvalidArgument, match=want):
        reader(max_image_pixels=11_999_999).open_all([ImageSource("base64", base64.b64encode(data).decode())])
    assert loads == []  # no pixel was decoded


def test_raw_pixels_over_the_pixel_limit_are_invalid_arg() -> None:
    with pytest.raises(InvalidArgument, match=r"^image 0: 5x4 is 20 pixels, more than max_image_pixels 19$"):
        read(collect_sources(None, None, np.zeros((1, 4, 5, 3), np.uint8), None), max_image_pixels=19)


# ---- placeholders [VIS-6] -----------------------------------------------------------------------


@pytest.mark.parametrize("text,n", [
    ("no images here", 0),
    ("<|kimi_image_placeholder|> and <|kimi_image_placeholder|>", 2),
    ("<|media_begin|>image 10x20<|media_content|><|media_pad|><|media_end|> describe", 1),
    ("<|media_pad|><|media_pad|>", 2),
    ("<|media_begin|>image 1x1<|media_content|><|media_pad|><|media_end|><|kimi_image_placeholder|><|media_pad|>", 3),
    ("<|media_begin|><|media_content|><|media_pad|><|media_end|>", 1),  # no text: not a block; the lone pad counts
], ids=["none", "literals", "framing-block", "lone-pads", "mixed", "empty-block"])
def test_text_input_placeholders_counted_like_k3_lm(tokenizer: Tokenizer, text: str, n: int) -> None:
    assert count_placeholders(text, None, tokenizer) == n
    assert len(tokenizer.find_image_placeholders(tokenizer.encode_text_input(text))) == n


def test_messages_placeholders_are_image_parts(tokenizer: Tokenizer) -> None:
    assert count_placeholders("<|kimi_image_placeholder|>", [None, ImageSource("url", "x")], tokenizer) == 2


def test_mismatch_message() -> None:
    with pytest.raises(InvalidArgument) as e:
        check_placeholder_count(2, 1)
    assert str(e.value) == "the prompt has 2 image placeholders but 1 image was supplied"
    with pytest.raises(InvalidArgument, match=r"^the prompt has 1 image placeholder but 0 images were supplied$"):
        check_placeholder_count(1, 0)


# ---- hashes [_IMAGE_HASHES], [VIS-8] ------------------------------------------------------------


def test_hash_is_stable_and_content_based() -> None:
    cfg = PreprocessConfig()
    digest = preprocess_digest(cfg)
    a, a2, b = noise(30, 20, seed=1), noise(30, 20, seed=1), noise(30, 20, seed=2)
    h = image_hash(digest, preprocess_image(a, cfg))
    assert len(h) == 32 and h == h.lower() and int(h, 16) >= 0
    assert image_hash(digest, preprocess_image(a2, cfg)) == h
    assert image_hash(digest, preprocess_image(b, cfg)) != h
    other = PreprocessConfig(in_patch_limit=1024)
    assert preprocess_digest(other) != digest
    assert image_hash(preprocess_digest(other), preprocess_image(a, other)) != h
    assert preprocess_digest(PreprocessConfig()) == digest  # canonical, not object identity


def test_hash_matches_its_definition() -> None:
    import hashlib
    import json

    cfg = PreprocessConfig()
    p = preprocess_image(noise(30, 20), cfg)
    cfg_digest = hashlib.blake2b(json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode(),
                                 digest_size=16).digest()
    want = hashlib.blake2b(cfg_digest + np.array(p.grid_thw, "<i8").tobytes() + p.resized_uint8.tobytes(),
                           digest_size=16).hexdigest()
    assert image_hash(preprocess_digest(cfg), p) == want


# ---- remote URLs [VIS-5] ------------------------------------------------------------------------

PNG_BYTES = encode(noise(12, 10), "PNG")


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    delay_s = 0.0

    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(self.delay_s)
        status, headers, body = self.routes.get(self.path, (404, {"Content-Type": "text/plain"}, b"nope"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up early (timeouts, size limits) break the pipe on purpose


def _serve(host: str) -> Iterator[str]:
    server = _Server((host, 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    yield from _serve("127.0.0.1")


@pytest.fixture(scope="module")
def web2() -> Iterator[str]:
    """A second loopback address (all of 127/8 is loopback on Linux): the 'private' target."""
    yield from _serve("127.0.0.2")


@pytest.fixture(autouse=True)
def _routes(web: str, web2: str) -> None:
    _Handler.routes = {
        "/img.png": (200, {"Content-Type": "image/png"}, PNG_BYTES),
        "/untyped": (200, {}, PNG_BYTES),
        "/page": (200, {"Content-Type": "text/html"}, b"<html></html>"),
        "/junk": (200, {"Content-Type": "image/png"}, b"not a png"),
        "/boom": (503, {}, b""),
        "/slow": (200, {"Content-Type": "image/png"}, PNG_BYTES),
        "/to-img": (302, {"Location": "/img.png"}, b""),
        "/to-private": (302, {"Location": f"{web2}/img.png"}, b""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
        "/r1": (301, {"Location": "/r2"}, b""), "/r2": (307, {"Location": "/r3"}, b""),
        "/r3": (308, {"Location": "/img.png"}, b""),
    }


def fetch(url: str, refuse=address_refusal, **policy) -> bytes:
    fetcher = UrlFetcher(UrlPolicy(**{"allow_remote": True, **policy}), refuse)
    return fetcher.fetch(url, 0, lambda n: None)


def test_remote_urls_disabled_by_default(web: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        UrlFetcher(UrlPolicy()).fetch(f"{web}/img.png", 1, lambda n: None)
    assert str(e.value) == "image 1: remote image URLs are disabled (allow_remote_image_urls=false)"


def test_loopback_refused_unless_private_network_allowed(web: str) -> None:
    with pytest.raises(InvalidArgument, match=r"127\.0\.0\.1, a loopback address \(allow_private_network_urls=false\)"):
        fetch(f"{web}/img.png")
    with pytest.raises(InvalidArgument, match=r"a loopback address"):
        fetch(web.replace("127.0.0.1", "localhost") + "/img.png")
    assert fetch(f"{web}/img.png", allow_private=True) == PNG_BYTES


def test_redirects_followed_up_to_three(web: str) -> None:
    assert fetch(f"{web}/to-img", allow_private=True) == PNG_BYTES
    assert fetch(f"{web}/r1", allow_private=True) == PNG_BYTES  # exactly 3 redirects
    with pytest.raises(InvalidArgument, match=r"^image 0: more than 3 redirects"):
        fetch(f"{web}/loop", allow_private=True)


def test_redirect_to_private_address_refused(web: str, web2: str) -> None:
    # Treat 127.0.0.1 as public and 127.0.0.2 as private: the check must run again after the redirect.
    refuse = lambda ip: "private" if ip == "127.0.0.2" else None  # noqa: E731
    assert fetch(f"{web}/img.png", refuse) == PNG_BYTES
    with pytest.raises(InvalidArgument, match=r"resolves to 127\.0\.0\.2, a private address"):
        fetch(f"{web}/to-private", refuse)
    assert fetch(f"{web}/to-private", allow_private=True) == PNG_BYTES


def test_redirect_to_other_scheme_refused(web: str) -> None:
    with pytest.raises(InvalidArgument, match=r"URL scheme 'file' is not accepted"):
        fetch(f"{web}/to-file", allow_private=True)


def test_allowlist(web: str) -> None:
    assert fetch(f"{web}/img.png", allow_private=True, allowlist=("127.0.0.1",)) == PNG_BYTES
    with pytest.raises(InvalidArgument, match=r"^image 0: host '127\.0\.0\.1' is not in remote_image_url_allowlist$"):
        fetch(f"{web}/img.png", allow_private=True, allowlist=("images.example.com",))


def test_http_errors_map_to_codes(web: str) -> None:
    with pytest.raises(InvalidArgument, match=r"failed: HTTP 404$"):
        fetch(f"{web}/missing", allow_private=True)
    with pytest.raises(Unavailable, match=r"failed: HTTP 503$"):
        fetch(f"{web}/boom", allow_private=True)
    with pytest.raises(InvalidArgument, match=r"is not an image \(Content-Type text/html\)"):
        fetch(f"{web}/page", allow_private=True)
    assert fetch(f"{web}/untyped", allow_private=True) == PNG_BYTES


def test_fetched_non_image_is_invalid_arg(web: str) -> None:
    r = ImageReader(ImageLimits(), UrlFetcher(UrlPolicy(allow_remote=True, allow_private=True)))
    with pytest.raises(InvalidArgument) as e:
        r.open_all([ImageSource("url", f"{web}/junk")])
    assert str(e.value) == CANNOT_DECODE


def test_timeout_and_connection_failure_are_unavailable(web: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Handler, "delay_s", 1.0)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=r"timed out \(url_fetch_timeout_s=0\.3\)"):
        fetch(f"{web}/slow", allow_private=True, timeout_s=0.3)
    assert time.monotonic() - t0 < 0.9
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(Unavailable, match=r"^image 0: cannot fetch"):
        fetch(f"http://127.0.0.1:{closed_port}/img.png", allow_private=True)


def test_download_size_limit(web: str) -> None:
    r = ImageReader(ImageLimits(max_image_bytes=len(PNG_BYTES) - 1),
                    UrlFetcher(UrlPolicy(allow_remote=True, allow_private=True)))
    with pytest.raises(InvalidArgument, match=r"more than max_image_bytes"):
        r.open_all([ImageSource("url", f"{web}/img.png")])


@pytest.mark.parametrize("ip,why", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"),
    ("172.16.5.4", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("::ffff:127.0.0.1", "loopback"), ("100.64.0.1", "non-public"), ("0.0.0.0", "private"),
    ("fc00::1", "private"), ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_address_refusal(ip: str, why: str | None) -> None:
    assert address_refusal(ip) == why

