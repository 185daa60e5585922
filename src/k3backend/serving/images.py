"""One request's image inputs -> decoded Pillow images, in order (SERVING.md §2.2, §3, §5.2).

Sources, exactly one kind per request [VIS-4]: `image_url_input` (data URIs, http(s) URLs),
`image` (base64 files), `image_bytes_input` (raw uint8 [N, H, W, C]), or images embedded in
`messages` parts. Every client mistake is an `InvalidArgument` whose message starts with
`image <i>:` (i = position in that order); a remote fetch that fails on the far side (timeout,
connection, 5xx) is `Unavailable` [VIS-5].

Limits are checked as early as the data allows: byte counts before decoding, W×H from the file
header before any pixel is decoded (decompression bombs), the count of images before any is
read. URL fetching pins the connection to the addresses that passed the network check, so a DNS
answer cannot change between the check and the connect; the check runs again after each redirect.
Environment proxies are not used: the network check would be meaningless behind one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import ipaddress
import json
import socket
import ssl
import time
import urllib.parse
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from k3backend.errors import InvalidArgument, Unavailable
from k3backend.model.preprocess import PreprocessConfig, ProcessedImage
from k3backend.serving.inputs import decode_utf8
from k3backend.tokenizer import IMAGE_PLACEHOLDER_TEXT, MEDIA_PAD, Tokenizer

ONLY_ONE_KIND = "use only one of image_url_input, image, image_bytes_input"
# Pillow format names accepted (camera JPEGs that Pillow opens as MPO come through "JPEG").
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class ImageLimits:
    """The size parameters of SERVING.md §3.4."""

    max_images_per_request: int = 16
    max_image_bytes: int = 33554432
    max_total_image_bytes: int = 134217728
    max_image_pixels: int = 89478485


@dataclass(frozen=True)
class UrlPolicy:
    """Which URLs may be fetched, and how long a fetch may take [VIS-5]."""

    allow_remote: bool = False
    allowlist: tuple[str, ...] = ()  # lower-case host names; empty = any public host
    allow_private: bool = False
    timeout_s: float = 10.0


class ImageSource(NamedTuple):
    """One image before it is read: `kind` is "url" (str), "base64" (str) or "pixels" ([H, W, C] uint8)."""

    kind: str
    value: Any


# ---- messages and placeholders [VIS-4], [VIS-6], SERVING.md §5.2 ------------------------------


def message_image_parts(messages: list[Any]) -> list[ImageSource | None]:
    """Per image part of `messages`, in order: its embedded image (an image_url part's URL, an
    image part's base64), or None for a `{"type": "image"}` part without data, which takes the
    next image of the image tensor (PRM-3).

    Only what images need is checked here; k3_lm validates the rest of the schema.
    """
    parts: list[ImageSource | None] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str):
                    raise InvalidArgument(f'{where}.image_url: expected {{"url": string}} or a string')
                parts.append(ImageSource("url", url))
            elif kind == "image":
                data = part.get("image")
                if data is not None and not isinstance(data, str):
                    raise InvalidArgument(f"{where}.image: expected a base64 string, got {type(data).__name__}")
                parts.append(None if data is None else ImageSource("base64", data))
    return parts


def count_placeholders(text: str, message_parts: Sequence[ImageSource | None] | None, tokenizer: Tokenizer) -> int:
    """Image placeholders of the prompt, by k3_lm's rule (IMG-1): each image part of `messages`,
    else the placeholders of `text_input` as `Tokenizer.find_image_placeholders` finds them.

    Every placeholder form contains `<|media_pad|>` or the placeholder literal, so a prompt
    without either is counted without tokenizing it (text-only requests stay cheap [TOP-4]).
    """
    if message_parts is not None:
        return len(message_parts)
    if MEDIA_PAD not in text and IMAGE_PLACEHOLDER_TEXT not in text:
        return 0
    return len(tokenizer.find_image_placeholders(tokenizer.encode_text_input(text)))


def check_placeholder_count(placeholders: int, images: int) -> None:
    if placeholders != images:
        noun = "image placeholder" if placeholders == 1 else "image placeholders"
        supplied = "1 image was" if images == 1 else f"{images} images were"
        raise InvalidArgument(f"the prompt has {placeholders} {noun} but {supplied} supplied")


def collect_sources(image_url_input: Sequence[bytes] | None, image: Sequence[bytes] | None,
                    image_bytes_input: np.ndarray | None,
                    message_parts: Sequence[ImageSource | None] | None) -> list[ImageSource]:
    """The request's images in order [VIS-4]. `image_bytes_input` is [N, H, W, C] (batch dim removed)."""
    present = [v is not None for v in (image_url_input, image, image_bytes_input)]
    embedded = [p for p in message_parts or () if p is not None]
    if sum(present) > 1:
        raise InvalidArgument(ONLY_ONE_KIND)
    if embedded and any(present):
        raise InvalidArgument(f"{ONLY_ONE_KIND} (images embedded in messages count as one)")
    if image_url_input is not None:
        return [ImageSource("url", decode_utf8(v, f"image {i}: image_url_input element")) for i, v in enumerate(image_url_input)]
    if image is not None:
        return [ImageSource("base64", decode_utf8(v, f"image {i}: image element")) for i, v in enumerate(image)]
    if image_bytes_input is not None:
        if image_bytes_input.ndim != 4 or image_bytes_input.shape[3] not in (1, 3, 4):
            raise InvalidArgument(f"image_bytes_input: expected [N, H, W, C] with C in {{1, 3, 4}}, "
                                  f"got shape {list(image_bytes_input.shape)}")
        return [ImageSource("pixels", a) for a in image_bytes_input]
    return embedded


# ---- reading and decoding ---------------------------------------------------------------------


class ImageReader:
    """Reads one request's sources into Pillow images whose header passed the limits; pixels are
    decoded later by `load_pixels`, after the caller's token-budget check."""

    def __init__(self, limits: ImageLimits, fetcher: UrlFetcher) -> None:
        self.limits = limits
        self.fetcher = fetcher

    def open_all(self, sources: Sequence[ImageSource]) -> list[Image.Image]:
        if len(sources) > self.limits.max_images_per_request:
            raise InvalidArgument(f"{len(sources)} images, more than max_images_per_request "
                                  f"{self.limits.max_images_per_request}")
        images, used = [], 0
        for i, (kind, value) in enumerate(sources):
            if kind == "pixels":
                images.append(self._from_pixels(value, i))
                continue
            check = lambda n, i=i, used=used: self._check_bytes(n, i, used)  # noqa: E731
            data = self._encoded_bytes(kind, value.strip(), i, check)
            used += len(data)
            images.append(self._open(data, i))
        return images

    def _encoded_bytes(self, kind: str, text: str, index: int, check: Callable[[int], None]) -> bytes:
        """The encoded file: base64 (`image`; a data URI is accepted too), or a data URI or
        http(s) URL (`image_url_input`, messages' image_url parts)."""
        scheme = text.split(":", 1)[0].lower() if ":" in text else ""
        if scheme in ("http", "https") and kind == "url":
            return self.fetcher.fetch(text, index, check)
        if scheme == "data":
            data = decode_data_uri(text, index)
        elif kind == "base64":
            data = decode_base64(text, index)
        else:
            shown = f"URL scheme '{scheme}'" if scheme else "a URL without a scheme"
            raise InvalidArgument(f"image {index}: {shown} is not accepted "
                                  f"(data:image/<type>;base64,... or http(s):// expected)")
        check(len(data))
        return data

    def _check_bytes(self, n: int, index: int, used: int) -> None:
        limits = self.limits
        if n > limits.max_image_bytes:
            raise InvalidArgument(f"image {index}: more than max_image_bytes {limits.max_image_bytes} bytes")
        if used + n > limits.max_total_image_bytes:
            raise InvalidArgument(f"image {index}: the images exceed max_total_image_bytes "
                                  f"{limits.max_total_image_bytes} bytes")

    def _open(self, data: bytes, index: int) -> Image.Image:
        """Parse the header only, and refuse more than max_image_pixels before decoding any pixel."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError as e:
            raise InvalidArgument(f"image {index}: too many pixels ({e})") from None
        except Exception:  # a hostile file may fail in any plugin: always the client's fault
            raise InvalidArgument(cannot_decode(index)) from None
        self._check_pixels(*image.size, index)
        return image

    def _from_pixels(self, pixels: np.ndarray, index: int) -> Image.Image:
        h, w, c = pixels.shape
        if pixels.dtype != np.uint8:
            raise InvalidArgument(f"image {index}: image_bytes_input must be UINT8, got {pixels.dtype}")
        if h < 1 or w < 1:
            raise InvalidArgument(f"image {index}: image_bytes_input has an empty {w}x{h} image")
        self._check_pixels(w, h, index)
        pixels = np.ascontiguousarray(pixels)
        return Image.fromarray(pixels[:, :, 0], "L") if c == 1 else Image.fromarray(pixels, "RGB" if c == 3 else "RGBA")

    def _check_pixels(self, w: int, h: int, index: int) -> None:
        if w * h > self.limits.max_image_pixels:
            raise InvalidArgument(f"image {index}: {w}x{h} is {w * h} pixels, more than max_image_pixels "
                                  f"{self.limits.max_image_pixels}")


def load_pixels(image: Image.Image, index: int) -> Image.Image:
    """Decode the pixels of an opened image (the first frame of a GIF or animated WebP)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
    except Exception:
        raise InvalidArgument(cannot_decode(index)) from None
    return image


def cannot_decode(index: int) -> str:
    return f"image {index}: cannot decode image data (PNG, JPEG, WebP, GIF or BMP expected)"


def decode_base64(text: str, index: int) -> bytes:
    """Standard alphabet; padding optional; whitespace ignored (SERVING.md §2.2 `image`)."""
    s = "".join(text.split())
    s += "=" * (-len(s) % 4)
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"image {index}: not valid base64 (standard alphabet expected)") from None


