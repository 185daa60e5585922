"""Errors that reach clients, each with the Triton error code it maps to (SERVING.md §7).

Raised anywhere (parsing, engine admission, image decoding); `serving.responses` maps `code` to
`pb_utils.TritonError` codes in one table. Anything else that escapes is a defect (INTERNAL).
"""

from __future__ import annotations


class K3Error(Exception):
    """Base of client-visible errors. `code` is one of INVALID_ARG, UNSUPPORTED, UNAVAILABLE, CANCELLED."""

    code = "INTERNAL"


class InvalidArgument(K3Error, ValueError):
    """A client mistake: bad value, bad JSON, prompt too long, placeholder mismatch, undecodable image."""

    code = "INVALID_ARG"


class Unsupported(K3Error):
    """A well-formed request for something not implemented (beam_width > 1, guided decoding, ...)."""

    code = "UNSUPPORTED"


class Unavailable(K3Error):
    """The server cannot take the request now: engine unhealthy, shutting down, queue full, remote fetch failed."""

    code = "UNAVAILABLE"


class Cancelled(K3Error):
    """The client cancelled the request (gRPC stream cancel)."""

    code = "CANCELLED"


class Internal(K3Error):
    """A defect caught at one request's boundary (its output processing failed): that request ends
    with INTERNAL and this message, which names the cause; other requests go on."""

    code = "INTERNAL"


def from_code(code: str, message: str) -> K3Error:
    """The error of `code` with `message` (errors that crossed a process boundary as text)."""
    kinds = {k.code: k for k in (InvalidArgument, Unsupported, Unavailable, Cancelled, Internal)}
    return kinds.get(code, Internal)(message)
