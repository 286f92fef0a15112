"""Small transformers for experiments: a ViT and a text classifier sharing one block.

The attention is written out with plain ``matmul``/``softmax`` (no fused SDPA kernel), so
second derivatives — needed by the geodesic sharpness ascent, which differentiates through
the Christoffel term — work on every backend. Q, K, V and O are separate ``nn.Linear`` layers
``q``, ``k``, ``v``, ``o``; :func:`geosharp.symmetry.find_symmetries` recognises them (SPEC §3).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["MLP", "Block", "MultiHeadAttention", "TextTransformer", "VisionTransformer"]


class MultiHeadAttention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with separate Q, K, V, O layers.

    ``y = o(concat_i softmax(q_i k_{j(i)}ᵀ / √h) v_{j(i)})`` where query head ``i`` uses
    key/value head ``j(i) = i // (num_heads / num_kv_heads)``.

    Args:
        dim: Model width ``d``.
        num_heads: Number of query heads.
        head_dim: Head dimension ``h`` (default ``dim // num_heads``).
        num_kv_heads: Number of key/value heads (default ``num_heads``; fewer gives GQA).
        bias: Whether the projections have biases.
        dropout: Dropout on the attention weights (training only).

    Raises:
        ValueError: If the head counts do not divide.

    Example:
        >>> import torch
        >>> attn = MultiHeadAttention(dim=16, num_heads=4, num_kv_heads=2)
        >>> attn(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
            head_dim = dim // num_heads
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(num_heads * head_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Self-attention over the sequence.

        Args:
            x: Input of shape ``(batch, seq, dim)``.
            key_padding_mask: Optional bool ``(batch, seq)``, ``True`` for real tokens and
                ``False`` for padding that must not be attended to.

        Returns:
            Output of shape ``(batch, seq, dim)``.
        """
        N, T, _ = x.shape
        H, KV, h = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q(x).view(N, T, H, h).transpose(1, 2)
        k = self.k(x).view(N, T, KV, h).transpose(1, 2)
        v = self.v(x).view(N, T, KV, h).transpose(1, 2)
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(h)
        if key_padding_mask is not None:
            keep = key_padding_mask[:, None, None, :].to(torch.bool)
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(N, T, H * h)
        return self.o(out)


class MLP(nn.Sequential):
    """Two-layer GELU feed-forward network ``fc2(gelu(fc1(x)))``.

    Args:
        dim: Input and output width.
        hidden: Hidden width.
        dropout: Dropout after the hidden layer (training only).
    """

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Args:
        dim: Model width.
        num_heads: Number of attention heads.
        mlp_dim: Hidden width of the MLP.
        num_kv_heads: Key/value heads (grouped-query attention when fewer than ``num_heads``).
        dropout: Dropout rate (attention weights and MLP).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, dropout=dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_dim, dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Apply the block.

        Args:
            x: Input ``(batch, seq, dim)``.
            key_padding_mask: Optional bool ``(batch, seq)``, ``True`` for real tokens.

        Returns:
            Output ``(batch, seq, dim)``.
        """
        x = x + self.attn(self.ln1(x), key_padding_mask)
        return x + self.mlp(self.ln2(x))


class VisionTransformer(nn.Module):
    """A small ViT classifier: patches, CLS token, learned positions, pre-norm blocks, head.

    Args:
        image_size: Side length of the (square) input images.
        patch_size: Side length of the patches (must divide ``image_size``).
        in_channels: Number of image channels.
        num_classes: Number of output logits.
        dim: Model width.
        depth: Number of blocks.
        num_heads: Attention heads per block.
        mlp_dim: MLP hidden width (default ``2·dim``).
        num_kv_heads: Key/value heads per block (default ``num_heads``).
        dropout: Dropout rate.

    Raises:
        ValueError: If ``patch_size`` does not divide ``image_size``.

    Example:
        >>> import torch
        >>> vit = VisionTransformer(image_size=8, patch_size=4, num_classes=3, dim=16,
        ...                         depth=2, num_heads=2)
        >>> vit(torch.randn(5, 3, 8, 8)).shape
        torch.Size([5, 3])
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        num_classes: int = 10,
        dim: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        mlp_dim: int | None = None,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size={patch_size} does not divide image_size={image_size}")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, num_patches + 1, dim))
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, mlp_dim or 2 * dim, num_kv_heads, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Classify images.

        Args:
            images: ``(batch, channels, image_size, image_size)``.

        Returns:
            Logits ``(batch, num_classes)``.
        """
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


class TextTransformer(nn.Module):
    """A small text classifier: token + learned position embeddings, blocks, pooling, head.

    Args:
        vocab_size: Vocabulary size.
        num_classes: Number of output logits.
        max_len: Longest supported sequence (without the CLS token).
        dim: Model width.
        depth: Number of blocks.
        num_heads: Attention heads per block.
        mlp_dim: MLP hidden width (default ``2·dim``).
        num_kv_heads: Key/value heads per block (default ``num_heads``).
        pooling: ``"mean"`` (average over real tokens) or ``"cls"`` (a learned CLS vector is
            prepended and its output used).
        dropout: Dropout rate.

    Raises:
        ValueError: For an unknown ``pooling``.

    Example:
        >>> import torch
        >>> net = TextTransformer(vocab_size=20, num_classes=2, dim=16, depth=1, num_heads=2)
        >>> ids = torch.randint(0, 20, (3, 7))
        >>> net(ids, attention_mask=torch.ones(3, 7, dtype=torch.bool)).shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        max_len: int = 128,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 4,
        mlp_dim: int | None = None,
        num_kv_heads: int | None = None,
        pooling: str = "mean",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.pooling = pooling
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.max_len = max_len
        extra = 1 if pooling == "cls" else 0
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, max_len + extra, dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pooling == "cls" else None
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, mlp_dim or 2 * dim, num_kv_heads, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Classify token sequences.

        Args:
            input_ids: ``(batch, seq)`` token ids.
            attention_mask: Optional ``(batch, seq)``, nonzero for real tokens, 0 for padding.

        Returns:
            Logits ``(batch, num_classes)``.
        """
        N, T = input_ids.shape
        if T > self.max_len:
            raise ValueError(
                f"sequence of {T} tokens is longer than max_len={self.max_len}; "
                "build the model with a larger max_len"
            )
        x = self.tok_embed(input_ids)
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(N, -1, -1), x], dim=1)
            if mask is not None:
                mask = F.pad(mask, (1, 0), value=True)
        x = x + self.pos_embed[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.pooling == "cls":
            pooled = x[:, 0]
        elif mask is None:
            pooled = x.mean(dim=1)
        else:
            w = mask.to(x.dtype).unsqueeze(-1)
            pooled = (x * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
        return self.head(pooled)
