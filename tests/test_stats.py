"""geosharp.stats against hand computations, naive double loops and scipy."""

import itertools
import math

import numpy as np
import pytest
from scipy.stats import kendalltau

from geosharp import stats


def naive_tau_a(t, s):
    """The paper's formula, literally: 2/(M(M−1)) Σ_{i<j} sign(t_i − t_j) sign(s_i − s_j)."""
    m = len(t)
    total = sum(
        np.sign(t[i] - t[j]) * np.sign(s[i] - s[j]) for i, j in itertools.combinations(range(m), 2)
    )
    return 2.0 * total / (m * (m - 1))


def correlated(m, noise, seed):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=m)
    return t, t + noise * rng.normal(size=m)


# ---------------------------------------------------------------- hand-computed cases with ties


def test_tau_hand_case_with_ties_in_both():
    # t = [1, 2, 2, 3], s = [1, 3, 2, 2]; pairs (i, j): sign(Δt)·sign(Δs)
    #   (0,1): (−1)(−1) = +1    (0,2): (−1)(−1) = +1    (0,3): (−1)(−1) = +1
    #   (1,2): ( 0)(+1) =  0    (1,3): (−1)(+1) = −1    (2,3): (−1)( 0) =  0
    # Σ = 2 over n0 = 6 pairs → τ-a = 2/6 = 1/3.
    # Ties: n_t = 1 (pair 1,2), n_s = 1 (pair 2,3) → τ-b = 2 / sqrt((6−1)(6−1)) = 2/5.
    t, s = [1, 2, 2, 3], [1, 3, 2, 2]
    assert stats.kendall_tau_a(t, s) == pytest.approx(1 / 3, abs=1e-15)
    assert stats.kendall_tau_b(t, s) == pytest.approx(2 / 5, abs=1e-15)


def test_tau_hand_case_ties_only_in_t():
    # t = [0, 0, 1, 1, 2], s = [5, 4, 3, 2, 1] (s strictly decreasing in index).
    # 10 pairs; the 2 pairs tied in t — (0,1), (2,3) — count 0, the other 8 are discordant.
    # τ-a = −8/10 = −0.8;  τ-b = −8 / sqrt((10 − 2)(10 − 0)) = −8/sqrt(80) = −0.894427...
    t, s = [0, 0, 1, 1, 2], [5, 4, 3, 2, 1]
    assert stats.kendall_tau_a(t, s) == pytest.approx(-0.8, abs=1e-15)
    assert stats.kendall_tau_b(t, s) == pytest.approx(-8 / math.sqrt(80), abs=1e-15)


def test_tau_a_equals_tau_b_without_ties():
    rng = np.random.default_rng(1)
    t, s = rng.normal(size=30), rng.normal(size=30)
    assert stats.kendall_tau_a(t, s) == pytest.approx(stats.kendall_tau_b(t, s), abs=1e-15)


# ------------------------------------------------------------------------- references


