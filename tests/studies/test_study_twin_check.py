"""``geosharp study MANIFEST --twin-check`` (issue 40, deliverable 6): every model's cells again on
one random equivalent twin, in ``twin_check.csv`` and the report's "Twin check" section.

Three tiny random BERT classifiers (float32, 2 steps, one ρ), through the command line: a line
per (model, measure, ρ), geodesic inv within 1e-3 of its twin or flagged, a rerun that measures
no twin again, a shard's file merged as ``geosharp merge`` does, and ``--fsdp`` refused in one
line before any work.
"""

from __future__ import annotations

import contextlib
import csv
import io

import pytest

from geosharp.errors import MeasureError
from geosharp.studies.twin_section import TWIN_FILE, is_flagged, merge_twin_files, read_rows

from ..measure.conftest import save_tiny_manifest

pytest.importorskip("transformers")

ROWS = [("a", 0.9, 0.7), ("b", 0.95, 0.8), ("c", 0.9, 0.85)]
MEASURES = ("adaptive-l2", "geodesic-inv-o2")


def _study(root, out):
    """``geosharp study m.csv ... --twin-check``: its exit status, stdout and stderr lines."""
    from geosharp.cli import main

    argv = ["study", str(root / "m.csv"), "--data", str(root / "data.csv"), "--out", str(out),
            "--measures", *MEASURES, "--rho", "0.01", "--steps", "2", "--batch-size", "4",
            "--samples", "8", "--max-length", "32", "--device", "cpu", "--no-progress",
            "--twin-check"]  # fmt: skip
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stdout.getvalue().splitlines(), stderr.getvalue().splitlines()


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("twins")
    save_tiny_manifest(root, ROWS, ["model", "train_accuracy", "test_accuracy"])
    out = root / "out"
    code, printed, lines = _study(root, out)
    assert code == 0, lines
    assert f"twin check: {out / TWIN_FILE} (the report's Twin check section)" in printed
    return root, out, lines


def test_twin_check_csv_has_a_line_per_model_measure_and_rho(study):
    _, out, lines = study
    rows = read_rows(out / TWIN_FILE)
    keys = {(r["model_id"], r["measure"], r["rho"]) for r in rows}
    names = {"adaptive worst l2", "geodesic-inv-o2 worst l2"}
    assert keys == {(m, n, "0.01") for m, *_ in ROWS for n in names}
    stored = {(r["model_id"], r["measure"]): r["value"]
              for r in csv.DictReader((out / "results.csv").open(encoding="utf-8"))}  # fmt: skip
    for r in rows:
        assert not r["error"], r
        assert float(r["value"]) == float(stored[(r["model_id"], r["measure"])])
        assert r["dtype"] == "float32" and float(r["scale"]) == 10.0
        assert float(r["output_change"]) < 1e-4  # the same function
        if r["measure"].startswith("geodesic"):  # the promise: held, or the cell says why not
            assert float(r["relative_change"]) <= 1e-3 or is_flagged(r), r
    adaptive = [float(r["relative_change"]) for r in rows if r["measure"].startswith("adaptive")]
    assert max(adaptive) > 1e-3  # adaptive sharpness is not invariant: it moves
    assert sum(line.startswith("twin check ") for line in lines) == len(ROWS), lines


def test_the_report_has_a_twin_check_section(study):
    _, out, _ = study
    md = (out / "tau_table.md").read_text(encoding="utf-8")
    assert "## Twin check" in md and "silent" in md and "same function" in md
    assert "Twin check" in (out / "report.html").read_text(encoding="utf-8")
    table = md.split("## Twin check", 1)[1]
    geo = next(line for line in table.splitlines() if line.startswith("| geodesic-inv-o2"))
    cells = [c.strip() for c in geo.strip("|").split("|")]
    assert cells[1:4] == ["0.01", "yes", str(len(ROWS))] and cells[-1] == "0"  # none silent


def test_a_rerun_measures_no_twin_again_and_a_merge_joins_the_files(study, tmp_path):
    root, out, _ = study
    before = (out / TWIN_FILE).read_text(encoding="utf-8")
    code, printed, lines = _study(root, out)
    assert code == 0 and any("measured 0, reused 6 rows" in line for line in printed), printed
    assert (out / TWIN_FILE).read_text(encoding="utf-8") == before
    assert not any(line.startswith("twin check ") for line in lines), lines
    assert "twin check: 0 model(s) to re-measure" in " ".join(lines)
    shard = tmp_path / "shard"
    shard.mkdir()
    rows = read_rows(out / TWIN_FILE)
    (shard / TWIN_FILE).write_text(before, encoding="utf-8")
    merged = tmp_path / "merged"
    merged.mkdir()
    assert merge_twin_files(merged, [shard, shard]) == len(ROWS)
    assert read_rows(merged / TWIN_FILE) == rows
    assert merge_twin_files(merged, [shard]) == 0


def test_twin_check_with_fsdp_is_refused_in_one_line():
    from geosharp.studies.population_cli import parser
    from geosharp.studies.population_fsdp import check_study_args

    args = parser().parse_args(["m.csv", "--data", "d.csv", "--fsdp", "--twin-check"])
    with pytest.raises(MeasureError, match="--fsdp with --twin-check") as err:
        check_study_args(args, env={})
    assert "\n" not in str(err.value)
