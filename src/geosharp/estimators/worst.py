r"""Worst-case sharpness of one batch by Auto-PGD (SPEC §2, §6).

.. code-block:: text

    max_{‖ξ‖ ≤ ρ} f_S(ξ) − f_S(0),        f_S(ξ) = L_S(θ′(ξ)),

in the ball of the perturbation's metric (``norm="l2"``) or the box ``|δ_i| ≤ ρ|w_i|``
(``norm="linf"``). The first run starts at ``ξ = 0`` from the clean gradient, on the embedding
rows the batch reaches (:mod:`geosharp.estimators.rows`); further runs start at random points
drawn from the batch's generator. The value is never below ``0``: ``ξ = 0`` is in the ball.

With ``order="exact"`` the batch also reports the largest relative speed ``κ`` of a GL(h) head
at the best perturbation found (:func:`exact_relative_speed`, once per batch after the ascent):
fixed-step RK4 needs about ``2κ`` steps (:mod:`geosharp.geometry.gl_diagnose`), and
:func:`exact_steps_warning` says when ``exact_steps`` is fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from geosharp.errors import MeasureWarning
from geosharp.estimators.apgd import BUFFER_BUDGET, AscentResult, autopgd, best_direction_rule
from geosharp.estimators.harness import BatchValue, Objective, clean_start
from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.estimators.rows import BatchRows

#: A measured inaccuracy the warning quotes (:mod:`geosharp.geometry.gl_diagnose`'s tiny BERT,
#: weights of standard deviation 0.02: a head's 10-step RK4 endpoint, still finite).
_MEASURED = "on a tiny BERT a head at κ ≈ 11 was 3.2 % off with 10 steps"


class ExactStepsWarning(MeasureWarning):
    """Fewer RK4 steps of the exact geodesic than ``2κ``: the value may be inaccurate.

    ``κ``: the relative speed of the fastest head (:func:`exact_steps_warning`).
    """


@dataclass
@dataclass(frozen=True)
class WorstCase:
    """``max_{‖ξ‖ ≤ ρ} f_S(ξ) − f_S(0)`` of one batch, as a function of its objective.

    Attributes:
        rho: Radius of the ball (or the box).
        steps: Auto-PGD iterations per run (one forward and one backward each).
        norm: ``"l2"`` or ``"linf"``.
        restarts: Runs; every run after the first starts at a random point.
        random_init: Start the first run at a random point as well.
        low_memory: Keep the best iterate's direction only while it costs no buffer
            (:func:`~geosharp.estimators.apgd.best_direction_rule`).
        buffer_budget: Parameter-sized buffers the ascent may hold for that rule.
    """

    rho: float
    steps: int
    norm: str = "l2"
    restarts: int = 1
    random_init: bool = False
    low_memory: bool = False
    buffer_budget: float | None = BUFFER_BUDGET

    @property
    def passes(self) -> int:
        """Forward passes per batch: the clean loss and every step of every run."""
        return 1 + self.steps * self.restarts

    def __call__(self, f: Objective, gen: torch.Generator) -> BatchValue:
        """The batch's clean loss, best loss found (at least the clean one) and trace."""
        zero_start = not self.random_init
        clean, grad, rows = clean_start(f, zero_start)
        start, grad = [clean, grad], None  # emptied by the first run: no reference kept here
        best, trace, kappa = -math.inf, [], None
        for r in range(self.restarts):
            pert = f.pert
            if r == 0 and zero_start:
                pert, res = ascent_from_zero(
                    f,
                    rows,
                    start,
                    self.rho,
                    self.steps,
                    norm=self.norm,
                    low_memory=self.low_memory,
                    buffer_budget=self.buffer_budget,
                )
            else:
                res = autopgd(
                    f.pert,
                    f,
                    self.rho,
                    self.steps,
                    random_start(f.pert, gen, self.rho, self.norm),
                    self.norm,
                    keep_best_direction=best_direction_rule(
                        f.pert, self.low_memory, self.buffer_budget
                    ),
                )
            if res.best_loss > best:
                best, trace = res.best_loss, res.trace
                kappa = exact_relative_speed(pert, res.best_xi)  # after the ascent, not in it
            res = pert = None  # its best iterate would live on through the next run
        if best <= clean:  # the value reported is ξ = 0's
            kappa = None if kappa is None else 0.0
        return BatchValue(clean, max(best, clean), trace, dict(f.counter), kappa)


