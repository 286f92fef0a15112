"""Populations with hyperparameter columns: granulated τ and the CMI score (SPEC §2.5).

Each definition is checked on an example small enough to compute on paper (the computation is
written out above the test), then on properties that hold for any population: a measure equal
to the gap scores 1, one independent of it scores 0, only the order of the measure matters,
granulated τ is plain τ when a single hyperparameter varies, and the vectorised CMI agrees with
a pair-by-pair count written independently below (natural logarithms, dictionaries).
"""

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from geosharp import stats

LOG2_3 = math.log2(3)


def h2(p: float) -> float:
    """Binary entropy in bits."""
    return -sum(x * math.log2(x) for x in (p, 1 - p) if x > 0)


# -------------------------------------------------------------------------- hand-computed: CMI


def test_cmi_three_models_one_hparam_by_hand():
    # gaps t = (1, 2, 3), measure s = (1, 3, 2), lr = (a, a, b). Ordered pairs (i, j), i ≠ j,
    # with (V_t, V_s) = (sign(t_i − t_j), sign(s_i − s_j)):
    #   (1,2): (−,−)  (2,1): (+,+)  (1,3): (−,−)  (3,1): (+,+)  (2,3): (−,+)  (3,2): (+,−)
    # S = ∅: counts (+,+) 2, (−,−) 2, (+,−) 1, (−,+) 1 of N = 6; both marginals ½/½.
    #   H(V_t) = 1 bit.  I = 2·(2/6)·log2((2/6)/(1/4)) + 2·(1/6)·log2((1/6)/(1/4))
    #                      = (2/3)(2 − log2 3) + (1/3)(1 − log2 3) = 5/3 − log2 3 ≈ 0.081704
    #   Î(∅) = I / H = 5/3 − log2 3.
    # S = {lr}: strata U = (lr_i, lr_j):
    #   (a,a): (1,2) (−,−), (2,1) (+,+) → V_s = V_t, I = H = 1 bit, weight 2/6
    #   (a,b): (1,3) (−,−), (2,3) (−,+) → V_t constant, I = H = 0, weight 2/6
    #   (b,a): (3,1) (+,+), (3,2) (+,−) → V_t constant, I = H = 0, weight 2/6
    #   I(V_s; V_t | U) = H(V_t | U) = 2/6 = 1/3 bit → Î({lr}) = 1.
    # score = min(0.081704, 1) = 5/3 − log2 3, at S = ∅.
    r = stats.cmi_score([1, 2, 3], [1, 3, 2], {"lr": ["a", "a", "b"]})
    assert r.per_set[()] == pytest.approx(5 / 3 - LOG2_3, abs=1e-12)
    assert r.information[()] == pytest.approx(5 / 3 - LOG2_3, abs=1e-12)
    assert r.entropy[()] == pytest.approx(1.0)
    assert r.information[("lr",)] == pytest.approx(1 / 3)
    assert r.entropy[("lr",)] == pytest.approx(1 / 3)
    assert r.per_set[("lr",)] == 1.0
    assert r.score == pytest.approx(0.0817041659, abs=1e-9)
    assert r.condition == ()
    assert (r.n_models, r.n_pairs, r.note) == (3, 6, "")


