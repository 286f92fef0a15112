"""What a measure is: :class:`Measure`, the registry of measure classes, and the one grammar.

A measure is an immutable object that knows its canonical :attr:`~Measure.name`, its
:attr:`~Measure.family` (the kind of row it gives in a τ table), whether it takes a radius ρ
(:attr:`~Measure.uses_rho`), the keyword arguments of its estimator that identify it
(:meth:`~Measure.kwargs`), and how it runs (:meth:`~Measure.run`). Every caller, ``gs.measure``,
the studies, the Trainer callback, loops over measure objects and never switches on a name.

A measure class is registered with :func:`register`; :func:`parse_measure` reads a user's
text (``"geodesic-inv-o2"``, ``"adaptive-linf"``, ``"curvature-mix-trace"``, or a name as a
table prints it) by asking each registered class, in order, whether the text is one of its
own (:meth:`Measure.claims`), and :func:`from_kwargs` rebuilds a measure from the keyword
arguments a study plan holds. Adding a measure is one class in one module of this package
(every module here is imported by the package) and its tests.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from geosharp.errors import MeasureError

__all__ = [
    "FORWARD_COST",
    "Measure",
    "MeasureError",
    "Outcome",
    "accepted",
    "from_kwargs",
    "grammar",
    "parse_measure",
    "register",
    "registered",
    "tokens",
]

_REGISTRY: list[type[Measure]] = []

#: A forward pass alone, in forward+backward passes (the unit of :meth:`Measure.step_cost`).
FORWARD_COST = 0.35


def register(cls: type[Measure]) -> type[Measure]:
    """Class decorator: make ``cls`` known to :func:`parse_measure` and :func:`from_kwargs`.

    Classes are asked in the order of their :attr:`Measure.priority` (lowest first), then of
    registration.
    """
    if cls not in _REGISTRY:
        _REGISTRY.append(cls)
        _REGISTRY.sort(key=lambda c: c.priority)
    return cls


def registered() -> tuple[type[Measure], ...]:
    """The registered measure classes, in the order they are asked."""
    return tuple(_REGISTRY)


def grammar() -> str:
    """The grammar of every registered measure, for error messages and ``--help``."""
    shown = sorted(_REGISTRY, key=lambda c: -c.priority)  # sharpness first
    parts = "; ".join(c.grammar for c in shown if c.grammar)
    return (
        f"a measure is one of: {parts}; tokens are separated by hyphens or spaces, "
        "case-insensitively, options in any order; a name as a results table prints it is "
        "read too"
    )


def tokens(text: str) -> list[str]:
    """The lower-case tokens of a measure's text (hyphens and spaces separate them)."""
    return [t for t in re.split(r"[\s\-]+", text.strip().lower()) if t]


