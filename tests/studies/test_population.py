"""Your own population: geosharp study MANIFEST and gs.study on small real populations.

Four tiny BERT classifiers saved with their tokenizer (Hugging Face folders), a manifest of
their accuracies and hyperparameters, a CSV of text and labels: the τ of summary.json is the
τ of results.csv against the manifest's gaps, every value is gs.sharpness of that model with
the same settings, a killed run resumes without recomputing, two shards merged are one run,
and bad manifests are refused before any model is measured.
"""

from __future__ import annotations

import csv
import json
import math
import sqlite3
from pathlib import Path

import pytest

import geosharp as gs
from geosharp.cli import main
from geosharp.errors import MeasureError
from geosharp.measures import parse_measure
from geosharp.stats import kendall_tau_a
from geosharp.studies.population import (
    PopulationSettings,
    PopulationStudy,
    parse_rho,
    run_population,
)
from geosharp.studies.population_call import study
from geosharp.studies.shards import Shard, shard_of

from ..measure.conftest import CORPUS, make_tokenizer, save_tiny_classifier

transformers = pytest.importorskip("transformers")

ROWS = [  # model, train_accuracy, test_accuracy, lr, width
    ("bert-a", 1.00, 0.70, 0.1, 1),
    ("bert-b", 0.95, 0.80, 0.01, 1),
    ("bert-c", 0.90, 0.85, 0.1, 2),
    ("bert-d", 0.99, 0.75, 0.01, 2),
]
OPTS = dict(batch_size=4, samples=8, max_length=16, device="cpu", dtype="float32")
MEASURES = ("adaptive-l2", "geodesic-inv-o2")


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    root = tmp_path_factory.mktemp("population")
    tok = make_tokenizer()
    for i, (name, *_rest) in enumerate(ROWS):
        save_tiny_classifier(root / "models" / name, tok, seed=i)
        tok.save_pretrained(root / "models" / name)
    with (root / "data.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i, text in enumerate((CORPUS * 2)[:8]):
            w.writerow([text, i % 2])
    with (root / "manifest.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", "train_accuracy", "test_accuracy", "lr", "width"])
        for name, tr, te, lr, width in ROWS:
            w.writerow([f"models/{name}", tr, te, lr, width])
    return root


def settings(root, **change):
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    opts = {**OPTS, "device": resolve_device("cpu"), "dtype": resolve_dtype("float32")}
    base = dict(
        manifest=str(root / "manifest.csv"),
        options={"data": str(root / "data.csv"), "seed": 0, **opts},
        measures=MEASURES,
        rho=parse_rho(["0.01", "0.1"]),
        steps=3,
    )
    return PopulationSettings(**{**base, **change})


