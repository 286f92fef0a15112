"""The numbers of a study report: τ per (measure, ρ) cell, paired comparisons and verdicts.

Nothing here draws or writes a file; :mod:`geosharp.studies.report` feeds the results to
:mod:`~geosharp.studies.plots` and :mod:`~geosharp.studies.render`. The comparison with the
paper's τ is in :mod:`geosharp.studies.paper`.

- :func:`check_models` and :func:`collect` validate the input and group the measurements into
  one :class:`Cell` per (measure, ρ); :func:`correlate` computes every cell's Kendall τ-a with
  the gap, its bootstrap CI and permutation p-value (:mod:`geosharp.stats`);
- :func:`geodesic_vs_adaptive`: geodesic against adaptive sharpness on the same models
  (paired Δτ with a CI) and :func:`paired_verdict` (what "stronger" means).

Measure names are read with :mod:`geosharp.measuring.names` (the grammar ``geosharp measure``
uses): :func:`measure_family`, :func:`default_paper_match`, ``is_geodesic_main``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from geosharp.measures import parse_measure
from geosharp.measuring.names import (
    FAMILY_ORDER,
    default_paper_match,
    is_geodesic_main,
    measure_family,
)
from geosharp.stats import CorrelationSummary, correlation_summary, tau_difference
from geosharp.studies.formatting import rho_key

__all__ = [
    "FAMILY_ORDER",
    "MIN_MODELS",
    "OPTIONAL_MODEL_FIELDS",
    "Cell",
    "PairedVerdict",
    "check_models",
    "collect",
    "correlate",
    "default_paper_match",
    "geodesic_vs_adaptive",
    "measure_family",
    "paired_verdict",
]

#: A (measure, ρ) cell needs at least this many models with finite values for τ.
MIN_MODELS = 3

OPTIONAL_MODEL_FIELDS = ("train_loss", "test_loss", "train_err", "test_err")


# --------------------------------------------------------------------------------------------
# input validation


def _number(value: object, where: str, *, none_is_nan: bool) -> float:
    if value is None and none_is_nan:
        return math.nan
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{where} must be a number; got {value!r:.80}")
    try:  # int, float, numpy scalars, 0-d arrays and tensors
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} must be a number; got {value!r:.80}") from err


def check_models(models: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Validate the ``models`` of :func:`~geosharp.studies.report.write_report`; clean copies."""
    if not models:
        raise ValueError("models is empty; pass one dict per trained model")
    out: list[dict[str, object]] = []
    seen: set[str] = set()
    for i, model in enumerate(models):
        if not isinstance(model, Mapping):
            raise ValueError(f"models[{i}] must be a dict; got {type(model).__name__}")
        for key in ("model_id", "gap"):
            if key not in model:
                raise ValueError(f"models[{i}] has no {key!r}; every model needs model_id and gap")
        model_id = model["model_id"]
        if not isinstance(model_id, str):
            raise ValueError(f"models[{i}]['model_id'] must be a str; got {model_id!r:.80}")
        if model_id in seen:
            raise ValueError(f"model_id {model_id!r} appears twice in models; ids must be unique")
        seen.add(model_id)
        row: dict[str, object] = {
            "model_id": model_id,
            "gap": _number(model["gap"], f"models[{i}]['gap']", none_is_nan=False),
        }
        for key in OPTIONAL_MODEL_FIELDS:
            if model.get(key) is not None:
                row[key] = _number(model[key], f"models[{i}][{key!r}]", none_is_nan=True)
        hparams = model.get("hparams") or {}
        if not isinstance(hparams, Mapping):
            raise ValueError(f"models[{i}]['hparams'] must be a dict; got {hparams!r:.80}")
        row["hparams"] = dict(hparams)
        out.append(row)
    return out


@dataclass
class Cell:
    """The measurements of one (measure, ρ) pair and their correlation with the gap."""

    measure: str
    rho: float | None
    model_ids: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    summary: CorrelationSummary | None = None


def collect(
    measurements: Sequence[Mapping[str, object]], model_ids: set[str]
) -> dict[str, dict[float | None, Cell]]:
    """Group the measurements into one :class:`Cell` per (measure, ρ), validating each."""
    cells: dict[str, dict[float | None, Cell]] = {}
    seen: set[tuple[str, str, float | None]] = set()
    for i, meas in enumerate(measurements):
        if not isinstance(meas, Mapping):
            raise ValueError(f"measurements[{i}] must be a dict; got {type(meas).__name__}")
        for key in ("model_id", "measure", "value"):
            if key not in meas:
                raise ValueError(
                    f"measurements[{i}] has no {key!r}; every measurement needs model_id, "
                    "measure, rho and value"
                )
        model_id, measure = meas["model_id"], meas["measure"]
        if model_id not in model_ids:
            raise ValueError(
                f"measurements[{i}] refers to model_id {model_id!r}, which is not in models"
            )
        if not isinstance(measure, str) or not measure:
            raise ValueError(f"measurements[{i}]['measure'] must be a non-empty str")
        rho_raw = meas.get("rho")
        rho = (
            None
            if rho_raw is None
            else _number(rho_raw, f"measurements[{i}]['rho']", none_is_nan=False)
        )
        key = (str(model_id), measure, rho)
        if key in seen:
            raise ValueError(
                f"measurements[{i}] repeats model {model_id!r}, measure {measure!r}, ρ={rho}; "
                "pass each (model, measure, ρ) once (average replicates beforehand)"
            )
        seen.add(key)
        cell = cells.setdefault(measure, {}).setdefault(rho, Cell(measure, rho))
        cell.model_ids.append(str(model_id))
        cell.values.append(_number(meas["value"], f"measurements[{i}]['value']", none_is_nan=True))
        if meas.get("time_s") is not None:
            cell.times.append(
                _number(meas["time_s"], f"measurements[{i}]['time_s']", none_is_nan=True)
            )
    return cells


