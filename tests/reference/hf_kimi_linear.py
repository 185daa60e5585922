"""Independent reference: transformers' KimiLinearForCausalLM on a random Kimi-Linear config.

Run as a subprocess (`python hf_kimi_linear.py OUT_DIR SEED N_PROMPTS LENGTH [V_HEAD_DIM]`): it hides
triton so transformers keeps its pure-torch paths (with triton importable it picks fla's GPU
kernels), writes a checkpoint with `save_pretrained`, and saves logits for fresh random prompts
computed two ways: fp32 as shipped, and float64 with transformers' internal float32 casts lifted to
float64 (so the comparison with our float64 model is exact up to summation order).

Two adjustments make transformers compute the spec's function (K3_LM.md §13): the MLA latent
norms use `rms_norm_eps` (transformers hard-codes 1e-6 there), and the KDA `o_norm` eps is 1e-5
(transformers uses rms_norm_eps, so the config sets rms_norm_eps = 1e-5).
"""

import importlib
import inspect
import json
import sys
from pathlib import Path

sys.modules["triton"] = None  # keep transformers off fla's GPU kernels

import torch  # noqa: E402

EPS = 1e-5


def make_config(v_head_dim: int):
    """v_head_dim is the MLA value head size; transformers' KDA layers use linear_attn_config.head_dim
    (16) for values whatever it is, so v_head_dim != 16 gives a checkpoint whose KDA value head size
    only its v_proj shape tells (K3_LM.md §13)."""
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=v_head_dim, qk_nope_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.446, rms_norm_eps=EPS, hidden_act="silu",
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4]},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._experts_implementation = "eager"
    return cfg


def fix_eps(model) -> None:
    for mod in model.modules():
        if type(mod).__name__ == "KimiLinearAttention":
            mod.q_a_layernorm.variance_epsilon = EPS
            mod.kv_a_layernorm.variance_epsilon = EPS


def float64_module():
    """transformers' kimi_linear modeling module re-executed with every float32 cast (`torch.float32`, `.float()`) made float64."""
    mk = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    src = inspect.getsource(mk).replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    exec(compile(src, mk.__file__, "exec"), mk.__dict__)
    return mk


def init_weights(model, g: torch.Generator) -> None:
    """Random weights at sane scales (std 1/sqrt(fan_in)), norms near 1, fresh per seed."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=g))


def router_margin(router, logits: torch.Tensor) -> float:
    """Smallest gap, over tokens, between the last chosen and the first rejected group / expert score.

    A float32 run can flip a choice whose gap is below its rounding error, so the test only uses
    prompts whose every routing decision has a clear margin (the issue asks for > 1e-4).
    """
    c = logits.sigmoid() + router.e_score_correction_bias
    T, E = c.shape
    gs = c.view(T, router.num_group, -1).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
    margin = (gs[:, router.topk_group - 1] - gs[:, router.topk_group]).min() if router.topk_group < router.num_group \
        else torch.tensor(float("inf"))
    keep = gs[:, router.topk_group - 1:router.topk_group]
    group_ok = c.view(T, router.num_group, -1).topk(2, dim=-1).values.sum(-1) >= keep
    masked = c.masked_fill(~group_ok.repeat_interleave(E // router.num_group, dim=1), float("-inf"))
    top = masked.sort(-1, descending=True).values
    return min(float(margin), float((top[:, router.top_k - 1] - top[:, router.top_k]).min()))


def main(out: Path, seed: int, n_prompts: int, length: int, v_head_dim: int = 16) -> None:
    from transformers import KimiLinearForCausalLM

    g = torch.Generator().manual_seed(seed)
    model = KimiLinearForCausalLM(make_config(v_head_dim))
    init_weights(model, g)
    fix_eps(model)
    model.save_pretrained(out / "ckpt")
    with torch.no_grad():
        mk = float64_module()
        model64 = mk.KimiLinearForCausalLM.from_pretrained(out / "ckpt", dtype=torch.float64,
                                                           experts_implementation="eager").eval()
        fix_eps(model64)
        margins: list[float] = []
        for mod in model64.modules():
            if type(mod).__name__ == "KimiLinearTopkRouter":
                mod.register_forward_hook(lambda m, args, out: margins.append(router_margin(m, out[0])))
        prompts, fp64 = [], []
        for _ in range(8 * n_prompts):
            p = torch.randint(3, 300, (length,), generator=g)
            margins.clear()
            logits = model64(p[None]).logits[0]
            if min(margins) > 1e-4:
                prompts.append(p)
                fp64.append(logits)
            if len(prompts) == n_prompts:
                break
        assert len(prompts) == n_prompts, "no prompts with clear routing margins"
        prompts = torch.stack(prompts)
        fp32 = torch.stack([model.eval()(p[None]).logits[0] for p in prompts])
    torch.save({"prompts": prompts, "fp32": fp32, "fp64": torch.stack(fp64)}, out / "logits.pt")
    (out / "done.json").write_text(json.dumps({"seed": seed}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *map(int, sys.argv[2:]))
