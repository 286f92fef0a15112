"""Kendall's τ between a measure and the generalization gap, its CIs and tests (SPEC §2, §7).

τ-a and the tie-corrected τ-b from integer sign counts, a percentile-bootstrap CI over models, a
two-sided permutation p-value, and the paired difference of two measures' τ with its paired
bootstrap CI; the summary a study reports of them is :mod:`~geosharp.stats.summary`'s. The
conventions are :mod:`geosharp.stats`'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.stats import rankdata

__all__ = [
    "TauDifference",
    "bootstrap_ci",
    "kendall_tau_a",
    "kendall_tau_b",
    "permutation_pvalue",
    "tau_difference",
]

Stat = Literal["a", "b"]

# Largest number of int8 entries one vectorised batch may allocate (~32 MiB).
_BATCH_ENTRIES = 1 << 25


# --------------------------------------------------------------------------------------------
# input handling


def _as_vector(x: object, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a 1-D sequence of numbers; got {x!r:.80}") from err
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got an array of shape {arr.shape}")
    return arr


def _paired(t: object, s: object, names: tuple[str, str] = ("t", "s")) -> tuple[np.ndarray, ...]:
    """Validate ``t`` and ``s``, drop NaN pairs; returns ``(t, s, keep_mask)``."""
    tt = _as_vector(t, names[0])
    ss = _as_vector(s, names[1])
    if tt.shape != ss.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same length (one entry per model); "
            f"got {tt.size} and {ss.size}"
        )
    keep = ~(np.isnan(tt) | np.isnan(ss))
    return tt[keep], ss[keep], keep


def _check_boot(n_boot: int, level: float) -> None:
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be ≥ 1; got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), e.g. 0.95; got {level}")


def _check_stat(stat: str) -> None:
    if stat not in ("a", "b"):
        raise ValueError(f"stat must be 'a' (τ-a) or 'b' (τ-b); got {stat!r}")


def _sign_matrix(x: np.ndarray) -> np.ndarray:
    """``sign(x_i − x_j)`` as int8, computed on ranks so that ±inf compare correctly."""
    r = rankdata(x, method="dense").astype(np.int64)
    return np.sign(r[:, None] - r[None, :]).astype(np.int8)


@dataclass(frozen=True)
class _Pairs:
    """Integer pair counts from which τ-a and τ-b follow (all over unordered pairs i < j)."""

    m: int
    concordance: int  # Σ_{i<j} sign(Δt) sign(Δs)  (concordant − discordant)
    ties_t: int  # pairs with t_i = t_j
    ties_s: int  # pairs with s_i = s_j

    @property
    def total(self) -> int:
        return self.m * (self.m - 1) // 2

    @property
    def defined(self) -> bool:
        return self.m >= 2 and self.ties_t < self.total and self.ties_s < self.total

    def tau(self, stat: Stat) -> float:
        if not self.defined:
            return math.nan
        if stat == "a":
            return self.concordance / self.total
        return self.concordance / math.sqrt((self.total - self.ties_t) * (self.total - self.ties_s))


def _pairs(t: np.ndarray, s: np.ndarray) -> _Pairs:
    m = t.size
    if m < 2:
        return _Pairs(m, 0, 0, 0)
    st, ss = _sign_matrix(t), _sign_matrix(s)
    # Full-matrix sums count every unordered pair twice; the diagonal contributes 0 / m.
    concordance = int(np.sum(st * ss, dtype=np.int64)) // 2
    ties_t = (int(np.count_nonzero(st == 0)) - m) // 2
    ties_s = (int(np.count_nonzero(ss == 0)) - m) // 2
    return _Pairs(m, concordance, ties_t, ties_s)


# --------------------------------------------------------------------------------------------
# point estimates


def kendall_tau_a(t: Sequence[float] | np.ndarray, s: Sequence[float] | np.ndarray) -> float:
    """Kendall's τ-a, the coefficient the paper reports (SPEC §2).

    ``τ_a = 2 / (M (M − 1)) Σ_{i<j} sign(t_i − t_j) sign(s_i − s_j)``; tied pairs count 0.
    Vectorised O(M²) in time and memory (fine for M up to a few thousand).

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).

    Returns:
        τ-a in [−1, 1]; ``nan`` if undefined (fewer than two models after dropping NaN pairs,
        or all ``t`` equal, or all ``s`` equal).

    Raises:
        ValueError: If ``t`` and ``s`` are not 1-D numeric sequences of the same length.

    Example:
        >>> kendall_tau_a([1, 2, 3], [1, 3, 2])
        0.3333333333333333
    """
    tt, ss, _ = _paired(t, s)
    return _pairs(tt, ss).tau("a")


def kendall_tau_b(t: Sequence[float] | np.ndarray, s: Sequence[float] | np.ndarray) -> float:
    """Kendall's tie-corrected τ-b (equal to ``scipy.stats.kendalltau(t, s, variant="b")``).

    ``τ_b = Σ_{i<j} sign(Δt) sign(Δs) / sqrt((n₀ − n_t)(n₀ − n_s))`` with ``n₀ = M(M−1)/2`` and
    ``n_t``, ``n_s`` the numbers of pairs tied in ``t`` and in ``s``. Without ties τ-b = τ-a.

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).

    Returns:
        τ-b in [−1, 1]; ``nan`` if undefined (fewer than two models, all ``t`` equal or all
        ``s`` equal). Never raises for degenerate data.

    Raises:
        ValueError: If ``t`` and ``s`` are not 1-D numeric sequences of the same length.

    Example:
        >>> kendall_tau_b([1, 2, 2, 3], [1, 3, 2, 2])
        0.4
    """
    tt, ss, _ = _paired(t, s)
    return _pairs(tt, ss).tau("b")


# --------------------------------------------------------------------------------------------
# uncertainty


def bootstrap_ci(
    t: Sequence[float] | np.ndarray,
    s: Sequence[float] | np.ndarray,
    stat: Stat = "a",
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of τ over models.

    Each resample draws ``M`` model indices with replacement and recomputes τ on the resampled
    population; the interval is the ``(1 ∓ level)/2`` percentiles of the resampled τ.
    Resamples where τ is undefined (e.g. every drawn model has the same gap) are ignored.

    Two draws of the same model are not a comparison between two models, so such pairs are
    left out of the resampled τ-a (numerator and denominator alike). Counting them as ties
    would shrink every resampled τ-a towards 0 by about ``1 − 1/M`` and, for strong
    correlations, push the interval off the estimate (at M = 12 and τ-a = −0.97 the naive
    interval was [−0.95, −0.76]). τ-b drops these pairs by construction (they are tied in both
    ``t`` and ``s``).

    All resamples are evaluated together as ``cᵀ S c`` with ``c`` the per-model draw counts and
    ``S`` the M × M concordance matrix (O(n_boot · M²) flops in BLAS).

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).
        stat: ``"a"`` for τ-a, ``"b"`` for τ-b.
        n_boot: Number of bootstrap resamples (≥ 1).
        level: Coverage of the interval, in (0, 1).
        seed: Seed of the numpy generator; the result is deterministic given it.

    Returns:
        ``(low, high)``; ``(nan, nan)`` if τ is undefined on the data or on every resample.

    Raises:
        ValueError: On bad inputs, ``stat``, ``n_boot`` or ``level``.

    Example:
        >>> low, high = bootstrap_ci([1, 2, 3, 4, 5, 6], [1, 2, 3, 5, 4, 6], n_boot=500)
        >>> bool(low <= kendall_tau_a([1, 2, 3, 4, 5, 6], [1, 2, 3, 5, 4, 6]) <= high)
        True
    """
    _check_stat(stat)
    _check_boot(n_boot, level)
    tt, ss, _ = _paired(t, s)
    if not _pairs(tt, ss).defined:
        return (math.nan, math.nan)
    taus = _bootstrap_taus(tt, ss, stat, int(n_boot), np.random.default_rng(seed))
    taus = taus[np.isfinite(taus)]
    if taus.size == 0:
        return (math.nan, math.nan)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(taus, [alpha, 1.0 - alpha])
    return (float(low), float(high))


