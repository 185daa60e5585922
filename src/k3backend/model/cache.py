"""Per-sequence decoding state and the batch description every layer receives.

Layers take caches as arguments (they own no state), so the engine can later swap these plain
per-sequence tensors for paged MLA blocks and KDA state slots without touching model math.
K3_LM.md §10 lists what is kept between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KDAState:
    """One KDA layer of one sequence: conv history [W−1, 3P] (raw rows, model dtype), state S [H, K, V] (fp32)."""

    conv: torch.Tensor
    S: torch.Tensor


@dataclass
class MLAState:
    """One MLA layer of one sequence: latent rows [t_cached, r + dr] = [c_kv ; k_pe] (model dtype)."""

    latent: torch.Tensor


@dataclass
class SequenceCache:
    """All layers' state for one sequence, plus how many tokens it has consumed."""

    layers: list[KDAState | MLAState]
    num_tokens: int = 0


@dataclass
class ForwardBatch:
    """Flat token batch: `seq_lens[i]` consecutive tokens belong to sequence i, whose state is `caches[i]`.

    With `caches=None` every sequence starts fresh and nothing is kept (a full forward).
    """

    seq_lens: list[int]
    caches: list[SequenceCache] | None = None

    @classmethod
    def single(cls, num_tokens: int, cache: SequenceCache | None = None) -> "ForwardBatch":
        return cls([num_tokens], None if cache is None else [cache])

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence views of a flat [T, ...] tensor."""
        return list(torch.split(x, self.seq_lens, dim=0))
