"""Writing Hugging Face-layout safetensors checkpoints (K3_LM.md §8): names, stored dtypes, shards.

The inverse of `checkpoint.py`'s loading. `write_tensors` takes each tensor as a recipe (name,
shape, stored dtype, a function that makes the value), so a writer holds one shard at most:
make-checkpoint draws a preset's random tensors one at a time in their stored dtype (presets.py),
and `save_checkpoint` writes a built model's parameters.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3backend.checkpoint import FP32_PARAMS, packed_params

MAX_SHARD_BYTES = 2 << 30  # make-checkpoint's shard size: what one writer holds in memory at most


@dataclass(frozen=True)
class TensorToWrite:
    """One checkpoint tensor: its name, stored shape and dtype, and how to make its value."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]  # deterministic on its own: recipes may run in any order, in threads

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_name(param: str, model_type: str) -> str:
    """Inverse of `canonical_name` for non-expert tensors (used when writing checkpoints)."""
    n = re.sub(r"\.(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)\.weight$", r".\1_\2.weight", param)
    if n.startswith("vision."):
        return n[len("vision."):]
    n = n.replace(".mlp.", ".block_sparse_moe.") if ".mlp.experts" in n or ".mlp.gate." in n or \
        ".mlp.shared_experts." in n or ".mlp.routed_expert" in n else n
    return n if model_type == "kimi_k3" else n[len("language_model."):]


def expected_checkpoint_tensors(model: torch.nn.Module, model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under their checkpoint names, experts and packed tensors unpacked (the inverse
    of loading; MXFP4 experts as their `weight_packed` / `weight_scale` pairs)."""
    packed = packed_params(model)
    parts: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for name, (pname, a, b) in packed.items():
        parts[pname].append((name, a, b))
    for name, p in model.named_parameters():
        expert = re.search(r"\.experts\.(w13|w2)(_scale)?$", name)
        if expert:
            base = checkpoint_name(name.rsplit(".", 1)[0] + ".x", model_type)[:-2]
            kind = "weight" if p.is_floating_point() else "weight_scale" if expert.group(2) else "weight_packed"
            for e in range(p.shape[0]):
                if expert.group(1) == "w13":
                    half = p.shape[1] // 2
                    yield f"{base}.{e}.w1.{kind}", p[e, :half]
                    yield f"{base}.{e}.w3.{kind}", p[e, half:]
                else:
                    yield f"{base}.{e}.w2.{kind}", p[e]
        elif name in parts:
            for part, a, b in parts[name]:
                yield checkpoint_name(part, model_type), p[a:b]
        else:
            yield checkpoint_name(name, model_type), p


def stored_dtype(name: str, dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint stores tensor `name` in: fp32 for FP32_PARAMS (§8.1), uint8 stays uint8
    (MXFP4 codes and exponents, §7.7), everything else model_dtype."""
    if dtype == torch.uint8:
        return dtype
    return torch.float32 if name.endswith(FP32_PARAMS) else model_dtype


def pad_a_log(t: torch.Tensor, n: int | None) -> torch.Tensor:
    """A_log 1-D zero-padded to n, as the K3 release stores it ([head_dim], §13); None: as it is."""
    return t if not n else torch.cat([t.reshape(-1), t.new_zeros(n - t.numel())])


def shard_count(tensors: Sequence[TensorToWrite], max_bytes: int = MAX_SHARD_BYTES, least: int = 2) -> int:
    """Shards of at most about max_bytes each, and at least `least` (so the index is always exercised)."""
    return max(least, -(-sum(t.nbytes for t in tensors) // max_bytes))


def write_tensors(out: Path, tensors: Sequence[TensorToWrite], num_shards: int = 1, threads: int = 1) -> None:
    """Write `tensors` sorted by name, as `num_shards` contiguous runs of about equal bytes
    (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`; `model.safetensors` for one).

    Each shard's tensors are made (`threads` at a time), written and dropped before the next shard.
    """
    tensors = sorted(tensors, key=lambda t: t.name)
    total = sum(t.nbytes for t in tensors)
    groups: dict[int, list[TensorToWrite]] = defaultdict(list)
    done = 0
    for t in tensors:  # a shard starts where the bytes so far pass its share
        groups[min(num_shards - 1, done * num_shards // max(total, 1))].append(t)
        done += t.nbytes
    shards = [groups[i] for i in sorted(groups)]
    weight_map = {}
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for i, shard in enumerate(shards):
            values = dict(zip((t.name for t in shard), pool.map(lambda t: _made(t), shard)))
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(values, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(values, fname))
            del values
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _made(t: TensorToWrite) -> torch.Tensor:
    v = t.make()
    if tuple(v.shape) != t.shape or v.dtype != t.dtype:  # a recipe that does not make what it announced
        raise AssertionError(f"{t.name}: made {v.dtype} {list(v.shape)}, expected {t.dtype} {list(t.shape)}")
    return v.contiguous()


def save_checkpoint(model: torch.nn.Module, out: Path, model_type: str, *, num_shards: int = 1,
                    dtype: torch.dtype = torch.bfloat16, a_log_pad: int | None = None) -> None:
    """Write `model`'s parameters as safetensors in the HF layout, each in its `stored_dtype`.

    a_log_pad: store A_log 1-D zero-padded to this length, as the K3 release does ([head_dim]).
    """
    recipes = []
    for name, p in expected_checkpoint_tensors(model, model_type):
        pad = a_log_pad if name.endswith("A_log") else None
        shape = (pad,) if pad else tuple(p.shape)
        sd = stored_dtype(name, p.dtype, dtype)
        recipes.append(TensorToWrite(name, shape, sd, lambda p=p, sd=sd, pad=pad: pad_a_log(p.detach().to("cpu", sd), pad)))
    write_tensors(out, recipes, num_shards)
