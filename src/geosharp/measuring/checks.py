"""What ``gs.measure`` checks before it measures, and in every result after.

Before: weights whose ``1/w²`` overflows (:func:`unrepresentable_weights`; a copy with them set
to 0 is measured), the clean loss of every batch (finite, and for cross-entropy every label
one of the model's classes) and the invariance self-check (:func:`self_check`: a random
re-parametrization of every symmetry block found must leave the outputs unchanged, or the
blocks are wrong and geodesic sharpness would be too). After: :func:`row_warnings`, e.g. an
Auto-PGD ascent still rising at its last step (:func:`still_rising`, beyond float rounding) or
one that never raised the loss.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.checks import InvarianceReport, check_invariance
from geosharp.estimators.worst import exact_steps_warning
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.measures import Measure
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.losses import IGNORE_INDEX, _logits, uses_cross_entropy
from geosharp.measuring.results import MeasureRow, rho_text
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.verify import call_model, eval_mode
from geosharp.symmetry.verify import to_device as _to_device

__all__ = [
    "RISE_TOL_ULPS",
    "RISE_WINDOW",
    "batch_loss",
    "check_finite_loss",
    "clean_pass",
    "count_unrepresentable",
    "flush_unrepresentable",
    "invariance_tol",
    "loss_eps",
    "row_warnings",
    "self_check",
    "still_rising",
    "unrepresentable_weights",
    "without_unrepresentable",
]


# --------------------------------------------------------------------------------------------
# before measuring


def unrepresentable_weights(model: nn.Module) -> dict[str, int]:
    """Trainable weights ``w ≠ 0`` whose ``1/w²`` is not finite in the parameter's dtype.

    The adaptive metric ``Σ ξ_i²/w_i²`` (SPEC §5) cannot be evaluated there (e.g.
    ``|w| < 5e-20`` in float32): the ball's norm becomes NaN and the ascent cannot move.

    Args:
        model: The model.

    Returns:
        Parameter name → number of such weights (only parameters that have some).
    """
    found = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or not p.is_floating_point():
            continue
        n = count_unrepresentable(p.detach())
        if n:
            found[name] = n
    return found


def count_unrepresentable(w: Tensor) -> int:
    """How many entries ``w_i ≠ 0`` of a plain tensor have a ``1/w_i²`` that is not finite."""
    # 1/w² is finite iff |w| ≥ max^(-1/2); test exactly only the few weights near that
    near = w.abs() < 2.0 * torch.finfo(w.dtype).max ** -0.5
    if not bool(near.any()):
        return 0
    sub = w[near]
    return int(((sub != 0) & ~torch.isfinite(sub.reciprocal().square())).sum())


@torch.no_grad()
def flush_unrepresentable(model: nn.Module) -> dict[str, int]:
    """Set the weights of :func:`unrepresentable_weights` to exactly 0, in place.

    Zero weights are frozen coordinates of the adaptive ball (their radius ``ρ|w_i|`` is 0), and
    a weight of ``|w| < 1e-19`` already has a ball of that size, so measuring is unchanged while
    the metric becomes finite. The model's function changes by less than the weights' size.

    Args:
        model: The model (modified in place).

    Returns:
        Parameter name → number of weights set to 0.
    """
    found = unrepresentable_weights(model)
    params = dict(model.named_parameters())
    for name in found:
        w = params[name]
        bad = (w != 0) & ~torch.isfinite(w.reciprocal().square())
        w.masked_fill_(bad, 0.0)
    return found


def without_unrepresentable(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``model``, or a copy with its :func:`unrepresentable_weights` set to 0 and why.

    Returns:
        ``(model, None)`` if every weight is representable, else ``(copy, warning)``.
    """
    tiny = unrepresentable_weights(model)
    if not tiny:
        return model, None
    model = copy.deepcopy(model)
    flush_unrepresentable(model)
    where = ", ".join(f"{k} ({v})" for k, v in list(tiny.items())[:4])
    return model, (
        f"{sum(tiny.values())} weight(s) are so small that 1/w² overflows "
        f"{next(iter(model.parameters())).dtype} ({where}); a copy of the model with them "
        "set to 0 is measured (zero weights are frozen in the adaptive ball, whose radius "
        "ρ|w| is below 1e-19 there anyway)"
    )