@pytest.fixture(scope="module")
def finished(population, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    lines: list[str] = []
    summary = run_population(settings(population), out, progress=False, log=lines.append)
    return out, summary, lines


def read_results(out):
    with (out / "results.csv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def gaps():
    return {f"models/{name}": tr - te for name, tr, te, *_ in ROWS}


def test_tau_of_the_summary_is_the_tau_of_results_and_manifest(finished):
    out, summary, lines = finished
    assert summary.measured == 4 * 2 * 2 and summary.failures == []
    rows = read_results(out)
    assert len(rows) == 16
    cells = json.loads((out / "summary.json").read_text())["cells"]
    assert len(cells) == 4
    g = gaps()
    for cell in cells:
        mine = sorted(
            (r for r in rows if r["measure"] == cell["measure"] and float(r["rho"]) == cell["rho"]),
            key=lambda r: r["model_id"],
        )
        t = [g[r["model_id"]] for r in mine]
        s = [float(r["value"]) for r in mine]
        assert cell["tau_a"] == pytest.approx(kendall_tau_a(t, s), abs=1e-12)
    assert any("gap = train_accuracy − test_accuracy" in line for line in lines)
    text = (out / "report.html").read_text(encoding="utf-8")
    assert "train_accuracy − test_accuracy" in text
    assert "Granulated τ per hyperparameter" in text and "Conditional mutual information" in text
    assert "Models and their symmetry blocks" in text


def test_each_value_is_gs_sharpness_of_that_model(finished, population):
    out, _, _ = finished
    from geosharp.measuring.pipeline import MeasureOptions, ModelSource, load_for_measure
    from geosharp.measuring.prepare import prepare_measurement

    s = settings(population)
    opts = MeasureOptions(**s.options)
    rows = read_results(out)
    for name in ("bert-a", "bert-d"):
        ready = load_for_measure(ModelSource(str(population / "models" / name)), opts)
        checked = prepare_measurement(ready.model, ready.batches, ready.loss)
        for text in MEASURES:
            m = parse_measure(text)
            res = gs.sharpness(
                checked.model,
                checked.loss_fn,
                checked.batches,
                rho=0.1,
                steps=3,
                seed=0,
                **m.kwargs(),
            )
            (row,) = [
                r
                for r in rows
                if r["model_id"] == f"models/{name}"
                and r["measure"] == m.name
                and float(r["rho"]) == 0.1
            ]
            assert float(row["value"]) == pytest.approx(res.value, rel=1e-6, abs=1e-9)


def test_a_killed_run_resumes_without_recomputing(population, tmp_path):
    out = tmp_path / "resume"
    first = run_population(settings(population), out, progress=False, log=lambda _: None)
    assert first.measured == 16
    db = sqlite3.connect(out / "study.sqlite")
    with db:
        db.execute("DELETE FROM measurements WHERE model_id = 'models/bert-b'")
    db.close()
    again = run_population(settings(population), out, progress=False, log=lambda _: None)
    assert (again.measured, again.reused) == (4, 12)


def test_two_shards_merged_are_one_run(population, finished, tmp_path):
    from geosharp.studies.merge import merge_shards

    out, _, _ = finished
    parts = []
    for k in (1, 2):
        part = tmp_path / f"shard{k}"
        run_population(
            settings(population), part, progress=False, shard=Shard(k, 2), log=lambda _: None
        )
        parts.append(part)
    merged = tmp_path / "merged"
    merge_shards(merged, parts, log=lambda _: None)
    one = {(r["model_id"], r["measure"], r["rho"]): r["value"] for r in read_results(out)}
    two = {(r["model_id"], r["measure"], r["rho"]): r["value"] for r in read_results(merged)}
    assert one == two


def test_the_python_call_returns_the_tau_table(population, tmp_path):
    table = study(
        population / "manifest.csv",
        data=str(population / "data.csv"),
        out=tmp_path / "py",
        measures=["adaptive"],
        rho=[0.05],
        steps=2,
        progress=False,
        log=lambda _: None,
        **OPTS,
    )
    assert [r["measure"] for r in table.rows] == ["adaptive worst l2"]
    assert table.rows[0]["n_models"] == 4 and math.isfinite(table.rows[0]["tau_a"])
    assert table.report is not None and table.report.is_file()
    assert "adaptive worst l2" in str(table)
    pytest.importorskip("pandas")
    assert list(table.dataframe()["measure"]) == ["adaptive worst l2"]


def test_frozen_parameters_are_left_out_of_every_model(population, tmp_path):
    kw = dict(measures=["adaptive"], rho=[0.05], steps=2, progress=False, log=lambda _: None)
    data = str(population / "data.csv")
    whole = study(population / "manifest.csv", data=data, out=tmp_path / "w", **kw, **OPTS)
    part = study(
        population / "manifest.csv", data=data, out=tmp_path / "f", freeze=("*embeddings*",),
        **kw, **OPTS,
    )  # fmt: skip
    a, b = read_results(tmp_path / "w"), read_results(tmp_path / "f")
    assert len(a) == len(b) == 4
    assert all(x["value"] != y["value"] for x, y in zip(a, b, strict=True))
    assert whole.rows[0]["n_models"] == part.rows[0]["n_models"] == 4


def test_rows_given_in_python(population, tmp_path, monkeypatch):
    monkeypatch.chdir(population)
    rows = [{"model": f"models/{n}", "gap": tr - te, "lr": lr} for n, tr, te, lr, _ in ROWS]
    table = study(
        rows,
        data="data.csv",
        out=tmp_path / "rows",
        measures=["adaptive"],
        rho=[0.05],
        steps=2,
        progress=False,
        log=lambda _: None,
        **OPTS,
    )
    assert table.rows[0]["n_models"] == 4


def test_the_rho_rule_decides_before_any_tau(population, tmp_path, monkeypatch):
    # the fixture's fresh classifiers are at chance, which a pilot may not be (test_pilot.py);
    # here the rule itself is tested, on the named pilot
    monkeypatch.setattr(PopulationStudy, "_pilot_judge", lambda self, ready: None)
    lines: list[str] = []
    s = settings(population, measures=("adaptive",), rho=parse_rho(["auto:models/bert-c"]))
    run_population(s, tmp_path / "auto", progress=False, log=lines.append)
    record = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert record["rho_rule"]["pilot"] == "models/bert-c"
    (grid,) = record["rho_rule"]["grids"].values()
    assert len(grid) == 3
    assert any("the ρ rule on the pilot models/bert-c" in line for line in lines)
    again: list[str] = []
    run_population(s, tmp_path / "auto", progress=False, log=again.append)
    assert any("the ρ rule's grids of" in line for line in again)  # reused, not re-run


def test_cli_runs_a_manifest_and_its_symmetry_test(population, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [
        str(population / "manifest.csv"),
        "--data",
        str(population / "data.csv"),
        "--out",
        str(out),
        "--measures",
        "adaptive",
        "geodesic-inv-o2",
        "--rho",
        "0.05",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--samples",
        "8",
        "--max-length",
        "16",
        "--device",
        "cpu",
        "--dtype",
        "float64",
        "--no-progress",
    ]
    rc = main(["study", *args, "--expect", "positive"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "report.html").is_file() and len(read_results(out)) == 8
    # the stated direction is the paired verdict's (a report setting, not the configuration)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    pairs = summary["geodesic_vs_adaptive"]
    assert pairs and {p["direction_from"] for p in pairs} == {"stated (--expect)"}
    assert {p["direction"] for p in pairs} == {"positive"}
    with pytest.raises(SystemExit) as bad:
        main(["study", *args, "--expect", "up"])
    assert bad.value.code == 2 and "--expect" in capsys.readouterr().err
    rc = main(["symmetry-test", *args, "--scale", "2", "5"])
    assert rc == 0, capsys.readouterr().err
    with (out / "symmetry_test.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    for r in rows:
        change = abs(float(r["reparametrized"]) - float(r["original"])) / abs(float(r["original"]))
        if r["measure"].startswith("geodesic"):
            assert change < 1e-6, r  # float64: invariant up to roundoff
    assert any(
        abs(float(r["reparametrized"]) - float(r["original"])) > 0.05 * abs(float(r["original"]))
        for r in rows
        if r["measure"].startswith("adaptive")
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda rows: rows[:2], "2 usable model"),
        (lambda rows: [*rows, rows[0]], "the same model as row 1"),
        (lambda rows: [[*rows[0][:1], "", *rows[0][2:]], *rows[1:]], "train_accuracy is missing"),
        (lambda rows: [["models/nowhere", *rows[0][1:]], *rows[1:]], "nowhere"),
    ],
)
def test_bad_manifests_are_refused_before_any_model_is_measured(
    population, tmp_path, capsys, edit, match
):
    rows = [[f"models/{n}", tr, te, lr, w] for n, tr, te, lr, w in ROWS]
    path = population / f"bad-{abs(hash(match))}.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", "train_accuracy", "test_accuracy", "lr", "width"])
        w.writerows(edit(rows))
    rc = main(["study", str(path), "--data", str(population / "data.csv"), "--out",
               str(tmp_path / "bad"), "--rho", "0.1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("geosharp: error:") == 1 and match in err, err
    assert not (tmp_path / "bad" / "study.sqlite").exists()
    with pytest.raises(MeasureError, match=match):
        run_population(settings(population, manifest=str(path)), tmp_path / "bad2")


def test_exact_steps_reach_the_exact_measures_and_keep_old_studies_resumable():
    """``--exact-steps``: in the exact measures' arguments, in the configuration only if set."""
    from geosharp.measures import parse_measure
    from geosharp.studies.population import PopulationSettings, PopulationStudy

    study = PopulationStudy.__new__(PopulationStudy)  # the settings alone, no manifest read
    study.cfg = PopulationSettings(manifest="m.csv", options={}, exact_steps=40)
    exact, o2 = parse_measure("geodesic-mix-exact"), parse_measure("geodesic-mix-o2")
    assert study._run_kwargs(exact)["exact_steps"] == 40
    assert "exact_steps" not in study._run_kwargs(o2)
    study.cfg = PopulationSettings(manifest="m.csv", options={})
    assert "exact_steps" not in study._run_kwargs(exact)
    study.grids = {}
    assert "exact_steps" not in study.config()


def test_a_manifest_grown_in_the_middle_between_shard_runs(population, tmp_path, capsys):
    """``--shard k/n`` by the models' names: a model added in the middle of the manifest goes
    to its own part, the parts already measured keep theirs, and the merge misses none."""

    def manifest(path, names):
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["model", "train_accuracy", "test_accuracy", "lr", "width"])
            for name, tr, te, lr, width in ROWS:
                if name in names:
                    w.writerow([f"models/{name}", tr, te, lr, width])
        return path

    path = population / "grown.csv"  # beside the models: ids models/bert-a, ...
    common = ["--data", str(population / "data.csv"), "--measures", "adaptive-l2", "--rho",
              "0.05", "--steps", "2", "--batch-size", "4", "--samples", "8", "--max-length",
              "16", "--device", "cpu", "--dtype", "float64", "--no-progress"]  # fmt: skip

    def shard(k):
        out = tmp_path / f"part{k}"
        assert main(["study", str(path), *common, "--shard", f"{k}/2", "--out", str(out)]) == 0
        with sqlite3.connect(out / "study.sqlite") as db:
            held = {Path(r[0]).name for r in db.execute("SELECT model_id FROM models")}
        db.close()
        return held, capsys.readouterr()

    # models/bert-a, -c and -d hash to part 1 of 2, models/bert-b to part 2
    assert [shard_of(f"models/bert-{x}", 2) for x in "abcd"] == [1, 2, 1, 1]
    manifest(path, {"bert-a", "bert-c", "bert-d"})
    first = [shard(k)[0] for k in (1, 2)]
    assert first == [{"bert-a", "bert-c", "bert-d"}, set()]  # part 2 owns none of them yet
    manifest(path, {"bert-a", "bert-b", "bert-c", "bert-d"})  # bert-b in the middle
    (one, said1), (two, said2) = shard(1), shard(2)
    assert "measured 0, reused 3 rows" in said1.out  # part 1 owns what it owned
    assert "shard part 2/2 (name-hash): 1 of the 4 models" in said2.err
    assert one == first[0] and two == first[1] | {"bert-b"}
    assert sorted([*one, *two]) == ["bert-a", "bert-b", "bert-c", "bert-d"]  # each once
    merged = tmp_path / "merged"
    assert main(["merge", str(merged), str(tmp_path / "part1"), str(tmp_path / "part2")]) == 0
    err = capsys.readouterr().err
    assert "measured by no shard" not in err and "more than one shard" not in err, err
    assert len(read_results(merged)) == 4
