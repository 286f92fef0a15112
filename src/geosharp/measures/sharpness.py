"""Sharpness measures: geodesic, adaptive and Euclidean, worst or average case (SPEC §2, §6)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from geosharp.errors import MeasureError
from geosharp.estimators.sharpness import sharpness
from geosharp.estimators.sharpness_settings import measure_name
from geosharp.measures.base import FORWARD_COST, Measure, accepted, grammar, register

__all__ = ["AVERAGE_SAMPLES", "STEP_COST", "Sharpness"]

#: An Auto-PGD step in plain forward+backward passes (medians of ``benchmarks/README.md``).
STEP_COST = {"adaptive": 1.2, "euclidean": 1.2, "geodesic": 1.4}
#: Average-case samples per batch (``gs.sharpness``'s default, which ``gs.measure`` keeps).
AVERAGE_SAMPLES = 10

_FAMILIES = {
    "geodesic": "geodesic",
    "geo": "geodesic",
    "adaptive": "adaptive",
    "ada": "adaptive",
    "euclidean": "euclidean",
    "eucl": "euclidean",
}
_ORDERS = {"o1": 1, "1": 1, "o2": 2, "2": 2, "exact": "exact", "oexact": "exact"}
_KINDS = {"worst": "worst", "average": "average", "avg": "average"}


def _set(opts: dict[str, Any], key: str, value: Any, text: str) -> None:
    if key in opts and opts[key] != value:
        raise MeasureError(f"measure {text!r} gives the {key} twice: {grammar()}")
    opts[key] = value


@register
@dataclass(frozen=True)
class Sharpness(Measure):
    """Sharpness of a model within a ball of radius ρ (worst case) or under noise ρ (average).

    Attributes:
        measure: ``"geodesic"`` (symmetry blocks on their quotient), ``"adaptive"`` or
            ``"euclidean"``.
        metric: Block metric of geodesic sharpness (``"inv"`` or ``"mix"``; ``""`` otherwise).
        order: Geodesic order (``1``, ``2`` or ``"exact"``; ``1`` for straight lines).
        kind: ``"worst"`` or ``"average"``.
        norm: ``"l2"`` or ``"linf"`` (the adaptive / Euclidean box).
        perturb: ``"all"``, or ``"blocks"`` for the attention-only measures (name ``-blocks``).
        corrected_norm: ``False`` for the "no corrected norm" ablation of geodesic sharpness
            (name ``-adaptivenorm``).

    Example:
        >>> Sharpness.parse("geodesic-mix-exact").name
        'geodesic-mix-oexact worst l2'
        >>> Sharpness.parse("adaptive-linf").name
        'adaptive worst linf'
        >>> Sharpness.parse("geodesic-mix-oexact worst l2") == Sharpness.parse("geo-mix-exact")
        True
    """

    measure: str = "geodesic"
    metric: str = "inv"
    order: int | str = 2
    kind: str = "worst"
    norm: str = "l2"
    perturb: str = "all"
    corrected_norm: bool = True

    family: ClassVar[str] = "sharpness"
    uses_rho: ClassVar[bool] = True
    keys: ClassVar[tuple[str, ...]] = ("geodesic", "adaptive", "euclidean")
    grammar: ClassVar[str] = (
        "a sharpness measure is FAMILY[-OPTION...] with FAMILY geodesic, adaptive or euclidean "
        "and options metric inv|mix (geodesic), order o1|o2|exact (geodesic), norm l2|linf "
        "(adaptive, euclidean), kind worst|average, blocks (geodesic, adaptive l2: "
        "attention-only), adaptivenorm (geodesic: no corrected norm); e.g. geodesic-inv-o2, "
        "geodesic-mix-exact, adaptive-linf, adaptive-l2-average"
    )
    priority: ClassVar[int] = 50
    settings: ClassVar[frozenset[str]] = frozenset({"steps", "eps", "seed", "exact_steps"})

    @classmethod
    def claims(cls, text: str, toks: list[str]) -> bool:  # noqa: D102
        return bool(toks) and toks[0] in _FAMILIES

    @classmethod
    def from_tokens(cls, text: str, toks: list[str]) -> Sharpness:  # noqa: D102
        family = _FAMILIES[toks[0]]
        opts: dict[str, Any] = {}
        for tok in toks[1:]:
            if tok in ("inv", "mix"):
                key, value = "metric", tok
            elif tok in _ORDERS:
                key, value = "order", _ORDERS[tok]
            elif tok in ("l2", "linf"):
                key, value = "norm", tok
            elif tok in _KINDS:
                key, value = "kind", _KINDS[tok]
            elif tok == "blocks":
                key, value = "perturb", "blocks"
            elif tok == "adaptivenorm":
                key, value = "corrected_norm", False
            else:
                raise MeasureError(f"unknown option {tok!r} in measure {text!r}: {grammar()}")
            _set(opts, key, value, text)
        if family != "geodesic" and ("metric" in opts or opts.get("order", 1) != 1):
            raise MeasureError(
                f"measure {text!r}: metric and order belong to geodesic sharpness only; "
                f"{family} sharpness is measured along straight lines"
            )
        if family == "geodesic" and opts.get("norm") == "linf":
            raise MeasureError(
                f"measure {text!r}: the l-infinity box is defined for adaptive and euclidean "
                "sharpness only (geodesic sharpness uses the metric's own l2 ball)"
            )
        if family != "geodesic" and "corrected_norm" in opts:
            raise MeasureError(
                f"measure {text!r}: adaptivenorm (the 'no corrected norm' ablation) belongs to "
                "geodesic sharpness only"
            )
        if opts.get("perturb") == "blocks" and (
            family == "euclidean" or opts.get("norm") == "linf"
        ):
            raise MeasureError(
                f"measure {text!r}: blocks (attention-only: only the symmetry blocks are "
                "perturbed) is defined for the geodesic and adaptive l2 measures only"
            )
        if family != "geodesic":
            opts.setdefault("order", 1)
            opts["metric"] = ""
        return cls(measure=family, **opts)

    @classmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> Sharpness:  # noqa: D102
        family = kwargs.get("measure", "geodesic")
        geodesic = family == "geodesic"
        return cls(
            measure=family,
            metric=kwargs.get("metric", "inv") if geodesic else "",
            order=kwargs.get("order", 2) if geodesic else 1,
            kind=kwargs.get("kind", "worst"),
            norm=kwargs.get("norm", "l2"),
            perturb=kwargs.get("perturb", "all"),
            corrected_norm=kwargs.get("corrected_norm", True) if geodesic else True,
        )

    @property
    def name(self) -> str:  # noqa: D102
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
    def head_scaled(self) -> bool:
        """Geodesic mix: its heads' norm is in units of the other factor's Gram matrix."""
        return self.measure == "geodesic" and self.metric == "mix" and self.corrected_norm

    @property
    def uses_blocks(self) -> bool:
        """Geodesic sharpness (its geometry) and the attention-only measures (``-blocks``)."""
        return self.measure == "geodesic" or self.perturb == "blocks"

    @property
    def ascends(self) -> bool:
        """The worst case: ``steps`` Auto-PGD steps per batch."""
        return self.kind == "worst"

    def step_cost(self, steps: int, curv: Mapping[str, Any]) -> float:
        """Worst case: ``steps`` × :data:`STEP_COST` + a forward; average: the sampled forwards."""
        if self.kind == "average":
            return (1 + AVERAGE_SAMPLES) * FORWARD_COST
        return steps * STEP_COST.get(self.measure, 1.4) + FORWARD_COST

    def run_settings(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """Steps, ε and seed; the RK4 steps (``exact_steps``) for the exact geodesic only."""
        kw = super().run_settings(available)
        if not self.exact_geodesic:
            kw.pop("exact_steps", None)
        return kw

    @property
    def paper_column(self) -> str | None:
        """``"adaptive"``, or ``"geodesic inv|mix"`` with the corrected norm (SPEC §7)."""
        if self.measure == "adaptive":
            return "adaptive"
        if self.measure == "geodesic" and self.corrected_norm:
            return f"geodesic {self.metric}"
        return None

    def shard_refusal(self) -> str | None:
        """``None``: :func:`geosharp.sharpness` measures every sharpness measure sharded."""
        return None

    def callback_refusal(self) -> str | None:
        """The attention-only and no-corrected-norm variants are refused."""
        if self.perturb != "all" or not self.corrected_norm:
            return (
                "the callback measures every parameter with the corrected norm; the "
                "attention-only (-blocks) and no-corrected-norm (-adaptivenorm) variants are "
                "measured with gs.sharpness(perturb=..., corrected_norm=...) or gs.measure"
            )
        return None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`geosharp.sharpness` that identify the measure."""
        kw: dict[str, Any] = {"measure": self.measure, "kind": self.kind, "norm": self.norm}
        if self.measure == "geodesic":
            kw.update(metric=self.metric, order=self.order, corrected_norm=self.corrected_norm)
        kw["perturb"] = self.perturb
        return kw

    def run(
        self,
        model: Any,
        loss_fn: Callable,
        batches: Iterable,
        *,
        rho: float | None = None,
        **settings: Any,
    ) -> Any:
        """:func:`geosharp.sharpness` of this measure at radius ``rho``."""
        if rho is None:
            raise MeasureError(f"{self.name} needs a radius rho")
        return sharpness(
            model, loss_fn, batches, rho=rho, **{**accepted(sharpness, settings), **self.kwargs()}
        )
