"""Hugging Face-layout safetensors checkpoints: name mapping, loading, writing (K3_LM.md §8, K3_VISION.md §5).

Reads `kimi_k3` (`language_model.*`, `vision_tower.*`, `mm_projector.*`) and `kimi_linear`
(`model.*`, `lm_head.*`, as transformers' `save_pretrained` writes it), single-file or sharded
with `model.safetensors.index.json`. Routed experts may be bf16 (`w1/w2/w3.weight`) or MXFP4
(`weight_packed` + `weight_scale`, §7.7), which stay packed: each rank copies its slices of the
bytes as they are. Missing, unexpected or mis-shaped tensors are a `CheckpointError` naming them: a
model never runs with silently random weights. Writing is `checkpoint_write.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from k3backend.config import MXFP4, K3Config, with_expert_quant
from k3backend.kernels.moe_ref import E8M0_NAN
from k3backend.model.parallel import SINGLE, Parallel

if TYPE_CHECKING:
    from k3backend.model.preprocess import PreprocessConfig

log = logging.getLogger(__name__)

# Parameters SGLang keeps in fp32 whatever the model dtype (§8.1), in the checkpoint and at run time.
FP32_PARAMS = ("conv1d.weight", "A_log", "dt_bias", "e_score_correction_bias")
# ... and those only the runtime layout keeps in fp32: the router weight, used only in fp32 (§7.3).
RUNTIME_FP32_PARAMS = FP32_PARAMS + ("conv1d_weight", ".mlp.gate.weight")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_RES = re.compile(r"\.(self_attention_res|mlp_res|output_attn_res)_(norm|proj)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes; the message names the tensors."""


def param_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The runtime dtype of our floating-point parameter `name` (packed MXFP4 experts stay uint8)."""
    if name.endswith(RUNTIME_FP32_PARAMS):
        return torch.float64 if model_dtype == torch.float64 else torch.float32
    return model_dtype


def canonical_name(ckpt_name: str, model_type: str) -> str:
    """Checkpoint tensor name → our parameter name (before expert stacking).

    kimi_k3: `language_model.layers.` → `language_model.model.layers.` (§8.2), `vision_tower.*` and
    `mm_projector.*` → `vision.*`; kimi_linear: everything under `language_model.`. Both spellings
    `block_sparse_moe` / `mlp` load. AttnRes `*_res_norm/_proj.weight` → `*_res.norm/proj.weight`.
    """
    n = ckpt_name
    if model_type == "kimi_k3":
        if n.startswith(("vision_tower.", "mm_projector.")):
            return "vision." + n
        if n.startswith("language_model.layers."):
            n = "language_model.model." + n[len("language_model."):]
    elif not n.startswith("language_model."):
        n = "language_model." + n
    n = n.replace(".block_sparse_moe.", ".mlp.")
    return _RES.sub(lambda m: f".{m.group(1)}.{m.group(2)}.weight", n)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{path}: shard files listed in the index are missing: {missing}")
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def tensor_shape(path: Path, param: str, model_type: str) -> list[int] | None:
    """Shape of the checkpoint tensor that loads into `param`, from the safetensors headers only."""
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                if canonical_name(name, model_type) == param:
                    return list(sf.get_slice(name).get_shape())
    return None


def load_config(path: str | Path) -> K3Config:
    """config.json plus what only the tensors say: the KDA value head size, which the first KDA
    layer's v_proj shape decides when v_head_dim and linear_attn_config.head_dim differ (K3_LM.md §13),
    and, when config.json has no quantization_config, whether the routed experts are MXFP4 (§7.7).

    A v_proj that fits neither is left to the load, which names it as mis-shaped.
    """
    path = Path(path)
    cfg = K3Config.from_json(path)
    text = cfg.text
    if text.routed_expert_quant is None and _experts_packed(path, cfg):
        cfg = dataclasses.replace(cfg, text=with_expert_quant(text, MXFP4, f"{path}: packed experts"))
        text = cfg.text
    if len(text.kda_v_head_dim_choices) < 2 or not text.kda_layer_ids:
        return cfg
    param = f"language_model.model.layers.{text.kda_layer_ids[0]}.self_attn.v_proj.weight"
    shape = tensor_shape(path, param, cfg.model_type)
    heads = text.linear_attn_config.num_heads
    if shape is None or shape[0] % heads or shape[0] // heads not in text.kda_v_head_dim_choices:
        return cfg
    return dataclasses.replace(cfg, text=dataclasses.replace(text, kda_v_head_dim_in_checkpoint=shape[0] // heads))


def _experts_packed(path: Path, cfg: K3Config) -> bool:
    """Whether the first MoE layer's expert 0 is stored as MXFP4 (`w1.weight_packed`, no `w1.weight`)."""
    text = cfg.text
    layer = next((i for i in range(text.num_hidden_layers) if text.is_moe_layer(i)), None)
    if layer is None:
        return False
    base = f"language_model.model.layers.{layer}.mlp.experts.0.w1."
    names = set()
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            names.update(n for n in map(lambda k: canonical_name(k, cfg.model_type), sf.keys()) if n.startswith(base))
    return base + "weight_packed" in names and base + "weight" not in names


