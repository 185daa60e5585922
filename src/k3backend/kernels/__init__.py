"""The one place that chooses an implementation for each op.

Model layers call only `kernels.<op>(...)`. Every op has its torch reference in `*_ref.py` (the
definition of the op); a fused Triton implementation in `kernels/<family>.py` registers under the
same name and signature with a verifier `(args) -> (ok, reason)`. `K3_KERNELS` (read once, here)
selects: `ref` (references only), `triton` (the fast path wherever its verifier accepts the call),
or `auto` (default: the fast path for CUDA tensors, the reference elsewhere). The choice of each op,
and the first reason a fast path declines a call, is logged once.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from k3backend.kernels.kda_ref import (
    kda_chunked,
    kda_decode,
    kda_decode_fused,
    kda_gate,
    kda_prefill,
    kda_prefill_inputs,
    kda_recurrent,
    short_conv,
    short_conv_decode,
    short_conv_seq,
)
from k3backend.kernels.linear_ref import linear
from k3backend.kernels.mla_ref import mla_absorbed, mla_decode, mla_latent, mla_mha, mla_prefill, mla_write
from k3backend.kernels.moe_ref import (
    Activation,
    dequant_mxfp4,
    experts,
    experts_mxfp4,
    glu,
    glu_linear,
    moe_front,
    route,
    router,
    silu_and_mul,
    situ_and_mul,
)
from k3backend.kernels.norm_ref import (
    acc_dtype,
    attn_res_mix,
    attn_res_mix_norm,
    gated_rms_norm,
    l2_norm,
    rms_norm,
)
from k3backend.kernels.sample_ref import race_draw, softmax_rows, top_k_top_p
from k3backend.kernels.varlen import VarlenLayout, varlen_layout

log = logging.getLogger(__name__)

MODE = os.environ.get("K3_KERNELS", "auto").strip().lower()
if MODE not in ("ref", "triton", "auto"):
    raise ValueError(f"K3_KERNELS must be ref, triton or auto, got {MODE!r}")

# Fast implementations: op name -> module that defines `<op>` and `<op>_supports(*args, **kwargs)`.
FAST_OPS: dict[str, str] = {
    **dict.fromkeys(("kda_decode_fused", "kda_decode", "short_conv"), "k3backend.kernels.kda"),
    **dict.fromkeys(("kda_prefill", "kda_prefill_inputs"), "k3backend.kernels.kda_chunk"),
    "experts": "k3backend.kernels.moe",
    "linear": "k3backend.kernels.gemv",
    "experts_mxfp4": "k3backend.kernels.moe",
    "glu_linear": "k3backend.kernels.moe",
    **dict.fromkeys(("router", "moe_front"), "k3backend.kernels.routing"),
    "mla_decode": "k3backend.kernels.mla",
    "mla_prefill": "k3backend.kernels.mla",
    "rms_norm": "k3backend.kernels.norm",
    "gated_rms_norm": "k3backend.kernels.norm",
    "attn_res_mix": "k3backend.kernels.norm",
    "attn_res_mix_norm": "k3backend.kernels.norm",
    "mla_latent": "k3backend.kernels.norm",
    **dict.fromkeys(("race_draw", "softmax_rows", "top_k_top_p"), "k3backend.kernels.sample"),
}

Verifier = Callable[..., tuple[bool, str]]


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    import torch

    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _dispatch(name: str, ref: Callable, module: str) -> Callable:
    """ref, or a function that takes the fast path where its verifier accepts the call."""
    try:
        mod = importlib.import_module(module)
        fast, supports = getattr(mod, name), getattr(mod, f"{name}_supports")
    except ImportError as e:  # no triton on this machine
        log.info("kernels: %s uses the torch reference (%s)", name, e)
        return ref
    seen: set[str] = set()  # what was logged: "ref", "triton", and each reason a call was declined

    def once(key: str, message: str, *args: Any) -> None:
        if key not in seen:
            seen.add(key)
            log.info(message, *args)

    def op(*args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args, kwargs)
        if MODE == "auto" and (t is None or not t.is_cuda):
            once("ref", "kernels: %s runs its torch reference (mode auto, tensors not on a GPU)", name)
            return ref(*args, **kwargs)
        ok, reason = supports(*args, **kwargs)
        if ok:
            once("triton", "kernels: %s runs its Triton kernel (%s, mode %s)", name, module, MODE)
            return fast(*args, **kwargs)
        once(reason, "kernels: the Triton %s declines a call (%s); the torch reference runs it", name, reason)
        return ref(*args, **kwargs)

    op.__name__, op.__doc__, op.__wrapped__ = name, ref.__doc__, ref  # type: ignore[attr-defined]
    return op


if MODE != "ref":
    for _name, _module in FAST_OPS.items():
        globals()[_name] = _dispatch(_name, globals()[_name], _module)


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Every op runs its torch reference inside this block whatever K3_KERNELS says (the model looks
    ops up here at call time): the fp32 reference side of a comparison in the same process."""
    fast = {name: globals()[name] for name in FAST_OPS}
    globals().update({name: getattr(op, "__wrapped__", op) for name, op in fast.items()})
    try:
        yield
    finally:
        globals().update(fast)

__all__ = [
    "Activation", "acc_dtype", "attn_res_mix", "attn_res_mix_norm", "dequant_mxfp4", "experts", "experts_mxfp4",
    "gated_rms_norm", "glu", "kda_chunked",
    "kda_decode", "kda_gate", "kda_prefill", "kda_prefill_inputs", "kda_recurrent", "l2_norm", "linear",
    "mla_absorbed", "mla_decode", "mla_latent", "mla_mha", "mla_prefill", "moe_front",
    "mla_write", "race_draw", "rms_norm", "route", "router", "short_conv", "short_conv_decode", "short_conv_seq",
    "silu_and_mul", "softmax_rows",
    "situ_and_mul", "glu_linear", "kda_decode_fused", "top_k_top_p", "VarlenLayout", "varlen_layout",
]
