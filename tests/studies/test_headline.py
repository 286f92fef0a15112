"""The report's headline (geosharp.studies.headline): a few sentences derived from the numbers."""

from __future__ import annotations

from types import SimpleNamespace

from geosharp.studies.analysis import Cell
from geosharp.studies.headline import headline


def cells(*rows):
    """``(measure, rho, tau, ci_low, ci_high)`` → the cells :func:`headline` reads."""
    out: dict = {}
    for measure, rho, tau, lo, hi in rows:
        s = SimpleNamespace(tau_a=tau, ci_low=lo, ci_high=hi, defined=True)
        out.setdefault(measure, {})[rho] = Cell(measure, rho, summary=s)
    return out


def pair(diff, lo, hi, rho=0.1):
    names = {"geodesic": "geodesic-inv-o2 worst l2", "adaptive": "adaptive worst l2"}
    return {**names, "rho_geodesic": rho, "rho_adaptive": rho, "diff": diff, "ci_low": lo,
            "ci_high": hi}  # fmt: skip


TAUS = cells(
    ("adaptive worst l2", 0.1, -0.01, -0.23, 0.19),
    ("geodesic-inv-o2 worst l2", 0.1, 0.07, -0.13, 0.26),
)


def test_ten_models_are_too_few_to_tell_the_measures_apart():
    wide = cells(
        ("adaptive worst l2", 0.1, 0.1, -0.4, 0.55),
        ("geodesic-inv-o2 worst l2", 0.1, 0.2, -0.3, 0.6),
    )
    lead = headline(10, wide, [pair(0.1, -0.25, 0.4)])
    assert lead[0].startswith("n = 10: too few models to tell the measures apart")
    assert lead[1].startswith("None of the 2 τ's with the gap has a 95 % CI excluding 0")


def test_a_narrow_ci_around_zero_bounds_the_difference():
    lead = headline(54, TAUS, [pair(0.08, -0.01, 0.18)])
    assert lead[0] == (
        "n = 54: geodesic and adaptive sharpness are not told apart: every paired Δτ's 95 % CI "
        "contains 0 and lies within ±0.18."
    )


def test_a_pair_whose_ci_excludes_zero_is_named():
    lead = headline(48, TAUS, [pair(0.14, 0.02, 0.25, rho=0.01), pair(0.05, -0.04, 0.14, rho=1)])
    assert lead[0] == (
        "n = 48: geodesic-inv-o2 worst l2 and adaptive worst l2 differ at ρ = 0.01: Δτ = 0.14 "
        "[0.02, 0.25]; the other 1 pair(s)' CIs contain 0."
    )


def test_without_pairs_the_taus_lead():
    taus = cells(("a", 0.1, 0.31, 0.12, 0.48), ("b", 0.1, 0.05, -0.2, 0.3), ("c", None, 0.0, -1, 1))
    assert headline(50, taus, []) == [
        "n = 50: 1 of the 3 τ's with the gap have a 95 % CI excluding 0; the largest |τ|: a at "
        "ρ = 0.1, τ = 0.31 [0.12, 0.48]."
    ]
    assert headline(3, {}, [])[0].startswith("n = 3: no τ could be computed")
