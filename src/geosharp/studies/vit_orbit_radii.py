"""Study 4's radius families and the ρ rule on its pilot.

* :data:`FAMILIES` — config field ``rhos_<key>`` → the measure it is the grid of (the plan of
  :class:`geosharp.studies.vit_orbit.VitOrbitStudy`, and the families of its analysis);
* :func:`calibrate_orbit_rhos` — Study 2's ρ rule (:mod:`geosharp.studies.rho_rule`) for those
  families on the pilot model, looking at the pilot's sharpness only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from geosharp.studies.rho_rule import rho_rule_grid

if TYPE_CHECKING:
    from geosharp.studies.vit_orbit import VitOrbitStudy

__all__ = ["FAMILIES", "calibrate_orbit_rhos"]

#: The radius families of Study 4: config field ``rhos_<key>`` → the measure it is the grid of.
FAMILIES: dict[str, dict[str, Any]] = {
    "adaptive_l2": {"measure": "adaptive"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
    "mix": {"measure": "geodesic", "metric": "mix", "order": 2},
    "adaptive_blocks": {"measure": "adaptive", "perturb": "blocks"},
    "inv_blocks": {"measure": "geodesic", "metric": "inv", "order": 2, "perturb": "blocks"},
    "average_adaptive": {"measure": "adaptive", "kind": "average"},
    "average_inv": {"measure": "geodesic", "metric": "inv", "order": 2, "kind": "average"},
}


def calibrate_orbit_rhos(
    study: VitOrbitStudy,
    model: nn.Module,
    start: float = 0.01,
    max_evals: int = 12,
    log: Callable[[str], None] | None = None,
) -> dict[str, tuple[float, ...]]:
    """Study 2's ρ rule (:func:`geosharp.studies.rho_rule.calibrate_rhos`) for Study 4's families.

    For every family of :data:`FAMILIES`, the pilot's sharpness is evaluated on the ladder
    ``ρ = 10^{k/2}`` walking from ``start`` towards the target (0.1 worst case, 0.01 average
    case) until it is bracketed; the grid is the half-decade grid of the ladder point closest to
    the target in log scale. Only the pilot's sharpness is looked at (no gap, no τ).

    Returns:
        ``{"rhos_<key>": grid}``.
    """
    c = study.cfg
    out = {}
    for key, kw in FAMILIES.items():
        budget = (
            {"samples": c.samples} if kw.get("kind", "worst") == "average" else {"steps": c.steps}
        )
        out[f"rhos_{key}"] = rho_rule_grid(
            study, model, {**kw, **budget}, key, start=start, max_evals=max_evals, log=log
        )
    return out
