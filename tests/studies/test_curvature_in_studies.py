"""The opt-in curvature part of the study plans: dispatch to gs.curvature, config, reuse, report."""

import json
from dataclasses import asdict

import pytest
import torch

import geosharp as gs
from geosharp.studies.curvature_plan import CLASSIFIER_CURVATURE, CurvaturePlan, curvature_specs
from geosharp.studies.diagonal import DIAGONAL_CURVATURE, DiagonalConfig, DiagonalStudy
from geosharp.studies.report import default_paper_match, measure_family
from geosharp.studies.runner import StudyMeasure, run_study
from geosharp.studies.store import Store, StudyMismatchError
from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy

from .test_classifier import Cfg, Linear

NAMES = [
    f"{m} curvature {q}"
    for m in ("geodesic-inv", "geodesic-mix", "adaptive", "euclidean")
    for q in ("lambda_max", "trace")
]


PAIRS = [("geodesic", "inv"), ("geodesic", "mix"), ("adaptive", "inv"), ("euclidean", "inv")]


def tiny(**kw):
    base = dict(n_models=4, d=12, n_train=8, n_test=50, max_steps=40_000, rhos=(1e-2,), steps=3)
    base.update(kw)
    return DiagonalStudy(DiagonalConfig.quick(**base))


def quiet(_msg):
    pass


def test_off_by_default_plan_and_config_unchanged():
    study = DiagonalStudy()
    # Study 1's recorded config: the second population's fields are left out for "alpha"
    study1 = {k: v for k, v in asdict(DiagonalConfig()).items() if not k.startswith("sgd_")}
    study1.pop("population")
    assert study.curvature is None and study.config() == study1
    assert "curvature" not in study.config()
    assert all(s.kwargs["measure"] != "curvature" for s in study.plan())
    vit = ViTMNISTStudy()
    assert vit.config() == asdict(ViTMNISTConfig()) and len(vit.plan()) == 12
    on = DiagonalStudy().with_curvature()
    assert (
        on.curvature == DIAGONAL_CURVATURE and on.config()["curvature"]["trace_method"] == "exact"
    )
    assert [s.name for s in on.plan()][: len(study.plan())] == [s.name for s in study.plan()]
    assert [s.name for s in on.plan()][len(study.plan()) :] == NAMES
    vit_on = ViTMNISTStudy().with_curvature()
    assert vit_on.config() == {
        **asdict(ViTMNISTConfig()),
        "curvature": asdict(CLASSIFIER_CURVATURE),
    }
    assert [s.name for s in vit_on.plan()][12:] == NAMES
    assert "Curvature (no ρ)" in vit_on.notes()[0] and "20 probes" in vit_on.notes()[0]


def test_specs():
    specs = curvature_specs(CurvaturePlan(iters=7, probes=3))
    assert [s.name for s in specs] == NAMES and all(s.rhos == (None,) for s in specs)
    lmax, trace = specs[0].kwargs, specs[1].kwargs
    assert lmax == {
        "measure": "curvature",
        "of": "geodesic",
        "quantity": "lambda_max",
        "metric": "inv",
        "iters": 7,
        "tol": 1e-5,
        "seed": 0,
    }
    assert trace["probes"] == 3 and trace["trace_method"] == "hutchinson"
    assert "metric" not in specs[-1].kwargs and specs[-1].kwargs["of"] == "euclidean"
    assert "probes" not in curvature_specs(CurvaturePlan(trace_method="exact"))[1].kwargs
    name = StudyMeasure({"measure": "curvature", "of": "adaptive", "quantity": "trace"}, (None,))
    assert name.name == "adaptive curvature trace"
    with pytest.raises(ValueError, match="quantity"):
        curvature_specs(CurvaturePlan(quantities=("top",)))


