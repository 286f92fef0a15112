"""Study plots: one panel per ρ (issue 13), curvature axes named as curvature (issue 12)."""

import numpy as np
import pytest

from geosharp.stats import correlation_summary
from geosharp.studies.analysis import Cell
from geosharp.studies.plots import measure_figure, plot_measure, value_label

GAP = "test error − train error"


def _cells(measure, rhos, scale=lambda rho, i: (rho or 1.0) ** 2 * (1 + i)):
    gaps = {f"m{i}": 0.01 * (i + 1) for i in range(8)}
    out = {}
    for rho in rhos:
        values = [float(scale(rho, i)) for i in range(8)]
        cell = Cell(measure, rho, list(gaps), values)
        cell.summary = correlation_summary(list(gaps.values()), values, n_boot=20, n_perm=5)
        out[rho] = cell
    return out, gaps


def test_one_panel_per_rho_each_with_its_own_x_axis():
    by_rho, gaps = _cells("adaptive worst l2", (0.1, 0.316, 1.0))
    fig = measure_figure("adaptive worst l2", by_rho, gaps, GAP)
    axes = fig.axes
    assert len(axes) == 3
    assert [ax.get_title() for ax in axes] == [
        "ρ = 0.1: τ-a = 1.00",
        "ρ = 0.316: τ-a = 1.00",
        "ρ = 1: τ-a = 1.00",
    ]
    # each panel spans its own values: ρ = 1's values (1 … 8) are off ρ = 0.1's axis
    assert axes[0].get_xlim()[1] < 1.0 and axes[2].get_xlim()[0] > 0.5
    assert all(ax.get_xlabel() == "sharpness" for ax in axes)
    assert axes[0].get_ylabel() == GAP
    assert fig.get_suptitle() == "adaptive worst l2"


def test_log_axis_on_every_panel_or_none():
    # ρ = 1 spans three decades; ρ = 0.1 less than one: both panels logarithmic
    by_rho, gaps = _cells(
        "adaptive worst l2", (0.1, 1.0), lambda rho, i: (1 + i) if rho == 0.1 else 10.0**i / 1e3
    )
    fig = measure_figure("adaptive worst l2", by_rho, gaps, GAP)
    assert [ax.get_xscale() for ax in fig.axes] == ["log", "log"]
    # a negative value (average case) keeps every panel linear
    by_rho, gaps = _cells(
        "adaptive average l2", (0.1, 1.0), lambda rho, i: 10.0**i / 1e3 if rho == 1.0 else i - 1
    )
    fig = measure_figure("adaptive average l2", by_rho, gaps, GAP)
    assert [ax.get_xscale() for ax in fig.axes] == ["linear", "linear"]


@pytest.mark.parametrize(
    ("measure", "label"),
    [
        ("geodesic-inv curvature lambda_max", "curvature λ_max (geodesic-inv)"),
        ("geodesic-mix curvature trace", "curvature trace (geodesic-mix)"),
        ("euclidean curvature lambda_min", "curvature λ_min (euclidean)"),
        ("adaptive curvature trace", "curvature trace (adaptive)"),
        ("relative_flatness", "relative flatness"),
        ("geodesic-inv-o2 worst l2", "sharpness"),
    ],
)
def test_curvature_axes_are_labelled_curvature_without_rho(measure, label):
    assert value_label(measure) == label
    by_rho, gaps = _cells(measure, (None,))
    fig = measure_figure(measure, by_rho, gaps, GAP)
    (ax,) = fig.axes
    assert ax.get_xlabel() == label
    if measure != "geodesic-inv-o2 worst l2":
        assert "sharpness" not in ax.get_xlabel()
        assert ax.get_title() == "τ-a = 1.00"  # no "no ρ"
        assert "ρ" not in ax.get_title()


def test_plot_measure_writes_the_png_it_returns(tmp_path):
    by_rho, gaps = _cells("adaptive worst l2", (0.1, 1.0))
    data = plot_measure(tmp_path / "a.png", "adaptive worst l2", by_rho, gaps, GAP)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "a.png").read_bytes() == data
    assert np.frombuffer(data, dtype=np.uint8).size > 1000


def _overlapping_tick_labels(fig):
    """Pairs of drawn x tick labels (major or minor, any panel) whose boxes overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        for minor in (False, True):
            ticks, labels = ax.get_xticks(minor=minor), ax.get_xticklabels(minor=minor)
            for loc, label in zip(ticks, labels, strict=True):
                if label.get_visible() and label.get_text() and lo <= loc <= hi:
                    boxes.append((label.get_text(), label.get_window_extent(renderer)))
    return [
        (a, b)
        for i, (a, box) in enumerate(boxes)
        for b, other in boxes[i + 1 :]
        if box.overlaps(other)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_tick_labels_of_log_panels_do_not_overlap(seed):
    """ρ = 0.316, 3.16, 31.6 on log axes: the panels spanning a decade or less labelled sparsely."""
    rng = np.random.default_rng(seed)
    small = 10 ** rng.uniform(-5, 0) * 10 ** rng.uniform(0, 3, 8)  # > 2 decades: log axes
    mid, large = rng.uniform(0.3, 3, 8), rng.uniform(1.0, 9.5, 8) * 10 ** rng.integers(0, 3)
    values = {0.316: small, 3.16: mid, 31.6: large}
    by_rho, gaps = _cells("adaptive worst l2", values, scale=lambda rho, i: values[rho][i])
    fig = measure_figure("adaptive worst l2", by_rho, gaps, GAP)
    assert all(ax.get_xscale() == "log" for ax in fig.axes)
    assert _overlapping_tick_labels(fig) == []
    for ax in fig.axes:  # every panel keeps at least two labelled ticks in view
        lo, hi = sorted(ax.get_xlim())
        assert sum(lo <= t <= hi for t in ax.get_xticks()) >= 2
