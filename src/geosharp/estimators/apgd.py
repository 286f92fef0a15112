"""Auto-PGD for the inner maximization of worst-case sharpness (SPEC §6, paper Algorithm 1).

The schedule follows Croce & Hein (2020) as used by the reference code of Andriushchenko et al.
(2023), with the paper's changes: the step is a normalized *Riemannian* gradient, projected
horizontally, and the projection onto the ball is the exact metric projection (horizontal
projection, then a radial rescale). Unlike the reference implementation, each iteration costs
exactly one forward and one backward pass: the loss at the new iterate comes from the same
forward pass that provides the next gradient, and the last iterate is evaluated by a forward
pass alone. A restart from the best point reuses the gradient stored with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from geosharp.estimators.perturbation import Perturbation, Xi

#: Momentum of Auto-PGD (SPEC §6, step 5).
MOMENTUM = 0.75
#: Fraction of improving steps below which the step size is halved at a checkpoint.
MIN_UPDATE_RATIO = 0.75

LossFn = Callable[[Xi, bool], "tuple[float, Xi | None]"]


def checkpoints(n_iters: int) -> list[int]:
    """Auto-PGD checkpoints ``⌈p_j N⌉`` (SPEC §6, step 6).

    ``p₀ = 0``, ``p₁ = 0.22``, ``p_{j+1} = p_j + max(p_j − p_{j−1} − 0.03, 0.06)``; iteration
    indices are 0-based and the list stops before ``N``. Computed in the same floating-point
    order as the reference code, so that ``N = 20`` gives exactly its checkpoints.

    Args:
        n_iters: Number of iterations ``N``.

    Returns:
        The sorted checkpoint iterations.

    Example:
        >>> checkpoints(20)
        [5, 9, 12, 15, 16, 18, 19]
    """
    p = [0.0, 0.22]
    w = [0, math.ceil(n_iters * 0.22)]
    while w[-1] < n_iters and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iters))
    return sorted({c for c in w[1:] if c < n_iters})


@dataclass
class AscentResult:
    """Outcome of one Auto-PGD run on one batch.

    Attributes:
        best_loss: ``ℓ_max``, the largest loss seen.
        best_xi: The perturbation that achieved it.
        start_loss: Loss at the starting point.
        trace: Loss at every iterate, the start included.
        step_sizes: Step size used at every iteration.
        restarts: Iterations at which the step size was halved and the ascent restarted from
            the best point.
    """

    best_loss: float
    best_xi: Xi
    start_loss: float
    trace: list[float] = field(default_factory=list)
    step_sizes: list[float] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)


def autopgd(
    pert: Perturbation,
    loss: LossFn,
    rho: float,
    steps: int,
    xi0: Xi,
    norm: str = "l2",
    start: tuple[float, Xi | None] | None = None,
) -> AscentResult:
    """Maximize ``loss(ξ)`` over the ball ``‖ξ‖ ≤ ρ`` (or the ℓ∞ box) with Auto-PGD.

    Args:
        pert: The perturbation set (geometry, ball, endpoint).
        loss: ``loss(ξ, need_grad) -> (value, Euclidean gradient w.r.t. ξ or None)``; one
            forward (and one backward when ``need_grad``) of the model.
        rho: Radius.
        steps: Number of iterations ``N`` (gradient evaluations).
        xi0: Starting point (inside the ball).
        norm: ``"l2"`` (metric ball, normalized Riemannian-gradient steps) or ``"linf"`` (box,
            sign steps).
        start: ``(loss, gradient)`` at ``xi0`` if already computed.

    Returns:
        An :class:`AscentResult`.
    """
    eta = 2.0 * rho
    xi, xi_prev = xi0, xi0
    value, egrad = start if start is not None else loss(xi, True)
    res = AscentResult(best_loss=value, best_xi=xi, start_loss=value, trace=[value])
    best_egrad = egrad
    cps = set(checkpoints(steps))
    n_improved, last_cp, eta_at_cp, best_at_cp = 0, 0, eta, value
    for i in range(steps):
        if norm == "l2":
            r = pert.riemannian_grad(egrad)
            rn = pert.norm(r)
            step = Perturbation.combine(xi, r, 1.0, eta / rn if rn > 0 else 0.0)
            z = pert.ball(step, rho)
            cand = Perturbation.combine(
                Perturbation.combine(xi, z, 1.0 - MOMENTUM, MOMENTUM),
                Perturbation.combine(xi, xi_prev, 1.0, -1.0),
                1.0,
                1.0 - MOMENTUM,
            )
            new = pert.ball(cand, rho)
        else:
            z = pert.box(Perturbation.combine(xi, pert.sign_direction(egrad), 1.0, eta), rho)
            cand = Perturbation.combine(
                Perturbation.combine(xi, z, 1.0 - MOMENTUM, MOMENTUM),
                Perturbation.combine(xi, xi_prev, 1.0, -1.0),
                1.0,
                1.0 - MOMENTUM,
            )
            new = pert.box(cand, rho)
        res.step_sizes.append(eta)
        xi_prev, xi = xi, new
        value, egrad = loss(xi, i < steps - 1)
        res.trace.append(value)
        if value > res.best_loss:
            res.best_loss, res.best_xi, best_egrad = value, xi, egrad
            n_improved += 1
        if i in cps:
            too_few = n_improved < MIN_UPDATE_RATIO * (i - last_cp)
            stalled = eta == eta_at_cp and res.best_loss == best_at_cp
            eta_at_cp, best_at_cp, last_cp, n_improved = eta, res.best_loss, i, 0
            if too_few or stalled:
                eta /= 2.0
                xi, egrad = res.best_xi, best_egrad
                res.restarts.append(i)
    return res
