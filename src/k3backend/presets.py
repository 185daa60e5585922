"""Named model sizes: config.json dictionaries of the exact K3 architecture at other sizes.

`tiny` exercises every K3 feature at toy size (issue: built-in default checkpoint): a dense first
layer, KDA and MLA layers in K3's pattern (every 4th layer MLA, the last layer MLA), three
Attention-Residual blocks, latent MoE with its norm, shared experts, two expert groups, SiTU,
and a vision tower with the K3 block structure. Its vocabulary is byte-level (256 ranks) plus
K3's 256 special slots, so special ids are K3's minus 163328.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3backend.checkpoint_write import TensorToWrite, expected_checkpoint_tensors, pad_a_log, shard_count, \
    stored_dtype, write_tensors
from k3backend.config import MXFP4_GROUP, TextConfig
from k3backend.kernels.moe_ref import E2M1

TINY_SPECIAL_BASE = 256  # first special id in the tiny vocabulary (163584 in K3)


def _tiny() -> dict[str, Any]:
    n_layers = 10
    mla = [4, 8, 10]  # 1-based: every 4th layer plus the last one, as in K3
    text = {
        "model_type": "kimi_linear",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": n_layers,
        "intermediate_size": 96,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_token": 3,
        "num_shared_experts": 2,
        "moe_intermediate_size": 64,  # MXFP4 groups of 32 must tile every expert matrix, also at moe-TP 2
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 2,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": 4,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, n_layers + 1) if i not in mla],
            "full_attn_layers": mla,
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "bos_token_id": TINY_SPECIAL_BASE + 0,
        "eos_token_id": TINY_SPECIAL_BASE + 2,
        "pad_token_id": TINY_SPECIAL_BASE + 255,
        "dtype": "bfloat16",
    }
    vision = {
        "patch_size": 14,
        "vt_hidden_size": 32,
        "hidden_size": 32,
        "vt_num_hidden_layers": 2,
        "vt_num_attention_heads": 2,
        "qkv_hidden_size": 48,
        "vt_intermediate_size": 64,
        "init_pos_emb_height": 16,
        "init_pos_emb_width": 16,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear",
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "linear_bias": False,
        "patch_embed_proj_bias": False,
        "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": 32,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": 64,
    }
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "bos_token_id": TINY_SPECIAL_BASE + 0,
        "eos_token_id": TINY_SPECIAL_BASE + 2,
        "pad_token_id": TINY_SPECIAL_BASE + 255,
        "media_placeholder_token_id": TINY_SPECIAL_BASE + 21,
        "tie_word_embeddings": False,
    }


def _small() -> dict[str, Any]:
    """The `small` benchmark shape: hidden 2048, 24 layers (18 KDA + 6 MLA), 64 experts top-6 at latent
    1024, vocab 163840 (6.08 B parameters). Every single-GPU performance figure uses it, so figures
    from different changes compare."""
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "intermediate_size": 8192,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "tie_word_embeddings": False,
        "num_experts": 64,
        "num_experts_per_token": 6,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1024,
        "routed_expert_hidden_size": 1024,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": 6,
        "linear_attn_config": {
            "kda_layers": [
                1,
                2,
                3,
                5,
                6,
                7,
                9,
                10,
                11,
                13,
                14,
                15,
                17,
                18,
                19,
                21,
                22,
                23
            ],
            "full_attn_layers": [
                4,
                8,
                12,
                16,
                20,
                24
            ],
            "num_heads": 16,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0
        },
        "bos_token_id": 163584,  # [BOS]; EOS is <|end_of_msg|>, as in K3's config.json (K3_LM.md §1.1)
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "dtype": "bfloat16"
    }


PRESETS = {"tiny": _tiny, "small": _small}


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of a preset's config.json dictionary."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name]())


def _init_rule(name: str, shape: torch.Size) -> tuple[str, float, float]:
    """(distribution, scale, offset) of one parameter's random value: scales that keep activations
    O(1) through all layers. distribution: "normal", or "a_log" (log(1 + 15·U), exp(A) in [1, 16])."""
    if name.endswith("A_log"):
        return "a_log", 1.0, 0.0
    if name.endswith("dt_bias"):
        return "normal", 0.5, 0.0
    if name.endswith("e_score_correction_bias"):
        return "normal", 0.01, 0.0
    if name.endswith(("conv1d.weight", "conv1d_weight")):
        return "normal", 1 / math.sqrt(shape[-1]), 0.0
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "normal", 0.1, 1.0
    if name.endswith("embed_tokens.weight"):
        return "normal", 1.0, 0.0
    if name.endswith("pos_emb.weight"):
        return "normal", 0.5, 0.0
    if name.endswith(("experts.w13", "experts.w2")):
        return "normal", 1 / math.sqrt(shape[-1]), 0.0
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return "normal", 1 / math.sqrt(fan_in), 0.0


# MXFP4 random experts (§7.7): uniform codes have E[c²] = mean(E2M1²) = 8.5625; exponents s0 + {-1, 0, 1}
# (E[2^2(s-s0)] = 1.75) with s0 chosen so that E[w²] ≈ 1 / fan_in, as for the bf16 experts.
_E2M1_MEAN_SQUARE = sum(v * v for v in E2M1) / len(E2M1)


@dataclass(frozen=True)
class Conditioning:
    """A well-conditioned random model (issue 17): the same architecture, weights whose bf16 rounding
    errors do not compound chaotically, so an end-to-end numerics check (bench/agreement.py) can tell
    a kernel error from rounding.

    The default init routes every token through near ties: a bf16 rounding of the router's input
    flips an expert choice of a few percent of the tokens in each layer, each flip moves that token's
    layer output by tens of percent, and after 24 layers bf16 logits are unrelated to fp32 ones.
    Here each MoE layer's `e_score_correction_bias` lifts top_k experts of one group (drawn per layer)
    by `bias` > 1, more than any sigmoid score difference, so selection never depends on rounding
    (the routing weights still depend on the token); and the sub-layers' output projections are
    scaled by `out_scale`, so each layer's rounding adds less to the stream the next layers read.
    """

    top_k: int
    num_groups: int
    bias: float = 2.0
    out_scale: float = 0.5

    @classmethod
    def of(cls, text: TextConfig) -> Conditioning:
        return cls(text.num_experts_per_token or 0, text.num_expert_group)


_OUTPUT_PROJECTIONS = (".o_proj.weight", ".down_proj.weight", ".routed_expert_up_proj.weight")  # what a sub-layer adds


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator,
                  device: str | torch.device = "cpu", cond: Conditioning | None = None) -> torch.Tensor:
    """A random value of one tensor by `_init_rule` (parameter and checkpoint names both work), in dtype,
    with at most one fp32 temporary. uint8 tensors are MXFP4: exponents where the name ends in `scale`
    (fan-in = 32 × their last dim), codes (uniform bytes) otherwise. cond: the conditioned variant."""
    if dtype == torch.uint8:
        if name.endswith("scale"):
            s0 = round(127 - 0.5 * math.log2(_E2M1_MEAN_SQUARE * 1.75 * shape[-1] * MXFP4_GROUP))
            return (torch.randint(-1, 2, shape, generator=g, device=device, dtype=torch.int16) + s0).to(dtype)
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=dtype)
    if cond is not None and name.endswith("e_score_correction_bias"):
        return _fixed_routing_bias(shape[0], cond, g, device).to(dtype)
    kind, scale, offset = _init_rule(name, shape)
    if cond is not None and name.endswith(_OUTPUT_PROJECTIONS) and not name.startswith("vision"):
        scale *= cond.out_scale
    if kind == "a_log":
        x = torch.rand(shape, generator=g, device=device).mul_(15).add_(1).log_()
    else:
        x = torch.randn(shape, generator=g, device=device).mul_(scale).add_(offset)
    return x.to(dtype)


def _fixed_routing_bias(num_experts: int, cond: Conditioning, g: torch.Generator,
                        device: str | torch.device) -> torch.Tensor:
    """`cond.bias` on top_k random experts of one random group, 0 elsewhere: grouped top-k then picks
    that group and those experts for every token (group scores sum biased scores too, §7.3)."""
    per_group = num_experts // cond.num_groups
    if per_group < cond.top_k:
        raise ValueError(f"conditioned init: {per_group} experts per group < num_experts_per_token {cond.top_k}")
    group = int(torch.randint(0, cond.num_groups, (), generator=g, device=device))
    chosen = group * per_group + torch.randperm(per_group, generator=g, device=device)[:cond.top_k]
    return torch.zeros(num_experts, device=device).index_fill_(0, chosen, cond.bias)


def tensor_seed(seed: int, name: str) -> int:
    """A tensor's own generator seed: its value depends on the seed and its name only."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