def count_tensors(path: Path) -> int:
    n = 0
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            n += len(list(sf.keys()))
    return n


def packed_params(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """Our unpacked names (as `canonical_name` gives them) -> (packed parameter, first row, end row).

    Modules whose runtime layout packs several checkpoint tensors into one parameter (q/k/v
    projections, gate/up) say so in `packing()`; the loader writes each tensor into its rows.
    """
    out = {}
    for prefix, module in model.named_modules():
        packing = getattr(module, "packing", None)
        if packing is not None:
            base = f"{prefix}." if prefix else ""
            out.update({base + k: (base + p, a, b) for k, (p, a, b) in packing().items()})
    return out


def shard_slices(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """Our (unpacked) names -> (dim, start, end) of the checkpoint tensor this rank loads; absent: all of it.

    Modules sharded by tensor parallelism say which slice in `shards()` (K3_LM.md §9.2).
    """
    out = {}
    for prefix, module in model.named_modules():
        shards = getattr(module, "shards", None)
        if shards is not None:
            base = f"{prefix}." if prefix else ""
            out.update({base + k: v for k, v in shards().items()})
    return out


def _read(sf, ckpt_name: str, shard: tuple[int, int, int] | None, mx: str | None = None) -> torch.Tensor:
    """The tensor, or this rank's slice of it, read from the file without the rest (`get_slice`).

    mx: "weight_packed" / "weight_scale" of an MXFP4 pair: a column slice of the unpacked matrix
    is a slice of 2 values per byte, or of 32 values per scale.
    """
    if shard is None:
        return sf.get_tensor(ckpt_name)
    dim, a, b = shard
    if dim == 1 and mx is not None:
        per = 2 if mx == "weight_packed" else 32
        if a % per or b % per:
            raise CheckpointError(f"{ckpt_name}: columns {a}..{b} do not fall on MXFP4 {per}-value boundaries")
        a, b = a // per, b // per
    sl = sf.get_slice(ckpt_name)
    return sl[a:b] if dim == 0 else sl[:, a:b]


def load_state_dict_into(model: torch.nn.Module, path: Path, model_type: str, *, progress: bool = True,
                         only_prefix: str | None = None) -> None:
    """Copy every checkpoint tensor this rank needs into `model`'s parameters (allocated, final dtypes).

    Tensors are read lazily: under tensor / expert parallelism only this rank's slices and experts
    (`shard_slices`, `Experts.local_expert`), and nothing of what `only_prefix` leaves out (the
    vision tower alone, or everything but it). Collects all problems and raises one
    `CheckpointError` listing them.
    """
    from k3backend.model.moe import Experts

    params = dict(model.named_parameters())
    packed, shards = packed_params(model), shard_slices(model)
    experts = {prefix: m for prefix, m in model.named_modules() if isinstance(m, Experts)}
    skip_vision = only_prefix is None and getattr(model, "vision", "absent") is None
    filled: dict[str, torch.Tensor] = {}  # param name -> bool mask of filled expert rows (or scalar True)
    unexpected, bad_shape = [], []
    total = count_tensors(path) if only_prefix is None else 0
    bar = tqdm(total=total, desc=f"loading {path.name}", unit="tensor", disable=not progress or total < 50)
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as sf:
            for ckpt_name in sf.keys():
                bar.update(1)
                name = canonical_name(ckpt_name, model_type)
                if only_prefix is not None:
                    if not name.startswith(only_prefix):
                        continue
                    name = name[len(only_prefix):]
                elif skip_vision and name.startswith("vision."):
                    continue  # a kimi_k3 checkpoint read by a text-only rank
                m = _EXPERT.match(name)
                if m:
                    base, e, w, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
                    module = experts.get(base)
                    local = None if module is None else module.local_expert(e)
                    if module is not None and local is None:
                        continue  # another expert group's expert
                    if module is None or (kind == "weight") != (module.quant is None):
                        unexpected.append(ckpt_name)  # no such layer, or bf16 experts where MXFP4 ones are expected
                        continue
                    t = _read(sf, ckpt_name, module.shard(w), None if kind == "weight" else kind)
                    _load_expert(params, filled, base, local, w, kind, t, ckpt_name, unexpected, bad_shape)
                    continue
                shard = shards.get(name)
                t = None
                if name.endswith(".self_attn.A_log") and name in params:  # padded on disk (§13): this rank's heads
                    a = 0 if shard is None else shard[1]
                    t = sf.get_tensor(ckpt_name).reshape(-1)[a:a + params[name].numel()]
                if name in packed:
                    pname, a, b = packed[name]
                    dst, key = params[pname][a:b], name
                elif name in params:
                    dst, key = params[name], name
                else:
                    unexpected.append(ckpt_name)
                    continue
                t = _read(sf, ckpt_name, shard) if t is None else t
                if tuple(t.shape) != tuple(dst.shape):
                    bad_shape.append(f"{ckpt_name}: expected {list(dst.shape)}, got {list(t.shape)}")
                    continue
                with torch.no_grad():
                    dst.copy_(t.to(dst.dtype))
                filled[key] = torch.tensor(True)
    bar.close()
    packed_into = {p for p, _, _ in packed.values()}
    missing = [name for name in packed if name not in filled]
    for name in params:
        f = filled.get(name)
        if name in packed_into:
            continue
        if f is None:
            missing.append(name)
        elif f.dim() and not bool(f.all()):
            missing.append(f"{name} (experts {(~f.view(f.shape[0], -1).all(-1)).nonzero().flatten().tolist()})")
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_short(unexpected)}")
    if bad_shape:
        problems.append(f"mis-shaped tensors ({len(bad_shape)}): {_short(bad_shape)}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json: " + "; ".join(problems))


def _load_expert(params: dict, filled: dict, base: str, e: int, w: str, kind: str, t: torch.Tensor,
                 ckpt_name: str, unexpected: list, bad_shape: list) -> None:
    """Stack experts.{e}.w1/w3 into w13[e] = [w1 ; w3] and experts.{e}.w2 into w2[e]; MXFP4 codes
    (`weight_packed`) go to the same parameters, their exponents (`weight_scale`) to w13_scale / w2_scale."""
    pname = f"{base}.{'w13' if w in ('w1', 'w3') else 'w2'}{'_scale' if kind == 'weight_scale' else ''}"
    if pname not in params:
        unexpected.append(ckpt_name)
        return
    p = params[pname]
    if e >= p.shape[0]:
        unexpected.append(ckpt_name)
        return
    half = p.shape[1] // 2
    dst = p[e, :half] if w == "w1" else p[e, half:] if w == "w3" else p[e]
    if tuple(t.shape) != tuple(dst.shape) or (kind != "weight" and t.dtype != torch.uint8):
        bad_shape.append(f"{ckpt_name}: expected {'uint8 ' if kind != 'weight' else ''}{list(dst.shape)}, "
                         f"got {str(t.dtype).removeprefix('torch.') + ' ' if kind != 'weight' else ''}{list(t.shape)}")
        return
    if kind == "weight_scale" and bool((t == E8M0_NAN).any()):
        bad_shape.append(f"{ckpt_name}: E8M0 scale byte {E8M0_NAN} (NaN) in {int((t == E8M0_NAN).sum())} groups")
        return
    with torch.no_grad():
        dst.copy_(t.to(p.dtype))
    mask = filled.setdefault(pname, torch.zeros(p.shape[0], 2, dtype=torch.bool))
    if w == "w2":
        mask[e] = True
    else:
        mask[e, 0 if w == "w1" else 1] = True


def _short(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def load_model(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               progress: bool = True, par: Parallel = SINGLE, vision: bool = True) -> torch.nn.Module:
    """Build the model a checkpoint's config.json describes and load its weights. dtype defaults to fp32.

    par: this rank's shards (only they are read); vision=False leaves out the tower (a worker rank).
    """
    path = Path(path)
    cfg = load_config(path)
    dtype = dtype or torch.float32
    model = empty_model(cfg, dtype, device, par, vision=vision)
    load_state_dict_into(model, path, cfg.model_type, progress=progress)
    if model.vision is not None and (path / "preprocessor_config.json").exists():
        from k3backend.model.preprocess import PreprocessConfig

        model.preprocess_cfg = PreprocessConfig.from_json(path / "preprocessor_config.json")
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s, %s) from %s: %s", cfg.model_type, dtype, device, path, weight_summary(model))
    if cfg.text.mamba_ssm_dtype != "float32":  # K3_LM.md §5.6: SGLang would round the state at every store
        log.warning("config.json asks for mamba_ssm_dtype %s: the KDA recurrent state is kept in float32 here, so "
                    "outputs can differ from a server that rounds the state to %s at every store (the float32 "
                    "state is the more precise; the cache holds half the KDA slots it would in 16 bits)",
                    cfg.text.mamba_ssm_dtype, cfg.text.mamba_ssm_dtype)
    return model


def empty_model(cfg: K3Config, dtype: torch.dtype, device: str | torch.device, par: Parallel = SINGLE, *,
                vision: bool = True) -> torch.nn.Module:
    """The model of `cfg`, allocated once on `device` in its runtime dtypes, values uninitialised."""
    from k3backend.model.k3 import K3Model

    with torch.device("meta"):
        model = K3Model(cfg, par, vision=vision)
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        if p.is_floating_point():  # packed MXFP4 experts stay uint8
            p.data = p.data.to(param_dtype(name, dtype))
    return model


def weight_summary(model: torch.nn.Module) -> str:
    """Bytes of the weights and of the routed experts among them (the memory the cache budget does not get)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts.w" in n)
    packed = any(n.endswith(".experts.w13_scale") for n, _ in model.named_parameters())
    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    return f"{size(total)} of weights, routed experts {size(experts)}{' as MXFP4 (4.25 bits a weight)' if packed else ''}"


def load_vision(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                progress: bool = True) -> tuple[torch.nn.Module, "PreprocessConfig"]:
    """Only the vision tower and projector of a kimi_k3 checkpoint (what `k3_vision` serves), plus its
    preprocessing config. The language model's tensors are not read."""
    from k3backend.model.preprocess import PreprocessConfig
    from k3backend.model.vision import K3VisionModel

    path = Path(path)
    cfg = K3Config.from_json(path)
    if cfg.vision is None:
        raise CheckpointError(f"{path}: model_type {cfg.model_type} has no vision_config")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = K3VisionModel(cfg.vision)
    model.to_empty(device=device)
    model.to(dtype)
    load_state_dict_into(model, path, cfg.model_type, progress=progress, only_prefix="vision.")
    pre = path / "preprocessor_config.json"
    preprocess_cfg = PreprocessConfig.from_json(pre) if pre.exists() else PreprocessConfig()
    log.info("loaded vision tower (%s, %s) from %s", dtype, device, path)
    return model.eval().requires_grad_(False), preprocess_cfg
