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
and dtype/device agnostic. :class:`GLGeometry` factorizes the base point once
(:mod:`~geosharp.geometry.gl_factors`: eigendecompositions of the ``h × h`` Gram matrices) and
runs the order-2 endpoint of :mod:`~geosharp.geometry.gl_endpoint`; the group action ``act``,
``act_tangent`` is :mod:`~geosharp.geometry.gl_action`'s; the one-call functions
(``gl_functional.geodesic(G, H, ξ_G, ξ_H)``, …) of :mod:`~geosharp.geometry.gl_functional` build
a geometry per call.

Example:
    >>> import torch
    >>> from geosharp.geometry import gl
    >>> g = torch.Generator().manual_seed(0)
    >>> G = torch.randn(4, 6, 3, dtype=torch.float64, generator=g)   # 4 heads, n=6, h=3
    >>> H = torch.randn(4, 5, 3, dtype=torch.float64, generator=g)
    >>> geom = gl.GLGeometry(G, H, metric="inv")
    >>> xi = geom.project((0.1 * torch.randn_like(G), 0.1 * torch.randn_like(H)))
    >>> Gp, Hp = geom.geodesic(xi, order=2)
    >>> A = torch.randn(4, 3, 3, dtype=torch.float64, generator=g)  # a random group element
    >>> geom_A = gl.GLGeometry(*gl.act(G, H, A), metric="inv")
    >>> GpA, HpA = geom_A.geodesic(gl.act_tangent(*xi, A), order=2)
    >>> bool(torch.allclose(GpA @ HpA.mT, Gp @ Hp.mT))  # the perturbed function is invariant
    True
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from typing import ClassVar

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
from geosharp.geometry.gl_action import act, act_tangent
from geosharp.geometry.gl_endpoint import _add_mm, _christoffel, _order2_endpoint
from geosharp.geometry.gl_factors import _gram, check_rank, factorize, sampling_roots

__all__ = ["CHUNK_ELEMENTS", "DEFAULT_EPS", "GLGeometry", "act", "act_tangent"]

#: Default damping of the Gram matrices. ``0`` keeps the metrics exactly GL(h)-invariant;
#: a rank-deficient block then raises an error that suggests ``eps > 0``.
DEFAULT_EPS = 0.0
#: Float64 elements of one chunk of heads in the per-step products on a CPU. Widening a whole
#: group of heads to float64 and multiplying it streams both through memory; in chunks of
#: about 2 MB they stay in cache (the Gram of 5.3 M float32 coordinates, h = 32: 46 ms in one
#: pass, 14 ms in chunks of 8–32 heads, on the CI machine).
CHUNK_ELEMENTS = 2**18


