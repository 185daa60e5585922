"""Batched sampling on the device (SERVING.md §5.4, §5.10): one pass over the step's [S, V] logits.

Every step of [SMP-6] runs for all rows at once (masks, penalties, temperature, top-k, top-p,
min-p, the exponential-race draw), with per-row parameters as tensors; `engine/sampler_ref.py`
defines the same function for one row, and the tests hold the two to the same tokens. The draw's
uniforms are a counter-based hash of (seed, output position, token id), so a seeded request's
tokens do not depend on what else is in the batch ([SMP-7]). Log-probabilities are computed only
for rows that ask ([LP-4]); ids and log-probs reach the host in one copy, the step's one sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3backend import kernels
from k3backend.engine.batch import to_device
from k3backend.engine.request import TokenLogprob
from k3backend.engine.sampling_params import SamplingParams

@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one request this step.

    seed: int64 draw seed; step: the output position of the token being drawn; banned: ids masked
    this step ([STP-6], min_tokens); prompt_ids/output_ids: only needed by penalties.
    """

    params: SamplingParams
    seed: int
    step: int
    banned: tuple[int, ...] = ()
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    @property
    def has_penalties(self) -> bool:
        return self.params.reads_prompt or bool(self.output_ids and self.params.reads_output)


@dataclass
class Sampled:
    """A step's sampled ids (and the log-probs the rows asked for), on the host."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class DeviceSample:
    """A step's draw before the host has it: `ids` [S] stay on the device (the next step's decode
    inputs, ENGINE.md §8); `result()` waits for the one copy to the host (the step's one sync)."""

    ids: torch.Tensor
    packed: torch.Tensor  # ids, then per log-prob row: value, rank, top ids, top values (float64)
    done: torch.cuda.Event | None  # recorded after the copy into the pinned `packed`
    lp_rows: list[int]
    ks: list[int]  # log-probs asked for by each of lp_rows
    kmax: int = 0

    def result(self) -> Sampled:
        if self.done is not None:
            self.done.synchronize()
        n = len(self.ids)
        if not self.lp_rows:
            return Sampled(self.packed.tolist(), [None] * n)
        flat = self.packed.tolist()
        host_ids, host = [int(t) for t in flat[:n]], flat[n:]
        out: list[TokenLogprob | None] = [None] * n
        width = 2 + 2 * self.kmax
        for j, (i, k) in enumerate(zip(self.lp_rows, self.ks)):
            vals = host[j * width:(j + 1) * width]
            top = [(int(t), float(lv)) for t, lv in zip(vals[2:2 + self.kmax][:k], vals[2 + self.kmax:][:k])]
            out[i] = TokenLogprob(host_ids[i], vals[0], int(vals[1]), top)
        return Sampled(host_ids, out)


class Sampler:
    """Stateless apart from the device; `__call__` is the whole of [SMP-6] for a batch."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Sampled:
        """logits: [S, V] (any float dtype, on the device) for the S rows in order."""
        return self.launch(logits, rows).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """The draw queued on the device, its copy to the host started; nothing waits for it."""
        exact = logits.dtype in (torch.bfloat16, torch.float16, torch.float32)  # float32 holds these exactly
        if exact and not any(r.banned or r.has_penalties for r in rows):
            x = logits  # read as they are: the kernels below take float32 of them, without a copy
        else:
            x = self._penalize(self._mask(logits.float(), rows), rows)
        ids = torch.argmax(x, dim=-1)  # greedy rows: the first maximum, ties to the lowest id
        idx = [i for i, r in enumerate(rows) if not r.params.greedy]  # drawn together: one launch of each kernel
        if idx and idx[-1] - idx[0] == len(idx) - 1:  # consecutive rows (all drawn, typically): slices, no gather
            ids[idx[0]:idx[-1] + 1] = self._draw(x[idx[0]:idx[-1] + 1], rows[idx[0]:idx[-1] + 1])
        elif idx:
            t = to_device(idx, torch.long, x.device)
            ids.index_copy_(0, t, self._draw(x.index_select(0, t), [rows[i] for i in idx]))
        return self._to_host(logits, ids, rows)

    # ---- [SMP-6] steps --------------------------------------------------------------------------

    @staticmethod
    def _mask(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 1: -inf at every (row, banned id)."""
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned]
        if not pairs:
            return x
        r, t = to_device(pairs, torch.long, x.device).unbind(1)
        return x.index_put((r, t), torch.full((), float("-inf"), device=x.device))

    @staticmethod
    def _penalize(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 2: repetition over prompt + output ids, frequency and presence over output ids."""
        pen = [i for i, r in enumerate(rows) if r.has_penalties]
        if not pen:
            return x
        x = x.clone()
        dev, V = x.device, x.shape[1]
        pen_t = to_device(pen, torch.long, dev)
        sub = x.index_select(0, pen_t)
        rep = [r.params.repetition_penalty for r in (rows[i] for i in pen)]
        if any(v != 1.0 for v in rep):
            seen = torch.zeros_like(sub, dtype=torch.bool)
            for j, i in enumerate(pen):
                seen[j, to_device(list(rows[i].prompt_ids) + list(rows[i].output_ids), torch.long, dev)] = True
            r = to_device(rep, sub.dtype, dev)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        counts = torch.zeros_like(sub)
        for j, i in enumerate(pen):
            out = to_device(list(rows[i].output_ids), torch.long, dev)
            counts[j].index_add_(0, out, torch.ones(len(out), dtype=sub.dtype, device=dev))
        fq = to_device([(rows[i].params.frequency_penalty, rows[i].params.presence_penalty) for i in pen],
                       sub.dtype, dev)
        sub = torch.where(counts > 0, sub - (fq[:, :1] * counts + fq[:, 1:]), sub)
        x.index_copy_(0, pen_t, sub)
        assert x.shape[1] == V
        return x

    @staticmethod
    def _draw(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Steps 4-8 for sampled rows: filtered probabilities, then argmax_i p_i / E_i."""
        dev = x.device
        p = [r.params for r in rows]
        temps, min_ps = to_device([[q.temperature for q in p], [q.min_p for q in p]], torch.float32, dev)
        seeds, steps = to_device([[r.seed for r in rows], [r.step for r in rows]], torch.int64, dev)
        probs = kernels.softmax_rows(x, temps)
        probs = Sampler._top_k_top_p(probs, p)
        if any(q.min_p > 0 for q in p):
            floor = min_ps[:, None] * probs.max(-1, keepdim=True).values
            probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
        return kernels.race_draw(probs, seeds, steps)

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, p: Sequence[SamplingParams]) -> torch.Tensor:
        """Steps 5-6 (ties to the lower id): zeros past top-k and top-p; on a GPU without a sort of
        the vocabulary (`kernels.top_k_top_p`). probs itself where no row cuts."""
        ks, top_ps = _top_ks(p, probs.shape[1]), [q.top_p for q in p]
        if all(k == probs.shape[1] for k in ks) and all(t >= 1.0 for t in top_ps):
            return probs
        return kernels.top_k_top_p(probs, ks, top_ps)

    # ---- log-probs and the one host copy --------------------------------------------------------

    @staticmethod
    def _to_host(logits: torch.Tensor, ids: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """[LP-1]..[LP-3] for the rows that ask, packed with the ids into one tensor whose copy to
        pinned host memory is started here (float64 with log-probs: ids < 2**53 stay exact)."""
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        ks = [rows[i].params.logprobs for i in lp_rows]
        kmax = max(ks, default=0)
        if not lp_rows:
            packed = ids
        else:
            lp = torch.log_softmax(logits[lp_rows].float(), dim=-1)  # raw logits: before penalties ([LP-1])
            tok = ids[lp_rows][:, None]
            v = lp.gather(1, tok)
            lower = torch.arange(lp.shape[1], device=lp.device)[None, :] < tok
            rank = 1 + (lp > v).sum(1, keepdim=True) + ((lp == v) & lower).sum(1, keepdim=True)
            top_v, top_i = torch.sort(lp, dim=-1, descending=True, stable=True)
            lp_packed = torch.cat([v.double(), rank.double(), top_i[:, :kmax].double(), top_v[:, :kmax].double()], 1)
            packed = torch.cat([ids.double(), lp_packed.flatten()])
        done = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            packed, done = host, torch.cuda.Event()
            done.record()
        return DeviceSample(ids, packed, done, lp_rows, ks, kmax)


def _top_ks(p: Sequence[SamplingParams], V: int) -> list[int]:
    """Each row's top-k ([SMP-6] step 5), V where it keeps every id (0, or not below V)."""
    return [q.top_k if 0 < q.top_k < V else V for q in p]