def decode_data_uri(uri: str, index: int) -> bytes:
    """`data:image/<subtype>[;param...];base64,<data>`; any other media type or encoding is refused."""
    header, sep, payload = uri.strip()[5:].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not sep or not params[0].startswith("image/") or params[-1] != "base64":
        raise InvalidArgument(f"image {index}: data URI must be data:image/<type>;base64,<data>, "
                              f"got 'data:{header[:64]}'")
    return decode_base64(urllib.parse.unquote(payload) if "%" in payload else payload, index)


# ---- remote URLs [VIS-5] ----------------------------------------------------------------------


def address_refusal(ip: str) -> str | None:
    """Why a resolved address may not be fetched without allow_private_network_urls, or None."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return "loopback"
    if addr.is_link_local:
        return "link-local"
    if addr.is_private:
        return "private"
    if not addr.is_global or addr.is_multicast:
        return "non-public"
    return None


class UrlFetcher:
    """http(s) GET under a `UrlPolicy`: allowlist, per-address network check, at most 3 redirects,
    one deadline for the whole download. `refuse` is the network check (tests replace it)."""

    def __init__(self, policy: UrlPolicy, refuse: Callable[[str], str | None] = address_refusal) -> None:
        self.policy = policy
        self.refuse = refuse
        self._tls = ssl.create_default_context()

    def fetch(self, url: str, index: int, check_size: Callable[[int], None]) -> bytes:
        """The body of a 200 response; `check_size(n)` raises once n bytes are too many."""
        if not self.policy.allow_remote:
            raise InvalidArgument(f"image {index}: remote image URLs are disabled (allow_remote_image_urls=false)")
        deadline = time.monotonic() + self.policy.timeout_s
        try:
            for _ in range(MAX_REDIRECTS + 1):
                body, location = self._get(url, index, check_size, deadline)
                if location is None:
                    return body
                url = urllib.parse.urljoin(url, location)
        except TimeoutError:
            raise Unavailable(f"image {index}: fetching {_short(url)} timed out "
                              f"(url_fetch_timeout_s={self.policy.timeout_s:g})") from None
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"image {index}: cannot fetch {_short(url)}: {e or type(e).__name__}") from None
        raise InvalidArgument(f"image {index}: more than {MAX_REDIRECTS} redirects fetching {_short(url)}")

    def _get(self, url: str, index: int, check_size: Callable[[int], None],
             deadline: float) -> tuple[bytes, str | None]:
        """One request: (body, None), or (b"", Location) for a redirect."""
        hop = self._check(url, index)
        conn_cls = _PinnedHTTPS if hop.https else _PinnedHTTP
        conn = conn_cls(hop.host, hop.port, hop.addresses, _left(deadline), self._tls)
        try:
            conn.request("GET", hop.target, headers={"Accept": "image/*", "User-Agent": "k3backend-k3_vision",
                                                     "Connection": "close"})
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise InvalidArgument(f"image {index}: HTTP {resp.status} redirect without a Location "
                                          f"from {_short(url)}")
                return b"", location
            if resp.status != 200:
                error = Unavailable if resp.status >= 500 else InvalidArgument
                raise error(f"image {index}: fetching {_short(url)} failed: HTTP {resp.status}")
            ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
            if ctype.startswith("text/") or ctype in ("application/json", "application/xml"):
                raise InvalidArgument(f"image {index}: {_short(url)} is not an image (Content-Type {ctype})")
            length = resp.getheader("Content-Length") or ""
            if length.isdigit():
                check_size(int(length))
            chunks, n = [], 0
            while chunk := resp.read(65536):
                n += len(chunk)
                check_size(n)
                chunks.append(chunk)
                if not resp.isclosed():  # a response closes its socket once the body is read
                    conn.pinned_sock.settimeout(_left(deadline))
            return b"".join(chunks), None
        finally:
            conn.close()

    def _check(self, url: str, index: int) -> _Hop:
        """Scheme, allowlist and network policy for one hop; the addresses that may be connected to."""
        try:
            parts = urllib.parse.urlsplit(url)
            https = parts.scheme.lower() == "https"
            port = parts.port or (443 if https else 80)
        except ValueError as e:
            raise InvalidArgument(f"image {index}: malformed URL {_short(url)}: {e}") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise InvalidArgument(f"image {index}: URL scheme '{parts.scheme}' is not accepted "
                                  f"(redirected to {_short(url)})")
        host = (parts.hostname or "").rstrip(".")
        if not host:
            raise InvalidArgument(f"image {index}: URL without a host: {_short(url)}")
        if self.policy.allowlist and host not in self.policy.allowlist:
            raise InvalidArgument(f"image {index}: host '{host}' is not in remote_image_url_allowlist")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise Unavailable(f"image {index}: cannot resolve host '{host}': {e}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not self.policy.allow_private:
            for ip in addresses:
                why = self.refuse(ip)
                if why:
                    raise InvalidArgument(f"image {index}: host '{host}' resolves to {ip}, a {why} address "
                                          f"(allow_private_network_urls=false)")
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        return _Hop(https, host, port, target, addresses)


class _Hop(NamedTuple):
    https: bool
    host: str
    port: int
    target: str  # path and query
    addresses: list[str]  # resolved and checked


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects only to the checked addresses; the Host header and TLS name stay the URL's host."""

    def __init__(self, host: str, port: int, addresses: list[str], timeout: float, tls: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout)
        self._addresses = addresses
        self._tls = tls
        self.pinned_sock: socket.socket | None = None  # outlives `sock`, which the response takes over

    def _connect_pinned(self) -> socket.socket:
        error: OSError | None = None
        for ip in self._addresses:
            try:
                return socket.create_connection((ip, self.port), self.timeout)
            except OSError as e:
                error = e
        raise error or OSError("no address to connect to")

    def connect(self) -> None:
        self.sock = self.pinned_sock = self._connect_pinned()


class _PinnedHTTPS(_PinnedHTTP):
    def connect(self) -> None:
        self.sock = self.pinned_sock = self._tls.wrap_socket(self._connect_pinned(), server_hostname=self.host)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


# ---- cache identity [_IMAGE_HASHES] -----------------------------------------------------------


def preprocess_digest(cfg: PreprocessConfig) -> bytes:
    """BLAKE2b-128 of the canonical JSON of the effective preprocessing config."""
    canonical = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def image_hash(config_digest: bytes, image: ProcessedImage) -> str:
    """32 hex chars: BLAKE2b-128 of (config digest ‖ grid as 3 little-endian int64 ‖ resized uint8
    pixels [Hp, Wp, 3] row-major). Equal inputs give equal hashes whatever the batch [VIS-8]."""
    h = hashlib.blake2b(config_digest, digest_size=16)
    h.update(np.asarray(image.grid_thw, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(image.resized_uint8, dtype=np.uint8).tobytes())
    return h.hexdigest()
