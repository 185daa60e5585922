"""MoonViT3d vision tower and PatchMergerMLPV2 projector (K3_VISION.md §4, §5).

`K3VisionModel` has children `vision_tower` and `mm_projector`, so its state_dict keys are the
checkpoint names of §5 and load with no renames.

Shape legend: L = patches of all images (Σ t·h·w), d = vt_hidden_size, H = heads,
D = head_dim, N = merged tokens of all images (Σ h·w/4), E = text_hidden_size.

Images are packed along L and never mix: position tables, RoPE, attention and the merge are
applied per image; every other op is row-wise.

dtypes: matmuls run in the module dtype (bf16 in serving); RMSNorm statistics and RoPE are
fp32, or fp64 when the module is fp64 (used for exact comparisons in tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend

from k3backend.config import VisionConfig

if TYPE_CHECKING:
    from k3backend.model.preprocess import ProcessedImage

Grid = tuple[int, int, int]  # (t, h, w) in 14-px patches

TOWER_NORM_EPS = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None) on torch >= 2.7 (§4.5)
ROPE_THETA = 10000  # hard-coded in SGLang and HF (§1.1)
ROPE_MAX_SIDE = 512  # RoPE table is 512 x 512 patches (§4.7)
# Scores ([heads, query rows, keys]) one math-path attention call may hold: 256 MiB in fp32.
ATTENTION_BLOCK_SCORES = 1 << 26


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for RMSNorm statistics and RoPE (§4.5, §4.7), unless the module runs in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · γ, all in fp32 and cast back (matches `nn.RMSNorm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        md = _math_dtype(x.dtype)
        xm = x.to(md)
        y = xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(md)
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# §4.1-4.3 patch embedding and the learnable position table
# ---------------------------------------------------------------------------------------------


def sincos_time_table(t: int, dim: int, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """T [t, dim]: T[τ] = [sin(τ·ω_k) for k < dim/2, cos(τ·ω_k) for k < dim/2], ω_k = 10000^(-k/(dim/2)).

    Fixed, not in the checkpoint (§4.3.4). Computed in fp32 as the reference does (fp64 for an fp64
    module), then cast to the position table's dtype as SGLang does.
    """
    md = _math_dtype(dtype)
    omega = torch.arange(dim // 2, dtype=md, device=device) / (dim / 2.0)
    omega = 1.0 / 10000**omega  # [dim/2]
    angle = torch.outer(torch.arange(t, dtype=md, device=device), omega)  # [t, dim/2]
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(dtype)


class PosEmbDividedFixed(nn.Module):
    """Learnable [H0, W0, d] table resized to each grid, plus the sin-cos time table (§4.3)."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, mode: str) -> None:
        super().__init__()
        self.num_frames, self.mode = num_frames, mode
        # N(0, 1) as in the reference; randn, not normal_, which on "meta" imports torch._dynamo (6 s).
        self.weight = nn.Parameter(torch.randn(height, width, dim))

    def table_2d(self, h: int, w: int) -> Tensor:
        """[h·w, d], row-major (i·w + j) like the patches; interpolated in the weight dtype."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        p = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, d, H0, W0]
        p = F.interpolate(p, size=(h, w), mode=self.mode, align_corners=False)  # [1, d, h, w]
        return p.squeeze(0).permute(1, 2, 0).flatten(0, 1)

    def forward(self, grids: Sequence[Grid]) -> Tensor:
        """Position rows for all images, frames τ-major: [L, d]."""
        rows = []
        for t, h, w in grids:
            pos = self.table_2d(h, w)  # [h·w, d]
            if t > 1:  # frame 0 of a video is shifted too: T[0] = [0…, 1…]
                time = sincos_time_table(t, pos.shape[-1], pos.dtype, pos.device)  # [t, d]
                pos = (pos.unsqueeze(0) + time.unsqueeze(1)).flatten(0, 1)  # [t·h·w, d]
            rows.append(pos)
        return torch.cat(rows)


class PatchEmbed(nn.Module):
    """Conv2d(3 → d, kernel = stride = patch, no bias) on each patch, then + position (§4.1, §4.3)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PosEmbDividedFixed(cfg.init_pos_emb_height, cfg.init_pos_emb_width,
                                          cfg.init_pos_emb_time, cfg.vt_hidden_size,
                                          cfg.pos_emb_interpolation_mode)

    def forward(self, pixel_values: Tensor, grids: Sequence[Grid]) -> Tensor:
        # pixel_values are quantised to the module dtype before the conv, as in SGLang (§2.7).
        w = self.proj.weight
        x = self.proj(pixel_values.to(device=w.device, dtype=w.dtype))  # [L, d, 1, 1]
        return x.flatten(1) + self.pos_emb(grids)  # [L, d]


