r"""Geometry of diagonal linear networks ``y = xᵀ(u ⊙ v)`` (SPEC §3, §5).

The network depends on ``(u, v)`` only through ``β = u ⊙ v``, so every coordinate carries its own
GL(1) symmetry ``(u_i, v_i) ↦ (α u_i, v_i/α)``. Each coordinate is exactly the GL(h) block of
SPEC §4 with ``n = m = h = 1``, ``G = u_i``, ``H = v_i``, and every formula here is that block's
formula specialised to scalars, with the damped "Gram matrices" ``M_G = u² + ε``, ``M_H = v² + ε``
(elementwise):

.. code-block:: text

    inv:  ⟨η, ζ⟩ = Σ_i η_u ζ_u / M_G + η_v ζ_v / M_H       (at ε = 0: du²/u² + dv²/v²)
    mix:  ⟨η, ζ⟩ = Σ_i η_u ζ_u M_H   + η_v ζ_v M_G         (at ε = 0: v² du² + u² dv²)

The vertical direction of coordinate ``i`` (along its orbit) is ``(u_i, −v_i)``; the horizontal
space is its metric-orthogonal complement, the same for both metrics:
``u ξ_u / M_G = v ξ_v / M_H``, i.e. ``ξ_u/u = ξ_v/v =: b`` at ``ε = 0``. A horizontal vector is
therefore described by one number ``b_i`` per coordinate (:func:`horizontal_coordinate`), with
``‖ξ‖²_inv = 2‖b‖²`` and ``‖ξ‖²_mix = 2 Σ_i b_i² β_i²``. Exact geodesics at ``ε = 0``:

.. code-block:: text

    inv (any velocity):        (u e^{t ξ_u/u}, v e^{t ξ_v/v}),   so β_t = β ⊙ e^{2bt} (horizontal)
    mix (horizontal velocity): (u √(1+2bt), v √(1+2bt)),          so β_t = β ⊙ (1 + 2bt)

For the square loss ``‖Xβ − y‖²`` with ``XᵀX = I`` the worst-case geodesic sharpness has closed
forms (:func:`closed_form_sharpness_mix`, :func:`closed_form_sharpness_inv`) that serve as
ground truth for the sharpness estimators, and the paper's two-regime approximation of the inv
value is :func:`two_regime_sharpness_inv`; they live in
:mod:`~geosharp.geometry.diagonal_closed_form` and are importable from here.

Example:
    A 3-coordinate net: project a velocity horizontally and follow the exact inv geodesic;
    the product moves as ``β e^{2b}``.

    >>> import torch
    >>> from geosharp.geometry.diagonal import DiagonalGeometry, horizontal_coordinate
    >>> u = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64)
    >>> v = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    >>> geom = DiagonalGeometry(u, v, metric="inv")
    >>> xi = geom.project((torch.tensor([0.2, 0.4, 0.1], dtype=torch.float64),
    ...                    torch.zeros(3, dtype=torch.float64)))
    >>> b = horizontal_coordinate(u, v, xi)
    >>> b.tolist()  # ½ ξ_u/u
    [0.1, 0.1, -0.1]
    >>> round(float(geom.norm_sq(xi)), 12)  # 2‖b‖²
    0.06
    >>> u1, v1 = geom.geodesic(xi, order="exact")
    >>> bool(torch.allclose(u1 * v1, u * v * torch.exp(2 * b)))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from geosharp.geometry._validate import (
    check_eps,
    check_like,
    check_metric,
    check_order,
    check_steps,
    check_tensor,
)
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent
from geosharp.geometry.diagonal_closed_form import (
    closed_form_sharpness_inv,
    closed_form_sharpness_mix,
    two_regime_sharpness_inv,
)

__all__ = [
    "DiagonalGeometry",
    "closed_form_sharpness_inv",
    "closed_form_sharpness_mix",
    "horizontal_coordinate",
    "horizontal_residual",
    "two_regime_sharpness_inv",
]

#: A velocity counts as horizontal for the closed-form mix geodesic when
#: ``|ξ_u/u − ξ_v/v| ≤ HORIZONTAL_RTOL_ULPS · eps_dtype · (|ξ_u/u| + |ξ_v/v|)`` for every coordinate
#: (``eps_dtype`` the dtype's machine epsilon). A projected vector is horizontal to a few ulps.
HORIZONTAL_RTOL_ULPS = 1e3

#: Floor ``τ`` of ``1 + 2b`` in the ``(u, v)`` chart of the continued exact mix geodesic.
MIX_CHART_FLOOR = 1e-2


# ---------------------------------------------------------------------------------------------
# Horizontal coordinates
# ---------------------------------------------------------------------------------------------
def _unpack_pair(name: str, xi: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(xi, (tuple, list)) or len(xi) != 2:
        raise TypeError(f"{name} must be a pair (xi_u, xi_v) of tensors, got {type(xi).__name__}")
    return xi[0], xi[1]


def _check_point_and_tangent(u: Tensor, v: Tensor, xi: Tangent, eps: float) -> tuple:
    """Validate a base point ``(u, v)``, a tangent pair and ``ε``; return ``(ξ_u, ξ_v, ε)``."""
    check_tensor("u", u)
    check_like("v", v, "u", u)
    xu, xv = _unpack_pair("xi", xi)
    check_like("xi_u", xu, "u", u)
    check_like("xi_v", xv, "u", u)
    return xu, xv, check_eps(eps)


def horizontal_coordinate(u: Tensor, v: Tensor, xi: Tangent, eps: float = 0.0) -> Tensor:
    r"""The coordinate ``b`` of a horizontal vector, ``ξ = (u b, v b)`` at ``eps = 0``.

    Computes ``b = ½ (u ξ_u / M_G + v ξ_v / M_H)`` with ``M_G = u² + ε``, ``M_H = v² + ε``; at
    ``ε = 0`` this is ``½ (ξ_u/u + ξ_v/v)``, which equals ``ξ_u/u = ξ_v/v`` for a horizontal ``ξ``
    (SPEC §5). In these coordinates ``‖ξ‖²_inv = 2‖b‖²`` and ``‖ξ‖²_mix = 2 Σ b² β²``.

    Args:
        u: First factor, any shape.
        v: Second factor, same shape as ``u``.
        xi: Tangent pair ``(ξ_u, ξ_v)`` shaped like ``u``.
        eps: Damping ``ε ≥ 0`` of ``M_G``, ``M_H``. At ``ε = 0`` coordinates with ``u_i = 0`` or
            ``v_i = 0`` give non-finite values.

    Returns:
        ``b``, shaped like ``u``; differentiable in ``ξ``.

    Raises:
        TypeError: If an argument is not a floating tensor (pair).
        ValueError: On mismatched shapes or ``eps < 0``.
    """
    xu, xv, eps = _check_point_and_tangent(u, v, xi, eps)
    return 0.5 * (u * xu / (u * u + eps) + v * xv / (v * v + eps))


def horizontal_residual(u: Tensor, v: Tensor, xi: Tangent, eps: float = 0.0) -> Tensor:
    r"""Per-coordinate residual of the horizontality condition, zero iff ``ξ`` is horizontal.

    Computes ``u ξ_u / M_G − v ξ_v / M_H`` (``= ξ_u/u − ξ_v/v`` at ``ε = 0``). It is the inv inner
    product of ``ξ`` with the vertical vector ``(u, −v)`` of each coordinate, and ``1/(M_G M_H)``
    times the mix one, so it vanishes exactly on the horizontal space of both metrics
    (SPEC §4 with ``h = 1``: ``ξ_u u M_H = M_G v ξ_v``).

    Args:
        u: First factor, any shape.
        v: Second factor, same shape as ``u``.
        xi: Tangent pair ``(ξ_u, ξ_v)`` shaped like ``u``.
        eps: Damping ``ε ≥ 0``.

    Returns:
        The residual, shaped like ``u`` (same units as :func:`horizontal_coordinate`).

    Raises:
        TypeError: If an argument is not a floating tensor (pair).
        ValueError: On mismatched shapes or ``eps < 0``.
    """
    xu, xv, eps = _check_point_and_tangent(u, v, xi, eps)
    return u * xu / (u * u + eps) - v * xv / (v * v + eps)


# ---------------------------------------------------------------------------------------------
# The geometry
# ---------------------------------------------------------------------------------------------
class DiagonalGeometry(Geometry):
    r"""GL(1)-per-coordinate geometry of a diagonal linear network at base point ``(u, v)``.

    Implements SPEC §4 with ``n = m = h = 1`` per coordinate (see the module docstring for the
    metrics): ``M_G = u² + ε`` and ``M_H = v² + ε`` elementwise, computed once here. Tangent
    vectors are pairs ``(ξ_u, ξ_v)`` shaped like ``u``. All methods are elementwise, so any shape
    works and :meth:`inner` sums over all coordinates.

    Args:
        u: First factor, any shape, floating dtype (float32 or float64).
        v: Second factor, same shape, dtype and device as ``u``.
        metric: ``"inv"`` or ``"mix"`` (SPEC §4–§5).
        eps: Damping ``ε ≥ 0`` of ``M_G`` and ``M_H``. The metrics are exactly invariant, and the
            closed-form exact geodesics are used, only at ``ε = 0``.

    Raises:
        TypeError: If ``u`` or ``v`` is not a floating tensor or their dtypes differ.
        ValueError: On mismatched shapes or devices, an unknown metric, ``eps < 0``, non-finite
            entries, or, at ``eps = 0``, a coordinate with ``u_i = 0`` or ``v_i = 0`` (where
            ``M_G`` or ``M_H`` vanishes and both metrics are singular).
    """

    def __init__(self, u: Tensor, v: Tensor, metric: str = "inv", eps: float = 0.0) -> None:
        check_tensor("u", u)
        check_like("v", v, "u", u)
        self.metric = check_metric(metric)
        self.eps = check_eps(eps)
        # The base point is fixed during the ascent: detach it so that repeated backward passes
        # through the geometry never reach the graph that produced the weights.
        u, v = u.detach(), v.detach()
        if not (bool(torch.isfinite(u).all()) and bool(torch.isfinite(v).all())):
            raise ValueError("u and v must be finite (found inf or nan)")
        self.u, self.v = u, v
        self.point: Point = (u, v)
        self.m_g = u * u + self.eps
        self.m_h = v * v + self.eps
        singular = (self.m_g == 0) | (self.m_h == 0)
        n_sing = int(singular.sum())
        if n_sing:
            raise ValueError(
                f"eps={self.eps} but {n_sing} of the {u.numel()} coordinates have u_i = 0 or "
                f"v_i = 0 (M_G = u² + eps or M_H = v² + eps vanishes), where the {self.metric} "
                f"metric is singular; pass eps>0 (e.g. eps=1e-8 times the typical squared weight) "
                f"or drop those coordinates"
            )

    # -- validation -------------------------------------------------------------------------------
    def _check_tangent(self, xi: Any, name: str = "xi") -> tuple[Tensor, Tensor]:
        xu, xv = _unpack_pair(name, xi)
        check_like(f"{name}_u", xu, "u", self.u)
        check_like(f"{name}_v", xv, "u", self.u)
        return xu, xv

    # -- metric -----------------------------------------------------------------------------------
    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        r"""Metric inner product, summed over all coordinates.

        inv: ``Σ a_u b_u / M_G + a_v b_v / M_H``; mix: ``Σ a_u b_u M_H + a_v b_v M_G``.

        Args:
            a: Tangent pair ``(a_u, a_v)``.
            b: Tangent pair ``(b_u, b_v)``.

        Returns:
            A 0-dim tensor.

        Raises:
            TypeError: If ``a`` or ``b`` is not a pair of tensors of ``u``'s dtype.
            ValueError: If their shapes differ from ``u``'s.
        """
        au, av = self._check_tangent(a, "a")
        bu, bv = self._check_tangent(b, "b")
        if self.metric == "inv":
            return (au * bu / self.m_g + av * bv / self.m_h).sum()
        return (au * bu * self.m_h + av * bv * self.m_g).sum()

    # -- quotient structure -----------------------------------------------------------------------
    def vertical(self, omega: Tensor) -> Tangent:
        """The vertical vector ``(−u ω, v ω)`` (SPEC §4 ``(−GΩ, HΩᵀ)`` with ``h = 1``).

        Args:
            omega: One generator per coordinate, shaped like ``u`` (or broadcastable to it).

        Returns:
            The tangent pair along the orbits ``(α u, v/α)``.
        """
        return -self.u * omega, self.v * omega

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        """Per-coordinate horizontality residual ``u ξ_u/M_G − v ξ_v/M_H``.

        Args:
            xi: Tangent pair.

        Returns:
            Shaped like ``u``; zero iff ``ξ`` is horizontal (see :func:`horizontal_residual`).
        """
        xu, xv = self._check_tangent(xi)
        return self.u * xu / self.m_g - self.v * xv / self.m_h

    @property
    def orthogonal_projection(self) -> bool:
        """The projection is metric-orthogonal exactly at ``eps = 0`` (see :meth:`project`)."""
        return self.eps == 0.0

    def project(self, xi: Tangent) -> Tangent:
        r"""Horizontal projection ``P(ξ) = (ξ_u + uΛ, ξ_v − vΛ)`` (SPEC §4 with ``h = 1``).

        mix: ``Λ = ½ (ξ_v v / M_H − u ξ_u / M_G)``; inv: the scalar Sylvester equation
        ``2 M_H M_G Λ = ξ_v v M_G − M_H u ξ_u``. For scalars both give the same ``Λ``,
        ``Λ = −½ (u ξ_u/M_G − v ξ_v/M_H)``. At ``ε = 0`` this is the metric-orthogonal projection
        for both metrics, ``P(ξ) = (u b, v b)`` with ``b = ½(ξ_u/u + ξ_v/v)``; at ``ε > 0`` it is
        the paper's relaxation, whose output is horizontal up to ``O(ε)`` (exactly as the GL(h)
        block's projection with damped Gram matrices).

        Args:
            xi: Tangent pair ``(ξ_u, ξ_v)``.

        Returns:
            The projected pair; linear and differentiable in ``ξ``.
        """
        xu, xv = self._check_tangent(xi)
        lam = 0.5 * (xv * self.v / self.m_h - self.u * xu / self.m_g)
        return xu + self.u * lam, xv - self.v * lam

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Riemannian gradient ``g⁻¹ e``: inv ``(e_u M_G, e_v M_H)``; mix ``(e_u/M_H, e_v/M_G)``.

        Args:
            egrad: Euclidean gradient pair ``(∂ℓ/∂u, ∂ℓ/∂v)``.

        Returns:
            The Riemannian gradient pair.
        """
        eu, ev = self._check_tangent(egrad, "egrad")
        if self.metric == "inv":
            return eu * self.m_g, ev * self.m_h
        return eu / self.m_h, ev / self.m_g

    # -- geodesics --------------------------------------------------------------------------------
    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        r"""Christoffel quadratic form ``Γ_p(ξ, ξ)`` with ``M_G, M_H`` evaluated at ``point``.

        SPEC §4 with ``h = 1`` (``M_G = u² + ε``, ``M_H = v² + ε`` at the point ``(u, v)``):

        .. code-block:: text

            inv: Γ_u = −ξ_u (2 ξ_u u)/M_G + u ξ_u²/M_G = −u ξ_u²/M_G,   Γ_v = −v ξ_v²/M_H
            mix: Γ_u = ξ_u (2 ξ_v v)/M_H − u ξ_v²/M_H,   Γ_v = ξ_v (2 ξ_u u)/M_G − v ξ_u²/M_G

        These are the Levi-Civita symbols of the damped metric (evaluated along the curve), so
        ``γ̈ = −Γ_γ(γ̇, γ̇)`` is its geodesic equation for every ``ε``.

        Args:
            point: ``(u, v)`` at which to evaluate the metric.
            xi: Velocity pair.

        Returns:
            ``(Γ_u, Γ_v)``.
        """
        u, v = point
        xu, xv = _unpack_pair("xi", xi)
        m_g = u * u + self.eps
        m_h = v * v + self.eps
        if self.metric == "inv":
            return -u * xu * xu / m_g, -v * xv * xv / m_h
        return (
            (2.0 * xu * xv * v - u * xv * xv) / m_h,
            (2.0 * xv * xu * u - v * xu * xu) / m_g,
        )

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        r"""Point reached at ``t = 1`` along the geodesic with initial velocity ``ξ``.

        Orders 1 and 2 as in :class:`~geosharp.geometry.base.Geometry`. ``order="exact"`` uses
        closed forms at ``ε = 0``:

        - inv, any velocity: ``(u e^{ξ_u/u}, v e^{ξ_v/v})`` (the metric decouples into
          ``du²/u² + dv²/v²``, each a reparametrised line);
        - mix, horizontal velocity ``b = ξ_u/u = ξ_v/v``: ``(u √(1+2b), v √(1+2b))``, so
          ``β′ = β ⊙ (1 + 2b)``. On the quotient the mix metric is ``½‖dβ‖²`` — Euclidean in
          ``β`` — and its geodesics are the straight lines ``β + 2tb⊙β``, which cross
          ``β_i = 0`` (a singular point of the ``(u, v)`` chart only) when ``1 + 2b_i ≤ 0``.
          There the representative ``(u √τ, v (1+2b)/√τ)``, ``τ =`` :data:`MIX_CHART_FLOOR`, of
          the continued geodesic is returned: its product ``u′v′ = β(1+2b)`` — all a diagonal
          network sees — and its derivative are exact (for ``1 + 2b_i ≥ τ`` it is the geodesic
          itself). "Horizontal" means within
          :data:`HORIZONTAL_RTOL_ULPS` machine epsilons, relative; a non-horizontal mix velocity
          falls back to RK4. The closed form is evaluated at ``b = ½(ξ_u/u + ξ_v/v)``, so it
          is the exact endpoint of the projected velocity ``P(ξ)`` and differentiates as such;
          since ``P`` is ``g``-orthogonal (``P g⁻¹ Pᵀ = P g⁻¹``), the projected Riemannian
          gradient it yields equals that of the true exact geodesic.

        With ``ε > 0`` the exact geodesic is always RK4 with ``steps`` steps.

        Args:
            xi: Initial velocity pair.
            order: ``1``, ``2`` or ``"exact"``.
            steps: RK4 steps when RK4 is used.

        Returns:
            ``(u′, v′)``, differentiable in ``ξ``.

        Raises:
            ValueError: On a bad ``order``/``steps``.
        """
        order = check_order(order)
        xu, xv = self._check_tangent(xi)
        if order != "exact":
            return super().geodesic((xu, xv), order=order, steps=steps)
        steps = check_steps(steps)
        if self.eps != 0.0:
            return self._rk4((xu, xv), steps)
        bu, bv = xu / self.u, xv / self.v
        if self.metric == "inv":
            return self.u * torch.exp(bu), self.v * torch.exp(bv)
        tol = HORIZONTAL_RTOL_ULPS * torch.finfo(self.u.dtype).eps
        with torch.no_grad():
            horizontal = bool(((bu - bv).abs() <= tol * (bu.abs() + bv.abs())).all())
        if not horizontal:
            return self._rk4((xu, xv), steps)
        b = 0.5 * (bu + bv)
        stretch = 1.0 + 2.0 * b
        s = torch.sqrt(stretch.clamp_min(MIX_CHART_FLOOR))
        return self.u * s, self.v * (stretch / s)

    def iterate_endpoint(
        self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS
    ) -> Point:
        """The geodesic of an ascent iterate: projected first for ``order="exact"``.

        The closed-form geodesics need an exactly horizontal velocity; iterates are horizontal
        only up to roundoff, which ``P`` removes (``P`` is the identity on them).
        """
        if order == "exact":
            xi = self.project(xi)
        return self.geodesic(xi, order=order, steps=steps)

    # -- sampling -------------------------------------------------------------------------------
    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        r"""Isotropic Gaussian tangent vector in the metric, ``ξ ~ N(0, scale² g⁻¹)``.

        inv: ``(s Z₁ σ(u) √M_G, s Z₂ σ(v) √M_H)``; mix: ``(s Z₁ σ(v) / √M_H, s Z₂ σ(u) / √M_G)``,
        with ``Z₁, Z₂`` standard normal (drawn in that order), ``s = scale`` and ``σ`` the sign
        (``+1`` at ``0``); then projected horizontally if asked (SPEC §6.4, average-case). The
        factors are the covariant factors of the GL(h) block with ``n = h = 1``:
        ``R(u) = σ(u) √M_G`` (``u`` itself at ``ε = 0``). Under ``(u, v) ↦ (α u, v / α)``, ``α``
        of either sign, the same generator draws ``(α ξ_u, ξ_v / α)``.

        Args:
            generator: Random generator on ``u``'s device.
            scale: Standard deviation in the metric's own coordinates.
            horizontal: Project the sample horizontally.

        Returns:
            A tangent pair shaped like ``(u, v)``.
        """
        kw = {"generator": generator, "device": self.u.device}
        z = [torch.randn(s, dtype=d, **kw) for (s,), d in self.normal_draws()]
        return self.tangent_from_normals(z, scale, horizontal)

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """``Z₁``, ``Z₂``: one draw each, shaped like ``u``, in its dtype."""
        return [((self.u.shape,), self.u.dtype)] * 2

    def tangent_from_normals(
        self, z: Sequence[Tensor], scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """:meth:`random_tangent` from the normals ``(Z₁, Z₂)`` it would draw."""
        z1, z2 = z
        root_g = torch.where(self.u < 0, -1.0, 1.0).to(self.u.dtype) * self.m_g.sqrt()  # R(u)
        root_h = torch.where(self.v < 0, -1.0, 1.0).to(self.u.dtype) * self.m_h.sqrt()  # R(v)
        if self.metric == "inv":
            xi = (scale * z1 * root_g, scale * z2 * root_h)
        else:  # R^{−T} = R / M
            xi = (scale * z1 * (root_h / self.m_h), scale * z2 * (root_g / self.m_g))
        return self.project(xi) if horizontal else xi
