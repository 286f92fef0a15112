"""What a manifest study says: its log, its report's settings, headline and table captions.

Three tiny BERT classifiers (Hugging Face folders) on 8 snippets: nothing is trained, so the
log does not say "training"; the symmetry blocks, the same in each, are listed once; the
report's settings give the samples and length used (8 and 32), not those asked (1,024 and
128); the report opens with a headline, and the granulated τ and CMI tables say in plain
words how to read them.
"""

from __future__ import annotations

import json

import pytest

from geosharp.studies.population import PopulationSettings, parse_rho, run_population

from ..measure.conftest import save_tiny_manifest

pytest.importorskip("transformers")

ROWS = [("a", 0.9, 0.7, 0.1), ("b", 0.95, 0.8, 0.01), ("c", 0.9, 0.85, 0.1)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    root = tmp_path_factory.mktemp("records")
    # max_position_embeddings 32
    save_tiny_manifest(root, ROWS, ["model", "train_accuracy", "test_accuracy", "lr"])
    options = {"data": str(root / "data.csv"), "seed": 0, "batch_size": 4, "samples": 1024,
               "max_length": 128, "device": resolve_device("cpu"),
               "dtype": resolve_dtype("float32")}  # fmt: skip
    settings = PopulationSettings(
        manifest=str(root / "m.csv"),
        options=options,
        measures=("adaptive-l2", "geodesic-inv-o2"),
        rho=parse_rho(["0.05"]),
        steps=1,
    )
    lines: list[str] = []
    out = root / "out"
    summary = run_population(settings, out, progress=False, log=lines.append)
    return out, summary, lines


def test_the_log_says_what_is_done(finished):
    _, _, lines = finished
    assert not any(line.startswith("training") for line in lines), lines
    assert "measuring 3 models of the manifest (nothing is trained)" in lines
    listings = [line for line in lines if line.startswith("adaptive geometry:")]
    assert len(listings) == 1, lines  # the blocks in full once ...
    same = [line for line in lines if line.startswith("symmetry blocks: the same as")]
    assert len(same) == 2, lines  # ... then a line per model, with its own verification
    for line in same:
        assert line.startswith("symmetry blocks: the same as a's (listed above); symmetry claims")
        assert "moved by ≤ " in line and "\n" not in line


def test_the_report_settings_say_the_batches_used(finished):
    out, _, _ = finished
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    used = "4 per batch, 7 samples, max length 32 (asked: 1024 samples, max length 128)"
    assert summary["settings"]["batches"] == used
    assert used in (out / "report.html").read_text(encoding="utf-8")


def test_the_report_opens_with_a_headline(finished):
    out, run, _ = finished
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    lead = summary["headline"]
    assert lead and lead[0].startswith("n = 3: ") and run.report.headline == lead
    assert list(summary)[:2] == ["title", "headline"]
    html = (out / "report.html").read_text(encoding="utf-8")
    assert html.index('<p class="headline">') < html.index("<h2>Settings</h2>")
    table = (out / "tau_table.md").read_text(encoding="utf-8").splitlines()
    assert table[2] == f"**{' '.join(lead)}**"


def test_the_hyperparameter_tables_say_how_to_read_them(finished):
    out, _, _ = finished
    sections = {
        s["title"]: s["caption"]
        for s in json.loads((out / "summary.json").read_text(encoding="utf-8"))["sections"]
    }
    assert (
        "In plain words: ψ for a hyperparameter asks"
        in (sections["Granulated τ per hyperparameter"])
    )
    assert (
        "In plain words: once the values of the hyperparameters S are known"
        in (sections["Conditional mutual information score (PGDL)"])
    )
