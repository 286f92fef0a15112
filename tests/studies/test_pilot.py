"""The pilot of ``--rho auto`` (issue 40): a typical model, never one at chance, said, recorded."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from geosharp.errors import MeasureError
from geosharp.studies.manifest import ManifestRow
from geosharp.studies.pilot import at_chance, choose_pilot, pilot_order
from geosharp.studies.runner import Prepared


def _rows(gaps):
    return [ManifestRow(i + 1, f"m{i}", "x", None, None, g) for i, g in enumerate(gaps)]


def test_the_median_gap_first_then_outwards():
    order = pilot_order(_rows([0.5, 0.1, 0.3, 0.2, 0.9, 0.4]))
    assert [r.model_id for r in order] == ["m2", "m5", "m0", "m3", "m1", "m4"]


def test_models_at_chance_are_set_aside_and_a_named_one_refused():
    rows = _rows([0.5, 0.1, 0.3, 0.2, 0.9])
    chance = {"m2", "m0"}
    said: list[str] = []

    def judge(ready):
        return "at chance: …" if ready.model in chance else None

    def load(row):
        return Prepared(row.model_id, [], None)

    choice = choose_pilot(rows, None, load, said.append, judge=judge)
    assert choice.row.model_id == "m3"  # m2 (median) and m0 at chance, m3 next
    assert [a["model"] for a in choice.set_aside] == ["m2", "m0"]
    assert "3rd closest to the median" in choice.why and len(said) == 2
    assert choice.record()["pilot"] == "m3"
    with pytest.raises(MeasureError, match=r"^--rho auto:m0: the pilot is at chance"):
        choose_pilot(rows, rows[0], load, said.append, judge=judge)
    with pytest.raises(MeasureError, match="most typical models are at chance"):
        choose_pilot(rows, None, load, said.append, judge=lambda _r: "at chance")


def test_at_chance_reads_the_clean_loss_against_the_trivial_predictor():
    torch.manual_seed(0)  # the draws below, whichever tests ran before in this process
    x = torch.randn(32, 3)
    y = (x[:, 0] > 0).long()
    fit = nn.Linear(3, 2)
    with torch.no_grad():
        fit.weight.copy_(torch.tensor([[-20.0, 0, 0], [20.0, 0, 0]]))
        fit.bias.zero_()
    blank = nn.Linear(3, 2)
    with torch.no_grad():
        blank.weight.mul_(1e-4)
        blank.bias.zero_()  # uniform outputs: at chance whatever the labels' balance
    ce = nn.functional.cross_entropy
    assert at_chance(Prepared(fit, [(x, y)], ce)) is None
    why = at_chance(Prepared(blank, [(x, y)], ce))
    assert why is not None and why.startswith("at chance: its clean loss ")
    assert f"{math.log(2):.4g}" in why


def test_a_study_of_models_at_chance_stops_before_measuring(tmp_path):
    pytest.importorskip("transformers")
    from geosharp.measuring.resolve import resolve_device, resolve_dtype
    from geosharp.studies.population import PopulationSettings, parse_rho, run_population

    from ..measure.conftest import save_tiny_manifest

    rows = [("a", 0.9, 0.7), ("b", 0.95, 0.8), ("c", 0.9, 0.85)]
    # fresh heads: logits near 0, loss near ln 2
    save_tiny_manifest(tmp_path, rows, ["model", "train_accuracy", "test_accuracy"])
    options = {"data": str(tmp_path / "data.csv"), "seed": 0, "batch_size": 4, "samples": 8,
               "max_length": 32, "device": resolve_device("cpu"),
               "dtype": resolve_dtype("float32")}  # fmt: skip
    settings = PopulationSettings(
        manifest=str(tmp_path / "m.csv"),
        options=options,
        measures=("geodesic-inv-o2",),
        rho=parse_rho(["auto"]),
        steps=1,
    )
    lines: list[str] = []
    with pytest.raises(MeasureError, match="the 3 most typical models are at chance"):
        run_population(settings, tmp_path / "out", progress=False, log=lines.append)
    assert sum("is not a usable pilot, at chance" in line for line in lines) == 3
    assert not (tmp_path / "out" / "study.sqlite").exists() or not any(
        line.startswith("radii of") for line in lines
    )
