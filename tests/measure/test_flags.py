"""Flags and nested balls (issue 40): a value that survives the symmetry or says why it may not.

``geosharp.measuring.flags``: ``instability`` of an ascent's trace, ``nest`` over nested balls,
``cell_flags``; and, as users run it, a trained classifier and a random equivalent twin in
float32 at the default radii: every geodesic cell within 1e-3 of its twin or flagged, every
worst-case value non-decreasing in ρ.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measuring.flags import (
    STABILITY_TOL,
    cell_flags,
    instability,
    nest,
    reference_loss,
)

EPS32 = float(torch.finfo(torch.float32).eps)


def test_instability_of_settled_rising_and_chaotic_traces():
    settled = [0.1, 0.5, 0.6, 0.61] + [0.61] * 6
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    chaotic = [0.02, 1.99, 1.82, 1.97, 0.47, 1.46, 1.19, 0.84, 1.59, 2.05, 0.67, 1.67]
    assert instability(settled) == 0.0
    assert instability(rising) == 0.0  # that is "rising", not "unstable"
    assert instability(chaotic) > 0.5
    # a float32 wobble of a few ulps is rounding, not instability
    wobble = [0.25, 0.70, 0.708, 0.70809, 0.708094, 0.7080941, 0.708094, 0.7080941]
    assert instability(wobble, EPS32) < STABILITY_TOL


def test_cell_flags_say_rising_unstable_and_saturated():
    clean = [0.01]
    ok = cell_flags([[0.01, 0.2, 0.3] + [0.3] * 6], clean, [0.3], loss_eps=EPS32, reference=0.69)
    assert ok.flags == ()
    up = cell_flags([[0.01, 0.1, 0.2, 0.3]], clean, [0.3], loss_eps=EPS32, reference=0.69)
    assert up.flags == ("rising",)
    swing = [0.01, 0.5, 0.2, 0.6, 0.1, 0.5, 0.2, 0.4]
    assert "unstable" in cell_flags([swing], clean, [0.6], loss_eps=EPS32).flags
    carried = cell_flags([[0.01, 0.3] + [0.3] * 6], clean, [0.3], loss_eps=EPS32, carried=1)
    assert carried.flags == ("unstable",) and carried.carried == 1
    sat = cell_flags([[0.01, 0.8] + [0.8] * 6], clean, [0.8], loss_eps=EPS32, reference=0.69)
    assert sat.flags == ("saturated",)
    # a model at chance has no basin to leave: not judged saturated against the reference
    chance = cell_flags([[0.69, 0.8] + [0.8] * 6], [0.69], [0.8], loss_eps=EPS32, reference=0.69)
    assert chance.flags == ()
    # no reference: a rise of 100 times the clean loss
    assert cell_flags([], [0.01], [1.5], loss_eps=EPS32).flags == ("saturated",)
    assert cell_flags([], [0.01], [0.5], loss_eps=EPS32).flags == ()


def test_nest_keeps_the_smaller_balls_better_points():
    values, carried = nest([0.3, 0.5], [0.4, 0.2], EPS32)
    assert values == [0.4, 0.5] and carried == 1
    assert nest(None, [0.1], EPS32) == ([0.1], 0)
    # within rounding: taken, not counted
    values, carried = nest([0.5 + 1e-9], [0.5], EPS32)
    assert values == [0.5 + 1e-9] and carried == 0


def test_reference_loss_is_the_trivial_predictors():
    model = nn.Linear(3, 4)
    x, y = torch.randn(5, 3), torch.randint(0, 4, (5,))
    ce = nn.functional.cross_entropy
    assert reference_loss(model, ce, [(x, y)]) == pytest.approx(math.log(4))
    t = torch.randn(5, 4)
    assert reference_loss(model, nn.functional.mse_loss, [(x, t)]) == pytest.approx(
        float((t**2).mean())
    )

    def needs_an_object(out, targets):  # a loss reading a field of the model's own output
        return out.loss

    assert reference_loss(model, needs_an_object, [(x, y)]) is None


class _Classifier(nn.Module):
    """A one-layer transformer classifier (4 heads of 4), small enough to train in a second."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, ids):
        return self.head(self.layer(self.embed(ids)).mean(1))


@pytest.fixture(scope="module")
def trained():
    """A classifier trained to a low loss on its task (is token 3 in the sequence?)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (96, 6), generator=g)
    y = (ids == 3).any(1).long()
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), y).backward()
        opt.step()
    model.eval()
    return model, [(ids[:48], y[:48]), (ids[48:], y[48:])]


def test_twin_cells_agree_or_are_flagged_in_float32_at_every_default_radius(trained):
    model, batches = trained
    twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(2), scale=10.0)
    # the default radii and one beyond them, where the ascent is chaotic (inv moves 51 % there)
    kw = dict(
        measures=["geodesic-inv-o2", "geodesic-mix-o2", "adaptive"],
        rhos=[*gs.measuring.DEFAULT_RHOS, 3.0],
        warn=lambda _m: None,
    )
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        a, b = (gs.measure(m, batches, "ce", **kw) for m in (model, twin))
    assert a.settings["reference_loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert float(sum(a.clean_losses)) / 2 < 0.2  # trained: far below chance
    moved = 0
    for ra, rb in zip(a.rows, b.rows, strict=True):
        assert (ra.measure, ra.rho) == (rb.measure, rb.rho)
        if ra.measure.startswith("geodesic"):
            rel = abs(ra.value - rb.value) / abs(ra.value)
            assert rel <= 1e-3 or ra.flags, (ra.measure, ra.rho, rel)
            moved += rel > 1e-3
            if ra.rho <= 0.1:
                assert ra.flags == () and rel <= 1e-3  # sound where the ascent settles
    assert moved  # the test reaches cells that the symmetry moves
    for rep in (a, b):  # the balls are nested: the values grow with rho
        for name in {r.measure for r in rep.rows}:
            rows = sorted((r for r in rep.rows if r.measure == name), key=lambda r: r.rho)
            for small, big in itertools.pairwise(rows):
                assert big.value >= small.value
                assert all(v >= u for u, v in zip(small.per_batch, big.per_batch, strict=True))


def test_flags_reach_the_csv_json_and_table(trained):
    model, batches = trained
    rep = gs.measure(
        model, batches, "ce", measures=["geodesic-mix-o2"], rhos=[10.0, 0.001], steps=6,
        warn=lambda _m: None,
    )  # fmt: skip
    assert [r.rho for r in rep.rows] == [0.001, 10.0]  # smallest ball first
    small, big = rep.rows
    assert small.flags == () and "saturated" in big.flags
    assert "flags" in rep.to_csv().splitlines()[0].split(",")
    assert rep.to_dict()["results"][1]["flags"] == list(big.flags)
    assert "saturated" in rep.table()
