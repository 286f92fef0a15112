"""Study 1's second population (sgd-batch): the default stays Study 1, SGD is what it says."""

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from geosharp.cli import main
from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy
from geosharp.studies.runner import run_study
from geosharp.studies.store import Store

COMMITTED = Path(__file__).resolve().parents[2] / "results" / "diagonal" / "study.sqlite"


def _quiet(msg: str) -> None:
    pass


@pytest.mark.skipif(not COMMITTED.is_file(), reason="results/diagonal not in this checkout")
def test_default_population_records_study_1s_committed_config():
    with sqlite3.connect(COMMITTED) as conn:
        (raw,) = conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
    recorded = json.loads(raw)
    assert json.loads(json.dumps(DiagonalStudy().config())) == recorded
    assert DiagonalStudy(DiagonalConfig(population="alpha")).config() == DiagonalStudy().config()


def test_sgd_population_is_deterministic_with_a_fixed_alpha():
    cfg = DiagonalConfig(population="sgd-batch")
    pop = DiagonalStudy(cfg).population()
    assert pop == DiagonalStudy(cfg).population() and len(pop) == 50
    assert {hp["alpha"] for _, hp in pop} == {cfg.sgd_alpha}
    assert {hp["batch_size"] for _, hp in pop} <= set(cfg.sgd_batch_sizes)
    assert len({hp["batch_size"] for _, hp in pop}) == len(cfg.sgd_batch_sizes)
    assert all(cfg.sgd_lr[0] <= hp["lr"] <= cfg.sgd_lr[1] for _, hp in pop)
    assert DiagonalStudy(cfg).config()["population"] == "sgd-batch"
    with pytest.raises(ValueError, match="population"):
        DiagonalStudy(DiagonalConfig(population="nope"))


def _train(study, todo, out):
    with Store(out / "study.sqlite", study.name, study.config()) as store:
        study.train(todo, out, store, progress=False)
        return {
            mid: torch.load(out / store.get_model(mid)["checkpoint"], weights_only=True)
            for mid, _ in todo
        }


def test_full_batch_sgd_is_gradient_descent(tmp_path):
    base = dict(n_models=3, d=30, n_train=15, n_test=50, max_steps=40_000, sgd_max_steps=40_000)
    gd = DiagonalStudy(DiagonalConfig.quick(**base))
    sgd = DiagonalStudy(DiagonalConfig.quick(population="sgd-batch", sgd_batch_sizes=(15,), **base))
    todo = [("diag-000", {"alpha": 0.1, "lr": 0.02})]
    a = _train(gd, todo, tmp_path / "gd")["diag-000"]
    todo_sgd = [("diag-000", {"alpha": 0.1, "lr": 0.02, "batch_size": 15, "seed": 3})]
    b = _train(sgd, todo_sgd, tmp_path / "sgd")["diag-000"]
    for k in ("u", "v"):
        assert torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12)


def test_each_model_follows_its_own_batches(tmp_path):
    study = DiagonalStudy(DiagonalConfig.quick(population="sgd-batch"))
    pop = study.population()
    together = _train(study, pop[:3], tmp_path / "all")
    alone = _train(study, pop[1:2], tmp_path / "one")
    mid = pop[1][0]
    for k in ("u", "v"):
        assert torch.allclose(together[mid][k], alone[mid][k], rtol=1e-10, atol=1e-13)
    # different batch sizes give different solutions from the same start
    betas = [(t["u"] * t["v"]).numpy() for t in together.values()]
    assert not np.allclose(betas[0], betas[1])


def test_quick_sgd_population_end_to_end_and_cli(tmp_path):
    study = DiagonalStudy(DiagonalConfig.quick(population="sgd-batch"))
    summary = run_study(study, tmp_path / "run", progress=False, log=_quiet)
    assert summary.trained == 8 and not summary.failures
    with Store(tmp_path / "run" / "study.sqlite", None, None) as store:
        models = store.models()
    assert all(m["converged"] for m in models)
    assert "second population" in (tmp_path / "run" / "report.html").read_text()
    out = tmp_path / "cli"
    argv = ["study", "diagonal", "--population", "sgd-batch", "--quick", "--models", "3"]
    assert main([*argv, "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    assert main(["study", "vit-mnist", "--population", "sgd-batch", "--quick"]) == 2
