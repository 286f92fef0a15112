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

import torch

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


def _momentum_(z: Xi, xi: Xi, xi_prev: Xi, a: float, b: float) -> None:
    """``z ← a·z + 2b·ξ_k − b·ξ_{k−1}``, in place.

    A function of its own: its loop variables, which would keep ``ξ_{k−1}`` alive through the
    next forward and backward, die with its frame.
    """
    for tz, tx, tp in zip(z, xi, xi_prev, strict=True):
        for t, x, p in zip(tz, tx, tp, strict=True):
            t.mul_(a).add_(x, alpha=2.0 * b).add_(p, alpha=-b)


def autopgd(
    pert: Perturbation,
    loss: LossFn,
    rho: float,
    steps: int,
    xi0: Xi | None,
    norm: str = "l2",
    start: tuple[float, Xi | None] | list | None = None,
    keep_best_direction: bool = True,
) -> AscentResult:
    """Maximize ``loss(ξ)`` over the ball ``‖ξ‖ ≤ ρ`` (or the ℓ∞ box) with Auto-PGD.

    Args:
        pert: The perturbation set (geometry, ball, endpoint).
        loss: ``loss(ξ, need_grad) -> (value, Euclidean gradient w.r.t. ξ or None)``; one
            forward (and one backward when ``need_grad``) of the model.
        rho: Radius.
        steps: Number of iterations ``N`` (gradient evaluations).
        xi0: Starting point (inside the ball); ``None`` for ``ξ = 0``, made here (a caller
            that passed a zero perturbation would hold it through the whole ascent, while
            Auto-PGD needs it only until its second step).
        norm: ``"l2"`` (metric ball, normalized Riemannian-gradient steps) or ``"linf"`` (box,
            sign steps).
        start: ``(loss, gradient)`` at ``xi0`` if already computed; a list is emptied, so that
            the caller holds no reference to the gradient, which becomes the first direction.
        keep_best_direction: Keep the ascent direction of the best iterate for restarts (one
            ξ-sized buffer). ``False`` trades it for time: a restart from a best iterate older
            than the current one recomputes its gradient (one extra forward and backward,
            counted by ``loss``); the iterates are the same.

    Returns:
        An :class:`AscentResult`.
    """
    eta = 2.0 * rho
    if xi0 is None:
        xi0 = pert.zeros()
    xi, xi_prev = xi0, xi0
    del xi0  # held as the first ξ_{k−1} and best iterate only: freed once both move on
    value, egrad = start if start is not None else loss(xi, True)
    if isinstance(start, list):
        start.clear()  # the caller's gradient lives on only as `direction` (computed in place)
    # The ascent direction at the current iterate: the Riemannian gradient (ℓ2) or the Euclidean
    # gradient whose signs are taken (ℓ∞). Stored with the best iterate for restarts.
    direction = pert.riemannian_grad(egrad, inplace=True) if norm == "l2" else egrad
    res = AscentResult(best_loss=value, best_xi=xi, start_loss=value, trace=[value])
    best_direction = direction if keep_best_direction else None
    cps = set(checkpoints(steps))
    n_improved, last_cp, eta_at_cp, best_at_cp = 0, 0, eta, value
    a, b = MOMENTUM, 1.0 - MOMENTUM
    for i in range(steps):
        # ξ_{k+1} = P(ξ_k + α(z − ξ_k) + (1−α)(ξ_k − ξ_{k−1})) = P(α z + 2(1−α) ξ_k − (1−α) ξ_{k−1})
        # with z = P(ξ_k + η d_k); computed in place on fresh tensors (few full-size passes).
        # ξ_k, ξ_{k−1} and the projected direction d_k are horizontal, so every combination is:
        # the horizontal part of P is the identity here and only the radial rescale remains.
        if norm == "l2":
            rn = pert.norm(direction)
            if not math.isfinite(rn):
                raise FloatingPointError(
                    f"the norm of the ascent direction is {rn}: the gradient or the metric is "
                    "not finite (a symmetry block near-singular at eps=0? try eps > 0)"
                )
            scale = eta / rn if rn > 0 else 0.0
            reuse = direction is not best_direction
            z = [
                tuple(
                    torch.add(x, d, alpha=scale, out=d) if reuse else torch.add(x, d, alpha=scale)
                    for x, d in zip(tx, td, strict=True)
                )
                for tx, td in zip(xi, direction, strict=True)
            ]
            # P(z) = c·z with c = min(1, ρ/‖z‖): folded into the momentum's factor on z (one
            # pass over ξ fewer; the same point up to float rounding)
            nz = pert.norm(z)
            c = rho / nz if nz > rho else 1.0
        else:
            step = pert.sign_direction(direction)
            z = pert.box(Perturbation.combine(xi, step, 1.0, eta), rho)
            c = 1.0
        _momentum_(z, xi, xi_prev, a * c, b)
        new = pert.ball(z, rho, inplace=True, project=False) if norm == "l2" else pert.box(z, rho)
        res.step_sizes.append(eta)
        xi_prev, xi = xi, new
        # the old direction is not needed any more (unless it is the best iterate's): drop it
        # before the forward and backward, which then reuse its memory
        direction = z = new = egrad = None
        value, egrad = loss(xi, i < steps - 1)
        if egrad is not None:
            direction = pert.riemannian_grad(egrad, inplace=True) if norm == "l2" else egrad
        res.trace.append(value)
        if value > res.best_loss:
            res.best_loss, res.best_xi = value, xi
            best_direction = direction if keep_best_direction else None
            n_improved += 1
        if i in cps:
            too_few = n_improved < MIN_UPDATE_RATIO * (i - last_cp)
            stalled = eta == eta_at_cp and res.best_loss == best_at_cp
            eta_at_cp, best_at_cp, last_cp, n_improved = eta, res.best_loss, i, 0
            if too_few or stalled:
                eta /= 2.0
                if keep_best_direction:
                    direction = best_direction
                elif res.best_xi is not xi and i < steps - 1:  # recompute its direction
                    direction = egrad = None  # (egrad is the current direction's buffer)
                    _, egrad = loss(res.best_xi, True)
                    direction = pert.riemannian_grad(egrad, inplace=True) if norm == "l2" else egrad
                    egrad = None
                xi = res.best_xi
                res.restarts.append(i)
    return res
