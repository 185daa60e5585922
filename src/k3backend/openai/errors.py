"""OpenAI error bodies and the one table from Triton errors to HTTP statuses (docs/errors.md).

k3_lm and k3_vision put their code in the message (`<model>: <CODE>: <detail>`), which is the
only place a gRPC stream client sees it; Triton's own errors (unknown model, ...) have no code.
"""

from __future__ import annotations

import json
import re

import grpc

_CODE = re.compile(r"\b(INVALID_ARG|UNSUPPORTED|UNAVAILABLE|CANCELLED|INTERNAL): ")
# Triton core's answers when the model is not loaded (explicit mode, unloaded after an engine
# failure, still loading): the deployment is not ready, not the client's mistake.
_NOT_READY = ("unknown model", "has no available versions", "is not ready")
_QUEUE_FULL = "request queue is full"


class ApiError(Exception):
    """An error answer: HTTP status plus OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_triton(message: str) -> ApiError:
    """The error of one Triton response, by the code in its message (docs/errors.md)."""
    m = _CODE.search(message)
    code = m.group(1) if m else None
    if code in ("INVALID_ARG", "UNSUPPORTED"):
        return ApiError(400, message, code=code.lower())
    if code == "UNAVAILABLE":
        if _QUEUE_FULL in message:  # k3_lm's max_queued_requests: retry later
            return ApiError(429, message, "rate_limit_error", code="queue_full")
        return ApiError(503, message, "service_unavailable", code="unavailable")
    if code == "CANCELLED":  # only the gateway cancels, so no client normally sees this
        return ApiError(503, message, "service_unavailable", code="cancelled")
    if code is None and any(s in message for s in _NOT_READY):
        return ApiError(503, f"model not ready: {message}", "service_unavailable", code="model_not_ready")
    # INTERNAL, or a Triton core refusal of what the gateway sent: a defect on the serving side.
    return ApiError(500, message, "server_error", code=(code or "triton_error").lower())


def from_rpc(err: grpc.RpcError) -> ApiError:
    """A failed gRPC call (the server is down or unreachable, the connection dropped)."""
    status = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    message = f"Triton gRPC {getattr(status, 'name', status)}: {details}"
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return ApiError(503, message, "service_unavailable", code="triton_unreachable")
    return ApiError(502, message, "server_error", code="bad_gateway")
