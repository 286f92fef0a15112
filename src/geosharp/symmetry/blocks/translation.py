"""Translations of biases the loss ignores: the key bias of softmax attention (SPEC §8).

``q·b_k`` is the same for every key, so the softmax ignores ``b_k``: every translation
``b ↦ b + t`` is a symmetry, the quotient is a point, and geodesic measures hold these
coordinates fixed (:class:`~geosharp.geometry.FixedGeometry`). Built from a
:class:`~geosharp.symmetry.specs.TranslationSpec`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry import FixedGeometry, Geometry
from geosharp.geometry.gl_rows import RowSum
from geosharp.symmetry.blocks.base import Coordinates, SymmetryBlock
from geosharp.symmetry.specs import TranslationSpec

__all__ = ["TranslationBlock"]


@dataclass(frozen=True, eq=False, repr=False)
class TranslationBlock(SymmetryBlock):
    """Biases the loss does not depend on: the key bias of softmax attention (SPEC §8).

    Every translation ``b ↦ b + t`` is a symmetry, so the quotient is a point and geodesic
    measures hold these coordinates fixed (:class:`~geosharp.geometry.FixedGeometry`).

    Attributes:
        name: Readable name, e.g. ``"encoder.layer.0.attention[b_k]"``.
        module: Dotted path of the owning module.
        heads: Number of heads (rows of :attr:`index`).
        head_dim: Features per head.
        index: ``LongTensor (B, k, h)`` of global flat positions into ``θ``.
        kind: ``"b_k"``.
    """

    name: str
    module: str
    heads: int
    head_dim: int
    index: Tensor
    kind: str = "b_k"

    index_fields: ClassVar[tuple[str, ...]] = ("index",)
    family: ClassVar[str] = "key-bias translations (held fixed)"
    batch_flat: ClassVar[bool] = True
    shard_layout: ClassVar[str | None] = "coordinates"
    spec_type: ClassVar[type | None] = TranslationSpec
    space_note: ClassVar[str | None] = (
        "key biases b_k: the softmax ignores q·b_k (the same for every key), so they are "
        "pure symmetry directions; geodesic measures hold them fixed (key_bias='quotient'), "
        "adaptive sharpness keeps them"
    )

    @classmethod
    def from_spec(cls, spec: TranslationSpec, coords: Coordinates) -> TranslationBlock:
        """The block of the bias slices ``spec.pieces``, ``(heads, k, head_dim)``."""
        owner = f"bias {spec.name!r}"
        index = coords.slices(spec.pieces, spec.heads, spec.head_dim, owner)
        return cls(spec.name, spec.module, spec.heads, spec.head_dim, index)

    @property
    def category(self) -> str:
        """``"b_k"``."""
        return "b_k"

    @property
    def count(self) -> int:
        """Number of heads."""
        return self.heads

    @property
    def group(self) -> str:
        """``ℝ^n`` (translations)."""
        return f"ℝ^{self.numel} (translations)"

    @property
    def shape_label(self) -> str:
        """``b: numel``."""
        return f"b: {self.numel:,}"

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """A translation ``t = scale·N(0, 1)`` of every coordinate."""
        return scale * torch.randn(self.index.shape, generator=generator, dtype=torch.float64)

    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """``b ↦ b + t``."""
        (b,) = parts
        return (b + element.to(dtype=b.dtype, device=b.device),)

    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """Any direction: every translation is a symmetry."""
        (b,) = parts
        return (torch.randn(b.shape, generator=generator, dtype=b.dtype, device=b.device),)

    def batch_key(self) -> Hashable:
        """All translations form one piece."""
        return ("translation",)

    @classmethod
    def batch(cls, blocks: Sequence[SymmetryBlock]) -> tuple[Tensor, ...]:
        """All positions of the batch, flattened into one vector."""
        return (torch.cat([b.index.reshape(-1) for b in blocks]),)

    @classmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
        row_sum: RowSum | None = None,
    ) -> Geometry:
        """:class:`~geosharp.geometry.FixedGeometry`: the quotient by translations is a point."""
        return FixedGeometry(point, name=f"{len(blocks)} key bias(es)")
