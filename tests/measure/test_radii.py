"""gs.measure's radii (issue 40): one grid, a grid per measure, or the defaults, with geodesic
mix's scaled so that its heads move as far as inv's, and the choice said."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measuring import MeasureError
from geosharp.measuring.radii import DEFAULT_RHOS, head_scale


def _layer():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    return model, [(x, torch.randn(3, 5, 8, dtype=torch.float64))]


def test_head_scale_is_the_mix_norm_of_a_relative_move_over_inv():
    model, _ = _layer()
    space = gs.find_symmetries(model)
    c = head_scale(model, space)
    num = den = 0.0
    theta = space.flatten_module(model).detach()
    for block in space.gl_blocks:
        G, H = block.gather(theta)
        for g, h in zip(G, H, strict=True):  # per head, by the definition
            num += float(torch.trace(g.T @ g @ h.T @ h))
            den += g.shape[1]
    assert c == pytest.approx(math.sqrt(num / den), rel=1e-12)
    # scaling the whole model's heads by s scales tr(M_G M_H) by s^4: c by s^2
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    assert head_scale(model, gs.find_symmetries(model)) == pytest.approx(4 * c, rel=1e-12)


def test_default_radii_scale_mix_and_say_so():
    model, batches = _layer()
    said: list[str] = []
    rep = gs.measure(
        model, batches, nn.functional.mse_loss, measures=["geodesic-inv-o2", "geodesic-mix-o2"],
        steps=1, log=said.append, warn=lambda _m: None,
    )  # fmt: skip
    c = head_scale(model, gs.find_symmetries(model))
    inv = [r.rho for r in rep.rows if r.measure.startswith("geodesic-inv")]
    mix = [r.rho for r in rep.rows if r.measure.startswith("geodesic-mix")]
    assert inv == list(DEFAULT_RHOS)
    for got, base in zip(mix, DEFAULT_RHOS, strict=True):  # on the half-decade ladder
        assert abs(math.log10(got) - math.log10(base * c)) <= 0.25 + 1e-9
        assert round(2 * math.log10(got)) == pytest.approx(2 * math.log10(got), abs=1e-2)
    assert rep.settings["rhos"] == {
        "geodesic-inv-o2 worst l2": list(DEFAULT_RHOS),
        "geodesic-mix-o2 worst l2": mix,
    }
    line = next(x for x in said if x.startswith("radii of geodesic-mix-o2"))
    assert f"c = {c:.3g}" in line and "pass the same --rho to compare models" in line


def test_one_grid_or_a_grid_per_measure_checked_before_any_work():
    model, batches = _layer()
    quiet = dict(steps=1, warn=lambda _m: None)
    rep = gs.measure(
        model, batches, nn.functional.mse_loss, measures=["adaptive", "geodesic-mix-o2"],
        rhos={"adaptive": [0.1, 0.01], "geo-mix": [0.001]}, **quiet,
    )  # fmt: skip
    assert [(r.measure.split()[0], r.rho) for r in rep.rows] == [
        ("adaptive", 0.01), ("adaptive", 0.1), ("geodesic-mix-o2", 0.001)
    ]  # fmt: skip
    for rhos, match in [
        ({"adaptive": [0.1]}, "gives no radii for geodesic-mix-o2"),
        ({"adaptive": [0.1], "geodesic-mix-o2": [1], "euclidean": [1]}, "not measured"),
        ([0.1, -1.0], "every rho must be a number > 0"),
        ({"adaptive": [], "geodesic-mix-o2": [1]}, "no radii given for adaptive"),
        ("0.1", "must be a list of numbers"),
    ]:
        with pytest.raises(MeasureError, match=match):
            gs.measure(
                model, batches, nn.functional.mse_loss, measures=["adaptive", "geodesic-mix-o2"],
                rhos=rhos, **quiet,
            )  # fmt: skip
