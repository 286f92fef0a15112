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

Every function is batched over any leading dimensions (e.g. ``layers × heads``), differentiable,
and dtype/device agnostic. :class:`GLGeometry` factorizes the base point once (eigendecompositions
of the ``h × h`` Gram matrices); the module-level functions are conveniences that build one per
call.

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
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from geosharp.geometry._validate import (
    check_eps,
    check_like,
    check_metric,
    check_order,
    check_steps,
    check_tensor,
    singular_threshold,
)
from geosharp.geometry.base import DEFAULT_RK4_STEPS, Geometry, Point, Tangent

#: Default damping of the Gram matrices. ``0`` keeps the metrics exactly GL(h)-invariant;
#: a rank-deficient block then raises an error that suggests ``eps > 0``.
DEFAULT_EPS = 0.0


def _eye_like(M: Tensor) -> Tensor:
    return torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)


def _gram(X: Tensor, eps: float) -> Tensor:
    """Damped Gram matrix ``XᵀX + εI`` (batched)."""
    M = X.mT @ X
    if eps:
        M = M + eps * _eye_like(M)
    return M


def _spd_funcs(M: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition ``M = U diag(λ) Uᵀ`` of a batch of symmetric matrices."""
    lam, U = torch.linalg.eigh(M)
    return lam, U


def _apply_spectral(lam: Tensor, U: Tensor, f: Tensor) -> Tensor:
    """``U diag(f) Uᵀ`` where ``f`` is a function of the eigenvalues ``lam``."""
    return (U * f.unsqueeze(-2)) @ U.mT


def _christoffel(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
) -> tuple[Tensor, Tensor]:
    """SPEC §4 Christoffel quadratic form with given inverse Gram matrices."""
    if metric == "inv":
        # Γ_G = −ξ_G M_G⁻¹ (ξ_Gᵀ G + Gᵀ ξ_G) + G M_G⁻¹ ξ_Gᵀ ξ_G, and the same with G → H.
        XG = xG.mT @ G
        XH = xH.mT @ H
        gG = -xG @ (MG_inv @ (XG + XG.mT)) + G @ (MG_inv @ (xG.mT @ xG))
        gH = -xH @ (MH_inv @ (XH + XH.mT)) + H @ (MH_inv @ (xH.mT @ xH))
        return gG, gH
    # mix: Γ_G = ξ_G (ξ_Hᵀ H + Hᵀ ξ_H) M_H⁻¹ − G ξ_Hᵀ ξ_H M_H⁻¹,
    #      Γ_H = ξ_H (ξ_Gᵀ G + Gᵀ ξ_G) M_G⁻¹ − H ξ_Gᵀ ξ_G M_G⁻¹.
    XG = xG.mT @ G
    XH = xH.mT @ H
    gG = xG @ ((XH + XH.mT) @ MH_inv) - G @ ((xH.mT @ xH) @ MH_inv)
    gH = xH @ ((XG + XG.mT) @ MG_inv) - H @ ((xG.mT @ xG) @ MG_inv)
    return gG, gH


def _add_mm(X: Tensor, A: Tensor, B: Tensor, alpha: float = 1.0) -> Tensor:
    """``X + α·A @ B`` in one batched pass (``baddbmm``) over any leading dimensions."""
    batch = torch.broadcast_shapes(X.shape[:-2], A.shape[:-2], B.shape[:-2])
    if len(batch) == 1 and X.shape[:-2] == A.shape[:-2] == B.shape[:-2]:
        return torch.baddbmm(X, A, B, alpha=alpha)
    return X + alpha * (A @ B)


def _order2_matrices(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """The ``h × h`` factors ``(C_G, B_G, C_H, B_H, s)`` of ``G′ = G + ξ_G C_G + s·G B_G``.

    See :func:`_order2_endpoint`.
    """
    XG = xG.mT @ G
    XH = xH.mT @ H
    eye = _eye_like(XG)
    if metric == "inv":
        cG = eye + 0.5 * (MG_inv @ (XG + XG.mT))
        cH = eye + 0.5 * (MH_inv @ (XH + XH.mT))
        return cG, MG_inv @ (xG.mT @ xG), cH, MH_inv @ (xH.mT @ xH), -0.5
    cG = eye - 0.5 * ((XH + XH.mT) @ MH_inv)
    cH = eye - 0.5 * ((XG + XG.mT) @ MG_inv)
    return cG, (xH.mT @ xH) @ MH_inv, cH, (xG.mT @ xG) @ MG_inv, 0.5


def _order2_endpoint(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
) -> tuple[Tensor, Tensor]:
    """``(G, H) + ξ − ½Γ(ξ, ξ)`` of :func:`_christoffel`, factored through ``h × h`` matrices.

    Every term of ``Γ`` is ``ξ_X A`` or ``X B`` with ``h × h`` matrices ``A``, ``B`` (SPEC §4):

    .. code-block:: text

        inv:  G′ = G + ξ_G (I + ½ M_G⁻¹ S_G) − G (½ M_G⁻¹ ξ_Gᵀ ξ_G),   S_G = ξ_Gᵀ G + Gᵀ ξ_G
        mix:  G′ = G + ξ_G (I − ½ S_H M_H⁻¹) + G (½ ξ_Hᵀ ξ_H M_H⁻¹),   S_H = ξ_Hᵀ H + Hᵀ ξ_H

    (and the same with ``G ↔ H``), so that the ``n × h`` work is two fused multiply-adds per
    factor instead of four products, a negation and three additions. The same values as
    ``point + ξ − ½Γ`` up to rounding. When only ``ξ`` needs a gradient (the ascent: the base
    point and its factorizations are constants), the backward is :class:`_Order2Endpoint`'s:
    three fused products per factor, ``∂ξ_X = g_X C_Xᵀ + X P_X + ξ_X Q_X``, where autograd
    would form four products and accumulate them one by one.
    """
    if _hand_backward(xG, xH) and not any(t.requires_grad for t in (G, H, MG_inv, MH_inv)):
        return _Order2Endpoint.apply(xG, xH, G, H, MG_inv, MH_inv, metric)
    return _order2_forward(G, H, xG, xH, MG_inv, MH_inv, metric)[:2]


def _order2_forward(
    G: Tensor, H: Tensor, xG: Tensor, xH: Tensor, MG_inv: Tensor, MH_inv: Tensor, metric: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """``(G′, H′, C_G, C_H, s)``: the endpoint and the factors its backward needs."""
    cG, bG, cH, bH, s = _order2_matrices(G, H, xG, xH, MG_inv, MH_inv, metric)
    Gp = _add_mm(_add_mm(G, xG, cG), G, bG, alpha=s)
    Hp = _add_mm(_add_mm(H, xH, cH), H, bH, alpha=s)
    return Gp, Hp, cG, cH, s


def _hand_backward(xG: Tensor, xH: Tensor) -> bool:
    """Whether :class:`_Order2Endpoint` may serve: a reverse-mode gradient in ``ξ``.

    Not under a ``torch.func`` transform, nor with forward-mode dual tensors: it has no ``jvp``
    or ``vmap`` rule, and plain autograd serves those.
    """
    if not (torch.is_grad_enabled() and (xG.requires_grad or xH.requires_grad)):
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    fwd = torch.autograd.forward_ad
    return fwd.unpack_dual(xG).tangent is None and fwd.unpack_dual(xH).tangent is None


def _sym(X: Tensor) -> Tensor:
    return X + X.mT


class _Order2Endpoint(torch.autograd.Function):
    """The order-2 endpoint of :func:`_order2_endpoint` with a hand-written backward in ``ξ``.

    With ``G′ = G + ξ_G C_G + s·G B_G`` and ``g_G = ∂L/∂G′``: ``∂C_G = ξ_Gᵀ g_G``,
    ``∂B_G = s·Gᵀ g_G``; ``C`` depends on ``ξ`` through ``ξ_Xᵀ X`` and ``B`` through ``ξ_Xᵀ ξ_X``
    (inv: ``X`` the same factor; mix: the other one), so

    .. code-block:: text

        ∂ξ_G = g_G C_Gᵀ + G·sym(∂S_G) + ξ_G·sym(∂T_G),   sym(A) = A + Aᵀ,
        inv:  ∂S_G = ½ M_G⁻ᵀ ∂C_G,      ∂T_G = M_G⁻ᵀ ∂B_G
        mix:  ∂S_G = −½ ∂C_H M_G⁻ᵀ,     ∂T_G = ∂B_H M_G⁻ᵀ

    (and ``G ↔ H``). The backward is made of differentiable operations on the inputs (``C`` is
    recomputed from ``ξ`` when a graph of the backward is asked for), so Hessian-vector
    products through the endpoint (:func:`geosharp.curvature`) are exact.
    """

    @staticmethod
    def forward(ctx, xG, xH, G, H, MG_inv, MH_inv, metric):
        Gp, Hp, cG, cH, s = _order2_forward(G, H, xG, xH, MG_inv, MH_inv, metric)
        ctx.save_for_backward(xG, xH, G, H, MG_inv, MH_inv, cG, cH)
        ctx.metric, ctx.s = metric, s
        return Gp, Hp

    @staticmethod
    def backward(ctx, gG, gH):
        xG, xH, G, H, MG_inv, MH_inv, cG, cH = ctx.saved_tensors
        metric, s = ctx.metric, ctx.s
        if torch.is_grad_enabled():  # create_graph: C as a function of ξ, not a constant
            cG, _, cH, _, _ = _order2_matrices(G, H, xG, xH, MG_inv, MH_inv, metric)
        gG = torch.zeros_like(G) if gG is None else gG
        gH = torch.zeros_like(H) if gH is None else gH
        dCG, dBG = xG.mT @ gG, s * (G.mT @ gG)
        dCH, dBH = xH.mT @ gH, s * (H.mT @ gH)
        if metric == "inv":
            dSG, dTG = 0.5 * (MG_inv.mT @ dCG), MG_inv.mT @ dBG
            dSH, dTH = 0.5 * (MH_inv.mT @ dCH), MH_inv.mT @ dBH
        else:
            dSG, dTG = -0.5 * (dCH @ MG_inv.mT), dBH @ MG_inv.mT
            dSH, dTH = -0.5 * (dCG @ MH_inv.mT), dBG @ MH_inv.mT
        dxG = _add_mm(_add_mm(gG @ cG.mT, G, _sym(dSG)), xG, _sym(dTG))
        dxH = _add_mm(_add_mm(gH @ cH.mT, H, _sym(dSH)), xH, _sym(dTH))
        return dxG, dxH, None, None, None, None, None


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
            per-step products (``None``: only when ``tangent_dtype`` is the compute dtype, i.e.
            when memory was not asked to be saved); otherwise it is widened again by every
            product that needs it (a cast of ``G``, ``H`` per projection).

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
        MG = _gram(self._G, self.eps)
        MH = _gram(self._H, self.eps)
        lg, Ug = _spd_funcs(MG)
        lh, Uh = _spd_funcs(MH)
        self._check_rank("G", lg, h, G.dtype)
        self._check_rank("H", lh, h, H.dtype)
        factors = {
            "MG": MG,
            "MH": MH,
            "MG_inv": _apply_spectral(lg, Ug, 1.0 / lg),
            "MH_inv": _apply_spectral(lh, Uh, 1.0 / lh),
        }
        # Square roots for sampling: inv samples Z M_G^{1/2}, mix samples Z M_H^{-1/2}.
        if self.metric == "inv":
            MH_sqrt = _apply_spectral(lh, Uh, lh.sqrt())
            factors["_sample_G"] = _apply_spectral(lg, Ug, lg.sqrt())
            factors["_sample_H"] = MH_sqrt
            # Sylvester solve of SPEC §4 (corrected): A Λ + Λ A = B with A = M_H M_G, A similar
            # to C = M_H^{1/2} M_G M_H^{1/2} = Q D Qᵀ via S = M_H^{1/2} Q.
            d, Q = torch.linalg.eigh(MH_sqrt @ MG @ MH_sqrt)
            factors["_S"] = MH_sqrt @ Q
            factors["_S_inv"] = Q.mT @ _apply_spectral(lh, Uh, lh.rsqrt())
            factors["_denom"] = d.unsqueeze(-1) + d.unsqueeze(-2)
        else:
            factors["_sample_G"] = _apply_spectral(lh, Uh, lh.rsqrt())
            factors["_sample_H"] = _apply_spectral(lg, Ug, lg.rsqrt())
        for key, value in factors.items():
            setattr(self, key, value)
        self._MG_inv_lo = self.MG_inv.to(G.dtype)
        self._MH_inv_lo = self.MH_inv.to(G.dtype)
        self._hold_wide = bool(hold_wide_point)
        if not self._hold_wide:
            self._G = self._H = None  # widened on demand (see the properties below)
        self._use_work_dtype(work_dtype)

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

    def _raise_singular(self, which: str, names: list[str], cond: float) -> None:
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        raise ValueError(
            f"eps=0 but the Gram matrix {which}ᵀ{which} of {len(names)} block(s) {shown} is "
            f"singular (cond {cond:.1e}); pass eps>0 (e.g. eps=1e-6 times the typical squared "
            f"weight norm) to damp it"
        )

    def _check_rank(self, which: str, lam: Tensor, h: int, dtype: torch.dtype) -> None:
        lam_max = lam[..., -1:].clamp_min(torch.finfo(lam.dtype).tiny)
        bad = lam[..., :1] <= singular_threshold(dtype, max(h, 2)) * lam_max
        if self.eps == 0.0 and bool(bad.any()):
            lam_min = lam[..., 0].abs().clamp_min(torch.finfo(lam.dtype).tiny)
            cond = float((lam[..., -1] / lam_min).max())
            where = ""
            if self.head_names is not None:
                flat_bad = bad.reshape(-1).nonzero().flatten().tolist()
                return self._raise_singular(which, [self.head_names[i] for i in flat_bad], cond)
            if lam.dim() > 1:
                idx = [tuple(i.tolist()) for i in bad.squeeze(-1).nonzero()][:5]
                where = f" at batch index {idx}"
            raise ValueError(
                f"eps=0 but the Gram matrix {which}ᵀ{which} of block '{self.name}'{where} is "
                f"singular (cond {cond:.1e}); pass eps>0 (e.g. eps=1e-6 times the typical squared "
                f"weight norm) to damp it"
            )
        if bool((lam[..., 0] <= 0).any()):
            raise ValueError(
                f"the damped Gram matrix {which}ᵀ{which} + eps·I of block '{self.name}' is not "
                f"positive definite (eps={self.eps}); increase eps"
            )

    # -- validation -----------------------------------------------------------------------------
    @property
    def tangent_dtype(self) -> torch.dtype:
        """The dtype tangents are kept in between calls (the ``tangent_dtype`` argument)."""
        return self._tangent_dtype

    def _check_tangent(self, xi: Tangent, name: str = "xi") -> tuple[Tensor, Tensor]:
        """Validate a tangent pair (dtype of ``G`` or the compute dtype); return it widened."""
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
        return xi[0].to(self.compute_dtype), xi[1].to(self.compute_dtype)

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
        aG, aH = self._check_tangent(a, "a")
        bG, bH = self._check_tangent(b, "b")
        return self._trace_form(aG.mT @ bG, aH.mT @ bH).to(a[0].dtype)

    def norm_sq(self, xi: Tangent) -> Tensor:
        """Squared norm ``⟨ξ, ξ⟩`` from the ``h × h`` Gram matrices ``ξ_Gᵀ ξ_G``, ``ξ_Hᵀ ξ_H``."""
        xG, xH = self._check_tangent(xi)
        return self._trace_form(xG.mT @ xG, xH.mT @ xH).to(xi[0].dtype)

    def _trace_form(self, XG: Tensor, XH: Tensor) -> Tensor:
        """``tr(M_a XG) + tr(M_b XH)`` with the metric's pair ``(M_a, M_b)``.

        inv: ``(M_G⁻¹, M_H⁻¹)``; mix: ``(M_H, M_G)`` (symmetric, so each trace is an
        element-wise sum).
        """
        if self.metric == "inv":
            return (XG * self.MG_inv).sum((-2, -1)) + (XH * self.MH_inv).sum((-2, -1))
        return (XG * self.MH).sum((-2, -1)) + (XH * self.MG).sum((-2, -1))

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
        if self.metric == "mix":
            return 0.5 * ((xH.mT @ self._H) @ self.MH_inv - self.MG_inv @ (self._G.mT @ xG))
        B = (xH.mT @ self._H) @ self.MG - self.MH @ (self._G.mT @ xG)
        Y = (self._S_inv @ B @ self._S) / self._denom
        return self._S @ Y @ self._S_inv

    def project(self, xi: Tangent) -> Tangent:
        """Horizontal projection ``P(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` (SPEC §4).

        Exactly the metric-orthogonal projection onto the horizontal space at ``eps = 0``.
        """
        wide = self._check_tangent(xi)
        return self._down(*self._project_wide(wide), like=xi[0])

    def horizontal_grad(self, egrad: Tangent) -> Tangent:
        """The horizontal projection of the Riemannian gradient (the ascent direction).

        ``P(g⁻¹ e)`` in one pass in :attr:`compute_dtype`: the tangent is widened once and the
        result rounded once (``project(riemannian_grad(e))`` would round in between).
        """
        eG, eH = self._check_tangent(egrad, "egrad")
        if self.metric == "inv":
            rg = (eG @ self.MG, eH @ self.MH)
        else:
            rg = (eG @ self.MH_inv, eH @ self.MG_inv)
        del eG, eH
        return self._down(*self._project_wide(rg), like=egrad[0])

    def _project_wide(self, xi: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """:meth:`project` of a tangent already in :attr:`compute_dtype`, left in it."""
        with self._wide_point():
            L = self.lam(xi)
            return _add_mm(xi[0], self._G, L), _add_mm(xi[1], self._H, L.mT, alpha=-1.0)

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
        if self.metric == "inv":
            return self._down(eG @ self.MG, eH @ self.MH, like=egrad[0])
        return self._down(eG @ self.MH_inv, eH @ self.MG_inv, like=egrad[0])

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

    def geodesic(self, xi: Tangent, order: int | str = 2, steps: int = DEFAULT_RK4_STEPS) -> Point:
        """Geodesic endpoint at ``t = 1`` (order 1, 2 or ``"exact"``); see :class:`Geometry`.

        Returned in the dtype of ``G``. Order 1 and the RK4 run in :attr:`compute_dtype`; the
        second-order term ``½Γ(ξ, ξ)`` of order 2 is evaluated in the dtype of ``G`` (it is a
        correction of relative size ``‖ξ‖``, so its rounding error is ``O(‖ξ‖²·eps)``, while
        float64 would double the cost of the ascent's forward and backward through it).
        """
        order = check_order(order)
        if order == 2 and self.dtype != self.compute_dtype:
            self._check_tangent(xi)
            xG, xH = xi[0].to(self.dtype), xi[1].to(self.dtype)
            return _order2_endpoint(
                self.G, self.H, xG, xH, self._MG_inv_lo, self._MH_inv_lo, self.metric
            )
        if order == 1 and xi[0].dtype == xi[1].dtype == self.dtype:
            self._check_tangent(xi)  # tangents in the model's dtype: G + ξ is one rounding
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
        xi = (scale * zG @ self._sample_G, scale * zH @ self._sample_H)
        if horizontal:
            xi = self.project(xi)
        return tuple(t.to(dtype or self.dtype) for t in xi)


# ---------------------------------------------------------------------------------------------
# Group action
# ---------------------------------------------------------------------------------------------
def act(G: Tensor, H: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Group action ``(G, H) ↦ (G A⁻¹, H Aᵀ)`` of ``A ∈ GL(h)`` (batched; ``A⁻¹`` by a solve).

    Args:
        G: Shape ``(..., n, h)``.
        H: Shape ``(..., m, h)``.
        A: Invertible matrices, shape ``(..., h, h)``.

    Returns:
        The transformed pair; ``G Hᵀ`` is unchanged.
    """
    return _right_solve(G, A), H @ A.mT


def act_tangent(xi_G: Tensor, xi_H: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Push-forward of a tangent vector by the group action: ``(ξ_G A⁻¹, ξ_H Aᵀ)``."""
    return _right_solve(xi_G, A), xi_H @ A.mT


def _right_solve(X: Tensor, A: Tensor) -> Tensor:
    """``X A⁻¹`` without forming the inverse."""
    return torch.linalg.solve(A.mT, X.mT).mT


# ---------------------------------------------------------------------------------------------
# Functional API: each call factorizes the base point; use GLGeometry to reuse it.
# ---------------------------------------------------------------------------------------------
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
