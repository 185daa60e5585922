"""End-to-end numerics of the fast path against the fp32 torch reference of the same random weights:
a teacher-forced check that can fail, then the greedy agreement table.

    python bench/agreement.py --preset small --conditioned --prompts 4 --prompt-len 512 --decode-steps 64
    python bench/agreement.py --preset small --conditioned --plant attn_res_mix_norm   # a planted kernel error: fails

Teacher-forced (`k3backend.numerics`): random prompts + continuations run through the fused path
(bf16, every op its fast implementation, decode steps through the engine's ModelRunner with its
caches and CUDA graphs), through the bf16 torch references (every op its reference, the same
runner path without graphs) and through the fp32 references (one full forward per sequence, the
independent reference). Per phase (prefill rows, cached decode steps) the table gives relative L2,
cosine, top-1 agreement and |Δ log-prob| against fp32. The rule: the fused path's relative L2 and
mean |Δ log-prob| within 1.2x of the bf16 reference's, prefill and decode; the exit status is 1
when it fails. It means something only on a model that is not chaotic (`--conditioned`,
`presets.Conditioning`): the default random init routes through near ties, and its bf16 logits are
unrelated to fp32 ones whatever the kernels do.

`--plant OP` scales the output of the fast `kernels.OP` by `--plant-scale` (1 + 2^-6) in the fast path
only (the references strip it: its `__wrapped__` is the clean reference), to show what the check
catches that the greedy table does not. `--ref-op OP` (repeatable) runs OP by its torch reference in
the fast path too: which fused op a failure comes from.

Greedy (`--output-len` > 0): the fast engine generates greedily from the same prompts; the bf16 and
fp32 references run one teacher-forced forward over each prompt + output, and at every output
position the engine's token is compared with each reference's argmax, also where the reference's
top-1 leads its top-2 by more than --margin logits, with the count of disagreements that are the
reference's second choice (a near tie lost), and the first disagreement.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import sys
import time
from collections.abc import Iterator

import torch

from k3backend import kernels, numerics
from k3backend.checkpoint import empty_model, param_dtype
from k3backend.config import K3Config
from k3backend.engine.batch import blocks_for
from k3backend.engine.config import EngineConfig
from k3backend.engine.core import EngineCore, run_requests
from k3backend.engine.request import Request
from k3backend.engine.runner import InProcessExecutor
from k3backend.engine.sampling_params import SamplingParams
from k3backend.generate import full_forward
from k3backend.model.k3 import K3Model
from k3backend.presets import preset_config, randomize_weights_

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def random_model(preset: str, dtype: torch.dtype, device: torch.device, seed: int, conditioned: bool) -> K3Model:
    model = empty_model(K3Config.from_dict(preset_config(preset)), dtype, device)
    return randomize_weights_(model, seed, conditioned=conditioned).eval().requires_grad_(False)


def cast(model: K3Model, dtype: torch.dtype) -> K3Model:
    """A copy of `model` in `dtype` (parameters kept in fp32 at runtime stay fp32)."""
    out = copy.deepcopy(model)
    for name, p in out.named_parameters():
        if p.is_floating_point():  # packed MXFP4 experts stay uint8
            p.data = p.data.to(param_dtype(name, dtype))
    return out


@contextlib.contextmanager
def fast_path(plant: str | None, scale: float, ref_ops: list[str]) -> Iterator[None]:
    """The fast path as --plant and --ref-op make it inside this block: kernels.<plant>'s output (its first
    output, for a tuple) times `scale`, a subtly wrong fused op whose `__wrapped__` is the clean reference
    (so `kernels.reference_ops()` runs clean); each op of ref_ops its torch reference (to bisect a failure)."""
    saved = {op: getattr(kernels, op) for op in [*ref_ops, *([plant] if plant else [])]}
    for op in ref_ops:
        setattr(kernels, op, getattr(saved[op], "__wrapped__", saved[op]))
    if plant:
        fast = getattr(kernels, plant)

        def wrong(*args, **kwargs):
            out = fast(*args, **kwargs)
            return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale

        wrong.__wrapped__ = getattr(fast, "__wrapped__", fast)  # type: ignore[attr-defined]
        setattr(kernels, plant, wrong)
    try:
        yield
    finally:
        for op, f in saved.items():
            setattr(kernels, op, f)


def teacher_forced(args: argparse.Namespace, ref: K3Model, fast: K3Model, prompts: list[list[int]]) -> bool:
    """Print the numerics table; True when the fast path meets the rule in both phases."""
    cfg = ref.cfg
    conts = numerics.random_tokens(cfg.text.vocab_size, cfg.media_placeholder_token_id, len(prompts),
                                   args.decode_steps, args.seed + 1)
    t0 = time.monotonic()
    with kernels.reference_ops():
        want = numerics.reference_logits(ref, prompts, conts)
        floor = numerics.teacher_forced_logits(fast, prompts, conts, graphs=False)
    t1 = time.monotonic()
    with fast_path(args.plant, args.plant_scale, args.ref_op):
        got = numerics.teacher_forced_logits(fast, prompts, conts, graphs=fast.language_model.lm_head.weight.is_cuda)
    t2 = time.monotonic()
    low, high = args.dtype, args.ref_dtype
    fast_name = (f"fused {low}" + (f" +{args.plant} x{args.plant_scale:.5g}" if args.plant else "")
                 + "".join(f" -{op}" for op in args.ref_op))
    print(f"\nteacher-forced: {len(prompts)} x {args.prompt_len} prompt rows (prefill), then {args.decode_steps} "
          f"cached decode steps of all {len(prompts)} sequences; {high} reference and {low} reference "
          f"{t1 - t0:.1f} s, fused {t2 - t1:.1f} s")
    print(numerics.TABLE_HEADER.replace("reference", high, 1))
    ok = True
    for phase, w, f, g in zip(("prefill", "decode"), want, floor, got):
        e_floor, e_fast = numerics.logit_errors(f, w), numerics.logit_errors(g, w)
        bad = e_fast.violations(e_floor)
        ok &= not bad
        print(numerics.table_row(f"{phase:<8} {low} reference", e_floor))
        print(numerics.table_row(f"{phase:<8} {fast_name}", e_fast, "FAIL " + "; ".join(bad) if bad else "ok"))
    print(f"rule: the fused path's {' and '.join(numerics.RULED)} within {numerics.RULE_RATIO}x of the {low} "
          f"reference's, prefill and decode: {'PASS' if ok else 'FAIL'}")
    return ok


def greedy(args: argparse.Namespace, ref: K3Model, fast: K3Model, prompts: list[list[int]]) -> None:
    """Print the greedy agreement table of the fast engine against both references."""
    device = fast.language_model.lm_head.weight.device
    max_len = args.prompt_len + args.output_len + 64
    n = len(prompts)  # pools for these sequences only (not 90 % of the GPU, nor cpu_cache_gb on a CPU)
    cfg = EngineConfig(max_num_seqs=n, max_model_len=max_len, prefix_caching=False, num_slots=n + 1,
                       num_blocks=n * blocks_for(max_len, EngineConfig.block_size) + 1)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    t0 = time.monotonic()
    with fast_path(args.plant, args.plant_scale, args.ref_op):
        executor = InProcessExecutor(fast, cfg)
        outs = [c.token_ids for c in run_requests(EngineCore(executor, cfg),
                                                   [Request(f"p{i}", p, params) for i, p in enumerate(prompts)])]
        executor.close()
    print(f"\ngreedy: {args.dtype} engine {sum(map(len, outs))} tokens in {time.monotonic() - t0:.1f} s")
    low, high = args.dtype, args.ref_dtype
    rows = {f"engine vs {low} reference": [], f"engine vs {high} reference": [],
            f"{low} reference vs {high} reference": []}
    names = list(rows)
    with kernels.reference_ops(), torch.inference_mode():
        for p, out in zip(prompts, outs):
            chosen = torch.tensor(out, device=device)
            l_high = plain_forward(ref, p + out).float()[len(p) - 1:-1]  # the logits that chose each output
            l_low = plain_forward(fast, p + out).float()[len(p) - 1:-1]
            rows[names[0]].append(compare(chosen, l_low, args.margin))
            rows[names[1]].append(compare(chosen, l_high, args.margin))
            rows[names[2]].append(compare(l_low.argmax(-1), l_high, args.margin))
    print(f"{len(prompts)} prompts x {args.output_len} greedy tokens of the engine (prompt {args.prompt_len}); "
          f"teacher-forced references over the same tokens")
    print(f"{'pair':<38} {'argmax agrees':>14} {'lost near ties':>15} {'clear agree':>16} first disagreement")
    for name, per in rows.items():
        n = sum(r[0] for r in per)
        same, second, clear, clear_same = (sum(r[i] for r in per) for i in (1, 2, 3, 4))
        print(f"{name:<38} {same / n:>14.2%} {second:>7}/{n - same:<7} {clear_same:>7}/{clear:<8} "
              f"{[r[5] for r in per]}")
    print(f"(clear: the reference's top-1 leads its top-2 by more than {args.margin} logits; lost near ties: "
          f"disagreements where the first pick is the reference's second)")


def plain_forward(model: K3Model, ids: list[int]) -> torch.Tensor:
    """full_forward where a generated media pad is a plain token, as the engine decodes it: its image row
    is the pad's own embedding (the prompts hold no pads)."""
    pads = sum(t == model.cfg.media_placeholder_token_id for t in ids)
    rows = model.language_model.model.embed_tokens.weight[model.cfg.media_placeholder_token_id].expand(pads, -1)
    return full_forward(model, ids, rows if pads else None)


