"""The one place that chooses an implementation for each op.

Model layers call only `kernels.<op>(...)`. Today every op is its torch reference (`*_ref.py`,
the definition of the op); fused Triton kernels will register here beside them, selected by
`K3_KERNELS=ref|triton|auto`, read once in this module.
"""

from k3backend.kernels.kda_ref import kda_chunked, kda_gate, kda_recurrent, short_conv
from k3backend.kernels.mla_ref import mla_absorbed, mla_mha
from k3backend.kernels.moe_ref import experts, route, silu_and_mul, situ_and_mul
from k3backend.kernels.norm_ref import (
    acc_dtype,
    attn_res_mix,
    gated_rms_norm,
    l2_norm,
    rms_norm,
)

__all__ = [
    "acc_dtype", "attn_res_mix", "experts", "gated_rms_norm", "kda_chunked", "kda_gate", "kda_recurrent",
    "l2_norm", "mla_absorbed", "mla_mha", "rms_norm", "route", "short_conv", "silu_and_mul", "situ_and_mul",
]