def accepted(fn: Callable, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``settings`` that ``fn`` takes as keyword arguments."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in settings.items() if k in params}


def sharpness_row_fields(result: Any, rho: float | None) -> dict[str, Any]:
    """The result-row fields of a ``SharpnessResult`` measured at ``rho``."""
    return {
        "measure": result.measure,
        "rho": rho,
        "value": result.value,
        "per_batch": list(result.per_batch),
        "clean_losses": list(result.clean_losses),
        "perturbed_losses": list(result.perturbed_losses),
        "traces": [list(t) for t in result.traces],
        "time_s": result.time_s,
        "n_forward": result.n_forward,
        "n_backward": result.n_backward,
        "max_relative_speed": result.settings.get("max_relative_speed"),
    }


@dataclass
class Outcome:
    """The numbers of one measurement, as a study's store records them.

    Attributes:
        value: The measure's value.
        per_batch: Its value on every batch.
        clean_losses: The loss of every batch at the model's weights.
        time_s: Wall time in seconds.
        stats: Statistics of the estimate (e.g. a trace's standard error), recorded beside the
            settings but not part of the measurement's identity.
    """

    value: float
    per_batch: list[float]
    clean_losses: list[float]
    time_s: float
    stats: dict[str, Any] = field(default_factory=dict)


class Measure(ABC):
    """One measure of a trained model (a subclass is a frozen dataclass).

    Subclasses set the class attributes, implement :meth:`claims`, :meth:`from_tokens`,
    :meth:`kwargs`, :attr:`name` and :meth:`run`, and are :func:`register`-ed. What the callers
    ask of a measure has a default a new measure may keep: its cost (:meth:`step_cost`,
    :attr:`ascends`), the study settings it takes (:attr:`settings`, :meth:`run_settings`), its
    column of the paper's τ table (:attr:`paper_column`), its plot axis (:attr:`axis_label`),
    whether it uses the symmetry blocks (:attr:`uses_blocks`: no by default), and whether it
    runs on a sharded model (:meth:`shard_refusal`) or in the Trainer callback
    (:meth:`callback_refusal`): the defaults refuse both in one line.
    """

    #: The kind of row it gives: ``"sharpness"``, ``"relative flatness"`` or ``"curvature"``.
    family: ClassVar[str] = "sharpness"
    #: Whether it is measured at radii ρ (a ball, or the noise of the average case).
    uses_rho: ClassVar[bool] = True
    #: The value of ``kwargs()["measure"]`` its instances carry (for :func:`from_kwargs`).
    keys: ClassVar[tuple[str, ...]] = ()
    #: One sentence of the grammar for this class's texts.
    grammar: ClassVar[str] = ""
    #: Classes with a lower priority are asked first by :func:`parse_measure`.
    priority: ClassVar[int] = 100
    #: The run settings it takes from a study or ``gs.measure`` (:meth:`run_settings`);
    #: ``"iters"``, ``"probes"``, ``"trace_method"`` are the curvature settings.
    settings: ClassVar[frozenset[str]] = frozenset({"seed"})

    @property
    def head_scaled(self) -> bool:
        """Whether its ball weighs a head by the size of the head's product, not its own.

        Then a radius moves a head by a multiple of its relative size that depends on the
        weights (the mix metric: ``‖ξ‖ ≈ σ² κ``), and ``gs.measure``'s default radii scale it to
        move heads as far as the scale-free measures do
        (:func:`geosharp.measuring.radii.default_radii`). ``False`` by default.
        """
        return False

    @property
    def nested_in_rho(self) -> bool:
        """Whether its value is a maximum over a ball that contains the balls of smaller ρ.

        Then a point found in a smaller ball is a point of this one, and ``gs.measure`` and the
        studies carry it over (:func:`geosharp.measuring.flags.nest`): the values grow with ρ.
        True for worst-case sharpness; a measure that is a mean (the average case), or has no
        ball, says ``False``.
        """
        return self.uses_rho and self.kwargs().get("kind") == "worst"

    @property
    def exact_geodesic(self) -> bool:
        """Whether it follows the exact (RK4) geodesic (its RK4 steps matter: ``exact_steps``)."""
        return self.kwargs().get("order") == "exact"

    @property
    def uses_blocks(self) -> bool:
        """Whether it uses the model's symmetry blocks (a geometry or a perturbation of them).

        Then ``gs.measure`` lays a sharded model's blocks out on the ranks' rows before any
        measurement (:func:`geosharp.measuring.sharded.check_sharded`), so that a block row
        split across ranks is refused first. ``False`` by default.
        """
        return False

    @property
    def ascends(self) -> bool:
        """Whether it runs ``steps`` ascent steps per batch (its time is steps × a step's time).

        Then the time estimate times a step of it on the model; else it counts
        :meth:`step_cost` passes. ``False`` by default.
        """
        return False

    def step_cost(self, steps: int, curv: Mapping[str, Any]) -> float:
        """Forward+backward passes it takes on one batch (for the time estimate).

        Args:
            steps: The run's ascent steps per batch.
            curv: The run's curvature settings (``iters``, ``probes``, ``trace_method``).

        Returns:
            One pass by default (a measure that takes more says so).
        """
        return 1.0

    def run_settings(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of a study's run settings it takes (those in :attr:`settings`), in order."""
        return {k: v for k, v in available.items() if k in self.settings}

    @property
    def paper_column(self) -> str | None:
        """The family label the paper's τ table reports it under (SPEC §7), or ``None``.

        ``"adaptive"``, ``"geodesic inv"`` or ``"geodesic mix"``; ``None`` (not a paper
        column) by default, whatever its name says.
        """
        return None

    @property
    def axis_label(self) -> str:
        """What a plot's value axis shows for it (its :attr:`family` by default)."""
        return self.family

    def shard_refusal(self) -> str | None:
        """Why it cannot be measured on a sharded (FSDP2) model, in one line; ``None``: it can.

        A measure that runs on a sharded model says so (``None``) by overriding this, and its
        :meth:`run` takes the sharded model as it takes any; the default refuses.
        """
        return f"{type(self).__name__} does not say that it runs on a sharded model"

    def callback_refusal(self) -> str | None:
        """Why the Trainer callback cannot measure it, in one line; ``None``: it can.

        The callback runs it at the callback's radius with the callback's settings and logs the
        result's ``value``; the default refuses.
        """
        return (
            "the callback measures sharpness (geodesic, adaptive, euclidean); "
            f"{type(self).__name__} does not say that the callback can measure it"
        )

    @classmethod
    @abstractmethod
    def claims(cls, text: str, toks: list[str]) -> bool:
        """Whether the text (and its :func:`tokens`) names a measure of this class."""

    @classmethod
    @abstractmethod
    def from_tokens(cls, text: str, toks: list[str]) -> Measure:
        """The measure a claimed text names.

        Raises:
            MeasureError: If an option is unknown, repeated or does not fit this measure.
        """

    @classmethod
    @abstractmethod
    def from_estimator_kwargs(cls, kwargs: Mapping[str, Any]) -> Measure:
        """The measure whose identifying keyword arguments are in ``kwargs``."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The canonical name every result carries, e.g. ``"geodesic-inv-o2 worst l2"``."""

    @abstractmethod
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of its estimator that identify the measure."""

    @abstractmethod
    def run(
        self,
        model: Any,
        loss_fn: Callable,
        batches: Iterable,
        *,
        rho: float | None = None,
        **settings: Any,
    ) -> Any:
        """Measure ``model``: the estimator's result (``SharpnessResult``, ``CurvatureResult``).

        ``settings`` are the run's settings (steps, seed, space, progress, …); each measure
        passes on those its estimator takes and ignores the rest.
        """

    def row_fields(self, result: Any, rho: float | None) -> dict[str, Any]:
        """The fields of the result row (``gs.measure``'s ``MeasureRow``) of one measurement.

        The default reads a ``SharpnessResult`` (:func:`sharpness_row_fields`); a measure with
        another result type says what its row holds (``measure``, ``rho``, ``value``,
        ``per_batch``, ``clean_losses``, ``time_s`` and the pass counts at least).
        """
        return sharpness_row_fields(result, rho)

    def outcome(self, result: Any) -> Outcome:
        """What a study's store records of the estimator's result (a ``SharpnessResult``)."""
        return Outcome(
            value=result.value,
            per_batch=list(result.per_batch),
            clean_losses=list(result.clean_losses),
            time_s=result.time_s,
        )

    @classmethod
    def parse(cls, text: str | Measure) -> Measure:
        """:func:`parse_measure`."""
        return parse_measure(text)

    def __str__(self) -> str:
        return self.name


def parse_measure(text: str | Measure) -> Measure:
    """Read a measure as a user writes it (or as a table prints it).

    Args:
        text: The measure, or a :class:`Measure` (returned as is).

    Returns:
        The measure object of the first registered class that claims the text.

    Raises:
        MeasureError: If no class claims the text, or its class finds it malformed (the message
            gives the grammar).

    Example:
        >>> parse_measure("geo-mix-exact").name
        'geodesic-mix-oexact worst l2'
        >>> parse_measure("curvature-euclidean-lmax").family
        'curvature'
    """
    if isinstance(text, Measure):
        return text
    if not isinstance(text, str):
        raise MeasureError(f"a measure must be a string, got {type(text).__name__}; {grammar()}")
    toks = tokens(text)
    for cls in _REGISTRY:
        if cls.claims(text, toks):
            return cls.from_tokens(text, toks)
    raise MeasureError(f"unknown measure {text!r}: {grammar()}")


def from_kwargs(kwargs: Mapping[str, Any]) -> Measure:
    """The measure of a study plan's keyword arguments (``{"measure": "adaptive", …}``).

    Keys that do not identify the measure (steps, samples, ε, …) are ignored.

    Raises:
        MeasureError: If ``kwargs["measure"]`` names no registered measure.
    """
    key = kwargs.get("measure", "geodesic")
    for cls in _REGISTRY:
        if key in cls.keys:
            return cls.from_estimator_kwargs(kwargs)
    raise MeasureError(f"no measure class takes measure={key!r}")
