"""A study carries every cell's flags (issue 40): results.csv, summary.json, the τ with and
without flagged cells, the headline; and its worst-case values grow with ρ (nested balls).

Four tiny random BERT classifiers (weights of standard deviation 0.5) at a small and a large ρ
with 3 steps: the large ball's ascent does not settle, so its cells are flagged (and 3 steps
leave most ascents rising); a rerun reuses every row.
"""

from __future__ import annotations

import csv
import json

import pytest

from geosharp.measuring.flags import FLAGS
from geosharp.studies.population import PopulationSettings, parse_rho, run_population

from ..measure.conftest import save_tiny_manifest

pytest.importorskip("transformers")

ROWS = [("a", 0.9, 0.7), ("b", 0.95, 0.8), ("c", 0.9, 0.85), ("d", 0.8, 0.75)]


def _settings(root):
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    options = {"data": str(root / "data.csv"), "seed": 0, "batch_size": 4, "samples": 8,
               "max_length": 32, "device": resolve_device("cpu"),
               "dtype": resolve_dtype("float32")}  # fmt: skip
    return PopulationSettings(
        manifest=str(root / "m.csv"),
        options=options,
        measures=("geodesic-mix-o2",),
        rho=parse_rho(["100", "0.01"]),
        steps=3,
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    header = ["model", "train_accuracy", "test_accuracy"]
    save_tiny_manifest(root, ROWS, header, initializer_range=0.5)
    out = root / "out"
    lines: list[str] = []
    run_population(_settings(root), out, progress=False, log=lines.append)
    return root, out, lines


def test_results_csv_carries_the_flags_and_values_grow_with_rho(study):
    _, out, lines = study
    rows = list(csv.DictReader((out / "results.csv").open(encoding="utf-8")))
    assert len(rows) == 2 * len(ROWS) and "flags" in rows[0]
    by_model: dict[str, dict[float, dict]] = {}
    for r in rows:
        by_model.setdefault(r["model_id"], {})[float(r["rho"])] = r
        assert r["flags"] != "not recorded"
    flagged = [r for r in rows if r["flags"]]
    assert flagged and all(set(r["flags"].split()) <= set(FLAGS) for r in flagged)
    assert any("unstable" in by_model[m][100.0]["flags"] for m in by_model)
    for cells in by_model.values():  # nested: the large ball never reports less
        assert float(cells[100.0]["value"]) >= float(cells[0.01]["value"])
    said = [line for line in lines if line.startswith("flagged: ")]
    assert len(said) == 1 and f"of the {2 * len(ROWS)} cells measured now" in said[0], lines


def test_summary_and_report_give_tau_with_and_without_flagged_cells(study):
    _, out, _ = study
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    section = next(s for s in summary["sections"] if s["title"] == "Flagged cells")
    assert section["header"][-2:] == ["τ-a, all models", "τ-a, sound only"]
    big = next(row for row in section["rows"] if row[1] == "100")
    n_flagged = int(big[2].split(" / ")[0])
    assert n_flagged >= 1 and big[2].endswith(f"/ {len(ROWS)}")
    assert any("measured cells are flagged" in s for s in summary["headline"])
    assert "Flagged cells" in (out / "report.html").read_text(encoding="utf-8")
    assert "Flagged cells" in (out / "tau_table.md").read_text(encoding="utf-8")


def test_a_rerun_reuses_every_flagged_row(study):
    root, out, _ = study
    again = run_population(_settings(root), out, progress=False, log=lambda _m: None)
    assert again.measured == 0 and again.reused == 2 * len(ROWS)