# ---------------------------------------------------------------------------------------------
# §4.7 2-D RoPE
# ---------------------------------------------------------------------------------------------


def rope_2d_freqs(grids: Sequence[Grid], head_dim: int, dtype: torch.dtype,
                  device: torch.device | None = None) -> Tensor:
    """cis(φ) [L, D/2] (complex64, complex128 for fp64): pair 2k turns by c·θ_k, pair 2k+1 by r·θ_k.

    θ_k = 10000^(-4k/D); (r, c) is the patch's row and column in its image, the same for every
    frame. Even pairs take the column, odd pairs the row: the reference code, not its docstring.
    """
    md = _math_dtype(dtype)
    theta = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, dtype=md, device=device) / head_dim)  # [D/4]
    out = []
    for t, h, w in grids:
        r = torch.arange(h, dtype=md, device=device).repeat_interleave(w)  # [h·w] row of patch i·w+j
        c = torch.arange(w, dtype=md, device=device).repeat(h)  # [h·w] column
        phi = torch.stack([torch.outer(c, theta), torch.outer(r, theta)], dim=-1).flatten(1)  # [h·w, D/2]
        out.append(torch.polar(torch.ones_like(phi), phi).repeat(t, 1))  # [t·h·w, D/2]
    return torch.cat(out)


def apply_rope_2d(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """x [L, H, D] with adjacent pairs (x[2m], x[2m+1]) as complex z_m; returns z_m·cis(φ_m) [L, H, D]."""
    z = torch.view_as_complex(x.to(_math_dtype(x.dtype)).unflatten(-1, (-1, 2)))  # [L, H, D/2]
    return torch.view_as_real(z * freqs_cis.unsqueeze(1)).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# §4.4-4.9 encoder
# ---------------------------------------------------------------------------------------------


class MLP2(nn.Module):
    """fc1(GELU_tanh(fc0(x))), no biases (§4.8)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    """Pre-norm block: x += Attn(norm0(x)); x += MLP(norm1(x)) (§4.4)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.vt_hidden_size
        self.n_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(d, TOWER_NORM_EPS)
        self.wqkv = nn.Linear(d, 3 * cfg.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(cfg.qkv_hidden_size, d, bias=False)
        self.norm1 = RMSNorm(d, TOWER_NORM_EPS)
        self.mlp = MLP2(d, cfg.vt_intermediate_size)

    def forward(self, x: Tensor, freqs_cis: Tensor, seqlens: list[int]) -> Tensor:
        x = x + self.attention(self.norm0(x), freqs_cis, seqlens)
        return x + self.mlp(self.norm1(x))

    def attention(self, x: Tensor, freqs_cis: Tensor, seqlens: list[int]) -> Tensor:
        """softmax(q·kᵀ/√D)·v per image and head; no mask inside an image, nothing across (§4.6)."""
        qkv = self.wqkv(x).unflatten(-1, (3, self.n_heads, self.head_dim))  # [L, 3, H, D]
        q, k, v = qkv.unbind(1)  # [L, H, D] each
        q, k = apply_rope_2d(q, freqs_cis), apply_rope_2d(k, freqs_cis)
        o = [image_attention(qi, ki, vi) for qi, ki, vi in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))]
        return self.wo(torch.cat(o))  # [L, d]


