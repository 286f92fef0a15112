"""Measures as objects (geosharp.measures): the grammar, the registry, and running one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measures import (
    Curvature,
    Measure,
    MeasureError,
    RelativeFlatness,
    Sharpness,
    from_kwargs,
    parse_measure,
    register,
    registered,
)
from geosharp.measures import base as measures_base

NAMES = [
    ("geodesic-inv-o2", "geodesic-inv-o2 worst l2"),
    ("geo-mix-exact", "geodesic-mix-oexact worst l2"),
    ("geodesic-inv-o1-average", "geodesic-inv-o1 average l2"),
    ("geodesic-mix-o2-blocks", "geodesic-mix-o2-blocks worst l2"),
    ("geodesic-inv-adaptivenorm", "geodesic-inv-o2-adaptivenorm worst l2"),
    ("adaptive", "adaptive worst l2"),
    ("adaptive-linf", "adaptive worst linf"),
    ("ada-l2-avg", "adaptive average l2"),
    ("adaptive-blocks", "adaptive-blocks worst l2"),
    ("euclidean", "euclidean worst l2"),
    ("curvature-inv-lmax", "geodesic-inv curvature lambda_max"),
    ("curvature-mix-trace", "geodesic-mix curvature trace"),
    ("curvature-euclidean-lmin", "euclidean curvature lambda_min"),
    ("curvature-adaptive-tr", "adaptive curvature trace"),
    ("relative-flatness", "relative_flatness"),
]


@pytest.mark.parametrize("text, name", NAMES)
def test_every_name_reads_back_to_itself(text, name):
    m = parse_measure(text)
    assert m.name == name
    assert parse_measure(name) == m  # a name as the table prints it is read too
    assert from_kwargs(m.kwargs()) == m  # the keyword form identifies it as well
    assert str(m) == name


def test_families_and_radii():
    assert (Sharpness().family, Sharpness.uses_rho) == ("sharpness", True)
    assert (Curvature().family, Curvature.uses_rho) == ("curvature", False)
    assert (RelativeFlatness().family, RelativeFlatness.uses_rho) == ("relative flatness", False)
    assert {Sharpness, Curvature, RelativeFlatness} <= set(registered())


@pytest.mark.parametrize(
    "text, match",
    [
        ("geodesic-inv-mix", "metric twice"),
        ("adaptive-inv", "geodesic sharpness only"),
        ("geodesic-linf", "l-infinity"),
        ("euclidean-blocks", "blocks"),
        ("adaptive-adaptivenorm", "adaptivenorm"),
        ("curvature-o2-lmax", "no order"),
        ("curvature-inv", "which curvature quantity"),
        ("curvature-euclidean-mix-lmax", "geodesic curvature only"),
        ("curvature-lmax-curvature", "twice"),
        ("sharpest", "unknown measure"),
        ("geodesic-fast", "unknown option"),
    ],
)
def test_bad_texts_say_why(text, match):
    with pytest.raises(MeasureError, match=match):
        parse_measure(text)


def test_study_kwargs_keep_their_identity_only():
    kw = {"measure": "geodesic", "metric": "mix", "steps": 7, "eps": 0.0, "samples": 3}
    assert from_kwargs(kw) == Sharpness(metric="mix")
    assert from_kwargs({"measure": "adaptive", "steps": 5}).name == "adaptive worst l2"
    assert from_kwargs({"measure": "relative_flatness", "layer": "head"}).layer == "head"
    with pytest.raises(MeasureError, match="no measure class"):
        from_kwargs({"measure": "flatness?"})


@pytest.fixture(scope="module")
def model_and_batches():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    y = torch.randn(4, 5, 8, generator=g, dtype=torch.float64)
    return model, [(x, y)]


def test_running_a_measure_is_calling_its_estimator(model_and_batches):
    model, batches = model_and_batches
    loss = nn.functional.mse_loss
    m = parse_measure("geodesic-mix-o2")
    res = m.run(model, loss, batches, rho=0.05, steps=4, cache=False, not_a_setting=1)
    ref = gs.sharpness(model, loss, batches, measure="geodesic", metric="mix", rho=0.05, steps=4)
    assert res.value == ref.value and res.measure == m.name
    out = m.outcome(res)
    assert (out.value, out.per_batch, out.stats) == (res.value, list(res.per_batch), {})

    c = parse_measure("curvature-inv-trace")
    cres = c.run(model, loss, batches, probes=8, iters=5, seed=3, steps=99)
    cref = gs.curvature(
        model, loss, batches, quantities=("trace",), probes=8, iters=5, seed=3, metric="inv"
    )
    assert cres.values["trace"] == cref.values["trace"]
    cout = c.outcome(cres)
    assert cout.value == cref.values["trace"]
    assert cout.stats["trace_stderr"] == float(cref.trace_stderr)


def test_radius_rules(model_and_batches):
    model, batches = model_and_batches
    loss = nn.functional.mse_loss
    with pytest.raises(MeasureError, match="needs a radius"):
        Sharpness().run(model, loss, batches)
    with pytest.raises(MeasureError, match="takes no radius"):
        Curvature().run(model, loss, batches, rho=0.1)
    with pytest.raises(MeasureError, match="takes no radius"):
        RelativeFlatness().run(model, loss, batches, rho=0.1)


def test_a_new_measure_is_one_registered_class(model_and_batches, monkeypatch):
    # what a contributor writes: one class, registered; the grammar and from_kwargs know it
    monkeypatch.setattr(measures_base, "_REGISTRY", list(measures_base._REGISTRY))

    @register
    @dataclass(frozen=True)
    class CleanLoss(Measure):
        family: ClassVar[str] = "sharpness"
        uses_rho: ClassVar[bool] = False
        keys: ClassVar[tuple[str, ...]] = ("clean_loss",)
        grammar: ClassVar[str] = "the clean loss is clean-loss"

        @classmethod
        def claims(cls, text, toks):
            return toks == ["clean", "loss"]

        @classmethod
        def from_tokens(cls, text, toks):
            return cls()

        @classmethod
        def from_estimator_kwargs(cls, kwargs):
            return cls()

        @property
        def name(self):
            return "clean loss"

        def kwargs(self):
            return {"measure": "clean_loss"}

        def run(self, model, loss_fn, batches, *, rho=None, **settings):
            with torch.no_grad():
                values = [float(loss_fn(model(x), y)) for x, y in batches]
            return gs.SharpnessResult(
                value=sum(values) / len(values),
                per_batch=values,
                clean_losses=values,
                perturbed_losses=values,
                measure=self.name,
                settings={},
                time_s=0.0,
                n_forward=len(values),
            )

    m = parse_measure("clean-loss")
    assert isinstance(m, CleanLoss) and from_kwargs({"measure": "clean_loss"}) == m
    assert "the clean loss is clean-loss" in measures_base.grammar()
    model, batches = model_and_batches
    rep = gs.measure(model, batches, measures=["clean-loss", "adaptive"], rhos=[0.1], steps=2)
    (row,) = [r for r in rep.rows if r.measure == "clean loss"]
    assert row.rho is None
    assert row.value == pytest.approx(
        float(nn.functional.mse_loss(model(batches[0][0]), batches[0][1]))
    )


def test_the_function_and_the_package_have_different_names():
    """``gs.measure`` is the function; the command's package is ``geosharp.measuring``."""
    import importlib.util

    assert callable(gs.measure) and gs.measure.__module__ == "geosharp.measuring.core"
    assert importlib.util.find_spec("geosharp.measure") is None
