"""The summary a study reports of τ between a measure and the gap (SPEC §2, §7).

:func:`correlation_summary` gathers in one :class:`CorrelationSummary` what
:mod:`~geosharp.stats.tau` computes (τ-a, τ-b, the percentile-bootstrap CI of τ-a and the
permutation p-value) with the models used and dropped, and, when τ is undefined, why; it never
raises on data. The conventions are :mod:`geosharp.stats`'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from geosharp.stats.tau import _paired, _pairs, bootstrap_ci, permutation_pvalue

__all__ = ["CorrelationSummary", "correlation_summary"]


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