@torch.no_grad()
def randomize_weights_(model: torch.nn.Module, seed: int = 0, *, conditioned: bool = False) -> torch.nn.Module:
    """Random weights by the same rules, drawn on the model's device in its dtypes (benchmarks of
    big presets without a checkpoint: `bench/engine.py --random-weights small`). conditioned: the
    `Conditioning` of the model's config (a K3Model or K3ForCausalLM)."""
    text = getattr(model.cfg, "text", model.cfg)
    cond = Conditioning.of(text) if conditioned else None
    for name, p in model.named_parameters():
        g = torch.Generator(device=p.device).manual_seed(tensor_seed(seed, name))
        p.copy_(random_tensor(name, tuple(p.shape), p.dtype, g, p.device, cond))
    return model


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")


def text_only_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The `kimi_linear` config.json of a kimi_k3 config's language model: its text_config at the top
    level with the token ids (the layout of a text-only Kimi Linear checkpoint)."""
    return {**raw["text_config"], "architectures": ["KimiLinearForCausalLM"],
            **{k: raw[k] for k in TOKEN_IDS if k in raw}}


def make_checkpoint(preset: str, out: str | Path, seed: int = 0, *, experts: str = "bf16",
                    num_shards: int | None = None, threads: int | None = None, text_only: bool = False,
                    conditioned: bool = False) -> Path:
    """Write a deterministic random-weight checkpoint of a preset: config.json, generation_config.json,
    bf16 safetensors (sharded, with an index), the tokenizer files and preprocessor_config.json.

    Every tensor is drawn on its own (`tensor_seed`) in its stored dtype, `threads` at a time, and
    written a shard at a time (`checkpoint_write.write_tensors`): no full-precision copy of the model
    exists, and the values depend on the seed alone. experts="mxfp4": the routed experts as the K3
    release stores them (`weight_packed` + `weight_scale`, compressed-tensors, §7.7). The tokenizer
    covers the preset's whole vocabulary (`tokenizer.write_tokenizer`). text_only: a `kimi_linear`
    checkpoint of the preset's language model alone (no tower, no preprocessor config). conditioned:
    the well-conditioned variant of the weights (`Conditioning`).
    """
    from k3backend.config import K3Config, mxfp4_quantization_config
    from k3backend.model.k3 import K3Model
    from k3backend.model.preprocess import PreprocessConfig
    from k3backend.tokenizer import N_SPECIAL, Tokenizer, check_tokenizer_matches, write_tokenizer

    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts: expected bf16 or mxfp4, got {experts!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = preset_config(preset)
    if experts == "mxfp4":
        raw["quantization_config"] = mxfp4_quantization_config()
    if text_only:
        raw = text_only_config(raw)
    cfg = K3Config.from_dict(raw)
    with torch.device("meta"):
        model = K3Model(cfg)
    cond = Conditioning.of(cfg.text) if conditioned else None
    recipes = [_recipe(name, p, seed, cfg.text.linear_attn_config.head_dim, cond)
               for name, p in expected_checkpoint_tensors(model, cfg.model_type)]
    write_tensors(out, recipes, num_shards or shard_count(recipes), threads or min(16, os.cpu_count() or 1))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": [raw["eos_token_id"]], "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, cfg.text.vocab_size - N_SPECIAL)
    check_tokenizer_matches(cfg, Tokenizer.from_dir(out))
    if cfg.vision is not None:
        PreprocessConfig().to_json(out / "preprocessor_config.json")
    return out


def _recipe(name: str, p: torch.Tensor, seed: int, a_log_pad: int, cond: Conditioning | None) -> TensorToWrite:
    """How to make checkpoint tensor `name` (p: its meta tensor): drawn, cast, A_log padded (§13)."""
    dtype = stored_dtype(name, p.dtype, torch.bfloat16)
    pad = a_log_pad if name.endswith("A_log") else None

    def make() -> torch.Tensor:
        g = torch.Generator().manual_seed(tensor_seed(seed, name))
        return pad_a_log(random_tensor(name, tuple(p.shape), dtype, g, cond=cond), pad)

    return TensorToWrite(name, (pad,) if pad else tuple(p.shape), dtype, make)


# Bump when the tiny preset or the files make_checkpoint writes change, so a cached copy is rebuilt.
# v4: each tensor drawn from its own generator (was one fp64 stream over all), moe_intermediate_size 64.
DEFAULT_CHECKPOINT_VERSION = 4


def default_checkpoint_dir() -> Path:
    """Where the built-in tiny checkpoint lives: $K3_DEFAULT_CHECKPOINT, else ~/.cache/k3backend/tiny-seed0-v<N>."""
    env = os.environ.get("K3_DEFAULT_CHECKPOINT")
    name = f"tiny-seed0-v{DEFAULT_CHECKPOINT_VERSION}"
    return Path(env) if env else Path.home() / ".cache" / "k3backend" / name


def ensure_default_checkpoint() -> Path:
    """The built-in checkpoint directory, created on first use (atomically, so concurrent loaders agree)."""
    path = default_checkpoint_dir()
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    make_checkpoint("tiny", tmp, seed=0)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
