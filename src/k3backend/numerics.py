"""Teacher-forced numerics of the model against a reference (issue 17): the logits of prefills and of
cached decode steps over the same tokens, the errors between two sets of logits, and the tolerance rule.

Every path reads the same tokens (teacher forcing), so errors do not feed back through sampled
tokens and every position counts. The decode logits come through the engine's own `ModelRunner`
(cache pools, batched decode rows, CUDA graphs where the runner captures them); the independent
reference is one full forward of each prompt + continuation in high precision (fp32, or fp64 on a
CPU), whose rows cover the prefill positions and the decode steps alike. The numbers mean something
only on a model whose rounding errors do not compound chaotically (`presets.Conditioning`).

Rule: a fast path is numerically sound when its errors against the reference are within
`RULE_RATIO` (1.2) × the errors of the torch reference ops in the same dtype, for the continuous
measures in `RULED` (relative L2 and mean |Δ log-prob|); cosine, top-1 agreement and max |Δ log-prob|
are reported beside them (top-1 counts over a few thousand positions are too noisy for a 1.2× bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3backend.engine.batch import blocks_for
from k3backend.engine.config import EngineConfig
from k3backend.engine.plan import ScheduledSeq, StepPlan
from k3backend.engine.runner import ModelRunner
from k3backend.generate import full_forward
from k3backend.model.cache import CachePools
from k3backend.model.k3 import K3Model

BLOCK_SIZE = 64
RULE_RATIO = 1.2
RULED = ("rel_l2", "dlp_mean")


@dataclass(frozen=True)
class LogitErrors:
    """Errors of logits [N, V] against reference logits [N, V] (N positions)."""

    rel_l2: float  # ‖x − r‖ / ‖r‖ over all N·V entries
    cosine: float  # cosine similarity of each position's logits, mean over positions
    top1: float  # share of positions whose argmax is the reference's
    dlp_mean: float  # |Δ log-prob| of the reference's top-1 token, mean over positions
    dlp_max: float  # ... and its maximum

    def violations(self, floor: LogitErrors, ratio: float = RULE_RATIO) -> list[str]:
        """The `RULED` measures where these errors exceed ratio × `floor`'s (the reference ops' errors)."""
        return [f"{k} {getattr(self, k):.4g} > {ratio} x {getattr(floor, k):.4g}" for k in RULED
                if not getattr(self, k) <= ratio * getattr(floor, k)]  # NaN fails too


@torch.inference_mode()
def logit_errors(x: torch.Tensor, ref: torch.Tensor, chunk: int = 256) -> LogitErrors:
    """x, ref: [N, V] logits of the same positions (any float dtype); computed in fp64, `chunk` rows at a time."""
    if x.shape != ref.shape:
        raise ValueError(f"logits: expected {list(ref.shape)} as the reference, got {list(x.shape)}")
    sq_err = sq_ref = cos = top1 = dlp_sum = 0.0
    dlp_max = 0.0
    for a in range(0, x.shape[0], chunk):
        xs, rs = x[a:a + chunk].double(), ref[a:a + chunk].double()
        sq_err += float((xs - rs).pow(2).sum())
        sq_ref += float(rs.pow(2).sum())
        cos += float(torch.nn.functional.cosine_similarity(xs, rs, dim=-1).sum())
        best = rs.argmax(-1, keepdim=True)  # [n, 1]
        top1 += float((xs.argmax(-1, keepdim=True) == best).sum())
        dlp = (xs.log_softmax(-1).gather(-1, best) - rs.log_softmax(-1).gather(-1, best)).abs()
        dlp_sum += float(dlp.sum())
        dlp_max = max(dlp_max, float(dlp.max()))
    n = x.shape[0]
    return LogitErrors(math.sqrt(sq_err / sq_ref), cos / n, top1 / n, dlp_sum / n, dlp_max)


def random_tokens(vocab: int, avoid: int, num: int, length: int, seed: int) -> list[list[int]]:
    """num sequences of `length` uniform token ids, `avoid` (the media pad: no image rows here) moved one down."""
    g = torch.Generator().manual_seed(seed)
    return [[t if t != avoid else t - 1 for t in torch.randint(0, vocab, (length,), generator=g).tolist()]
            for _ in range(num)]


@torch.inference_mode()
def reference_logits(model: K3Model, prompts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill rows [Σ P_i, V], decode rows [Σ D_i, V]) of one full forward of each prompt + continuation:
    row P_i + j is the logits after continuation token j, what decode step j computes."""
    rows = [full_forward(model, [*p, *c]) for p, c in zip(prompts, continuations)]
    return (torch.cat([r[:len(p)] for r, p in zip(rows, prompts)]),
            torch.cat([r[len(p):] for r, p in zip(rows, prompts)]))


@torch.inference_mode()
def teacher_forced_logits(model: K3Model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                          *, graphs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill rows [Σ P_i, V], decode rows [Σ D_i, V]) in the rows of `reference_logits`: each prompt in
    one fresh prefill, then the runner prefills all prompts in one step and decodes continuation token j
    of every sequence in step j, all in one batch as the engine runs them (CUDA graphs if `graphs` and
    the runner captures them: on a GPU with the fused kernels)."""
    prefill = torch.cat([full_forward(model, p) for p in prompts])
    steps = len(continuations[0])
    if any(len(c) != steps for c in continuations):
        raise ValueError(f"continuations: expected {steps} tokens each, got {[len(c) for c in continuations]}")
    max_len = max(len(p) for p in prompts) + steps
    nb = blocks_for(max_len, BLOCK_SIZE)
    pools = CachePools.allocate(model.language_model, len(prompts) + 1, len(prompts) * nb + 1, BLOCK_SIZE)
    runner = ModelRunner(model, pools, samples=False)
    runner.capture_graphs(EngineConfig(max_num_seqs=len(prompts), max_model_len=max_len, block_size=BLOCK_SIZE,
                                       enforce_eager=not graphs))
    tables = [tuple(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(len(prompts))]  # block 0 is the null block
    runner.logits(StepPlan([ScheduledSeq(i + 1, tuple(p), 0, False, tables[i], True) for i, p in enumerate(prompts)]))
    out = []
    for j in range(steps):
        rows = [ScheduledSeq(i + 1, (c[j],), len(p) + j, True, tables[i], True)
                for i, (p, c) in enumerate(zip(prompts, continuations))]
        out.append(runner.logits(StepPlan(rows, num_decode=len(rows))).clone())  # graph outputs are reused
    return prefill, torch.stack(out, 1).flatten(0, 1)  # [B, D, V] -> sequence-major rows


def table_row(name: str, e: LogitErrors, verdict: str = "") -> str:
    """One line of the numerics table (`TABLE_HEADER`'s columns)."""
    return (f"{name:<44} {e.rel_l2:>9.4g} {e.cosine:>9.6f} {e.top1:>7.2%} {e.dlp_mean:>10.4g} {e.dlp_max:>9.4g}"
            f"  {verdict}")


TABLE_HEADER = f"{'phase, path vs reference':<44} {'rel L2':>9} {'cosine':>9} {'top-1':>7} {'|dlp| mean':>10} {'|dlp| max':>9}"
