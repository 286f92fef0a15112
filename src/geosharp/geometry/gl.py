r"""Riemannian geometry of a GL(h) symmetry block (SPEC §4).

A GL(h) block is a pair ``G ∈ R^{n×h}``, ``H ∈ R^{m×h}`` on which the network depends only through
``G Hᵀ``. The group GL(h) acts by ``(G, H) ↦ (G A⁻¹, H Aᵀ)``; in self-attention every head has two
such blocks, ``(W_Q, W_K)`` and ``(W_V, W_O)``. Sharpness is measured on the quotient manifold
(weights modulo this action) with one of two GL(h)-invariant metrics, built from the damped Gram
matrices ``M_G = GᵀG + εI`` and ``M_H = HᵀH + εI`` of the **base point**:

.. code-block:: text

    inv:  ⟨η, ζ⟩ = tr(M_G⁻¹ η_Gᵀ ζ_G) + tr(M_H⁻¹ η_Hᵀ ζ_H)
    mix:  ⟨η, ζ⟩ = tr(M_H η_Gᵀ ζ_G)  + tr(M_G η_Hᵀ ζ_H)

Vertical vectors (along the orbit) are ``(−GΩ, HΩᵀ)``; horizontal ones are metric-orthogonal to
all of them (inv: ``ξ_Gᵀ G M_H = M_G Hᵀ ξ_H``; mix: ``Gᵀ ξ_G M_H = M_G ξ_Hᵀ H``). Both metrics are
exactly invariant, and the horizontal projection exactly idempotent, at ``ε = 0``; ``ε > 0`` is
the paper's relaxation for near-singular blocks (SPEC §4) and perturbs both by ``O(ε/σ²_min)``.

Everything is batched over any leading dimensions (e.g. ``layers × heads``), differentiable,
and dtype/device agnostic. The formulas are the pure functions of
:mod:`~geosharp.geometry.gl_math`; :class:`GLGeometry` factorizes the base point once
(:mod:`~geosharp.geometry.gl_factors`) and evaluates them under one execution policy
(:class:`~geosharp.geometry.gl_execution.GLExecution`: dtypes, chunks of heads), running the
per-step products chunk by chunk of heads (:mod:`~geosharp.geometry.gl_chunked`). The group
action is :mod:`~geosharp.geometry.gl_action`'s; its random draws are
:mod:`~geosharp.geometry.gl_sampling`'s.

Example:
    >>> import torch
    >>> from geosharp.geometry.gl import GLGeometry
    >>> from geosharp.geometry.gl_action import act, act_tangent
    >>> g = torch.Generator().manual_seed(0)
    >>> G = torch.randn(4, 6, 3, dtype=torch.float64, generator=g)   # 4 heads, n=6, h=3
    >>> H = torch.randn(4, 5, 3, dtype=torch.float64, generator=g)
    >>> geom = GLGeometry(G, H, metric="inv")
    >>> xi = geom.project((0.1 * torch.randn_like(G), 0.1 * torch.randn_like(H)))
    >>> Gp, Hp = geom.geodesic(xi, order=2)
    >>> A = torch.randn(4, 3, 3, dtype=torch.float64, generator=g)  # a random group element
    >>> geom_A = GLGeometry(*act(G, H, A), metric="inv")
    >>> GpA, HpA = geom_A.geodesic(act_tangent(*xi, A), order=2)
    >>> bool(torch.allclose(GpA @ HpA.mT, Gp @ Hp.mT))  # the perturbed function is invariant
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from geosharp.geometry import gl_math
from geosharp.geometry._validate import (
    check_eps,
    check_like,
    check_metric,
    check_order,
    check_steps,
    check_tensor,
)
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent
from geosharp.geometry.gl_chunked import GLChunkedProducts
from geosharp.geometry.gl_diagnose import exact_geodesic_trouble, relative_speed
from geosharp.geometry.gl_endpoint import order2_adjoint_by_chunks, order2_factors_by_chunks
from geosharp.geometry.gl_execution import GLExecution, by_head
from geosharp.geometry.gl_factors import (
    GLFactors,
    RankCheck,
    check_rank,
    factorize,
    gram_matrices,
)
from geosharp.geometry.gl_rows import RowSum
from geosharp.geometry.gl_sampling import GLSampling

#: Reads ``(G, H)`` of some flattened heads in a dtype (:meth:`GLGeometry.read_point_from`).
PointReader = Callable[[slice, torch.dtype], tuple[Tensor, Tensor]]

__all__ = ["DEFAULT_EPS", "GLGeometry"]

#: Default damping of the Gram matrices. ``0`` keeps the metrics exactly GL(h)-invariant;
#: a rank-deficient block then raises an error that suggests ``eps > 0``.
DEFAULT_EPS = 0.0


class GLGeometry(GLSampling, GLChunkedProducts, Geometry):
    r"""The geometry of one (batched) GL(h) block at a fixed base point ``(G, H)``.

    All base-point work — Gram matrices, their inverses and the eigendecomposition behind the
    inv-metric Sylvester solve — is done once here (:attr:`factors`), so each method afterwards
    costs a few batched ``h × h`` and ``n × h`` matmuls of :mod:`~geosharp.geometry.gl_math`,
    in the dtypes and chunks of heads of :attr:`execution`. Inputs and outputs keep the dtype
    of ``G`` (tangents: :attr:`tangent_dtype`).

    A geometry of a subgroup of GL(h) (:class:`~geosharp.geometry.GLSubgroupGeometry`) has the
    same metric and geodesics and replaces only the vertical-space solve: :meth:`_factorize`
    (the factors its solve needs) and :meth:`_lam`.

    Args:
        G: Left factor, shape ``(..., n, h)``.
        H: Right factor, shape ``(..., m, h)`` with the same leading dimensions and ``h``.
        metric: ``"inv"`` or ``"mix"`` (SPEC §4).
        eps: Damping ``ε ≥ 0`` added to both Gram matrices.
        name: Name of the block, used in error messages.
        head_names: Optional readable name of every element of the (flattened) leading batch,
            e.g. ``"encoder.layer.3.attention[QK] head 5"``, used in error messages.
        execution: The execution policy (dtypes, chunks of heads; default
            :class:`~geosharp.geometry.gl_execution.GLExecution`'s defaults: float64
            factorizations and products, tangents in the dtype of ``G``).
        work_dtype: Sets ``execution.work_dtype`` (the dtype of the per-step products; the
            keyword the symmetry blocks pass).

    Raises:
        TypeError: If ``G`` or ``H`` is not a floating tensor, or their dtypes differ.
        ValueError: On mismatched shapes, an unknown metric, ``eps < 0``, or, at ``eps = 0``, a
            (numerically) singular Gram matrix.
    """

    def __init__(
        self,
        G: Tensor,
        H: Tensor,
        metric: str = "inv",
        eps: float = DEFAULT_EPS,
        name: str = "GL block",
        head_names: Sequence[str] | None = None,
        *,
        execution: GLExecution | None = None,
        work_dtype: torch.dtype | None = None,
    ) -> None:
        check_tensor("G", G)
        check_tensor("H", H)
        if G.dim() < 2 or H.dim() < 2:
            raise ValueError(
                f"G and H must have at least 2 dimensions (..., n, h) and (..., m, h); "
                f"got shapes {tuple(G.shape)} and {tuple(H.shape)}"
            )
        if G.shape[:-2] != H.shape[:-2] or G.shape[-1] != H.shape[-1]:
            raise ValueError(
                f"G (..., n, h) and H (..., m, h) must share leading dims and h; got shapes "
                f"{tuple(G.shape)} and {tuple(H.shape)}"
            )
        if G.dtype != H.dtype:
            raise TypeError(f"G has dtype {G.dtype} but H has {H.dtype}")
        if G.device != H.device:
            raise ValueError(f"G is on {G.device} but H is on {H.device}")
        self.metric = check_metric(metric)
        self.eps = check_eps(eps)
        self.name = name
        self.head_names = list(head_names) if head_names is not None else None
        self.G, self.H = G, H
        self.point: Point = (G, H)
        self.dtype = G.dtype
        policy = execution or GLExecution()
        if work_dtype is not None:
            policy = dataclasses.replace(policy, work_dtype=work_dtype)
        #: The resolved execution policy (every dtype concrete).
        self.execution = ex = policy.resolve(G.dtype)
        h = G.shape[-1]

        def check(which: str, lam: Tensor) -> None:  # on both spectra, before any inverse
            check_rank(
                lam, h, self.dtype, self.eps, which, name=self.name, head_names=self.head_names
            )

        held = ex.hold_point and ex.work_dtype == ex.factor_dtype  # the copy is held anyway
        if held or G.requires_grad or H.requires_grad:
            Gf, Hf = G.to(ex.factor_dtype), H.to(ex.factor_dtype)
            factors = self._factorize(Gf, Hf, check)
        else:  # the Gram matrices widened a chunk of heads at a time: no widened copy of G, H
            Gf = Hf = None
            grams = gram_matrices(G, H, ex.factor_dtype, ex.row_sum)
            factors = self._factorize(G, H, check, grams=grams)
        #: The base-point factors, in ``execution.work_dtype``.
        self.factors = factors.cast(ex.work_dtype).with_eig_sums()
        #: ``(M_G⁻¹, M_H⁻¹)`` of the order-2 endpoint, in ``execution.endpoint_dtype``.
        self._endpoint_inv = (
            factors.MG_inv.to(ex.endpoint_dtype),
            factors.MH_inv.to(ex.endpoint_dtype),
        )
        #: The base point in the work dtype, held (``execution.hold_point``) or ``None``.
        self._held = None
        if ex.hold_point:
            self._held = (
                G.to(ex.work_dtype) if Gf is None else ex.work_point(G, Gf),
                H.to(ex.work_dtype) if Hf is None else ex.work_point(H, Hf),
            )
        del Gf, Hf
        #: Reads a chunk of heads of the base point (:meth:`read_point_from`), or ``None``.
        self._reader: PointReader | None = None
        self._flat = by_head(G.dim() - 2)
        #: The chunks of the flattened heads, and the factors of each (views).
        self._slices = ex.head_slices(G, H)
        flat = self.factors.per_head(self._flat)
        self._chunk_factors = [flat.per_head(lambda t, sl=sl: t[sl]) for sl in self._slices]

    # -- the vertical-space solve: what a subgroup replaces --------------------------------------
    def _factorize(
        self, G: Tensor, H: Tensor, check: RankCheck, grams: tuple[Tensor, Tensor] | None = None
    ) -> GLFactors:
        """The base-point factors of ``(G, H)`` the metric and :meth:`_lam` use.

        In the dtype of ``G`` and ``H``, or of their Gram matrices ``grams`` (``GᵀG``, ``HᵀH``
        summed over the ranks, :func:`~geosharp.geometry.gl_factors.gram_matrices`) if given.
        """
        ex = self.execution
        return factorize(G, H, self.metric, self.eps, check, ex.row_sum, grams=grams)

    def _lam(self, F: GLFactors, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor) -> Tensor:
        """The vertical-space solve :func:`~geosharp.geometry.gl_math.lam` (SPEC §4.4)."""
        return gl_math.lam(G, H, xG, xH, F, metric=self.metric, row_sum=self.execution.row_sum)

    def _lam_from(self, F: GLFactors, XH: Tensor, GX: Tensor) -> Tensor:
        """:meth:`_lam` from the contractions ``ξ_Hᵀ H``, ``Gᵀ ξ_G`` summed over every row."""
        return gl_math.lam_from(XH, GX, F, self.metric)

    # -- validation and dtypes ------------------------------------------------------------------
    @property
    def tangent_dtype(self) -> torch.dtype:
        """The dtype tangents are kept in between calls (``execution.tangent_dtype``)."""
        return self.execution.tangent_dtype

    def _point(self) -> tuple[Tensor, Tensor]:
        """The base point in the work dtype: the held copy, or cast for this call."""
        if self._reader is not None:
            return self._reader(slice(None), self.execution.work_dtype)
        return self._held if self._held is not None else self.execution.widen(self.G, self.H)

    def read_point_from(self, reader: PointReader) -> tuple[Tensor, ...]:
        """Read the base point through ``reader``, a chunk of heads at a time, from now on.

        ``reader(heads, dtype)`` returns ``(G, H)`` of the flattened heads ``heads`` (a slice)
        as fresh tensors in ``dtype``. The per-step products (the projection, the horizontal
        gradient, the vertical-space solve, :meth:`order2_factors`, :meth:`order2_adjoint`)
        then read no tensor of :attr:`point` and hold no copy of it, so the caller may give
        their memory back: a model sharded by FSDP2 reads the rows from its shards
        (:class:`~geosharp.estimators.sharded.gather.GatheredEndpoint`). :meth:`geodesic` and
        :meth:`vertical` still read :attr:`point` (the sampler only its shapes).

        Returns:
            The tensors of the base point this geometry no longer reads: those of
            :attr:`point` and of the copy it held in the work dtype (if any), for the caller to
            free.
        """
        released = (*self.point, *(self._held or ()))
        self._reader = reader
        self._held = None
        return released

    def point_rows(self, heads: slice, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """``(G, H)`` of the flattened heads ``heads``, in ``dtype`` (default: the work dtype).

        Slices of the held copy or of :attr:`point` (no copy where the dtype is theirs), or
        what :meth:`read_point_from`'s reader reads.
        """
        dtype = dtype or self.execution.work_dtype
        if self._reader is not None:
            return self._reader(heads, dtype)
        Gs, Hs = (self._flat(t) for t in (self._held or self.point))
        return Gs[heads].to(dtype), Hs[heads].to(dtype)

    def _check_tangent(self, xi: Tangent, name: str = "xi") -> tuple[Tensor, Tensor]:
        """Validate a tangent pair; return it in the work dtype."""
        self._validate_tangent(xi, name)
        return self.execution.widen(xi[0], xi[1])

    def _validate_tangent(self, xi: Tangent, name: str = "xi") -> None:
        """Check a tangent pair's type, dtype (``G``'s or the work dtype), shape, device."""
        if not isinstance(xi, (tuple, list)) or len(xi) != 2:
            raise TypeError(f"{name} must be a pair (xi_G, xi_H) of tensors")
        for part, t, ref, ref_name in (
            (f"{name}_G", xi[0], self.G, "G"),
            (f"{name}_H", xi[1], self.H, "H"),
        ):
            check_tensor(part, t)
            if t.dtype not in (self.dtype, self.execution.work_dtype):
                raise TypeError(f"{part} has dtype {t.dtype} but {ref_name} has {self.dtype}")
            # shape and device only (no cast: tangents kept in float64 are checked as they are)
            check_like(part, t, ref_name, ref, dtype=False)

    # -- metric ---------------------------------------------------------------------------------
    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """Metric inner product (SPEC §4.1), one value per leading batch element.

        :func:`~geosharp.geometry.gl_math.inner`: ``tr(M aᵀ b) = Σ (aᵀ b) ⊙ M`` for symmetric
        ``M``, one ``h × h`` product per factor.
        """
        self._validate_tangent(a, "a")
        self._validate_tangent(b, "b")
        return self._pair_form(a, b)

    def norm_sq(self, xi: Tangent) -> Tensor:
        """Squared norm ``⟨ξ, ξ⟩`` from the ``h × h`` Gram matrices ``ξ_Gᵀ ξ_G``, ``ξ_Hᵀ ξ_H``."""
        self._validate_tangent(xi)
        return self._pair_form(xi, None)

    # -- quotient structure ---------------------------------------------------------------------
    def vertical(self, omega: Tensor) -> Tangent:
        """The vertical vector ``(−GΩ, HΩᵀ)`` generated by ``Ω ∈ R^{h×h}`` (batched)."""
        return gl_math.vertical(self.G, self.H, omega)

    def lam(self, xi: Tangent) -> Tensor:
        """The ``Λ`` of the horizontal projection ``P(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` (SPEC §4.4).

        In the work dtype; see :func:`~geosharp.geometry.gl_math.lam`.
        """
        xG, xH = self._check_tangent(xi)
        G, H = self._point()
        return self._lam(self.factors, G, H, xG, xH)

    def project(self, xi: Tangent) -> Tangent:
        """Horizontal projection ``P(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` (SPEC §4.4).

        Exactly the metric-orthogonal projection onto the horizontal space at ``eps = 0``.
        """
        self._validate_tangent(xi)
        return self._project_chunks(xi, grad=False)

    def horizontal_grad(self, egrad: Tangent) -> Tangent:
        """The horizontal projection of the Riemannian gradient (the ascent direction).

        ``P(g⁻¹ e)`` in one pass in the work dtype: the tangent is widened once and the result
        rounded once (``project(riemannian_grad(e))`` would round in between).
        """
        self._validate_tangent(egrad, "egrad")
        return self._project_chunks(egrad, grad=True)

    @property
    def orthogonal_projection(self) -> bool:
        """The projection is metric-orthogonal exactly at ``eps = 0`` (see :meth:`project`)."""
        return self.eps == 0.0

    def ascent_direction(self, egrad: Tangent) -> tuple[Tangent, Tensor]:
        """:meth:`horizontal_grad` and its squared norm, in the same pass over the heads.

        At ``eps = 0`` the norm is ``e·d`` summed in the work dtype on each chunk's widened
        ``e`` and unrounded ``d`` (no Gram matrices; see
        :meth:`~geosharp.geometry.Geometry.ascent_direction`); otherwise :meth:`norm_sq`.
        """
        self._validate_tangent(egrad, "egrad")
        if not self.orthogonal_projection:
            d = self._project_chunks(egrad, grad=True)
            return d, self._pair_form(d, None).sum()
        wd = self.execution.work_dtype
        total = torch.zeros((), dtype=wd, device=egrad[0].device)
        d = self._project_chunks(egrad, grad=True, pairing=total)
        return d, total.to(torch.float64)

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        """Residual of the horizontality condition, zero iff ``ξ`` is horizontal (at ``eps=0``).

        inv: ``ξ_Gᵀ G M_H − M_G Hᵀ ξ_H``; mix: ``Gᵀ ξ_G M_H − M_G ξ_Hᵀ H`` (SPEC §4.3).
        """
        xG, xH = self._check_tangent(xi)
        G, H = self._point()
        res = gl_math.horizontal_residual(
            G, H, xG, xH, self.factors, metric=self.metric, row_sum=self.execution.row_sum
        )
        return res.to(xi[0].dtype)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Riemannian gradient: inv ``(e_G M_G, e_H M_H)``; mix ``(e_G M_H⁻¹, e_H M_G⁻¹)``."""
        eG, eH = self._check_tangent(egrad, "egrad")
        rG, rH = gl_math.riemannian_grad(eG, eH, self.factors, self.metric)
        return rG.to(egrad[0].dtype), rH.to(egrad[0].dtype)

    # -- geodesics ------------------------------------------------------------------------------
    def christoffel(self, xi: Tangent) -> Tangent:
        """Christoffel quadratic form ``Γ(ξ, ξ)`` at the base point (SPEC §4.5)."""
        xG, xH = self._check_tangent(xi)
        G, H = self._point()
        F = self.factors
        rs = self.execution.row_sum
        gG, gH = gl_math.christoffel(
            G, H, xG, xH, F.MG_inv, F.MH_inv, metric=self.metric, row_sum=rs
        )
        return gG.to(xi[0].dtype), gH.to(xi[0].dtype)

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Christoffel form with the (damped) Gram matrices evaluated at ``point``."""
        out_dtype = point[0].dtype
        G, H, xG, xH = self.execution.widen(*point, *xi)
        rs = self.execution.row_sum
        gG, gH = gl_math.christoffel_at(G, H, xG, xH, metric=self.metric, eps=self.eps, row_sum=rs)
        return gG.to(out_dtype), gH.to(out_dtype)

    def pulls_back(self, order: int | str) -> bool:
        """At orders 1 and 2 (``θ₀ + ξ − ½Γ(ξ, ξ)``, ``Γ`` quadratic).

        A subclass that replaces the endpoint overrides this too.
        """
        return order in (1, 2)

    def row_endpoint(self, order: int | str) -> bool:
        """At order 2 (:func:`~geosharp.geometry.gl_endpoint.order2_factors_by_chunks`)."""
        return order == 2

    @property
    def head_slices(self) -> list[slice]:
        """The chunks of the flattened heads that the per-step products run over, in order."""
        return list(self._slices)

    def order2_factors(
        self, xG: Tensor, xH: Tensor, row_sum: RowSum | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
        """The ``h × h`` factors of the order-2 endpoint at ``ξ``: ``(C_G, B_G, C_H, B_H, s)``.

        ``G′ = G (I + s B_G) + ξ_G C_G`` and ``H′ = H (I + s B_H) + ξ_H C_H`` row by row
        (:meth:`row_endpoint`): a caller holding the rows of ``G`` elsewhere (a sharded model's
        gathered layers) makes ``θ′`` from them. ``ξ`` has its heads flattened, in
        ``execution.endpoint_dtype``; the point is read a chunk of heads at a time
        (:meth:`point_rows`); ``row_sum`` sums the contractions over the ranks holding the
        other rows (``None``: every row is here).
        :func:`~geosharp.geometry.gl_endpoint.order2_factors_by_chunks`.
        """
        inv = self._endpoint_inv
        return order2_factors_by_chunks(
            self.point_rows, self._slices, xG, xH, *inv, self.metric, row_sum
        )

    def order2_adjoint(
        self,
        xi: tuple[Tensor, Tensor],
        factors: tuple[Tensor, Tensor, float],
        grad: tuple[Tensor, Tensor],
        row_sum: RowSum | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``∂L/∂ξ`` of the order-2 endpoint from ``grad = (∂L/∂G′, ∂L/∂H′)``, in place.

        ``factors``: ``(C_G, C_H, s)`` of :meth:`order2_factors` at ``ξ`` (no second forward of
        the endpoint); ``ξ`` and ``grad`` as there, ``grad`` overwritten with the result.
        :func:`~geosharp.geometry.gl_endpoint.order2_adjoint_by_chunks`.
        """
        inputs = (*xi, *self._endpoint_inv)
        return order2_adjoint_by_chunks(
            self.point_rows,
            self._slices,
            inputs,
            factors,
            metric=self.metric,
            g=grad,
            row_sum=row_sum,
        )

    def relative_speed(self, xi: Tangent) -> Tensor:
        """:func:`~geosharp.geometry.gl_diagnose.relative_speed`: two ``h × h`` contractions."""
        return relative_speed(self, xi)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Geodesic endpoint at ``t = 1`` (order 1, 2 or ``"exact"``); see :class:`Geometry`.

        Returned in the dtype of ``G``. Order 2 is
        :func:`~geosharp.geometry.gl_math.order2_endpoint` in ``execution.endpoint_dtype``;
        order 1 adds tangents in the dtype of ``G`` directly (one rounding), others in the work
        dtype; the RK4 of ``"exact"`` runs in the work dtype.
        """
        order = check_order(order)
        ex = self.execution
        if order == 2:
            self._validate_tangent(xi)  # checked, cast to the endpoint's dtype
            G, H, xG, xH = (t.to(ex.endpoint_dtype) for t in (self.G, self.H, *xi))
            out = gl_math.order2_endpoint(
                G, H, xG, xH, *self._endpoint_inv, self.metric, ex.row_sum
            )
            return tuple(t.to(self.dtype) for t in out)
        if order == 1 and xi[0].dtype == xi[1].dtype == self.dtype:
            self._validate_tangent(xi)  # tangents in the model's dtype: G + ξ is one rounding
            return gl_math.order1_endpoint(self.G, self.H, xi[0], xi[1])
        xG, xH = self._check_tangent(xi)
        if order == 1:
            out = gl_math.order1_endpoint(*self._point(), xG, xH)
        else:
            out = self._rk4((xG, xH), check_steps(steps), point=self._point())
        return tuple(t.to(self.dtype) for t in out)

    def endpoint_trouble(
        self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS
    ) -> str | None:
        """Why the exact geodesic is not finite, or ``None`` (order 1 and 2: ``None``).

        :func:`~geosharp.geometry.gl_diagnose.exact_geodesic_trouble`: a step too coarse for the
        heads' relative speed (raise ``exact_steps``), or a Gram matrix of the moving point
        becoming singular (order 2, a smaller ρ, ``eps > 0``). Integrates again: for after a
        failure only.
        """
        if check_order(order) != "exact":
            return None
        return exact_geodesic_trouble(self, xi, check_steps(steps))