def _check_labels(b: int, logits: Tensor, targets: Tensor) -> None:
    n_classes = logits.shape[-1]
    valid = (targets == IGNORE_INDEX) | ((targets >= 0) & (targets < n_classes))
    if not bool(valid.all()):
        bad = sorted({int(t) for t in targets[~valid].reshape(-1).tolist()})
        shown = ", ".join(map(str, bad[:10])) + (", …" if len(bad) > 10 else "")
        raise MeasureError(
            f"batch {b} has labels outside the model's {n_classes} classes (0..{n_classes - 1}): "
            f"{shown}; check the label column, or that the model has the right number of labels"
        )


def clean_pass(
    model: nn.Module, loss_fn: Callable, batches: Sequence[tuple[Any, Any]]
) -> list[float]:
    """Clean loss of every batch; raises unless every one is finite and every label valid.

    Raises:
        MeasureError: Naming the batch: not a pair, a model or loss that fails on it, a loss
            that is not a scalar or not finite, labels outside the model's classes.
    """
    device = next(iter(model.parameters())).device
    params = dict(model.named_parameters())
    losses = []
    with eval_mode(model), torch.no_grad():
        for b, batch in enumerate(batches):
            value = batch_loss(b, batch, lambda x: call_model(model, params, x), loss_fn, device)
            losses.append(check_finite_loss(b, value))
    return losses