def compare(chosen: torch.Tensor, logits: torch.Tensor, margin: float) -> tuple[int, int, int, int, int, int]:
    """(positions, argmax agrees, chosen is the reference's 2nd, clear positions, clear and agreeing,
    first disagreement) of picks `chosen` [N] against reference logits [N, V]."""
    top2 = logits.topk(2, dim=-1)
    same = top2.indices[:, 0] == chosen
    clear = top2.values[:, 0] - top2.values[:, 1] > margin
    bad = (~same).nonzero()
    return (len(chosen), int(same.sum()), int((top2.indices[:, 1] == chosen).sum()), int(clear.sum()),
            int((same & clear).sum()), int(bad[0]) if len(bad) else len(chosen))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--conditioned", action="store_true", help="the well-conditioned random init (presets.Conditioning)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=64, help="teacher-forced cached decode steps per sequence")
    ap.add_argument("--output-len", type=int, default=0, help="greedy tokens per prompt for the greedy table (0: none)")
    ap.add_argument("--margin", type=float, default=0.05, help="reference top-1 lead, in logits, of a clear position")
    ap.add_argument("--plant", default=None, metavar="OP", help="scale the fast path's kernels.OP output (e.g. attn_res_mix_norm)")
    ap.add_argument("--plant-scale", type=float, default=1 + 2 ** -6)
    ap.add_argument("--ref-op", action="append", default=[], metavar="OP",
                    help="run kernels.OP by its torch reference in the fast path too (repeatable; bisects a failure)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the fast path and its torch reference")
    ap.add_argument("--ref-dtype", default="float32", choices=DTYPES, help="the independent reference (float64 on a CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for op in [*args.ref_op, *([args.plant] if args.plant else [])]:
        if op not in kernels.FAST_OPS:
            ap.error(f"--plant / --ref-op: expected one of {', '.join(sorted(kernels.FAST_OPS))}, got {op!r}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")  # cache, kernels, graphs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    ref = random_model(args.preset, DTYPES[args.ref_dtype], device, args.seed, args.conditioned)
    fast = cast(ref, DTYPES[args.dtype])
    print(f"{args.preset}{' conditioned' if args.conditioned else ''} on {device}: {args.ref_dtype} reference and "
          f"{args.dtype} copy ready in {time.monotonic() - t0:.1f} s, kernels mode {kernels.MODE}, "
          f"torch {torch.__version__}")
    prompts = numerics.random_tokens(ref.cfg.text.vocab_size, ref.cfg.media_placeholder_token_id, args.prompts,
                                     args.prompt_len, args.seed)
    ok = teacher_forced(args, ref, fast, prompts)
    if args.output_len > 0:
        greedy(args, ref, fast, prompts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
