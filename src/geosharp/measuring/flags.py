"""Whether a measured cell can be trusted: its flags, and values that grow with the ball.

A worst-case value is the best loss an ascent found, so it is only as good as the ascent. Three
things make it untrustworthy, and each gives the cell a flag (:func:`cell_flags`; a cell with
no flag is *sound*):

``rising``
    On some batch the loss was still rising at the last Auto-PGD steps, beyond rounding and by
    more than :data:`STABILITY_TOL` of the whole rise
    (:func:`~geosharp.measuring.checks.still_rising`): the value is a lower bound and more steps
    would find more.
``unstable``
    The ascent did not settle (:func:`instability`): its last iterates fall back by more than
    :data:`STABILITY_TOL` of the loss rise, or it ended that far below its best iterate, or a
    smaller ball of the same measure held a better point (:func:`nest`). The ascent is then
    chaotic at this radius: the value depends on rounding, and an equivalent
    re-parametrization (or one ulp of ρ) can move it by a large fraction (issue 40: geodesic mix
    at ρ = 1 on ten trained tiny BERTs moved 0.7–24 % in float32 and up to 9 % in float64,
    while a change of ρ by 2⁻⁵⁰ moved the float64 value by 4 %).
``saturated``
    The ball leaves the basin: the mean perturbed loss is at least the loss of the trivial
    predictor (all-zero outputs: ``ln C`` for ``C``-class cross-entropy, the mean squared
    target for the squared error; :func:`reference_loss`) while the clean loss is below
    :data:`AT_CHANCE` of it (a model at chance has no basin to leave), or, where that cannot be
    computed,
    the loss rose by at least :data:`SATURATION_FACTOR` times the clean loss. The measure then
    ranks how fast a model can be destroyed, not the shape of its minimum.

The estimate is free: it reads the loss traces the ascent recorded, no pass is added.

**Nested balls.** The balls of one measure at one base point are nested: a point of the ball of
radius ρ₁ is a point of every larger ball. :func:`nest` therefore gives each batch of a
worst-case cell at least the value of the same batch at the next smaller ρ (itself carried
from the ones below): the reported values are non-decreasing in ρ by construction and each
is still the loss at a point of its own ball, a valid lower bound of the maximum.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measuring.checks import MATERIAL_RISE, RISE_TOL_ULPS, still_rising
from geosharp.measuring.losses import _logits
from geosharp.measuring.results import flags_text
from geosharp.symmetry.verify import call_model, eval_mode
from geosharp.symmetry.verify import to_device as _to_device

__all__ = [
    "AT_CHANCE",
    "FLAGS",
    "SATURATION_FACTOR",
    "STABILITY_TOL",
    "STABILITY_WINDOW",
    "CellCheck",
    "cell_flags",
    "flags_text",
    "instability",
    "nest",
    "reference_loss",
]

#: The flags a cell may carry, in the order they are written.
FLAGS = ("rising", "unstable", "saturated")
#: A fall of the last iterates (or of the last below the best) beyond this fraction of the loss
#: rise makes the cell ``unstable``, a rise over the last steps beyond it ``rising``: the value
#: is not settled to three digits.
STABILITY_TOL = MATERIAL_RISE
#: The last this-many iterates are read for the fall.
STABILITY_WINDOW = 6
#: A clean loss above this fraction of the trivial predictor's is at chance: not judged saturated.
AT_CHANCE = 0.95
#: Without a trivial predictor's loss: a rise of this many times the clean loss is ``saturated``.
SATURATION_FACTOR = 100.0


def _tolerance(trace: Sequence[float], eps: float) -> float:
    return RISE_TOL_ULPS * eps * max(max(abs(v) for v in trace), 1e-30)


def instability(
    trace: Sequence[float], eps: float = float(torch.finfo(torch.float32).eps)
) -> float:
    """How far an ascent's last iterates fall back, relative to its loss rise (0: settled).

    ``max(largest fall between consecutive iterates among the last`` :data:`STABILITY_WINDOW`
    ``, best − last) − tol``, over ``best − clean`` (at least ``tol``), where ``tol`` is the
    rounding tolerance of :func:`~geosharp.measuring.checks.still_rising`. A converged ascent
    ends at its best iterate with steps that no longer move the loss (≈ 0); a still-rising one
    does not fall (0: that is ``rising``); a chaotic one swings (up to ≈ 1 or more).

    Args:
        trace: The loss at every iterate, the clean loss first.
        eps: Machine epsilon of the loss's dtype.

    Example:
        >>> instability([0.1, 0.5, 0.6, 0.61, 0.61, 0.61, 0.61, 0.61])
        0.0
        >>> round(instability([0.1, 0.9, 0.5, 0.8, 0.4, 0.7, 0.3, 0.6]), 3)  # falls 0.4 of 0.8
        0.5
    """
    values = [float(v) for v in trace]
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return 0.0
    tol = _tolerance(values, eps)
    best = max(values)
    tail = values[-STABILITY_WINDOW:]
    fall = max([a - b for a, b in itertools.pairwise(tail)] + [best - values[-1]])
    return max(fall - tol, 0.0) / max(best - values[0], tol)


@dataclass(frozen=True)
class CellCheck:
    """The trust of one cell (:func:`cell_flags`).

    Attributes:
        flags: A subset of :data:`FLAGS`, in that order (empty: the cell is sound).
        instability: The largest :func:`instability` over the batches (``None``: no traces).
        carried: Batches whose value came from a smaller ball (:func:`nest`) by more than
            rounding.
    """

    flags: tuple[str, ...] = ()
    instability: float | None = None
    carried: int = 0


def cell_flags(
    traces: Sequence[Sequence[float]],
    clean_losses: Sequence[float],
    perturbed_losses: Sequence[float],
    *,
    loss_eps: float,
    reference: float | None = None,
    carried: int = 0,
) -> CellCheck:
    """The flags of one measured cell (the module docstring says what each means).

    Args:
        traces: The loss traces of the worst-case ascents (empty for the average case).
        clean_losses: The clean loss of every batch.
        perturbed_losses: The best (worst case) or mean (average case) perturbed loss of every
            batch, after :func:`nest`.
        loss_eps: Machine epsilon of the loss's dtype.
        reference: The trivial predictor's mean loss over the same batches
            (:func:`reference_loss`), or ``None``.
        carried: Batches whose value came from a smaller ball (:func:`nest`).
    """
    flags = []
    if any(still_rising(t, loss_eps) for t in traces):
        flags.append("rising")
    unstable = max((instability(t, loss_eps) for t in traces), default=None)
    if carried or (unstable is not None and unstable > STABILITY_TOL):
        flags.append("unstable")
    if clean_losses and perturbed_losses:
        clean = sum(clean_losses) / len(clean_losses)
        moved = sum(perturbed_losses) / len(perturbed_losses)
        if reference is not None and math.isfinite(reference):
            # judged only where the model beats the trivial predictor: a model at chance has
            # no basin to leave (the study's pilot refuses one)
            saturated = clean < AT_CHANCE * reference and moved >= reference
        else:
            saturated = moved - clean >= SATURATION_FACTOR * abs(clean) and moved > clean
        if saturated:
            flags.append("saturated")
    return CellCheck(tuple(flags), unstable, carried)


def nest(
    smaller: Sequence[float] | None, values: Sequence[float], eps: float
) -> tuple[list[float], int]:
    """Per batch, the larger of this ball's value and the next smaller ball's (already nested).

    Args:
        smaller: The per-batch values at the next smaller ρ of the same worst-case measure on
            the same batches (``None``: none measured).
        values: The per-batch values at this ρ.
        eps: Machine epsilon of the loss's dtype (a carry within rounding is not counted).

    Returns:
        ``(values, carried)``: the nested per-batch values and how many batches took the
        smaller ball's value by more than rounding.
    """
    if smaller is None or len(smaller) != len(values):
        return list(values), 0
    out, carried = [], 0
    for s, v in zip(smaller, values, strict=True):
        if s is not None and math.isfinite(s) and s > v:
            out.append(float(s))
            carried += s - v > _tolerance([s, v, 1.0], eps)
        else:
            out.append(float(v))
    return out, carried


def reference_loss(
    model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], batches: Sequence[tuple[Any, Any]]
) -> float | None:
    """The mean loss of the trivial predictor (all-zero outputs) over ``batches``, or ``None``.

    One forward per batch (no gradient) gives the shape of the predictions; the loss is then
    taken of zeros of that shape: ``ln C`` for ``C``-class cross-entropy, the mean squared
    target for the squared error. ``None`` when the loss does not take a tensor of predictions
    (a loss reading other fields of the output) or the result is not a finite scalar.
    """
    device = next(iter(model.parameters())).device
    params = dict(model.named_parameters())
    total = 0.0
    try:
        with eval_mode(model), torch.no_grad():
            for inputs, targets in batches:
                x, y = _to_device(inputs, device), _to_device(targets, device)
                zeros = torch.zeros_like(_logits(call_model(model, params, x)))
                value = loss_fn(zeros, y)
                if not isinstance(value, Tensor) or value.numel() != 1:
                    return None
                total += float(value)
    except Exception:  # a loss that needs the model's own output type: no reference
        return None
    mean = total / max(len(batches), 1)
    return mean if math.isfinite(mean) else None
