"""Auto-PGD for the inner maximization of worst-case sharpness (SPEC §6, paper Algorithm 1).

The schedule follows Croce & Hein (2020) as used by the reference code of Andriushchenko et al.
(2023), with the paper's changes: the step is a normalized *Riemannian* gradient, projected
horizontally, and the projection onto the ball is the exact metric projection (horizontal
projection, then a radial rescale). Unlike the reference implementation, each iteration costs
one forward and one backward pass at most: the loss at the new iterate comes from the same
forward pass that provides the next gradient, the last iterate is evaluated by a forward pass
alone, and so is an iterate the ascent leaves at once for the best one (a restart). A restart
reuses the gradient stored with the best point, or recomputes it (:func:`best_direction_rule`).
The norms the step needs are pairings of the gradient with the iterates and a Gram recursion:
no pass over the parameters computes a metric norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.geometry.flat import axpy, clone, combine_into_, lists, scale_

#: Momentum of Auto-PGD (SPEC §6, step 5).
MOMENTUM = 0.75
#: Fraction of improving steps below which the step size is halved at a checkpoint.
MIN_UPDATE_RATIO = 0.75

#: ``loss(ξ, need_grad) -> (value, gradient or None)``; ``need_grad`` is a bool or a function of
#: the value that decides, after the forward, whether the backward runs.
LossFn = Callable[[Xi, "bool | Callable[[float], bool]"], "tuple[float, Xi | None]"]


#: Parameter-sized buffers an ascent may hold above a plain forward and backward by default.
BUFFER_BUDGET = 4


def best_direction_rule(
    pert: Perturbation, low_memory: bool = False, budget: float | None = BUFFER_BUDGET
) -> bool | None:
    """The ``keep_best_direction`` of :func:`autopgd` within ``budget`` buffers.

    Keeping the best iterate's direction always holds four perturbation-sized buffers once
    the best iterate is older than ``ξ_{k−1}``; with what the perturbation holds beside its
    iterates (:meth:`Perturbation.buffer_bytes`: block base points, factorizations, gathered
    weights) that must fit in ``budget`` parameter-sized buffers (default
    :data:`BUFFER_BUDGET`; ``None``: no bound), or the direction is kept only while free
    (three buffers, one extra forward and backward per restart from an older best iterate).
    ``low_memory`` always takes the second.

    Returns:
        ``True`` (keep always) or ``None`` (while free).
    """
    if low_memory:
        return None
    if budget is None:
        return True
    xi, held = pert.buffer_bytes()
    need, have = 4 * xi + held, pert.param_bytes
    if pert.reduce is not None:
        # sharded: the sums over the ranks, so that every rank decides alike (a rank that
        # recomputed a direction alone would run a forward the others do not: a collective
        # mismatch); its own shard's figures differ where the shards are uneven
        sums = pert.reduce(torch.tensor([float(need), float(have)], dtype=torch.float64))
        need, have = (float(v) for v in sums.tolist())
    # to a hundredth of a buffer (small masks and scalars are not worth a recomputation)
    return True if need <= (budget + 0.01) * have else None


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
    """``z ← a·z + 2b·ξ_k − b·ξ_{k−1}``, in place (the ℓ∞ step).

    A function of its own: its loop variables, which would keep ``ξ_{k−1}`` alive through the
    next forward and backward, die with its frame.
    """
    for tz, tx, tp in zip(z, xi, xi_prev, strict=True):
        if tz:  # multi-tensor ops: one dispatch each, not one per component
            scale_(tz, a)
            torch._foreach_add_(list(tz), list(tx), alpha=2.0 * b)
            torch._foreach_add_(list(tz), list(tp), alpha=-b)


def _linf_step(
    pert: Perturbation, xi: Xi, xi_prev: Xi, d: Xi, *, eta: float, rho: float, a: float, b: float
) -> Xi:
    """``P(a·P(ξ_k + η sign(d)⊙|w|) + 2b·ξ_k − b·ξ_{k−1})``: the ℓ∞ step, in new tensors.

    The box's ``|w|`` and bounds are formed once for the step (:class:`~geosharp.estimators.
    linf.StepBox`) and both projections clip in place; a function of its own, so that the
    bounds die with its frame, before the next forward and backward.
    """
    box = pert.step_box(rho)
    z = box.project_(box.sign_step(xi, d, eta))
    _momentum_(z, xi, xi_prev, a, b)
    return box.project_(z)


def _piece_step(
    x: tuple[Tensor, ...],
    v: tuple[Tensor, ...],
    p: tuple[Tensor, ...] | None,
    coefs: tuple[float, float, float],
    reuse: bool,
    into_prev: bool,
) -> tuple[Tensor, ...]:
    """``(x + c₁v + c₂p)·k`` of one piece (no ``p`` term where ``p`` is None).

    Written into ``v`` when ``reuse``; over ``p``'s flat buffer with ``into_prev`` where
    :func:`~geosharp.geometry.flat.combine_into_` can (the same values); else in a new buffer.
    """
    c1, c2, k = coefs
    if into_prev and not reuse and p is not None:
        done = combine_into_(x, v, c1, p, c2, k)
        if done is not None:
            return done
    t = axpy(x, v, c1, reuse)
    if p is not None and t:
        torch._foreach_add_(*lists(t, p), alpha=c2)
    if k != 1.0:
        scale_(t, k)
    return t


def _l2_step(
    xi: Xi | None,
    d: Xi,
    prev: Xi | None,
    reuse: bool,
    coef: tuple[float, float, float],
    nsq: float,
    rho: float,
    into_prev: bool = False,
) -> tuple[Xi | None, float]:
    """``P_S(u)``, ``u = α ξ_k + β d + γ ξ_{k−1}``: the momentum step and the ball, in 3 passes.

    ``None`` is the zero perturbation (never made). ``t = ξ_k + (β/α) d`` (written into ``d``
    when ``reuse``), ``t += (γ/α) ξ_{k−1}``, then one rescale of ``t`` to ``r·u`` with
    ``r = min(1, ρ/‖u‖)``: the combination of horizontal vectors is horizontal, so the metric
    projection onto the ball is that radial rescale. ``nsq = ‖u‖²`` comes from the pairings
    of the three vectors (:func:`autopgd`), so no pass computes a norm. With ``into_prev`` (the
    ascent alone holds ``ξ_{k−1}``, which this step retires) the new iterate is written over
    ``ξ_{k−1}``'s buffers where a piece lies in flat buffers on a CPU
    (:func:`~geosharp.geometry.flat.combine_into_`: the same values, no new parameter-sized
    buffer, whose fresh pages cost a CPU more than the three passes). A function of its own, so
    that its loop variables die with its frame.

    Returns:
        The new iterate and ``r``.
    """
    alpha, beta, gamma = coef
    n = math.sqrt(max(nsq, 0.0))
    r = rho / n if n > rho else 1.0
    # one op per piece over its flat buffers (or its components), not one per tensor
    if xi is not None:
        coefs = (beta / alpha, gamma / alpha, alpha * r)
        ps = prev if prev is not None else [None] * len(xi)
        t = [
            _piece_step(tx, tv, tp, coefs, reuse, into_prev)
            for tx, tv, tp in zip(xi, d, ps, strict=True)
        ]
        return t, r
    if beta != 0.0:
        t = d if reuse else [clone(tv) for tv in d]
        s = beta
    elif prev is not None:
        t, s, prev = [clone(tv) for tv in prev], gamma, None
    else:
        return None, 1.0
    if prev is not None:
        for tt, tp in zip(t, prev, strict=True):
            if tt:
                torch._foreach_add_(*lists(tt, tp), alpha=gamma / s)
    if s * r != 1.0:
        for tt in t:
            scale_(tt, s * r)
    return t, r


def autopgd(
    pert: Perturbation,
    loss: LossFn,
    rho: float,
    steps: int,
    xi0: Xi | None,
    norm: str = "l2",
    start: tuple[float, Xi | None] | list | None = None,
    keep_best_direction: bool | None = True,
) -> AscentResult:
    """Maximize ``loss(ξ)`` over the ball ``‖ξ‖ ≤ ρ`` (or the ℓ∞ box) with Auto-PGD.

    Args:
        pert: The perturbation set (geometry, ball, endpoint).
        loss: ``loss(ξ, need_grad) -> (value, Euclidean gradient w.r.t. ξ or None)``; one
            forward (and one backward when ``need_grad``) of the model.
        rho: Radius.
        steps: Number of iterations ``N`` (gradient evaluations).
        xi0: Starting point (inside the ball); ``None`` for ``ξ = 0``, which (ℓ2) is never
            made: while the start is ``ξ_{k−1}`` or the best iterate it costs no buffer (a
            caller that passed a zero perturbation would hold it through the whole ascent).
        norm: ``"l2"`` (metric ball, normalized Riemannian-gradient steps) or ``"linf"`` (box,
            sign steps).
        start: ``(loss, gradient)`` at ``xi0`` if already computed; a list is emptied, so that
            the caller holds no reference to the gradient, which becomes the first direction.
        keep_best_direction: Whether to keep the ascent direction of the best iterate for
            restarts. ``True`` (default): always, so that a restart costs no pass (one
            ξ-sized buffer more whenever the best iterate is older than ``ξ_{k−1}``: four at
            most). ``None``: while it costs no buffer, i.e. while the best iterate is the
            current one, ``ξ_{k−1}`` or the zero start (whose buffers are held anyway); once
            the best iterate is older it is dropped, and a restart from it recomputes its
            gradient (one extra forward and backward, counted by ``loss``): three ξ-sized
            buffers at most. ``False``: never. :func:`best_direction_rule` chooses within a
            memory budget. The iterates are the same in every case.

    Each iteration is one forward and one backward, except the last (a forward: its gradient
    would not be used) and a checkpoint that restarts from an older best iterate: whether it
    restarts depends only on the loss, so ``loss`` learns it after the forward (``need_grad``
    is then a function of the value) and skips the backward whose gradient the restart would
    discard.

    Returns:
        An :class:`AscentResult`.
    """
    l2 = norm == "l2"
    if xi0 is None and not l2:
        xi0 = pert.zeros()
    xi, xi_prev = xi0, xi0
    # every iterate but the caller's start is the ascent's alone: ξ_{k−1} may then be written
    # over (_l2_step's into_prev). Its id, not the start itself, is kept (holding it would keep
    # its buffers); an id reused once the start is freed only forgoes that write.
    start_id = id(xi0)
    del xi0  # held as the first ξ_{k−1} and best iterate only: freed once both move on
    xi_nsq = 0.0 if xi is None or not l2 else float(pert.norm_sq(xi))
    if start is not None:
        value, egrad = start
    else:
        value, egrad = loss(xi if xi is not None else pert.zeros(), True)
    if isinstance(start, list):
        start.clear()  # the caller's gradient lives on only as `direction` (computed in place)
    # The ascent direction at the current iterate: the Riemannian gradient (ℓ2, with ‖d‖²,
    # ⟨ξ_k, d⟩ and ⟨ξ_{k−1}, d⟩) or the Euclidean gradient whose signs are taken (ℓ∞).
    direction, dd, xd, pd = _direction(pert, egrad, xi, xi_prev, l2)
    egrad = None
    # ‖ξ_{k−1}‖² and ⟨ξ_k, ξ_{k−1}⟩: with ‖ξ_k‖² and the pairings of d, the Gram matrix of
    # the three vectors that the step combines
    prev_nsq, cross = xi_nsq, xi_nsq
    res = AscentResult(best_loss=value, best_xi=xi, start_loss=value, trace=[value])
    best_xi, best_nsq = xi, xi_nsq
    keep = keep_best_direction
    best_direction = direction if keep is not False else None
    best_dd, best_xd = dd, xd
    cps = set(checkpoints(steps))
    sched = _Schedule(cps, 2.0 * rho, value)  # the step size starts at 2ρ
    a, b = MOMENTUM, 1.0 - MOMENTUM
    for i in range(steps):
        # ξ_{k+1} = P(ξ_k + α(z − ξ_k) + (1−α)(ξ_k − ξ_{k−1})) = P(α z + 2(1−α) ξ_k − (1−α) ξ_{k−1})
        # with z = P(ξ_k + η d_k). ξ_k, ξ_{k−1} and the projected direction d_k are horizontal,
        # so every combination is: P is a radial rescale, of z by c = min(1, ρ/‖z‖) with
        # ‖z‖² = ‖ξ_k‖² + 2s⟨ξ_k, d_k⟩ + s²‖d_k‖² (no z is formed), then of the new iterate.
        if l2:
            if not math.isfinite(dd):
                raise FloatingPointError(
                    f"the squared norm of the ascent direction is {dd}: the gradient or the "
                    "metric is not finite (a symmetry block near-singular at eps=0? try eps > 0)"
                )
            rn = math.sqrt(max(dd, 0.0))
            scale = sched.eta / rn if rn > 0 else 0.0
            nz = math.sqrt(max(xi_nsq + 2.0 * scale * xd + scale * scale * dd, 0.0))
            c = rho / nz if nz > rho else 1.0
            reuse = direction is not best_direction
            al, be, ga = a * c + 2.0 * b, a * c * scale, -b
            nsq = (
                al * al * xi_nsq
                + be * be * dd
                + ga * ga * prev_nsq
                + 2.0 * (al * be * xd + al * ga * cross + be * ga * pd)
            )
            into = id(xi_prev) != start_id and xi_prev is not xi and xi_prev is not best_xi
            new, r = _l2_step(
                xi,
                direction,
                xi_prev,
                reuse=reuse,
                coef=(al, be, ga),
                nsq=nsq,
                rho=rho,
                into_prev=into,
            )
            # ⟨ξ_{k+1}, ξ_k⟩ = r⟨u, ξ_k⟩, then shift: ξ_k becomes ξ_{k−1}
            cross = r * (al * xi_nsq + be * xd + ga * cross)
            prev_nsq, xi_nsq = xi_nsq, r * r * max(nsq, 0.0)
        else:
            new = _linf_step(pert, xi, xi_prev, direction, eta=sched.eta, rho=rho, a=a, b=b)
        res.step_sizes.append(sched.eta)
        xi_prev, xi = xi, new
        if keep is None and not (best_xi is None or best_xi is xi or best_xi is xi_prev):
            best_direction = None  # the best iterate is older: its direction would cost a buffer
        # the old direction is not needed any more (unless it is the best iterate's): drop it
        # before the forward and backward, which then reuse its memory
        direction = new = None
        # the gradient is needed unless this checkpoint restarts from an older best iterate
        need = sched.wants_grad(i, res.best_loss, best_xi is xi) if i < steps - 1 else False
        value, egrad = loss(xi if xi is not None else pert.zeros(), need)
        if egrad is not None:
            direction, dd, xd, pd = _direction(pert, egrad, xi, xi_prev, l2)
            egrad = None
        res.trace.append(value)
        restart = sched.update(i, value, res.best_loss)
        if value > res.best_loss:
            res.best_loss, best_xi, best_nsq = value, xi, xi_nsq
            best_direction = direction if keep is not False else None
            best_dd, best_xd = dd, xd
        if restart:
            res.restarts.append(i)
            if best_xi is not xi and i < steps - 1:  # back to the best iterate and its direction
                if best_direction is not None:
                    direction, dd, xd = best_direction, best_dd, best_xd
                    pd = pert.inner(direction, xi_prev) if l2 else 0.0
                else:  # recompute it
                    direction = None
                    _, egrad = loss(best_xi if best_xi is not None else pert.zeros(), True)
                    direction, dd, xd, pd = _direction(pert, egrad, best_xi, xi_prev, l2)
                    egrad = None
                    if keep is None:  # the best iterate is the current one again
                        best_direction, best_dd, best_xd = direction, dd, xd
                cross = pert.inner(best_xi, xi_prev) if l2 else 0.0
            xi, xi_nsq = best_xi, best_nsq
    res.best_xi = best_xi if best_xi is not None else pert.zeros()
    return res


class _Schedule:
    """The step-size schedule of Auto-PGD: when a checkpoint halves the step and restarts.

    At checkpoint ``w_j`` the step is halved, and the ascent restarts from the best iterate,
    if fewer than ``MIN_UPDATE_RATIO`` of the steps since ``w_{j−1}`` improved the best loss,
    or if neither the step nor the best loss changed since ``w_{j−1}`` (SPEC §6, step 6).
    """

    def __init__(self, cps: set[int], eta: float, start_loss: float) -> None:
        self.cps, self.eta = cps, eta
        self.n_improved, self.last_cp, self.eta_at_cp, self.best_at_cp = 0, 0, eta, start_loss

    def restarts(self, i: int, value: float, best: float) -> bool:
        """Whether iteration ``i`` restarts if its loss is ``value`` (``best``: the best before)."""
        if i not in self.cps:
            return False
        up = value > best
        too_few = self.n_improved + up < MIN_UPDATE_RATIO * (i - self.last_cp)
        stalled = self.eta == self.eta_at_cp and not up and best == self.best_at_cp
        return too_few or stalled

    def wants_grad(self, i: int, best: float, best_is_current: bool) -> Callable[[float], bool]:
        """The ``need_grad`` of iteration ``i``, decided from its loss after the forward.

        No backward when a restart from an older best iterate would discard the gradient.
        """
        return lambda v: best_is_current or v > best or not self.restarts(i, v, best)

    def update(self, i: int, value: float, best: float) -> bool:
        """Record iteration ``i``'s loss; return whether it restarts (then :attr:`eta` halves)."""
        restart = self.restarts(i, value, best)
        self.n_improved += value > best
        if i in self.cps:
            self.eta_at_cp, self.last_cp, self.n_improved = self.eta, i, 0
            self.best_at_cp = max(best, value)
            if restart:
                self.eta /= 2.0
        return restart


def _direction(
    pert: Perturbation, egrad: Xi, xi: Xi | None, prev: Xi | None, l2: bool
) -> tuple[Xi, float, float, float]:
    """The ascent direction from ``egrad`` (written in place): ``d, ‖d‖², ⟨ξ, d⟩, ⟨ξ_{k−1}, d⟩``."""
    if not l2:
        return egrad, 0.0, 0.0, 0.0
    if prev is xi:
        d, dd, (xd,) = pert.ascent_direction(egrad, (xi,), inplace=True)
        return d, dd, xd, xd
    d, dd, (xd, pd) = pert.ascent_direction(egrad, (xi, prev), inplace=True)
    return d, dd, xd, pd
