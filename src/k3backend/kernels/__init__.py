"""The one place that chooses an implementation for each op.

Model layers call only `kernels.<op>(...)`. Today every op is its torch reference (`*_ref.py`,
the definition of the op); fused Triton kernels will register here beside them, selected by
`K3_KERNELS=ref|triton|auto`, read once in this module.
"""

from k3backend.kernels.kda_ref import (
    kda_chunked,
    kda_decode,
    kda_gate,
    kda_prefill,
    kda_recurrent,
    short_conv,
    short_conv_decode,
    short_conv_seq,
)
from k3backend.kernels.mla_ref import mla_absorbed, mla_decode, mla_mha, mla_prefill, mla_write
from k3backend.kernels.moe_ref import Activation, experts, glu, route, silu_and_mul, situ_and_mul
from k3backend.kernels.norm_ref import (
    acc_dtype,
    attn_res_mix,
    gated_rms_norm,
    l2_norm,
    rms_norm,
)

__all__ = [
    "Activation", "acc_dtype", "attn_res_mix", "experts", "gated_rms_norm", "glu", "kda_chunked", "kda_decode",
    "kda_gate", "kda_prefill", "kda_recurrent", "l2_norm", "mla_absorbed", "mla_decode", "mla_mha", "mla_prefill",
    "mla_write", "rms_norm", "route", "short_conv", "short_conv_decode", "short_conv_seq", "silu_and_mul",
    "situ_and_mul",
]
