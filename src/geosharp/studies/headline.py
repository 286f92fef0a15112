"""The one-line headline at the top of a study's report, derived from its numbers.

:func:`headline` returns a list of plain sentences: first what the paired comparison of the
geodesic and adaptive measures can say for this many models (or, without pairs, what the τ's
can), then how many τ's differ from 0. Each sentence comes from its own small function over
the report's analysis, so another (e.g. "many cells flagged") is one more function and one more
line in :func:`headline`.

Example:
    >>> headline(10, {}, [])
    ['n = 10: no τ could be computed (no measure has a finite value for 3 or more models).']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from geosharp.studies.analysis import Cell
from geosharp.studies.formatting import fmt, rho_label

__all__ = ["WIDE", "headline"]

#: A 95 % CI of a paired Δτ whose median half-width over the pairs is at least this wide
#: cannot tell the measures apart: "too few models". (n = 10 gives about ±0.3, Study 5's
#: n = 54 about ±0.1.)
WIDE = 0.15


def headline(
    n_models: int,
    cells: Mapping[str, Mapping[float | None, Cell]],
    paired: Sequence[Mapping[str, Any]],
    level: float = 0.95,
) -> list[str]:
    """The report's headline: a few sentences, each derived from the numbers of the report.

    Args:
        n_models: The models analysed.
        cells: Measure → ρ → :class:`~geosharp.studies.analysis.Cell` (with its summary).
        paired: The paired geodesic-vs-adaptive rows
            (:func:`~geosharp.studies.analysis.geodesic_vs_adaptive`).
        level: The CIs' coverage.

    Returns:
        The sentences, most important first.
    """
    defined = [c for by_rho in cells.values() for c in by_rho.values() if _defined(c)]
    if not defined:
        return [
            f"n = {n_models}: no τ could be computed (no measure has a finite value for 3 or "
            "more models)."
        ]
    pairs = [p for p in paired if _finite(p.get("ci_low")) and _finite(p.get("ci_high"))]
    tau_half = float(np.median([_half(c.summary) for c in defined]))
    first = _pairs_sentence(n_models, pairs, level, tau_half) if pairs else None
    return [s for s in (first, _tau_sentence(n_models, defined, level, first is None)) if s]


def _half(s: Any) -> float:
    """Half the width of a CI (``s.ci_low``, ``s.ci_high``)."""
    return float(s.ci_high - s.ci_low) / 2


def _defined(cell: Cell) -> bool:
    s = cell.summary
    return s is not None and s.defined and _finite(s.ci_low) and _finite(s.ci_high)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and bool(np.isfinite(x))


def _pct(level: float) -> str:
    return f"{100 * level:g} %"


def _pairs_sentence(
    n: int, pairs: Sequence[Mapping[str, Any]], level: float, tau_half: float
) -> str:
    """Whether the paired Δτ(geodesic − adaptive) tell the measures apart, and if not, why.

    ``tau_half``: the median half-width of the τ's CIs; a pair's CI can be narrow because both
    τ move together on a handful of models, so "too few models" looks at both.
    """
    apart = [p for p in pairs if p["ci_low"] > 0 or p["ci_high"] < 0]
    if apart:
        p = max(apart, key=lambda q: abs(q["diff"]))
        dtau = f"Δτ = {fmt(p['diff'])} [{fmt(p['ci_low'])}, {fmt(p['ci_high'])}]"
        if len(apart) == 1:
            rest = f"; the other {len(pairs) - 1} pair(s)' CIs contain 0" if len(pairs) > 1 else ""
            where = f"{p['geodesic']} and {p['adaptive']} differ at {_rho_text(p)}"
            return f"n = {n}: {where}: {dtau}{rest}."
        return (
            f"n = {n}: {len(apart)} of {len(pairs)} paired Δτ(geodesic − adaptive) have a "
            f"{_pct(level)} CI excluding 0; the largest, {p['geodesic']} at {_rho_text(p)}: {dtau}."
        )
    half = float(np.median([(p["ci_high"] - p["ci_low"]) / 2 for p in pairs]))
    if half >= WIDE or tau_half >= 2 * WIDE:
        return (
            f"n = {n}: too few models to tell the measures apart: every paired Δτ(geodesic − "
            f"adaptive) has a {_pct(level)} CI containing 0 (median half-width ±{half:.2f}; "
            f"the τ's: ±{tau_half:.2f})."
        )
    bound = max(max(abs(p["ci_low"]), abs(p["ci_high"])) for p in pairs)
    return (
        f"n = {n}: geodesic and adaptive sharpness are not told apart: every paired Δτ's "
        f"{_pct(level)} CI contains 0 and lies within ±{bound:.2f}."
    )


def _rho_text(pair: Mapping[str, Any]) -> str:
    rg, ra = pair.get("rho_geodesic"), pair.get("rho_adaptive")
    if rg == ra:
        return rho_label(rg)
    return f"{rho_label(rg)} (adaptive {rho_label(ra).removeprefix('ρ = ')})"


def _tau_sentence(n: int, defined: Sequence[Cell], level: float, lead: bool) -> str:
    """How many τ's have a CI that excludes 0, and the strongest; ``lead``: starts the headline."""
    sums = [(c, c.summary) for c in defined if c.summary is not None]
    away = [(c, s) for c, s in sums if s.ci_low > 0 or s.ci_high < 0]
    if not away:
        half = float(np.median([_half(s) for _, s in sums]))
        few = (
            "too few models to tell a correlation from none: " if lead and half >= 2 * WIDE else ""
        )
        text = (
            f"{few}none of the {len(sums)} τ's with the gap has a {_pct(level)} CI excluding 0 "
            f"(median half-width ±{half:.2f})."
        )
    else:
        c, s = max(away, key=lambda cs: abs(cs[1].tau_a))
        at = "" if c.rho is None else f" at {rho_label(c.rho)}"
        text = (
            f"{len(away)} of the {len(sums)} τ's with the gap have a {_pct(level)} CI excluding "
            f"0; the largest |τ|: {c.measure}{at}, τ = {fmt(s.tau_a)} "
            f"[{fmt(s.ci_low)}, {fmt(s.ci_high)}]."
        )
    return f"n = {n}: {text}" if lead else text[0].upper() + text[1:]
