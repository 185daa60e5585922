"""End-to-end numerics of the fast path: greedy tokens of the bf16 engine (fused kernels, CUDA
graphs) against the fp32 torch reference of the same random weights.

    python bench/agreement.py --preset small --prompts 4 --prompt-len 256 --output-len 1024

The bf16 engine (decode steps in CUDA graphs where they are on) generates greedily; then the torch
references (every op its reference) in bf16 and in fp32 run one teacher-forced forward over each
prompt + output, and at every output position the engine's token is compared with each reference's
argmax. The bf16 reference against fp32 is the floor that bf16 rounding alone sets: a random-weight
model routes its MoE tokens through near ties, so one flipped expert choice moves a layer's output by
percents, and the errors compound over the layers. The fused engine should agree with the bf16
reference nearly everywhere and with fp32 about as well as the bf16 reference does. Also printed:
agreement where the reference's top-1 leads its top-2 by more than --margin logits, how many
disagreements are the reference's second choice (a near tie lost), and the first disagreement.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from k3backend import kernels
from k3backend.checkpoint import empty_model, param_dtype
from k3backend.config import K3Config
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore, run_requests
from k3backend.engine.request import Request
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.generate import full_forward
from k3backend.model.k3 import K3Model
from k3backend.presets import preset_config, randomize_weights_


def random_model(preset: str, dtype: torch.dtype, device: torch.device, seed: int) -> K3Model:
    model = empty_model(K3Config.from_dict(preset_config(preset)), dtype, device)
    return randomize_weights_(model, seed).eval().requires_grad_(False)


def cast(model: K3Model, dtype: torch.dtype) -> K3Model:
    """A copy of `model` in `dtype` (parameters kept in fp32 at runtime stay fp32)."""
    import copy

    out = copy.deepcopy(model)
    for name, p in out.named_parameters():
        if p.is_floating_point():  # packed MXFP4 experts stay uint8
            p.data = p.data.to(param_dtype(name, dtype))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--margin", type=float, default=0.05, help="fp32 top-1 lead, in logits, of a clear position")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")  # cache, kernels, graphs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    ref = random_model(args.preset, torch.float32, device, args.seed)
    fast = cast(ref, torch.bfloat16)
    print(f"{args.preset} on {device}: fp32 reference and bf16 copy ready in {time.monotonic() - t0:.1f} s, "
          f"kernels mode {kernels.MODE}")
    vocab = ref.cfg.text.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    pad = ref.cfg.media_placeholder_token_id  # no image rows here
    prompts = [[t if t != pad else t - 1 for t in torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()]
               for _ in range(args.prompts)]

    cfg = EngineConfig(max_num_seqs=max(args.prompts, 1), max_model_len=args.prompt_len + args.output_len + 64)
    executor = InProcessExecutor(fast, cfg)
    greedy = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    t0 = time.monotonic()
    outs = [c.token_ids for c in run_requests(EngineCore(executor, cfg),
                                               [Request(f"p{i}", p, greedy) for i, p in enumerate(prompts)])]
    print(f"bf16 engine: {sum(map(len, outs))} tokens in {time.monotonic() - t0:.1f} s")
    executor.close()

    rows = {"bf16 engine vs bf16 reference": [], "bf16 engine vs fp32 reference": [],
            "bf16 reference vs fp32 reference": []}
    with kernels.reference_ops(), torch.inference_mode():
        for p, out in zip(prompts, outs):
            chosen = torch.tensor(out, device=device)
            l32 = full_forward(ref, p + out).float()[len(p) - 1:-1]  # the logits that chose each output
            l16 = full_forward(fast, p + out).float()[len(p) - 1:-1]
            rows["bf16 engine vs bf16 reference"].append(compare(chosen, l16, args.margin))
            rows["bf16 engine vs fp32 reference"].append(compare(chosen, l32, args.margin))
            rows["bf16 reference vs fp32 reference"].append(compare(l16.argmax(-1), l32, args.margin))
    print(f"\n{len(prompts)} prompts x {args.output_len} greedy tokens of the bf16 engine (prompt {args.prompt_len}); "
          f"teacher-forced references over the same tokens")
    print(f"{'pair':<34} {'argmax agrees':>16} {'lost near ties':>15} {'clear agree':>16} first disagreement")
    for name, per in rows.items():
        n = sum(r[0] for r in per)
        same, second, clear, clear_same = (sum(r[i] for r in per) for i in (1, 2, 3, 4))
        print(f"{name:<34} {same / n:>16.2%} {second:>7}/{n - same:<7} {clear_same:>7}/{clear:<8} "
              f"{[r[5] for r in per]}")
    print(f"(clear: the reference's top-1 leads its top-2 by more than {args.margin} logits; lost near ties: "
          f"disagreements where the first pick is the reference's second)")
    return 0


def compare(chosen: torch.Tensor, logits: torch.Tensor, margin: float) -> tuple[int, int, int, int, int, int]:
    """(positions, argmax agrees, chosen is the reference's 2nd, clear positions, clear and agreeing,
    first disagreement) of picks `chosen` [N] against reference logits [N, V]."""
    top2 = logits.topk(2, dim=-1)
    same = top2.indices[:, 0] == chosen
    clear = top2.values[:, 0] - top2.values[:, 1] > margin
    bad = (~same).nonzero()
    return (len(chosen), int(same.sum()), int((top2.indices[:, 1] == chosen).sum()), int(clear.sum()),
            int((same & clear).sum()), int(bad[0]) if len(bad) else len(chosen))


if __name__ == "__main__":
    sys.exit(main())
