"""Curvature measures: the Hessian spectrum on the quotient (SPEC §9), one quantity each."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from geosharp.errors import MeasureError
from geosharp.estimators.curvature import curvature
from geosharp.measures.base import Measure, Outcome, accepted, grammar, register

__all__ = ["HVP_COST", "Curvature", "curvature_name"]

#: A Hessian-vector product in forward+backward passes.
HVP_COST = 2.0
#: How a curvature quantity is written on a plot's axis.
_AXIS = {"lambda_max": "λ_max", "lambda_min": "λ_min", "trace": "trace"}

_OF = {
    "geodesic": "geodesic",
    "geo": "geodesic",
    "adaptive": "adaptive",
    "ada": "adaptive",
    "euclidean": "euclidean",
    "eucl": "euclidean",
}
_QUANTITIES = {
    "lmax": "lambda_max",
    "lambda_max": "lambda_max",
    "lambdamax": "lambda_max",
    "λmax": "lambda_max",
    "lmin": "lambda_min",
    "lambda_min": "lambda_min",
    "lambdamin": "lambda_min",
    "λmin": "lambda_min",
    "trace": "trace",
    "tr": "trace",
}
_NOT_CURVATURE = {"o1", "1", "o2", "2", "exact", "oexact", "worst", "average", "avg", "l2", "linf"}


def curvature_name(measure: str, metric: str, quantity: str) -> str:
    """Canonical name of a curvature measure: :attr:`geosharp.CurvatureResult.measure` + quantity.

    Args:
        measure: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
        metric: Block metric of the geodesic measure (ignored otherwise).
        quantity: ``"lambda_max"``, ``"lambda_min"`` or ``"trace"``.

    Example:
        >>> curvature_name("geodesic", "mix", "trace")
        'geodesic-mix curvature trace'
        >>> curvature_name("euclidean", "", "lambda_max")
        'euclidean curvature lambda_max'
    """
    base = f"geodesic-{metric or 'inv'}" if measure == "geodesic" else measure
    return f"{base} curvature {quantity}"


@register
@dataclass(frozen=True)
class Curvature(Measure):
    """One quantity of the Hessian spectrum of a measure's geometry (no ρ).

    Attributes:
        of: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``: whose Hessian.
        metric: Block metric of geodesic curvature (``"inv"`` or ``"mix"``; ``""`` otherwise).
        quantity: ``"lambda_max"``, ``"lambda_min"`` or ``"trace"``.

    Example:
        >>> Curvature.parse("curvature-mix-trace").name
        'geodesic-mix curvature trace'
        >>> Curvature.parse("curvature-euclidean-lmax").name
        'euclidean curvature lambda_max'
    """

    of: str = "geodesic"
    metric: str = "inv"
    quantity: str = "lambda_max"

    family: ClassVar[str] = "curvature"
    uses_rho: ClassVar[bool] = False
    keys: ClassVar[tuple[str, ...]] = ("curvature",)
    grammar: ClassVar[str] = (
        "a curvature measure is curvature[-geodesic|adaptive|euclidean][-inv|mix]-lmax|lmin|trace "
        "(no rho), e.g. curvature-inv-lmax, curvature-euclidean-trace"
    )
    priority: ClassVar[int] = 10  # before sharpness: 'curvature-geodesic' names a family too
    settings: ClassVar[frozenset[str]] = frozenset({"seed", "iters", "probes", "trace_method"})

    @classmethod
    def claims(cls, text: str, toks: list[str]) -> bool:  # noqa: D102
        return "curvature" in toks

    @classmethod
    def from_tokens(cls, text: str, toks: list[str]) -> Curvature:  # noqa: D102
        if toks.count("curvature") > 1:
            raise MeasureError(f"measure {text!r} names curvature twice: {grammar()}")
        opts: dict[str, Any] = {}
        for tok in toks:
            if tok == "curvature":
                continue
            if tok in _OF:
                key, value = "of", _OF[tok]
            elif tok in ("inv", "mix"):
                key, value = "metric", tok
            elif tok in _QUANTITIES:
                key, value = "quantity", _QUANTITIES[tok]
            elif tok in _NOT_CURVATURE:
                raise MeasureError(
                    f"measure {text!r}: a curvature measure has no order, kind or norm (it is "
                    "the Hessian spectrum on the quotient, SPEC §9: second-order geodesics, no "
                    f"rho); {grammar()}"
                )
            else:
                raise MeasureError(f"unknown option {tok!r} in measure {text!r}: {grammar()}")
            if key in opts and opts[key] != value:
                raise MeasureError(f"measure {text!r} gives the {key} twice: {grammar()}")
            opts[key] = value
        if "quantity" not in opts:
            raise MeasureError(
                f"measure {text!r}: say which curvature quantity, lmax (largest eigenvalue), "
                f"lmin (smallest) or trace; {grammar()}"
            )
        of = opts.get("of", "geodesic")
        if of != "geodesic" and "metric" in opts:
            raise MeasureError(
                f"measure {text!r}: the metric inv|mix belongs to geodesic curvature only; {of} "
                "curvature has its own (element-wise) metric"
            )
        metric = opts.get("metric", "inv") if of == "geodesic" else ""
        return cls(of=of, metric=metric, quantity=opts["quantity"])

    @classmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> Curvature:  # noqa: D102
        of = kwargs.get("of", "geodesic")
        metric = kwargs.get("metric", "inv") if of == "geodesic" else ""
        return cls(of=of, metric=metric, quantity=kwargs["quantity"])

    @property
    def name(self) -> str:  # noqa: D102
        return curvature_name(self.of, self.metric, self.quantity)

    @property
    def uses_blocks(self) -> bool:
        """Geodesic curvature: the Hessian on the quotient of the symmetry blocks."""
        return self.of == "geodesic"

    def step_cost(self, steps: int, curv: Mapping[str, Any]) -> float:
        """The Hessian-vector products (``iters``, or ``probes`` for the trace) and a pass."""
        n = curv.get("iters", 50) if self.quantity != "trace" else curv.get("probes", 100)
        return float(n) * HVP_COST + 1.0

    @property
    def axis_label(self) -> str:
        """E.g. ``"curvature λ_max (geodesic-inv)"``."""
        of = f"geodesic-{self.metric or 'inv'}" if self.of == "geodesic" else self.of
        return f"curvature {_AXIS.get(self.quantity, self.quantity)} ({of})"

    def shard_refusal(self, trace_method: str = "hutchinson") -> str | None:
        """``None``: :func:`geosharp.curvature` measures it sharded, but the exact trace.

        ``trace_method``: the run's (``gs.measure``'s ``trace_method``); the exact trace takes
        one product per coordinate of the whole model, which a sharded model is not measured
        with (``gs.curvature`` refuses it).
        """
        if self.quantity == "trace" and trace_method == "exact":
            return (
                "the exact trace (trace_method exact) takes one Hessian-vector product per "
                "coordinate of the whole model"
            )
        return None

    def callback_refusal(self) -> str | None:  # noqa: D102
        return (
            "the callback measures sharpness (geodesic, adaptive, euclidean); curvature and "
            "relative flatness are measured with gs.curvature and gs.relative_flatness"
        )

    def kwargs(self) -> dict[str, Any]:
        """``{"measure": "curvature", "of": …, "metric": …, "quantity": …}``."""
        return {
            "measure": "curvature",
            "of": self.of,
            "metric": self.metric,
            "quantity": self.quantity,
        }

    def run(
        self,
        model: Any,
        loss_fn: Callable,
        batches: Iterable,
        *,
        rho: float | None = None,
        **settings: Any,
    ) -> Any:
        """:func:`geosharp.curvature` of this measure's quantity (``rho`` must be ``None``).

        ``trace_method`` is the trace's setting and is passed for the trace only (λ_max and
        λ_min never use it, nor are they checked against it).
        """
        if rho is not None:
            raise MeasureError(f"{self.name} takes no radius rho, got {rho}")
        identity = {
            "measure": self.of,
            "metric": self.metric or "inv",
            "quantities": (self.quantity,),
        }
        taken = accepted(curvature, settings)
        if self.quantity != "trace":  # the trace's setting, not λ_max's or λ_min's
            taken.pop("trace_method", None)
        return curvature(model, loss_fn, batches, **{**taken, **identity})

    def row_fields(self, result: Any, rho: float | None) -> dict[str, Any]:
        """The row of this quantity of a ``CurvatureResult`` (no radius)."""
        q = self.quantity
        return {
            "measure": f"{result.measure} {q}",
            "rho": None,
            "value": result.values[q],
            "per_batch": list(result.per_batch[q]),
            "clean_losses": list(result.clean_losses),
            "time_s": result.time_s,
            "n_forward": result.n_forward,
            "n_backward": result.n_backward,
            "stderr": result.trace_stderr if q == "trace" else None,
            "n_hvp": result.n_hvp,
        }

    def outcome(self, result: Any) -> Outcome:
        """This quantity of a ``CurvatureResult``; the trace's standard errors as its stats."""
        q = self.quantity
        stats: dict[str, Any] = {}
        if q == "trace":
            stats = {
                "trace_stderr": float(result.trace_stderr),
                "per_batch_trace_stderr": [float(v) for v in result.per_batch_trace_stderr],
            }
        return Outcome(
            value=result.values[q],
            per_batch=list(result.per_batch[q]),
            clean_losses=list(result.clean_losses),
            time_s=result.time_s,
            stats=stats,
        )
