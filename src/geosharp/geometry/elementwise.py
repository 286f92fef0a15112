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

Besides the ℓ2 ball the adaptive ℓ∞ box ``|δ_i| ≤ ρ|w_i|`` (the reference's headline measure) is
provided by :func:`linf_norm` and :func:`project_linf_ball`.

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

import torch
from torch import Tensor

from geosharp.geometry._validate import check_like, check_order, check_tensor
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent


class ElementwiseGeometry(Geometry):
    """Adaptive metric ``Σ η_i ζ_i / w_i²`` at the base point ``w`` (any shape).

    Args:
        w: The weights, any shape, floating dtype. Exact zeros (and weights whose ``1/w²``
            overflows) are frozen coordinates.
        name: Name used in error messages.

    Raises:
        TypeError: If ``w`` is not a floating tensor.
    """

    def __init__(self, w: Tensor, name: str = "tensor") -> None:
        check_tensor("w", w)
        self.w = w
        self.name = name
        self.point: Point = (w,)
        # Frozen: exact zeros, and weights so small that 1/w² overflows the dtype (a ball of
        # radius ρ|w| < 1e-19 there; e.g. float32 LayerNorm weights ~5e-33 in MiniLM).
        # Only 1/w² is stored (one parameter-sized buffer beside w): w², |w| and the mask are
        # recomputed where they are needed, in temporaries that live for one operation.
        inv_w2 = w.reciprocal().square_()
        mask = (w != 0) & torch.isfinite(inv_w2)
        # 1/w² on moving coordinates, 0 on frozen ones: the metric restricted to what can move.
        self.inv_w2 = inv_w2.masked_fill_(~mask, 0.0)
        self.has_frozen = not bool(mask.all())
        del mask

    @property
    def mask(self) -> Tensor:
        """``True`` on the coordinates that can move (a temporary)."""
        return self.inv_w2 != 0

    @property
    def w2(self) -> Tensor:
        """``w²`` on moving coordinates, 0 on frozen ones (a temporary)."""
        w2 = self.w.square()
        return w2.masked_fill_(~self.mask, 0.0) if self.has_frozen else w2

    @property
    def abs_w(self) -> Tensor:
        """``|w|`` on moving coordinates, 0 on frozen ones (a temporary)."""
        a = self.w.abs()
        return a.masked_fill_(~self.mask, 0.0) if self.has_frozen else a

    def riemannian_grad_(self, egrad: Tensor) -> Tensor:
        """``e ⊙ w²`` written into ``egrad`` (zero on frozen coordinates)."""
        return egrad.mul_(self.w2)

    def _check(self, xi: Tangent, name: str = "xi") -> Tensor:
        if not isinstance(xi, (tuple, list)) or len(xi) != 1:
            raise TypeError(f"{name} must be a 1-tuple (xi,) of tensors")
        return check_like(name, xi[0], "w", self.w)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """``Σ_i a_i b_i / w_i²`` over the non-frozen coordinates (a 0-dim tensor)."""
        return (self._check(a, "a") * self._check(b, "b") * self.inv_w2).sum()

    def norm_sq(self, xi: Tangent) -> Tensor:
        """``Σ_i ξ_i² / w_i²`` (one temporary, for large tensors)."""
        x = self._check(xi).reshape(-1)
        return torch.dot(x, x * self.inv_w2.reshape(-1))

    def project(self, xi: Tangent) -> Tangent:
        """Zero the frozen coordinates (``w_i = 0`` or ``1/w_i²`` not finite)."""
        x = self._check(xi)
        if not self.has_frozen:
            return (x,)
        return (torch.where(self.mask, x, torch.zeros_like(x)),)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """``e ⊙ w²`` (zero on frozen coordinates)."""
        return (self._check(egrad, "egrad") * self.w2,)

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """``Γ_w(ξ, ξ) = −ξ² / w`` (zero on frozen coordinates)."""
        (w,) = point
        (x,) = xi
        mask = w != 0
        w_safe = torch.where(mask, w, torch.ones_like(w))
        return (torch.where(mask, -x.square() / w_safe, torch.zeros_like(x)),)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Endpoint of the geodesic; ``"exact"`` is the closed form ``w·exp(ξ/w)``."""
        x = self._check(xi)
        if order == "exact":
            w_safe = torch.where(self.mask, self.w, torch.ones_like(self.w))
            return (torch.where(self.mask, self.w * torch.exp(x / w_safe), self.w),)
        return super().geodesic((x,), order=order, steps=steps)

    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        """``ξ = scale · Z ⊙ |w|`` — adaptive average-case noise ``δ_i ~ N(0, ρ² w_i²)``."""
        z = torch.randn(self.w.shape, generator=generator, dtype=self.w.dtype, device=self.w.device)
        return (scale * z * self.abs_w,)


class EuclideanGeometry(Geometry):
    """The flat metric ``⟨η, ζ⟩ = Σ η_i ζ_i`` of plain (non-adaptive) sharpness.

    Args:
        w: The weights (any shape).
        name: Name used in error messages.
    """

    def __init__(self, w: Tensor, name: str = "tensor") -> None:
        check_tensor("w", w)
        self.w = w
        self.name = name
        self.point: Point = (w,)

    def _check(self, xi: Tangent, name: str = "xi") -> Tensor:
        if not isinstance(xi, (tuple, list)) or len(xi) != 1:
            raise TypeError(f"{name} must be a 1-tuple (xi,) of tensors")
        return check_like(name, xi[0], "w", self.w)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """``Σ a_i b_i``."""
        return (self._check(a, "a") * self._check(b, "b")).sum()

    def project(self, xi: Tangent) -> Tangent:
        """Identity: the Euclidean ball knows no symmetry."""
        return (self._check(xi),)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Identity."""
        return (self._check(egrad, "egrad"),)

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Zero: straight lines are the geodesics."""
        return (torch.zeros_like(xi[0]),)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """The straight line ``w + ξ``, exact for every order."""
        check_order(order)
        return (self.w + self._check(xi),)

    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
    ) -> Tangent:
        """``scale · Z``."""
        z = torch.randn(self.w.shape, generator=generator, dtype=self.w.dtype, device=self.w.device)
        return (scale * z,)


# ---------------------------------------------------------------------------------------------
# Adaptive balls (element-wise), used by the ℓ2 and ℓ∞ adaptive sharpness baselines.
# ---------------------------------------------------------------------------------------------
def adaptive_norm(w: Tensor, xi: Tensor, p: float = 2.0) -> Tensor:
    """``‖ξ ⊘ |w|‖_p`` over the non-frozen coordinates (``w_i ≠ 0``).

    Args:
        w: Weights.
        xi: Perturbation, shaped like ``w``.
        p: ``2`` or ``float("inf")``.

    Returns:
        A 0-dim tensor.

    Raises:
        ValueError: If ``p`` is not 2 or inf.
    """
    check_tensor("w", w)
    check_like("xi", xi, "w", w)
    mask = w != 0
    r = torch.where(mask, xi / torch.where(mask, w, torch.ones_like(w)), torch.zeros_like(xi))
    if p == 2:
        return r.square().sum().sqrt()
    if p == float("inf"):
        return r.abs().max() if r.numel() else r.sum()
    raise ValueError(f"p must be 2 or inf, got {p!r}")


def linf_norm(w: Tensor, xi: Tensor) -> Tensor:
    """Adaptive ℓ∞ norm ``max_i |ξ_i| / |w_i|`` over non-frozen coordinates."""
    return adaptive_norm(w, xi, float("inf"))


def project_linf_ball(w: Tensor, xi: Tensor, rho: float) -> Tensor:
    """Euclidean projection onto the adaptive box ``|ξ_i| ≤ ρ |w_i|`` (a clamp; zeros frozen).

    Example:
        >>> import torch
        >>> w = torch.tensor([1.0, -2.0, 0.0])
        >>> project_linf_ball(w, torch.tensor([0.5, 0.5, 0.5]), rho=0.1).tolist()
        [0.10000000149011612, 0.20000000298023224, 0.0]
    """
    bound = rho * w.abs()
    return torch.maximum(torch.minimum(xi, bound), -bound)


def project_l2_ball(w: Tensor, xi: Tensor, rho: float) -> Tensor:
    """Metric projection onto the adaptive ball ``‖ξ ⊘ |w|‖₂ ≤ ρ`` (a radial rescale)."""
    xi = torch.where(w != 0, xi, torch.zeros_like(xi))
    n = adaptive_norm(w, xi, 2.0)
    return xi * torch.clamp(rho / n.clamp_min(torch.finfo(xi.dtype).tiny), max=1.0)
