"""The measurement plan shared by Studies 2 and 3, and its radius families.

* :data:`RADIUS_FAMILIES` — config field ``rhos_<key>`` → the measure that calibrates it;
* :func:`standard_plan` — the measures: adaptive ℓ2/ℓ∞ and geodesic inv/mix at order 2; the
  ablations (order 1, no corrected norm); average-case adaptive/inv/mix; relative flatness;
* :func:`grids_text` — the ρ grids of a config, for the report's settings.

How each family's grid is chosen (the ρ rule) is :mod:`geosharp.studies.rho_rule`.
"""

from __future__ import annotations

from typing import Any

from geosharp.studies.runner import StudyMeasure

__all__ = ["RADIUS_FAMILIES", "grids_text", "standard_plan"]


#: The radius families of the plan: config field ``rhos_<key>`` → the measure that calibrates
#: it. The order-1 ablation of a metric is measured on the grid of its order-2 measure (same
#: ball, only the path differs); every other family has its own grid.
RADIUS_FAMILIES: dict[str, dict[str, Any]] = {
    "adaptive_l2": {"measure": "adaptive", "norm": "l2"},
    "adaptive_linf": {"measure": "adaptive", "norm": "linf"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
    "mix": {"measure": "geodesic", "metric": "mix", "order": 2},
    "inv_adaptivenorm": {
        "measure": "geodesic",
        "metric": "inv",
        "order": 2,
        "corrected_norm": False,
    },
    "mix_adaptivenorm": {
        "measure": "geodesic",
        "metric": "mix",
        "order": 2,
        "corrected_norm": False,
    },
    "average_adaptive": {"measure": "adaptive", "kind": "average"},
    "average_inv": {"measure": "geodesic", "metric": "inv", "order": 2, "kind": "average"},
    "average_mix": {"measure": "geodesic", "metric": "mix", "order": 2, "kind": "average"},
}


def _families(cfg: Any) -> list[str]:
    keys = ["adaptive_l2", "adaptive_linf", "inv", "mix"]
    keys += [f"{m}_adaptivenorm" for m in cfg.ablations]
    return [*keys, "average_adaptive", "average_inv", "average_mix"]


def _with_budget(cfg: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs.get("kind") == "average":
        return {**kwargs, "samples": cfg.samples}
    return {**kwargs, "steps": cfg.steps}


def standard_plan(cfg: Any, head: str) -> list[StudyMeasure]:
    """The measurement plan shared by Studies 2 and 3.

    Args:
        cfg: A config with ``steps``, ``samples``, ``ablations`` (metrics, a subset of
            ``("inv", "mix")``) and a grid ``rhos_<key>`` for every key of
            :data:`RADIUS_FAMILIES` it uses.
        head: Module path of the classification head (relative flatness).

    Returns:
        The :class:`StudyMeasure` list: adaptive ℓ2/ℓ∞ and geodesic inv/mix at order 2 (worst
        case); the ablations for ``cfg.ablations`` — order 1 (on the grid of the same metric at
        order 2) and no corrected norm; average-case adaptive, inv and mix; relative flatness.

    Raises:
        ValueError: If ``cfg.ablations`` names a metric other than ``"inv"`` and ``"mix"``.
    """
    if not set(cfg.ablations) <= {"inv", "mix"}:
        raise ValueError(f"ablations must be a subset of ('inv', 'mix'), got {cfg.ablations!r}")

    def spec(key: str, **change: Any) -> StudyMeasure:
        kwargs = _with_budget(cfg, {**RADIUS_FAMILIES[key], **change})
        return StudyMeasure(kwargs, getattr(cfg, f"rhos_{key}"))

    specs = [spec(key) for key in ["adaptive_l2", "adaptive_linf", "inv", "mix"]]
    specs += [spec(metric, order=1) for metric in cfg.ablations]
    specs += [spec(f"{metric}_adaptivenorm") for metric in cfg.ablations]
    specs += [spec(key) for key in ["average_adaptive", "average_inv", "average_mix"]]
    specs.append(StudyMeasure({"measure": "relative_flatness", "layer": head}, (None,)))
    return specs


def grids_text(cfg: Any) -> str:
    """The ρ grids of a config, one family per clause, for the report's settings."""
    labels = {
        "adaptive_l2": "adaptive ℓ2",
        "adaptive_linf": "adaptive ℓ∞",
        "inv": "geodesic inv",
        "mix": "geodesic mix",
        "inv_adaptivenorm": "inv, no corrected norm",
        "mix_adaptivenorm": "mix, no corrected norm",
        "average_adaptive": "average adaptive",
        "average_inv": "average inv",
        "average_mix": "average mix",
    }
    return "; ".join(
        f"{labels[k]} " + ", ".join(f"{r:g}" for r in getattr(cfg, f"rhos_{k}"))
        for k in _families(cfg)
    )
