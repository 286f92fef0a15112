"""A minimal image tower in OpenAI-CLIP layout (``visual.*`` keys), plus a linear head.

The parameter names are those of OpenAI's ``clip.model.VisionTransformer`` — ``conv1.weight``,
``class_embedding``, ``positional_embedding``, ``ln_pre``,
``transformer.resblocks.{i}.{attn,ln_1,mlp.c_fc,mlp.c_proj,ln_2}``, ``ln_post``, ``proj`` — so an
OpenAI state dict loads without renaming. The attention is the fused ``nn.MultiheadAttention``
CLIP uses (``in_proj_weight`` holds ``[W_q; W_k; W_v]``), which
:func:`geosharp.symmetry.find_symmetries` splits into one QK and one VO block per layer
(SPEC §3). The MLP uses QuickGELU ``x·σ(1.702 x)``, as CLIP was trained with it.

Example:
    >>> import torch
    >>> vit = OpenAIVisionTransformer(image_size=32, patch_size=8, width=64, layers=2,
    ...                               heads=1, output_dim=16)
    >>> vit(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 16])
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

__all__ = ["CLIPClassifier", "OpenAIVisionTransformer", "QuickGELU", "ResidualAttentionBlock"]


class QuickGELU(nn.Module):
    """CLIP's activation ``x · σ(1.702 x)``."""

    def forward(self, x: Tensor) -> Tensor:
        """Apply the activation.

        Args:
            x: Any tensor.

        Returns:
            ``x · sigmoid(1.702 x)``.
        """
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    """Pre-norm block ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (OpenAI names).

    Args:
        width: Model width ``d``.
        heads: Attention heads (``d`` must be divisible by it).
        mlp_width: Hidden width of the MLP (``4·d`` in CLIP).
    """

    def __init__(self, width: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, mlp_width)),
                    ("gelu", QuickGELU()),
                    ("c_proj", nn.Linear(mlp_width, width)),
                ]
            )
        )
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: Tokens ``(batch, seq, width)``.

        Returns:
            Tokens ``(batch, seq, width)``.
        """
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    """``resblocks``: the stack of :class:`ResidualAttentionBlock` (OpenAI's ``Transformer``)."""

    def __init__(self, width: int, layers: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.resblocks = nn.Sequential(
            *[ResidualAttentionBlock(width, heads, mlp_width) for _ in range(layers)]
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.resblocks(x)


class OpenAIVisionTransformer(nn.Module):
    """CLIP's ViT image encoder: patches, class token, positions, blocks, ``ln_post``, ``proj``.

    Args:
        image_size: Side of the (square) input images (224 for ViT-B/32).
        patch_size: Side of the patches (32 for ViT-B/32).
        width: Model width (768 for ViT-B/32).
        layers: Number of blocks (12).
        heads: Attention heads per block (``width // 64`` in OpenAI CLIP).
        output_dim: Width of the image embedding after ``proj`` (512).
        mlp_width: MLP hidden width (default ``4·width``).

    Raises:
        ValueError: If ``patch_size`` does not divide ``image_size`` or ``heads`` does not
            divide ``width``.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        width: int,
        layers: int,
        heads: int,
        output_dim: int,
        mlp_width: int | None = None,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size={patch_size} does not divide image_size={image_size}")
        if heads < 1 or width % heads:
            raise ValueError(f"heads={heads} does not divide width={width}")
        self.image_size = image_size
        self.patch_size = patch_size
        grid = image_size // patch_size
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(grid * grid + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = _Transformer(width, layers, heads, mlp_width or 4 * width)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    def forward(self, images: Tensor) -> Tensor:
        """Image embeddings (before any normalization).

        Args:
            images: ``(batch, 3, image_size, image_size)``, normalized with CLIP's mean/std
                (see :func:`geosharp.zoo.clip_preprocess`); cast to the weights' dtype.

        Returns:
            ``(batch, output_dim)``.

        Raises:
            ValueError: If the images do not have the size the positional embedding was made
                for.
        """
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, self.image_size, self.image_size):
            raise ValueError(
                f"expected images of shape (batch, 3, {self.image_size}, {self.image_size}), got "
                f"{tuple(images.shape)}; resize and crop them first (geosharp.zoo.clip_preprocess)"
            )
        x = self.conv1(images.to(self.conv1.weight.dtype))  # (N, width, grid, grid)
        x = x.flatten(2).transpose(1, 2)  # (N, grid², width)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x[:, 0, :]) @ self.proj


class CLIPClassifier(nn.Module):
    """CLIP image tower plus a linear head: ``head(f / ‖f‖)`` (or ``head(f)``), ``f = visual(x)``.

    This is the model-soups ``ModelWrapper`` without the text tower: its fine-tunes were trained
    and evaluated with ``normalize=True`` (image features scaled to unit norm before the head).

    Args:
        visual: The image encoder.
        num_classes: Number of logits.
        normalize: Whether the features are scaled to unit norm before the head.
    """

    def __init__(
        self, visual: OpenAIVisionTransformer, num_classes: int, normalize: bool = True
    ) -> None:
        super().__init__()
        self.visual = visual
        self.classification_head = nn.Linear(visual.proj.shape[1], num_classes)
        self.normalize = normalize

    def forward(self, images: Tensor) -> Tensor:
        """Logits.

        Args:
            images: ``(batch, 3, H, W)`` preprocessed images.

        Returns:
            ``(batch, num_classes)`` logits.
        """
        features = self.visual(images)
        if self.normalize:
            features = features / features.norm(dim=-1, keepdim=True)
        return self.classification_head(features)