@pytest.mark.parametrize("seed", range(5))
def test_tau_a_matches_naive_double_loop(seed):
    rng = np.random.default_rng(seed)
    m = 37
    t = rng.integers(0, 6, size=m).astype(float)  # many ties
    s = rng.integers(0, 4, size=m) + 0.5 * (t > 2)
    # float sums of ±1/0 over 666 pairs are exact, so equality up to one rounding
    assert stats.kendall_tau_a(t, s) == pytest.approx(naive_tau_a(t, s), abs=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_tau_b_matches_scipy_with_ties(seed):
    rng = np.random.default_rng(100 + seed)
    m = 50
    t = rng.integers(0, 5, size=m)
    s = rng.integers(0, 7, size=m) + t
    expected = kendalltau(t, s, variant="b").statistic
    # scipy works from the same integer counts; differences are a few ulps
    assert stats.kendall_tau_b(t, s) == pytest.approx(expected, abs=1e-12)


def test_infinite_values_rank_at_the_ends():
    t = [1.0, 2.0, 3.0, 4.0]
    s = [-np.inf, 0.0, 1.0, np.inf]
    assert stats.kendall_tau_a(t, s) == 1.0
    assert stats.kendall_tau_b(t, s) == 1.0


def test_nan_pairs_are_dropped():
    t = [1.0, 2.0, np.nan, 3.0, 4.0]
    s = [1.0, 2.0, 5.0, np.nan, 3.0]
    assert stats.kendall_tau_a(t, s) == stats.kendall_tau_a([1, 2, 4], [1, 2, 3]) == 1.0
    summary = stats.correlation_summary(t, s, n_boot=50, n_perm=50)
    assert summary.n_models == 3 and summary.n_dropped == 2
    assert "2 model(s) dropped" in summary.note


# ----------------------------------------------------------------------------- degenerate


def test_all_equal_gaps_are_undefined_not_an_error():
    t = [0.2] * 6
    s = [1, 2, 3, 4, 5, 6]
    assert math.isnan(stats.kendall_tau_a(t, s))
    assert math.isnan(stats.kendall_tau_b(t, s))
    assert all(math.isnan(x) for x in stats.bootstrap_ci(t, s, n_boot=10))
    assert math.isnan(stats.permutation_pvalue(t, s, n_perm=10))
    summary = stats.correlation_summary(t, s)
    assert not summary.defined
    assert summary.note == "all gaps equal: τ undefined"
    assert all(math.isnan(x) for x in (summary.tau_a, summary.tau_b, summary.p_value))


def test_constant_sharpness_and_tiny_populations_are_undefined():
    assert math.isnan(stats.kendall_tau_b([1, 2, 3], [7, 7, 7]))
    assert "sharpness values equal" in stats.correlation_summary([1, 2, 3], [7, 7, 7]).note
    assert math.isnan(stats.kendall_tau_a([1.0], [2.0]))
    assert math.isnan(stats.kendall_tau_a([], []))
    summary = stats.correlation_summary([1, 2], [1, 2], min_models=3)
    assert not summary.defined and "need ≥ 3" in summary.note


# ------------------------------------------------------------------------------ bootstrap


def test_bootstrap_ci_contains_estimate_and_shrinks_with_m():
    widths = []
    for m in (20, 80, 320):
        t, s = correlated(m, noise=1.0, seed=m)
        tau = stats.kendall_tau_a(t, s)
        low, high = stats.bootstrap_ci(t, s, n_boot=1000, seed=0)
        assert low <= tau <= high, (m, low, tau, high)
        widths.append(high - low)
    # the CI of a U-statistic narrows like 1/sqrt(M): ×4 models ≈ ×0.5 width; allow slack
    assert widths[0] > 1.4 * widths[1] > 1.4**2 * widths[2], widths


def test_bootstrap_tau_b_and_level():
    t, s = correlated(40, noise=1.0, seed=3)
    tau_b = stats.kendall_tau_b(t, s)
    low90, high90 = stats.bootstrap_ci(t, s, "b", n_boot=1000, level=0.9)
    low99, high99 = stats.bootstrap_ci(t, s, "b", n_boot=1000, level=0.99)
    assert low99 <= low90 <= tau_b <= high90 <= high99


def resampled_tau_a(t, s, idx):
    """τ-a of a resample over pairs of draws of two *different* models (see bootstrap_ci)."""
    pairs = [(p, q) for p, q in itertools.combinations(range(len(idx)), 2) if idx[p] != idx[q]]
    ti, si = t[idx], s[idx]
    if len(set(ti)) < 2 or len(set(si)) < 2:
        return math.nan
    total = sum(np.sign(ti[p] - ti[q]) * np.sign(si[p] - si[q]) for p, q in pairs)
    return total / len(pairs)


def test_bootstrap_matches_explicit_resampling():
    # The count-vector formulas (cᵀSc etc.) must equal recomputing τ on the resampled arrays.
    t, s = correlated(15, noise=0.7, seed=4)
    t = np.round(t, 1)  # ties
    idx = np.random.default_rng(9).integers(0, t.size, size=(200, t.size))
    expected = {
        "a": [resampled_tau_a(t, s, i) for i in idx],
        "b": [stats.kendall_tau_b(t[i], s[i]) for i in idx],  # duplicates tie in t and s
    }
    for stat in ("a", "b"):
        taus = stats.tau._bootstrap_taus(t, s, stat, 200, np.random.default_rng(9))
        np.testing.assert_allclose(taus, expected[stat], rtol=0, atol=1e-12)


def test_bootstrap_is_centred_for_strong_correlation():
    # τ-a = 0.94 at M = 12. Counting two draws of one model as a tie would shrink the mean
    # resampled τ-a by ~(1 − 1/M) to ≈ 0.86 and could push the interval off the estimate;
    # leaving those pairs out keeps the mean within 0.02 (≈ one pair-step, 2/(M(M−1)) = 0.015,
    # plus Monte Carlo error of 2000 resamples, sd ≈ 0.05/sqrt(2000)).
    t, s = correlated(12, noise=0.3, seed=11)
    tau = stats.kendall_tau_a(t, s)
    assert 0.9 < tau < 1.0
    taus = stats.tau._bootstrap_taus(t, s, "a", 2000, np.random.default_rng(0))
    assert abs(np.nanmean(taus) - tau) < 0.02
    low, high = stats.bootstrap_ci(t, s)
    assert low <= tau <= high


def test_bootstrap_and_permutation_are_reproducible():
    t, s = correlated(25, noise=2.0, seed=5)
    assert stats.bootstrap_ci(t, s, seed=7) == stats.bootstrap_ci(t, s, seed=7)
    assert stats.bootstrap_ci(t, s, seed=7) != stats.bootstrap_ci(t, s, seed=8)
    assert stats.permutation_pvalue(t, s, seed=7) == stats.permutation_pvalue(t, s, seed=7)


# ---------------------------------------------------------------------------- permutation


def test_permutation_pvalue_small_for_strong_correlation():
    t, s = correlated(40, noise=0.3, seed=6)
    p = stats.permutation_pvalue(t, s, n_perm=2000)
    # τ ≈ 0.8 at M = 40 is ~7 null standard deviations: no permutation reaches it
    assert p < 0.01
    assert p == pytest.approx(1 / 2001)


def test_permutation_pvalue_roughly_uniform_under_independence():
    rng = np.random.default_rng(7)
    ps = [
        stats.permutation_pvalue(rng.normal(size=20), rng.normal(size=20), n_perm=300, seed=k)
        for k in range(40)
    ]
    # Under H0 p ~ U(0, 1): the mean of 40 has sd ≈ 0.29/sqrt(40) ≈ 0.046, so [0.3, 0.7] is
    # more than 4 sd wide on either side.
    assert 0.3 <= np.mean(ps) <= 0.7
    assert all(1 / 301 <= p <= 1 for p in ps)


def test_permutation_pvalue_agrees_between_a_and_b():
    t, s = correlated(20, noise=1.5, seed=8)
    t = np.round(t)
    assert stats.permutation_pvalue(t, s, "a") == stats.permutation_pvalue(t, s, "b")


# ------------------------------------------------------------------------------ granulated


def test_granulated_kendall_on_a_grid_where_s_follows_one_hparam():
    # Grid A ∈ {0, 1, 2} × B ∈ {0, 1}; sharpness s = A depends on A only.
    # Gap: B = 0 → t = (0, 1, 2) over A = 0, 1, 2;  B = 1 → t = (10, 12, 11).
    # ψ_A: group B = 0: s and t both increase → τ = 1.
    #      group B = 1: pairs (A0,A1): (−)(−) = +1, (A0,A2): (−)(−) = +1, (A1,A2): (+)(−) = −1
    #      → τ = 1/3.  ψ_A = (1 + 1/3)/2 = 2/3.
    # ψ_B: groups A = a hold s constant → every pair ties in s → τ-a = 0 → ψ_B = 0
    #      (a measure blind to B earns 0, Jiang et al.'s convention).
    # Ψ = (2/3 + 0)/2 = 1/3.
    a = [0, 1, 2, 0, 1, 2]
    b = [0, 0, 0, 1, 1, 1]
    t = [0, 1, 2, 10, 12, 11]
    s = [float(x) for x in a]
    out = stats.granulated_kendall(t, s, {"A": a, "B": b})
    assert out["psi"]["A"] == pytest.approx(2 / 3)
    assert out["psi"]["B"] == 0.0
    assert out["Psi"] == pytest.approx(1 / 3)
    assert out["n_groups"] == {"A": 2, "B": 3}
    # τ-b skips the all-tied groups instead: ψ_B undefined, Ψ = ψ_A
    out_b = stats.granulated_kendall(t, s, {"A": a, "B": b}, stat="b")
    assert math.isnan(out_b["psi"]["B"])
    assert out_b["Psi"] == pytest.approx(2 / 3)


def test_granulated_kendall_random_search_population_is_undefined():
    out = stats.granulated_kendall([1, 2, 3], [1, 2, 3], {"lr": [1, 2, 3], "wd": [4, 5, 6]})
    assert math.isnan(out["Psi"]) and out["n_groups"] == {"lr": 0, "wd": 0}


def test_granulated_kendall_with_replicates_and_nan():
    # Two seeds of each config sit in one group; one model has a NaN gap and is dropped.
    a = [0, 0, 1, 1]
    t = [0.1, np.nan, 0.3, 0.4]
    s = [1.0, 1.1, 2.0, 2.1]
    out = stats.granulated_kendall(t, s, {"A": a})
    # single hyperparameter → one group holding the 3 remaining models, all concordant
    assert out["psi"]["A"] == 1.0


# ---------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_with_the_argument_names():
    with pytest.raises(ValueError, match="t and s must have the same length"):
        stats.kendall_tau_a([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="t must be 1-D"):
        stats.kendall_tau_b([[1, 2], [3, 4]], [1, 2])
    with pytest.raises(ValueError, match="s must be a 1-D sequence of numbers"):
        stats.kendall_tau_a([1, 2], ["a", "b"])
    with pytest.raises(ValueError, match="stat must be"):
        stats.bootstrap_ci([1, 2, 3], [1, 2, 3], stat="c")
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap_ci([1, 2, 3], [1, 2, 3], level=95)
    with pytest.raises(ValueError, match="n_perm"):
        stats.permutation_pvalue([1, 2, 3], [1, 2, 3], n_perm=0)
    with pytest.raises(ValueError, match=r"hparams\['lr'\] has 2 values"):
        stats.granulated_kendall([1, 2, 3], [1, 2, 3], {"lr": [1, 2]})
    with pytest.raises(ValueError, match="hparams is empty"):
        stats.granulated_kendall([1, 2, 3], [1, 2, 3], {})


# ------------------------------------------------------------------------- paired τ difference


def test_tau_difference_matches_explicit_paired_resampling():
    t, s1 = correlated(14, noise=0.4, seed=5)
    s2 = t + 1.5 * np.random.default_rng(6).normal(size=t.size)
    t = np.round(t, 1)  # ties in the gap
    res = stats.tau_difference(t, s1, s2, n_boot=300, seed=3)
    assert res.diff == pytest.approx(stats.kendall_tau_a(t, s1) - stats.kendall_tau_a(t, s2))
    idx = np.random.default_rng(3).integers(0, t.size, size=(300, t.size))
    diffs = [resampled_tau_a(t, s1, i) - resampled_tau_a(t, s2, i) for i in idx]
    low, high = np.quantile(diffs, [0.025, 0.975])
    assert (res.ci_low, res.ci_high) == pytest.approx((low, high), abs=1e-12)
    assert res.n_models == 14 and res.ci_low <= res.diff <= res.ci_high


def test_tau_difference_is_tighter_than_separate_intervals_and_handles_nan():
    # s2 is s1 with one pair of models swapped: the two τ differ by little, but always.
    t = np.arange(30.0)
    s1 = t + np.random.default_rng(0).normal(scale=8, size=30)
    s2 = s1.copy()
    i, j = np.argsort(s1)[[10, 11]]
    s2[i], s2[j] = s1[j], s1[i]
    res = stats.tau_difference(t, s1, s2, n_boot=500)
    separate = stats.bootstrap_ci(t, s1, n_boot=500)
    assert res.ci_high - res.ci_low < 0.2 * (separate[1] - separate[0])
    s2[0] = np.nan
    assert stats.tau_difference(t, s1, s2, n_boot=50).n_models == 29
    undefined = stats.tau_difference(t, s1, np.ones(30), n_boot=50)
    assert math.isnan(undefined.diff) and math.isnan(undefined.ci_low)
    with pytest.raises(ValueError, match="one entry per model"):
        stats.tau_difference(t, s1, s2[:5])
