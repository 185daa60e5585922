"""The Python-backend boundary: model parameters, request tensors in, response tensors and errors out.

Everything that touches `triton_python_backend_utils` objects for k3_lm goes through here, so the
adapter logic above it works on plain numpy / torch / dicts.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Callable, Mapping

import numpy as np
import torch

from k3backend.errors import InvalidArgument


def setup_logging() -> None:
    """Route the `k3backend` logger to the stub's stderr (the server log) at INFO, once per process."""
    root = logging.getLogger("k3backend")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def triton_error_code(pb_utils: Any, code: str) -> int:
    """Triton's TritonError code for our code name (SERVING.md §7.3)."""
    return getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)


class ModelParams:
    """Typed access to a model's config.pbtxt `parameters` with defaults; unknown names fail the load ([CFG-L3])."""

    def __init__(self, model_config: Mapping[str, Any], defaults: Mapping[str, str], model_name: str) -> None:
        raw = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        unknown = sorted(set(raw) - set(defaults))
        if unknown:
            raise ValueError(f"{model_name}: unknown parameter(s) {unknown}; known: {sorted(defaults)}")
        self._values = {**defaults, **raw}
        self._model = model_name

    def str(self, name: str) -> str:
        return self._values[name]

    def int(self, name: str, minimum: int | None = None) -> int:
        try:
            v = int(self._values[name])
        except ValueError:
            raise ValueError(f"{self._model}: parameter {name}={self._values[name]!r} is not an integer") from None
        if minimum is not None and v < minimum:
            raise ValueError(f"{self._model}: parameter {name}={v} must be >= {minimum}")
        return v

    def float(self, name: str) -> float:
        try:
            return float(self._values[name])
        except ValueError:
            raise ValueError(f"{self._model}: parameter {name}={self._values[name]!r} is not a number") from None

    def bool(self, name: str) -> bool:
        v = self._values[name].strip().lower()
        if v in ("true", "1", "yes", "on"):
            return True
        if v in ("false", "0", "no", "off", ""):
            return False
        raise ValueError(f"{self._model}: parameter {name}={self._values[name]!r} is not true/false")


def input_getter(pb_utils: Any, request: Any) -> Callable[[str], np.ndarray | torch.Tensor | None]:
    """`get(name)` for `serving.params.parse_request`: numpy arrays, or a torch tensor for BF16 inputs."""

    def get(name: str) -> np.ndarray | torch.Tensor | None:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        try:
            return t.as_numpy()
        except Exception:  # BF16 has no numpy dtype: take it through DLPack
            return torch.utils.dlpack.from_dlpack(t.to_dlpack())

    return get


def request_parameters(request: Any) -> dict[str, Any]:
    """The request's Triton parameters (HTTP `/generate` puts unknown body keys here, [SMP-1] level 3)."""
    raw = request.parameters()
    try:
        params = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"request parameters are not valid JSON: {e}") from None
    return params if isinstance(params, dict) else {}


def output_tensors(pb_utils: Any, outputs: Mapping[str, np.ndarray | torch.Tensor]) -> list[Any]:
    tensors = []
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor):
            tensors.append(pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous())))
        else:
            tensors.append(pb_utils.Tensor(name, value))
    return tensors


def data_response(pb_utils: Any, outputs: Mapping[str, np.ndarray | torch.Tensor]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=output_tensors(pb_utils, outputs))


def error_response(pb_utils: Any, code: str, message: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, triton_error_code(pb_utils, code)))