class GLGeometry(Geometry):
    r"""The geometry of one (batched) GL(h) block at a fixed base point ``(G, H)``.

    All base-point work — Gram matrices, their inverses and square roots, and the
    eigendecomposition behind the inv-metric Sylvester solve — is done once here, so each method
    afterwards costs a few batched ``h × h`` and ``n × h`` matmuls.

    Args:
        G: Left factor, shape ``(..., n, h)``.
        H: Right factor, shape ``(..., m, h)`` with the same leading dimensions and ``h``.
        metric: ``"inv"`` or ``"mix"`` (SPEC §4).
        eps: Damping ``ε ≥ 0`` added to both Gram matrices.
        name: Name of the block, used in error messages.
        work_dtype: Dtype of the per-step products and of the tangents, after the
            factorizations in ``compute_dtype`` (default: ``compute_dtype``). The model's dtype
            runs them without float64 temporaries (``gs.sharpness(low_memory=True)``); see
            :meth:`_use_work_dtype`.
        compute_dtype: Dtype of the internal computations. Default: float64 (the geometry costs
            ``O((n+m)h²)`` per step, negligible next to a forward pass, while the horizontal
            projection of an ill-conditioned block loses ``cond(M_G)·cond(M_H)`` relative
            accuracy). Inputs and outputs keep the dtype of ``G``.
        head_names: Optional readable name of every element of the (flattened) leading batch,
            e.g. ``"encoder.layer.3.attention[QK] head 5"``, used in error messages.
        tangent_dtype: Dtype in which tangents are kept between calls (:attr:`tangent_dtype`;
            default: the dtype of ``G``). Each method widens its tangents to
            :attr:`compute_dtype` for its products and rounds its result back once, so a
            float32 model's tangents cost float32 memory while the projection, the metric and
            the Riemannian gradient keep float64 accuracy; the only extra error is the rounding
            of each stored tangent to float32.
        hold_wide_point: Keep a copy of the base point in :attr:`compute_dtype` for the
            per-step products (``None``: only when tangents are kept in the compute dtype, e.g.
            for a float64 model, where the copy is the point itself); otherwise each projection
            widens ``G``, ``H`` once, chunk by chunk of heads on a CPU.

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
        compute_dtype: torch.dtype | None = None,
        head_names: Sequence[str] | None = None,
        work_dtype: torch.dtype | None = None,
        tangent_dtype: torch.dtype | None = None,
        hold_wide_point: bool | None = None,
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
        h = G.shape[-1]

        self.dtype = G.dtype
        self.compute_dtype = compute_dtype or torch.promote_types(G.dtype, torch.float64)
        self._tangent_dtype = tangent_dtype or G.dtype
        if hold_wide_point is None:
            hold_wide_point = self._tangent_dtype == self.compute_dtype
        self._G, self._H = G.to(self.compute_dtype), H.to(self.compute_dtype)

        def check(which: str, lam: Tensor) -> None:  # on both spectra, before any inverse
            check_rank(lam, h, self.dtype, self.eps, which, self.name, self.head_names)

        factors = factorize(self._G, self._H, self.metric, self.eps, check)
        #: Dtype of the factorizations (:meth:`_samplers` computes its square roots in it).
        self._factor_dtype = self.compute_dtype
        for key, value in factors.items():
            setattr(self, key, value)
        self._MG_inv_lo = self.MG_inv.to(G.dtype)
        self._MH_inv_lo = self.MH_inv.to(G.dtype)
        if not hold_wide_point:
            self._G = self._H = None  # widened on demand (see the properties below)
        self._use_work_dtype(work_dtype)
        n_heads = math.prod(G.shape[:-2])
        per = max(1, CHUNK_ELEMENTS // (max(G.shape[-2], H.shape[-2]) * h))
        #: Slices of the flattened heads for the per-step products (None: one pass).
        self._chunks: list[slice] | None = None
        if G.device.type == "cpu" and per < n_heads:
            self._chunks = [slice(i, min(i + per, n_heads)) for i in range(0, n_heads, per)]

    @property
    def _G(self) -> Tensor:
        """``G`` in :attr:`compute_dtype`: the held copy, or a fresh cast (``hold_wide_point``)."""
        held = self.__dict__.get("_G_wide")
        return held if held is not None else self.G.to(self.compute_dtype)

    @_G.setter
    def _G(self, value: Tensor | None) -> None:
        self.__dict__["_G_wide"] = value

    @property
    def _H(self) -> Tensor:
        """``H`` in :attr:`compute_dtype` (see :attr:`_G`)."""
        held = self.__dict__.get("_H_wide")
        return held if held is not None else self.H.to(self.compute_dtype)

    @_H.setter
    def _H(self, value: Tensor | None) -> None:
        self.__dict__["_H_wide"] = value

    def _use_work_dtype(self, dtype: torch.dtype | None) -> None:
        """Run every per-step product in ``dtype`` (factorizations stay as computed).

        The Gram matrices, their inverses and the Sylvester factors were computed in
        :attr:`compute_dtype` (float64); with ``dtype`` the model's (e.g. float32) they are
        rounded once to it, the base point is the model's own ``G``, ``H`` (no float64 cast)
        and tangents are kept in ``dtype``: no float64 temporaries and faster products, at the
        cost of float32 roundoff in the projection and the Christoffel term (relative error
        up to ≈ cond(M_G)·cond(M_H)·2⁻²⁴ in the projection, SPEC §4).
        """
        if dtype is None or dtype == self.compute_dtype:
            return
        wide = self.compute_dtype
        for key, value in list(vars(self).items()):
            if key in ("G", "H", "point", "_G_wide", "_H_wide"):
                continue
            if isinstance(value, Tensor) and value.dtype == wide:
                setattr(self, key, value.to(dtype))
            elif isinstance(value, tuple) and value and all(isinstance(t, Tensor) for t in value):
                setattr(self, key, tuple(t.to(dtype) if t.dtype == wide else t for t in value))
        self._G, self._H = self.G.to(dtype), self.H.to(dtype)  # no copy in the model's dtype
        self.compute_dtype = dtype
        self._tangent_dtype = dtype

    # -- validation -----------------------------------------------------------------------------
    @property
    def tangent_dtype(self) -> torch.dtype:
        """The dtype tangents are kept in between calls (the ``tangent_dtype`` argument)."""
        return self._tangent_dtype

    def _check_tangent(self, xi: Tangent, name: str = "xi") -> tuple[Tensor, Tensor]:
        """Validate a tangent pair (dtype of ``G`` or the compute dtype); return it widened."""
        self._validate_tangent(xi, name)
        return xi[0].to(self.compute_dtype), xi[1].to(self.compute_dtype)

    def _validate_tangent(self, xi: Tangent, name: str = "xi") -> None:
        """Check a tangent pair's type, dtype (``G``'s or the compute dtype), shape, device."""
        if not isinstance(xi, (tuple, list)) or len(xi) != 2:
            raise TypeError(f"{name} must be a pair (xi_G, xi_H) of tensors")
        for part, t, ref, ref_name in (
            (f"{name}_G", xi[0], self.G, "G"),
            (f"{name}_H", xi[1], self.H, "H"),
        ):
            check_tensor(part, t)
            if t.dtype not in (self.dtype, self.compute_dtype):
                raise TypeError(f"{part} has dtype {t.dtype} but {ref_name} has {self.dtype}")
            # shape and device only (no cast: tangents kept in float64 are checked as they are)
            check_like(part, t, ref_name, ref, dtype=False)

    # -- chunks of heads ----------------------------------------------------------------------
    def _by_head(self, t: Tensor) -> Tensor:
        """``t`` (a tangent, the point or a per-head factor) with the heads' dims flattened."""
        return t.reshape(-1, *t.shape[self.G.dim() - 2 :])

    def _fac(self, name: str, sl: slice | None) -> Tensor:
        """A per-head factor (``MG_inv``, ``_S``, …), or its chunk ``sl`` of the flat heads."""
        t = getattr(self, name)
        return t if sl is None else self._by_head(t)[sl]

    def _down(self, *ts: Tensor, like: Tensor | None = None) -> tuple[Tensor, ...]:
        """Cast results to the dtype of ``like`` (the caller's tangent) or of ``G``."""
        dtype = self.dtype if like is None else like.dtype
        return tuple(t.to(dtype) for t in ts)

    # -- metric -----------------------------------------------------------------------------------
    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        """Metric inner product (SPEC §4), one value per leading batch element.

        Uses ``tr(M aᵀ b) = Σ (aᵀ b) ⊙ M`` for symmetric ``M``: one ``h × h`` product per
        factor, no ``n × h`` temporary.
        """
        self._validate_tangent(a, "a")
        self._validate_tangent(b, "b")
        return self._pair_form(a, b)

    def norm_sq(self, xi: Tangent) -> Tensor:
        """Squared norm ``⟨ξ, ξ⟩`` from the ``h × h`` Gram matrices ``ξ_Gᵀ ξ_G``, ``ξ_Hᵀ ξ_H``."""
        self._validate_tangent(xi)
        return self._pair_form(xi, None)

    def _pair_form(self, a: Tangent, b: Tangent | None) -> Tensor:
        """``⟨a, b⟩`` (``b = None``: ``⟨a, a⟩``) per head, widened and multiplied chunk by chunk."""
        cd = self.compute_dtype
        rows = [self._by_head(t) for t in (*a, *(a if b is None else b))]
        out = torch.empty(rows[0].shape[0], dtype=cd, device=rows[0].device)
        for sl in self._head_slices():
            aG, aH = rows[0][sl].to(cd), rows[1][sl].to(cd)
            bG, bH = (aG, aH) if b is None else (rows[2][sl].to(cd), rows[3][sl].to(cd))
            out[sl] = self._trace_form(aG.mT @ bG, aH.mT @ bH, sl)
        return out.reshape(self.G.shape[:-2]).to(a[0].dtype)

    def _trace_form(self, XG: Tensor, XH: Tensor, sl: slice) -> Tensor:
        """``tr(M_a XG) + tr(M_b XH)`` with the metric's pair ``(M_a, M_b)``.

        inv: ``(M_G⁻¹, M_H⁻¹)``; mix: ``(M_H, M_G)`` (symmetric, so each trace is an
        element-wise sum). ``sl``: the chunk of heads ``XG``, ``XH`` belong to.
        """
        a, b = ("MG_inv", "MH_inv") if self.metric == "inv" else ("MH", "MG")
        return (XG * self._fac(a, sl)).sum((-2, -1)) + (XH * self._fac(b, sl)).sum((-2, -1))

    # -- quotient structure -----------------------------------------------------------------------
    def vertical(self, omega: Tensor) -> Tangent:
        """The vertical vector ``(−GΩ, HΩᵀ)`` generated by ``Ω ∈ R^{h×h}`` (batched)."""
        return -self.G @ omega, self.H @ omega.mT

    def lam(self, xi: Tangent) -> Tensor:
        """The ``Λ`` of the horizontal projection ``P(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` (SPEC §4).

        mix: ``Λ = ½ (ξ_Hᵀ H M_H⁻¹ − M_G⁻¹ Gᵀ ξ_G)``. inv (corrected): ``AΛ + ΛA = B`` with
        ``A = M_H M_G`` and ``B = ξ_Hᵀ H M_G − M_H Gᵀ ξ_G``, solved as ``Λ = S Y S⁻¹``,
        ``Y_ij = (S⁻¹ B S)_ij / (d_i + d_j)``.
        """
        xG, xH = self._check_tangent(xi)
        with self._wide_point():
            return self._lam_of(xG, xH, self._G, self._H)

    def _lam_of(
        self, xG: Tensor, xH: Tensor, G: Tensor, H: Tensor, sl: slice | None = None
    ) -> Tensor:
        """:meth:`lam` of widened tangents at the widened point ``(G, H)`` (chunk ``sl``)."""
        f = self._fac
        if self.metric == "mix":
            return 0.5 * ((xH.mT @ H) @ f("MH_inv", sl) - f("MG_inv", sl) @ (G.mT @ xG))
        B = (xH.mT @ H) @ f("MG", sl) - f("MH", sl) @ (G.mT @ xG)
        S, d = f("_S", sl), f("_eig", sl)
        Y = (f("_S_inv", sl) @ B @ S) / (d.unsqueeze(-1) + d.unsqueeze(-2))
        return S @ Y @ f("_S_inv", sl)

    def project(self, xi: Tangent) -> Tangent:
        """Horizontal projection ``P(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` (SPEC §4).

        Exactly the metric-orthogonal projection onto the horizontal space at ``eps = 0``.
        """
        self._validate_tangent(xi)
        return self._project_chunks(xi, grad=False)

    def horizontal_grad(self, egrad: Tangent) -> Tangent:
        """The horizontal projection of the Riemannian gradient (the ascent direction).

        ``P(g⁻¹ e)`` in one pass in :attr:`compute_dtype`: the tangent is widened once and the
        result rounded once (``project(riemannian_grad(e))`` would round in between).
        """
        self._validate_tangent(egrad, "egrad")
        return self._project_chunks(egrad, grad=True)

    @property
    def orthogonal_projection(self) -> bool:
        """The projection is metric-orthogonal exactly at ``eps = 0`` (see :meth:`project`)."""
        return self.eps == 0.0

    def ascent_direction(self, egrad: Tangent) -> tuple[Tangent, Tensor]:
        """:meth:`horizontal_grad` and its squared norm, in the same pass over the heads.

        At ``eps = 0`` the norm is ``e·d`` summed in :attr:`compute_dtype` on each chunk's
        widened ``e`` and unrounded ``d`` (no Gram matrices; see
        :meth:`~geosharp.geometry.Geometry.ascent_direction`); otherwise :meth:`norm_sq`.
        """
        self._validate_tangent(egrad, "egrad")
        if not self.orthogonal_projection:
            d = self._project_chunks(egrad, grad=True)
            return d, self._pair_form(d, None).sum()
        total = torch.zeros((), dtype=self.compute_dtype, device=egrad[0].device)
        d = self._project_chunks(egrad, grad=True, pairing=total)
        return d, total.to(torch.float64)

    def _rg_of(self, eG: Tensor, eH: Tensor, sl: slice | None = None) -> tuple[Tensor, Tensor]:
        """The Riemannian gradient of widened ``e`` (chunk ``sl``): inv ``e M``, mix ``e M⁻¹``."""
        if self.metric == "inv":
            return eG @ self._fac("MG", sl), eH @ self._fac("MH", sl)
        return eG @ self._fac("MH_inv", sl), eH @ self._fac("MG_inv", sl)

    def _head_slices(self) -> list[slice]:
        """The chunks of the flattened heads the per-step products run over (one: all)."""
        return self._chunks if self._chunks is not None else [slice(None)]

    #: Per-head tensors (their leading dims are the heads'), sliced by :meth:`_chunk_view`; a
    #: subclass whose :meth:`lam` reads more of them lists those too.
    _PER_HEAD: ClassVar[tuple[str, ...]] = (
        "MG",
        "MH",
        "MG_inv",
        "MH_inv",
        "_S",
        "_S_inv",
        "_eig",
    )

    def _chunk_view(self, sl: slice, G: Tensor, H: Tensor) -> GLGeometry:
        """A shallow copy restricted to the heads ``sl``, at their widened point ``(G, H)``.

        Serves a subclass's own :meth:`lam` chunk by chunk: every tensor of :attr:`_PER_HEAD`
        is sliced (a view), the rest (an algebra's indices, the metric) is shared.
        """
        view = copy.copy(self)
        d = view.__dict__
        for name in self._PER_HEAD:
            v = d.get(name)
            if isinstance(v, Tensor):
                d[name] = self._by_head(v)[sl]
            elif isinstance(v, tuple):
                d[name] = tuple(self._by_head(t)[sl] for t in v)
        d["G"], d["H"], d["point"] = G, H, (G, H)
        d["_G_wide"], d["_H_wide"] = G, H
        d["_chunks"] = None
        return view

    def _project_chunks(
        self, xi: Tangent, grad: bool, pairing: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`project` (or, with ``grad``, :meth:`horizontal_grad`) chunk by chunk.

        Each chunk of heads (all of them in one, off a CPU or for few heads) is widened,
        projected in :attr:`compute_dtype` and written into the result in the tangent's dtype:
        the same products as one pass, head by head. ``pairing`` (a 0-dim tensor) accumulates
        ``xi·result`` of the unrounded chunks.
        """
        cd = self.compute_dtype
        held = self.__dict__.get("_G_wide")
        Gs = self._by_head(held if held is not None else self.G)
        Hs = self._by_head(self.__dict__["_H_wide"] if held is not None else self.H)
        xG, xH = self._by_head(xi[0]), self._by_head(xi[1])
        outG = torch.empty(xi[0].shape, dtype=xi[0].dtype, device=xi[0].device)
        outH = torch.empty(xi[1].shape, dtype=xi[1].dtype, device=xi[1].device)
        oG, oH = self._by_head(outG), self._by_head(outH)
        for sl in self._head_slices():
            eG, eH = xG[sl].to(cd), xH[sl].to(cd)
            g, h = self._rg_of(eG, eH, sl) if grad else (eG, eH)
            G, H = Gs[sl].to(cd), Hs[sl].to(cd)
            if type(self).lam is GLGeometry.lam:
                L = self._lam_of(g, h, G, H, sl)
            else:  # a subgroup's Λ, on the chunk's own factors
                L = self._chunk_view(sl, G, H).lam((g, h))
            # the Riemannian gradient is a fresh temporary: P accumulates into it
            pG, pH = _add_mm(g, G, L, inplace=grad), _add_mm(h, H, L.mT, alpha=-1.0, inplace=grad)
            if pairing is not None:
                pairing += torch.dot(eG.reshape(-1), pG.reshape(-1))
                pairing += torch.dot(eH.reshape(-1), pH.reshape(-1))
            oG[sl], oH[sl] = pG, pH
        return outG, outH

    @contextlib.contextmanager
    def _wide_point(self) -> Iterator[None]:
        """Hold ``G``, ``H`` in :attr:`compute_dtype` for the products of one method call.

        Without a held copy (``hold_wide_point=False``) every read of :attr:`_G` casts ``G``
        afresh; a projection reads it twice or more. Inside this block it is cast once, and the
        copy is dropped on leaving.
        """
        if self.__dict__.get("_G_wide") is not None:
            yield
            return
        self._G, self._H = self.G.to(self.compute_dtype), self.H.to(self.compute_dtype)
        try:
            yield
        finally:
            self._G = self._H = None

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        """Residual of the horizontality condition, zero iff ``ξ`` is horizontal (at ``eps=0``).

        inv: ``ξ_Gᵀ G M_H − M_G Hᵀ ξ_H``; mix: ``Gᵀ ξ_G M_H − M_G ξ_Hᵀ H`` (SPEC §4).
        """
        xG, xH = self._check_tangent(xi)
        if self.metric == "inv":
            res = (xG.mT @ self._G) @ self.MH - self.MG @ (self._H.mT @ xH)
        else:
            res = (self._G.mT @ xG) @ self.MH - self.MG @ (xH.mT @ self._H)
        return res.to(xi[0].dtype)

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        """Riemannian gradient: inv ``(e_G M_G, e_H M_H)``; mix ``(e_G M_H⁻¹, e_H M_G⁻¹)``."""
        eG, eH = self._check_tangent(egrad, "egrad")
        return self._down(*self._rg_of(eG, eH), like=egrad[0])

    # -- geodesics --------------------------------------------------------------------------------
    def christoffel(self, xi: Tangent) -> Tangent:
        """Christoffel quadratic form ``Γ(ξ, ξ)`` at the base point (SPEC §4)."""
        xG, xH = self._check_tangent(xi)
        return self._down(
            *_christoffel(self._G, self._H, xG, xH, self.MG_inv, self.MH_inv, self.metric),
            like=xi[0],
        )

    def christoffel_at(self, point: Point, xi: Tangent) -> Tangent:
        """Christoffel form with the (damped) Gram matrices evaluated at ``point``."""
        out_dtype = point[0].dtype
        G, H, xG, xH = (t.to(self.compute_dtype) for t in (*point, *xi))
        MG_inv = torch.linalg.inv(_gram(G, self.eps))
        MH_inv = torch.linalg.inv(_gram(H, self.eps))
        gG, gH = _christoffel(G, H, xG, xH, MG_inv, MH_inv, self.metric)
        return gG.to(out_dtype), gH.to(out_dtype)

    def pulls_back(self, order: int | str) -> bool:
        """At orders 1 and 2 (``θ₀ + ξ − ½Γ(ξ, ξ)``, ``Γ`` quadratic), unless overridden.

        A subclass that replaces the endpoint is left to autograd.
        """
        same = (
            type(self).geodesic is GLGeometry.geodesic
            and type(self).iterate_endpoint is GLGeometry.iterate_endpoint
        )
        return same and order in (1, 2)

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Geodesic endpoint at ``t = 1`` (order 1, 2 or ``"exact"``); see :class:`Geometry`.

        Returned in the dtype of ``G``. Order 1 and the RK4 run in :attr:`compute_dtype`; the
        second-order term ``½Γ(ξ, ξ)`` of order 2 is evaluated in the dtype of ``G`` (it is a
        correction of relative size ``‖ξ‖``, so its rounding error is ``O(‖ξ‖²·eps)``, while
        float64 would double the cost of the ascent's forward and backward through it).
        """
        order = check_order(order)
        if order == 2 and self.dtype != self.compute_dtype:
            self._validate_tangent(xi)  # checked, not widened: the term runs in G's dtype
            xG, xH = xi[0].to(self.dtype), xi[1].to(self.dtype)
            return _order2_endpoint(
                self.G, self.H, xG, xH, self._MG_inv_lo, self._MH_inv_lo, self.metric
            )
        if order == 1 and xi[0].dtype == xi[1].dtype == self.dtype:
            self._validate_tangent(xi)  # tangents in the model's dtype: G + ξ is one rounding
            return self.G + xi[0], self.H + xi[1]
        xG, xH = self._check_tangent(xi)
        if order == 1:
            return self._down(self._G + xG, self._H + xH)
        if order == 2:
            return self._down(
                *_order2_endpoint(self._G, self._H, xG, xH, self.MG_inv, self.MH_inv, self.metric)
            )
        return self._down(*self._rk4((xG, xH), check_steps(steps), point=(self._G, self._H)))

    # -- sampling ---------------------------------------------------------------------------
    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
        dtype: torch.dtype | None = None,
    ) -> Tangent:
        """Isotropic Gaussian in the metric (SPEC §6), optionally projected horizontally.

        Returned in ``dtype`` (default: the dtype of ``G``).

        inv: ``η_G = s Z M_G^{1/2}``, ``η_H = s Z M_H^{1/2}``; mix: ``η_G = s Z M_H^{−1/2}``,
        ``η_H = s Z M_G^{−1/2}`` with ``Z`` standard normal and ``s = scale``.
        """
        zG = torch.randn(
            self.G.shape, generator=generator, dtype=self.compute_dtype, device=self.G.device
        )
        zH = torch.randn(
            self.H.shape, generator=generator, dtype=self.compute_dtype, device=self.H.device
        )
        sample_G, sample_H = self._samplers()
        xi = (scale * zG @ sample_G, scale * zH @ sample_H)
        if horizontal:
            xi = self.project(xi)
        return tuple(t.to(dtype or self.dtype) for t in xi)

    def _samplers(self) -> tuple[Tensor, Tensor]:
        """The square roots :meth:`random_tangent` multiplies by, made on first use and kept.

        inv: ``(M_G^{1/2}, M_H^{1/2})``; mix: ``(M_H^{−1/2}, M_G^{−1/2})``. Computed from ``G``,
        ``H`` as the constructor computes its factorizations (same dtype, same operations: the
        same numbers), so that a worst-case ascent, which never samples, holds none of them.
        """
        held = self.__dict__.get("_sampler_pair")
        if held is None:
            G, H = self.G.to(self._factor_dtype), self.H.to(self._factor_dtype)
            pair = sampling_roots(G, H, self.metric, self.eps)
            held = tuple(t.to(self.compute_dtype) for t in pair)
            self.__dict__["_sampler_pair"] = held
        return held