def correlate(
    cells: dict[str, dict[float | None, Cell]],
    gaps: Mapping[str, float],
    *,
    n_boot: int,
    n_perm: int,
    level: float,
    seed: int,
) -> dict[str, dict[float | None, Cell]]:
    """Fill every cell's :attr:`Cell.summary`; return the cells sorted by :data:`FAMILY_ORDER`.

    Sharpness, then relative flatness, then curvature, then a family not listed (a new
    measure's); each kind in the order given.
    """

    def rank(name: str) -> int:
        family = measure_family(name)
        return FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)

    cells = dict(sorted(cells.items(), key=lambda kv: rank(kv[0])))
    for by_rho in cells.values():
        for cell in by_rho.values():
            cell.summary = correlation_summary(
                [gaps[m] for m in cell.model_ids],
                cell.values,
                n_boot=n_boot,
                n_perm=n_perm,
                level=level,
                seed=seed,
                min_models=MIN_MODELS,
            )
    return cells


# --------------------------------------------------------------------------------------------
# geodesic against adaptive sharpness


def geodesic_vs_adaptive(
    cells: dict[str, dict[float | None, Cell]],
    gaps: Mapping[str, float],
    paper: Mapping[str, float] | None,
    n_boot: int,
    level: float,
    seed: int,
    expected: str | None = None,
) -> list[dict[str, object]]:
    """Paired comparison of each geodesic measure with adaptive ℓ2 of the same kind.

    ``geodesic-{inv,mix}-o2 {worst,average} l2`` is compared with ``adaptive {worst,average}
    l2`` at the same position of their ρ grids (smallest with smallest, …; radii of different
    balls are not comparable, positions are): ``Δτ = τ_geo − τ_ada`` on the models that have
    both values, with a paired bootstrap CI (:func:`geosharp.stats.tau.tau_difference`), and a
    verdict by :func:`paired_verdict` (which measure correlates more strongly with the gap in
    the expected direction).
    """
    out: list[dict[str, object]] = []
    for name, by_rho in cells.items():
        if not is_geodesic_main(name):
            continue
        spec = parse_measure(name)
        base = f"adaptive {spec.kind} l2"
        if base not in cells:
            continue
        geo_rhos = sorted(by_rho, key=rho_key)
        ada_rhos = sorted(cells[base], key=rho_key)
        if len(geo_rhos) != len(ada_rhos):
            continue
        family = f"geodesic {spec.metric}"
        for k, (rg, ra) in enumerate(zip(geo_rhos, ada_rhos, strict=True)):
            cg, ca = by_rho[rg], cells[base][ra]
            va = dict(zip(ca.model_ids, ca.values, strict=True))
            ids = [m for m in cg.model_ids if m in va]
            vg = dict(zip(cg.model_ids, cg.values, strict=True))
            d = tau_difference(
                [gaps[m] for m in ids],
                [vg[m] for m in ids],
                [va[m] for m in ids],
                n_boot=n_boot,
                level=level,
                seed=seed,
            )
            tg = cg.summary.tau_a if cg.summary else math.nan
            ta = ca.summary.tau_a if ca.summary else math.nan
            paper_tau = float(paper[family]) if paper and family in paper else None
            judged = paired_verdict(d.ci_low, d.ci_high, tg, ta, paper_tau, expected)
            out.append(
                {
                    "geodesic": name,
                    "adaptive": base,
                    "position": k,
                    "grid_size": len(geo_rhos),
                    "rho_geodesic": rg,
                    "rho_adaptive": ra,
                    "tau_geodesic": tg,
                    "tau_adaptive": ta,
                    "diff": d.diff,
                    "ci_low": d.ci_low,
                    "ci_high": d.ci_high,
                    "n_models": d.n_models,
                    "direction": judged.direction,
                    "direction_from": judged.direction_from,
                    "verdict": judged.verdict,
                }
            )
    return out


#: The directions a user can state for the paired verdict (``--expect``).
EXPECTED = ("positive", "negative")


