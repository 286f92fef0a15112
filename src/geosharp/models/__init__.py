"""Small models for experiments and tests, and the packaged MiniLM (loaded lazily).

Example:
    >>> import torch
    >>> from geosharp.models import VisionTransformer
    >>> from geosharp.symmetry import find_symmetries
    >>> vit = VisionTransformer(image_size=8, patch_size=4, dim=16, depth=2, num_heads=2)
    >>> len(find_symmetries(vit).gl_blocks)  # QK and VO per block
    4
"""

from geosharp.models.diagonal import DiagonalNet
from geosharp.models.hf import load_minilm, minilm_path
from geosharp.models.transformer import (
    MLP,
    Block,
    MultiHeadAttention,
    TextTransformer,
    VisionTransformer,
)

__all__ = [
    "MLP",
    "Block",
    "DiagonalNet",
    "MultiHeadAttention",
    "TextTransformer",
    "VisionTransformer",
    "load_minilm",
    "minilm_path",
]
