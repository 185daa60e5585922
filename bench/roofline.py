"""The roofline floor of one engine step: the bytes it must move at 4.27 TB/s and the FLOPs it must
do at 788 TFLOP/s (the H200 ceilings measured by bench/kernels.py), whichever takes longer.

Bytes: every weight but the embedding table (one row per token is noise), the routed experts the
step's tokens touch (E·(1 − (1 − k/E)^T) of E per layer under uniform routing), each sequence's KDA
state read and written once per KDA layer, and its MLA latent rows read once per MLA layer. FLOPs:
2 per weight per token over the active weights (shared + top-k routed), plus attention over the
context. `python bench/roofline.py` prints the floors of the `small` shape.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

HBM_BYTES_PER_S = 4.27e12
BF16_FLOPS = 788e12


@dataclass(frozen=True)
class Floor:
    bytes: float
    flops: float
    expert_bytes: float = 0.0  # of `bytes`: the routed experts touched (MXFP4: codes + exponents)

    @property
    def seconds(self) -> float:
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / BF16_FLOPS)


def _sizes(model: torch.nn.Module) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    """(dense weight bytes without the embedding, dense weight count, per MoE layer (E, top_k, bytes and
    weights of one expert)); MXFP4 experts: 2 codes a byte plus one exponent byte per 32."""
    lm = model.language_model
    dense_bytes = dense_count = 0
    moe = []
    for name, p in lm.named_parameters():
        if name.endswith("embed_tokens.weight"):
            continue
        if ".experts.w13" in name or ".experts.w2" in name:
            continue
        dense_bytes += p.numel() * p.element_size()
        dense_count += p.numel()
    for layer in lm.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            e = mlp.experts
            parts = [p[0] for n, p in e.named_parameters()]
            weights = (e.w13[0].numel() + e.w2[0].numel()) * (1 if e.quant is None else 2)
            moe.append((e.w13.shape[0], mlp.top_k, sum(p.numel() * p.element_size() for p in parts), weights))
    return dense_bytes, dense_count, moe


def step_floor(model: torch.nn.Module, num_tokens: int, context_lens: list[int]) -> Floor:
    """The floor of one step over `num_tokens` tokens of len(context_lens) sequences whose MLA
    caches hold `context_lens` tokens after the step: a decode step (one token per sequence) or a
    prefill of whole prompts (context_lens their lengths)."""
    dense_bytes, dense_count, moe = _sizes(model)
    lm = model.language_model
    elt = next(lm.parameters()).element_size()
    bytes_, flops, experts = float(dense_bytes), 2.0 * dense_count * num_tokens, 0.0
    for E, k, one, weights in moe:
        experts += E * (1 - (1 - k / E) ** num_tokens) * one  # the experts touched
        flops += 2.0 * num_tokens * k * weights
    bytes_ += experts
    for layer in lm.model.layers:
        attn = layer.self_attn
        if attn.is_kda:
            (H, K, V), _ = attn.cache_shapes()
            bytes_ += 2 * 4 * H * K * V * len(context_lens)  # fp32 state read + write
            flops += 4.0 * H * K * V * num_tokens
        else:
            bytes_ += sum(context_lens) * attn.cache_width * elt
            if num_tokens == len(context_lens):  # decode, absorbed form: scores over [c ; k_pe], values over c
                flops += 2.0 * attn.N * (attn.cache_width + attn.r) * sum(context_lens)
            else:  # prefill, expanded form over the causal half of each chunk's square
                pairs = sum(n * n / 2 for n in context_lens)
                flops += 2.0 * attn.N * (attn.dn + attn.dr + attn.dv) * pairs
    return Floor(bytes_, flops, experts)


def main() -> None:
    from k3backend.config import K3Config
    from k3backend.model.k3 import K3Model
    from k3backend.presets import preset_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--experts", choices=["bf16", "mxfp4"], default="bf16")
    args = ap.parse_args()
    raw = preset_config(args.preset)
    if args.experts == "mxfp4":
        from k3backend.config import mxfp4_quantization_config

        raw["quantization_config"] = mxfp4_quantization_config()
    with torch.device("meta"):
        model = K3Model(K3Config.from_dict(raw)).to(torch.bfloat16)
    for b in (1, 16, 64, 256):
        f = step_floor(model, b, [args.context] * b)
        print(f"decode batch {b:4d} context {args.context}: {f.seconds * 1e3:7.3f} ms  ({f.bytes / 1e9:.2f} GB, "
              f"routed experts {f.expert_bytes / f.bytes:.0%} of them, {f.flops / 1e12:.3f} TFLOP)")
    f = step_floor(model, 4096, [4096])
    print(f"prefill 1 x 4096: {f.seconds * 1e3:7.3f} ms  ({f.bytes / 1e9:.2f} GB, {f.flops / 1e12:.2f} TFLOP)")


if __name__ == "__main__":
    main()
