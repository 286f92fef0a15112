"""The one interface every geometry implements (SPEC §4–§6).

A :class:`Geometry` is a Riemannian metric on the parameters of one *block* (a GL(h) block of
attention, a set of diagonal-net pairs, or a plain tensor with the adaptive metric), bound to a
fixed **base point** — the trained weights. Base-point work (Gram matrices, their inverses and
eigendecompositions) happens once, in the constructor; every method afterwards is a few batched
matmuls. The sharpness ascent only ever talks to this interface, so it never needs to ask which
geometry it holds (the geoopt design).

Points and tangent vectors are tuples of tensors with the shapes of the block's parameters:
``(G, H)`` for a GL(h) block, ``(u, v)`` for a diagonal net, ``(w,)`` for a plain tensor.
Blocks may carry leading batch dimensions (e.g. layers × heads); :meth:`Geometry.inner` returns
one value per batch element, so the squared norm of a perturbation spread over many blocks is
``sum(geom.norm_sq(xi).sum() for geom, xi in ...)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import is_dataclass

import torch
from torch import Tensor

from geosharp.geometry._validate import check_order, check_steps
from geosharp.geometry.flat import flat_exact

Tangent = tuple[Tensor, ...]
Point = tuple[Tensor, ...]

#: Default number of RK4 steps for ``order="exact"`` geodesics.
DEFAULT_RK4_STEPS = 10


class Geometry(ABC):
    """A metric on one block of parameters at a fixed base point.

    Subclasses implement :meth:`inner`, :meth:`project`, :meth:`riemannian_grad`,
    :meth:`christoffel_at` and :meth:`random_tangent`; :meth:`geodesic` follows from them
    (order 1: ``w + ξ``; order 2: ``w + ξ − ½ Γ_w(ξ, ξ)``; exact: RK4 on ``γ̈ = −Γ_γ(γ̇, γ̇)``),
    and subclasses with closed-form geodesics override it.

    Callers outside :mod:`geosharp.geometry` never ask for a geometry's class; they ask what it
    can do: :attr:`is_trivial` (held fixed), :meth:`pulls_back`, :meth:`is_straight` and
    :meth:`row_endpoint` (the form of its endpoint), :attr:`draws_over_point` and
    :meth:`normal_draws` (its random draws), :meth:`relative_speed` (the scale an exact
    geodesic must resolve). A new geometry overrides the defaults that are not true of it.
    """

    point: Point
    #: ``True`` when the quotient is a single point (every direction is a symmetry).
    is_trivial: bool = False
    #: ``True`` when :meth:`horizontal_grad` is exactly the metric-orthogonal projection of the
    #: Riemannian gradient. Then ``⟨P g⁻¹e, v⟩ = e·v`` for every horizontal ``v``, and
    #: :meth:`ascent_direction` reads norms off Euclidean pairings with ``e``.
    orthogonal_projection: bool = False
    #: ``True`` when :meth:`normal_draws` is one draw over the point's components, in their
    #: order (the numbers of :func:`~geosharp.geometry.draws.draw_like`): a uniform draw over
    #: the point (the ℓ∞ box's random start) then follows the same plan of draws.
    draws_over_point: bool = False

    # -- metric ---------------------------------------------------------------------------
    @abstractmethod
    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """Metric inner product ``⟨a, b⟩`` at the base point, one value per batch element."""

    def norm_sq(self, xi: Tangent) -> Tensor:
        """Squared metric norm ``⟨ξ, ξ⟩``, one value per batch element."""
        return self.inner(xi, xi)

    # -- what it holds ----------------------------------------------------------------------
    def held_tensors(self) -> Iterator[Tensor]:
        """Every tensor this geometry holds (a tensor may come more than once).

        Its point, its base-point factors (also inside dataclasses, such as a factor record) and
        those of the geometries it holds; the caller counts storages.
        """
        todo: list[object] = [self]
        visited: set[int] = set()
        while todo:
            obj = todo.pop()
            if id(obj) in visited:
                continue
            visited.add(id(obj))
            for value in vars(obj).values():
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, Tensor):
                        yield t
                    elif isinstance(t, Geometry) or (is_dataclass(t) and not isinstance(t, type)):
                        todo.append(t)

    # -- quotient structure -----------------------------------------------------------------
    @abstractmethod
    def project(self, xi: Tangent) -> Tangent:
        """Horizontal projection: remove the component of ``ξ`` along the symmetry orbit."""

    @abstractmethod
    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Riemannian gradient ``g⁻¹ e`` of a Euclidean gradient ``e``."""

    def horizontal_grad(self, egrad: Tangent) -> Tangent:
        """``P(g⁻¹ e)``: the Riemannian gradient projected horizontally (the ascent direction).

        Geometries that can do both in one pass (no rounding in between) override it.
        """
        return self.project(self.riemannian_grad(egrad))

    def horizontal_grad_(self, egrad: Tangent) -> Tangent:
        """:meth:`horizontal_grad`, free to overwrite ``egrad`` (no copy where a geometry can)."""
        return self.horizontal_grad(egrad)

    def ascent_direction_(self, egrad: Tangent) -> tuple[Tangent, Tensor]:
        """:meth:`ascent_direction`, free to overwrite ``egrad`` (no copy where a geometry can)."""
        return self.ascent_direction(egrad)

    def ascent_direction(self, egrad: Tangent) -> tuple[Tangent, Tensor]:
        """The ascent direction ``d = P(g⁻¹ e)`` and its squared norm ``⟨d, d⟩`` (0-dim).

        With a metric-orthogonal projection (:attr:`orthogonal_projection`) the norm is a
        Euclidean pairing, ``⟨d, d⟩ = ⟨g⁻¹e, P g⁻¹e⟩ = e·d``: one pass over ``e`` and ``d``
        instead of the metric's products. Otherwise it is :meth:`norm_sq` of ``d``.
        """
        d = self.horizontal_grad(egrad)
        if self.orthogonal_projection:
            return d, euclidean_pairing(egrad, d)
        return d, self.norm_sq(d).sum()

    def coordinate_norm_sq(self, xi: Tangent) -> tuple[Tensor, ...] | None:
        """``‖ξ‖²`` split over the coordinates, where the metric is diagonal; else ``None``.

        Where it is not ``None`` its entries add up to :meth:`norm_sq`.
        """
        return None

    def box_scale(self) -> tuple[Tensor, ...] | None:
        """The half-widths of this geometry's ℓ∞ box per unit radius, or ``None`` for ``1``.

        The box ``|ξ_i| ≤ ρ·s_i`` (SPEC §2): ``|w_i|`` for the adaptive geometry.
        """
        return None

    # -- geodesics --------------------------------------------------------------------------
    def pulls_back(self, order: int | str) -> bool:
        """Whether the endpoint of this ``order`` has exactly the identity as its derivative at 0.

        Then ``∂L/∂ξ`` at ``ξ = 0`` is ``∂L/∂θ`` (no backward through the endpoint). RK4 and
        closed forms are the identity there only up to rounding: ``False`` by default.
        """
        return False

    def is_straight(self, order: int | str) -> bool:
        """Whether the endpoint of this ``order`` is the straight line ``w + ξ`` itself."""
        return False

    def row_endpoint(self, order: int | str) -> bool:
        """Whether the endpoint of this ``order`` is a row-wise product with ``h × h`` factors.

        ``G′ = G (I + s B_G) + ξ_G C_G`` (and so for ``H``,
        :mod:`~geosharp.geometry.gl_endpoint`): a holder of some rows of the point and of ``ξ``
        makes those rows of the endpoint once the factors are summed over the holders (a
        model sharded by FSDP2). ``False`` by default.
        """
        return False

    def relative_speed(self, xi: Tangent) -> Tensor | None:
        """``κ`` per head: ``ξ`` in units of the head's own scale; ``None`` where undefined.

        An exact (RK4) geodesic needs about ``2κ`` steps
        (:mod:`~geosharp.geometry.gl_diagnose`). ``None`` by default: a geometry without heads.
        """
        return None

    @abstractmethod
    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Christoffel quadratic form ``Γ_p(ξ, ξ)`` with the metric evaluated at ``point``."""

    def christoffel(self, xi: Tangent) -> Tangent:
        """Christoffel quadratic form ``Γ(ξ, ξ)`` at the base point."""
        return self.christoffel_at(self.point, xi)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Point reached at ``t = 1`` along the geodesic from the base point with velocity ``ξ``.

        Args:
            xi: Initial velocity (a tangent vector).
            order: ``1`` (straight line ``w + ξ``), ``2`` (``w + ξ − ½Γ(ξ, ξ)``, SPEC Eq. 5,
                error ``O(‖ξ‖³)``) or ``"exact"`` (fixed-step RK4 of the geodesic ODE).
            steps: Number of RK4 steps for ``order="exact"``.

        Returns:
            The end point, a tuple shaped like :attr:`point`. Differentiable in ``ξ``.
        """
        order = check_order(order)
        if order == 1:
            return tuple(p + x for p, x in zip(self.point, xi, strict=True))
        if order == 2:
            gamma = self.christoffel(xi)
            return tuple(p + x - 0.5 * g for p, x, g in zip(self.point, xi, gamma, strict=True))
        return self._rk4(xi, check_steps(steps))

    def iterate_endpoint(
        self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS
    ) -> Point:
        """:meth:`geodesic` of an ascent iterate, which is horizontal only up to roundoff.

        Geometries whose closed forms need an exactly horizontal velocity override this.
        """
        return self.geodesic(xi, order=order, steps=steps)

    def endpoint_trouble(
        self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS
    ) -> str | None:
        """After a non-finite loss: one line on why this block's endpoint is at fault, or ``None``.

        Not on the path of a measurement (it may integrate again); ``None`` here, where nothing
        specific is known. :class:`~geosharp.geometry.gl.GLGeometry` tells a too coarse RK4 of
        ``order="exact"`` from a geodesic that leaves the region where its metric is defined.
        """
        return None

    def _rk4(self, xi: Tangent, steps: int, point: Point | None = None) -> Point:
        """Integrate ``γ̈ = −Γ_γ(γ̇, γ̇)`` from ``(point, ξ)`` to ``t = 1`` with classic RK4.

        ``point`` defaults to the base point (it may be passed in a wider dtype).
        """
        dt = 1.0 / steps
        x, v = (self.point if point is None else point), xi

        def accel(p: Point, vel: Tangent) -> Tangent:
            return tuple(-g for g in self.christoffel_at(p, vel))

        def add(a: Tangent, b: Tangent, s: float) -> Tangent:
            return tuple(ai + s * bi for ai, bi in zip(a, b, strict=True))

        for _ in range(steps):
            k1x, k1v = v, accel(x, v)
            x2, v2 = add(x, k1x, dt / 2), add(v, k1v, dt / 2)
            k2x, k2v = v2, accel(x2, v2)
            x3, v3 = add(x, k2x, dt / 2), add(v, k2v, dt / 2)
            k3x, k3v = v3, accel(x3, v3)
            x4, v4 = add(x, k3x, dt), add(v, k3v, dt)
            k4x, k4v = v4, accel(x4, v4)
            x = tuple(
                xi_ + dt / 6 * (a + 2 * b + 2 * c + d)
                for xi_, a, b, c, d in zip(x, k1x, k2x, k3x, k4x, strict=True)
            )
            v = tuple(
                vi + dt / 6 * (a + 2 * b + 2 * c + d)
                for vi, a, b, c, d in zip(v, k1v, k2v, k3v, k4v, strict=True)
            )
        return x

    # -- sampling -----------------------------------------------------------------------------
    @abstractmethod
    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        """Isotropic Gaussian tangent vector in the metric, ``ξ ~ N(0, scale² g⁻¹)``.

        Args:
            generator: Random generator (on the block's device) for reproducibility.
            scale: Standard deviation in the metric's own coordinates (``ρ`` for average-case
                sharpness).
            horizontal: Project the sample horizontally (SPEC §6, average-case).
        """

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """The standard normals :meth:`random_tangent` draws, in the order it draws them.

        Per draw: the shapes it covers (one ``torch.randn`` over their elements, concatenated,
        then split) and its dtype. With :meth:`tangent_from_normals` a caller can draw the
        numbers itself: a rank of a sharded model draws its part of them
        (:mod:`~geosharp.estimators.sharded.draws`). A point on one device.

        Raises:
            NotImplementedError: For a geometry that does not give its draws (the default).
        """
        raise NotImplementedError(f"the random draws of a {type(self).__name__}")

    def tangent_from_normals(
        self, z: Sequence[Tensor], scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """:meth:`random_tangent` from the standard normals it would draw.

        ``z``: one tensor per shape of :meth:`normal_draws`, in its order. The same tangent,
        bit for bit, as :meth:`random_tangent` with a generator that draws these numbers.

        Raises:
            NotImplementedError: For a geometry that does not give its draws (the default).
        """
        raise NotImplementedError(f"the random draws of a {type(self).__name__}")

    # -- conveniences -------------------------------------------------------------------------
    @property
    def tangent_dtype(self) -> torch.dtype:
        """Dtype in which tangent vectors are best kept (default: the point's)."""
        return self.point[0].dtype

    def zeros(self) -> Tangent:
        """The zero tangent vector, in :attr:`tangent_dtype`."""
        return tuple(torch.zeros_like(p, dtype=self.tangent_dtype) for p in self.point)


def euclidean_pairing(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """``Σ a·b`` over the components of two tangents, as a 0-dim float64 tensor.

    The Euclidean pairing of a gradient with a tangent: with a metric-orthogonal projection it
    is the metric inner product of the Riemannian gradient with any horizontal vector
    (:meth:`Geometry.ascent_direction`). One dot product per component, in its dtype, or one
    over the flat buffers when both tangents' components lie in one each, in float32 or float64
    (:func:`~geosharp.geometry.flat.flat_exact`).
    """
    fa, fb = flat_exact(a), flat_exact(b)
    if fa is not None and fb is not None and len(a) == len(b) and fa.numel() == fb.numel():
        # components in one flat buffer each (:mod:`geosharp.geometry.flat`): one dot
        return torch.dot(fa, fb.to(fa.dtype)).to(torch.float64)
    total = None
    for x, y in zip(a, b, strict=True):
        v = torch.dot(x.reshape(-1), y.reshape(-1).to(x.dtype)).to(torch.float64)
        total = v if total is None else total + v.to(total.device)  # scalars meet
    if total is None:
        return torch.zeros((), dtype=torch.float64, device="cpu")
    return total
