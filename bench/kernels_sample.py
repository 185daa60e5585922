"""Sampler cases for bench/kernels.py: the Triton draw (kernels/sample.py) and the whole batched sampler.

race_draw over S = 1, 16, 64, 256 rows of the K3 vocabulary (163,840 ids): bytes are one fp32 read
of the probabilities; the reference materialises the float64 uniforms. softmax_rows: from bf16
logits with a temperature (bytes: two bf16 reads and the fp32 write), within 32 float32 ulps of
torch's softmax. `--check` wants the same ids
as the reference, bit for bit. top_k_top_p: the sort-free cut against the sorted reference over the
same probabilities (top-p 0.9 rows, and top-k 50 with top-p 0.9; `_flat`: rows of logits of scale
0.5, where most ids stay in play for several passes), every element equal. sampler/*: `Sampler()`
over bf16 logits as the engine calls it, for temperature-only rows, top-p 0.9 rows (peaky and flat),
top-k 50 rows and greedy rows; none sorts the vocabulary. The reference column of the sampled rows
is the always-sorted path with the reference draw, which must pick the same tokens. Timed eagerly:
the sampler ends in the step's one host copy.
"""

from __future__ import annotations

import torch

from kernels import Case

VOCAB = 163840


def _ids_equal(fast, ref):
    def check() -> str:
        got, want = fast(), ref()
        got = got if isinstance(got, list) else got.tolist()
        want = want if isinstance(want, list) else want.tolist()
        assert got == want, f"{sum(a != b for a, b in zip(got, want))} of {len(want)} ids differ"
        return f"ok: {len(want)} ids equal"
    return check


def _probs_equal(fast, ref):
    def check() -> str:
        got, want = fast(), ref()
        rows = [i for i in range(len(want)) if not torch.equal(got[i], want[i])]
        assert not rows, f"{len(rows)} of {len(want)} rows differ, first {rows[:5]}"
        return f"ok: {len(want)} rows equal, {int((want > 0).sum(1).float().mean())} ids kept a row on average"
    return check


def _probs_close(fast, ref, ulps: int = 32):
    def check() -> str:
        got, want = fast(), ref()
        worst = ((got - want).abs() / (want * 2.0 ** -24 + 2.0 ** -140)).max().item()
        assert worst <= ulps, f"worst element {worst:.1f} float32 ulps (2^-24 of its value) from the reference"
        return f"ok: within {worst:.1f} ulps"
    return check


def cases(args) -> list[Case]:
    from k3backend import kernels
    from k3backend.engine.sampler import Sampler, SamplingRow, _top_ks
    from k3backend.engine.sampling_params import SamplingParams
    from k3backend.kernels import sample, sample_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    V, sizes = (3000, [1, 5]) if args.smoke else (VOCAB, [1, 16, 64, 256])
    out: list[Case] = []
    for S in sizes:
        probs = torch.softmax(torch.randn(S, V, generator=g, device=device).bfloat16().float() * 3, dim=-1)
        seeds = torch.randint(-2**63, 2**63 - 1, (S,), generator=g, device=device)
        steps = torch.randint(0, 4096, (S,), generator=g, device=device)
        a = (probs, seeds, steps)
        out.append(Case("sample", "race_draw", f"S{S} V{V}", run=lambda a=a: sample.race_draw(*a),
                        ref=lambda a=a: sample_ref.race_draw(*a), bytes=S * V * 4,
                        check=_ids_equal(lambda a=a: sample.race_draw(*a), lambda a=a: sample_ref.race_draw(*a))))

    for S in sizes:  # from the model's bf16 logits: the reference converts them and divides first
        logits = (torch.randn(S, V, generator=g, device=device) * 3).bfloat16()
        a = (logits, torch.full((S,), 0.8, device=device))
        run, ref = (lambda a=a: sample.softmax_rows(*a)), (lambda a=a: sample_ref.softmax_rows(*a))
        out.append(Case("sample", "softmax_rows", f"S{S} V{V}", run=run, ref=ref, bytes=S * V * 8,
                        check=_probs_close(run, ref)))

    for S in sizes:  # peaky rows (logits of scale 3 at temperature 0.8), and flat ones (scale 0.5): most ids in play
        peaky = torch.softmax(torch.randn(S, V, generator=g, device=device).bfloat16().float() * 3 / 0.8, dim=-1)
        flat = torch.softmax(torch.randn(S, V, generator=g, device=device).bfloat16().float() * 0.5, dim=-1)
        for tag, ks, probs in (("top_p0.9", [V] * S, peaky), ("top_k50_top_p0.9", [50] * S, peaky),
                               ("top_p0.9_flat", [V] * S, flat)):
            a = (probs, ks, [0.9] * S)
            run, ref = (lambda a=a: sample.top_k_top_p(*a)), (lambda a=a: sample_ref.top_k_top_p(*a))
            out.append(Case("sample", f"top_k_top_p/{tag}", f"S{S} V{V}", run=run, ref=ref, bytes=S * V * 8,
                            graph=False, check=_probs_equal(run, ref)))

    sampler = Sampler()

    def before(logits: torch.Tensor, rows: list) -> list[int]:
        """The draw as it was: every row sorted (top-k / top-p even when they keep everything), the
        reference draw."""
        x = logits.float()
        p = [r.params for r in rows]
        temp = torch.tensor([q.temperature for q in p], device=x.device)[:, None]
        with kernels.reference_ops():
            probs = kernels.top_k_top_p(torch.softmax(x / temp, dim=-1), _top_ks(p, x.shape[1]), [q.top_p for q in p])
            ids = kernels.race_draw(probs, torch.tensor([r.seed for r in rows], device=x.device),
                                    torch.tensor([r.step for r in rows], device=x.device))
        return ids.tolist()

    modes = {"temperature": dict(temperature=1.0), "top_p0.9": dict(temperature=0.8, top_p=0.9),
             "top_k50": dict(temperature=0.8, top_k=50), "greedy": dict(temperature=0.0),
             "top_p0.9_flat": dict(temperature=0.8, top_p=0.9)}
    for S in sizes:
        logits = (torch.randn(S, V, generator=g, device=device) * 3).bfloat16()
        flat = (torch.randn(S, V, generator=g, device=device) * 0.5).bfloat16()
        for mode, kw in modes.items():
            x = flat if mode.endswith("_flat") else logits
            rows = [SamplingRow(SamplingParams(max_tokens=64, seed=i, **kw), seed=i, step=17) for i in range(S)]
            run = lambda x=x, r=rows: sampler(x, r).token_ids  # noqa: E731
            ref = (lambda x=x, r=rows: before(x, r)) if mode != "greedy" else None
            out.append(Case("sample", f"sampler/{mode}", f"S{S} V{V}", run=run, ref=ref, graph=False,
                            check=_ids_equal(run, ref) if ref else None))
    return out
