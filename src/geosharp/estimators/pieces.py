"""The pieces of a perturbation: parts of ``θ``, each with its geometry, and where they lie.

A :class:`~geosharp.estimators.perturbation.Perturbation` splits the flat parameters of a
:class:`~geosharp.symmetry.ParameterSpace` into :class:`Piece` objects: one per group of
symmetry blocks of one batch key (all heads of equal shape of all layers, one batched
geometry) and one for the coordinates in no block. This module holds the piece and the
helpers that lay the base point out as pieces; none stores a parameter-sized index (positions
are built when asked, from the blocks' recipes or the space's layout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from geosharp.geometry import Geometry
from geosharp.geometry.base import Tangent
from geosharp.symmetry import ParameterSpace

__all__ = ["Piece", "Xi"]

#: A perturbation: one tangent tuple per piece.
Xi = list[Tangent]


class Piece:
    """One part of ``θ`` with its geometry.

    Attributes:
        name: Readable name (for summaries and errors).
        index: Global positions in ``θ``, one tensor per component of the point (built on
            each access from the blocks or the space: a piece stores no parameter-sized index).
        geometry: Geometry used for the horizontal projection and the geodesic.
        norm_geometry: Geometry of the ball and of the Riemannian gradient (differs from
            ``geometry`` only in the "no corrected norm" ablation).
        order: Geodesic order used for this piece.
    """

    def __init__(
        self,
        name: str,
        index: tuple[Tensor, ...] | Callable[[], tuple[Tensor, ...]],
        geometry: Geometry,
        norm_geometry: Geometry,
        order: int | str,
    ) -> None:
        self.name = name
        self._index = index
        self.geometry = geometry
        self.norm_geometry = norm_geometry
        self.order = order

    @property
    def index(self) -> tuple[Tensor, ...]:
        """Global positions in ``θ`` of every component (a new tensor per access)."""
        return self._index() if callable(self._index) else self._index

    def __repr__(self) -> str:
        return f"Piece({self.name!r}, {type(self.geometry).__name__}, order={self.order})"


def _base_params(space: ParameterSpace, theta0: Tensor | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The base point by name, detached: the given tensors, or views of a flat ``θ₀``."""
    if isinstance(theta0, Tensor):
        return {n: t.detach() for n, t in space.unflatten(theta0.detach()).items()}
    checked = space.checked(theta0, "the base point")
    return {n: t.detach() for n, t in zip(space.param_names, checked, strict=True)}


def _rest_positions(
    space: ParameterSpace, layout: Sequence[tuple[int, Tensor | None]], device: torch.device
) -> Callable[[], tuple[Tensor, ...]]:
    """Global positions of the rest components, built when asked (no index is stored)."""
    return lambda: tuple(space.layout_positions(layout, device))


def _row_positions(piece: Piece, cut: Mapping[int, Tensor], full: Sequence[Tensor]) -> Callable:
    """Global positions of a rest piece some of whose components are cut to rows."""

    def positions() -> tuple[Tensor, ...]:
        out = list(piece.index)
        for c, r in cut.items():
            row = full[c][0].numel()
            per_row = out[c].reshape(full[c].shape[0], row)
            out[c] = per_row.index_select(0, r.to(per_row.device)).reshape(-1)
        return tuple(out)

    return positions


def _block_positions(cls: type, blocks: list, device: torch.device) -> Callable:
    """Global positions of a batched block piece, built when asked (the blocks hold them)."""
    return lambda: tuple(i.to(device) for i in cls.batch(blocks))


def _group_blocks(space: ParameterSpace) -> list[list]:
    """Blocks grouped by :meth:`~geosharp.symmetry.SymmetryBlock.batch_key`, in first-seen order.

    Each group becomes one batched geometry (e.g. all QK heads of equal shape of all layers).
    """
    groups: dict = {}
    for b in space.blocks:
        groups.setdefault(b.batch_key(), []).append(b)
    return list(groups.values())
