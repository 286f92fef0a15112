"""One-call functions of a GL(h) block: each factorizes the base point ``(G, H)`` afresh.

Conveniences over :class:`~geosharp.geometry.gl.GLGeometry` (which factorizes once and is
what the estimators use): the metric, the horizontal projection, the Christoffel form, the
geodesic endpoint, the Riemannian gradient and an isotropic sample, on raw ``(G, H)``.

Example:
    >>> import torch
    >>> from geosharp.geometry import gl_functional
    >>> G, H = torch.eye(3, 2, dtype=torch.float64), torch.eye(4, 2, dtype=torch.float64)
    >>> float(gl_functional.norm_sq(G, H, G, H, metric="mix"))  # tr(M_H GᵀG) + tr(M_G HᵀH) = 2 + 2
    4.0
"""

from __future__ import annotations

import torch
from torch import Tensor

from geosharp.geometry._validate import check_order, check_steps
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.geometry.gl import DEFAULT_EPS, GLGeometry

__all__ = [
    "christoffel",
    "geodesic",
    "inner",
    "norm_sq",
    "project",
    "random_tangent",
    "riemannian_grad",
]


def inner(
    G: Tensor,
    H: Tensor,
    a_G: Tensor,
    a_H: Tensor,
    b_G: Tensor,
    b_H: Tensor,
    metric: str = "inv",
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Metric inner product ``⟨a, b⟩`` at ``(G, H)``; see :class:`GLGeometry`.

    Example:
        >>> import torch
        >>> G, H = torch.eye(3, 2, dtype=torch.float64), torch.eye(4, 2, dtype=torch.float64)
        >>> float(inner(G, H, G, H, G, H, metric="inv"))  # tr(I₂) + tr(I₂)
        4.0
    """
    return GLGeometry(G, H, metric, eps).inner((a_G, a_H), (b_G, b_H))


def norm_sq(
    G: Tensor, H: Tensor, xi_G: Tensor, xi_H: Tensor, metric: str = "inv", eps: float = DEFAULT_EPS
) -> Tensor:
    """Squared metric norm ``⟨ξ, ξ⟩`` at ``(G, H)``."""
    return GLGeometry(G, H, metric, eps).norm_sq((xi_G, xi_H))


def project(
    G: Tensor, H: Tensor, xi_G: Tensor, xi_H: Tensor, metric: str = "inv", eps: float = DEFAULT_EPS
) -> tuple[Tensor, Tensor]:
    """Horizontal projection of ``ξ`` at ``(G, H)`` (SPEC §4)."""
    return GLGeometry(G, H, metric, eps).project((xi_G, xi_H))


def christoffel(
    G: Tensor, H: Tensor, xi_G: Tensor, xi_H: Tensor, metric: str = "inv", eps: float = DEFAULT_EPS
) -> tuple[Tensor, Tensor]:
    """Christoffel quadratic form ``(Γ_G, Γ_H) = Γ(ξ, ξ)`` at ``(G, H)`` (SPEC §4)."""
    return GLGeometry(G, H, metric, eps).christoffel((xi_G, xi_H))


def geodesic(
    G: Tensor,
    H: Tensor,
    xi_G: Tensor,
    xi_H: Tensor,
    metric: str = "inv",
    order: int | str = 2,
    eps: float = DEFAULT_EPS,
    steps: int = DEFAULT_RK4_STEPS,
) -> tuple[Tensor, Tensor]:
    """Geodesic endpoint ``γ(1)`` from ``(G, H)`` with velocity ``ξ`` (SPEC §4).

    Args:
        G: Left factor ``(..., n, h)``.
        H: Right factor ``(..., m, h)``.
        xi_G: Velocity of ``G``.
        xi_H: Velocity of ``H``.
        metric: ``"inv"`` or ``"mix"``.
        order: ``1`` (``w + ξ``), ``2`` (``w + ξ − ½Γ(ξ, ξ)``) or ``"exact"`` (RK4).
        eps: Gram damping.
        steps: RK4 steps for ``order="exact"``.

    Returns:
        ``(G′, H′)``.

    Raises:
        ValueError: On an unknown order or bad ``steps`` (besides the checks of GLGeometry).
    """
    check_order(order)
    check_steps(steps)
    return GLGeometry(G, H, metric, eps).geodesic((xi_G, xi_H), order=order, steps=steps)


def riemannian_grad(
    G: Tensor, H: Tensor, e_G: Tensor, e_H: Tensor, metric: str = "inv", eps: float = DEFAULT_EPS
) -> tuple[Tensor, Tensor]:
    """Riemannian gradient of the Euclidean gradient ``e = (e_G, e_H)`` at ``(G, H)``."""
    return GLGeometry(G, H, metric, eps).riemannian_grad((e_G, e_H))


def random_tangent(
    G: Tensor,
    H: Tensor,
    metric: str = "inv",
    generator: torch.Generator | None = None,
    eps: float = DEFAULT_EPS,
    scale: float = 1.0,
    horizontal: bool = True,
) -> tuple[Tensor, Tensor]:
    """Isotropic Gaussian tangent vector in the metric at ``(G, H)``, projected horizontally."""
    return GLGeometry(G, H, metric, eps).random_tangent(generator, scale, horizontal)
