"""config.json parsing: both model types, defaults, and errors that name the field."""

import json

import pytest

from k3backend.config import ConfigError, K3Config
from k3backend.presets import preset_config


def test_tiny_preset_has_every_k3_feature():
    cfg = K3Config.from_dict(preset_config("tiny"))
    t = cfg.text
    assert cfg.model_type == "kimi_k3" and cfg.vision is not None
    assert not t.is_moe_layer(0) and all(t.is_moe_layer(i) for i in range(1, t.num_hidden_layers))
    n = t.num_hidden_layers
    assert t.mla_layer_ids == [i for i in range(n) if (i + 1) % 4 == 0 or i == n - 1]  # K3's pattern
    assert -(-n // t.attn_res_block_size) >= 2  # at least two Attention-Residual blocks
    assert t.routed_expert_hidden_size and t.latent_moe_use_norm and t.num_shared_experts > 0
    assert t.num_expert_group > 1 and t.hidden_act == "situ"
    lac = t.linear_attn_config
    assert lac.use_full_rank_gate and lac.gate_lower_bound == -5.0
    assert cfg.vision.vt_num_hidden_layers >= 2 and cfg.vision.text_hidden_size == t.hidden_size


def test_sglang_defaults_apply_to_omitted_fields():
    raw = preset_config("tiny")
    for key in ("routed_scaling_factor", "num_expert_group", "topk_group", "latent_moe_use_norm",
                "first_k_dense_replace"):
        raw["text_config"].pop(key)
    t = K3Config.from_dict(raw).text
    assert (t.routed_scaling_factor, t.num_expert_group, t.topk_group) == (1.0, 1, 1)
    assert t.latent_moe_use_norm is False and t.first_k_dense_replace == 0


def test_situ_beta_defaults_differ_for_routed_experts():
    raw = preset_config("tiny")
    raw["text_config"]["activation_situ_beta"] = None
    t = K3Config.from_dict(raw).text
    assert t.situ_betas(routed=True)[0] == 4.0 and t.situ_betas(routed=False)[0] == 1.0


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t.update(num_experts_per_token=9), "text_config.num_experts_per_token"),
    (lambda t: t.update(hidden_act="gelu"), "text_config.hidden_act"),
    (lambda t: t.update(moe_router_activation_func="softmax"), "text_config.moe_router_activation_func"),
    (lambda t: t.update(hiden_size=3), "text_config.hiden_size: unknown field"),
    (lambda t: t.update(hidden_size="64"), "text_config.hidden_size: expected an integer"),
    (lambda t: t.update(num_expert_group=3), "text_config.num_expert_group"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 4]), "in both kda_layers and full_attn_layers"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[0, 1]), "linear_attn_config.kda_layers"),
    (lambda t: t.pop("kv_lora_rank"), "text_config.kv_lora_rank"),
    (lambda t: t.update(n_routed_experts=4), "contradicts text_config.num_experts"),
], ids=["topk>experts", "act", "router", "typo", "type", "groups", "overlap", "range", "mla-missing", "alias"])
def test_bad_text_config_names_the_field(mutate, field):
    raw = preset_config("tiny")
    mutate(raw["text_config"])
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        K3Config.from_dict(raw)


def test_bad_vision_config_and_model_type_name_the_field():
    raw = preset_config("tiny")
    raw["vision_config"]["merge_type"] = "sd4"
    with pytest.raises(ConfigError, match="vision_config.merge_type"):
        K3Config.from_dict(raw)
    raw = preset_config("tiny")
    raw["vision_config"]["text_hidden_size"] = 65
    with pytest.raises(ConfigError, match="vision_config.text_hidden_size"):
        K3Config.from_dict(raw)
    with pytest.raises(ConfigError, match="model_type"):
        K3Config.from_dict({"model_type": "llama"})


def test_kimi_linear_top_level_config(tmp_path):
    raw = dict(preset_config("tiny")["text_config"], eos_token_id=[258, 259])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = K3Config.from_json(tmp_path)
    assert cfg.model_type == "kimi_linear" and cfg.vision is None and cfg.eos_token_id == (258, 259)


def test_unreadable_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        K3Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_json(tmp_path)
