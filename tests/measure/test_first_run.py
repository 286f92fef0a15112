"""Issue 29, item 2: a first run that fits the machine.

Before measuring, ``gs.measure`` (and so ``geosharp measure``) times one forward+backward pass
and a short ascent of each measure, and says the run's estimated time with its cells; a long run
on a CPU is followed by what each option would cut it to, and nothing is changed for the user.
Every result file records the sizes used: samples, batch size, maximum length and steps.
"""

import csv
import io
import json

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.measures import parse_measure
from geosharp.measuring import estimate
from geosharp.measuring.estimate import RunEstimate, batch_sizes, estimate_run

from .conftest import CORPUS

FAST = ["--measures", "geodesic-inv-o2", "--rho", "0.1", "--steps", "2"]


def mlp_batches(n_batches=2, rows=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    batches = [(torch.randn(rows, 4), torch.randint(0, 3, (rows,))) for _ in range(n_batches)]
    return model, batches


def test_the_estimate_is_said_before_measuring(llama_dir, corpus_txt, tmp_path, run_cli):
    code, out, err = run_cli(
        llama_dir, corpus_txt, *FAST, "--batch-size", "4", "--max-length", "16",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("time estimate: "))
    assert line.startswith(
        "time estimate: 1 cell × 2 steps × 2 batches ≈ 4 forward+backward passes ≈ "
    )
    assert "on this machine (cpu, 1 thread; one forward+backward of batch 0 took " in line
    assert "an ascent step " in line and "timed on batch 0" in line
    assert out.index("time estimate: ") < out.index("measuring 1 (measure, rho) cell")
    assert "this run is long" not in out  # a short run gets no advice

    # the sizes of the run, in both result files
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "results.csv").read_text())))
    assert list(rows[0])[-4:] == ["steps", "samples", "batch_size", "max_length"]
    n_docs = len(CORPUS)
    assert {k: rows[0][k] for k in ("steps", "samples", "batch_size", "max_length")} == {
        "steps": "2",
        "samples": str(n_docs),
        "batch_size": "4",
        "max_length": "16",
    }
    settings = json.loads((tmp_path / "o" / "results.json").read_text())["settings"]
    assert (settings["steps"], settings["samples"]) == (2, n_docs)
    assert (settings["batch_size"], settings["max_length"]) == (4, 16)
    assert settings["largest_batch"] == 4 and 2 <= settings["longest_input"] <= 16
    assert settings["estimated_time_s"] > 0 and settings["one_pass_s"] > 0


def test_a_long_cpu_run_says_what_cuts_it(llama_dir, corpus_txt, tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr(estimate, "LONG_RUN_S", 0.0)  # every run is "long"
    code, out, err = run_cli(
        llama_dir, corpus_txt, "--rho", "0.1", "1", "--measures", "adaptive", "geodesic-inv-o2",
        "--steps", "12", "--batch-size", "4", "--max-length", "64", "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "this run is long for a CPU; estimates of what each option would cut it to" in out
    assert "  --steps 10: ≈ " in out and "more values are lower bounds" in out
    assert "  fewer --rho: each radius left out of the 2 saves ≈ " in out
    assert "  fewer --measures: each measure left out of the 2 saves ≈ " in out
    assert "  --batch-size alone cuts little" in out and "m-sharpness" in out
    assert out.index("this run is long") < out.index("measuring 4 (measure, rho) cell")
    # nothing was changed: the run measured what was asked
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert len(res["results"]) == 4 and res["settings"]["steps"] == 12


def test_advice_estimates_scale_with_the_options():
    est = RunEstimate(
        n_cells=9, steps=20, n_batches=8, passes=1440.0, pass_s=1.0, seconds=2400.0,
        device="cpu", threads=2, worst_only=True, n_rhos=3, n_measures=3, n_samples=1024,
        weights=[1.0] * 8, widths=[128] * 8, rows=[128] * 8,
        cells=[(m, r, 2400.0 / 9) for m in "abc" for r in (0.01, 0.1, 1.0)],
    )  # fmt: skip
    assert est.long
    text = "\n".join(est.advice())
    assert "--samples 256: ≈ 10.0 min" in text  # 2 of the 8 batches: a quarter of 40 min
    assert "--max-length 64: ≈ 20.0 min (batches are up to 128 tokens wide" in text
    assert "--steps 10: ≈ 20.0 min" in text
    assert "each radius left out of the 3 saves ≈ 13.3 min" in text
    assert "each measure left out of the 3 saves ≈ 13.3 min" in text
    assert "--samples 256 --max-length 64 together: ≈ 5.0 min" in text
    gpu = RunEstimate(**{**est.__dict__, "device": "cuda:0"})
    assert not gpu.long and gpu.advice() == []  # the defaults suit a GPU: no advice there
    short = RunEstimate(**{**est.__dict__, "seconds": 60.0})
    assert short.advice() == []


def test_estimate_without_a_probe_counts_passes(monkeypatch):
    model, batches = mlp_batches()
    monkeypatch.setattr(estimate, "_timed_pass", lambda *a: 0.5)
    specs = [parse_measure(m) for m in ("adaptive", "geodesic-inv-o2")]
    est = estimate_run(model, nn.functional.cross_entropy, batches, specs, [0.1, 1.0], steps=10)
    assert (est.n_cells, est.passes, est.pass_s) == (4, 80.0, 0.5)
    # 2 batches × (10 steps × 1.2 or 1.4 passes + a forward of 0.35) × 0.5 s, 2 radii each
    assert est.seconds == pytest.approx(2 * 2 * 0.5 * ((12 + 0.35) + (14 + 0.35)))
    est = estimate_run(
        model, nn.functional.cross_entropy, batches, specs, [0.1], steps=10,
        probe=lambda spec, k: 0.1 * k + 1.0,  # a set-up of 1 s, then 0.1 s a step
    )  # fmt: skip
    assert est.step_s == pytest.approx({s.name: 0.1 for s in specs})
    assert est.seconds == pytest.approx(2 * 2 * (10 * 0.1 + 0.35 * 0.5))


def test_gs_measure_records_the_sizes_of_its_batches():
    model, batches = mlp_batches(n_batches=3, rows=8)
    batches[-1] = (batches[-1][0][:5], batches[-1][1][:5])
    logged = []
    rep = gs.measure(model, batches, measures=["adaptive"], rhos=[1.0], steps=2, log=logged.append)
    assert any(x.startswith("time estimate: 1 cell × 2 steps × 3 batches") for x in logged)
    assert rep.settings["largest_batch"] == 8 and "longest_input" not in rep.settings
    assert rep.sizes() == {"steps": 2, "samples": 21, "batch_size": 8, "max_length": None}
    (row,) = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert (row["steps"], row["samples"], row["batch_size"], row["max_length"]) == (
        "2",
        "21",
        "8",
        "",
    )
    tokens = [({"input_ids": torch.zeros(4, 7, dtype=torch.long)}, torch.zeros(4))]
    assert batch_sizes(tokens) == {"largest_batch": 4, "longest_input": 7}
