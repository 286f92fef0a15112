"""The figures of a study report: one scatter plot of sharpness against gap per measure.

matplotlib's Agg canvas is used directly (no display, no global pyplot state).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from geosharp._io import atomic_write_bytes
from geosharp.studies.analysis import Cell
from geosharp.studies.formatting import fmt, rho_key, rho_label

__all__ = ["log_x", "plot_measure"]


def log_x(values: np.ndarray) -> bool:
    """Log axis when every value is positive and they span more than two decades."""
    return bool(values.size) and bool(np.all(values > 0)) and values.max() / values.min() > 100.0


def plot_measure(
    path: Path,
    measure: str,
    by_rho: dict[float | None, Cell],
    gaps: Mapping[str, float],
    gap_label: str,
) -> bytes:
    """Draw sharpness against gap (a colour per ρ), write the PNG to ``path``, return its bytes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "write_report draws its scatter plots with matplotlib; install it "
            "(pip install matplotlib)"
        ) from err
    fig = Figure(figsize=(5.6, 4.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    all_x: list[float] = []
    all_y: list[float] = []
    for k, rho in enumerate(sorted(by_rho, key=rho_key)):
        cell = by_rho[rho]
        x = np.asarray(cell.values, dtype=float)
        y = np.asarray([gaps[m] for m in cell.model_ids], dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        all_x.extend(x[ok].tolist())
        all_y.extend(y[ok].tolist())
        s = cell.summary
        tau = f"τ-a = {fmt(s.tau_a)}" if s is not None and s.defined else "τ undefined"
        ax.scatter(
            x[ok], y[ok], s=22, color=f"C{k % 10}", alpha=0.8, label=f"{rho_label(rho)}: {tau}"
        )
    xs = np.asarray(all_x)
    if log_x(xs):
        ax.set_xscale("log")
    if log_x(np.asarray(all_y)):
        ax.set_yscale("log")
    if not xs.size:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"sharpness ({measure})")
    ax.set_ylabel(gap_label)
    ax.set_title(measure if len(measure) <= 60 else measure[:57] + "...", fontsize=10)
    ax.grid(alpha=0.3)
    # Below the axes, never over the points (constrained layout makes room for it).
    ax.legend(
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(2, max(1, len(by_rho))),
        frameon=False,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return data
