"""Relative flatness (Petzka et al. 2021) of one linear layer: a baseline with no ρ."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from geosharp.errors import MeasureError
from geosharp.estimators.relative_flatness import relative_flatness
from geosharp.measures.base import Measure, register

__all__ = ["RelativeFlatness"]

_NAMES = {"relative-flatness", "relative_flatness", "relflat", "rf"}


@register
@dataclass(frozen=True)
class RelativeFlatness(Measure):
    """Relative flatness ``κ_Tr`` of one ``nn.Linear`` (default: the model's last).

    Attributes:
        layer: Module path of the layer, or ``None`` for the last ``nn.Linear``.

    Example:
        >>> RelativeFlatness.parse("relative-flatness").name
        'relative_flatness'
    """

    layer: str | None = None

    family: ClassVar[str] = "relative flatness"
    uses_rho: ClassVar[bool] = False
    keys: ClassVar[tuple[str, ...]] = ("relative_flatness",)
    grammar: ClassVar[str] = "relative flatness is relative-flatness (no rho)"
    priority: ClassVar[int] = 0

    @classmethod
    def claims(cls, text: str, toks: list[str]) -> bool:  # noqa: D102
        return text.strip().lower() in _NAMES

    @classmethod
    def from_tokens(cls, text: str, toks: list[str]) -> RelativeFlatness:  # noqa: D102
        return cls()

    @classmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> RelativeFlatness:  # noqa: D102
        return cls(layer=kwargs.get("layer"))

    @property
    def name(self) -> str:  # noqa: D102
        return "relative_flatness"

    def step_cost(self, steps: int, curv: Mapping[str, Any]) -> float:
        """Two passes per batch."""
        return 2.0

    def shard_refusal(self) -> str | None:  # noqa: D102
        return "relative flatness of a sharded model is not implemented yet"

    def callback_refusal(self) -> str | None:  # noqa: D102
        return (
            "the callback measures sharpness (geodesic, adaptive, euclidean); curvature and "
            "relative flatness are measured with gs.curvature and gs.relative_flatness"
        )

    def kwargs(self) -> dict[str, Any]:
        """``{"measure": "relative_flatness"}``, with ``layer`` when one is named."""
        kw: dict[str, Any] = {"measure": "relative_flatness"}
        if self.layer is not None:
            kw["layer"] = self.layer
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
        """:func:`geosharp.relative_flatness` of the layer (``rho`` must be ``None``)."""
        if rho is not None:
            raise MeasureError(f"{self.name} takes no radius rho, got {rho}")
        return relative_flatness(model, loss_fn, batches, layer=self.layer)
