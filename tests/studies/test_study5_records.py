"""Study 5's records say what happened (results/study5-minilm-finetunes, issue 41).

The label noise recorded is the noise applied (a training set of 1,024 is the protected
sharpness sample alone: nothing is flipped), two training shards appending to one manifest
write its header once, on line 1, and ``gpu/study.sh`` fails when its shards or merges do.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "results" / "study5-minilm-finetunes"
pytestmark = pytest.mark.skipif(not STUDY.is_dir(), reason="no results/ in this checkout")


def _records():
    sys.path.insert(0, str(STUDY))
    try:
        import records
    finally:
        sys.path.remove(str(STUDY))
    return records


def test_the_noise_recorded_is_the_noise_applied():
    records = _records()
    labels = np.arange(4096) % 2
    for n_train, drawn, flips in ((1024, 0.2, 0), (2048, 0.1, 102), (4096, 0.2, 614)):
        noisy, n_flip = records.noisy_labels(labels[:n_train], drawn, 1024, seed=7)
        assert n_flip == flips == int((noisy != labels[:n_train]).sum())
        assert not (noisy[:1024] != labels[:1024]).any()  # the sharpness sample stays clean
        hp = records.applied_noise({"n_train": n_train, "label_noise": drawn}, n_flip)
        assert hp["label_flips"] == flips and hp["label_noise"] == flips / n_train


def test_the_committed_manifest_records_the_noise_applied():
    for name in ("manifest.csv", "excluded.csv"):
        with (STUDY / "gpu-run" / name).open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        for r in rows:
            n, noise, flips = int(r["n_train"]), float(r["label_noise"]), int(r["label_flips"])
            assert noise == flips / n <= 0.15, r["name"]
            assert n > 1024 or flips == 0, r["name"]
    with (STUDY / "gpu-run" / "manifest.csv").open(newline="") as fh:
        flipped = [r for r in csv.DictReader(fh) if int(r["label_flips"]) > 0]
    assert len(flipped) == 21  # 33 drawn noisy, 12 of them with 1,024 snippets


_APPENDER = """
import pathlib, sys, time
real = pathlib.Path.is_file
def slow(self):  # widens the window between a check and a write
    found = real(self)
    time.sleep(0.2)
    return found
pathlib.Path.is_file = slow
sys.path.insert(0, {study!r})
from records import append
go = pathlib.Path({go!r})
while not go.exists():
    time.sleep(0.001)
for j in range(3):
    append(pathlib.Path({folder!r}) / f"m{{j}}.csv", ["name", "j"], {{"name": sys.argv[1], "j": j}})
"""


def test_two_shards_appending_at_once_write_the_header_once_on_line_1(tmp_path):
    go = tmp_path / "go"
    code = _APPENDER.format(study=str(STUDY), go=str(go), folder=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", code, who], stderr=subprocess.PIPE, text=True)
        for who in ("a", "b")
    ]
    go.touch()
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    for j in range(3):
        lines = (tmp_path / f"m{j}.csv").read_text().splitlines()
        assert lines[0] == "name,j" and lines.count("name,j") == 1, lines
        assert sorted(lines[1:]) == [f"a,{j}", f"b,{j}"], lines


_STUB = """#!/usr/bin/env bash
# stands for python: torch absent, train.py and pilot.py quick, geosharp failing
case "$1" in
  -c) case "$2" in
        *geosharp.cli*) echo "stub: geosharp failed" >&2; exit 1 ;;
        *"import torch"*) echo cpu; exit 0 ;;
        *) exec {python} "$@" ;;
      esac ;;
  *train.py)
    while [ $# -gt 0 ]; do
      case $1 in --out) out=$2 ;; --models) models=$2 ;; esac; shift
    done
    if [ "$models" = 0:1 ]; then
      printf 'name,model,train_error,test_error\\nsmoke-000,models/smoke-000,0.1,0.2\\n' \\
        >"$out/manifest.csv"
    fi ;;
  *pilot.py)
    decide=0
    while [ $# -gt 0 ]; do
      case $1 in --decide) decide=1 ;; --json) js=$2 ;; esac; shift
    done
    if [ $decide = 1 ]; then
      echo '{{"steps": 2, "samples": 16, "rows_per_model": 3, "rho_main": ["0.1"],
             "rho_outer": ["0.2"]}}' >"$js"
    fi ;;
esac
"""


def test_study_sh_fails_when_its_measuring_shards_fail(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(textwrap.dedent(_STUB.format(python=sys.executable)))
    stub.chmod(0o755)
    env = {**os.environ, "PY": str(stub), "WORK": str(tmp_path / "w"), "SITE": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(STUDY / "gpu" / "study.sh"), "100", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    log = (tmp_path / "w" / "logs" / "study.log").read_text()
    assert run.returncode != 0, log
    assert "main shard 1: failed (rc 1" in log, log
    assert (tmp_path / "w" / "out" / "study5.tar.gz").is_file()  # packed all the same