def test_cmi_grid_where_the_measure_only_tracks_lr_by_hand():
    # 2 × 2 grid, one model per cell:  model  lr  width  t  s
    #                                     1    a    1    1  1
    #                                     2    a    2    2  1
    #                                     3    b    1    3  2
    #                                     4    b    2    4  2
    # Unordered pairs i < j all have V_t = −; the reverse pair flips both signs:
    #   (1,2): (−,0)  (1,3): (−,−)  (1,4): (−,−)  (2,3): (−,−)  (2,4): (−,−)  (3,4): (−,0)
    # 12 ordered pairs. V_s takes three values (a tie in s is V_s = 0).
    # S = ∅: (+,+) 4, (−,−) 4, (+,0) 2, (−,0) 2.  H(V_t) = 1, H(V_s) = log2 3,
    #   H(V_t, V_s) = 2·(4/12)·log2 3 + 2·(2/12)·log2 6 = log2 3 + 1/3,
    #   I = 1 + log2 3 − (log2 3 + 1/3) = 2/3 → Î(∅) = 2/3.
    # S = {lr}: (a,a): (1,2),(2,1) = (−,0),(+,0): V_s constant → I = 0, H = 1, weight 2/12;
    #   (b,b): the same with (3,4),(4,3); (a,b) and (b,a): 4 pairs each, V_t constant → H = 0.
    #   I = 0, H(V_t | U) = 4/12 = 1/3 → Î({lr}) = 0.
    # S = {width}: (1,1): (1,3),(3,1) = (−,−),(+,+): I = H = 1, weight 2/12; (2,2) likewise;
    #   (1,2): (1,2) (−,0), (1,4) (−,−), (3,2) (+,+), (3,4) (−,0): V_s determines V_t, so
    #   I = H = h2(1/4) = 2 − ¾·log2 3 ≈ 0.811278, weight 4/12; (2,1) is its mirror image.
    #   I = H = 2/12 + 2/12 + (8/12)·h2(1/4) ≈ 0.874185 → Î({width}) = 1.
    # S = {lr, width}: every stratum holds one ordered pair → H = 0 → undefined, left out.
    # score = min(2/3, 0, 1) = 0 at S = {lr}: given lr, the measure says nothing more.
    t = [1, 2, 3, 4]
    s = [1, 1, 2, 2]
    hp = {"lr": ["a", "a", "b", "b"], "width": [1, 2, 1, 2]}
    r = stats.cmi_score(t, s, hp)
    assert r.per_set[()] == pytest.approx(2 / 3)
    assert r.information[()] == pytest.approx(2 / 3)
    assert r.per_set[("lr",)] == 0.0
    assert r.entropy[("lr",)] == pytest.approx(1 / 3)
    assert h2(1 / 4) == pytest.approx(2 - 0.75 * LOG2_3)
    assert r.entropy[("width",)] == pytest.approx(1 / 3 + (2 / 3) * h2(1 / 4))
    assert r.information[("width",)] == pytest.approx(1 / 3 + (2 / 3) * h2(1 / 4))
    assert r.per_set[("width",)] == 1.0
    assert math.isnan(r.per_set[("lr", "width")])
    assert r.entropy[("lr", "width")] == 0.0
    assert (r.score, r.condition, r.n_pairs) == (0.0, ("lr",), 12)
    assert "H(V_t | U_S) = 0 for S = {lr, width}" in r.note
    # the competition's loop (pairs of hyperparameters only) has nothing defined here
    comp = stats.cmi_score(t, s, hp, 2, min_condition=2)
    assert math.isnan(comp.score) and comp.condition is None
    assert "every conditioning set decides the gap order" in comp.note
    # only the unconditional set
    assert stats.cmi_score(t, s, hp, 0).score == pytest.approx(2 / 3)


def test_cmi_drops_pairs_with_equal_gaps_and_keeps_measure_ties_by_hand():
    # t = (1, 1, 2), s = (1, 2, 3), no hyperparameters (S = ∅ only).
    # Pairs (1,2), (2,1) have equal gaps: dropped (nothing to order; the measure's opinion on
    # them is not scored). Remaining: (1,3) (−,−), (3,1) (+,+), (2,3) (−,−), (3,2) (+,+):
    # V_s = V_t on all 4 → I = H = 1 bit → score 1.
    r = stats.cmi_score([1, 1, 2], [1, 2, 3], {})
    assert (r.score, r.condition, r.n_pairs) == (1.0, (), 4)
    # t = (1, 2, 3), s = (1, 1, 1): a constant measure is V_s = 0 on every pair → I = 0 → 0
    # (defined, not nan: the gap order is there, the measure says nothing about it).
    r = stats.cmi_score([1, 2, 3], [1, 1, 1], {})
    assert (r.score, r.n_pairs) == (0.0, 6)


# ----------------------------------------------------------------- hand-computed: granulated