def ascent_from_zero(
    f: Objective,
    rows: BatchRows,
    start: list,
    rho: float,
    steps: int,
    norm: str = "l2",
    low_memory: bool = False,
    buffer_budget: float | None = BUFFER_BUDGET,
) -> tuple[Perturbation, AscentResult]:
    """Auto-PGD from ``ξ = 0``, on the embedding rows the clean forward reached.

    Args:
        f: The batch's objective.
        rows: The rows its clean forward reached (:func:`~geosharp.estimators.harness.clean_start`).
        start: ``[f_S(0), ∇_ξ f_S(0)]``; emptied, so that the caller holds no reference to the
            gradient while it becomes the first ascent direction.
        rho: Radius.
        steps: Iterations.
        norm: ``"l2"`` or ``"linf"``.
        low_memory: See :func:`~geosharp.estimators.apgd.best_direction_rule`.
        buffer_budget: See :func:`~geosharp.estimators.apgd.best_direction_rule`.

    Returns:
        ``(perturbation the ascent ran on, its result)``; the perturbation is ``f.pert`` cut to
        the rows reached, or ``f.pert`` itself when no table is cut.
    """
    clean, grad = start
    start.clear()
    cut, grad = rows.restrict(grad)
    pair, grad = [clean, grad], None
    fc = f if cut is f.pert else f.on(cut)
    keep = best_direction_rule(cut, low_memory, buffer_budget)
    return cut, autopgd(cut, fc, rho, steps, None, norm=norm, start=pair, keep_best_direction=keep)


def random_start(pert: Perturbation, gen: torch.Generator, rho: float, norm: str) -> Xi:
    """A random start: on the sphere of radius ρ (ℓ2, horizontal) or uniform in the box (ℓ∞)."""
    if norm == "linf":
        return pert.uniform_box(gen, rho)
    xi = pert.project(pert.random(gen, 1.0))
    n = pert.norm(xi)
    return [tuple(t * (rho / n) for t in x) for x in xi] if n > 0 else xi


def exact_relative_speed(pert: Perturbation, xi: Xi) -> float | None:
    """The largest relative speed ``κ`` at ``ξ`` of a head whose geodesic is exact RK4.

    Over every GL(h) piece with ``order="exact"``
    (:meth:`~geosharp.geometry.Geometry.relative_speed`: two ``h × h`` contractions from the
    base-point factors, no forward or backward); ``None`` when there is none. With the rows
    split over ranks the contractions are collective and every rank gets the same ``κ``.
    """
    speeds = []
    for p, x in zip(pert.pieces, xi, strict=True):
        k = p.geometry.relative_speed(x) if p.order == "exact" else None
        if k is not None:
            speeds.append(float(k.amax()) if k.numel() else 0.0)
    return max(speeds) if speeds else None


def exact_steps_warning(what: str, kappa: float | None, steps: int | None) -> str | None:
    """The warning of a value whose exact geodesic had fewer RK4 steps than ``2κ``, or ``None``.

    Args:
        what: The measure and its radius, e.g. ``"geodesic-mix-oexact worst l2 at rho=0.3"``.
        kappa: The largest relative speed over the batches (``None``: no exact RK4 heads).
        steps: The RK4 steps used (``exact_steps``).
    """
    if kappa is None or steps is None or not 2.0 * kappa > steps:
        return None
    need = math.ceil(2.0 * kappa)
    return (
        f"{what}: the exact geodesic moved a head κ ≈ {kappa:.3g} times its size with "
        f"{steps} RK4 steps; RK4 needs about 2κ = {need}: the value may be inaccurate "
        f"({_MEASURED}); use exact_steps >= {need}"
    )