@dataclass(frozen=True)
class PairedVerdict:
    """What :func:`paired_verdict` concluded.

    Attributes:
        direction: ``"negative"`` or ``"positive"`` (the expected sign of τ), or ``"none"``.
        direction_from: ``"paper"``, ``"stated (--expect)"`` or ``"τ geodesic + τ adaptive"``.
        verdict: ``"geodesic stronger"``, ``"adaptive stronger"`` (each possibly followed by
            ``"; neither τ has the expected sign"``), ``"no clear difference (CI contains
            0)"``, ``"undefined"`` or ``"undefined (no expected direction …)"``.
    """

    direction: str
    direction_from: str
    verdict: str


def paired_verdict(
    ci_low: float,
    ci_high: float,
    tau_geodesic: float,
    tau_adaptive: float,
    paper_tau: float | None = None,
    expected: str | None = None,
) -> PairedVerdict:
    """Which of two measures correlates more strongly with the gap in the expected direction.

    The verdict is read on ``s·τ``, the correlation in the expected direction ``s ∈ {−1, +1}``,
    and its CI is ``s·[ci_low, ci_high]``, the paired bootstrap CI of ``Δτ = τ_geo − τ_ada``:

    - ``s`` is the sign of the paper's τ for the geodesic family when the study has one
      (``paper_tau``); else the direction the user stated before measuring (``expected``,
      ``geosharp study MANIFEST --expect``); otherwise the sign of ``τ_geo + τ_ada``, the
      direction the two measures share on balance (so a τ near 0 cannot flip it: with
      ``τ_ada = −0.71`` the direction is negative whether ``τ_geo`` is ``+0.01`` or
      ``−0.01``). When that sum is 0 (or not finite) there is no expected direction and the
      verdict is undefined.
    - ``"geodesic stronger"`` when the whole CI of ``s·Δτ`` is above 0, ``"adaptive
      stronger"`` when it is below 0, else ``"no clear difference (CI contains 0)"``.
    - Where the stronger measure's ``s·τ`` is not positive (only possible with a paper
      direction: both τ have the other sign), ``"; neither τ has the expected sign"`` is
      added: the "stronger" one is only the less wrong.

    So with no paper value, ``τ_ada = −0.3`` and ``τ_geo = +0.1`` give the negative direction
    and, if the CI allows, "adaptive stronger": adaptive sharpness correlates with the gap
    (−0.3) and geodesic sharpness does not in that direction (+0.1). When the direction comes
    from the sum, or both τ have the expected sign, this is also the reading on ``|τ|``: the
    measure called stronger has the larger ``|τ|`` (of the point estimates). With a paper
    direction that one τ contradicts, the other is stronger whatever the sizes.

    Args:
        ci_low: Lower end of the CI of ``τ_geo − τ_ada`` (NaN: undefined).
        ci_high: Upper end.
        tau_geodesic: τ of the geodesic measure.
        tau_adaptive: τ of the adaptive measure.
        paper_tau: The paper's τ for the geodesic family, if any.
        expected: ``"positive"`` or ``"negative"``: the expected sign of τ stated by the
            user (used when there is no paper τ), or ``None``.

    Example:
        >>> paired_verdict(0.2, 0.6, 0.1, -0.3).verdict  # Δτ = τ_geo − τ_ada = +0.4
        'adaptive stronger'
        >>> paired_verdict(0.45, 0.98, 0.01, -0.71).verdict  # τ_geo ≈ 0: still negative
        'adaptive stronger'
        >>> paired_verdict(-0.1, 0.1, 0.0, 0.0).verdict
        'undefined (no expected direction: τ geodesic + τ adaptive = 0 and no paper value)'
        >>> paired_verdict(0.02, 0.25, 0.05, -0.09, expected="positive").verdict
        'geodesic stronger'
    """
    if expected is not None and expected not in EXPECTED:
        raise ValueError(f"expected must be one of {EXPECTED} or None, got {expected!r}")
    if paper_tau is not None and math.isfinite(paper_tau) and paper_tau != 0:
        sign, source = math.copysign(1.0, paper_tau), "paper"
    elif expected is not None:
        sign, source = (1.0 if expected == "positive" else -1.0), "stated (--expect)"
    else:
        total = tau_geodesic + tau_adaptive
        source = "τ geodesic + τ adaptive"
        if not math.isfinite(total) or total == 0:
            reason = "τ undefined" if not math.isfinite(total) else "τ geodesic + τ adaptive = 0"
            return PairedVerdict(
                "none", source, f"undefined (no expected direction: {reason} and no paper value)"
            )
        sign = math.copysign(1.0, total)
    direction = "negative" if sign < 0 else "positive"
    if not (math.isfinite(ci_low) and math.isfinite(ci_high)):
        return PairedVerdict(direction, source, "undefined")
    lo, hi = sorted((sign * ci_low, sign * ci_high))
    if lo > 0:
        verdict, winner = "geodesic stronger", tau_geodesic
    elif hi < 0:
        verdict, winner = "adaptive stronger", tau_adaptive
    else:
        return PairedVerdict(direction, source, "no clear difference (CI contains 0)")
    if not sign * winner > 0:
        verdict += "; neither τ has the expected sign"
    return PairedVerdict(direction, source, verdict)
