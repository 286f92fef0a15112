"""How numbers, radii and values are written in study reports (one place, so every table agrees).

Used by :mod:`geosharp.studies.analysis` (its verdict sentences), :mod:`~geosharp.studies.plots`,
:mod:`~geosharp.studies.render` and :mod:`~geosharp.studies.report` (``summary.json``).

Example:
    >>> fmt(-0.4167), fmt(float("nan")), rho_label(0.01), rho_label(None)
    ('-0.42', 'undefined', 'ρ = 0.01', 'no ρ')
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from geosharp.stats import CorrelationSummary

__all__ = [
    "display",
    "fmt",
    "fmt_p",
    "json_safe",
    "rho_key",
    "rho_label",
    "slug",
    "undefined_reason",
]


def rho_key(rho: float | None) -> tuple[int, float]:
    """Sort key of radii: ``None`` (no ρ) first, then increasing."""
    return (0, 0.0) if rho is None else (1, rho)


def rho_label(rho: float | None) -> str:
    """``"ρ = 0.01"``, or ``"no ρ"`` for a measure without a radius."""
    return "no ρ" if rho is None else f"ρ = {rho:g}"


def fmt(x: float, digits: int = 2) -> str:
    """A number with ``digits`` decimals, ``"undefined"`` when not finite."""
    return f"{x:.{digits}f}" if math.isfinite(x) else "undefined"


def fmt_p(p: float) -> str:
    """A p-value with two significant digits, ``"undefined"`` when not finite."""
    return f"{p:.2g}" if math.isfinite(p) else "undefined"


def undefined_reason(summary: CorrelationSummary) -> str:
    """Why a cell's τ is undefined, from its summary's note."""
    return summary.note.replace(": τ undefined", "")


def json_safe(obj: object) -> object:
    """A JSON-ready copy: numpy scalars as Python numbers, NaN/inf as ``None``, paths as text."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (bool, str)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def display(value: object) -> str:
    """A value as shown in a table: text as is, floats with 4 significant digits, else JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "–"
    return json.dumps(json_safe(value), ensure_ascii=False)


def slug(name: str, taken: set[str]) -> str:
    """A file-name stem for ``name`` not yet in ``taken`` (which it is added to)."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "measure"
    out, k = base, 2
    while out in taken:
        out, k = f"{base}-{k}", k + 1
    taken.add(out)
    return out
