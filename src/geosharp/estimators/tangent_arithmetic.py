"""The arithmetic of perturbations ``ξ``: combinations, the ball's metric, its gradient, draws.

A perturbation ``ξ`` of a :class:`~geosharp.estimators.perturbation.Perturbation` is a list with
one tangent tuple per piece (:data:`~geosharp.estimators.pieces.Xi`). :class:`TangentArithmetic`,
a mixin of :class:`~geosharp.estimators.perturbation.Perturbation`, holds what is done to such
lists piece by piece, in the ball's metric (SPEC §5, §6): the zero perturbation and linear
combinations (multi-tensor ops), the squared norm and the inner product of the one global ball
(summed over the pieces, :mod:`~geosharp.estimators.reductions`, and over the ranks holding the
other shards), the horizontal projection, the Riemannian gradient and Auto-PGD's ascent
direction with its pairings, and the isotropic Gaussian draw. Its methods are documented with
:class:`~geosharp.estimators.perturbation.Perturbation`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.estimators.pieces import Xi
from geosharp.estimators.reductions import ascent_sums, scalar_sum
from geosharp.geometry.draws import generator_for

__all__ = ["TangentArithmetic"]


class TangentArithmetic:
    """The tangent-vector arithmetic of a :class:`~geosharp.estimators.perturbation.Perturbation`.

    A mixin of it: reads the perturbation's ``pieces``, ``reduce`` and ``draws``.
    """

    def zeros(self) -> Xi:
        """The zero perturbation."""
        return [p.geometry.zeros() for p in self.pieces]

    @staticmethod
    def combine(a: Xi, b: Xi, alpha: float = 1.0, beta: float = 1.0) -> Xi:
        """``alpha·a + beta·b`` piece by piece (multi-tensor ops: one dispatch each per piece)."""
        out = []
        for ta, tb in zip(a, b, strict=True):
            if len(ta) != len(tb):
                raise ValueError(f"combine: {len(ta)} components and {len(tb)}")
            same = all(x.dtype == y.dtype for x, y in zip(ta, tb, strict=True))
            graph = torch.is_grad_enabled() and any(t.requires_grad for t in (*ta, *tb))
            if not ta or not same or graph:  # (mixed dtypes promote, as alpha·x + beta·y does)
                out.append(tuple(alpha * x + beta * y for x, y in zip(ta, tb, strict=True)))
                continue
            sa = torch._foreach_mul(list(ta), alpha)
            sb = torch._foreach_mul(list(tb), beta)
            torch._foreach_add_(sa, sb)
            out.append(tuple(sa))
        return out

    def norm_sq(self, xi: Xi) -> Tensor:
        """Squared norm of the whole perturbation: the sum over pieces (one global ball)."""
        pairs = zip(self.pieces, xi, strict=True)
        total = scalar_sum(p.norm_geometry.norm_sq(x).sum() for p, x in pairs)
        return total if self.reduce is None else self.reduce(torch.as_tensor(total))

    def inner(self, a: Xi | None, b: Xi | None) -> float:
        """The metric inner product ``⟨a, b⟩`` summed over pieces (``None``: the zero tangent)."""
        if a is None or b is None:
            return 0.0
        pairs = zip(self.pieces, a, b, strict=True)
        total = scalar_sum(p.norm_geometry.inner(x, y).sum() for p, x, y in pairs)
        return float(total if self.reduce is None else self.reduce(torch.as_tensor(total)))

    def norm(self, xi: Xi) -> float:
        """Norm ``‖ξ‖`` as a float."""
        return float(self.norm_sq(xi).clamp_min(0).sqrt())

    def project(self, xi: Xi) -> Xi:
        """Horizontal projection of every piece, in the ball's metric (frozen ones zeroed)."""
        return [p.norm_geometry.project(x) for p, x in zip(self.pieces, xi, strict=True)]

    def riemannian_grad(self, egrad: Xi, inplace: bool = False) -> Xi:
        """Riemannian gradient in the ball's metric, projected horizontally (SPEC §6, step 3).

        With ``inplace=True`` the element-wise pieces of ``egrad`` are overwritten (``e ⊙ w²``
        is already zero on frozen coordinates, so it needs no projection).
        """
        out = []
        for p, e in zip(self.pieces, egrad, strict=True):
            g = p.norm_geometry
            out.append(
                g.horizontal_grad_(e) if inplace and p.geometry is g else g.horizontal_grad(e)
            )
        return out

    def ascent_direction(
        self, egrad: Xi, pairs: Sequence[Xi | None] = (), inplace: bool = False
    ) -> tuple[Xi, float, list[float]]:
        """The ascent direction ``d`` (:meth:`riemannian_grad`) with ``‖d‖²`` and ``⟨ξ, d⟩``.

        Wherever a piece's projection is metric-orthogonal
        (:attr:`~geosharp.geometry.Geometry.orthogonal_projection`) these numbers are
        Euclidean pairings with the gradient: ``⟨d, d⟩ = e·d`` and, ``ξ`` being horizontal,
        ``⟨ξ, d⟩ = ⟨ξ, g⁻¹e⟩ = e·ξ`` (one pass each, no metric products). Other pieces use
        their metric. Auto-PGD needs them for the norms of its combinations of ``ξ_k``,
        ``ξ_{k−1}`` and ``d`` without forming them.

        Args:
            egrad: ``∂L/∂ξ`` at ``ξ``.
            pairs: Horizontal tangents ``ξ`` whose ``⟨ξ, d⟩`` is wanted (``None``: ``ξ = 0``).
            inplace: Let the element-wise pieces of ``egrad`` be overwritten (as in
                :meth:`riemannian_grad`).

        Returns:
            ``(d, ‖d‖², [⟨ξ, d⟩ for ξ in pairs])``, the numbers as floats.
        """
        out, sums = ascent_sums(self.pieces, egrad, pairs, inplace)
        if self.reduce is not None:  # one collective for every number of the step
            dev = next((v.device for v in sums if v is not None), None)
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            stacked = torch.stack([zero if v is None else v.to(dev) for v in sums])
            sums = list(self.reduce(stacked).unbind())
        dd, *inner = (0.0 if v is None else float(v) for v in sums)
        return out, dd, inner

    def random(self, generator: torch.Generator | None, scale: float) -> Xi:
        """Isotropic Gaussian in the metric of every piece, projected horizontally (SPEC §6)."""
        if self.draws is not None:
            return self.draws.random(self, generator, scale)
        out = []
        for p in self.pieces:  # each piece's noise made on its device
            point = p.geometry.point
            gen = generator_for(generator, point[0].device) if point else generator
            xi = p.norm_geometry.random_tangent(gen, scale)
            dtype = p.geometry.tangent_dtype
            out.append(tuple(t.to(dtype) for t in xi))
        return out
