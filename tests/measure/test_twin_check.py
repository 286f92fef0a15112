"""``gs.twin_check`` (issue 40, deliverable 6): a model and one random equivalent twin, measured the
same way, cell by cell.

A float64 ``nn.TransformerEncoderLayer`` (its attention heads are GL(h) blocks): geodesic inv and
mix give the twin's value to 1e-8 relative at a small ρ, adaptive sharpness does not; a model
without symmetry blocks gets one line and nothing measured; a bad scale is refused before any work.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.errors import MeasureError, MeasureWarning


def _layer_and_batches():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    batches = [
        (torch.randn(4, 5, 8, dtype=torch.float64), torch.randn(4, 5, 8, dtype=torch.float64))
        for _ in range(2)
    ]
    return layer, batches


def test_geodesic_cells_keep_their_value_on_the_twin_and_adaptive_ones_do_not():
    layer, batches = _layer_and_batches()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    measures = ["geodesic-inv-o2", "geodesic-mix-o2", "adaptive-l2"]
    tc = gs.twin_check(layer, batches, measures=measures, rhos=[0.01], steps=3, seed=1,
                       warn=lambda _msg: None)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())  # not written
    by = {r.measure: r for r in tc.rows}
    assert set(by) == {"geodesic-inv-o2 worst l2", "geodesic-mix-o2 worst l2", "adaptive worst l2"}
    for name in ("geodesic-inv-o2 worst l2", "geodesic-mix-o2 worst l2"):
        assert by[name].relative_change < 1e-8 and by[name].reading() == "held"
    assert by["adaptive worst l2"].relative_change > 1e-4  # the symmetry moves adaptive sharpness
    assert by["adaptive worst l2"].reading() == "not invariant"
    assert tc.held and not tc.silent and tc.dtype == "float64" and tc.n_blocks > 0
    assert tc.output_change < 1e-12 and tc.model_report is not None
    assert tc.twin_report.rows[0].value == by["geodesic-inv-o2 worst l2"].twin_value
    text = tc.table()
    assert "held" in text and "not invariant" in text and "no broken promise" in text
    d = json.loads(json.dumps(tc.to_dict()))
    assert d["scale"] == 10.0 and d["seed"] == 1 and len(d["rows"]) == 3
    assert d["rows"][0]["reading"] == "held" and d["rows"][0]["promised"] is True


def test_a_model_without_symmetry_blocks_is_said_in_one_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(6, 4), torch.randint(0, 3, (6,)))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tc = gs.twin_check(model, batches, steps=2)
    said = [str(w.message) for w in caught if issubclass(w.category, MeasureWarning)]
    assert len(said) == 1 and "no symmetry blocks" in said[0] and "\n" not in said[0]
    assert tc.rows == [] and tc.table() == said[0] and tc.model_report is None
    assert tc.to_dict()["note"] == said[0]


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "10", True])
def test_a_bad_scale_is_refused_before_any_work(scale):
    layer, batches = _layer_and_batches()
    with pytest.raises(MeasureError, match="scale must be a finite number > 0"):
        gs.twin_check(layer, batches, scale=scale)


def test_a_bad_measure_is_refused_in_one_line():
    layer, batches = _layer_and_batches()
    with pytest.raises(MeasureError, match="geodesic-nope") as err:
        gs.twin_check(layer, batches, measures=["geodesic-nope"])
    assert "\n" not in str(err.value)