def image_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q·kᵀ/√D)·v over one image's patches: q, k, v [n, H, D] -> [n, H·D], heads in order (§4.6).

    Memory stays linear in n (a 9000x9000 image resizes to n = 66564 patches; its scores alone
    would be H·n² elements). SDPA gets the 4-D layout [1, H, n, D], the one its fused kernels accept (flash
    on CPU for every float dtype; flash or memory-efficient on CUDA): they never hold the scores.
    Only the math path, SDPA's fallback where no fused kernel applies (e.g. fp64 on CUDA, or with
    fused kernels disabled), materialises them; there the queries go in blocks of at most
    ATTENTION_BLOCK_SCORES scores. Every query row is still one softmax over all keys, and the
    blocks depend only on this image's n, so an image's rows do not depend on the batch [VIS-8].
    """
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
    heads, n = q.shape[1], q.shape[2]
    rows = n if _fused_sdpa(q, k, v) else attention_block_rows(n, heads)
    if rows >= n:
        o = F.scaled_dot_product_attention(q, k, v)  # [1, H, n, D]
    else:
        o = torch.cat([F.scaled_dot_product_attention(qb, k, v) for qb in q.split(rows, dim=2)], dim=2)
    return o[0].transpose(0, 1).flatten(1)  # [n, H·D]


def attention_block_rows(n: int, heads: int) -> int:
    """Query rows per math-path SDPA call: its [heads, rows, n] scores stay within ATTENTION_BLOCK_SCORES."""
    return max(1, min(n, ATTENTION_BLOCK_SCORES // (heads * n)))


def _fused_sdpa(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether SDPA runs a fused kernel on these inputs, i.e. not the math path. Asks SDPA's own
    dispatcher (which honours `torch.nn.attention.sdpa_kernel`); without it, assume the math path."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    return choice is not None and choice(q, k, v) != SDPBackend.MATH.value


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, TOWER_NORM_EPS)

    def forward(self, x: Tensor, grids: Sequence[Grid]) -> Tensor:
        freqs_cis = rope_2d_freqs(grids, self.blocks[0].head_dim, x.dtype, x.device)  # [L, D/2], shared by all layers
        seqlens = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, freqs_cis, seqlens)
        return self.final_layernorm(x)  # [L, d]


# ---------------------------------------------------------------------------------------------
# §4.10 merge, §4.11 projector
# ---------------------------------------------------------------------------------------------


def tpool_patch_merger(x: Tensor, grids: Sequence[Grid], kernel: tuple[int, int] = (2, 2)) -> Tensor:
    """[L, d] -> [N, kh·kw, d]: mean over frames, then each kh×kw window becomes one token (§4.10).

    Token I·(w/kw) + J holds rows (2I+a, 2J+b) in the order (a, b) = (0,0), (0,1), (1,0), (1,1).
    """
    kh, kw = kernel
    out = []
    for seq, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
        v = seq.view(t, h // kh, kh, w // kw, kw, -1).mean(dim=0)  # [h/kh, kh, w/kw, kw, d]
        out.append(v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
    return torch.cat(out)


class MoonViT3d(nn.Module):
    """The vision tower (`vision_tower.*`): patches of packed images -> merged tokens."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixel_values: Tensor, grid_thws: Sequence[Grid] | Tensor) -> Tensor:
        """pixel_values [L, 3, p, p], one (t, h, w) per image -> [N, 4, d]."""
        grids = _check_inputs(self.cfg, pixel_values, grid_thws)
        x = self.patch_embed(pixel_values, grids)  # [L, d]
        x = self.encoder(x, grids)  # [L, d]
        return tpool_patch_merger(x, grids, self.cfg.merge_kernel_size)  # [N, 4, d]


