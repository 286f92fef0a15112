"""The geometry of coordinates the loss does not depend on at all (SPEC §8).

For a key bias ``b_k`` every translation is a symmetry: the orbit is the whole space, the
quotient is a single point and every tangent vector is vertical. :class:`FixedGeometry` is that
point: its horizontal projection is zero, its geodesics stay at the base point and its norm is
zero, so a perturbation never moves these coordinates and spends no budget on them.

Example:
    >>> import torch
    >>> geom = FixedGeometry((torch.tensor([1.0, -2.0]),))
    >>> geom.project((torch.tensor([0.3, 0.4]),))[0].tolist()
    [0.0, 0.0]
    >>> geom.geodesic((torch.tensor([0.3, 0.4]),))[0].tolist()
    [1.0, -2.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.geometry._validate import check_order, check_tensor
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent

__all__ = ["FixedGeometry"]


class FixedGeometry(Geometry):
    """A block whose quotient is one point: every direction is a symmetry direction.

    Args:
        point: The block's factors at the base point.
        name: Name used in messages.
    """

    #: The quotient is a point: nothing here can carry perturbation budget.
    is_trivial = True
    #: Every direction is vertical: the projection (to zero) is trivially orthogonal.
    orthogonal_projection = True

    def __init__(self, point: Point, name: str = "fixed coordinates") -> None:
        for i, p in enumerate(point):
            check_tensor(f"point[{i}]", p)
        self.point = tuple(point)
        self.name = name

    def _zeros(self, xi: Tangent) -> Tangent:
        return tuple(torch.zeros_like(x) for x in xi)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """Zero: the quotient has no tangent directions."""
        return torch.zeros((), dtype=self.point[0].dtype, device=self.point[0].device)

    def project(self, xi: Tangent) -> Tangent:
        """Zero: every tangent vector is vertical."""
        return self._zeros(xi)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Zero (the loss does not depend on these coordinates)."""
        return self._zeros(egrad)

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Zero."""
        return self._zeros(xi)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """The base point, whatever the velocity (held fixed)."""
        check_order(order)
        return tuple(p + 0 * x for p, x in zip(self.point, xi, strict=True))

    def pulls_back(self, order: int | str) -> bool:
        """``True``: the endpoint is the base point, and the gradient there is zero."""
        return True

    def random_tangent(
        self, generator: torch.Generator | None = None, scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """Zero (there is nothing to sample on a point)."""
        return tuple(torch.zeros_like(p) for p in self.point)

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """None: nothing is drawn."""
        return []

    def tangent_from_normals(
        self, z: Sequence[Tensor], scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """Zero."""
        return tuple(torch.zeros_like(p) for p in self.point)
