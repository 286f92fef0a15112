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

from geosharp.stats.granulated import CMIScore, cmi_score, granulated_kendall
from geosharp.stats.summary import CorrelationSummary, correlation_summary
from geosharp.stats.tau import (
    TauDifference,
    bootstrap_ci,
    kendall_tau_a,
    kendall_tau_b,
    permutation_pvalue,
    tau_difference,
)

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
