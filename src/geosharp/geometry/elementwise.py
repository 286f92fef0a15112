r"""The adaptive (element-wise GL(1)) geometry and the plain Euclidean one (SPEC §2, §5).

Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023) perturbs every weight relative
to its own magnitude. As a Riemannian metric this is

.. code-block:: text

    ⟨η, ζ⟩_w = Σ_i η_i ζ_i / w_i²,      grad_R = e ⊙ w²,      ‖ξ‖ = ‖ξ ⊘ |w|‖₂,

and geodesic sharpness at order 1 with this metric everywhere *is* adaptive ℓ2 sharpness (paper
App. F). Coordinates with ``w_i = 0`` cannot move (their ball has radius 0): they are **frozen** —
every tangent vector, gradient and sample is zero there, never NaN.

The metric ``dw²/w²`` has Christoffel symbol ``Γ(ξ, ξ) = −ξ²/w`` and exact geodesics
``w·exp(tξ/w)``; :meth:`ElementwiseGeometry.geodesic` offers all three orders, though adaptive
sharpness itself uses the straight line (order 1).

Finding the frozen coordinates and zeroing them, in the per-component temporaries ``w²``,
``|w|`` and ``x / |w|`` too, is :mod:`~geosharp.geometry.elementwise_frozen`'s; the metric's
products over many components, a chunk of them at a time, are
:mod:`~geosharp.geometry.elementwise_chunked`'s. :class:`ElementwiseGeometry` mixes both in.

Besides the ℓ2 ball the adaptive ℓ∞ box ``|δ_i| ≤ ρ|w_i|`` (the reference's headline measure) is
provided by :func:`~geosharp.geometry.adaptive_balls.linf_norm` and
:func:`~geosharp.geometry.adaptive_balls.project_linf_ball`.

Example:
    >>> import torch
    >>> w = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    >>> geom = ElementwiseGeometry(w)
    >>> xi = (torch.tensor([0.2, 0.1, 5.0], dtype=torch.float64),)
    >>> geom.project(xi)[0].tolist()  # the zero weight is frozen
    [0.2, 0.1, 0.0]
    >>> round(float(geom.norm_sq(geom.project(xi))), 6)  # (0.2/2)² + (0.1/1)²
    0.02
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from geosharp.geometry._validate import check_like, check_order, check_tensor
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent
from geosharp.geometry.draws import draw_like
from geosharp.geometry.elementwise_chunked import ElementwiseChunkedProducts
from geosharp.geometry.elementwise_frozen import ElementwiseFrozen, _frozen_of
from geosharp.geometry.flat import flat_exact


def _cut_rows(point: Sequence[Tensor], rows: Mapping[int, Tensor]) -> tuple[Tensor, ...]:
    """The components ``c`` in ``rows`` cut to ``point[c][rows[c]]``, the others as they are."""
    return tuple(t.index_select(0, rows[c]) if c in rows else t for c, t in enumerate(point))


class ElementwiseGeometry(ElementwiseFrozen, ElementwiseChunkedProducts, Geometry):
    """Adaptive metric ``Σ η_i ζ_i / w_i²`` at the base point ``w``: one tensor or several.

    The point may be one tensor (any shape) or a tuple of tensors, e.g. every parameter of a
    model outside the symmetry blocks: tangents are then tuples with one tensor per component
    and the metric is the sum over components (a product of element-wise metrics). Nothing of
    the size of ``w`` is stored for components whose every coordinate can move — ``1/w²``,
    ``w²`` and ``|w|`` are recomputed per component, in temporaries the size of one component —
    so a point made of a model's own parameter tensors costs no memory at all. Components with
    frozen coordinates keep their masked ``1/w²``.

    Args:
        w: The weights: a floating tensor, or a sequence of floating tensors on one device.
            Exact zeros (and weights whose ``1/w²`` overflows) are frozen coordinates.
        name: Name used in error messages.

    Raises:
        TypeError: If a component is not a floating tensor.
    """

    #: :meth:`normal_draws` is one draw over the point (:func:`draw_like`'s numbers).
    draws_over_point = True

    #: No vertical space: the projection (zeroing frozen coordinates) is metric-orthogonal.
    orthogonal_projection = True

    def __init__(self, w: Tensor | Sequence[Tensor], name: str = "tensor") -> None:
        parts = (w,) if isinstance(w, Tensor) else tuple(w)
        if not parts:
            raise ValueError(f"{name}: an element-wise geometry needs at least one tensor")
        for t in parts:
            check_tensor("w", t)
        self.point: Point = parts
        self.name = name
        # Frozen: exact zeros, and weights so small that 1/w² overflows the dtype (a ball of
        # radius ρ|w| < 1e-19 there; e.g. float32 LayerNorm weights ~5e-33 in MiniLM). Only the
        # components that have such coordinates keep where they are: their flat positions when
        # few (an embedding's padding row), else a boolean mask; nothing parameter-sized.
        scratch: dict = {}  # one |w| buffer for every component
        self._frozen: list[Tensor | None] = [_frozen_of(t, scratch) for t in parts]
        self.has_frozen = any(f is not None for f in self._frozen)
        self._whole: list[bool] | None = None  # components frozen throughout (_whole_frozen)

    def with_rows(self, rows: Mapping[int, Tensor]) -> ElementwiseGeometry:
        """The same geometry with some components cut down to some of their rows.

        Args:
            rows: Component → row indices (``long``, along dimension 0); the new component is
                ``point[c][rows]`` (a copy of those rows), the others are shared as they are.

        Returns:
            A new geometry (the frozen coordinates of the untouched components are shared).
        """
        new = copy.copy(self)
        new.point = _cut_rows(self.point, rows)
        new._frozen = [
            _frozen_of(new.point[c]) if c in rows else f for c, f in enumerate(self._frozen)
        ]
        new.has_frozen = any(f is not None for f in new._frozen)
        new._whole = None
        return new

    # -- single-tensor conveniences (the point has one component) ----------------------------
    @property
    def w(self) -> Tensor:
        """The weights, when the point is a single tensor."""
        return self._single(self.point)

    def _single(self, parts: Sequence[Tensor]) -> Tensor:
        if len(parts) != 1:
            raise TypeError(
                f"{self.name} has {len(self.point)} components; use the *_parts methods"
            )
        return parts[0]

    @property
    def inv_w2(self) -> Tensor:
        """``1/w²`` on moving coordinates, 0 on frozen ones (single tensor; a temporary)."""
        return self._single(self.inv_w2_parts())

    @property
    def mask(self) -> Tensor:
        """``True`` on the coordinates that can move (single tensor; a temporary)."""
        return self._single(self.mask_parts())

    @property
    def w2(self) -> Tensor:
        """``w²`` on moving coordinates, 0 on frozen ones (single tensor; a temporary)."""
        return self._single(self.w2_parts())

    @property
    def abs_w(self) -> Tensor:
        """``|w|`` on moving coordinates, 0 on frozen ones (single tensor; a temporary)."""
        return self._single(self.abs_w_parts())

    # -- per component (temporaries) -----------------------------------------------------------
    def inv_w2_parts(self) -> tuple[Tensor, ...]:
        """``1/w²`` per component, 0 on frozen coordinates."""
        return tuple(
            self._zero_frozen_(t.reciprocal().square_(), k) for k, t in enumerate(self.point)
        )

    def mask_parts(self) -> tuple[Tensor, ...]:
        """Per component, ``True`` on the coordinates that can move."""
        return tuple(
            self._zero_frozen_(torch.ones_like(t, dtype=torch.bool), k, False)
            for k, t in enumerate(self.point)
        )

    def w2_parts(self) -> tuple[Tensor, ...]:
        """``w²`` per component, 0 on frozen coordinates."""
        return tuple(self._w2(k) for k in range(len(self.point)))

    def abs_w_parts(self) -> tuple[Tensor, ...]:
        """``|w|`` per component, 0 on frozen coordinates."""
        return tuple(self._abs(k) for k in range(len(self.point)))

    def coordinate_norm_sq(self, xi: Tangent) -> tuple[Tensor, ...]:
        """``ξ_i² / w_i²`` per coordinate (0 on frozen ones), one tensor per component."""
        x = self._check(xi)
        return tuple(self._scaled(t, k).square_() for k, t in enumerate(x))

    def riemannian_grad_(self, egrad: Tensor | Sequence[Tensor]) -> Tensor | tuple[Tensor, ...]:
        """``e ⊙ w²`` written into ``egrad`` (zero on frozen coordinates)."""
        if isinstance(egrad, Tensor):
            return egrad.mul_(self.w2)
        return tuple(e.mul_(self._w2(k)) for k, e in enumerate(egrad))

    def ascent_direction_(self, egrad: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """:meth:`ascent_direction` written into ``egrad``: ``d = e ⊙ w²`` and ``Σ (e w)²``.

        ``e ← e ⊙ w`` (frozen coordinates zeroed), ``⟨d, d⟩ = e·e``, then ``e ← e ⊙ w``: two
        element-wise passes and a norm, each one multi-tensor op over the components (the
        values of ``t = e ⊙ w; d = t ⊙ w``). The norm is one dot product over the components'
        flat buffer where they lie in one, in float32 or float64
        (:func:`~geosharp.geometry.flat.flat_exact`), else one per component, summed.
        """
        e = list(egrad)
        w = list(self.point)
        torch._foreach_mul_(e, w)
        self._zero_frozen_all_(e)
        flat = flat_exact(e)
        if flat is not None:
            total = torch.dot(flat, flat)
        else:
            total = None
            for t in e:
                v = torch.dot(t.reshape(-1), t.reshape(-1))
                total = v if total is None else total + v.to(total.device)  # scalars meet
        torch._foreach_mul_(e, w)
        assert total is not None
        return tuple(e), total.to(torch.float64)

    def ascent_direction(self, egrad: Tangent) -> tuple[Tangent, Tensor]:
        """``d = e ⊙ w²`` (zero on frozen coordinates) and ``⟨d, d⟩ = Σ e² w²``."""
        e = self._check(egrad, "egrad")
        return self.ascent_direction_(tuple(t.clone() for t in e))

    def horizontal_grad_(self, egrad: Tangent) -> Tangent:
        """``e ⊙ w²`` in place (:meth:`riemannian_grad_`): zero on frozen coordinates already."""
        return self.riemannian_grad_(tuple(egrad))

    def box_scale(self) -> tuple[Tensor, ...]:
        """``|w|``: the adaptive box ``|ξ_i| ≤ ρ|w_i|`` (one multi-tensor ``abs``)."""
        out = torch._foreach_abs(list(self.point))
        self._zero_frozen_all_(out)
        return tuple(out)

    def pulls_back(self, order: int | str) -> bool:
        """At order 1 (``w + ξ``)."""
        return order == 1

    def is_straight(self, order: int | str) -> bool:
        """At order 1 (``w + ξ``)."""
        return order == 1

    def _check(self, xi: Tangent, name: str = "xi") -> tuple[Tensor, ...]:
        return _check_components(self.point, self.name, xi, name)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """``Σ_i a_i b_i / w_i²`` over the non-frozen coordinates (a 0-dim tensor)."""
        return self._scaled_dot(self._check(a, "a"), self._check(b, "b"))

    def norm_sq(self, xi: Tangent) -> Tensor:
        """``Σ_i ξ_i² / w_i²`` (temporaries of a chunk of components, :data:`_CHUNK`)."""
        x = self._check(xi)
        return self._scaled_dot(x, x)

    def project(self, xi: Tangent) -> Tangent:
        """Zero the frozen coordinates (``w_i = 0`` or ``1/w_i²`` not finite)."""
        x = self._check(xi)
        if not self.has_frozen:
            return x
        return tuple(
            t if f is None else self._zero_frozen_(t.clone(), k)
            for k, (t, f) in enumerate(zip(x, self._frozen, strict=True))
        )

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """``e ⊙ w²`` (zero on frozen coordinates)."""
        e = self._check(egrad, "egrad")
        return tuple(t * self._w2(k) for k, t in enumerate(e))

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """``Γ_w(ξ, ξ) = −ξ² / w`` (zero on frozen coordinates)."""
        out = []
        for w, x in zip(point, xi, strict=True):
            mask = w != 0
            w_safe = torch.where(mask, w, torch.ones_like(w))
            out.append(torch.where(mask, -x.square() / w_safe, torch.zeros_like(x)))
        return tuple(out)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Endpoint of the geodesic; ``"exact"`` is the closed form ``w·exp(ξ/w)``."""
        x = self._check(xi)
        if order == "exact":
            out = []
            for w, t, m in zip(self.point, x, self.mask_parts(), strict=True):
                w_safe = torch.where(m, w, torch.ones_like(w))
                out.append(torch.where(m, w * torch.exp(t / w_safe), w))
            return tuple(out)
        return super().geodesic(x, order=order, steps=steps)

    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        """``ξ = scale · Z ⊙ |w|`` — adaptive average-case noise ``δ_i ~ N(0, ρ² w_i²)``.

        One draw of all coordinates in component order (the same numbers as one draw over
        the concatenated components), then split: the noise does not depend on how the
        point is cut into components.
        """
        return self.tangent_from_normals(draw_like(self.point, generator), scale)

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """One draw over every component, in the dtype of the first (:func:`draw_like`)."""
        return _one_draw(self.point)

    def tangent_from_normals(
        self, z: Sequence[Tensor], scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """``scale · Z ⊙ |w|`` from the normals ``Z`` (one tensor per component).

        Multi-tensor ops (:meth:`box_scale`'s ``|w|``): one dispatch each, not per component.
        """
        z = list(z)
        if torch.is_grad_enabled() and any(t.requires_grad for t in z):
            return tuple(scale * zk * self._abs(k) for k, zk in enumerate(z))
        out = torch._foreach_mul(z, scale)
        torch._foreach_mul_(out, list(self.box_scale()))
        return tuple(out)


class EuclideanGeometry(Geometry):
    """The flat metric ``⟨η, ζ⟩ = Σ η_i ζ_i`` of plain (non-adaptive) sharpness.

    Args:
        w: The weights: one tensor (any shape) or a sequence of tensors (the components of
            a product, as for :class:`ElementwiseGeometry`).
        name: Name used in error messages.
    """

    #: :meth:`normal_draws` is one draw over the point (:func:`draw_like`'s numbers).
    draws_over_point = True

    #: No vertical space: the projection is the identity.
    orthogonal_projection = True

    def __init__(self, w: Tensor | Sequence[Tensor], name: str = "tensor") -> None:
        parts = (w,) if isinstance(w, Tensor) else tuple(w)
        if not parts:
            raise ValueError(f"{name}: a Euclidean geometry needs at least one tensor")
        for t in parts:
            check_tensor("w", t)
        self.name = name
        self.point: Point = parts

    def with_rows(self, rows: Mapping[int, Tensor]) -> EuclideanGeometry:
        """The same geometry with some components cut down to some of their rows.

        See :meth:`ElementwiseGeometry.with_rows`.
        """
        new = copy.copy(self)
        new.point = _cut_rows(self.point, rows)
        return new

    @property
    def w(self) -> Tensor:
        """The weights, when the point is a single tensor."""
        if len(self.point) != 1:
            raise TypeError(f"{self.name} has {len(self.point)} components")
        return self.point[0]

    def _check(self, xi: Tangent, name: str = "xi") -> tuple[Tensor, ...]:
        return _check_components(self.point, self.name, xi, name)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """``Σ a_i b_i``."""
        total = None
        for x, y in zip(self._check(a, "a"), self._check(b, "b"), strict=True):
            v = torch.dot(x.reshape(-1), y.reshape(-1))
            total = v if total is None else total + v.to(total.device)  # scalars meet
        return total

    def project(self, xi: Tangent) -> Tangent:
        """Identity: the Euclidean ball knows no symmetry."""
        return self._check(xi)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Identity."""
        return self._check(egrad, "egrad")

    def horizontal_grad(self, egrad: Tangent) -> Tangent:
        """``e`` itself: no metric, no symmetry."""
        return tuple(egrad)

    def coordinate_norm_sq(self, xi: Tangent) -> tuple[Tensor, ...]:
        """``ξ_i²``."""
        return tuple(t.square() for t in xi)

    def pulls_back(self, order: int | str) -> bool:
        """At order 1 (``w + ξ``)."""
        return order == 1

    def is_straight(self, order: int | str) -> bool:
        """Always: straight lines are the geodesics."""
        return True

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Zero: straight lines are the geodesics."""
        return tuple(torch.zeros_like(x) for x in xi)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """The straight line ``w + ξ``, exact for every order."""
        check_order(order)
        return tuple(w + x for w, x in zip(self.point, self._check(xi), strict=True))

    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        """``scale · Z`` (one draw over all components, then split)."""
        return self.tangent_from_normals(draw_like(self.point, generator), scale)

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """One draw over every component, in the dtype of the first (:func:`draw_like`)."""
        return _one_draw(self.point)

    def tangent_from_normals(
        self, z: Sequence[Tensor], scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        """``scale · Z`` from the normals ``Z`` (one tensor per component)."""
        return tuple(scale * zk for zk in z)


def _one_draw(point: Sequence[Tensor]) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
    """The one draw of :func:`draw_like` over ``point``'s components (none for no component)."""
    return [(tuple(t.shape for t in point), point[0].dtype)] if point else []


def _check_components(
    point: Sequence[Tensor], owner: str, xi: Tangent, name: str
) -> tuple[Tensor, ...]:
    """A tangent: one tensor per component of ``point``, each shaped like it."""
    if not isinstance(xi, (tuple, list)) or len(xi) != len(point):
        raise TypeError(
            f"{name} must be a {len(point)}-tuple of tensors (one per component of {owner})"
        )
    for t, w in zip(xi, point, strict=True):
        check_like(name, t, "w", w)
    return tuple(xi)
