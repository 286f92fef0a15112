r"""Why the exact GL(h) geodesic of a block came out unusable (SPEC §4.6), in one line.

Fixed-step RK4 of ``γ̈ = −Γ_γ(γ̇, γ̇)`` (``order="exact"``) is stable only while a step moves
each head by a small fraction of its own size. The GL(h)-invariant measure of that is the
**relative speed** of a head,

.. code-block:: text

    κ = max(‖ξ_G M_G^{−1/2}‖_F, ‖ξ_H M_H^{−1/2}‖_F)
      = max(tr(M_G⁻¹ ξ_Gᵀξ_G), tr(M_H⁻¹ ξ_Hᵀξ_H))^{1/2}

(how many times its own scale ``ξ`` moves the head per unit time). The right-hand side is
quadratic in the velocity, so a step of ``κ/steps ≳ 1`` can overshoot, make the next stage's
velocity larger still, and overflow within a few steps, although the true geodesic is regular:
on a tiny BERT (``save_tiny_bert``: initialization std 0.02, Gram eigenvalues 0.002–0.03) the
mix ball of radius 0.3 gives a head ``κ ≈ 11``, whose 10-step RK4 overflows near ``t = 0.3``
while the geodesic (DOP853, rtol 1e-13) keeps its Gram eigenvalues above ``2.3e-3``; with 20,
40, 100, 400 steps RK4 converges to it at fourth order. The other cause of an unusable endpoint
is the geodesic itself leaving the region where the metric is defined (a Gram matrix of the
moving point becoming singular), which no number of steps cures.

:func:`exact_geodesic_trouble` tells the two apart after the fact (never on the path of a
measurement: a caller asks once, after a non-finite loss): it integrates the block again with
``max(4·steps, ⌈2κ⌉)`` steps to the times ``t = k/8`` (``γ_ξ(t) = γ_{tξ}(1)``) and watches the
Gram matrices of the moving point.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from geosharp.geometry._validate import singular_threshold
from geosharp.geometry.base import Tangent
from geosharp.geometry.gl_factors import _gram
from geosharp.geometry.gl_rows import contract

if TYPE_CHECKING:
    from geosharp.geometry.gl import GLGeometry

__all__ = ["exact_geodesic_trouble", "relative_speed"]

#: Times at which the finer integration is inspected.
_TIMES = 8
#: The most RK4 steps of the finer integration (it runs after a failure, but not for hours).
_MAX_STEPS = 1000


def relative_speed(geom: GLGeometry, xi: Tangent) -> Tensor:
    """``κ`` of every head (module docstring): ``ξ`` measured in units of the head's own scale.

    GL(h)-invariant at ``ε = 0``; from the base-point factors and two ``h × h`` contractions.
    """
    xG, xH = geom._check_tangent(xi)
    KG, KH = contract((xG, xG), (xH, xH), row_sum=geom.execution.row_sum)
    F = geom.factors
    kG = (KG * F.MG_inv).sum((-2, -1))
    kH = (KH * F.MH_inv).sum((-2, -1))
    return torch.maximum(kG, kH).clamp_min(0.0).sqrt()


def _spectra(geom: GLGeometry, G: Tensor, H: Tensor) -> tuple[Tensor, Tensor]:
    """``(λ_min, λ_max)`` of the undamped Gram matrices ``GᵀG`` and ``HᵀH``, stacked ``(2, heads)``.

    Per head, flattened, in float64; NaN where a Gram matrix is not finite.
    """
    rs = geom.execution.row_sum
    lo, hi = [], []
    for X in (G, H):
        h = X.shape[-1]
        M = _gram(X, 0.0, rs).to(torch.float64).reshape(-1, h, h)
        ok = torch.isfinite(M).all((-2, -1))
        eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        lam = torch.linalg.eigvalsh(torch.where(ok[:, None, None], M, eye))
        nan = torch.full_like(lam[:, 0], math.nan)
        lo.append(torch.where(ok, lam[:, 0], nan))
        hi.append(torch.where(ok, lam[:, -1], nan))
    return torch.stack(lo), torch.stack(hi)


def _health(lo: Tensor, hi: Tensor, hi0: Tensor, small: float) -> Tensor:
    """Per head: the smaller of ``λ_min/λ_max`` and ``λ_min/λ_max(0)`` over both Gram matrices.

    Small when a Gram matrix loses rank or the head collapses towards 0; 0 when it blows up
    (``λ_max/λ_max(0) > small^{−1/2}``: the head ~``small^{−1/4}`` times its size, far past any
    ρ a measurement uses); NaN when not finite.
    """
    tiny = torch.finfo(lo.dtype).tiny
    r = torch.minimum(lo / hi.clamp_min(tiny), lo / hi0.clamp_min(tiny))
    blown = hi / hi0.clamp_min(tiny) > small**-0.5
    return torch.where(blown, torch.zeros_like(r), r).amin(0)  # amin propagates NaN


def _label(geom: GLGeometry, heads: list[int], batch: tuple[int, ...]) -> str:
    shown = heads[:3]
    if geom.head_names is not None:
        names = ", ".join(repr(geom.head_names[i]) for i in shown)
    else:
        idx = [tuple(int(j) for j in torch.unravel_index(torch.tensor(i), batch)) for i in shown]
        names = f"'{geom.name}'" + (" at batch index " + ", ".join(map(str, idx)) if batch else "")
    more = f" and {len(heads) - len(shown)} more" if len(heads) > len(shown) else ""
    return f"{names}{more}"


@torch.no_grad()
def exact_geodesic_trouble(geom: GLGeometry, xi: Tangent, steps: int) -> str | None:
    """One line on why the exact geodesic with ``steps`` RK4 steps is unusable, or ``None``.

    ``None`` when the endpoint of every head is finite, with Gram matrices neither singular nor
    blown up. Otherwise the block is integrated again with ``max(4·steps, ⌈2κ⌉)`` steps (at most
    1000; κ: :func:`relative_speed`), and the line says either that the step was too coarse (the
    finer geodesic stays finite with regular Gram matrices: raise ``exact_steps``) or by about
    which ``t`` a Gram matrix of the moving point becomes singular or blows up (the geodesic
    leaves the region where the metric is defined: use order 2, a smaller ρ, or ``eps > 0``).
    Costs a few RK4 integrations of the block; meant for after a failure, not for the hot path.
    With the rows split over ranks every rank must call it (its contractions are collective).
    """
    xG, xH = geom._check_tangent(xi)
    G, H = geom._point()
    batch = tuple(G.shape[:-2])
    end = geom._rk4((xG, xH), steps, point=(G, H))
    thresh = singular_threshold(geom.dtype, max(G.shape[-1], 2))
    lo0, hi0 = _spectra(geom, G, H)
    ratio0 = _health(lo0, hi0, hi0, thresh)
    r1 = _health(*_spectra(geom, *end), hi0, thresh)
    bad = r1.isnan() | (r1 <= thresh)
    if not bool(bad.any()):
        return None
    heads = bad.nonzero().flatten().tolist()
    kappa = relative_speed(geom, (xG, xH)).flatten()[bad]
    kmax = float(kappa.max())
    fine = max(4 * steps, math.ceil(2.0 * kmax))
    capped = fine > _MAX_STEPS
    fine = min(fine, max(_MAX_STEPS, steps + 1))
    ratio0, hi0 = ratio0[bad], hi0[:, bad]
    lowest, t_fail = ratio0.clone(), None
    for k in range(1, _TIMES + 1):
        t = k / _TIMES
        pt = geom._rk4((t * xG, t * xH), max(1, math.ceil(t * fine)), point=(G, H))
        lo, hi = _spectra(geom, *pt)
        r = _health(lo[:, bad], hi[:, bad], hi0, thresh)
        if bool((r.isnan() | (r <= thresh)).any()):
            t_fail = t
            break
        lowest = torch.minimum(lowest, r)
    where = f"exact geodesic of {_label(geom, heads, batch)}"
    fastest = "the fastest head" if len(heads) > 1 else "the head"
    speed = f"relative speed κ ≈ {kmax:.3g} (ξ moves {fastest} {kmax:.3g}× its size per unit time)"
    if t_fail is None:
        return (
            f"the {where} blew up with {steps} RK4 steps, a step too coarse for its {speed}; the "
            f"geodesic itself is regular: with {fine} steps it stays finite and its Gram matrices "
            f"non-singular (smallest eigenvalue ratio {float(lowest.min()):.2g}, "
            f"{float(ratio0.min()):.2g} at t=0); use exact_steps >= {fine} (RK4 needs about 2κ), "
            "a smaller rho, or order 2"
        )
    more = f" (or needs more than {fine} steps)" if capped else ""
    return (
        f"the {where} leaves the region where the metric is defined{more}: a Gram matrix of the "
        f"moving point becomes singular or blows up by t ≈ {t_fail:.3g} even with {fine} RK4 "
        f"steps ({speed}; smallest eigenvalue ratio before that {float(lowest.min()):.2g}, "
        f"{float(ratio0.min()):.2g} at t=0); use order 2, a smaller rho, or eps > 0"
    )
