"""The figures of a study report: one figure per measure, its values against the gap per ρ.

matplotlib's Agg canvas is used directly (no display, no global pyplot state).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from geosharp._io import atomic_write_bytes
from geosharp.measuring.names import measure_family, registered_measure
from geosharp.studies.analysis import Cell
from geosharp.studies.formatting import fmt, rho_key, rho_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["log_x", "measure_figure", "plot_measure", "value_label"]


def log_x(values: np.ndarray) -> bool:
    """Log axis when every value is positive and they span more than two decades."""
    return bool(values.size) and bool(np.all(values > 0)) and values.max() / values.min() > 100.0


def value_label(measure: str) -> str:
    """What the x axis of a measure's plot shows (:attr:`geosharp.measures.Measure.axis_label`).

    A name no registered measure class claims shows its family (:func:`measure_family`).

    Example:
        >>> value_label("adaptive worst l2"), value_label("relative_flatness")
        ('sharpness', 'relative flatness')
        >>> value_label("geodesic-inv curvature lambda_max")
        'curvature λ_max (geodesic-inv)'
    """
    spec = registered_measure(measure)
    return spec.axis_label if spec is not None else measure_family(measure)


def _panel_title(rho: float | None, cell: Cell) -> str:
    s = cell.summary
    tau = f"τ-a = {fmt(s.tau_a)}" if s is not None and s.defined else "τ undefined"
    return tau if rho is None else f"{rho_label(rho)}: {tau}"


def measure_figure(
    measure: str,
    by_rho: dict[float | None, Cell],
    gaps: Mapping[str, float],
    gap_label: str,
) -> Figure:
    """A measure's values against the gap, as a matplotlib figure (Agg canvas, no display).

    One panel per ρ, side by side with a shared gap axis: the values at different radii
    differ by orders of magnitude, so each panel has its own x axis (every panel logarithmic
    when all values are positive and some panel's span more than two decades,
    :func:`log_x`). A measure without a radius (curvature, relative flatness) has one panel,
    titled with its τ only. The x axis names what is plotted (:func:`value_label`).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "write_report draws its scatter plots with matplotlib; install it "
            "(pip install matplotlib)"
        ) from err
    rhos = sorted(by_rho, key=rho_key)
    n = max(1, len(rhos))
    width = 5.0 if n == 1 else min(11.0, 1.0 + 3.4 * n)
    fig = Figure(figsize=(width, 3.9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    points = []
    for rho in rhos:
        cell = by_rho[rho]
        x = np.asarray(cell.values, dtype=float)
        y = np.asarray([gaps[m] for m in cell.model_ids], dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        points.append((x[ok], y[ok]))
    # One rule for every panel of a figure: logarithmic x when every value is positive and
    # some panel spans more than two decades.
    positive = all(bool(np.all(x > 0)) for x, _ in points)
    log = positive and any(log_x(x) for x, _ in points)
    all_y: list[float] = []
    for k, (ax, rho, (x, y)) in enumerate(zip(axes, rhos, points, strict=False)):
        cell = by_rho[rho]
        all_y.extend(y.tolist())
        ax.scatter(x, y, s=18, color=f"C{k % 10}", alpha=0.8)
        if log and x.size:
            ax.set_xscale("log")
        if not x.size:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(_panel_title(rho, cell), fontsize=9)
        ax.set_xlabel(value_label(measure), fontsize=9)
        if log and x.size:
            _log_ticks(ax, x)
        ax.tick_params(which="both", labelsize=8)
        ax.grid(alpha=0.3)
    if log_x(np.asarray(all_y)):
        axes[0].set_yscale("log")
    axes[0].set_ylabel(gap_label, fontsize=9)
    fig.suptitle(measure if len(measure) <= 80 else measure[:77] + "...", fontsize=10)
    return fig


def _log_ticks(ax: Any, x: np.ndarray) -> None:
    """Labels of a logarithmic x axis that do not run into each other.

    matplotlib labels the minor ticks (2, 3, 4, 6 × 10^k in scientific notation) of a log axis
    that spans less than about two decades, and those labels overlap on a panel a third of a
    figure wide. Here: the decades alone over two decades or more; 1 and 3 × 10^k over one to
    two; under one decade, at most four evenly spaced ticks labelled with just enough digits
    to tell them apart. Minor ticks stay, unlabelled.
    """
    from matplotlib.ticker import (
        Formatter,
        LogFormatterSciNotation,
        LogLocator,
        MaxNLocator,
        NullFormatter,
    )

    class Distinct(Formatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return _distinct_labels([x])[0]

        def format_ticks(self, values: Sequence[float]) -> list[str]:
            return _distinct_labels(list(values))

    span = float(np.log10(x.max() / x.min()))
    if span >= 2.0:
        pass
    elif span >= 1.0:
        ax.xaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 3.0)))
        ax.xaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3))
        ax.xaxis.set_major_formatter(Distinct())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _distinct_labels(values: Sequence[float]) -> list[str]:
    """The values with the fewest significant digits (at least 2) that tell them apart."""
    labels = [f"{v:.2g}" for v in values]
    for digits in range(2, 10):
        labels = [f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == len(labels):
            break
    return labels


def plot_measure(
    path: Path,
    measure: str,
    by_rho: dict[float | None, Cell],
    gaps: Mapping[str, float],
    gap_label: str,
) -> bytes:
    """Draw :func:`measure_figure`, write it as a PNG to ``path`` and return the PNG's bytes."""
    buf = io.BytesIO()
    measure_figure(measure, by_rho, gaps, gap_label).savefig(buf, format="png")
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return data
