"""Sharded studies: two shards plus a merge equal one unsharded run; shared databases."""

import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from geosharp.cli import main
from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy
from geosharp.studies.merge import MergeConflictError, merge_shards
from geosharp.studies.runner import run_study
from geosharp.studies.shards import Shard
from geosharp.studies.store import Store, StudyMismatchError
from geosharp.studies.study_report import report_from_folder

N_MODELS, N_MEASURES = 4, 5  # 4 models x (adaptive + geodesic inv/mix x exact/order 2) x 1 rho


def tiny(seed=0):
    return DiagonalStudy(
        DiagonalConfig.quick(
            n_models=N_MODELS, d=20, n_train=10, n_test=100, rhos=(1e-2,), steps=5, seed=seed
        )
    )


def key(r):
    return (r["model_id"], r["measure"], r["rho"])


def rows(out):
    with Store(out / "study.sqlite", None, None) as store:
        return store.models(), store.measurements()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unsharded run and the two shards of the same study, counting computed rows."""
    root = tmp_path_factory.mktemp("runs")
    computed = {}
    original = Store.put_measurement

    def counting(self, model_id, measure, rho, *args, **kwargs):
        computed.setdefault(self.path.parent.name, []).append((model_id, measure, rho))
        return original(self, model_id, measure, rho, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Store, "put_measurement", counting)
        run_study(tiny(), root / "full", progress=False, log=lambda m: None)
        for k in (1, 2):
            shard = Shard(k, 2)
            out = root / f"shard{k}"
            run_study(tiny(), out, shard=shard, report=False, progress=False, log=lambda m: None)
    return root, computed


def test_two_shards_plus_merge_equal_one_unsharded_run(runs, capsys):
    root, computed = runs
    # No row computed twice, none lost: the shards' rows partition the unsharded run's rows.
    s1, s2 = computed["shard1"], computed["shard2"]
    assert len(computed["full"]) == N_MODELS * N_MEASURES == len(s1) + len(s2)
    assert not set(s1) & set(s2) and sorted(s1 + s2) == sorted(computed["full"])

    assert main(["merge", str(root / "merged"), str(root / "shard1"), str(root / "shard2")]) == 0
    assert "report:" in capsys.readouterr().out
    models, meas = rows(root / "merged")
    ref_models, ref_meas = rows(root / "full")
    assert sorted(map(key, meas)) == sorted(map(key, ref_meas))
    ref = {key(r): r for r in ref_meas}
    for r in meas:  # bit-identical values, per-batch values and clean losses
        for field in ("value", "per_batch", "clean_losses", "settings", "error"):
            assert r[field] == ref[key(r)][field], (key(r), field)
    strip = lambda m: {k: v for k, v in m.items() if k != "train_time_s"}  # noqa: E731
    assert [strip(m) for m in models] == [strip(m) for m in ref_models]
    for m in models:  # every checkpoint copied, byte for byte
        shard = "shard1" if m["model_id"] in {mid for mid, _, _ in s1} else "shard2"
        copied = (root / "merged" / m["checkpoint"]).read_bytes()
        assert copied == (root / shard / m["checkpoint"]).read_bytes()

    # The same report: τ of every cell from the same values and gaps (wall times differ).
    def cells(out):
        cells = json.loads((out / "summary.json").read_text())["cells"]
        return [{k: v for k, v in c.items() if k != "median_time_s"} for c in cells]

    assert cells(root / "merged") == cells(root / "full")

    # Merging again changes nothing; identical rows found twice are kept once.
    again = merge_shards(root / "merged", [root / "shard1", root / "shard2"], report=False)
    assert (again.new_models, again.new_measurements) == (0, 0)
    assert again.duplicates == N_MODELS * (1 + N_MEASURES) and not again.missing
    assert rows(root / "merged")[1] == meas


def test_a_missing_shard_is_reported(runs, tmp_path, capsys):
    root, _ = runs
    summary = merge_shards(tmp_path, [root / "shard1"], report=False, log=lambda m: None)
    assert summary.missing == ["diag-001", "diag-003"]  # part 2/2's (a hash of the names)
    assert any("is a shard missing" in w for w in summary.warnings)
    # The command says it in one line, and the report and results.csv say so too.
    out = tmp_path / "cli"
    assert main(["merge", str(out), str(root / "shard1")]) == 0
    err = capsys.readouterr().err
    assert (
        "warning: 2 of the 4 models of the population were measured by no shard: diag-001, "
        "diag-003 (part 2/2 owns diag-001, diag-003: rerun it, then merge again)"
    ) in err
    assert "warning: part(s) 2/2 of the split (name-hash) are in none of the folders" in err
    csv_rows = (out / "results.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in csv_rows if r.endswith(",not-measured")] == [
        "diag-001",
        "diag-003",
    ]
    html = (out / "report.html").read_text()
    assert "not measured: 2 of the 4 models of the population have no row here" in html
    assert "rerun it, then merge again" not in html and "a shard not merged" in html
    # A shard folder's own report says whose the other models are.
    part = tmp_path / "part1"
    shutil.copytree(root / "shard1", part)
    report_from_folder(part)
    assert "this folder holds part 1/2 of the population" in (part / "report.html").read_text()


def test_not_measured_lines_read_as_missing_values(runs, tmp_path):
    """The csv module and pandas read a not-measured line's empty cells as missing, and the
    recipe of docs/examples/study.md (skip empty values) keeps the measured cells alone."""
    import csv

    root, _ = runs
    merge_shards(tmp_path, [root / "shard1"], log=lambda m: None)
    lines = list(csv.DictReader((tmp_path / "results.csv").open(newline="")))
    missing = [r for r in lines if r["flags"] == "not-measured"]
    assert [r["model_id"] for r in missing] == ["diag-001", "diag-003"]
    assert all(v == "" for r in missing for k, v in r.items() if k not in ("model_id", "flags"))
    measured = [r for r in lines if r["value"] != ""]
    assert len(measured) == 2 * N_MEASURES and all(float(r["value"]) > 0 for r in measured)
    pd = pytest.importorskip("pandas")
    df = pd.read_csv(tmp_path / "results.csv")
    gone = df[df["flags"] == "not-measured"]  # df.flags is pandas' own attribute
    assert list(gone.model_id) == ["diag-001", "diag-003"]
    assert gone.drop(columns=["model_id", "flags"]).isna().all().all()
    assert len(df.dropna(subset=["value"])) == 2 * N_MEASURES


def test_conflicting_rows_are_named_and_nothing_is_written(runs, tmp_path, capsys):
    root, _ = runs
    bad = tmp_path / "bad"
    shutil.copytree(root / "shard1", bad)
    with sqlite3.connect(bad / "study.sqlite") as conn:
        conn.execute(
            "UPDATE measurements SET value = value * 2 "
            "WHERE model_id = 'diag-000' AND measure = 'adaptive worst l2'"
        )
    conn.close()
    out = tmp_path / "merged"
    with pytest.raises(MergeConflictError, match=r"'diag-000', measure 'adaptive worst l2'"):
        merge_shards(out, [root / "shard1", root / "shard2", bad], report=False)
    assert rows(out) == ([], [])
    assert main(["merge", str(out), str(root / "shard1"), str(bad)]) == 2
    assert "differs between" in capsys.readouterr().err


def test_shards_of_different_configurations_are_refused(runs, tmp_path):
    root, _ = runs
    other = tmp_path / "other"
    run_study(tiny(seed=3), other, shard=Shard(2, 2), report=False, progress=False, log=print)
    with pytest.raises(
        StudyMismatchError, match=r"other was run with seed=3 but .*shard1 with seed=0: "
    ):
        merge_shards(tmp_path / "merged", [root / "shard1", other], report=False)
    assert not (tmp_path / "merged").exists()
    with pytest.raises(StudyMismatchError, match="merge into a new folder"):
        merge_shards(other, [root / "shard1"], report=False)
    with pytest.raises(FileNotFoundError, match=r"holds no study\.sqlite"):
        merge_shards(tmp_path / "merged", [tmp_path / "nothing"], report=False)


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy
    from geosharp.studies.runner import run_study
    from geosharp.studies.shards import Shard

    out, k = Path(sys.argv[1]), int(sys.argv[2])
    (out.parent / f"ready{k}").touch()
    while not all((out.parent / f"ready{j}").exists() for j in (1, 2)):  # start together
        time.sleep(0.01)
    cfg = DiagonalConfig.quick(n_models=4, d=20, n_train=10, n_test=100, rhos=(1e-2,), steps=5)
    run_study(DiagonalStudy(cfg), out, shard=Shard(k, 2), report=False, progress=False,
              log=lambda m: None)
    """
)


def test_two_processes_write_one_shared_database(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "shared"
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(k)], stderr=subprocess.PIPE)
        for k in (1, 2)
    ]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    models, meas = rows(out)
    _, ref_meas = rows(root / "full")
    assert len(models) == N_MODELS and len(meas) == N_MODELS * N_MEASURES
    ref = {key(r): r["value"] for r in ref_meas}
    assert {key(r): r["value"] for r in meas} == ref