def test_granulated_kendall_incomplete_grid_by_hand():
    # model  lr  width  t  s
    #   1     1    s    1  1
    #   2     2    s    3  2
    #   3     3    s    2  3
    #   4     1    l    4  5
    #   5     2    l    5  4
    # ψ_lr: groups by width. width = s: models 1,2,3; pairs (1,2): Δt +, Δs + → +1;
    #   (1,3): +, + → +1; (2,3): Δt −, Δs + → −1; τ = (1 + 1 − 1)/3 = 1/3.
    #   width = l: models 4,5: Δt +, Δs − → τ = −1.  ψ_lr = (1/3 − 1)/2 = −1/3 (2 groups).
    # ψ_width: groups by lr. lr = 1: models 1,4: Δt +, Δs + → 1; lr = 2: models 2,5: +, + → 1;
    #   lr = 3: model 3 alone, one value of width → skipped.  ψ_width = 1 (2 groups).
    # Ψ = (−1/3 + 1)/2 = 1/3.
    t = [1, 3, 2, 4, 5]
    s = [1, 2, 3, 5, 4]
    hp = {"lr": [1, 2, 3, 1, 2], "width": ["s", "s", "s", "l", "l"]}
    out = stats.granulated_kendall(t, s, hp)
    assert out["psi"]["lr"] == pytest.approx(-1 / 3)
    assert out["psi"]["width"] == 1.0
    assert out["Psi"] == pytest.approx(1 / 3)
    assert out["n_groups"] == {"lr": 2, "width": 2}


def test_granulated_kendall_on_the_cmi_grid_by_hand():
    # The grid of the lr-tracking measure above (t = 1..4, s = 1, 1, 2, 2).
    # ψ_lr: width = 1: models 1,3: Δt +, Δs + → 1; width = 2: models 2,4: +, + → 1 → ψ_lr = 1.
    # ψ_width: lr = a: models 1,2: Δs = 0 → τ-a = 0; lr = b: 0 → ψ_width = 0.  Ψ = 1/2.
    # τ-b leaves the all-tied groups out: ψ_width undefined, Ψ = ψ_lr = 1.
    t, s = [1, 2, 3, 4], [1, 1, 2, 2]
    hp = {"lr": ["a", "a", "b", "b"], "width": [1, 2, 1, 2]}
    out = stats.granulated_kendall(t, s, hp)
    assert (out["psi"], out["Psi"]) == ({"lr": 1.0, "width": 0.0}, 0.5)
    out_b = stats.granulated_kendall(t, s, hp, stat="b")
    assert math.isnan(out_b["psi"]["width"]) and out_b["Psi"] == 1.0


def test_granulated_kendall_constant_and_missing_hyperparameters():
    # A hyperparameter with one value has no group in which it varies: ψ = nan, and Ψ is the
    # mean over the hyperparameters that vary.
    t, s = [1, 2, 3, 4], [1, 2, 4, 3]
    out = stats.granulated_kendall(t, s, {"lr": [1, 1, 2, 2], "opt": ["sgd"] * 4})
    assert math.isnan(out["psi"]["opt"]) and out["n_groups"]["opt"] == 0
    assert out["psi"]["lr"] == pytest.approx(stats.kendall_tau_a(t, s))
    assert out["Psi"] == out["psi"]["lr"]
    # Missing values (None, NaN of any float type) are one value, not one value per model.
    wd = [float("nan"), np.float64("nan"), None, 0.1]
    out = stats.granulated_kendall(t, s, {"wd": wd})
    assert out["psi"]["wd"] == pytest.approx(stats.kendall_tau_a(t, s))
    by_hand = stats.granulated_kendall(t, s, {"wd": [0, 0, 0, 0.1]})
    assert out == by_hand


# ------------------------------------------------------------------------------- properties


def grid_population(seed: int, replicates: int = 2, ties: bool = False):
    """A 2 × 3 × 2 grid with replicates; gaps depend on the hyperparameters plus noise."""
    rng = np.random.default_rng(seed)
    cells = list(itertools.product([0.1, 0.01], [1, 2, 3], ["sgd", "adam"])) * replicates
    hp = {
        "lr": [c[0] for c in cells],
        "depth": [c[1] for c in cells],
        "opt": [c[2] for c in cells],
    }
    t = np.array([10 * c[0] + 0.3 * c[1] + (c[2] == "adam") for c in cells])
    t = t + rng.normal(scale=0.5, size=len(cells))
    s = t + rng.normal(scale=1.0, size=len(cells))
    if ties:
        t, s = np.round(t), np.round(s)
    return t, s, hp


