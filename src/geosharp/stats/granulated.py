"""Populations with hyperparameter columns: granulated τ and the CMI score (SPEC §2.5).

The granulated Kendall coefficient of Jiang et al. (2020) averages τ over the groups of models
that differ in one hyperparameter only; the conditional mutual information score of the PGDL
competition measures what a measure says about the gap beyond the hyperparameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from geosharp.stats.tau import (
    Stat,
    _check_stat,
    _paired,
    _pairs,
    _sign_matrix,
)

__all__ = [
    "CMIScore",
    "cmi_score",
    "granulated_kendall",
]

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
