"""The paired geodesic-vs-adaptive verdict: the expected direction, sign changes and τ ≈ 0.

Issue 14: with no paper value the old rule took the expected direction from τ_geodesic alone,
so results/diagonal-2 (mix, ρ = 0.01: τ_geo = +0.01, τ_ada = −0.71, Δτ = 0.72 [0.45, 0.98])
read "geodesic stronger", while at the neighbouring radii (τ_geo = −0.27, −0.04) the same kind
of pair read "adaptive stronger".
"""

import pytest

from geosharp.stats import correlation_summary
from geosharp.studies.analysis import Cell, geodesic_vs_adaptive, paired_verdict


@pytest.mark.parametrize(
    ("ci", "tau_geo", "tau_ada", "paper", "verdict", "direction"),
    [
        # adaptive −0.3, geodesic +0.1, no paper: negative direction, adaptive correlates more
        ((0.2, 0.6), 0.1, -0.3, None, "adaptive stronger", "negative"),
        # the same with the CI containing 0
        ((-0.1, 0.6), 0.1, -0.3, None, "no clear difference (CI contains 0)", "negative"),
        # diagonal-2, mix ρ = 0.01: τ_geo ≈ 0 on either side of 0 gives the same verdict
        ((0.45, 0.98), 0.01, -0.71, None, "adaptive stronger", "negative"),
        ((0.43, 0.96), -0.01, -0.71, None, "adaptive stronger", "negative"),
        ((0.45, 0.98), 0.0, -0.71, None, "adaptive stronger", "negative"),
        # both ≈ 0: no direction to read
        ((-0.2, 0.2), 0.0, 0.0, None, None, "none"),
        ((-0.2, 0.2), 0.02, -0.01, None, "no clear difference (CI contains 0)", "positive"),
        # geodesic stronger in the negative direction (the paper's sign)
        ((-0.5, -0.1), -0.6, -0.3, -0.71, "geodesic stronger", "negative"),
        # positive direction: larger τ is stronger
        ((0.1, 0.5), 0.6, 0.3, None, "geodesic stronger", "positive"),
        ((-0.5, -0.1), 0.3, 0.6, None, "adaptive stronger", "positive"),
        # the paper says negative; geodesic +0.5 goes the wrong way, adaptive −0.3 the right one
        ((0.6, 1.0), 0.5, -0.3, -0.71, "adaptive stronger", "negative"),
        # the paper says negative and both are positive: the "stronger" is only the less wrong
        (
            (-0.4, -0.1),
            0.2,
            0.5,
            -0.71,
            "geodesic stronger; neither τ has the expected sign",
            "negative",
        ),
        # undefined CI
        ((float("nan"), float("nan")), -0.2, -0.3, None, "undefined", "negative"),
    ],
)
def test_paired_verdict(ci, tau_geo, tau_ada, paper, verdict, direction):
    got = paired_verdict(*ci, tau_geo, tau_ada, paper)
    assert got.direction == direction
    if verdict is None:
        assert got.verdict.startswith("undefined (no expected direction")
    else:
        assert got.verdict == verdict
    assert got.direction_from == ("paper" if paper is not None else "τ geodesic + τ adaptive")


def test_stronger_means_larger_abs_tau_when_the_direction_comes_from_the_taus():
    # Every point-consistent case without a paper value: the stronger one has the larger |τ|.
    for tg in (-0.8, -0.3, -0.05, 0.0, 0.05, 0.3, 0.8):
        for ta in (-0.8, -0.3, -0.05, 0.0, 0.05, 0.3, 0.8):
            d = tg - ta
            got = paired_verdict(d - 0.01, d + 0.01, tg, ta).verdict
            if got == "geodesic stronger":
                assert abs(tg) > abs(ta), (tg, ta)
            elif got == "adaptive stronger":
                assert abs(ta) > abs(tg), (tg, ta)