class PatchMergerMLPV2(nn.Module):
    """`mm_projector`: RMSNorm(Linear(GELU_erf(Linear(u)))) on u = the 4 sub-vectors concatenated (§4.11).

    No pre-norm and no biases (unlike K2.5's projector); post-norm eps = projector_ln_eps.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kh, kw = cfg.merge_kernel_size
        merged = cfg.mm_hidden_size * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=False),
            nn.GELU(),  # exact erf GELU, unlike the tower's tanh GELU
            nn.Linear(merged, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)

    def forward(self, x: Tensor) -> Tensor:
        u = x.flatten(1)  # [N, 4·d]: u[k·d + i] = sub-vector k, dim i
        z = self.proj[2](self.proj[1](self.proj[0](u)))  # [N, E]
        return self.post_norm(z)


class K3VisionModel(nn.Module):
    """Tower + projector: pixels of packed images -> rows that replace `<|media_pad|>` embeddings."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT3d(cfg)
        self.mm_projector = PatchMergerMLPV2(cfg)

    def forward(self, pixel_values: Tensor, grid_thws: Sequence[Grid] | Tensor) -> Tensor:
        """pixel_values [L, 3, p, p] (images concatenated in order), grid_thws one (t, h, w) per
        image -> [Σ h·w/4, text_hidden_size], images in order, merged tokens row-major."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def encode_images(self, processed: Sequence[ProcessedImage]) -> list[Tensor]:
        """One [h·w/4, text_hidden_size] tensor per image, all images run as one packed batch."""
        if not processed:
            return []
        pixel_values = torch.cat([p.pixel_values for p in processed])
        grids = [p.grid_thw for p in processed]
        out = self(pixel_values, grids)
        kh, kw = self.cfg.merge_kernel_size
        return list(out.split([h // kh * (w // kw) for _, h, w in grids]))


def _check_inputs(cfg: VisionConfig, pixel_values: Tensor, grid_thws: Sequence[Grid] | Tensor) -> list[Grid]:
    """Validate on the host (the grids are small Python ints) and return the grids as tuples. A tensor
    of grids must be on the CPU: reading one from the device would wait for it (ENGINE.md §9)."""
    if isinstance(grid_thws, Tensor) and grid_thws.device.type != "cpu":
        raise ValueError(f"grid_thws: host ints expected (a list of (t, h, w) or a CPU tensor), got a tensor on "
                         f"{grid_thws.device}")
    grids_raw = grid_thws.tolist() if isinstance(grid_thws, Tensor) else grid_thws
    grids = [tuple(int(v) for v in g) for g in grids_raw]
    p, (kh, kw) = cfg.patch_size, cfg.merge_kernel_size
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
        raise ValueError(f"pixel_values: expected [L, 3, {p}, {p}], got {list(pixel_values.shape)}")
    if not grids:
        raise ValueError("grid_thws: expected at least one (t, h, w)")
    for i, g in enumerate(grids):
        if len(g) != 3:
            raise ValueError(f"grid_thws[{i}]: expected (t, h, w), got {g}")
        t, h, w = g
        if not 1 <= t <= cfg.init_pos_emb_time:
            raise ValueError(f"grid_thws[{i}]: t={t} outside 1..init_pos_emb_time {cfg.init_pos_emb_time}")
        if not (1 <= h <= ROPE_MAX_SIDE and 1 <= w <= ROPE_MAX_SIDE):
            raise ValueError(f"grid_thws[{i}]: h={h}, w={w} outside 1..{ROPE_MAX_SIDE} (RoPE table)")
        if h % kh or w % kw:
            raise ValueError(f"grid_thws[{i}]: h={h}, w={w} not divisible by merge kernel {kh}x{kw}")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"pixel_values: {pixel_values.shape[0]} patches, grid_thws need Σ t·h·w = {total}")
    return grids
