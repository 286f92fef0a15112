"""``gs.measure``'s radii: one grid for every measure, a grid per measure, or the defaults.

The default grid is a decade apart, ``0.01, 0.1, 1``, and it means the same for the scale-free
measures: adaptive sharpness and geodesic inv move every coordinate, and every head, by about ρ
of its own size. Geodesic mix does not: its norm weighs a head's factor by the Gram matrix of
the *other* factor (SPEC §4.1), so a move of ``κ`` times a head's size has mix norm
``κ·√tr(M_G M_H)`` per factor against inv's ``κ·√h``. On ten tiny BERTs trained with the HF
``Trainer`` the ratio ``c`` below was 0.015–0.25: the default ρ = 1 moved their heads 4–70
times as far under mix as under inv, the ball left the basin (a clean loss of 0.005 rose by
2.4–4.6) and every such cell was chaotic (issue 40).

So by default (``rhos=None``) a measure whose ball is head-scaled (:attr:`Measure.head_scaled`)
gets the default grid times

.. code-block:: text

    c = √( Σ_heads tr(M_G M_H) / Σ_heads h )          (M = GᵀG, every GL head of the model)

snapped to the half-decade ladder ``10^{k/2}``: at each of its radii a head moves as far, for
its size, as under inv at the default grid. Nothing is measured to choose it (no pass: the Gram
matrices of the weights), and the choice is printed. ``c`` depends on the model, so two models'
default mix grids may differ: pass the same radii (``rhos=``, ``--rho``) to compare models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from geosharp.measures import Measure, parse_measure
from geosharp.measuring.errors import MeasureError
from geosharp.symmetry import ParameterSpace

__all__ = ["DEFAULT_RHOS", "Radii", "check_radii", "default_radii", "grid_setting", "head_scale"]

#: One decade apart: the paper reports no ρ, and the measures scale differently with it.
DEFAULT_RHOS = (0.01, 0.1, 1.0)

#: Measure name → its radii, smallest first.
Radii = dict[str, list[float]]


def head_scale(model: nn.Module, space: ParameterSpace | None) -> float | None:
    """``c = √(Σ tr(M_G M_H) / Σ h)`` over every GL head of ``space`` (``None``: no head)."""
    if space is None or not space.gl_blocks:
        return None
    with torch.no_grad():
        theta = space.flatten_module(model)
    num, den = 0.0, 0
    for block in space.gl_blocks:
        G, H = (t.to(torch.float64) for t in block.gather(theta))
        num += float(torch.einsum("bij,bji->", G.mT @ G, H.mT @ H))
        den += G.shape[0] * G.shape[-1]
    return math.sqrt(num / den) if den and num > 0 else None


def _snap(rho: float) -> float:
    """``ρ`` on the half-decade ladder ``10^{k/2}``, 3 significant digits."""
    return float(f"{10 ** (round(2 * math.log10(rho)) / 2):.3g}")


def _checked(values: Any, what: str) -> list[float]:
    try:
        radii = list(values)
    except TypeError:
        raise MeasureError(f"{what} must be a list of numbers > 0, got {values!r}") from None
    if not radii:
        raise MeasureError(f"no radii given for {what}: pass at least one rho > 0")
    for r in radii:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise MeasureError(f"every rho must be a number > 0, got {r!r}")
        if not math.isfinite(r):
            raise MeasureError(f"every rho must be finite, got {r!r}")
    return sorted(float(r) for r in radii)


def check_radii(
    specs: Sequence[Measure], rhos: Sequence[float] | Mapping[str, Sequence[float]] | None
) -> Radii | None:
    """Every measure's radii, checked before any work (``None``: the defaults, decided later).

    Args:
        specs: The measures.
        rhos: One grid for every measure; or measure (any spelling ``parse_measure`` reads) →
            its grid, every measure with ρ named once; or ``None``.

    Raises:
        MeasureError: On a radius that is not a finite number > 0, an empty grid, a measure of
            the mapping that is not measured, or a measure with ρ the mapping leaves out.
    """
    with_rho = [s for s in specs if s.uses_rho]
    if rhos is None:
        return None
    if isinstance(rhos, Mapping):
        grids: Radii = {}
        for key, values in rhos.items():
            name = parse_measure(key).name
            if name not in {s.name for s in with_rho}:
                raise MeasureError(f"rhos names {key!r}, which is not measured (or has no rho)")
            grids[name] = _checked(values, name)
        missing = [s.name for s in with_rho if s.name not in grids]
        if missing:
            raise MeasureError(f"rhos gives no radii for {', '.join(missing)}")
        return grids
    if isinstance(rhos, (str, bytes)):
        raise MeasureError(f"rhos must be a list of numbers > 0, got {rhos!r}")
    grid = _checked(rhos, "rhos") if with_rho else []
    return {s.name: list(grid) for s in with_rho}


def default_radii(
    specs: Sequence[Measure], model: nn.Module, space: ParameterSpace | None
) -> tuple[Radii, list[str]]:
    """The default grids and the lines that say them (module docstring).

    Returns:
        ``(measure name → radii, lines to print)``.
    """
    grids: Radii = {}
    lines: list[str] = []
    scaled = [s for s in specs if s.uses_rho and s.head_scaled]
    c = head_scale(model, space) if scaled else None
    for s in specs:
        if not s.uses_rho:
            continue
        if s.head_scaled and c is not None:
            grids[s.name] = [_snap(r * c) for r in DEFAULT_RHOS]
        else:
            grids[s.name] = list(DEFAULT_RHOS)
    default = ", ".join(f"{r:g}" for r in DEFAULT_RHOS)
    lines.append(f"radii: {default} (the default grid)")
    for s in scaled:
        if c is None:
            lines.append(
                f"radii of {s.name}: {default}, not scaled (no GL head to scale by, or a sharded "
                "model); its ρ moves heads by a different multiple of their size than inv's"
            )
            continue
        lines.append(
            f"radii of {s.name}: "
            + ", ".join(f"{r:g}" for r in grids[s.name])
            + f" (the default grid × c = {c:.3g}, on the half-decade ladder: its heads move as "
            "far for their size as under inv at the default grid; c depends on the weights, "
            "so pass the same --rho to compare models)"
        )
    return grids, lines


def grid_setting(grids: Radii) -> list[float] | dict[str, list[float]]:
    """``settings["rhos"]``: one list when every measure has the same grid, else the mapping."""
    values = list(grids.values())
    if values and all(v == values[0] for v in values):
        return list(values[0])
    return {k: list(v) for k, v in grids.items()}