def _bootstrap_taus(
    t: np.ndarray, s: np.ndarray, stat: Stat, n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    m = t.size
    st, ss = _sign_matrix(t), _sign_matrix(s)
    conc = (st * ss).astype(np.float64)  # concordance of each ordered pair; 0 on the diagonal
    eq_t = (st == 0).astype(np.float64)  # includes the diagonal (a model tied with itself)
    eq_s = (ss == 0).astype(np.float64)
    idx = rng.integers(0, m, size=(n_boot, m))
    out = np.empty(n_boot)
    total = m * (m - 1) / 2.0
    chunk = max(1, _BATCH_ENTRIES // (8 * m * 3))
    for start in range(0, n_boot, chunk):
        rows = idx[start : start + chunk]
        k = rows.shape[0]
        # counts[b, i] = how often model i was drawn in resample b
        counts = np.bincount((rows + m * np.arange(k)[:, None]).ravel(), minlength=k * m)
        counts = counts.reshape(k, m).astype(np.float64)
        conc_b = np.einsum("bi,bi->b", counts @ conc, counts) / 2.0
        # pairs of distinct draws tied in t: (Σ_ij c_i c_j [t_i = t_j] − m) / 2
        ties_t = (np.einsum("bi,bi->b", counts @ eq_t, counts) - m) / 2.0
        ties_s = (np.einsum("bi,bi->b", counts @ eq_s, counts) - m) / 2.0
        defined = (ties_t < total - 0.5) & (ties_s < total - 0.5)
        if stat == "a":
            # pairs of two draws of one model: Σ_i c_i (c_i − 1) / 2
            self_pairs = (np.einsum("bi,bi->b", counts, counts) - m) / 2.0
            with np.errstate(invalid="ignore", divide="ignore"):
                tau = conc_b / (total - self_pairs)
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                tau = conc_b / np.sqrt((total - ties_t) * (total - ties_s))
        out[start : start + k] = np.where(defined, tau, np.nan)
    return out


def permutation_pvalue(
    t: Sequence[float] | np.ndarray,
    s: Sequence[float] | np.ndarray,
    stat: Stat = "a",
    n_perm: int = 2000,
    seed: int = 0,
) -> float:
    """Two-sided permutation p-value of τ against "sharpness is unrelated to the gap".

    ``p = (1 + #{|τ_perm| ≥ |τ_obs|}) / (1 + n_perm)`` with ``τ_perm`` computed after randomly
    permuting ``s`` relative to ``t``. Permuting leaves the tie structure of ``t`` and ``s``
    unchanged, so τ-a and τ-b differ from the concordance count by the same constant and give
    the same p-value; the comparison is done on exact integer counts.

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).
        stat: ``"a"`` or ``"b"`` (identical p-values, see above; kept for symmetry with
            :func:`bootstrap_ci`).
        n_perm: Number of random permutations (≥ 1).
        seed: Seed of the numpy generator; the result is deterministic given it.

    Returns:
        The p-value in ``[1/(1 + n_perm), 1]``; ``nan`` if τ is undefined.

    Raises:
        ValueError: On bad inputs, ``stat`` or ``n_perm``.

    Example:
        >>> p = permutation_pvalue(range(10), range(10), n_perm=999)
        >>> p < 0.01
        True
    """
    _check_stat(stat)
    if int(n_perm) < 1:
        raise ValueError(f"n_perm must be ≥ 1; got {n_perm}")
    n_perm = int(n_perm)
    tt, ss, _ = _paired(t, s)
    pairs = _pairs(tt, ss)
    if not pairs.defined:
        return math.nan
    m = tt.size
    st, s_sign = _sign_matrix(tt), _sign_matrix(ss)
    observed = abs(2 * pairs.concordance)  # full-matrix concordance
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((n_perm, m)), axis=1)
    chunk = max(1, _BATCH_ENTRIES // (m * m))
    hits = 0
    for start in range(0, n_perm, chunk):
        p = perms[start : start + chunk]
        permuted = s_sign[p[:, :, None], p[:, None, :]]  # (k, m, m): sign(s_π(i) − s_π(j))
        conc = np.sum(permuted * st, axis=(1, 2), dtype=np.int64)
        hits += int(np.count_nonzero(np.abs(conc) >= observed))
    return (1 + hits) / (1 + n_perm)


# --------------------------------------------------------------------------------------------
# comparing two measures on one population


@dataclass(frozen=True)
class TauDifference:
    """``τ_a(s₁) − τ_a(s₂)`` on the same models, with a paired bootstrap CI.

    Attributes:
        diff: The difference of the two τ-a.
        ci_low: Lower end of its percentile-bootstrap CI.
        ci_high: Upper end.
        n_models: Models with finite gap and both sharpness values.
        level: Coverage of the CI.
    """

    diff: float
    ci_low: float
    ci_high: float
    n_models: int
    level: float


def tau_difference(
    t: Sequence[float] | np.ndarray,
    s1: Sequence[float] | np.ndarray,
    s2: Sequence[float] | np.ndarray,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> TauDifference:
    """Is measure 1 more correlated with the gap than measure 2 on *these* models?

    Two τ computed on one population are not independent: their CIs overlap even when one
    measure is consistently better. The paired bootstrap resamples the models once per
    replicate and recomputes both τ-a on the same draw, so the interval is that of the
    difference (self-pairs of a model drawn twice are left out, as in :func:`bootstrap_ci`).
    A CI that excludes 0 says the difference is not an accident of which models were trained.

    Args:
        t: Generalization gap of each model.
        s1: First sharpness measure of each model.
        s2: Second sharpness measure of each model (same models, same order).
        n_boot: Bootstrap resamples (≥ 1).
        level: Coverage of the interval, in (0, 1).
        seed: Seed of the numpy generator.

    Returns:
        A :class:`TauDifference` (all ``nan`` if either τ is undefined on the data).

    Raises:
        ValueError: On inputs of different lengths, bad ``n_boot`` or ``level``.

    Example:
        >>> t = [1, 2, 3, 4, 5, 6, 7, 8]
        >>> d = tau_difference(t, [8, 7, 6, 5, 4, 3, 2, 1], [1, 3, 2, 5, 4, 7, 6, 8], n_boot=500)
        >>> round(d.diff, 3), d.ci_high < 0
        (-1.786, True)
    """
    _check_boot(n_boot, level)
    tt, a, b = (_as_vector(x, n) for x, n in ((t, "t"), (s1, "s1"), (s2, "s2")))
    if not tt.shape == a.shape == b.shape:
        raise ValueError(
            f"t, s1 and s2 must have one entry per model; got {tt.size}, {a.size} and {b.size}"
        )
    keep = ~(np.isnan(tt) | np.isnan(a) | np.isnan(b))
    tt, a, b = tt[keep], a[keep], b[keep]
    m = int(tt.size)
    p1, p2 = _pairs(tt, a), _pairs(tt, b)
    if not (p1.defined and p2.defined):
        return TauDifference(math.nan, math.nan, math.nan, m, level)
    diff = p1.tau("a") - p2.tau("a")
    st, s1, s2 = _sign_matrix(tt), _sign_matrix(a), _sign_matrix(b)
    # τ-a difference of a resample: cᵀ (C₁ − C₂) c / 2 over the distinct-draw pairs.
    conc = (st * s1).astype(np.float64) - (st * s2).astype(np.float64)
    eq_t, eq_1, eq_2 = ((x == 0).astype(np.float64) for x in (st, s1, s2))
    counts = np.zeros((int(n_boot), m))
    idx = np.random.default_rng(seed).integers(0, m, size=(int(n_boot), m))
    np.add.at(counts, (np.arange(int(n_boot))[:, None], idx), 1.0)
    total = m * (m - 1) / 2.0

    def quad(mat: np.ndarray) -> np.ndarray:
        return np.einsum("bi,bi->b", counts @ mat, counts)

    self_pairs = (np.einsum("bi,bi->b", counts, counts) - m) / 2.0
    ties_t, ties_1, ties_2 = ((quad(e) - m) / 2.0 for e in (eq_t, eq_1, eq_2))
    defined = (ties_t < total - 0.5) & (ties_1 < total - 0.5) & (ties_2 < total - 0.5)
    with np.errstate(invalid="ignore", divide="ignore"):
        diffs = quad(conc) / 2.0 / (total - self_pairs)
    diffs = diffs[defined & np.isfinite(diffs)]
    if diffs.size == 0:
        return TauDifference(diff, math.nan, math.nan, m, level)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(diffs, [alpha, 1.0 - alpha])
    return TauDifference(diff, float(low), float(high), m, level)
