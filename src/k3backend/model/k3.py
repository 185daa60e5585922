"""The whole K3 model: language model plus (for kimi_k3 checkpoints) vision tower and projector.

Image embeddings overwrite the text embeddings at the `<|media_pad|>` positions (K3_VISION.md §6.4).
`k3backend.generate.full_forward` runs one fresh sequence (prompt and images) without an engine.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from k3backend.config import K3Config
from k3backend.model.cache import CachePools, ForwardBatch
from k3backend.model.lm import K3ForCausalLM
from k3backend.model.parallel import SINGLE, Parallel


class K3Model(nn.Module):
    """`model(batch, pools)` -> logits [S, V] of the batch's logits rows; image rows (`batch.mm_embeds`,
    from `encode_images` or k3_vision) replace the embeddings of their media-pad positions."""

    def __init__(self, cfg: K3Config, par: Parallel = SINGLE, *, vision: bool = True) -> None:
        """par: this rank's shards of the language model; vision=False leaves the tower out (workers)."""
        super().__init__()
        self.cfg = cfg
        self.language_model = K3ForCausalLM(cfg.text, par)
        self.vision = None
        if cfg.vision is not None and vision:
            from k3backend.model.vision import K3VisionModel

            self.vision = K3VisionModel(cfg.vision)
        self.preprocess_cfg = None  # set by the loader from preprocessor_config.json

    def encode_images(self, images: Sequence) -> torch.Tensor:
        """PIL images → projector rows [Σ N_i, H], in image order then merged-token order."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (model_type kimi_linear)")
        from k3backend.model.preprocess import PreprocessConfig, preprocess_image

        cfg = self.preprocess_cfg or PreprocessConfig()
        processed = [preprocess_image(im, cfg) for im in images]
        return torch.cat(self.vision.encode_images(processed), dim=0)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Token embeddings [T, H] with the batch's image rows written over their positions."""
        x = self.language_model.model.embed_tokens(batch.input_ids)
        if batch.mm_positions is not None:
            x = x.index_copy(0, batch.mm_positions, batch.mm_embeds.to(x.dtype))
        return x

    def forward(self, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        return self.language_model(batch, pools, inputs_embeds=self.embed(batch))
