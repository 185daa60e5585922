"""Tensor and expert parallelism of the K3 layers (K3_LM.md §9): who holds which shard, and the
collectives, which layers call explicitly in their `forward`.

One TP group of `tp_size` ranks shards attention heads, the dense MLP, the shared experts and the
vocabulary; the MoE splits the same ranks into `ep_size` expert groups of `tp_size / ep_size`
ranks (moe-TP) each: rank r holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep) and the
intermediate slice moe_tp_rank of each. Replicated modules (norms, routers, MLA's latent
projections, the latent down/up projections) compute the same values on every rank. The
reductions are exactly §9.3's: after the embedding, after every o_proj, after the dense
down_proj, one for [routed latent | shared] per MoE layer, and an all-gather of the logits.

Placement `host_ep` (`hosts` > 1, docs/deployment.md): the TP group is one host's `tp_size`
ranks, and `hosts` such groups compute the same attention, dense MLP, shared experts and
vocabulary for every token (replicated across hosts). Only the routed experts span hosts: expert
group `host` of `ep_size == hosts` lives on host `host`, moe-TP over that host's TP group. The MoE
reduction is then the one collective over `world_group` (all hosts' ranks); every other one stays
inside the host.

With one rank every collective is a no-op, so the single-process model is the same code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def packed_rows(param: str, parts: Sequence[tuple[str, int]]) -> dict[str, tuple[str, int, int]]:
    """A module's `packing()`: checkpoint tensors (name, rows on this rank) stacked in order into the
    one parameter `param` -> name: (param, first row, end row)."""
    ends = list(itertools.accumulate(n for _, n in parts))
    return {name: (param, end - n, end) for (name, n), end in zip(parts, ends)}


class ParallelConfigError(ValueError):
    """A config whose heads, experts or widths do not divide over the ranks: the load fails, naming them."""


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the TP group. `group` is the torch.distributed group (None: one rank).

    hosts > 1 (placement host_ep): `group` is this host's TP group, replicated on each of `hosts`
    hosts; this is host `host`, holding expert group `host` (ep_size must equal hosts); the MoE
    reduces over `world_group`, all hosts' ranks (None: torch.distributed's default group)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    group: Any = None
    hosts: int = 1
    host: int = 0
    world_group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ParallelConfigError(f"tensor parallel rank {self.tp_rank} of size {self.tp_size}")
        if self.hosts > 1:
            if self.ep_size != self.hosts or not 0 <= self.host < self.hosts:
                raise ParallelConfigError(f"placement host_ep needs expert_parallel_size {self.ep_size} == nnodes "
                                          f"{self.hosts} (host {self.host})")
        elif self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ParallelConfigError(f"expert_parallel_size {self.ep_size} must divide tensor_parallel_size "
                                      f"{self.tp_size}")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size if self.hosts > 1 else self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.host if self.hosts > 1 else self.tp_rank // self.moe_tp_size

    # ---- shard arithmetic (construction and loading) ---------------------------------------------

    def split(self, n: int, what: str, ways: int | None = None) -> int:
        """n / ways (default tp_size), or ParallelConfigError naming `what` when it does not divide."""
        ways = self.tp_size if ways is None else ways
        if n % ways:
            raise ParallelConfigError(f"{what} = {n} is not divisible by {ways} "
                                      f"(tensor_parallel_size {self.tp_size * self.hosts}, expert_parallel_size "
                                      f"{self.ep_size}{', placement host_ep' if self.hosts > 1 else ''})")
        return n // ways

    def tp_range(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of n items split over the TP group."""
        m = self.split(n, what)
        return self.tp_rank * m, (self.tp_rank + 1) * m

    # ---- collectives (called in forward) ---------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, *, moe: bool = False) -> torch.Tensor:
        """Sum of every rank's x, in place (the partial outputs of a row-parallel layer). moe: over the
        MoE's ranks, which are every host's under host_ep (see `moe_share`)."""
        if moe and self.hosts > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.world_group)
        elif self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, proj: torch.nn.Module, x: torch.Tensor, adds: Sequence[torch.Tensor] = (),
                     gate: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel projection (of x ⊙ σ(gate) with a gate) summed over the ranks, then `adds` in turn
        (the layer's residual). With one rank there is nothing to sum, and the adds ride in the projection
        (`Linear`'s epilogue)."""
        if self.tp_size == 1:
            return proj(x, adds, gate)
        return add_in_turn(self.all_reduce(proj(x, (), gate)), adds)

    @property
    def moe_reduces(self) -> bool:
        """Whether the MoE's all-reduce sums anything: more than one rank holds a share of its experts."""
        return self.tp_size > 1 or self.hosts > 1

    def all_reduce_pair(self, a: torch.Tensor, b: torch.Tensor, *,
                        moe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sums in ONE all-reduce of [a | b] (the MoE's routed latent and shared partials, §9.3 item 4)."""
        if not (self.moe_reduces if moe else self.tp_size > 1):
            return a, b
        both = self.all_reduce(torch.cat([a, b], dim=-1), moe=moe)
        return both[..., :a.shape[-1]], both[..., a.shape[-1]:]

    def moe_share(self, x: torch.Tensor) -> torch.Tensor:
        """A host-replicated partial (the shared experts') as this host's share of the MoE's world
        all-reduce: every host adds the same partial, so each adds 1/hosts of it. Dividing by a power
        of two is exact; for other host counts it rounds (one ulp of the shared output)."""
        return x / self.hosts if self.hosts > 1 else x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = Parallel()


def add_in_turn(y: torch.Tensor, adds: Sequence[torch.Tensor]) -> torch.Tensor:
    """y + adds[0] + adds[1] ..., rounding after each add (the residual adds of a layer that the
    projection's epilogue does not take)."""
    for a in adds:
        y = y + a
    return y


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [v0, v1) of the embedding table on this rank; a masked lookup and an all-reduce."""

    def __init__(self, vocab: int, dim: int, par: Parallel) -> None:
        super().__init__()
        self.par = par
        self.v0, self.v1 = par.tp_range(vocab, "vocab_size")
        self.weight = torch.nn.Parameter(torch.zeros(self.v1 - self.v0, dim))

    def shards(self) -> dict[str, tuple[int, int, int]]:
        return {"weight": (0, self.v0, self.v1)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        mine = (ids >= self.v0) & (ids < self.v1)
        x = torch.nn.functional.embedding((ids - self.v0) * mine, self.weight) * mine[:, None]
        return self.par.all_reduce(x)  # disjoint shards: the sum is exact (§9.3 item 1)
