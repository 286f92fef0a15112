"""``geosharp study MANIFEST --fsdp`` under ``torchrun`` equals the unsharded study (issue 27).

Three tiny BERT classifiers (built from configs, saved with a word-level tokenizer: nothing is
downloaded), a manifest of their accuracies and a CSV of 8 sentences in 2 batches of 4 rows.
``torchrun --standalone --nproc-per-node 2 -m geosharp study ... --fsdp`` (gloo on CPU, float64:
every model's layer and root under ``fully_shard``, ``W_q``, ``W_k``, ``W_v`` along dimension 1,
2 rows of every batch per rank) against ``geosharp study`` in this process. Asserted:

- the ρ rule (``--rho auto``) chooses the unsharded pilot (models at chance set aside) and, walked
  on the sharded pilot, picks the unsharded grids;
- every value of ``results.csv`` (adaptive-l2, geodesic-inv-o2, geodesic-mix-o2 at the 3 radii
  of each grid, and ``--curvature``'s 8 rows: λ_max by 3 Lanczos iterations and the trace by
  2 Hutchinson probes of 4 geometries) within 1e-10 (relative) of the unsharded study's;
- rank 0 alone writes and prints; the report says the models were sharded and what was skipped;
- a killed run (rows deleted from ``study.sqlite``) resumed with the same command measures only
  the missing rows, and ``results.csv`` is then what the whole run wrote, bit for bit;
- what a sharded study cannot run is refused in one line, exit status 2, before the manifest is
  read (in this process, with ``torchrun``'s environment set).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from geosharp.cli import main

from ..measure.conftest import CORPUS, make_tokenizer, save_tiny_classifier

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

ROWS = [("bert-a", 1.00, 0.70, 0.1), ("bert-b", 0.95, 0.80, 0.01), ("bert-c", 0.90, 0.85, 0.1)]
ARGS = [
    "--measures", "adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2", "--rho", "auto",
    "--steps", "3", "--batch-size", "4", "--samples", "8", "--max-length", "16",
    "--dtype", "float64", "--device", "cpu", "--no-progress", "--threads", "1",
    "--curvature", "--iters", "3", "--probes", "2",
]  # fmt: skip
#: Rows per model: 3 sharpness measures at 3 radii, and --curvature's 8 (lambda_max and the
#: trace of geodesic inv and mix, adaptive and Euclidean curvature; no radius).
PER_MODEL = 3 * 3 + 8
ROWS_ALL = 3 * PER_MODEL


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-population")
    tok = make_tokenizer()
    for i, (name, *_rest) in enumerate(ROWS):
        # large weights (initializer_range): losses far from log 2, the ρ rule's radii small
        save_tiny_classifier(root / "models" / name, tok, seed=i, initializer_range=0.5)
        tok.save_pretrained(root / "models" / name)
    with (root / "data.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([text, i % 2] for i, text in enumerate((CORPUS * 2)[:8]))
    with (root / "manifest.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", "train_accuracy", "test_accuracy", "lr"])
        w.writerows([f"models/{name}", tr, te, lr] for name, tr, te, lr in ROWS)
    return root


def _args(root, out):
    return [str(root / "manifest.csv"), "--data", str(root / "data.csv"), "--out", str(out), *ARGS]


def _torchrun(root, out):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "geosharp", "study",
           *_args(root, out), "--fsdp"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _values(out):
    with (out / "results.csv").open(encoding="utf-8") as f:
        return {(r["model_id"], r["measure"], r["rho"]): r["value"] for r in csv.DictReader(f)}


def test_the_sharded_study_equals_the_unsharded_one_and_resumes(population, tmp_path, capsys):
    if not dist.is_available():
        pytest.skip("torch without distributed")
    sharded = _torchrun(population, tmp_path / "sharded")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert main(["study", *_args(population, tmp_path / "whole")]) == 0
    capsys.readouterr()

    # the ρ rule on the sharded pilot: rank 0's record, the unsharded grids
    record = json.loads((tmp_path / "sharded" / "manifest.json").read_text())
    want = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert record["rho_rule"]["grids"] == want["rho_rule"]["grids"]
    assert len(record["rho_rule"]["grids"]) == 3
    got, ref = _values(tmp_path / "sharded"), _values(tmp_path / "whole")
    assert got.keys() == ref.keys() and len(got) == ROWS_ALL
    assert sum("curvature" in m for _, m, _ in got) == 3 * 8
    worst = max(abs(float(got[k]) - float(ref[k])) / abs(float(ref[k])) for k in got)
    assert worst <= 1e-10, worst  # measured: 2.5e-14

    # rank 0 alone printed and wrote; the report says how the models were measured
    assert sharded.stdout.count(f"measured {ROWS_ALL}, reused 0 rows") == 1
    # bert-b (the median gap) and bert-a are at chance (clean loss 0.74 and 1.72, ln 2 = 0.69):
    # set aside on every rank as in one process, the pilot is bert-c
    assert sharded.stderr.count("radii: the ρ rule on the pilot models/bert-c") == 1
    assert record["rho_rule"]["pilot_choice"] == want["rho_rule"]["pilot_choice"]
    assert "fsdp: 1 layer(s) (BertLayer) and the root sharded over 2 rank(s) (gloo" in (
        sharded.stderr
    )
    assert not list(tmp_path.glob("sharded/*.tmp"))
    html = (tmp_path / "sharded" / "report.html").read_text(encoding="utf-8")
    assert "FSDP2 over 2 ranks (gloo, cpu)" in html and "--fsdp: the self-check was not run" in html
    models = json.loads((tmp_path / "sharded" / "models.json").read_text())
    assert sorted(models) == [f"models/{n}" for n, *_ in ROWS]

    # killed: a model's rows and one more row lost; the same command measures only those
    db = sqlite3.connect(tmp_path / "sharded" / "study.sqlite")
    with db:
        lost = db.execute("DELETE FROM measurements WHERE model_id = 'models/bert-b'").rowcount
        lost += db.execute(
            "DELETE FROM measurements WHERE model_id = 'models/bert-c' AND rho = "
            "(SELECT MAX(rho) FROM measurements WHERE model_id = 'models/bert-c')"
        ).rowcount
    db.close()
    assert PER_MODEL < lost < ROWS_ALL
    again = _torchrun(population, tmp_path / "sharded")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(f"measured {lost}, reused {ROWS_ALL - lost} rows") == 1, again.stdout
    assert "the ρ rule's grids of" in again.stderr  # rank 0's record, not walked again
    assert _values(tmp_path / "sharded") == got


def test_a_sharded_study_takes_the_curvature_measures_and_curvature():
    from geosharp.studies.population_cli import parser
    from geosharp.studies.population_fsdp import check_study_args

    args = parser().parse_args([
        "m.csv", "--data", "d.csv", "--fsdp", "--curvature", "--iters", "4", "--probes", "2",
        "--measures", "adaptive-l2", "curvature-inv-lmax", "curvature-mix-trace",
        "--batch-size", "4", "--samples", "8", "--device", "cpu",
    ])  # fmt: skip
    run = check_study_args(args, TORCHRUN_ENV)  # --curvature's plan: no measure refuses
    assert (run.rank, run.world) == (0, 2)


TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
}


def _refused(capsys, tmp_path, command, *args):
    out = tmp_path / "never"
    code = main([command, "no-such-manifest.csv", "--data", "no-such-data.csv", "--out",
                 str(out), "--fsdp", *args])  # fmt: skip
    printed, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in printed + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geosharp: error: --fsdp"), err
    assert "no-such" not in err  # refused before the manifest or the data is read
    assert not out.exists()
    return lines[0]


def test_fsdp_study_without_torchrun_is_refused(capsys, tmp_path, monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    line = _refused(capsys, tmp_path, "study")
    assert "--fsdp runs one process per rank under torchrun" in line
    assert "-m geosharp study MANIFEST --data DATA --fsdp ...` (docs/cluster.md)" in line


@pytest.mark.parametrize(
    ("command", "args", "says"),
    [
        ("study", ["--measures", "relative-flatness"], "relative flatness of a sharded model"),
        ("study", ["--device", "cuda:1"], "use --device auto, cuda or cpu"),
        ("study", ["--batch-size", "5"], "--batch-size 5 is not a multiple of the 2 ranks"),
        ("symmetry-test", [], "symmetry-test re-parametrizes every model by a random group"),
    ],
)
def test_what_a_sharded_study_cannot_run_is_one_line(
    capsys, tmp_path, monkeypatch, command, args, says
):
    from geosharp.measuring.fsdp import FsdpRun

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)

    def never(self):  # a combination let through would wait for rank 1 of 2 (for 30 minutes)
        raise RuntimeError("not refused: --fsdp went on to start the process group")

    monkeypatch.setattr(FsdpRun, "start", never)
    assert says in _refused(capsys, tmp_path, command, *args)


class _Loaded(Exception):
    """Raised by the stand-in check: what a sharded row was checked with is recorded."""


def test_a_sharded_population_checks_exactly_the_measures_its_plan_lists(tmp_path, monkeypatch):
    """The specs come from the plan: before and after the radii are decided, in its order."""
    import geosharp.measuring.sharded as sharded
    from geosharp.studies.population import PopulationSettings, curvature_rows, parse_rho
    from geosharp.studies.population_fsdp import ShardedPopulation

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "m.csv").write_text("model,gap\na,0.1\nb,0.2\nc,0.3\n")
    settings = PopulationSettings(
        manifest=str(tmp_path / "m.csv"),
        options={"data": "data.csv"},
        measures=("adaptive-l2", "geodesic-inv-o2", "curvature-mix-trace"),
        rho=parse_rho(["0.1", "1"]),
        curvature=True,
        curvature_iters=4,
        curvature_probes=2,
        seed=3,
    )

    class Run:  # rank 0 of a run that hands back a model without loading one
        rank = 0

        def load(self, source, options, say, warn):
            return None, object(), [], None

    checked: list[list[str]] = []

    def check(model, batches, loss, specs, say):
        checked.append([m.name for m in specs])
        raise _Loaded

    monkeypatch.setattr(sharded, "check_sharded", check)
    study = ShardedPopulation(settings, Run(), log=lambda _: None)
    with pytest.raises(_Loaded):  # the pilot is loaded before any grid is decided
        study.prepare_row(study.manifest.rows[0])
    study.decide_radii(tmp_path / "out")
    with pytest.raises(_Loaded):
        study.prepare_row(study.manifest.rows[1])
    plan = study.plan()
    assert checked == [[s.name for s in plan]] * 2
    assert len(plan) == 3 + 8  # the given measures, then --curvature's 8 rows
    curvature = plan[3:]  # with the study's iterations, probes and seed
    assert [s.kwargs for s in curvature] == [s.kwargs for s in curvature_rows(4, 2, 3)]
    for s in curvature:  # λ rows carry the iterations, trace rows the probes
        assert s.kwargs["seed"] == 3 and s.kwargs.get("iters", 4) == 4, s.kwargs
        assert s.kwargs.get("probes", 2) == 2, s.kwargs
