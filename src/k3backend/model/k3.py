"""The whole K3 model: language model plus (for kimi_k3 checkpoints) vision tower and projector.

Image embeddings overwrite the text embeddings at the `<|media_pad|>` positions (K3_VISION.md §6.4).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from k3backend.config import K3Config
from k3backend.model.cache import ForwardBatch, SequenceCache
from k3backend.model.lm import K3ForCausalLM


class K3Model(nn.Module):
    """`model(input_ids)` → logits [T, V]; `model(input_ids, images=[PIL.Image, ...])` for prompts whose
    placeholders are already expanded (one `<|media_pad|>` position per image token)."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.language_model = K3ForCausalLM(cfg.text)
        self.vision = None
        if cfg.vision is not None:
            from k3backend.model.vision import K3VisionModel

            self.vision = K3VisionModel(cfg.vision)
        self.preprocess_cfg = None  # set by the loader from preprocessor_config.json

    def new_cache(self) -> SequenceCache:
        return self.language_model.new_cache()

    def encode_images(self, images: Sequence) -> torch.Tensor:
        """PIL images → projector rows [Σ N_i, H], in image order then merged-token order."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (model_type kimi_linear)")
        from k3backend.model.preprocess import PreprocessConfig, preprocess_image

        cfg = self.preprocess_cfg or PreprocessConfig()
        processed = [preprocess_image(im, cfg) for im in images]
        return torch.cat(self.vision.encode_images(processed), dim=0)

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [T, H] with image rows written over the media-pad positions."""
        x = self.language_model.model.embed_tokens(input_ids)
        mask = input_ids == self.cfg.media_placeholder_token_id
        n = int(mask.sum())
        rows = 0 if image_embeds is None else image_embeds.shape[0]
        if n != rows:
            raise ValueError(f"the prompt has {n} image pad positions but the images give {rows} embeddings")
        if rows:
            x = x.clone()
            x[mask] = image_embeds.to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None, *, images: Sequence | None = None,
                image_embeds: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        if images:
            image_embeds = self.encode_images(images)
        x = self.embed(input_ids, image_embeds)
        return self.language_model(batch=batch, inputs_embeds=x, logits_rows=logits_rows)