def batch_loss(
    b: int, batch: Any, run: Callable[[Any], Any], loss_fn: Callable, device: torch.device
) -> float:
    """The loss of batch ``b`` with the model run as ``run(inputs)`` (no check of finiteness).

    Raises:
        MeasureError: Naming the batch: not a pair, a model or loss that fails on it, a loss
            that is not a scalar, labels outside the model's classes.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise MeasureError(
            f"batch {b} must be a pair (inputs, targets), got {type(batch).__name__}"
        )
    inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
    try:
        out = run(inputs)
    except Exception as err:
        raise MeasureError(f"the model failed on batch {b}: {type(err).__name__}: {err}") from err
    try:
        if uses_cross_entropy(loss_fn, targets):
            _check_labels(b, _logits(out), targets)
        loss = loss_fn(out, targets)
    except MeasureError as err:
        if str(err).startswith(f"batch {b}"):
            raise
        raise MeasureError(f"batch {b}: {err}") from err
    except Exception as err:
        raise MeasureError(f"the loss failed on batch {b}: {type(err).__name__}: {err}") from err
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise MeasureError(
            f"the loss of batch {b} must be a scalar tensor, got {type(loss).__name__}"
        )
    return float(loss)


def check_finite_loss(b: int, value: float) -> float:
    """``value``, the clean loss of batch ``b``; raises unless it is finite.

    Raises:
        MeasureError: If it is NaN or infinite.
    """
    if not math.isfinite(value):
        raise MeasureError(
            f"the clean loss of batch {b} is {value}: sharpness is undefined. Check the "
            "data (NaN or inf inputs?), the model's weights and the loss"
        )
    return value


def invariance_tol(model: nn.Module) -> float:
    """Tolerance of the invariance check: the relative output change rounding can cause."""
    dtype = next(iter(model.parameters())).dtype
    # A wrong block changes the outputs by O(1); correct blocks only by rounding, which after a
    # product of up to three re-parametrized factors is ≲ 1e3 ulp of the dtype.
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)


def self_check(
    model: nn.Module,
    inputs: Any,
    space: ParameterSpace,
    seed: int,
    say: Callable[[str], None],
) -> InvarianceReport:
    """Re-parametrize every block of ``space`` at random; raise unless the outputs stay put.

    Args:
        model: The model.
        inputs: The inputs of batch 0.
        space: The symmetry blocks found.
        seed: Seed of the random group elements.
        say: Called with what was checked.

    Returns:
        The :class:`geosharp.InvarianceReport` (``n_blocks == 0``: nothing to check).

    Raises:
        MeasureError: If the model fails on the inputs, its outputs are not finite, or they
            change under the re-parametrization (a block that is not a symmetry).
    """
    say("self-check: random re-parametrization of every block found ...")
    try:
        invariance = check_invariance(
            model, inputs, space=space, seed=seed, tol=invariance_tol(model)
        )
    except Exception as err:
        raise MeasureError(
            f"the invariance self-check could not run the model on batch 0: "
            f"{type(err).__name__}: {err}"
        ) from err
    if invariance.n_blocks == 0:
        # without blocks there is nothing to check (check_invariance then reports passed=False)
        say("self-check: no symmetry blocks, so there is nothing to re-parametrize")
        return invariance
    say(f"self-check: {invariance}")
    if invariance.passed:
        return invariance
    if not all(map(math.isfinite, invariance.rel_changes)):
        raise MeasureError(
            "self-check failed: the model's outputs on batch 0 are not finite (NaN or inf), "
            "so the invariance under re-parametrization cannot be checked; check the data "
            "and the model's weights"
        )
    worst = max(invariance.rel_changes)
    raise MeasureError(
        f"self-check failed: the model's outputs changed by up to {worst:.2g} (relative; "
        f"tolerance {invariance.tol:g}) under a random re-parametrization of the "
        f"{invariance.n_blocks} symmetry block(s) found, so at least one block is not a "
        "symmetry of this model (a wrong adapter, or a module whose forward differs from "
        "the layout the adapter expects). Measuring geodesic sharpness on it would be "
        "wrong. Fix or narrow the adapter (find_symmetries(adapters=...)), declare the "
        "blocks by hand (declare_block), or skip the check with --no-check / check=False "
        "if you know better"
    )


# --------------------------------------------------------------------------------------------
# after measuring

#: A loss rise within this many units of the dtype's precision (relative to the loss) is
#: rounding: a mean of many float32 terms computed twice along nearby paths differs by a few ulp.
RISE_TOL_ULPS = 16
#: The trend is judged over this many last Auto-PGD steps.
RISE_WINDOW = 3
#: A rise over the window below this fraction of the whole loss rise is immaterial (the value is
#: settled to three digits): not "still rising" (:data:`geosharp.measuring.flags.STABILITY_TOL`).
MATERIAL_RISE = 1e-3


def loss_eps(model: nn.Module) -> float:
    """Machine epsilon of the dtype the model computes its loss in (its parameters')."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return float(torch.finfo(dtypes[0] if dtypes else torch.float32).eps)


def still_rising(
    trace: Sequence[float],
    eps: float = float(torch.finfo(torch.float32).eps),
    *,
    ulps: float = RISE_TOL_ULPS,
    window: int = RISE_WINDOW,
    material: float = MATERIAL_RISE,
) -> bool:
    """Whether an Auto-PGD loss trace was still rising at its last step (beyond rounding).

    A rise counts only above ``tol = ulps · eps · max|loss|``: the loss at the last step must be
    the trace's best (within ``tol``), higher than at the step before by more than ``tol``, and
    higher than ``window`` steps before by more than ``window · tol`` — a trend, not a one-ulp
    wobble of a flat trace — and by more than ``material`` of the whole rise (the last loss
    less the first): a float64 ascent creeping up by 1e-10 of its value is settled.

    Args:
        trace: The loss at every iterate (the clean loss first).
        eps: Machine epsilon of the dtype the loss was computed in (float32 by default).
        ulps: The tolerance in units of ``eps`` relative to the loss.
        window: The number of last steps the trend is judged over.
        material: The smallest rise over the window, as a fraction of the whole rise.

    Returns:
        ``True`` if more steps would likely raise the loss further.

    Example:
        >>> still_rising([0.5, 0.6899, 0.689989447593689, 0.6899895071983337])  # one ulp
        False
        >>> still_rising([0.5, 0.6, 0.65, 0.68])
        True
    """
    values = [float(v) for v in trace]
    if len(values) < 3 or not all(math.isfinite(v) for v in values):
        return False
    tol = ulps * eps * max(max(abs(v) for v in values), 1e-30)
    last = values[-1]
    k = min(window, len(values) - 1)
    recent = last - values[-1 - k]
    return (
        last >= max(values) - tol
        and last - values[-2] > tol
        and recent > k * tol
        and recent > material * (last - values[0])
    )


def _at(rho: float | None) -> str:
    """`` at rho=1`` (as the table prints ρ), or nothing for a measure without ρ."""
    return "" if rho is None else f" at rho={rho_text(rho)}"


def row_warnings(
    row: MeasureRow,
    spec: Measure,
    steps: int,
    loss_eps: float,
    exact_steps: int = DEFAULT_RK4_STEPS,
) -> list[str]:
    """What a user should know about one measured row: it failed, or its value is suspect.

    Args:
        row: The row.
        spec: Its measure.
        steps: The Auto-PGD steps per batch.
        loss_eps: Machine epsilon of the loss's dtype (:func:`still_rising`).
        exact_steps: The RK4 steps of the exact geodesic (``-exact`` measures).

    Returns:
        The failure alone; or at most one of: the ascent still rising on some batch (the
        value is a lower bound), a worst case of exactly 0 that never raised the loss; then
        one line for each of the flags ``unstable`` and ``saturated``
        (:mod:`geosharp.measuring.flags`); then, for an ``-exact`` measure, fewer RK4 steps
        than ``2κ`` of its fastest head (:func:`~geosharp.estimators.worst.exact_steps_warning`:
        the value may be inaccurate).
    """
    if row.error is not None:
        return [f"{row.measure}{_at(row.rho)} failed: {row.error}"]
    rk4 = exact_steps_warning(f"{row.measure}{_at(row.rho)}", row.max_relative_speed, exact_steps)
    return (
        _ascent_warnings(row, spec, steps, loss_eps)
        + _flag_warnings(row)
        + ([] if rk4 is None else [rk4])
    )


def _flag_warnings(row: MeasureRow) -> list[str]:
    """One line for ``unstable``, one for ``saturated`` (``rising`` has its own above)."""
    out = []
    if "unstable" in row.flags:
        why = []
        if row.instability is not None and row.instability > 0:
            why.append(f"its last iterates fell back by {row.instability:.2%} of the loss rise")
        if row.carried:
            why.append(
                f"on {row.carried} batch(es) a smaller ball held a better point than this "
                "ball's ascent found (that value is kept: the values grow with rho)"
            )
        out.append(
            f"{row.measure}{_at(row.rho)}: flagged unstable: the ascent did not settle ("
            + "; ".join(why)
            + "), so rounding, or an equivalent re-parametrization, can move the value; a "
            "smaller rho or more --steps may settle it"
        )
    if "saturated" in row.flags:
        out.append(
            f"{row.measure}{_at(row.rho)}: flagged saturated: the perturbed loss "
            "reaches the loss of a trivial predictor (the ball leaves the basin); it ranks how "
            "fast a model can be destroyed, not its minimum: use a smaller rho"
        )
    return out


def _ascent_warnings(row: MeasureRow, spec: Measure, steps: int, loss_eps: float) -> list[str]:
    """The ascent still rising on some batch, or a worst case of 0 that never rose; or none."""
    rising = sum(still_rising(t, loss_eps) for t in row.traces)
    if rising:
        return [
            f"{row.measure}{_at(row.rho)}: on {rising} of {len(row.traces)} "
            f"batch(es) the loss was still rising at the last of {steps} Auto-PGD "
            "steps, so the value is a lower bound; more --steps may find more"
        ]
    if (
        spec.kwargs().get("kind") == "worst"
        and spec.uses_rho
        and row.value == 0.0
        and all(len(t) > 1 and max(t) <= t[0] for t in row.traces)
    ):
        return [
            f"{row.measure}{_at(row.rho)}: the ascent never raised the loss on any "
            "batch; the value 0 is suspicious (a vanishing gradient, or a metric that "
            "is not finite at these weights)"
        ]
    return []
