"""A manifest study records the orbit position of every head of every model beside its rows
and its report shows the population's spread (issue 44, deliverable 1); a resumed study
measures nothing again and records the spread of models whose rows were all reused."""

from __future__ import annotations

import sqlite3

import pytest

from geosharp.studies.orbit_spread import folder_rows, head_rows, population_spread
from geosharp.studies.population import PopulationSettings, parse_rho, run_population

from ..measure.conftest import save_tiny_manifest

pytest.importorskip("transformers")

ROWS = [("a", 0.9, 0.7), ("b", 0.95, 0.8), ("c", 0.9, 0.85)]


def _settings(root):
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    options = {"data": str(root / "data.csv"), "seed": 0, "batch_size": 4, "samples": 8,
               "max_length": 32, "device": resolve_device("cpu"),
               "dtype": resolve_dtype("float32")}  # fmt: skip
    return PopulationSettings(
        manifest=str(root / "m.csv"),
        options=options,
        measures=("adaptive-l2", "geodesic-inv-o2"),
        rho=parse_rho(["0.05"]),
        steps=1,
    )


def test_study_stores_the_heads_and_reports_the_spread(tmp_path):
    import transformers

    save_tiny_manifest(tmp_path, ROWS, ["model", "train_accuracy", "test_accuracy"])
    out = tmp_path / "out"
    run_population(_settings(tmp_path), out, progress=False, log=lambda _: None)
    rows = folder_rows(out)
    assert {r["model_id"] for r in rows} == {"a", "b", "c"}
    # the stored heads are those of the saved models
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a")
    mine = [r for r in rows if r["model_id"] == "a"]
    want = head_rows(model.eval(), model_id="a", key_bias="quotient")
    assert len(mine) == len(want) > 0
    got = {(r["block"], r["head"]): r["imbalance"] for r in mine}
    for w in want:
        assert got[(w["block"], w["head"])] == pytest.approx(w["imbalance"], rel=1e-6)
    kinds = {s.category for s in population_spread(rows)}
    assert {"QK", "VO"} <= kinds
    table = (out / "tau_table.md").read_text()
    assert "## Orbit spread of the population" in table
    assert "Orbit spread" in (out / "summary.json").read_text()

    # resumed: nothing measured again; a study whose spread was dropped records it anew
    with sqlite3.connect(out / "study.sqlite") as conn:
        n_rows = conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        conn.execute("DELETE FROM orbit WHERE model_id = 'b'")
    summary = run_population(_settings(tmp_path), out, progress=False, log=lambda _: None)
    assert summary.measured == 0 and summary.reused == n_rows
    assert {r["model_id"] for r in folder_rows(out)} == {"a", "b", "c"}
    assert (out / "tau_table.md").read_text() == table
