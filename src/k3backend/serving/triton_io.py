"""The Python-backend boundary: model parameters, request tensors in, response tensors and errors out.

Everything that touches `triton_python_backend_utils` objects for k3_lm goes through here, so the
adapter logic above it works on plain numpy / torch / dicts.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from k3backend.config import ConfigError
from k3backend.errors import InvalidArgument


def setup_logging() -> None:
    """Route the `k3backend` logger to the stub's stderr (the server log) at INFO, once per process.

    faulthandler too: a stub that dies of a signal then leaves its Python stacks in the server log.
    And the stub ends at the start of interpreter teardown: by then `finalize` ran and the stub
    released the server's objects, and the teardown of torch's modules would only keep Triton's
    unload (and a shutdown) waiting a second or two per stub.
    """
    faulthandler.enable(sys.stderr)
    in_stub = "triton_python_backend_utils" in sys.modules  # never in a test process: it would hide its exit status
    if in_stub and not getattr(setup_logging, "_exit_registered", False):
        setup_logging._exit_registered = True  # type: ignore[attr-defined]
        atexit.register(_exit_now)
    root = logging.getLogger("k3backend")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _exit_now() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def triton_error_code(pb_utils: Any, code: str) -> int:
    """Triton's TritonError code for our code name (SERVING.md §7.3)."""
    return getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)


# Python-backend settings a deployment may add to any model; accepted and left to the backend.
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS", "ENABLE_MEMORY_GROWTH")


class ModelParams:
    """Typed access to a model's config.pbtxt `parameters`, with defaults.

    Unknown names and unparsable values fail the load with a `ConfigError` naming the parameter
    ([CFG-L3]); an empty string is the default unless the caller says the value is optional.
    """

    def __init__(self, model_config: Mapping[str, Any], defaults: Mapping[str, str], model_name: str) -> None:
        raw = {k: v.get("string_value", "") if isinstance(v, dict) else str(v)
               for k, v in (model_config.get("parameters") or {}).items()}
        unknown = sorted(set(raw) - set(defaults) - set(BACKEND_PARAMETERS))
        if unknown:
            raise ConfigError(f"{model_name}: unknown parameter(s) {unknown}; known: {sorted(defaults)}")
        self._values = {**defaults, **{k: v for k, v in raw.items() if k in defaults}}
        self._model = model_name

    def _fail(self, name: str, expected: str) -> ConfigError:
        return ConfigError(f"{self._model}: parameter {name}: expected {expected}, got {self._values[name]!r}")

    def str(self, name: str) -> str:
        return self._values[name].strip()

    def int(self, name: str, lo: int, hi: int | None = None, optional: bool = False) -> Any:
        s = self.str(name)
        if optional and not s:
            return None
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise self._fail(name, f"an integer in [{lo}, {hi if hi is not None else 'inf'}]"
                             + (" or empty" if optional else ""))
        return v

    def float(self, name: str, lo: float, hi: float = float("inf")) -> float:
        try:
            v = float(self.str(name))
        except ValueError:
            v = float("nan")
        if not (lo <= v <= hi and v != float("inf")):
            raise self._fail(name, f"a finite number >= {lo:g}" + (f" and <= {hi:g}" if hi != float("inf") else ""))
        return v

    def bool(self, name: str) -> bool:
        s = self.str(name).lower()
        if s not in ("true", "false", "1", "0", "yes", "no"):
            raise self._fail(name, "true or false")
        return s in ("true", "1", "yes")

    def choice(self, name: str, options: Sequence[str]) -> str:
        s = self.str(name).lower()
        if s not in options:
            raise self._fail(name, f"one of {list(options)}")
        return s


def resolve_device_dtype(device: str, dtype: str, model_name: str, gpu_id: int = 0) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA when a GPU is visible, else CPU; `auto` dtype: bfloat16 on GPU, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{model_name}: parameter device: cuda requested but no GPU is visible")
        if gpu_id >= torch.cuda.device_count():
            raise ConfigError(f"{model_name}: GPU {gpu_id} does not exist ({torch.cuda.device_count()} visible)")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device, gpu_id) if device == "cuda" else torch.device("cpu"), getattr(torch, dtype)


def input_getter(request: Any) -> Callable[[str], np.ndarray | torch.Tensor | None]:
    """`get(name)` for `serving.params.parse_request`: numpy arrays, or a torch tensor for BF16 inputs.
    The inputs are listed once: pb_utils.get_input_tensor_by_name lists and scans them on every call,
    and a request is asked for some 45 optional inputs (about 0.2 ms per request that way)."""
    tensors = {t.name(): t for t in request.inputs()}

    def get(name: str) -> np.ndarray | torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            return None
        try:
            return t.as_numpy()
        except Exception:  # BF16 has no numpy dtype: take it through DLPack
            return torch.utils.dlpack.from_dlpack(t.to_dlpack())

    return get


def request_id(request: Any) -> str:
    """The request's id. HTTP lets a client send any bytes there; the backend's UTF-8 decoding then
    fails, which is the client's mistake, not an internal error."""
    try:
        return request.request_id()
    except UnicodeDecodeError:
        raise InvalidArgument("the request id is not valid UTF-8") from None


def request_parameters(request: Any) -> dict[str, Any]:
    """The request's Triton parameters (HTTP `/generate` puts unknown body keys here, [SMP-1] level 3)."""
    try:
        raw = request.parameters()
    except UnicodeDecodeError:
        raise InvalidArgument("the request parameters are not valid UTF-8") from None
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