@pytest.mark.parametrize("seed", [0, 1])
def test_a_measure_equal_to_the_gap_scores_one(seed):
    t, _, hp = grid_population(seed, ties=seed == 1)
    r = stats.cmi_score(t, t, hp)
    assert r.score == 1.0
    assert all(v == 1.0 for v in r.per_set.values() if math.isfinite(v))
    assert r.information == r.entropy
    assert stats.granulated_kendall(t, t, hp, stat="b")["Psi"] == 1.0


def test_a_measure_independent_of_the_gap_scores_zero():
    # t = (1, 2, 3, 4), s = (2, 4, 1, 3): unordered pairs (1,2) conc., (1,3) disc., (1,4) conc.,
    # (2,3) disc., (2,4) disc., (3,4) conc. → 3 and 3 (τ = 0). Ordered: each concordant pair
    # gives (+,+) and (−,−), each discordant one (+,−) and (−,+): the 2 × 2 table is 3/3/3/3,
    # p(V_t, V_s) = p(V_t) p(V_s) = 1/4 everywhere → I = 0 exactly.
    t, s = [1, 2, 3, 4], [2, 4, 1, 3]
    assert stats.kendall_tau_a(t, s) == 0.0
    r = stats.cmi_score(t, s, {})
    assert (r.score, r.information[()], r.entropy[()]) == (0.0, 0.0, 1.0)
    # With hyperparameters the unconditional set is among the candidates: the minimum is 0.
    r = stats.cmi_score(t, s, {"lr": [1, 1, 2, 2]})
    assert (r.score, r.condition) == (0.0, ())


@pytest.mark.parametrize("seed", [2, 3])
def test_only_the_order_of_the_measure_matters(seed):
    t, s, hp = grid_population(seed, ties=seed == 3)
    base = stats.cmi_score(t, s, hp)
    assert 0.0 < base.score < 1.0
    for transform in (np.exp, lambda x: x**3 + 5.0, lambda x: 2.0 * x - 7.0):
        assert stats.cmi_score(t, transform(s), hp) == base
        assert stats.granulated_kendall(t, transform(s), hp) == stats.granulated_kendall(t, s, hp)
    # The CMI score cannot see the direction: a decreasing transform leaves it unchanged ...
    # (same counts with the measure's two signs swapped; sums in another order, so to 1e-12)
    flipped_cmi = stats.cmi_score(t, -s, hp)
    assert flipped_cmi.condition == base.condition
    assert flipped_cmi.per_set == pytest.approx(base.per_set, abs=1e-12)
    assert stats.cmi_score(t, -t, hp).score == 1.0
    # ... while granulated τ changes sign.
    plain = stats.granulated_kendall(t, s, hp)
    flipped = stats.granulated_kendall(t, -s, hp)
    assert flipped["Psi"] == pytest.approx(-plain["Psi"])


@pytest.mark.parametrize("stat", ["a", "b"])
def test_granulated_tau_is_plain_tau_when_one_hyperparameter_varies(stat):
    rng = np.random.default_rng(4)
    t = np.round(rng.normal(size=15), 1)  # ties in the gap
    s = np.round(t + rng.normal(size=15), 1)
    lr = rng.choice([0.1, 0.01, 0.001], size=15)
    plain = stats.kendall_tau_a(t, s) if stat == "a" else stats.kendall_tau_b(t, s)
    one = stats.granulated_kendall(t, s, {"lr": lr}, stat=stat)
    assert one["psi"]["lr"] == pytest.approx(plain) and one["Psi"] == pytest.approx(plain)
    # a second hyperparameter that never changes does not split the population
    two = stats.granulated_kendall(t, s, {"lr": lr, "opt": ["sgd"] * 15}, stat=stat)
    assert two["Psi"] == pytest.approx(plain) and two["n_groups"] == {"lr": 1, "opt": 0}


