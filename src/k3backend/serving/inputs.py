"""Typed access to one request's inputs: BYTES/number tensors (batch dimension stripped) and the
scalar coercion shared by `sampling_parameters` JSON and request parameters (SERVING.md §2.2, [SMP-3]).

Every failure is `InvalidArgument` naming the input and value; `serving.params` builds on these.
`ScalarType` (INT32, UINT64, FP32, BOOL) is the one rule for numbers and booleans, whichever
source (tensor, JSON, request parameter) they come from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from k3backend.errors import InvalidArgument

# get(name) -> the input with its batch dimension, or None when absent. Any input may come as a
# torch.Tensor (DLPack: BF16 has no numpy dtype, and with FORCE_CPU_ONLY_INPUT_TENSORS=no inputs may
# sit on the GPU). `image_embeds` stays a tensor where it is; the small ones are copied to numpy.
TensorGetter = Callable[[str], Union[np.ndarray, torch.Tensor, None]]


# ---- scalar coercion: the one rule for every number and boolean of a request ([SMP-3]) ----------


def show_value(value: Any) -> str:
    """repr for an error message, cut short: a hostile value must not make a megabyte message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# A number sent as a string must be spelled as a JSON number: int()/float() alone would also take
# "nan", "inf", "1_000" and non-ASCII digits, which no client means as a sampling setting.
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# Above 2**53 a float no longer names one integer (1e19 + 1 == 1e19), so it cannot stand for one.
_MAX_EXACT_FLOAT = 2**53
_FP32_MAX = float(np.finfo(np.float32).max)


def _number(value: Any) -> int | float | None:
    """A JSON number, or a string spelled as one, as int or float; None for anything else."""
    if isinstance(value, str):
        text = value.strip()
        if not _JSON_NUMBER.fullmatch(text):
            return None
        try:
            return int(text) if text.lstrip("-").isdigit() else float(text)
        except ValueError:  # int() beyond Python's digit limit
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # True is not a number here
        return value
    return None


@dataclass(frozen=True)
class ScalarType:
    """The §2.2 type of a setting. A value from any source (input tensor, `sampling_parameters`,
    request parameter) must be one the declared tensor could carry, so every path means the same.

    Called as `INT32(value, where)`; a failure is `InvalidArgument` naming `where`, the expected
    type and the value. Ranges of meaning (top_p in (0, 1], ...) are `SamplingParams`' job.
    """

    name: str  # Triton name, for messages
    kind: str  # "int", "float" or "bool"
    lo: int = 0
    hi: int = 0
    bounds: str = ""  # the range as messages print it

    def __call__(self, value: Any, where: str) -> int | float | bool:
        if self.kind == "bool":
            return _as_bool(value, where)
        number = _number(value)
        if self.kind == "float":
            if number is None:
                raise InvalidArgument(f"{where} must be a number, got {show_value(value)}")
            if abs(number) > _FP32_MAX and not (isinstance(number, float) and math.isinf(number)):
                raise InvalidArgument(f"{where} must be a number within ±{_FP32_MAX:.7g} ({self.name}), "
                                      f"got {show_value(value)}")
            return float(number)  # NaN and inf pass: the range rules of each setting reject them
        if number is None or (isinstance(number, float) and not number.is_integer()):  # NaN, inf, 2.5
            raise InvalidArgument(f"{where} must be an integer, got {show_value(value)}")
        if not self.lo <= number <= self.hi:
            raise InvalidArgument(f"{where} must be an integer in {self.bounds} ({self.name}), got {show_value(value)}")
        if isinstance(number, float) and abs(number) > _MAX_EXACT_FLOAT:
            raise InvalidArgument(f"{where} must be an integer, got {show_value(value)}: a float above 2**53 is "
                                  "not exact; send the integer digits")
        return int(number)


def _as_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgument(f"{where} must be a boolean (true or false), got {show_value(value)}")


INT32 = ScalarType("INT32", "int", -2**31, 2**31 - 1, "[-2**31, 2**31)")
UINT64 = ScalarType("UINT64", "int", 0, 2**64 - 1, "[0, 2**64)")
FP32 = ScalarType("FP32", "float")
BOOL = ScalarType("BOOL", "bool")


def as_strs(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{where} must be a list of strings, got {show_value(value)}")
    return value


def as_stop(value: Any, where: str) -> list[str]:
    return [value] if isinstance(value, str) else as_strs(value, where)


def as_int32s(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a list of integers, got {show_value(value)}")
    return [INT32(v, f"{where}[{i}]") for i, v in enumerate(value)]


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
            try:
                value = value.detach().cpu().numpy()
            except TypeError:  # BF16 and other dtypes numpy lacks: only image_embeds is declared so
                raise InvalidArgument(f"{name}: unexpected tensor dtype {value.dtype}") from None
        shape = tuple(value.shape)
        if not shape or shape[0] != 1:
            raise InvalidArgument(f"{name}: expected a batch dimension of 1, got shape {list(shape)}")
        return value[0]

    def _one(self, name: str) -> np.ndarray | None:
        arr = self.array(name)
        if arr is not None and arr.size != 1:
            raise InvalidArgument(f"{name} must hold exactly one value, got shape {list(arr.shape)}")
        return None if arr is None else arr.reshape(-1)

    def scalar(self, name: str, type: ScalarType) -> int | float | bool | None:
        """A one-value tensor, held to `type` like the same setting from JSON ([SMP-3])."""
        arr = self._one(name)
        return None if arr is None else type(_values(name, arr, type)[0], name)

    def flag(self, name: str) -> bool | None:
        return self.scalar(name, BOOL)

    def int(self, name: str, type: ScalarType = INT32) -> int | None:
        return self.scalar(name, type)

    def float(self, name: str) -> float | None:
        return self.scalar(name, FP32)

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
        return [INT32(v, f"{name}[{i}]") for i, v in enumerate(_values(name, arr, INT32))]


# numpy dtype kinds a tensor of each kind of setting may have: Triton delivers the declared dtype;
# a wider one (int64, float64: in-process callers, tests) is fine because the value is checked.
_TENSOR_KINDS = {"int": "iu", "float": "f", "bool": "b"}


def _values(name: str, arr: np.ndarray, type: ScalarType) -> list[int | float | bool]:
    """The tensor's elements as Python values, after checking that its dtype suits `type`."""
    if arr.dtype.kind not in _TENSOR_KINDS[type.kind]:
        raise InvalidArgument(f"{name}: expected {type.name}, got {arr.dtype}")
    if type.kind == "float":  # the shortest text of the fp32 value: 0.7, not 0.699999988079071
        return [float(str(x)) for x in arr.reshape(-1)]
    return [bool(x) if type.kind == "bool" else int(x) for x in arr.reshape(-1)]


def alias(inputs: Inputs, name: str, alias: str, type: ScalarType = INT32) -> int | None:
    """[SMP-2]: both tensors of an alias pair given with different values is INVALID_ARG."""
    value, other = inputs.int(name, type), inputs.int(alias, type)
    if value is not None and other is not None and value != other:
        raise InvalidArgument(f"{name} ({value}) and {alias} ({other}) disagree")
    return value if value is not None else other
