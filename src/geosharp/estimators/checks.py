"""Numerical checkers a user can run on their own model (the pymanopt habit).

:func:`check_invariance` re-parametrizes every symmetry block that was found by a random group
element and compares the model's outputs: a wrong adapter (a block that is not a symmetry) is
caught here instead of being silently measured. :func:`check_geometry` verifies, at the model's
own weights, that the horizontal projection is idempotent and that the metric is invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geosharp.estimators.perturbation import Perturbation
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.verify import (
    SYMMETRY_TO_RANDOM,
    default_tol,
    invariance_changes,
    is_symmetry,
)


@dataclass
class InvarianceReport:
    """Result of :func:`check_invariance`.

    Attributes:
        passed: Whether every relative output change stayed below the tolerance (or, for a
            model computing below float64 internally, far below a random move of the same
            size). ``False`` when there was nothing to check.
        rel_changes: ``‖f(g·w) − f(w)‖ / ‖f(w)‖`` for every scale.
        scales: The scales ``a`` of the random group elements.
        tol: The tolerance used.
        n_blocks: Number of symmetry blocks re-parametrized (as in ``space.summary()``).
        n_factors: Their independent group factors (heads, pair coordinates, biases).
        random_changes: The relative output change of a random, non-symmetric move of the same
            coordinates by the same distance, for every scale (the scale of a real failure).
        notes: Remarks, e.g. that the model computes internally below float64.
    """

    passed: bool
    rel_changes: list[float]
    scales: list[float]
    tol: float
    n_blocks: int
    notes: list[str] = field(default_factory=list)
    n_factors: int = 0
    random_changes: list[float] = field(default_factory=list)

    @property
    def nothing_to_check(self) -> bool:
        """``True`` when the space has no symmetry block (no claim was made)."""
        return self.n_blocks == 0

    def __str__(self) -> str:
        if self.nothing_to_check:
            return (
                "invariance check: nothing to check (no symmetry blocks were found, so no "
                "symmetry is claimed; every parameter uses the adaptive geometry)"
            )
        pairs = zip(self.scales, self.rel_changes, strict=True)
        changes = ", ".join(f"a={a:g}: {c:.1e}" for a, c in pairs)
        verdict = "PASSED" if self.passed else "FAILED"
        text = (
            f"invariance check {verdict} ({self.n_blocks} symmetry blocks, {self.n_factors} "
            f"group factors; tol {self.tol:g}): {changes}"
        )
        if self.random_changes:
            text += "; a random move of the same size: " + ", ".join(
                f"{c:.1e}" for c in self.random_changes
            )
        return text + "".join(f"\n  note: {n}" for n in self.notes)


def check_invariance(
    model: nn.Module,
    inputs: Any,
    *,
    space: ParameterSpace | None = None,
    scales: Sequence[float] = (0.5, 1.0, 2.0),
    tol: float | None = None,
    seed: int = 0,
) -> InvarianceReport:
    """Check that a random re-parametrization of every block found leaves the outputs unchanged.

    Each block gets a random element of its group (as :func:`geosharp.reparametrize` draws
    it). Beside the change of the outputs, the change under a random *non-symmetric* move of
    the same coordinates by the same distance is measured: a true symmetry changes the outputs
    by roundoff only, a false claim by a sizeable fraction of the random move. A model that
    computes internally below its parameters' precision (HF's float32 softmax or RMSNorm in a
    float64 model, GPT-Neo's float32 scores) may exceed the float64 tolerance by roundoff: it
    passes when its change stays below 1e-5 of the random one, with a note
    (:func:`geosharp.symmetry.verify.invariance_changes`).

    Args:
        model: The model.
        inputs: One batch of inputs (tensor, tuple or dict, as for :func:`geosharp.sharpness`).
        space: Symmetry blocks (default: :func:`geosharp.find_symmetries`).
        scales: Scales ``a`` of the random group elements.
        tol: Relative tolerance (default ``1e-4`` in float32, ``1e-9`` in float64).
        seed: Seed of the group elements.

    Returns:
        An :class:`InvarianceReport`; ``passed`` is ``False`` if an adapter is wrong, and
        :attr:`InvarianceReport.nothing_to_check` is ``True`` without blocks.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        >>> check_invariance(layer, torch.randn(2, 5, 8)).passed
        True
    """
    space = space if space is not None else find_symmetries(model)
    tol = default_tol(model) if tol is None else tol
    if not space.blocks:
        return InvarianceReport(False, [], list(scales), tol, 0, n_factors=0)
    changes, randoms = invariance_changes(model, space, inputs, scales=scales, seed=seed)
    notes = []
    within = all(c <= tol for c in changes)
    roundoff = is_symmetry(changes, randoms, tol)
    if not within and roundoff:
        notes.append(
            f"outputs changed by up to {max(changes):.1e} > tol {tol:g}, but by less than "
            f"{SYMMETRY_TO_RANDOM:g} of a random move of the same size (≥ {min(randoms):.1e}): "
            "roundoff of a model computing internally below its parameters' precision"
        )
    return InvarianceReport(
        passed=roundoff,
        rel_changes=changes,
        scales=list(scales),
        tol=tol,
        n_blocks=len(space.blocks),
        notes=notes,
        n_factors=space.n_group_factors,
        random_changes=randoms,
    )


@dataclass
class GeometryReport:
    """Result of :func:`check_geometry`: worst relative residuals over all blocks."""

    idempotence: float
    norm_decrease: float
    passed: bool

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return (
            f"geometry check {verdict}: ‖P(Pξ) − Pξ‖/‖Pξ‖ = {self.idempotence:.1e}, "
            f"‖Pξ‖ ≤ ‖ξ‖ violated by {self.norm_decrease:.1e}"
        )


def check_geometry(
    model: nn.Module,
    *,
    metric: str = "inv",
    eps: float = 0.0,
    space: ParameterSpace | None = None,
    seed: int = 0,
    tol: float = 1e-6,
) -> GeometryReport:
    """Check the horizontal projection at the model's own weights (idempotent, norm-reducing).

    Args:
        model: The model.
        metric: ``"inv"`` or ``"mix"``.
        eps: Gram damping (at ``eps > 0`` idempotence holds only approximately).
        space: Symmetry blocks (default: found here).
        seed: Seed of the random tangent vectors.
        tol: Tolerance on the relative residuals.

    Returns:
        A :class:`GeometryReport`.

    Example:
        >>> from torch import nn
        >>> check_geometry(nn.TransformerEncoderLayer(8, 2, 16)).passed
        True
    """
    space = space if space is not None else find_symmetries(model)
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    pert = Perturbation(space, theta0, measure="geodesic", metric=metric, eps=eps)
    gen = torch.Generator(device=theta0.device).manual_seed(seed)
    xi = [p.geometry.random_tangent(gen, 1.0, horizontal=False) for p in pert.pieces]
    p1 = pert.project(xi)
    p2 = pert.project(p1)
    diff = Perturbation.combine(p2, p1, 1.0, -1.0)
    idem = pert.norm(diff) / max(pert.norm(p1), 1e-300)
    decrease = max(0.0, pert.norm(p1) - pert.norm(xi)) / max(pert.norm(xi), 1e-300)
    return GeometryReport(idem, decrease, idem <= tol and decrease <= tol)