def cmi_pair_by_pair(t, s, hp, max_condition=2):
    """The definition read literally: loop over ordered pairs, count, natural logarithms."""
    names = list(hp)
    out = {}
    for size in range(max_condition + 1):
        for subset in itertools.combinations(names, size):
            joint: Counter = Counter()
            for i, j in itertools.permutations(range(len(t)), 2):
                if t[i] == t[j]:
                    continue
                u = tuple((hp[h][i], hp[h][j]) for h in subset)
                joint[u, np.sign(t[i] - t[j]), np.sign(s[i] - s[j])] += 1
            n = sum(joint.values())
            n_u, n_ut, n_us = Counter(), Counter(), Counter()
            for (u, a, b), c in joint.items():
                n_u[u] += c
                n_ut[u, a] += c
                n_us[u, b] += c
            info = sum(
                c / n * math.log(c * n_u[u] / (n_ut[u, a] * n_us[u, b]))
                for (u, a, b), c in joint.items()
            )
            ent = sum(c / n * math.log(n_u[u] / c) for (u, _), c in n_ut.items())
            out[subset] = info / ent if ent > 1e-12 else math.nan
    return out


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_cmi_agrees_with_a_pair_by_pair_count(seed):
    t, s, hp = grid_population(seed, replicates=1 + seed % 2, ties=seed != 5)
    expected = cmi_pair_by_pair(t, s, hp)
    r = stats.cmi_score(t, s, hp)
    assert set(r.per_set) == set(expected)
    for subset, value in expected.items():
        if math.isnan(value):
            assert math.isnan(r.per_set[subset])
        else:
            assert r.per_set[subset] == pytest.approx(value, abs=1e-12)
    finite = {k: v for k, v in expected.items() if math.isfinite(v)}
    assert r.score == pytest.approx(min(finite.values()), abs=1e-12)


# ------------------------------------------------------------------- degenerate and errors


def test_cmi_is_nan_with_a_reason_when_undefined():
    r = stats.cmi_score([0.3], [1.0], {"lr": [1]})
    assert math.isnan(r.score) and r.condition is None and not r.defined
    assert "only 1 model(s)" in r.note and set(r.per_set) == {(), ("lr",)}
    assert all(math.isnan(v) for v in r.per_set.values())
    r = stats.cmi_score([0.2, 0.2, 0.2], [1.0, 2.0, 3.0], {"lr": [1, 2, 3]})
    assert math.isnan(r.score) and r.note.startswith("all gaps equal") and r.n_pairs == 0
    # NaN models are dropped first and said so; two models left with different lr:
    # conditioning on lr leaves one pair per stratum (H = 0), S = ∅ orders them correctly.
    r = stats.cmi_score([0.1, np.nan, 0.3], [1.0, 2.0, 3.0], {"lr": [1, 2, 3]})
    assert (r.score, r.condition, r.n_models, r.n_pairs) == (1.0, (), 2, 2)
    assert "1 model(s) dropped" in r.note and "S = {lr}" in r.note
    assert r.defined


def test_cmi_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"hparams\['lr'\] has 2 values"):
        stats.cmi_score([1, 2, 3], [1, 2, 3], {"lr": [1, 2]})
    with pytest.raises(ValueError, match="unhashable"):
        stats.cmi_score([1, 2], [1, 2], {"arch": [[1, 2], [3]]})
    with pytest.raises(ValueError, match="min_condition ≤ max_condition"):
        stats.cmi_score([1, 2], [1, 2], {"lr": [1, 2]}, 1, min_condition=2)
    with pytest.raises(ValueError, match="min_condition ≤ max_condition"):
        stats.cmi_score([1, 2], [1, 2], {"lr": [1, 2]}, -1)
    with pytest.raises(ValueError, match="only 1 hyperparameter"):
        stats.cmi_score([1, 2], [1, 2], {"lr": [1, 2]}, 2, min_condition=2)
    with pytest.raises(ValueError, match="t and s must have the same length"):
        stats.cmi_score([1, 2, 3], [1, 2], {})
