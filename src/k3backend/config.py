"""Typed, validated model configuration (K3_LM.md §1, K3_VISION.md §1).

`K3Config.from_json(path)` parses a checkpoint's `config.json`, either `model_type: kimi_k3`
(top level with `text_config` and `vision_config`) or `model_type: kimi_linear` (text only, as
Moonshot ships it or as transformers' `save_pretrained` writes it). Defaults are SGLang's
(K3_LM.md §13). Every problem is a `ConfigError` naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json value is missing, unknown or contradictory; the message names the field."""


# Keys written by transformers / Moonshot that carry no meaning for the K3 math (K3_LM.md §1.1).
_IGNORED_TEXT_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "initializer_range", "use_cache", "pretraining_tp", "attention_bias", "attention_dropout",
    "output_router_logits", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "model_max_length", "head_dim", "qk_head_dim", "num_key_value_heads", "mla_use_nope",
    "topk_method", "use_grouped_topk", "num_nextn_predict_layers", "quantization_config",
    "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "layer_types", "mlp_layer_types",
    "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "problem_type", "tokenizer_class", "bos_token_id",
    "eos_token_id", "pad_token_id", "media_placeholder_token_id", "_name_or_path", "moe_layer_freq_type",
    "aux_loss_alpha", "seq_aux", "scoring_func", "ep_size", "router_aux_loss_coef", "z_loss_coef",
}
# TextConfig fields that config.json cannot set directly.
_NOT_JSON_TEXT_FIELDS = ("kda_v_head_dim_in_checkpoint", "routed_expert_quant")
MXFP4 = "mxfp4"
MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name (K3_LM.md §7.7)
MXFP4_GROUP = 32
# transformers' attribute_map aliases -> our canonical names.
_TEXT_ALIASES = {
    "n_routed_experts": "num_experts",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
}


@dataclass(frozen=True)
class LinearAttnConfig:
    """`text_config.linear_attn_config`: the KDA layer parameters (K3_LM.md §1.1)."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    kda_layers: tuple[int, ...] = ()  # 1-based
    full_attn_layers: tuple[int, ...] = ()  # 1-based
    use_full_rank_gate: bool = False
    gate_lower_bound: float | None = None


@dataclass(frozen=True)
class TextConfig:
    """The language-model config (`text_config`, model_type kimi_linear), SGLang defaults."""

    vocab_size: int = 163840
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 11008
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    rms_norm_eps: float = 1e-6
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_use_output_gate: bool = False
    tie_word_embeddings: bool = False
    num_experts: int | None = None
    num_experts_per_token: int | None = None
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    attn_res_block_size: int | None = None
    linear_attn_config: LinearAttnConfig | None = None
    mamba_ssm_dtype: str = "float32"
    logit_scale: float = 1.0
    # The KDA value head size the checkpoint's v_proj shape shows (§13), set by
    # `checkpoint.load_config`; config.json cannot say it. None: the K3 rule of `kda_v_head_dim`.
    kda_v_head_dim_in_checkpoint: int | None = None
    # How the routed experts are stored: None (the model dtype) or "mxfp4" (packed E2M1 codes and
    # E8M0 group scales, §7.7), from config.json's quantization_config (`parse_quantization`) or,
    # without one, from the checkpoint's tensor names (`checkpoint.load_config`).
    routed_expert_quant: str | None = None

    # ---- derived (K3_LM.md §1.2) ----
    def is_kda_layer(self, i: int) -> bool:
        lac = self.linear_attn_config
        return lac is not None and (i + 1) in lac.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def kda_v_head_dim(self) -> int:
        """KDA value head size V (§13): SGLang's K3 code takes v_head_dim, the older Kimi-Linear code
        and transformers take linear_attn_config.head_dim. Where the two differ, only the v_proj
        tensor tells which one a checkpoint used; without a checkpoint (new models) K3's rule holds."""
        if self.kda_v_head_dim_in_checkpoint is not None:
            return self.kda_v_head_dim_in_checkpoint
        return self.kda_v_head_dim_choices[0]

    @property
    def kda_v_head_dim_choices(self) -> tuple[int, ...]:
        """The value head sizes a checkpoint of this config may use in its KDA layers, K3's first."""
        head_dim = self.linear_attn_config.head_dim
        return tuple(dict.fromkeys(d for d in (self.v_head_dim, head_dim) if d is not None))

    def situ_betas(self, routed: bool) -> tuple[float, float | None]:
        """(β, λ) for SiTU; β defaults to 4.0 for routed experts and 1.0 elsewhere (§1.1, §11.14)."""
        beta = self.activation_situ_beta
        if beta is None:
            beta = 4.0 if routed else 1.0
        return beta, self.activation_situ_linear_beta


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of a kimi_k3 checkpoint (K3_VISION.md §1.1)."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    vt_intermediate_size: int = 4096
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    norm_type: str = "rmsnorm"
    mm_hidden_size: int = 1024
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads


