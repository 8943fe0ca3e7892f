"""A small Vision Transformer for ``3 × 32 × 32`` images, written so that the fast KWNG
step batches every parameter (:mod:`kwng.engine.replicate`).

:func:`vit`: patches of ``4 × 4`` (a stride-4 convolution: 64 tokens) and a class token,
a learned position embedding, 6 pre-norm blocks of width 192 (3 heads of 64, MLP ratio 4
with GELU), a final layer norm and a linear head on the class token: 2.69 M parameters
for 10 classes. :func:`vit_tiny` (width 16, 2 blocks, 2 heads) is the same network for
the CPU tests.

What the engine needs from a transformer (every parameter in a layer it batches):

* attention from ``nn.Linear`` projections (``qkv``, ``proj``) and the parameter-free
  ``F.scaled_dot_product_attention``, not ``nn.MultiheadAttention`` (whose input
  projection is a bare parameter);
* the class token and the position embedding as
  :class:`kwng.engine.expanded.ExpandedParameter` (called on the batch), not bare
  ``nn.Parameter`` tensors used in ``forward``;
* ``nn.LayerNorm`` and ``nn.Linear`` as they are; no dropout (the replicated forward
  refuses it in training mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kwng._checks import check_int
from kwng.engine.expanded import ExpandedParameter

__all__ = ["Attention", "Block", "ViT", "vit", "vit_tiny"]


class Attention(nn.Module):
    """Multi-head self-attention: one ``nn.Linear`` for queries, keys and values, the
    scaled dot product per head, one ``nn.Linear`` projection out."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, D / heads)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(),
                                 nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding, class token, position embedding, ``depth`` blocks, final layer
    norm, linear head on the class token; logits ``(N, num_classes)``."""

    def __init__(self, num_classes: int = 10, width: int = 192, depth: int = 6,
                 heads: int = 3, mlp_ratio: int = 4, patch: int = 4,
                 image_size: int = 32) -> None:
        super().__init__()
        for name, v in (("num_classes", num_classes), ("width", width),
                        ("depth", depth), ("heads", heads), ("mlp_ratio", mlp_ratio),
                        ("patch", patch)):
            check_int(v, name, 1)
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch "
                             f"{patch}")
        tokens = (image_size // patch) ** 2 + 1
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = ExpandedParameter(1, width)
        self.pos_embed = ExpandedParameter(tokens, width)
        nn.init.trunc_normal_(self.pos_embed.weight, std=0.02)
        nn.init.trunc_normal_(self.cls_token.weight, std=0.02)
        self.blocks = nn.Sequential(*(Block(width, heads, mlp_ratio)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.patch(z).flatten(2).transpose(1, 2)  # (N, tokens - 1, width)
        x = torch.cat([self.cls_token(x), x], 1) + self.pos_embed(x)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(num_classes: int = 10) -> ViT:
    """The study's ViT: patch 4, width 192, depth 6, 3 heads, MLP ratio 4 (2.69 M
    parameters for 10 classes)."""
    return ViT(num_classes)


def vit_tiny(num_classes: int = 10) -> ViT:
    """The same network at width 16, depth 2, 2 heads (for the CPU tests)."""
    return ViT(num_classes, width=16, depth=2, heads=2)
