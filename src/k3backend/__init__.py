"""k3backend: Kimi-K3 in PyTorch, served from Triton Inference Server."""

from k3backend.config import ConfigError, K3Config, TextConfig, VisionConfig

__all__ = ["ConfigError", "K3Config", "TextConfig", "VisionConfig", "load_model"]


def load_model(path, *, dtype=None, device="cpu", progress: bool = True):
    """Load a K3 / Kimi-Linear checkpoint directory as an `nn.Module` (default dtype float32).

    `model(input_ids)` with a 1-D LongTensor returns logits [T, vocab] (full forward, no cache);
    `model(input_ids, images=[PIL.Image, ...])` for prompts whose placeholders are expanded.
    """
    from k3backend.checkpoint import load_model as _load

    return _load(path, dtype=dtype, device=device, progress=progress)