def _cells(geo, ada, gaps):
    cells = {}
    for name, values in (("geodesic-mix-o2 worst l2", geo), ("adaptive worst l2", ada)):
        ids = [f"m{i}" for i in range(len(values))]
        cell = Cell(name, 0.01, ids, list(values))
        cell.summary = correlation_summary(gaps, values, n_boot=200, n_perm=10)
        cells[name] = {0.01: cell}
    return cells


def test_geodesic_vs_adaptive_with_adaptive_negative_and_geodesic_near_zero():
    gaps = [0.1 * i for i in range(12)]
    ada = [-g for g in gaps]  # τ_ada = −1
    geo = [1, 0, 2, 1, 0, 2, 1, 2, 0, 1, 0, 2]  # τ_geo ≈ 0, positive on these gaps
    cells = _cells(geo, ada, gaps)
    gap_of = {f"m{i}": g for i, g in enumerate(gaps)}
    (pair,) = geodesic_vs_adaptive(cells, gap_of, None, 500, 0.95, 0)
    assert -0.3 < pair["tau_geodesic"] < 0.3 and pair["tau_adaptive"] == -1.0
    assert pair["diff"] > 0  # τ_geo − τ_ada: the old rule read this as geodesic stronger
    assert pair["direction"] == "negative" and pair["verdict"] == "adaptive stronger"
    assert pair["direction_from"] == "τ geodesic + τ adaptive"


# -- a direction stated before measuring (geosharp study MANIFEST --expect) ------------------
def test_stated_direction_decides_where_the_taus_would_not():
    # Study 5's outer ρ (results/study5-minilm-finetunes): τ_geo +0.05, τ_ada −0.09, Δτ +0.14
    # [+0.02, +0.25]. From the data the direction is negative and the pair reads "adaptive
    # stronger"; with the preregistered positive direction it is geodesic that is stronger.
    assert paired_verdict(0.02, 0.25, 0.05, -0.09).verdict == "adaptive stronger"
    got = paired_verdict(0.02, 0.25, 0.05, -0.09, expected="positive")
    assert (got.verdict, got.direction, got.direction_from) == (
        "geodesic stronger",
        "positive",
        "stated (--expect)",
    )
    neg = paired_verdict(0.02, 0.25, 0.05, -0.09, expected="negative")
    assert (neg.verdict, neg.direction) == ("adaptive stronger", "negative")
    # a paper value wins over a stated direction
    assert paired_verdict(0.02, 0.25, 0.05, -0.09, -0.3, "positive").direction_from == "paper"
    with pytest.raises(ValueError, match="positive"):
        paired_verdict(0.02, 0.25, 0.05, -0.09, expected="up")


def test_stated_direction_reaches_the_pairs_and_the_section():
    from geosharp.studies.sections import paired_section

    gaps = [0.1 * i for i in range(12)]
    ada = [-g for g in gaps]  # τ_ada = −1
    geo = [1, 0, 2, 1, 0, 2, 1, 2, 0, 1, 0, 2]
    gap_of = {f"m{i}": g for i, g in enumerate(gaps)}
    (pair,) = geodesic_vs_adaptive(_cells(geo, ada, gaps), gap_of, None, 500, 0.95, 0, "positive")
    assert pair["direction"] == "positive" and pair["direction_from"] == "stated (--expect)"
    assert pair["verdict"] == "geodesic stronger"  # τ_geo ≈ 0 beats τ_ada = −1 in that direction
    (section,) = paired_section([pair], 0.95)
    assert section.caption.endswith(
        "Here s is the direction stated before measuring (--expect positive), not the sign of "
        "τ-geodesic + τ-adaptive."
    )
    assert section.rows[0][2] == "single ρ"  # one ρ per measure: no grid position to name
    (plain,) = geodesic_vs_adaptive(_cells(geo, ada, gaps), gap_of, None, 500, 0.95, 0)
    assert "stated" not in paired_section([plain], 0.95)[0].caption
