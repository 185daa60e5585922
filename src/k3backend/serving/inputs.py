"""Typed access to one request's inputs: BYTES/number tensors (batch dimension stripped) and the
scalar coercion shared by `sampling_parameters` JSON and request parameters (SERVING.md §2.2, [SMP-3]).

Every failure is `InvalidArgument` naming the input and value; `serving.params` builds on these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import numpy as np
import torch

from k3backend.errors import InvalidArgument

# get(name) -> the input with its batch dimension, or None when absent. Any input may come as a
# torch.Tensor (DLPack: BF16 has no numpy dtype, and with FORCE_CPU_ONLY_INPUT_TENSORS=no inputs may
# sit on the GPU). `image_embeds` stays a tensor where it is; the small ones are copied to numpy.
TensorGetter = Callable[[str], Union[np.ndarray, torch.Tensor, None]]


# ---- scalar coercion (JSON values and request parameters, [SMP-3]) -----------------------------


def show_value(value: Any) -> str:
    """repr for an error message, cut short: a hostile value must not make a megabyte message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_number(text: str) -> int | float | None:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:  # also int() beyond Python's digit limit
            pass
    return None


def as_int(value: Any, where: str) -> int:
    number = parse_number(value) if isinstance(value, str) else value
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, int) and not isinstance(number, bool):
        return number
    raise InvalidArgument(f"{where} must be an integer, got {show_value(value)}")


def as_float(value: Any, where: str) -> float:
    number = parse_number(value) if isinstance(value, str) else value
    if isinstance(number, (int, float)) and not isinstance(number, bool):
        try:
            return float(number)
        except OverflowError:
            pass
    raise InvalidArgument(f"{where} must be a number, got {show_value(value)}")


def as_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgument(f"{where} must be a boolean, got {show_value(value)}")


def as_strs(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{where} must be a list of strings, got {show_value(value)}")
    return value


def as_stop(value: Any, where: str) -> list[str]:
    return [value] if isinstance(value, str) else as_strs(value, where)


def as_ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a list of integers, got {show_value(value)}")
    return [as_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


COERCE: dict[str, Callable[[Any, str], Any]] = {
    "int": as_int, "float": as_float, "bool": as_bool, "strs": as_strs, "stop": as_stop, "ints": as_ints,
}


# ---- tensors -----------------------------------------------------------------------------------


def to_bytes(name: str, element: Any) -> bytes:
    if isinstance(element, (bytes, np.bytes_)):
        return bytes(element)
    if isinstance(element, str):  # tests and numpy 'U' arrays; lone surrogates fail the UTF-8 check
        return element.encode("utf-8", errors="surrogatepass")
    raise InvalidArgument(f"{name}: expected BYTES elements, got {type(element).__name__}")


def decode_utf8(raw: bytes | str, name: str) -> str:
    """A BYTES element as text; invalid UTF-8 is INVALID_ARG naming the input and byte ([PRM-2])."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{name} is not valid UTF-8 at byte {e.start}") from None


class Inputs:
    """Typed access to one request's tensors, batch dimension stripped (batch must be 1)."""

    def __init__(self, get: TensorGetter):
        self._get = get

    def array(self, name: str) -> np.ndarray | torch.Tensor | None:
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, torch.Tensor) and name != "image_embeds":
            value = value.detach().cpu().numpy()
        shape = tuple(value.shape)
        if not shape or shape[0] != 1:
            raise InvalidArgument(f"{name}: expected a batch dimension of 1, got shape {list(shape)}")
        return value[0]

    def _one(self, name: str) -> np.ndarray | None:
        arr = self.array(name)
        if arr is not None and arr.size != 1:
            raise InvalidArgument(f"{name} must hold exactly one value, got shape {list(arr.shape)}")
        return None if arr is None else arr.reshape(-1)

    def flag(self, name: str) -> bool | None:
        arr = self._one(name)
        if arr is None:
            return None
        if arr.dtype != np.bool_:
            raise InvalidArgument(f"{name}: expected BOOL, got {arr.dtype}")
        return bool(arr[0])

    def int(self, name: str) -> int | None:
        arr = self._one(name)
        if arr is None:
            return None
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"{name}: expected an integer type, got {arr.dtype}")
        return int(arr[0])

    def float(self, name: str) -> float | None:
        arr = self._one(name)
        if arr is None:
            return None
        if arr.dtype.kind != "f":
            raise InvalidArgument(f"{name}: expected FP32, got {arr.dtype}")
        return float(str(arr[0]))  # the shortest text of the fp32 value: 0.7, not 0.699999988079071

    def raw(self, name: str) -> bytes | None:
        arr = self._one(name)
        return None if arr is None else to_bytes(name, arr[0])

    def text(self, name: str) -> str | None:
        raw = self.raw(name)
        return None if raw is None else decode_utf8(raw, name)

    def texts(self, name: str) -> list[str] | None:
        arr = self.array(name)
        if arr is None:
            return None
        return [decode_utf8(to_bytes(name, x), f"{name}[{i}]") for i, x in enumerate(arr.reshape(-1))]

    def ints(self, name: str) -> list[int] | None:
        arr = self.array(name)
        if arr is None:
            return None
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"{name}: expected an integer type, got {arr.dtype}")
        return [int(x) for x in arr.reshape(-1)]


def alias(inputs: Inputs, name: str, alias: str) -> int | None:
    """[SMP-2]: both tensors of an alias pair given with different values is INVALID_ARG."""
    value, other = inputs.int(name), inputs.int(alias)
    if value is not None and other is not None and value != other:
        raise InvalidArgument(f"{name} ({value}) and {alias} ({other}) disagree")
    return value if value is not None else other
