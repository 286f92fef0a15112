"""How a population's radii are chosen (``geosharp study MANIFEST --rho``).

One grid for every measure (``--rho 0.01 0.1 1``), one per measure or family (``--rho
adaptive=0.1,0.316,1 geodesic=0.01,0.0316,0.1``), or the ρ rule of the built-in studies on a
pilot model (``--rho auto``, ``auto:NAME``): :class:`RadiusPlan`, read by :func:`parse_rho`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geosharp.errors import MeasureError
from geosharp.measures import Measure, parse_measure

__all__ = ["RadiusPlan", "parse_rho", "rho_plan"]


@dataclass(frozen=True)
class RadiusPlan:
    """How the radii of a population are chosen (``--rho``).

    Attributes:
        grid: One grid for every measure that takes ρ, or ``None``.
        per_key: Grids per measure name or family (``"adaptive"``, ``"geodesic"``, …).
        pilot: ``None``, or the model whose sharpness sets every measure's grid by the ρ rule
            (``""``: a typical model, :func:`geosharp.studies.pilot.choose_pilot`).
    """

    grid: tuple[float, ...] | None = None
    per_key: tuple[tuple[str, tuple[float, ...]], ...] = ()
    pilot: str | None = None

    def text(self) -> str:
        """As the log and the report say it."""
        if self.pilot is not None:
            return f"ρ rule on the pilot {self.pilot or '(a typical model, not at chance)'}"
        if self.grid is not None:
            return "one grid: " + ", ".join(f"{r:g}" for r in self.grid)
        return "; ".join(f"{k} " + ", ".join(f"{r:g}" for r in g) for k, g in self.per_key)

    def grid_of(self, measure: Measure) -> tuple[float, ...]:
        """The grid of one measure (by its name, then its family's key).

        Raises:
            MeasureError: If the plan has no grid for it.
        """
        if self.grid is not None:
            return self.grid
        keys = dict(self.per_key)
        if measure.name in keys:
            return keys[measure.name]
        family = measure.kwargs().get("measure", "")
        if family in keys:
            return keys[family]
        raise MeasureError(
            f"--rho gives no radii for {measure.name}: add {family}=R1,R2,... (or one grid for "
            "all measures)"
        )


def _radii(text: str, where: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise MeasureError(f"--rho {where}: {text!r} is not a list of numbers") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise MeasureError(f"--rho {where}: radii must be finite numbers > 0, got {text!r}")
    return values


def parse_rho(values: Sequence[str] | None) -> RadiusPlan:
    """Read ``--rho``: numbers (one grid), ``KEY=R1,R2,...`` clauses, or ``auto[:MODEL]``.

    Example:
        >>> parse_rho(["0.01", "0.1"]).grid
        (0.01, 0.1)
        >>> parse_rho(["adaptive=0.1,1", "geodesic=0.01"]).per_key
        (('adaptive', (0.1, 1.0)), ('geodesic', (0.01,)))
        >>> parse_rho(["auto:run-3"]).pilot
        'run-3'
    """
    if not values:
        return RadiusPlan(pilot="")
    if len(values) == 1 and values[0].split(":")[0].strip().lower() == "auto":
        pilot = values[0].partition(":")[2]
        return RadiusPlan(pilot=pilot.strip())
    if all("=" in v for v in values):
        clauses = []
        for v in values:
            key, _, grid = v.partition("=")
            key = key.strip()
            if key in {"geodesic", "adaptive", "euclidean"}:
                name = key
            else:
                name = parse_measure(key).name
            clauses.append((name, _radii(grid, key)))
        return RadiusPlan(per_key=tuple(clauses))
    if any("=" in v for v in values):
        raise MeasureError(
            "--rho: give one grid (numbers), or KEY=R1,R2,... for every measure or family, "
            "or auto[:MODEL]; not both"
        )
    return RadiusPlan(grid=_radii(" ".join(values), "grid"))


def rho_plan(rho: Any) -> RadiusPlan:
    """The plan of what :func:`geosharp.study` takes as ``rho`` (None, auto, a grid, a dict)."""
    if rho is None or isinstance(rho, str):
        return parse_rho(None if rho is None else [rho])
    if isinstance(rho, Mapping):
        return parse_rho([f"{k}=" + ",".join(str(float(r)) for r in v) for k, v in rho.items()])
    return parse_rho([str(float(r)) for r in rho])
