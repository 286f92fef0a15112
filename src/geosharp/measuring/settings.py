"""What :func:`geosharp.measure` measures with: one checked, frozen :class:`MeasureSettings`.

``gs.measure`` takes its settings as keywords (the API users call) and builds one
:class:`MeasureSettings` from them before any work; the time estimate and the measuring loop
(:mod:`geosharp.measuring.cells`) take it whole, and every cell runs its measure with
:meth:`MeasureSettings.run_kwargs`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geosharp.estimators.apgd import BUFFER_BUDGET
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.measures import Measure, parse_measure
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.radii import Radii, check_radii
from geosharp.symmetry import ParameterSpace

__all__ = [
    "DEFAULT_CURVATURE_ITERS",
    "DEFAULT_CURVATURE_PROBES",
    "DEFAULT_MEASURES",
    "DEFAULT_STEPS",
    "MeasureSettings",
]

#: The paper's three measures (SPEC §7): adaptive ℓ2, geodesic inv and mix at order 2.
DEFAULT_MEASURES = ("adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2")
#: Auto-PGD iterations, as in the paper (SPEC §6).
DEFAULT_STEPS = 20
#: Lanczos iterations and Hutchinson probes of the curvature measures (``gs.curvature``'s).
DEFAULT_CURVATURE_ITERS = 50
DEFAULT_CURVATURE_PROBES = 100

_CURVATURE_KEYS = frozenset({"iters", "probes", "trace_method"})


@dataclass(frozen=True)
class MeasureSettings:
    """Every setting of one ``gs.measure`` run, checked when built (see :func:`measure`).

    ``measures`` may be given as texts of the grammar (:func:`geosharp.measures.parse_measure`)
    or measure objects and is held as measure objects; ``rhos`` as one grid or measure → grid
    and is held as :data:`~geosharp.measuring.radii.Radii` (``None``: the default radii, chosen
    once the model is checked); ``progress=None`` is held as whether stderr is a terminal.

    Raises:
        MeasureError: On no measures, a bad measure or ρ, ``steps``, ``exact_steps`` or (when a
            measure takes them) ``iters``, ``probes`` or ``trace_method``; one line saying what
            was wrong. The checks run in the order of :func:`measure`'s arguments.
    """

    measures: Sequence[str | Measure] = DEFAULT_MEASURES
    rhos: Sequence[float] | Mapping[str, Sequence[float]] | Radii | None = None
    steps: int = DEFAULT_STEPS
    eps: float = 0.0
    seed: int = 0
    iters: int = DEFAULT_CURVATURE_ITERS
    probes: int = DEFAULT_CURVATURE_PROBES
    trace_method: str = "hutchinson"
    check: bool = True
    low_memory: bool = False
    buffer_budget: float | None = BUFFER_BUDGET
    exact_steps: int = DEFAULT_RK4_STEPS
    progress: bool | None = None

    def __post_init__(self) -> None:
        specs = tuple(parse_measure(m) for m in self.measures)
        if not specs:
            raise MeasureError("no measures given: pass at least one (e.g. geodesic-inv-o2)")
        object.__setattr__(self, "measures", specs)
        object.__setattr__(self, "rhos", check_radii(list(specs), self.rhos))
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise MeasureError(f"steps must be an int >= 1, got {steps!r}")
        if self.takes_curvature_settings:
            for key in ("iters", "probes"):
                n = getattr(self, key)
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise MeasureError(f"{key} must be an int >= 1, got {n!r}")
            if self.trace_method not in ("hutchinson", "hutch++", "exact"):
                raise MeasureError(
                    f"trace_method must be hutchinson, hutch++ or exact, got {self.trace_method!r}"
                )
            if self.trace_method == "hutch++" and self.probes < 3:
                raise MeasureError(f"hutch++ needs at least 3 probes, got {self.probes}")
        n = self.exact_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MeasureError(f"exact_steps must be a positive integer, got {n!r}")
        if self.progress is None:
            object.__setattr__(self, "progress", sys.stderr.isatty())

    @property
    def specs(self) -> list[Measure]:
        """The measures, as measure objects."""
        return list(self.measures)  # type: ignore[arg-type]

    @property
    def grids(self) -> Radii | None:
        """Measure name → its radii, checked (``None``: the defaults, chosen on the model)."""
        return self.rhos  # type: ignore[return-value]

    @property
    def curvature(self) -> dict[str, Any]:
        """The curvature measures' settings: ``iters``, ``probes``, ``trace_method``."""
        return {"iters": self.iters, "probes": self.probes, "trace_method": self.trace_method}

    @property
    def takes_curvature_settings(self) -> bool:
        """Whether a measure takes the curvature settings (``iters``, ``probes``, ...)."""
        return any(s.settings & _CURVATURE_KEYS for s in self.specs)

    def run_kwargs(
        self,
        space: ParameterSpace | None,
        *,
        steps: int | None = None,
        progress: bool | None = None,
    ) -> dict[str, Any]:
        """The settings every measure's ``run`` is called with.

        ``steps``, ``progress``: these instead of the run's (as the time estimate's probe asks).
        """
        return {
            "steps": self.steps if steps is None else steps,
            "eps": self.eps,
            "seed": self.seed,
            "space": space,
            "progress": self.progress if progress is None else progress,
            "low_memory": self.low_memory,
            "buffer_budget": self.buffer_budget,
            "exact_steps": self.exact_steps,
            **self.curvature,
        }
