"""The study pipeline end to end on tiny populations: store, resume, report, CLI."""

import csv
import json
import math
import re

import pytest

from geosharp.cli import main
from geosharp.stats import kendall_tau_a
from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy
from geosharp.studies.runner import run_study
from geosharp.studies.shards import Shard
from geosharp.studies.store import Store, StudyMismatchError
from geosharp.studies.study_report import report_from_folder


def tiny(**kw):
    base = dict(n_models=5, d=20, n_train=10, n_test=100, max_steps=40_000, rhos=(1e-2,), steps=5)
    base.update(kw)
    return DiagonalStudy(DiagonalConfig.quick(**base))


def rows(out):
    with Store(out / "study.sqlite", None, None) as store:
        return store.models(), store.measurements()


def test_pipeline_end_to_end(tmp_path):
    study = tiny()
    summary = run_study(study, tmp_path, progress=False, log=lambda m: None)
    assert summary.trained == 5 and summary.measured == 5 * 5 and summary.reused == 0
    for name in ("results.csv", "tau_table.md", "report.html", "summary.json", "study.sqlite"):
        assert (tmp_path / name).is_file(), name
    models, meas = rows(tmp_path)
    assert all(m["converged"] and m["train_loss"] <= 1e-5 for m in models)
    # τ in the summary is the τ-a of the stored values against the stored gaps.
    gaps = {m["model_id"]: m["gap"] for m in models}
    cells = json.loads((tmp_path / "summary.json").read_text())["cells"]
    for name in {r["measure"] for r in meas}:
        values = [(gaps[r["model_id"]], r["value"]) for r in meas if r["measure"] == name]
        tau = kendall_tau_a([g for g, _ in values], [v for _, v in values])
        (cell,) = [c for c in cells if c["measure"] == name]
        assert math.isclose(cell["tau_a"], tau, abs_tol=1e-12)
    with (tmp_path / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 25 and {"model_id", "measure", "rho", "value", "gap"} <= set(table[0])


def test_resume_after_a_crash_reuses_rows_and_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    full = tmp_path / "full"
    run_study(tiny(), full, progress=False, log=lambda m: None)
    _, reference = rows(full)

    crashed = tmp_path / "crashed"
    original = Store.put_measurement
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt("killed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Store, "put_measurement", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_study(tiny(), crashed, progress=False, log=lambda m: None)
    monkeypatch.setattr(Store, "put_measurement", original)
    _, partial = rows(crashed)
    assert len(partial) == 7  # the 8th was never written: no half rows

    computed = {"n": 0}

    def counting(self, *args, **kwargs):
        computed["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Store, "put_measurement", counting)
    summary = run_study(tiny(), crashed, progress=False, log=lambda m: None)
    assert summary.trained == 0 and summary.reused == 7 and computed["n"] == 25 - 7
    _, resumed = rows(crashed)
    key = lambda r: (r["model_id"], r["measure"], r["rho"])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, reference))
    ref = {key(r): r["value"] for r in reference}
    assert all(r["value"] == ref[key(r)] for r in resumed)  # bit-identical values


def test_folder_of_another_study_is_refused_unless_forced(tmp_path):
    run_study(tiny(), tmp_path, progress=False, log=lambda m: None)
    # the error names the differing key instead of dumping both configurations
    with pytest.raises(
        StudyMismatchError, match=r"different configuration \(seed: stored 0, now 3\).*--force"
    ):
        run_study(tiny(seed=3), tmp_path, progress=False, log=lambda m: None)
    Store(tmp_path / "other.sqlite", "vit-mnist", {}).close()
    with pytest.raises(StudyMismatchError, match="study 'vit-mnist'"):
        Store(tmp_path / "other.sqlite", "diagonal", {})
    run_study(tiny(seed=3), tmp_path, force=True, progress=False, log=lambda m: None)


def test_all_equal_gaps_are_reported_undefined_not_nan(tmp_path):
    with Store(tmp_path / "study.sqlite", "fake", {"x": 1}) as store:
        for i in range(4):
            store.put_model(f"m{i}", hparams={"i": i}, metrics={}, gap=0.5)
            store.put_measurement(f"m{i}", "adaptive worst l2", 0.1, {}, float(i), [float(i)])
    paths = report_from_folder(tmp_path)
    assert "undefined" in paths.tau_table.read_text()
    page = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", paths.html.read_text())
    assert not re.search(r"\bnan\b", page, flags=re.I)


def test_shards_partition_the_population():
    pop = list(range(10))
    parts = [Shard.parse(f"{k}/3").take(pop) for k in (1, 2, 3)]
    assert sorted(x for part in parts for x in part) == pop
    with pytest.raises(ValueError, match="k/n"):
        Shard.parse("4/3")


def test_cli_quick_study_and_report(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["study", "diagonal", "--quick", "--models", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and (out / "report.html").is_file()
    assert main(["report", str(out)]) == 0
    assert main(["study", "diagonal", "--quick", "--seed", "5", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit):
        main(["study", "no-such-study"])
    assert main(["study", "diagonal", "--quick", "--models", "1", "--out", str(out)]) == 2
    # symmetry-test: diagonal pairs are rescaled; every measure here is invariant to that
    test = ["symmetry-test", "diagonal", "--quick", "--models", "4", "--out", str(out)]
    assert main(test) == 0
    printed = capsys.readouterr().out
    assert "| adaptive worst l2 | 0.01 |" in printed and "+0.00 [+0.00, +0.00]" in printed
    assert main([*test, "--scale", "2", "1"]) == 2
    # --export: a small copy to share (consistent database, same report, no checkpoints)
    dest = tmp_path / "shared"
    assert main(["report", str(out), "--export", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "plots",
        "report.html",
        "results.csv",
        "study.sqlite",
        "summary.json",
        "symmetry_test.csv",
        "symmetry_test.md",
        "tau_table.md",
    ]
    assert main(["report", str(out)]) == 0  # the report now shows the symmetry test
    title = "τ before and after random equivalent re-parametrizations"
    for name in ("report.html", "tau_table.md"):
        assert title in (dest / name).read_text() and title in (out / name).read_text()
    assert (dest / "tau_table.md").read_text() == (out / "tau_table.md").read_text()
    assert (dest / "results.csv").read_text() == (out / "results.csv").read_text()
    assert main(["report", str(dest)]) == 0  # the export is a study folder of its own
    assert main(["report", str(out), "--export", str(out)]) == 2
    assert "another folder" in capsys.readouterr().err


def test_report_records_notes_population_and_every_environment_that_ran(tmp_path, monkeypatch):
    import torch

    class Noted(DiagonalStudy):
        def notes(self):
            return ["a remark of the study"]

    study = Noted(DiagonalConfig.quick(n_models=4, d=20, n_train=10, n_test=100, rhos=(1e-2,)))
    threads = torch.get_num_threads()
    run_study(study, tmp_path, progress=False, log=lambda m: None)
    try:  # a resume with another thread count is the same study, and is recorded as well
        torch.set_num_threads(threads + 1)
        run_study(study, tmp_path, progress=False, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "a remark of the study" in summary["notes"]
    run_by = summary["settings"]["run by"]
    assert f"{threads} threads" in run_by and f"{threads + 1} threads" in run_by
    assert run_by.count("geosharp") == 2 and f"torch {torch.__version__}" in run_by
    models, _ = rows(tmp_path)
    gaps = sorted(m["gap"] for m in models)
    assert summary["settings"]["population"].startswith(f"gap {gaps[0]:.4g} to {gaps[-1]:.4g}")
    assert "test loss" in summary["settings"]["population"]
    assert "run by" in (tmp_path / "report.html").read_text()
