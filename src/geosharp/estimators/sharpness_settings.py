"""The settings of one ``gs.sharpness`` call: checked once, named and recorded (SPEC §2, §6).

:class:`SharpnessSettings` holds the keyword arguments of
:func:`~geosharp.estimators.sharpness.sharpness`, checked once (a measure that is defined, of
a kind in ``KINDS`` and a norm in ``NORMS``; radii, counts and the buffer budget in range),
and answers what follows from them: the measure's canonical name (:func:`measure_name`), what
its perturbation is made of, the per-batch quantity (worst or average case) and the settings a
result records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from geosharp.estimators.apgd import BUFFER_BUDGET
from geosharp.estimators.average import AverageCase
from geosharp.estimators.harness import PerturbationSettings, check_float, check_int
from geosharp.estimators.perturbation import BLOCK_METRICS, MEASURES
from geosharp.estimators.worst import WorstCase
from geosharp.symmetry import ParameterSpace

__all__ = ["KINDS", "NORMS", "SharpnessSettings", "measure_name"]

KINDS = ("worst", "average")
NORMS = ("l2", "linf")


def measure_name(
    measure: str,
    metric: str,
    order: int | str,
    kind: str,
    norm: str,
    corrected_norm: bool = True,
    perturb: str = "all",
) -> str:
    """Canonical name of a measure, e.g. ``"geodesic-inv-o2 worst l2"``.

    Attention-only measures (``perturb="blocks"``) carry ``-blocks``:
    ``"geodesic-inv-o2-blocks worst l2"``, ``"adaptive-blocks worst l2"``.
    """
    blocks = "-blocks" if perturb == "blocks" else ""
    if measure == "geodesic":
        base = f"geodesic-{metric}-o{order}" + ("" if corrected_norm else "-adaptivenorm")
    else:
        base = measure
    return f"{base}{blocks} {kind} {norm}"


@dataclass(frozen=True)
class SharpnessSettings:
    """Every setting of one ``gs.sharpness`` call, checked once (:meth:`checked`).

    The fields are :func:`~geosharp.estimators.sharpness.sharpness`'s keyword arguments of the
    same names; the call asks this object what follows from them (:attr:`geodesic`,
    :attr:`worst`, :attr:`name`, :meth:`case`, :attr:`perturbation`, :meth:`recorded`).
    """

    measure: str = "geodesic"
    metric: str = "inv"
    order: int | str = 2
    kind: str = "worst"
    rho: float = 0.1
    steps: int = 20
    norm: str = "l2"
    eps: float = 0.0
    seed: int = 0
    samples: int = 10
    restarts: int = 1
    random_init: bool = False
    corrected_norm: bool = True
    exact_steps: int = 10
    key_bias: str = "quotient"
    perturb: str = "all"
    cache: bool = True
    low_memory: bool = False
    buffer_budget: float | None = BUFFER_BUDGET
    progress: bool | None = None
    distributed: bool | None = None

    @classmethod
    def checked(cls, **values: Any) -> SharpnessSettings:
        """The settings of ``values`` (the fields by name), checked in ``gs.sharpness``'s order.

        Raises:
            ValueError: On an unknown measure, kind, norm, metric, order or ``perturb``, or a
                radius, step count, sample count, restart count or buffer budget out of range.
        """
        s = cls(**values)
        _check_measure(s.measure, s.kind, s.norm, s.perturb, s.metric, s.order)
        rho = check_float("rho", s.rho)
        steps = check_int("steps", s.steps)
        samples = check_int("samples", s.samples)
        restarts = check_int("restarts", s.restarts)
        budget = s.buffer_budget
        if budget is not None:
            budget = check_float("buffer_budget", budget)
        return dataclasses.replace(
            s, rho=rho, steps=steps, samples=samples, restarts=restarts, buffer_budget=budget
        )

    @property
    def geodesic(self) -> bool:
        """Whether the measure is geodesic sharpness (its metric and order mean something)."""
        return self.measure == "geodesic"

    @property
    def worst(self) -> bool:
        """Whether the value is the worst case (else the average case)."""
        return self.kind == "worst"

    @property
    def name(self) -> str:
        """The measure's canonical name (:func:`measure_name`)."""
        return measure_name(
            self.measure,
            self.metric,
            self.order,
            self.kind,
            self.norm,
            corrected_norm=self.corrected_norm,
            perturb=self.perturb,
        )

    @property
    def perturbation(self) -> PerturbationSettings:
        """What the call's perturbation is made of."""
        return PerturbationSettings(
            measure=self.measure,
            metric=self.metric,
            order=self.order,
            perturb=self.perturb,
            eps=self.eps,
            corrected_norm=self.corrected_norm,
            exact_steps=self.exact_steps,
            key_bias=self.key_bias,
            low_memory=self.low_memory,
        )

    def case(self) -> WorstCase | AverageCase:
        """The per-batch quantity: :class:`WorstCase` or :class:`AverageCase`."""
        if self.worst:
            return WorstCase(
                self.rho,
                self.steps,
                norm=self.norm,
                restarts=self.restarts,
                random_init=self.random_init,
                low_memory=self.low_memory,
                buffer_budget=self.buffer_budget,
            )
        return AverageCase(self.rho, self.samples)

    def recorded(self, space: ParameterSpace) -> dict[str, Any]:
        """The settings a result records, those that ``space`` (the measured one) decides too.

        The call adds what it found (the cached base point, the largest relative speed, the
        parameter count, dtype, device and sharding) in ``gs.sharpness``'s key order.
        """
        worst, geodesic = self.worst, self.geodesic
        return {
            "measure": self.measure,
            "metric": self.metric if geodesic else None,
            "order": self.order if geodesic else 1,
            "kind": self.kind,
            "rho": self.rho,
            "steps": self.steps if worst else None,
            "norm": self.norm,
            "eps": self.eps,
            "seed": self.seed,
            "samples": self.samples if self.kind == "average" else None,
            "restarts": self.restarts if worst else None,
            "random_init": self.random_init,
            "corrected_norm": self.corrected_norm,
            "perturb": self.perturb,
            "low_memory": self.low_memory,
            "buffer_budget": self.buffer_budget,
            "cached_base_point": None,
            "exact_steps": self.exact_steps if self.order == "exact" else None,
            "max_relative_speed": None,
            "n_params": None,
            "n_gl_blocks": sum(b.heads for b in space.gl_blocks) if geodesic else 0,
            "n_key_biases_fixed": sum(b.kind == "b_k" for b in space.blocks)
            if geodesic and self.metric != "adaptive"
            else 0,
        }


def _check_measure(
    measure: str, kind: str, norm: str, perturb: str, metric: str, order: int | str
) -> None:
    """Raise ``ValueError`` on a measure, kind, norm, ``perturb``, metric or order not defined."""
    if measure not in MEASURES:
        raise ValueError(
            f"measure must be one of {MEASURES}, got {measure!r} "
            "(relative flatness: geosharp.relative_flatness)"
        )
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm == "linf" and measure == "geodesic":
        raise ValueError("norm='linf' is defined for measure='adaptive' or 'euclidean' only")
    if perturb not in ("all", "blocks"):
        raise ValueError(f"perturb must be 'all' or 'blocks', got {perturb!r}")
    if perturb == "blocks" and (measure == "euclidean" or norm == "linf"):
        raise ValueError(
            "perturb='blocks' (attention-only) is defined for the geodesic and adaptive ℓ2 measures"
        )
    if measure == "geodesic" and metric not in BLOCK_METRICS:
        raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {metric!r}")
    if isinstance(order, bool) or order not in (1, 2, "exact"):
        raise ValueError(f"order must be one of 1, 2, 'exact', got {order!r}")
