"""``benchmarks/gpu_table.py`` (issue 43's GPU table) on its CPU twin: ``summary.json`` has the
issue's shape exactly, figures where a configuration ran and reasons where it did not.

One tiny BERT is measured in the script's own child process; the memory and time-budget skips
need no child. The script's CUDA paths (``max_memory_allocated``, the real shapes) run on a
GPU only.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The issue's shape: {"device": str, "torch": str, "configs": {NAME: {...}}}.
ENTRY_TYPES = {
    "params": int,
    "dtype": str,
    "batch": str,
    "plain_ms": float,
    "step_ratio": dict,
    "setup_plain_steps": float,
    "peak_buffers_P": dict,
}
OPTIONAL = {"skipped", "errors"}
#: Measured in the child here (two of the table's four, to keep the test short).
MEASURES = ("adaptive-l2", "geodesic-inv-o2")


@pytest.fixture(scope="module")
def gpu_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("gpu_table")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _check_shape(summary: dict) -> None:
    assert set(summary) == {"device", "torch", "configs"}
    assert isinstance(summary["device"], str) and summary["device"]
    assert isinstance(summary["torch"], str) and summary["torch"]
    for name, entry in summary["configs"].items():
        assert isinstance(name, str)
        assert set(ENTRY_TYPES) <= set(entry) <= set(ENTRY_TYPES) | OPTIONAL, (name, entry)
        not_run = bool(entry.keys() & OPTIONAL)
        for key, typ in ENTRY_TYPES.items():
            value = entry[key]
            if value is None:  # a figure is missing only where the entry says why
                assert not_run and typ is float, (name, key)
                continue
            assert type(value) is typ, (name, key, value)
        for key in ("step_ratio", "peak_buffers_P"):
            for measure, value in entry[key].items():
                assert isinstance(measure, str) and type(value) is float, (name, key, measure)
        for key in OPTIONAL & entry.keys():
            assert entry[key] and all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in entry[key].items()
            ), (name, key)


def test_cpu_twin_measures_a_tiny_bert(gpu_table, tmp_path):
    out = tmp_path / "table"
    argv = ["--device", "cpu", "--configs", "tiny-bert/float32", "--out", str(out)]
    argv += [
        "--budget",
        "300",
        "--steps",
        "1,2",
        "--repeats",
        "1",
        "--measures",
        ",".join(MEASURES),
    ]
    assert gpu_table.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    _check_shape(summary)
    entry = summary["configs"]["tiny-bert/float32"]
    assert not entry.keys() & OPTIONAL, entry
    assert entry["dtype"] == "float32" and entry["batch"] == "2 × 8"
    assert entry["params"] == 1_019_746  # BertConfig(hidden 32, 2 layers), vocabulary 30 522
    assert set(entry["step_ratio"]) == set(entry["peak_buffers_P"]) == set(MEASURES)
    for value in (entry["plain_ms"], entry["setup_plain_steps"], *entry["step_ratio"].values()):
        assert math.isfinite(value)
    assert entry["plain_ms"] > 0
    raw = json.loads((out / "raw.json").read_text(encoding="utf-8"))
    assert raw["schema"] == "geosharp-gpu-table/1"
    child = raw["configs"]["tiny-bert/float32"]["child"]
    assert child["rc"] == 0 and not child["timed_out"] and child["stage"] == "done"
    assert child["n_params_perturbed"] == entry["params"]
    assert "tiny-bert/float32" in (out / "table.md").read_text(encoding="utf-8")
    assert "tiny-bert/float32" in (out / "log.txt").read_text(encoding="utf-8")
    assert sorted(p.name for p in out.iterdir()) == [
        "log.txt",
        "raw.json",
        "summary.json",
        "table.md",
    ]


def test_skips_what_does_not_fit_or_is_out_of_time(gpu_table, tmp_path):
    out = tmp_path / "table"
    configs = "tiny-llama-7b-shape/bfloat16,tiny-bert/bfloat16"
    argv = ["--device", "cpu", "--configs", configs, "--out", str(out), "--budget", "300"]
    assert gpu_table.main([*argv, "--device-memory-gib", "0.5"]) == 0  # 1 GiB margin alone
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    _check_shape(summary)
    big = summary["configs"]["tiny-llama-7b-shape/bfloat16"]
    assert big["plain_ms"] is None and big["step_ratio"] == {} and big["dtype"] == "bfloat16"
    assert big["params"] > 0 and big["batch"] == "1 × 16"
    assert big["skipped"]["config"] == "no measure fits in the device's memory"
    assert all("does not fit" in big["skipped"][m] for m in gpu_table.MEASURES)
    assert "(memory taken as 0.5 GiB" in summary["device"]

    assert gpu_table.main([*argv[:-1], "0"]) == 0  # --budget 0: nothing starts
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    _check_shape(summary)
    for entry in summary["configs"].values():
        assert entry["skipped"]["config"].startswith("out of time: 0 s of the 0 s budget left")


def test_the_7b_shape_fits_an_h200_not_an_h100_for_geodesic(gpu_table):
    meta = gpu_table.describe("llama-7b", "bfloat16")  # on the meta device: no memory
    assert 6.5e9 < meta["params"] == meta["trainable"] < 6.8e9 and meta["batch"] == "1 × 128"
    need = {
        m: gpu_table.memory_need(meta["params"], meta["params"], 2, m) for m in gpu_table.MEASURES
    }
    h100, h200 = 79.1 * 2**30, 139.8 * 2**30  # torch's total_memory of each, about
    assert need["adaptive-l2"] < h100 < need["geodesic-inv-o2"] < h200
