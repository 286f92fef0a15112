"""GL(1) per coordinate: the factors ``(u, v)`` of a diagonal linear network (SPEC §3).

The network depends on ``u`` and ``v`` only through ``u ⊙ v``; ``α ∈ (ℝ*)^d`` acts by
``(u, v) ↦ (α u, v / α)``, and the quotient geometry is
:class:`~geosharp.geometry.DiagonalGeometry`. Built from a
:class:`~geosharp.symmetry.specs.PairSpec`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry import DiagonalGeometry, Geometry
from geosharp.geometry.gl_rows import RowSum
from geosharp.symmetry.blocks.base import MAX_TRIES, Coordinates, SymmetryBlock
from geosharp.symmetry.specs import PairSpec

__all__ = ["DiagonalPair"]

#: Entries of ``α`` are resampled while ``|α| < _MIN_ALPHA · scale``.
_MIN_ALPHA = 0.1


@dataclass(frozen=True, eq=False, repr=False)
class DiagonalPair(SymmetryBlock):
    """The factors ``(u, v)`` of a diagonal linear network ``y = xᵀ(u ⊙ v)`` (SPEC §3).

    One GL(1) per coordinate acts by ``(u_i, v_i) ↦ (α_i u_i, v_i / α_i)``.

    Attributes:
        name: Readable name, e.g. ``"net[u*v]"``.
        module: Dotted path of the owning module.
        u_index: ``LongTensor`` of global flat positions of ``u`` into ``θ``.
        v_index: ``LongTensor`` of the same shape: positions of the matching ``v``.
        kind: ``"pair"``.

    Example:
        >>> import torch
        >>> pair = DiagonalPair("net[u*v]", "net", torch.arange(3), torch.arange(3, 6))
        >>> u, v = pair.gather(torch.arange(6.0))
        >>> (u * v).tolist()
        [0.0, 4.0, 10.0]
    """

    name: str
    module: str
    u_index: Tensor
    v_index: Tensor
    kind: str = "pair"

    index_fields: ClassVar[tuple[str, ...]] = ("u_index", "v_index")
    family: ClassVar[str] = "diagonal pairs"
    spec_type: ClassVar[type | None] = PairSpec

    @classmethod
    def from_spec(cls, spec: PairSpec, coords: Coordinates) -> DiagonalPair:
        """The pair of the whole parameters ``spec.u`` and ``spec.v`` (equally shaped).

        Raises:
            ValueError: If ``u`` and ``v`` differ in shape (or as :meth:`Coordinates.name`).
        """
        owner = f"diagonal pair {spec.name!r}"
        u, v = coords.name(spec.u, owner), coords.name(spec.v, owner)
        if coords.shape(u) != coords.shape(v):
            raise ValueError(
                f"diagonal pair {spec.name!r}: {u!r} has shape {tuple(coords.shape(u))} but "
                f"{v!r} has shape {tuple(coords.shape(v))}; u and v must match"
            )
        return cls(spec.name, spec.module, coords.whole(u), coords.whole(v))

    @property
    def category(self) -> str:
        """``"pair"``."""
        return "pair"

    @property
    def count(self) -> int:
        """Number of coordinates (one GL(1) each)."""
        return int(self.u_index.numel())

    @property
    def group(self) -> str:
        """``GL(1)^size``."""
        return f"GL(1)^{self.count}"

    @property
    def shape_label(self) -> str:
        """``u, v: size``."""
        return f"u, v: {self.count:,}"

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """``α = scale·N(0, 1)`` per coordinate, redrawn while ``|α| < 0.1``."""
        a = torch.randn(self.u_index.shape, generator=generator, dtype=torch.float64)
        for _ in range(MAX_TRIES):
            small = a.abs() < _MIN_ALPHA
            if not small.any():
                break
            a[small] = torch.randn(int(small.sum()), generator=generator, dtype=torch.float64)
        return scale * a

    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """``(u, v) ↦ (α u, v / α)``."""
        u, v = parts
        alpha = element.to(dtype=u.dtype, device=u.device)
        return u * alpha, v / alpha

    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """``(u ω, −v ω)``: the velocity of ``(u e^{tω}, v e^{−tω})`` at ``t = 0``."""
        u, v = parts
        w = torch.randn(u.shape, generator=generator, dtype=u.dtype, device=u.device)
        return u * w, -v * w

    def batch_key(self) -> Hashable:
        """Each pair is its own piece (as the closed-form studies expect)."""
        return ("pair", self.name)

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
        """A :class:`~geosharp.geometry.DiagonalGeometry` of ``(u, v)``."""
        if row_sum is not None:
            raise NotImplementedError(
                "diagonal pairs on a sharded model (their coordinates u_i and v_i on different "
                "ranks) are not implemented"
            )
        u, v = point
        return DiagonalGeometry(u, v, metric=metric, eps=eps)
