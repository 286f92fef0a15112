"""Rank correlation between sharpness and generalization gap across a population (SPEC §2, §7).

The paper measures how well a sharpness measure ``s`` predicts the generalization gap ``t`` of
``M`` trained models by Kendall's τ-a (SPEC §2)::

    τ_a = 2 / (M (M − 1)) · Σ_{i<j} sign(t_i − t_j) · sign(s_i − s_j)

τ < 0 means sharper models generalize better. This module computes τ-a, the tie-corrected τ-b,
a percentile-bootstrap confidence interval over models, a two-sided permutation p-value, and,
for populations with hyperparameter columns, the granulated Kendall coefficient of Jiang et al.
(2020) and the conditional mutual information score of the PGDL competition (SPEC §2.5). It is
pure numpy/scipy.

Conventions shared by every function here:

- ``t`` and ``s`` are 1-D sequences of the same length; a model whose ``t`` or ``s`` is NaN is
  dropped (pairwise), ±inf is kept and ranks above/below every finite value.
- τ is *undefined* — returned as ``nan``, never raised — when fewer than two models remain or
  when all gaps or all sharpness values are equal: there is then no ranking to agree with.
  (The τ-a formula would give 0 there, which reads as "no correlation" when there is nothing
  to correlate.)
- Only the order of the values matters; everything is computed from integer sign counts, so
  results are exact and independent of the scale of ``t`` and ``s``.

Example:
    >>> from geosharp import stats
    >>> t = [1, 2, 2, 3]
    >>> s = [1, 3, 2, 2]
    >>> round(stats.kendall_tau_a(t, s), 4), round(stats.kendall_tau_b(t, s), 4)
    (0.3333, 0.4)
    >>> summary = stats.correlation_summary([0.1, 0.2, 0.3], [3.0, 2.0, 1.0], n_boot=200)
    >>> summary.tau_a, summary.defined
    (-1.0, True)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.stats import rankdata

__all__ = [
    "CMIScore",
    "CorrelationSummary",
    "TauDifference",
    "bootstrap_ci",
    "cmi_score",
    "correlation_summary",
    "granulated_kendall",
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
# populations with hyperparameter columns (SPEC §2.5)


def _hparam_value(value: object) -> Hashable:
    """The grouping key of one hyperparameter value: a missing value (None or NaN) is ``None``."""
    if value is None:
        return None
    if isinstance(value, float | np.floating) and math.isnan(value):
        return None
    return value  # type: ignore[return-value]


def _hparam_columns(
    hparams: Mapping[str, Sequence[object]], keep: np.ndarray
) -> dict[str, list[Hashable]]:
    """Validate ``hparams`` (one value per model) and keep the rows in ``keep``.

    Values are grouping keys: equal values (``==`` and equal hashes, so ``1`` and ``1.0`` are
    one value) are one level; every missing value (``None`` or NaN) is the one level ``None``,
    not a level per model (NaN ≠ NaN would otherwise make each missing entry its own value).
    """
    columns: dict[str, list[Hashable]] = {}
    for name, values in hparams.items():
        vals = list(values)
        if len(vals) != keep.size:
            raise ValueError(
                f"hparams[{name!r}] has {len(vals)} values but t and s have {keep.size} "
                "(one value per model)"
            )
        column = [_hparam_value(v) for v, k in zip(vals, keep, strict=True) if k]
        for v in column:
            try:
                hash(v)
            except TypeError as err:
                raise ValueError(
                    f"hparams[{name!r}] holds the unhashable value {v!r:.60}; hyperparameter "
                    "values must be numbers, strings or other hashable values"
                ) from err
        columns[name] = column
    return columns


def granulated_kendall(
    t: Sequence[float] | np.ndarray,
    s: Sequence[float] | np.ndarray,
    hparams: Mapping[str, Sequence[object]],
    stat: Stat = "a",
) -> dict[str, object]:
    """Granulated Kendall coefficient Ψ of Jiang et al. (2020), "Fantastic generalization measures".

    For each hyperparameter ``i``, the models are grouped by the values of every *other*
    hyperparameter; within each group only hyperparameter ``i`` varies, and τ(t, s) is computed
    there. ``ψ_i`` is the average of these τ over the groups, and ``Ψ`` the average of ``ψ_i``
    over hyperparameters (SPEC §2.5). ψ_i asks "when only hyperparameter i changes, does the
    measure rank the models like their gaps?".

    On a complete grid (every combination of hyperparameter values trained) this is Jiang et
    al.'s definition exactly: every group holds one model per value of ``i``, ψ_i averages over
    all ``∏_{j≠i} |Θ_j|`` groups and Ψ over all hyperparameters. Departures from a grid are
    handled as follows:

    - A group in which hyperparameter ``i`` takes fewer than two distinct values (in particular a
      group of one model) has no comparison to make and is skipped; ψ_i averages the remaining
      groups (``n_groups`` says how many). Random-search populations have such groups only and
      give ``nan``.
    - A hyperparameter with a single value in the whole population has only such groups: its
      ψ_i is ``nan``, and ``Ψ`` is the mean of the *defined* ψ_i (the mean over hyperparameters
      that vary, which is Jiang et al.'s plain mean when all of them vary).
    - Replicates (e.g. seeds) of one configuration sit in the same group, and their pairs count
      in that group's τ like any other pair.
    - A missing value (``None`` or NaN) of a hyperparameter is one value of its own.

    With ``stat="a"`` the within-group τ is Jiang et al.'s τ-a, in which a tied pair counts 0:
    a group whose sharpness (or gap) does not move with hyperparameter ``i`` contributes τ = 0
    instead of being skipped, so a measure blind to ``i`` gets ``ψ_i = 0``. (Unlike
    :func:`kendall_tau_a`, which returns ``nan`` for an all-tied population, such a group is
    averaged as 0.) With ``stat="b"`` groups where τ-b is undefined are skipped.

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).
        hparams: Hyperparameter name → the value of that hyperparameter for each model (each
            sequence as long as ``t``; values must be hashable, e.g. numbers or strings).
        stat: ``"a"`` (Jiang et al.) or ``"b"``.

    Returns:
        ``{"psi": {name: ψ_i}, "Psi": Ψ, "n_groups": {name: number of groups averaged}}``, with
        ``nan`` where undefined. Models with NaN ``t`` or ``s`` are dropped first. With a single
        hyperparameter that varies, Ψ = ψ_i = τ over the whole population.

    Raises:
        ValueError: If lengths disagree, ``hparams`` is empty, a value is unhashable, or
            ``stat`` is unknown.

    Example:
        >>> lr = [0.1, 0.1, 0.01, 0.01]
        >>> width = [32, 64, 32, 64]
        >>> out = granulated_kendall([1, 2, 3, 4], [2, 1, 4, 3], {"lr": lr, "width": width})
        >>> out["psi"], out["Psi"]
        ({'lr': 1.0, 'width': -1.0}, 0.0)
    """
    _check_stat(stat)
    tt, ss, keep = _paired(t, s)
    if not hparams:
        raise ValueError("hparams is empty; pass at least one hyperparameter name → values")
    columns = _hparam_columns(hparams, keep)
    names = list(columns)
    psi: dict[str, float] = {}
    n_groups: dict[str, int] = {}
    for name in names:
        others = [n for n in names if n != name]
        groups: dict[tuple[object, ...], list[int]] = {}
        for j in range(tt.size):
            key = tuple(columns[o][j] for o in others)
            groups.setdefault(key, []).append(j)
        taus = []
        for members in groups.values():
            if len({columns[name][j] for j in members}) < 2:
                continue
            pairs = _pairs(tt[members], ss[members])
            tau = pairs.concordance / pairs.total if stat == "a" else pairs.tau("b")
            if math.isfinite(tau):
                taus.append(tau)
        psi[name] = float(np.mean(taus)) if taus else math.nan
        n_groups[name] = len(taus)
    defined = [v for v in psi.values() if math.isfinite(v)]
    big_psi = float(np.mean(defined)) if defined else math.nan
    return {"psi": psi, "Psi": big_psi, "n_groups": n_groups}


@dataclass(frozen=True)
class CMIScore:
    """The conditional mutual information score of a measure over a population (SPEC §2.5).

    Attributes:
        score: ``min_S Î(S)``, the smallest normalized conditional mutual information over the
            conditioning sets where it is defined, in [0, 1]; ``nan`` if it is defined for none.
        condition: The minimizing conditioning set (hyperparameter names; ``()`` is the empty
            set); ``None`` when ``score`` is ``nan``. Ties go to the first set in the order
            sizes ascending, then ``itertools.combinations`` of the ``hparams`` order.
        per_set: ``Î(S) = I(V_s; V_t | U_S) / H(V_t | U_S)`` for every conditioning set tried,
            ``nan`` where ``H(V_t | U_S) = 0`` (the hyperparameters in ``S`` determine every
            gap comparison: nothing is left for the measure to explain).
        information: ``I(V_s; V_t | U_S)`` in bits, per set.
        entropy: ``H(V_t | U_S)`` in bits, per set.
        n_models: Models used (finite ``t`` and ``s``).
        n_pairs: Ordered pairs of models used (those with different gaps).
        note: Why the score is undefined, which sets were left out of the minimum, or what was
            dropped; empty when there is nothing to say.
    """

    score: float
    condition: tuple[str, ...] | None
    per_set: dict[tuple[str, ...], float]
    information: dict[tuple[str, ...], float]
    entropy: dict[tuple[str, ...], float]
    n_models: int
    n_pairs: int
    note: str

    @property
    def defined(self) -> bool:
        """Whether the score is a number (some conditioning set has ``H(V_t | U_S) > 0``)."""
        return math.isfinite(self.score)


def _conditional_information_bits(counts: np.ndarray) -> tuple[float, float]:
    """``(I(V_s; V_t | U), H(V_t | U))`` in bits from counts ``n[u, v_t, v_s]``.

    ``I = Σ n_{u,a,b}/N · log2(n_{u,a,b} n_u / (n_{u,a} n_{u,b}))`` and
    ``H = Σ n_{u,a}/N · log2(n_u / n_{u,a})``, summed over non-empty cells. The ratios are of
    integer counts, so a measure that determines ``V_t`` gives ``I`` equal to ``H`` to the bit.
    """
    n = counts.astype(np.float64)
    total = float(n.sum())
    n_u = n.sum(axis=(1, 2))
    n_ut = n.sum(axis=2)
    n_us = n.sum(axis=1)
    u, a = np.nonzero(n_ut)
    entropy = float(np.sum(n_ut[u, a] * np.log2(n_u[u] / n_ut[u, a]))) / total
    u, a, b = np.nonzero(n)
    ratio = (n[u, a, b] * n_u[u]) / (n_ut[u, a] * n_us[u, b])
    information = float(np.sum(n[u, a, b] * np.log2(ratio))) / total
    return max(float(information), 0.0), max(float(entropy), 0.0)


def cmi_score(
    t: Sequence[float] | np.ndarray,
    s: Sequence[float] | np.ndarray,
    hparams: Mapping[str, Sequence[object]],
    max_condition: int = 2,
    *,
    min_condition: int = 0,
) -> CMIScore:
    """Conditional mutual information score of Jiang et al. (2020) and the PGDL competition.

    Does the measure carry information about which of two models generalizes worse *beyond*
    what the hyperparameters already say? For every ordered pair ``(i, j)`` of distinct models
    let ``V_t = sign(t_i − t_j)``, ``V_s = sign(s_i − s_j)`` and, for a set ``S`` of
    hyperparameters, ``U_S = (θ_S(i), θ_S(j))`` — the values of the hyperparameters in ``S`` of
    *both* models, so pairs in which a hyperparameter of ``S`` changes are kept, in strata of
    their own. Over these pairs (each equally likely)::

        Î(S) = I(V_s; V_t | U_S) / H(V_t | U_S),        score = min_{|S| ≤ max_condition} Î(S)

    (SPEC §2.5). ``Î(S) ∈ [0, 1]``: 1 when, within every stratum, the measure's order
    determines the gap's order; 0 when it is independent of it given ``U_S``. Conditioning
    removes what ``S`` explains: a measure that only tracks the learning rate scores 0 once the
    learning rate is conditioned on. The score is the worst case over conditioning sets.

    It sees only pairwise signs, so it is invariant under any strictly monotone transform of
    ``s`` — **increasing or decreasing**: a measure perfectly anti-correlated with the gap
    scores 1 too. Report τ alongside it for the direction.

    Choices where the reference scoring program (PGDL 2020, ``mutual_information.py``) is
    loose, stated so that the number can be compared with it:

    - Pairs with equal gaps (including a model paired with itself) are **dropped**: there is no
      order to predict. The reference keeps them (a tie, and the self-pair, count as "gap not
      greater"); on populations without ties the two differ by its self-pairs only.
    - Pairs with equal measures are **kept**, with ``V_s = 0`` (a third value): a measure that
      cannot tell two models apart earns nothing for it, and dropping such pairs would reward a
      measure for tying the pairs it would get wrong. The reference counts them as "measure
      not greater".
    - Strata are weighted by their share of pairs, ``p(U_S)`` (the definition of a conditional
      mutual information); the reference averages the cells of its table uniformly, which is
      the same on a complete grid up to its self-pairs.
    - Every ``S`` with ``min_condition ≤ |S| ≤ max_condition`` is tried, the empty set
      included (Jiang et al.'s ``|S| ≤ 2``); the competition's program loops over pairs of
      distinct hyperparameters only (``min_condition=2, max_condition=2``).
    - A set with ``H(V_t | U_S) = 0`` (its hyperparameters decide every gap comparison — e.g.
      conditioning on all hyperparameters of a grid without replicates) has ``Î(S)`` undefined
      and is left out of the minimum (the reference would divide 0 by 0).

    Information is in bits; ``Î`` is a ratio and does not depend on the base.

    Args:
        t: Generalization gap of each model.
        s: The measure (e.g. sharpness) of each model, same length as ``t``.
        hparams: Hyperparameter name → its value for each model (hashable values; a missing
            value, ``None`` or NaN, is one value of its own). May be empty: then only ``S = ∅``,
            the unconditional normalized mutual information.
        max_condition: Largest conditioning set (2 in Jiang et al. and the competition).
        min_condition: Smallest conditioning set (0; 2 for the competition's loop).

    Returns:
        A :class:`CMIScore`. ``nan`` (never an exception) with ``note`` saying why when fewer
        than two models have finite values, when all gaps are equal, or when no conditioning set
        leaves anything to explain. Models with NaN ``t`` or ``s`` are dropped first.

    Raises:
        ValueError: If lengths disagree, a hyperparameter value is unhashable, or the
            conditioning sizes are negative, inverted or larger than the hyperparameters allow.

    Example:
        >>> t = [1, 2, 3, 4]
        >>> r = cmi_score(t, [1, 1, 2, 2], {"lr": ["a", "a", "b", "b"], "width": [1, 2, 1, 2]})
        >>> r.score, r.condition  # the measure only knows the learning rate
        (0.0, ('lr',))
        >>> round(r.per_set[()], 4), r.per_set[("width",)]
        (0.6667, 1.0)
    """
    max_condition, min_condition = int(max_condition), int(min_condition)
    if min_condition < 0 or max_condition < min_condition:
        raise ValueError(
            "need 0 ≤ min_condition ≤ max_condition; "
            f"got min_condition={min_condition}, max_condition={max_condition}"
        )
    tt, ss, keep = _paired(t, s)
    columns = _hparam_columns(hparams, keep)
    names = list(columns)
    if min_condition > len(names):
        raise ValueError(
            f"min_condition={min_condition} but only {len(names)} hyperparameter(s) given"
        )
    sets = [
        subset
        for size in range(min_condition, min(max_condition, len(names)) + 1)
        for subset in itertools.combinations(names, size)
    ]
    m = int(tt.size)
    n_dropped = int(keep.size - m)
    dropped = f"{n_dropped} model(s) dropped for a NaN gap or measure" if n_dropped else ""

    def undefined(reason: str, n_pairs: int = 0, **tables: dict) -> CMIScore:
        nan_sets = {subset: math.nan for subset in sets}
        return CMIScore(
            score=math.nan,
            condition=None,
            per_set=tables.get("per_set", nan_sets),
            information=tables.get("information", dict(nan_sets)),
            entropy=tables.get("entropy", dict(nan_sets)),
            n_models=m,
            n_pairs=n_pairs,
            note="; ".join(x for x in (reason, dropped) if x),
        )

    if m < 2:
        return undefined(f"only {m} model(s) with finite values (need ≥ 2): score undefined")
    sign_t = _sign_matrix(tt)
    first, second = np.nonzero(sign_t)  # ordered pairs with different gaps (never i == j)
    if first.size == 0:
        return undefined("all gaps equal: no pair of models to order, score undefined")
    v_t = (sign_t[first, second] > 0).astype(np.int64)  # 0: t_i < t_j, 1: t_i > t_j
    v_s = _sign_matrix(ss)[first, second].astype(np.int64) + 1  # 0: <, 1: =, 2: >
    codes = {}
    for name, column in columns.items():
        level: dict[Hashable, int] = {}
        codes[name] = np.array([level.setdefault(v, len(level)) for v in column], dtype=np.int64)

    per_set: dict[tuple[str, ...], float] = {}
    information: dict[tuple[str, ...], float] = {}
    entropy: dict[tuple[str, ...], float] = {}
    for subset in sets:
        if subset:
            keys = np.stack(
                [codes[h][first] for h in subset] + [codes[h][second] for h in subset], axis=1
            )
            _, stratum = np.unique(keys, axis=0, return_inverse=True)
            stratum = stratum.reshape(-1)
        else:
            stratum = np.zeros(first.size, dtype=np.int64)
        n_strata = int(stratum.max()) + 1
        cell = stratum * 6 + v_t * 3 + v_s
        counts = np.bincount(cell, minlength=n_strata * 6).reshape(n_strata, 2, 3)
        info, ent = _conditional_information_bits(counts)
        information[subset], entropy[subset] = info, ent
        per_set[subset] = float(min(info / ent, 1.0)) if ent > 0 else math.nan

    defined = {subset: v for subset, v in per_set.items() if math.isfinite(v)}
    empty = [subset for subset, v in per_set.items() if not math.isfinite(v)]
    left_out = ""
    if empty:
        shown = ", ".join("{" + ", ".join(x) + "}" for x in empty[:4])
        more = f" and {len(empty) - 4} more" if len(empty) > 4 else ""
        left_out = (
            f"H(V_t | U_S) = 0 for S = {shown}{more}: these hyperparameters decide every gap "
            "comparison; left out of the minimum"
        )
    if not defined:
        return undefined(
            "every conditioning set decides the gap order: score undefined",
            int(first.size),
            per_set=per_set,
            information=information,
            entropy=entropy,
        )
    condition = min(defined, key=lambda subset: (defined[subset], sets.index(subset)))
    return CMIScore(
        score=defined[condition],
        condition=condition,
        per_set=per_set,
        information=information,
        entropy=entropy,
        n_models=m,
        n_pairs=int(first.size),
        note="; ".join(x for x in (left_out, dropped) if x),
    )


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


# --------------------------------------------------------------------------------------------
# summary


@dataclass(frozen=True)
class CorrelationSummary:
    """τ between gap and sharpness over a population, with its uncertainty.

    Attributes:
        tau_a: Kendall's τ-a (the paper's coefficient); ``nan`` if undefined.
        tau_b: Kendall's τ-b (tie-corrected); ``nan`` if undefined.
        ci_low: Lower end of the percentile-bootstrap CI of τ-a.
        ci_high: Upper end of the percentile-bootstrap CI of τ-a.
        p_value: Two-sided permutation p-value of τ.
        n_models: Models used (after dropping NaN pairs).
        n_dropped: Models dropped because their gap or sharpness is NaN.
        defined: Whether τ is defined (enough models, neither variable constant).
        note: Why τ is undefined, or what was dropped; empty when there is nothing to say.
        level: Coverage of the CI.
        n_boot: Bootstrap resamples behind the CI.
        n_perm: Permutations behind the p-value.
    """

    tau_a: float
    tau_b: float
    ci_low: float
    ci_high: float
    p_value: float
    n_models: int
    n_dropped: int
    defined: bool
    note: str
    level: float
    n_boot: int
    n_perm: int


def correlation_summary(
    t: Sequence[float] | np.ndarray,
    s: Sequence[float] | np.ndarray,
    *,
    n_boot: int = 2000,
    n_perm: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    min_models: int = 2,
) -> CorrelationSummary:
    """τ-a, τ-b, bootstrap CI of τ-a and permutation p-value in one record; never raises on data.

    Args:
        t: Generalization gap of each model.
        s: Sharpness of each model (same length as ``t``).
        n_boot: Bootstrap resamples for the CI of τ-a.
        n_perm: Permutations for the p-value.
        level: Coverage of the CI.
        seed: Seed for both the bootstrap and the permutations.
        min_models: Fewer usable models than this makes τ undefined (at least 2).

    Returns:
        A :class:`CorrelationSummary`; when τ is undefined every number in it is ``nan``,
        ``defined`` is False and ``note`` says why.

    Raises:
        ValueError: If ``t`` and ``s`` are not 1-D numeric sequences of the same length, or on
            bad ``n_boot``, ``n_perm``, ``level`` or ``min_models``.

    Example:
        >>> correlation_summary([0.3, 0.3, 0.3], [1.0, 2.0, 3.0]).note
        'all gaps equal: τ undefined'
    """
    if int(min_models) < 2:
        raise ValueError(f"min_models must be ≥ 2 (τ needs a pair); got {min_models}")
    if int(n_boot) < 1 or int(n_perm) < 1:
        raise ValueError(f"n_boot and n_perm must be ≥ 1; got {n_boot} and {n_perm}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), e.g. 0.95; got {level}")
    tt, ss, keep = _paired(t, s)
    n_dropped = int(keep.size - tt.size)
    pairs = _pairs(tt, ss)
    reason = ""
    if tt.size < min_models:
        reason = f"only {tt.size} model(s) with finite values (need ≥ {min_models}): τ undefined"
    elif pairs.ties_t == pairs.total:
        reason = "all gaps equal: τ undefined"
    elif pairs.ties_s == pairs.total:
        reason = "all sharpness values equal: τ undefined"
    dropped = f"{n_dropped} model(s) dropped for a NaN gap or sharpness" if n_dropped else ""
    note = "; ".join(x for x in (reason, dropped) if x)
    common = dict(
        n_models=int(tt.size),
        n_dropped=n_dropped,
        note=note,
        level=float(level),
        n_boot=int(n_boot),
        n_perm=int(n_perm),
    )
    if reason:
        nan = math.nan
        return CorrelationSummary(nan, nan, nan, nan, nan, defined=False, **common)
    low, high = bootstrap_ci(tt, ss, "a", n_boot=n_boot, level=level, seed=seed)
    return CorrelationSummary(
        tau_a=pairs.tau("a"),
        tau_b=pairs.tau("b"),
        ci_low=low,
        ci_high=high,
        p_value=permutation_pvalue(tt, ss, "a", n_perm=n_perm, seed=seed),
        defined=True,
        **common,
    )
