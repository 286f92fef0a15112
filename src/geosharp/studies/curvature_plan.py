"""The opt-in curvature part of a study's plan: which curvature rows are measured, and how.

* :class:`CurvaturePlan` — the (measure, quantity) pairs of :func:`geosharp.curvature`
  (SPEC §9) on the quotient, with Lanczos and trace settings, no ρ;
* :data:`CLASSIFIER_CURVATURE` — the plan of Studies 2 and 3 (``with_curvature()``);
* :func:`curvature_specs` — a plan as the :class:`~geosharp.studies.runner.StudyMeasure` rows
  of a study.

Used by :mod:`geosharp.studies.classifier`, :mod:`geosharp.studies.diagonal` and the
population study (:mod:`geosharp.studies.population`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geosharp.studies.runner import StudyMeasure

__all__ = ["CLASSIFIER_CURVATURE", "CurvaturePlan", "curvature_specs"]


@dataclass(frozen=True)
class CurvaturePlan:
    """The opt-in curvature part of a study's plan: :func:`geosharp.curvature` per model.

    Every (measure, quantity) pair is one row of the study (no ρ), named as
    :func:`geosharp.measuring.core.curvature_name` spells it, e.g.
    ``"geodesic-inv curvature lambda_max"``. Lanczos starts and trace probes use ``seed``
    (batch ``b``: ``batch_seed(seed, b)``), so the rows do not depend on which others are
    measured.

    Attributes:
        measures: ``(measure, metric)`` pairs: geodesic inv and mix, adaptive and Euclidean
            (the metric is ignored but by geodesic curvature).
        quantities: Any of ``"lambda_max"``, ``"lambda_min"``, ``"trace"``.
        iters: Most Lanczos iterations per batch (λ).
        tol: Lanczos tolerance on the residual of the wanted Ritz pair, relative to it.
        probes: Hutchinson probes per batch (trace; unused by ``trace_method="exact"``).
        trace_method: ``"hutchinson"``, ``"hutch++"`` or ``"exact"``.
        seed: Seed of the Lanczos starts and the probes.
    """

    measures: tuple[tuple[str, str], ...] = (
        ("geodesic", "inv"),
        ("geodesic", "mix"),
        ("adaptive", ""),
        ("euclidean", ""),
    )
    quantities: tuple[str, ...] = ("lambda_max", "trace")
    iters: int = 50
    tol: float = 1e-5
    probes: int = 100
    trace_method: str = "hutchinson"
    seed: int = 0

    def text(self) -> str:
        """One line for a report's settings."""
        which = ", ".join(f"geodesic {m}" if k == "geodesic" else k for k, m in self.measures)
        parts = []
        if any(q.startswith("lambda") for q in self.quantities):
            parts.append(
                f"λ by Lanczos in the metric (≤ {self.iters} iterations, tol {self.tol:g})"
            )
        if "trace" in self.quantities:
            parts.append(
                "exact trace (one product per coordinate)"
                if self.trace_method == "exact"
                else f"trace by {self.trace_method} ({self.probes} probes)"
            )
        return (
            f"{', '.join(self.quantities)} of the Hessian on the quotient (SPEC §9, gs.curvature) "
            f"for {which}, per batch and averaged over the batches; "
            + "; ".join(parts)
            + f"; seed {self.seed}"
        )


#: The curvature part of Studies 2 and 3 (``with_curvature()``), fixed from the cost on the
#: pilot ``vit-000`` before any curvature τ was computed: on one core a product costs 0.1–0.2 s
#: per batch of 128 and Lanczos meets ``tol = 1e-5`` in 10–12 iterations, so λ_max of the four
#: measures costs ≈ 25 s per model; 20 Hutchinson probes per batch (≈ 32 s per model) give the
#: pilot's trace a standard error of ≈ 2 % (5.7 % per batch with 10 probes), 100 would cost
#: 160 s per model.
CLASSIFIER_CURVATURE = CurvaturePlan(probes=20)


def curvature_specs(plan: CurvaturePlan) -> list[StudyMeasure]:
    """The :class:`StudyMeasure` of every (measure, quantity) of ``plan`` (``rhos = (None,)``).

    Raises:
        ValueError: On an unknown measure or quantity.
    """
    specs = []
    for measure, metric in plan.measures:
        if measure not in ("geodesic", "adaptive", "euclidean"):
            raise ValueError(
                f"curvature measure must be geodesic, adaptive or euclidean: {measure}"
            )
        for q in plan.quantities:
            if q not in ("lambda_max", "lambda_min", "trace"):
                raise ValueError(f"curvature quantity must be lambda_max/lambda_min/trace: {q}")
            kw: dict[str, Any] = {"measure": "curvature", "of": measure, "quantity": q}
            if measure == "geodesic":
                kw["metric"] = metric
            if q == "trace":
                kw["trace_method"] = plan.trace_method
                if plan.trace_method != "exact":
                    kw["probes"] = plan.probes
            else:
                kw.update(iters=plan.iters, tol=plan.tol)
            kw["seed"] = plan.seed
            specs.append(StudyMeasure(kw, (None,)))
    return specs