_IGNORED_VISION_KEYS = {
    "attn_bias", "linear_bias", "patch_embed_proj_bias", "mlp_type", "activation_func", "mm_projector_type",
    "projector_hidden_act", "video_attn_type", "_attn_implementation", "model_type", "hidden_size",
    "transformers_version", "dtype", "torch_dtype", "architectures",
}
# Values whose alternative the vision code does not implement: (field, required value).
_VISION_FIXED = {
    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
}


@dataclass(frozen=True)
class K3Config:
    """Whole-checkpoint config: text model, optional vision tower, special token ids."""

    text: TextConfig
    vision: VisionConfig | None = None
    model_type: str = "kimi_k3"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    media_placeholder_token_id: int = 163605
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, path: str | Path) -> "K3Config":
        return cls.from_dict(read_json_object(path, "config.json"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "K3Config":
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            if "text_config" not in raw:
                raise ConfigError("text_config: required for model_type kimi_k3")
            text = _parse_text(raw["text_config"], "text_config.")
            vision = _parse_vision(raw["vision_config"]) if raw.get("vision_config") is not None else None
            if vision is not None and vision.text_hidden_size != text.hidden_size:
                raise ConfigError(f"vision_config.text_hidden_size: {vision.text_hidden_size} != "
                                  f"text_config.hidden_size {text.hidden_size}")
            tokens_src = {**raw.get("text_config", {}), **raw}
        elif model_type == "kimi_linear":
            text, vision, tokens_src = _parse_text(raw, ""), None, raw
        else:
            raise ConfigError(f"model_type: expected 'kimi_k3' or 'kimi_linear', got {model_type!r}")
        quant = raw.get("quantization_config", raw.get("text_config", {}).get("quantization_config")
                        if model_type == "kimi_k3" else None)
        if quant is not None:
            text = with_expert_quant(text, parse_quantization(quant), "quantization_config")
        eos = tokens_src.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        for name, v in (("bos_token_id", tokens_src.get("bos_token_id")), ("eos_token_id", eos_ids),
                        ("media_placeholder_token_id", tokens_src.get("media_placeholder_token_id"))):
            for x in (v if isinstance(v, tuple) else (v,)):
                if x is not None and not 0 <= int(x) < text.vocab_size:
                    raise ConfigError(f"{name}: {x} outside the vocabulary [0, {text.vocab_size})")
        return cls(text=text, vision=vision, model_type=model_type,
                   bos_token_id=tokens_src.get("bos_token_id"), eos_token_id=eos_ids,
                   pad_token_id=tokens_src.get("pad_token_id"),
                   media_placeholder_token_id=int(tokens_src.get("media_placeholder_token_id", 163605)), raw=raw)


def parse_quantization(q: Any, where: str = "quantization_config") -> str:
    """The routed experts' storage a compressed-tensors `quantization_config` describes: "mxfp4".

    Only what the K3 release ships loads (§7.7): `mxfp4-pack-quantized`, 4-bit float weights in
    groups of 32, activations unquantized (w4a16), packed on disk. Anything else is a ConfigError
    naming the method or format, rather than weights read as something they are not.
    """
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {q!r}")
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"{where}.quant_method: {method!r} is not supported; only compressed-tensors "
                          f"{MXFP4_FORMAT} routed experts load")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ConfigError(f"{where}.config_groups: expected a JSON object")
    formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {MXFP4_FORMAT}:
        bad = sorted(str(f) for f in formats - {MXFP4_FORMAT})
        raise ConfigError(f"{where}.format: {bad or 'none given'} is not supported; only {MXFP4_FORMAT} "
                          f"(MXFP4 routed experts) loads")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        for key, want in (("num_bits", 4), ("group_size", MXFP4_GROUP), ("type", "float")):
            if isinstance(weights, dict) and weights.get(key, want) != want:
                raise ConfigError(f"{where}.config_groups.{name}.weights.{key}: {weights[key]!r}; "
                                  f"{MXFP4_FORMAT} has {want!r}")
        if isinstance(group, dict) and group.get("input_activations"):
            raise ConfigError(f"{where}.config_groups.{name}.input_activations: quantized activations are not "
                              f"supported (MXFP4 weights with bf16 activations only)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(f"{where}.quantization_status: {status!r}; only 'compressed' (packed) checkpoints load")
    return MXFP4


def mxfp4_quantization_config() -> dict[str, Any]:
    """The `quantization_config` of a checkpoint whose routed experts, and nothing else, are MXFP4
    (compressed-tensors, what make-checkpoint --experts mxfp4 writes; the K3 release's scheme)."""
    weights = {"num_bits": 4, "type": "float", "group_size": MXFP4_GROUP, "strategy": "group", "symmetric": True,
               "dynamic": False}
    group = {"format": MXFP4_FORMAT, "targets": [r"re:.*\.experts\.\d+\.w[123]$"], "weights": weights,
             "input_activations": None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": [], "kv_cache_scheme": None}


def with_expert_quant(text: TextConfig, quant: str | None, where: str) -> TextConfig:
    """text with routed experts stored as `quant`, checking that its groups tile every expert matrix."""
    if quant is None or text.num_experts is None:
        return text
    widths = {"moe_intermediate_size": text.moe_intermediate_size,
              "routed_expert_hidden_size" if text.routed_expert_hidden_size else "hidden_size":
                  text.routed_expert_hidden_size or text.hidden_size}
    bad = {k: v for k, v in widths.items() if v % MXFP4_GROUP}
    if bad:
        raise ConfigError(f"{where}: MXFP4 groups of {MXFP4_GROUP} must tile the expert matrices, but {bad}")
    return replace(text, routed_expert_quant=quant)


def read_json_object(path: str | Path, filename: str) -> dict[str, Any]:
    """A JSON object from `path` (or `path/filename` for a checkpoint directory), or a ConfigError."""
    path = Path(path)
    if path.is_dir():
        path = path / filename
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: {filename} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def _check_type(name: str, value: Any, annotation: str) -> Any:
    """Coerce a JSON value to the dataclass field type, or raise naming the field."""
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"{name}: must not be null")
    base = annotation.replace(" | None", "")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        return float(value)
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    return value


def _parse_text(d: dict[str, Any], prefix: str) -> TextConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a JSON object")
    d = dict(d)
    for alias, canon in _TEXT_ALIASES.items():
        if alias in d:
            if canon in d and d[canon] != d[alias]:
                raise ConfigError(f"{prefix}{alias}: {d[alias]!r} contradicts {prefix}{canon} {d[canon]!r}")
            d[canon] = d.pop(alias)
    kwargs: dict[str, Any] = {}
    known = {f.name: f for f in fields(TextConfig) if f.name not in _NOT_JSON_TEXT_FIELDS}
    for key, value in d.items():
        if key in _IGNORED_TEXT_KEYS:
            continue
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown field")
        if key == "linear_attn_config":
            kwargs[key] = None if value is None else _parse_linear_attn(value, prefix + key + ".")
        elif key == "mamba_ssm_dtype":
            if value not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"{prefix}{key}: expected float32/bfloat16/float16, got {value!r}")
            kwargs[key] = value
        else:
            kwargs[key] = _check_type(prefix + key, value, str(known[key].type))
    # transformers writes mlp_layer_types instead of first_k_dense_replace (and drops it).
    mlp_types = d.get("mlp_layer_types")
    if "first_k_dense_replace" not in d and isinstance(mlp_types, list):
        dense = [t == "dense" for t in mlp_types]
        k = dense.index(False) if False in dense else len(dense)
        if any(dense[k:]):
            raise ConfigError(f"{prefix}mlp_layer_types: dense layers must come first, got {mlp_types}")
        kwargs["first_k_dense_replace"] = k
    lac = kwargs.get("linear_attn_config")
    # transformers may write layer_types without kda_layers (then a default-pattern schedule).
    if lac is not None and not lac.kda_layers and isinstance(d.get("layer_types"), list):
        kda = tuple(i + 1 for i, t in enumerate(d["layer_types"]) if t == "linear_attention")
        full = tuple(i + 1 for i, t in enumerate(d["layer_types"]) if t == "full_attention")
        kwargs["linear_attn_config"] = lac = LinearAttnConfig(**{**lac.__dict__, "kda_layers": kda, "full_attn_layers": full})
    cfg = TextConfig(**kwargs)
    _validate_text(cfg, prefix)
    return cfg


def _parse_linear_attn(d: Any, prefix: str) -> LinearAttnConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.')}: expected a JSON object")
    known = {f.name: f for f in fields(LinearAttnConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown field")
        if key in ("kda_layers", "full_attn_layers"):
            if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                raise ConfigError(f"{prefix}{key}: expected a list of 1-based layer numbers, got {value!r}")
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = _check_type(prefix + key, value, str(known[key].type))
    for req in ("num_heads", "head_dim"):
        if req not in kwargs:
            raise ConfigError(f"{prefix}{req}: required")
    return LinearAttnConfig(**kwargs)


def _validate_text(c: TextConfig, p: str) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(p + msg)

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        need(getattr(c, name) > 0, f"{name}: must be positive, got {getattr(c, name)}")
    need(c.rms_norm_eps > 0, f"rms_norm_eps: must be positive, got {c.rms_norm_eps}")
    need(c.hidden_act in ("silu", "situ"), f"hidden_act: expected 'silu' or 'situ', got {c.hidden_act!r}")
    need(c.moe_router_activation_func == "sigmoid",
         f"moe_router_activation_func: only 'sigmoid' is supported, got {c.moe_router_activation_func!r}")
    need(c.linear_attn_config is not None, "linear_attn_config: required (KDA layer schedule)")
    lac = c.linear_attn_config
    n = c.num_hidden_layers
    for name in ("kda_layers", "full_attn_layers"):
        bad = [x for x in getattr(lac, name) if not 1 <= x <= n]
        need(not bad, f"linear_attn_config.{name}: layers {bad} outside 1..{n}")
    both = set(lac.kda_layers) & set(lac.full_attn_layers)
    need(not both, f"linear_attn_config: layers {sorted(both)} are in both kda_layers and full_attn_layers")
    need(lac.num_heads > 0 and lac.head_dim > 0, "linear_attn_config.num_heads/head_dim: must be positive")
    need(lac.short_conv_kernel_size >= 1, "linear_attn_config.short_conv_kernel_size: must be >= 1")
    if c.mla_layer_ids:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(c, name) is not None and getattr(c, name) > 0,
                 f"{name}: required (positive) when the model has MLA layers")
    if c.num_experts is not None:
        need(c.num_experts > 0, f"num_experts: must be positive, got {c.num_experts}")
        k = c.num_experts_per_token
        need(k is not None and 1 <= k <= c.num_experts,
             f"num_experts_per_token: {k} must be in 1..num_experts {c.num_experts}")
        need(c.moe_intermediate_size is not None and c.moe_intermediate_size > 0,
             "moe_intermediate_size: required when num_experts is set")
        need(c.num_expert_group >= 1 and c.num_experts % c.num_expert_group == 0,
             f"num_expert_group: {c.num_expert_group} must divide num_experts {c.num_experts}")
        need(1 <= c.topk_group <= c.num_expert_group,
             f"topk_group: {c.topk_group} must be in 1..num_expert_group {c.num_expert_group}")
        if c.num_expert_group > 1:
            need(c.num_experts // c.num_expert_group >= 2,
                 f"num_expert_group: {c.num_expert_group} leaves fewer than 2 experts per group")
            need(k <= c.topk_group * (c.num_experts // c.num_expert_group),
                 f"num_experts_per_token: {k} > experts in topk_group {c.topk_group} groups")
        need(c.moe_layer_freq >= 1, f"moe_layer_freq: must be >= 1, got {c.moe_layer_freq}")
    need(c.first_k_dense_replace >= 0, f"first_k_dense_replace: must be >= 0, got {c.first_k_dense_replace}")
    if c.attn_res_block_size is not None:
        need(c.attn_res_block_size >= 1, f"attn_res_block_size: must be >= 1, got {c.attn_res_block_size}")
    if c.latent_moe_use_norm:
        need(c.routed_expert_hidden_size is not None,
             "latent_moe_use_norm: true needs routed_expert_hidden_size")
    if c.hidden_act == "situ" and c.activation_situ_beta is not None:
        need(c.activation_situ_beta > 0, f"activation_situ_beta: must be positive, got {c.activation_situ_beta}")
    if c.activation_situ_linear_beta is not None:
        need(c.activation_situ_linear_beta > 0,
             f"activation_situ_linear_beta: must be positive, got {c.activation_situ_linear_beta}")


def _parse_vision(d: Any) -> VisionConfig:
    p = "vision_config."
    if not isinstance(d, dict):
        raise ConfigError("vision_config: expected a JSON object")
    known = {f.name: f for f in fields(VisionConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key in _VISION_FIXED and value != _VISION_FIXED[key]:
            raise ConfigError(f"{p}{key}: only {_VISION_FIXED[key]!r} is supported, got {value!r}")
        if key in _IGNORED_VISION_KEYS:
            continue
        if key not in known:
            raise ConfigError(f"{p}{key}: unknown field")
        if key == "merge_kernel_size":
            if not (isinstance(value, list) and len(value) == 2):
                raise ConfigError(f"{p}{key}: expected [2, 2], got {value!r}")
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = _check_type(p + key, value, str(known[key].type))
    v = VisionConfig(**kwargs)
    checks = [
        (v.pos_emb_type == "divided_fixed", f"pos_emb_type: only 'divided_fixed' is supported, got {v.pos_emb_type!r}"),
        (v.merge_type == "sd2_tpool", f"merge_type: only 'sd2_tpool' is supported, got {v.merge_type!r}"),
        (v.norm_type == "rmsnorm", f"norm_type: only 'rmsnorm' is supported, got {v.norm_type!r}"),
        (v.merge_kernel_size == (2, 2), f"merge_kernel_size: only [2, 2] is supported, got {list(v.merge_kernel_size)}"),
        (v.qkv_hidden_size % v.vt_num_attention_heads == 0,
         f"qkv_hidden_size: {v.qkv_hidden_size} not divisible by vt_num_attention_heads {v.vt_num_attention_heads}"),
        (v.head_dim % 4 == 0, f"qkv_hidden_size: head_dim {v.head_dim} must be a multiple of 4 (2-D RoPE)"),
        (v.mm_hidden_size == v.vt_hidden_size,
         f"mm_hidden_size: {v.mm_hidden_size} != vt_hidden_size {v.vt_hidden_size}"),
        (v.pos_emb_interpolation_mode in ("bilinear", "bicubic"),
         f"pos_emb_interpolation_mode: expected 'bilinear' or 'bicubic', got {v.pos_emb_interpolation_mode!r}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(p + msg)
    return v
