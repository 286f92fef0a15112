"""``--no-check`` (``check=False``) skips the invariance self-check alone, and measures the same.

Before the fix, ``prepare_measurement`` handed the symmetry proof no inputs when ``check`` was
off, so every model with symmetry blocks failed with "the symmetry finder could not run the
model on batch 0" (a Hugging Face model: "...input_ids or inputs_embeds"). The proof decides
which blocks are measured (a claim that fails is dropped, never refused), so it runs either
way: a tiny BERT classifier and a tiny Llama (causal-lm) measured with and without
``--no-check`` give bit-identical values, per batch, for the same seed; so do
``geosharp study MANIFEST --no-check`` (three tiny BERTs) and ``gs.measure(check=False)``.
"""

import csv
import json

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.errors import MeasureError

from ..test_measure import SENTENCES, save_tiny_bert, write_csv
from .conftest import CORPUS, make_tokenizer, save_tiny_classifier

pytest.importorskip("transformers")

ARGS = [
    "--measures", "geodesic-inv-o2", "adaptive-l2", "--rho", "0.1", "--steps", "2",
    "--batch-size", "3", "--max-length", "16", "--seed", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def bert_and_csv(tmp_path_factory):
    d = tmp_path_factory.mktemp("nocheckbert")
    (d / "bert").mkdir()
    return save_tiny_bert(d / "bert"), write_csv(d / "train.csv", SENTENCES)


@pytest.mark.parametrize("which", ["bert", "llama"])
def test_no_check_measures_what_the_checked_run_measures(
    which, bert_and_csv, llama_dir, corpus_txt, tmp_path, run_cli
):
    model, data = bert_and_csv if which == "bert" else (llama_dir, corpus_txt)
    code, out, err = run_cli(model, data, *ARGS, "--out", tmp_path / "checked")
    assert code == 0, err
    assert "invariance check PASSED" in out
    code, out, err = run_cli(model, data, *ARGS, "--no-check", "--out", tmp_path / "unchecked")
    assert code == 0, err
    assert "could not run the model" not in err and "self-check" not in out
    assert "finding symmetry blocks (and proving each on batch 0)" in out

    want = json.loads((tmp_path / "checked" / "results.json").read_text())
    got = json.loads((tmp_path / "unchecked" / "results.json").read_text())
    assert want["invariance_check"]["passed"] and got["invariance_check"] is None
    for key in ("n_symmetry_blocks", "n_group_factors", "n_params"):
        assert got["settings"][key] == want["settings"][key], key
    assert got["settings"]["n_symmetry_blocks"] > 0  # the geodesic measure used blocks
    assert got["clean_losses"] == want["clean_losses"]
    assert [(r["measure"], r["rho"]) for r in got["results"]] == [
        (r["measure"], r["rho"]) for r in want["results"]
    ]
    for g, w in zip(got["results"], want["results"], strict=True):
        assert g["value"] == w["value"] and g["per_batch"] == w["per_batch"], g["measure"]
        assert g["value"] > 0


def test_measure_check_false_finds_and_proves_the_blocks():
    """gs.measure(check=False) on a model with blocks and no space given (no HF needed)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(3, 5, 8)
    kw = dict(measures=["geodesic-inv-o2"], rhos=[0.1], steps=2, seed=1, progress=False, warn=print)
    checked = gs.measure(layer, [(x, x)], **kw)
    unchecked = gs.measure(layer, [(x, x)], check=False, **kw)
    assert checked.invariance.passed and unchecked.invariance is None
    assert unchecked.rows[0].per_batch == checked.rows[0].per_batch
    assert unchecked.settings["n_symmetry_blocks"] == checked.settings["n_symmetry_blocks"] > 0
    assert unchecked.symmetry_summary == checked.symmetry_summary


def test_study_no_check_measures_what_the_checked_study_measures(tmp_path, capsys):
    pytest.importorskip("transformers")
    from geosharp.cli import main

    tok = make_tokenizer()
    with (tmp_path / "manifest.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["model", "train_accuracy", "test_accuracy"])
        for i, (tr, te) in enumerate([(1.0, 0.7), (0.95, 0.8), (0.9, 0.85)]):
            save_tiny_classifier(tmp_path / f"m{i}", tok, seed=i)
            tok.save_pretrained(tmp_path / f"m{i}")
            w.writerow([f"m{i}", tr, te])
    rows = [(t, i % 2) for i, t in enumerate((CORPUS * 2)[:8])]
    data = write_csv(tmp_path / "data.csv", rows)
    args = [
        "study", tmp_path / "manifest.csv", "--data", data, "--measures", "geodesic-inv-o2",
        "--rho", "0.05", "--steps", "2", "--batch-size", "4", "--max-length", "16",
        "--no-progress", "--threads", "1",
    ]  # fmt: skip
    results = {}
    for name, extra in (("checked", []), ("unchecked", ["--no-check"])):
        code = main([*map(str, args), "--out", str(tmp_path / name), *extra])
        err = capsys.readouterr().err
        assert code == 0, err
        with (tmp_path / name / "results.csv").open(encoding="utf-8") as f:
            results[name] = sorted(
                (r["model_id"], r["measure"], r["rho"], r["value"]) for r in csv.DictReader(f)
            )
    assert len(results["checked"]) == 3
    assert results["unchecked"] == results["checked"]


@pytest.mark.parametrize(
    ("batch", "says"),
    [
        (torch.randn(3, 8), "batch 1 must be a pair (inputs, targets), got Tensor"),
        ((torch.randn(3, 8),), "batch 1 must be a pair (inputs, targets), got tuple of 1"),
    ],
)
def test_a_batch_that_is_not_a_pair_is_named_before_the_symmetry_search(batch, says):
    """Not "the symmetry finder could not run the model": the batch and what it should be."""
    model = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    good = (torch.randn(3, 4, 8), torch.randn(3, 4, 8))
    with pytest.raises(MeasureError) as err:
        gs.measure(model, [good, batch], measures=["adaptive"], rhos=[0.1])
    assert str(err.value) == says
