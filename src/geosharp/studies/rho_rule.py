"""The ρ rule: a half-decade grid of radii per measure, set on one pilot model.

Three ρ per radius family, ``{ρ₀/√10, ρ₀, √10·ρ₀}``, the centre ``ρ₀ = 10^{k/2}`` being where
one pilot model's rise is closest (log scale) to :data:`CALIBRATION_TARGET` — 0.1 (worst case)
or 0.01 (average case). Only the pilot's sharpness is looked at: no gap, no τ.

* :func:`half_decade_grid` — the grid of a ladder point;
* :func:`ladder_grid` — the rule on any measurement ρ → rise;
* :func:`rho_rule_grid` — the rule for one measure family of a study;
* :func:`calibrate_rhos` — the rule for every radius family of a classifier study's plan
  (:mod:`geosharp.studies.classifier_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from geosharp.studies.classifier_plan import RADIUS_FAMILIES, _families, _with_budget
from geosharp.studies.runner import Study

__all__ = [
    "CALIBRATION_TARGET",
    "calibrate_rhos",
    "half_decade_grid",
    "ladder_grid",
    "rho_rule_grid",
]


#: Loss rise at the centre ρ₀ of a grid (the ρ rule; worst case and average case).
CALIBRATION_TARGET = {"worst": 0.1, "average": 0.01}


def half_decade_grid(centre: float) -> tuple[float, ...]:
    """The half-decade grid ``(ρ₀/√10, ρ₀, √10·ρ₀)`` of the ladder point ``ρ₀ = 10^{k/2}``.

    ``centre`` is snapped to the nearest point of the ladder ``10^{k/2}``; values are rounded
    to 3 significant digits.

    Example:
        >>> half_decade_grid(0.1), half_decade_grid(0.316)
        ((0.0316, 0.1, 0.316), (0.1, 0.316, 1.0))
    """
    k = round(2 * math.log10(centre))
    return tuple(float(f"{10 ** (j / 2):.3g}") for j in (k - 1, k, k + 1))


def _log_distance(value: float, target: float) -> float:
    return abs(math.log(value / target)) if 0 < value < math.inf else math.inf


def calibrate_rhos(
    study: Study,
    model: nn.Module,
    start: float = 0.01,
    max_evals: int = 12,
    log: Any = None,
) -> dict[str, tuple[float, ...]]:
    """Apply the ρ rule to a pilot model: one half-decade grid per radius family.

    For every family of the study's plan, sharpness of ``model`` on ``study.batches()`` (with
    the study's loss, Auto-PGD steps and samples) is evaluated on the half-decade ladder
    ``ρ = 10^{k/2}``, walking from ``start`` towards :data:`CALIBRATION_TARGET` (0.1 worst case,
    0.01 average case) until the target is bracketed; the centre ``ρ₀`` is the ladder point
    whose rise is closest to the target in log scale, and the grid is
    :func:`half_decade_grid` of ``ρ₀``. Only sharpness values of the pilot are looked at —
    no gap, no τ.

    Args:
        study: A study whose config has ``steps``, ``samples`` and ``ablations``.
        model: The pilot model (eval mode).
        start: First ρ of every walk (rounded to the ladder).
        max_evals: Most evaluations per family.
        log: Called with one line per evaluation (default: silent).

    Returns:
        ``{"rhos_<key>": grid}`` for every family of the plan; pass it to the config.
    """
    cfg = study.cfg  # type: ignore[attr-defined]
    return {
        f"rhos_{key}": rho_rule_grid(
            study,
            model,
            _with_budget(cfg, RADIUS_FAMILIES[key]),
            key,
            start=start,
            max_evals=max_evals,
            log=log,
        )
        for key in _families(cfg)
    }


def rho_rule_grid(
    study: Study,
    model: nn.Module,
    kwargs: dict[str, Any],
    key: str,
    start: float = 0.01,
    max_evals: int = 12,
    log: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """The ρ rule for one measure family: its half-decade grid on the pilot ``model``.

    The pilot's sharpness (``gs.sharpness(**kwargs)``, budget included) is evaluated on the
    ladder ``ρ = 10^{k/2}`` walking from ``start`` towards :data:`CALIBRATION_TARGET` until it
    is bracketed; the grid is :func:`half_decade_grid` of the ladder point closest to the target
    in log scale.

    Args:
        study: The study (loss, batches, ``key_bias``).
        model: The pilot model.
        kwargs: Settings of the measure, e.g. ``{"measure": "adaptive", "steps": 20}``.
        key: Name of the family, for the log.
        start: First radius of the ladder.
        max_evals: Most sharpness evaluations.
        log: Where each evaluation is reported, or ``None``.

    Returns:
        The three radii.
    """
    from geosharp.estimators import sharpness

    batches = study.batches()

    def rise(rho: float) -> float:
        return sharpness(
            model,
            study.loss_fn,
            batches,
            rho=rho,
            progress=False,
            key_bias=study.key_bias,
            **kwargs,
        ).value

    return ladder_grid(rise, kwargs.get("kind", "worst"), key, start, max_evals, log)


def ladder_grid(
    rise: Callable[[float], float],
    kind: str,
    key: str,
    start: float = 0.01,
    max_evals: int = 12,
    log: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """The ρ rule on any measurement: walk the ladder ``ρ = 10^{k/2}`` to the target, then grid.

    Args:
        rise: ρ → the pilot's sharpness at ρ (a failure to measure counts as ``inf``).
        kind: ``"worst"`` or ``"average"`` (the target of :data:`CALIBRATION_TARGET`).
        key: Name of the family, for the log.
        start: First radius of the ladder.
        max_evals: Most evaluations.
        log: Where each evaluation is reported, or ``None``.

    Returns:
        :func:`half_decade_grid` of the ladder point whose rise is closest to the target in log
        scale.
    """
    target = CALIBRATION_TARGET[kind]
    k = round(2 * math.log10(start))
    seen: dict[int, float] = {}
    direction = 0
    for _ in range(max_evals):
        try:
            value = rise(10 ** (k / 2))
        except (FloatingPointError, ValueError):
            value = math.inf
        seen[k] = value
        if log is not None:
            log(f"{key}: rho={10 ** (k / 2):.3g} rise={value:.4g}")
        step = 1 if value < target else -1
        if direction and step != direction:
            break
        direction = step
        k += step
    best = min(seen, key=lambda j: _log_distance(seen[j], target))
    return half_decade_grid(10 ** (best / 2))
