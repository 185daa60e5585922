"""Checkpoint loading: layouts, name spellings, MXFP4 experts, named errors, the built-in checkpoint."""

import dataclasses
import json
import math
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from k3backend import load_model
from k3backend.generate import full_forward
from k3backend.checkpoint import CheckpointError, iter_tensors, load_config
from k3backend.checkpoint_write import save_checkpoint
from k3backend.kernels.moe_ref import dequant_mxfp4
from k3backend.config import ConfigError, K3Config
from k3backend.model.k3 import K3Model
from k3backend.presets import make_checkpoint, preset_config
from k3backend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return load_model(tiny, progress=False)


def single_file_copy(src, dst, rename=lambda n: n, transform=lambda n, t: {n: t}):
    """Rewrite a checkpoint as one safetensors file, renaming / transforming tensors."""
    dst.mkdir()
    for f in ("config.json", "tiktoken.model", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(src / f, dst / f)
    tensors = {}
    for name, t in iter_tensors(src):
        tensors.update(transform(rename(name), t))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_make_checkpoint_is_deterministic(tmp_path, tiny):
    again = make_checkpoint("tiny", tmp_path / "again", seed=0)
    other = make_checkpoint("tiny", tmp_path / "other", seed=1)
    a, b, c = (dict(iter_tensors(p)) for p in (tiny, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if a[k].numel() > 4)


def test_checkpoint_values_do_not_depend_on_sharding_or_threads(tmp_path, tiny):
    """Each tensor is drawn from its own generator (seed and name), so one file made by one thread
    holds the same bytes as two shards made by several."""
    one = make_checkpoint("tiny", tmp_path / "one", seed=0, num_shards=1, threads=1)
    assert (one / "model.safetensors").exists() and not (one / "model.safetensors.index.json").exists()
    a, b = dict(iter_tensors(tiny)), dict(iter_tensors(one))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert {t.dtype for t in a.values()} == {torch.bfloat16, torch.float32}  # bf16, fp32 for the FP32_PARAMS


def test_tiny_checkpoint_is_sharded_in_k3_layout(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    names = set(index)
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in names
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names and "mm_projector.post_norm.weight" in names
    a_log = load_file(str(tiny / index["language_model.model.layers.0.self_attn.A_log"]))[
        "language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (16,) and a_log.dtype == torch.float32 and torch.all(a_log[4:] == 0)  # K3 padding


def test_activations_stay_sane(tiny_model):
    ids = torch.randint(0, tiny_model.cfg.media_placeholder_token_id, (48,))  # text ids: no image pads
    hidden = []
    hooks = [layer.register_forward_hook(lambda m, a, out: hidden.append(out))
             for layer in tiny_model.language_model.model.layers]
    logits = full_forward(tiny_model, ids)
    for h in hooks:
        h.remove()
    for i, h in enumerate(hidden):
        assert torch.isfinite(h).all() and 0.1 < h.std() < 100, f"layer {i}: std {h.std()}"
    assert torch.isfinite(logits).all() and logits.std(-1).min() > 0.1
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_both_name_spellings_load_the_same_model(tmp_path, tiny, tiny_model):
    def short(n):  # language_model.layers.* and mlp.* spellings (K3_LM.md §8.2, §13)
        return n.replace("language_model.model.layers.", "language_model.layers.").replace(".block_sparse_moe.", ".mlp.")

    other = load_model(single_file_copy(tiny, tmp_path / "short", rename=short), progress=False)
    ids = torch.randint(0, 277, (20,), generator=torch.Generator().manual_seed(1))  # below <|media_pad|>
    assert torch.equal(full_forward(other, ids), full_forward(tiny_model, ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=["bf16", "fp16", "fp32", "fp64"])
def test_mxfp4_dequantisation_is_exact_for_every_code_and_exponent(dtype):
    """All 16 E2M1 codes under all 256 E8M0 exponents, extremes included (2^-127: subnormal products;
    2^127: 6·2^127 overflows to inf in 16/32-bit types; 255: NaN), against §7.7 in Python floats,
    rounded once: bit for bit (the sign of -0 too)."""
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row s: every byte, so every code pair
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)  # row s: exponent s in all 16 groups
    ref = [[math.nan if s == 255 else (-1.0) ** (c >> 3) * math.ldexp(lut[c & 7], s - 127)
            for b in range(256) for c in (b & 0xF, b >> 4)] for s in range(256)]  # low nibble = even index
    want = torch.tensor(ref, dtype=torch.float64).to(dtype)
    got = dequant_mxfp4(packed, scale, dtype)
    assert got.dtype == dtype and got.shape == (256, 512)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan].signbit(), want[~nan].signbit())
    # spot values: byte 0x01 = codes (1, 0) at columns 2, 3; byte 0x0F low nibble 15 = -6; byte 0xF0 high nibble
    assert (got[127, 2], got[127, 3], got[128, 30], got[127, 481]) == (0.5, 0, -12, -6)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest MXFP4 codes for w [out, in] with a per-32 scale (test helper; exactness is not needed)."""
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    groups = w.float().view(w.shape[0], -1, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp)[..., None]
    mag = (scaled.abs()[..., None] - lut).abs().argmin(-1)
    codes = (mag | ((scaled < 0).long() << 3)).view(w.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def test_mxfp4_experts_load_like_their_dequantised_values(tmp_path, tiny):
    def to_mxfp4(name, t):
        if ".experts." not in name:
            return {name: t}
        packed, scale = quantize_mxfp4(t)
        base = name.removesuffix(".weight")
        return {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale}

    def dequantised(name, t):
        return {name: dequant_mxfp4(*quantize_mxfp4(t)).to(torch.bfloat16) if ".experts." in name else t}

    mx = load_model(single_file_copy(tiny, tmp_path / "mx", transform=to_mxfp4), progress=False)
    bf = load_model(single_file_copy(tiny, tmp_path / "bf", transform=dequantised), progress=False)
    ids = torch.randint(0, 277, (16,), generator=torch.Generator().manual_seed(2))  # below <|media_pad|>
    assert torch.equal(full_forward(mx, ids), full_forward(bf, ids))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("language_model.lm_head.weight"), "missing tensors.*language_model.lm_head.weight"),
    (lambda d: d.pop("language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight"),
     r"missing tensors.*layers.2.mlp.experts.w13 \(experts \[5\]\)"),
    (lambda d: d.update({"language_model.model.layers.0.self_attn.bogus": torch.zeros(2)}),
     "unexpected tensors.*layers.0.self_attn.bogus"),
    (lambda d: d.update({"language_model.model.norm.weight": torch.zeros(63)}),
     r"mis-shaped tensors.*model.norm.weight: expected \[64\], got \[63\]"),
    (lambda d: d.update({"language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed":
                         torch.zeros(16, 16, dtype=torch.uint8)}),
     "unexpected tensors.*experts.0.w1.weight_packed"),
], ids=["missing", "missing-expert", "unexpected", "mis-shaped", "half-mxfp4"])
def test_checkpoint_mismatch_names_the_tensors(tmp_path, tiny, edit, message):
    dst = single_file_copy(tiny, tmp_path / "bad")
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_model(dst, progress=False)


def test_missing_shard_and_missing_config_are_errors(tmp_path, tiny):
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard files listed in the index are missing"):
        load_model(broken, progress=False)
    (broken / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json not found"):
        load_model(broken, progress=False)


def test_a_16_bit_kda_state_in_the_config_is_named_in_a_warning_and_the_state_stays_float32(tmp_path, tiny, caplog):
    """mamba_ssm_dtype (K3_LM.md §5.6) is parsed but the state pool is float32: a load says so rather than serving
    other numerics than the checkpoint's config asks for in silence."""
    import json
    import logging

    from k3backend.model.cache import layer_cache

    dst = tmp_path / "bf16_state"
    shutil.copytree(tiny, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["text_config"]["mamba_ssm_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="k3backend"):
        model = load_model(dst, progress=False)
    assert any("mamba_ssm_dtype bfloat16" in r.getMessage() and "kept in float32" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    kda = next(layer.self_attn for layer in model.language_model.model.layers if layer.self_attn.is_kda)
    assert layer_cache(kda, 2, 1, 16, torch.bfloat16, torch.device("cpu")).state.dtype == torch.float32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3backend"):
        load_model(tiny, progress=False)
    assert not any("mamba_ssm_dtype" in r.getMessage() for r in caplog.records)


def write_text_checkpoint(out, raw: dict, kda_v: int | None) -> None:
    """A kimi_linear checkpoint of `raw` whose KDA layers use value head size `kda_v` (None: K3's rule)."""
    cfg = K3Config.from_dict(raw)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, kda_v_head_dim_in_checkpoint=kda_v))
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    save_checkpoint(K3Model(cfg), out, "kimi_linear")


@pytest.mark.parametrize("kda_v, expected", [(None, 24), (16, 16)], ids=["k3-v_head_dim", "kimi-linear-head_dim"])
def test_kda_value_head_size_follows_the_v_proj_shape(tmp_path, kda_v, expected):
    """K3_LM.md §13: with v_head_dim 24 and linear_attn_config.head_dim 16 both conventions load."""
    raw = {**preset_config("tiny")["text_config"], "v_head_dim": 24}
    write_text_checkpoint(tmp_path / "ckpt", raw, kda_v)
    assert load_config(tmp_path / "ckpt").text.kda_v_head_dim == expected
    model = load_model(tmp_path / "ckpt", progress=False)
    assert model.language_model.model.layers[0].self_attn.V == expected
    assert torch.isfinite(full_forward(model, torch.arange(5))).all()


def test_kda_v_proj_of_neither_size_is_a_named_mis_shape(tmp_path):
    raw = {**preset_config("tiny")["text_config"], "v_head_dim": 24}
    write_text_checkpoint(tmp_path / "ckpt", raw, 20)  # neither 24 nor 16
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.v_proj.weight: expected \[96, 64\], got \[80, 64\]"):
        load_model(tmp_path / "ckpt", progress=False)


def test_kda_value_head_size_is_not_a_config_json_key():
    raw = {**preset_config("tiny")["text_config"], "kda_v_head_dim_in_checkpoint": 16}
    with pytest.raises(ConfigError, match="kda_v_head_dim_in_checkpoint: unknown field"):
        K3Config.from_dict(raw)


def test_image_prompt_runs_through_the_model(tiny, tiny_model):
    tok = Tokenizer.from_dir(tiny)
    image = Image.new("RGB", (640, 480), (200, 30, 90))
    ids = tok.render_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                          thinking=False).ids
    ids, spans = tok.expand_image_placeholders(ids, [(640, 480)], [414])
    assert spans[0][1] - spans[0][0] == 414
    with_image = full_forward(tiny_model, ids, tiny_model.encode_images([image]))
    other = full_forward(tiny_model, ids, tiny_model.encode_images([Image.new("RGB", (640, 480), (0, 200, 0))]))
    assert with_image.shape == (len(ids), 512) and torch.isfinite(with_image).all()
    assert not torch.equal(with_image[-1], other[-1])  # the image reaches the logits
    with pytest.raises(ValueError, match="image pad positions"):
        full_forward(tiny_model, ids)


# ---------------------------------------------------------------- MXFP4 checkpoints (K3_LM.md §7.7)
@pytest.fixture(scope="module")
def tiny_mx(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_mx"), seed=0, experts="mxfp4")


def dequantised_copy(src, dst):
    """The MXFP4 checkpoint with its experts as exact bf16 `.weight` tensors and no quantization_config."""
    def to_bf16(name, t, tensors):
        if name.endswith("weight_scale"):
            return {}
        if name.endswith("weight_packed"):
            scale = tensors[name.replace("weight_packed", "weight_scale")]
            return {name.replace("weight_packed", "weight"): dequant_mxfp4(t, scale, torch.bfloat16)}
        return {name: t}

    tensors = dict(iter_tensors(src))
    single_file_copy(src, dst, transform=lambda n, t: to_bf16(n, t, tensors))
    raw = json.loads((src / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_mxfp4_checkpoint_is_the_release_format_and_stays_packed(tiny_mx):
    raw = json.loads((tiny_mx / "config.json").read_text())
    assert raw["quantization_config"]["format"] == "mxfp4-pack-quantized"
    tensors = dict(iter_tensors(tiny_mx))
    packed = tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"]
    scale = tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"]
    assert packed.dtype == scale.dtype == torch.uint8 and packed.shape == (32, 32) and scale.shape == (32, 2)
    assert not any(n.endswith("experts.0.w1.weight") for n in tensors)
    assert tensors["language_model.model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    model = load_model(tiny_mx, dtype=torch.bfloat16, progress=False)
    experts = model.language_model.model.layers[1].mlp.experts
    assert experts.quant == "mxfp4" and experts.w13.dtype == experts.w13_scale.dtype == torch.uint8
    assert experts.w13.shape == (8, 128, 16) and experts.w2.shape == (8, 32, 32) and experts.w2_scale.shape == (8, 32, 2)
    torch.testing.assert_close(experts.w2[0], packed, rtol=0, atol=0)  # the bytes as they are on disk
    bf16 = load_model(dequantised_copy(tiny_mx, tiny_mx.parent / "bf16"), dtype=torch.bfloat16, progress=False)
    ratio = (sum(p.nbytes for n, p in model.named_parameters() if ".experts.w" in n)
             / sum(p.nbytes for n, p in bf16.named_parameters() if ".experts.w" in n))
    assert ratio == 4.25 / 16  # codes and exponents: the memory the cache budget gets back


def test_mxfp4_model_forward_equals_the_dequantised_bf16_model(tmp_path, tiny_mx):
    mx = load_model(tiny_mx, progress=False)
    bf = load_model(dequantised_copy(tiny_mx, tmp_path / "bf16"), progress=False)
    ids = torch.randint(0, 277, (24,), generator=torch.Generator().manual_seed(3))  # below <|media_pad|>
    logits = full_forward(mx, ids)
    assert torch.isfinite(logits).all() and logits.std(-1).min() > 0.1
    assert torch.equal(logits, full_forward(bf, ids))


@pytest.mark.parametrize("tp, ep, placement", [(2, 1, "tp"), (2, 2, "tp"), (4, 2, "host_ep")],
                         ids=["tp2", "ep2", "host_ep-2x2"])
def test_mxfp4_experts_shard_on_group_boundaries_and_whole_experts(tiny_mx, tp, ep, placement):
    """moe-TP: w1/w3 rows and w2 columns (32-value groups: 16 bytes, 1 exponent); EP: whole experts.
    host_ep over 2 hosts x 2 ranks: host n's experts, moe-TP by the rank within the host."""
    from k3backend.checkpoint import load_model
    from k3backend.engine.workers import placement_layout
    from k3backend.model.parallel import Parallel

    full = load_model(tiny_mx, progress=False, vision=False).language_model.model.layers[1].mlp.experts
    for rank in range(tp):
        par = Parallel(**placement_layout(placement, tp, rank, ep, 2))
        if placement == "host_ep":
            assert (par.tp_size, par.ep_rank, par.moe_tp_rank) == (2, rank // 2, rank % 2)
        part = load_model(tiny_mx, progress=False, vision=False, par=par).language_model.model.layers[1].mlp.experts
        e = slice(part.e0, part.e0 + part.w13.shape[0])
        i, n = par.moe_tp_rank, part.intermediate
        rows = torch.cat([torch.arange(i * n, (i + 1) * n), 64 + torch.arange(i * n, (i + 1) * n)])  # [w1_r ; w3_r]
        assert torch.equal(part.w13, full.w13[e][:, rows]) and torch.equal(part.w13_scale, full.w13_scale[e][:, rows])
        assert torch.equal(part.w2, full.w2[e][:, :, i * n // 2:(i + 1) * n // 2])
        assert torch.equal(part.w2_scale, full.w2_scale[e][:, :, i * n // 32:(i + 1) * n // 32])


def test_mxfp4_checkpoint_errors_name_the_problem(tmp_path, tiny_mx):
    w2 = "language_model.model.layers.1.block_sparse_moe.experts.0.w2"
    cases = {
        "nan-exponent": (lambda d: d[f"{w2}.weight_scale"].fill_(255), r"E8M0 scale byte 255 \(NaN\) in 64 groups"),
        "int32-packed": (lambda d: d.update({f"{w2}.weight_packed": d[f"{w2}.weight_packed"].int()}),
                         r"w2.weight_packed: expected uint8 \[32, 32\], got int32 \[32, 32\]"),
        "bf16-expert": (lambda d: d.update({f"{w2}.weight": torch.zeros(32, 64)}), r"unexpected tensors.*w2.weight\b"),
        "missing-scale": (lambda d: d.pop(f"{w2}.weight_scale"), r"missing tensors.*layers.1.mlp.experts.w2_scale"),
    }
    for what, (edit, message) in cases.items():
        dst = single_file_copy(tiny_mx, tmp_path / what)
        shutil.copy(tiny_mx / "config.json", dst / "config.json")
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_model(dst, progress=False)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(format="pack-quantized"), r"format: \['pack-quantized'\] is not supported"),
    (lambda q: q.update(quant_method="fp8"), r"quant_method: 'fp8' is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16), r"weights.group_size: 16"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
     r"input_activations: quantized activations are not supported"),
    (lambda q: q.update(quantization_status="frozen"), r"quantization_status: 'frozen'"),
], ids=["int4-pack", "fp8", "group-16", "w4a8", "not-compressed"])
def test_unsupported_quantization_is_refused_naming_the_format(edit, message):
    from k3backend.config import mxfp4_quantization_config

    raw = preset_config("tiny")
    raw["quantization_config"] = mxfp4_quantization_config()
    assert K3Config.from_dict(raw).text.routed_expert_quant == "mxfp4"
    edit(raw["quantization_config"])
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(raw)