def test_diagonal_run_values_equal_gs_curvature_and_report(tmp_path):
    study = tiny().with_curvature(CurvaturePlan(iters=30, trace_method="exact"))
    summary = run_study(study, tmp_path, progress=False, log=quiet)
    assert summary.trained == 4 and summary.measured == 4 * (5 + 8) and not summary.failures
    with Store(tmp_path / "study.sqlite", None, None) as store:
        meas = store.measurements()
        model_row = store.get_model("diag-000")
        assert store.config["curvature"]["iters"] == 30
    curv = {r["measure"]: r for r in meas if r["model_id"] == "diag-000" and r["rho"] is None}
    assert sorted(curv) == sorted(NAMES)
    model_row["checkpoint_path"] = str(tmp_path / model_row["checkpoint"])
    model = study.load(model_row)
    for m, metric in PAIRS:
        ref = gs.curvature(
            model, study.loss_fn, study.batches(), measure=m, metric=metric, iters=30,
            trace_method="exact", key_bias=study.key_bias,
        )  # fmt: skip
        prefix = f"geodesic-{metric}" if m == "geodesic" else m
        for q in ("lambda_max", "trace"):
            row = curv[f"{prefix} curvature {q}"]
            assert row["value"] == ref.values[q] and row["per_batch"] == ref.per_batch[q]
            assert row["clean_losses"] == ref.clean_losses and row["settings"]["rho"] is None
    # at an interpolating solution the Euclidean Hessian (Gauss-Newton part) is PSD
    assert curv["euclidean curvature trace"]["value"] > 0
    # the τ table: curvature rows after the sharpness rows, no paper τ
    table = (tmp_path / "tau_table.md").read_text()
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and "curvature" in ln]
    assert len(lines) == 8 and all(ln.rstrip().endswith("| – |") for ln in lines)
    assert table.index("geodesic-mix-o2 worst l2") < table.index("adaptive curvature lambda_max")
    cells = json.loads((tmp_path / "summary.json").read_text())["cells"]
    assert {c["measure"] for c in cells if c["paper_family"] is None} >= set(NAMES)
    assert [c["measure"] for c in cells][-8:] == sorted(NAMES)


def test_curvature_added_to_a_finished_folder_reuses_its_rows(tmp_path):
    run_study(tiny(), tmp_path, progress=False, log=quiet)
    with Store(tmp_path / "study.sqlite", None, None) as store:
        before = store.measurements()
    on = tiny().with_curvature(CurvaturePlan(iters=10, probes=4))
    with pytest.raises(StudyMismatchError):  # the config records the curvature part
        run_study(on, tmp_path, progress=False, log=quiet)
    summary = run_study(on, tmp_path, force=True, progress=False, log=quiet)
    assert summary.trained == 0 and summary.reused == len(before) == 4 * 5
    assert summary.measured == 4 * 8
    with Store(tmp_path / "study.sqlite", None, None) as store:
        after = store.measurements()
    old = {(r["model_id"], r["measure"], r["rho"]): r["value"] for r in before}
    assert {
        k: r["value"] for r in after if (k := (r["model_id"], r["measure"], r["rho"])) in old
    } == old
    trace = [r for r in after if r["measure"] == "geodesic-mix curvature trace"]
    assert len(trace) == 4 and all(r["settings"]["probes"] == 4 for r in trace)


class Classifier(Linear):
    """The synthetic classifier study of ``test_classifier`` with checkpoints and batches."""

    def load(self, row):
        model = self.build()
        model.load_state_dict(torch.load(row["checkpoint_path"], weights_only=True))
        return model.eval()

    def batches(self):
        d = self.data()
        n, bs = self.cfg.n_sharp, self.cfg.sharp_batch
        return [(d["x_train"][i : i + bs], d["y_train"][i : i + bs]) for i in range(0, n, bs)]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_classifier_study_measures_curvature(tmp_path, one_thread):
    study = Classifier(Cfg(n_models=3)).with_curvature(CurvaturePlan(iters=5, probes=3))
    summary = run_study(study, tmp_path, progress=False, log=quiet)
    n_rows = sum(len(s.rhos) for s in study.plan())
    assert not summary.failures and summary.measured == 3 * n_rows
    with Store(tmp_path / "study.sqlite", None, None) as store:
        meas = [r for r in store.measurements() if r["model_id"] == "lin-000"]
        row = store.get_model("lin-000")
    row["checkpoint_path"] = str(tmp_path / row["checkpoint"])
    ref = gs.curvature(
        study.load(row), study.loss_fn, study.batches(), measure="euclidean", iters=5, probes=3,
        key_bias=study.key_bias,
    )  # fmt: skip
    got = {r["measure"]: r["value"] for r in meas}
    assert got["euclidean curvature lambda_max"] == ref.lambda_max
    assert got["euclidean curvature trace"] == ref.trace
    assert "Curvature (no ρ)" in (tmp_path / "report.html").read_text()


def test_report_families():
    assert measure_family("geodesic-inv curvature lambda_max") == "curvature"
    assert measure_family("relative_flatness") == "relative flatness"
    assert measure_family("adaptive worst l2") == "sharpness"
    assert default_paper_match("adaptive curvature trace") is None
    assert default_paper_match("adaptive worst l2") == "adaptive"
