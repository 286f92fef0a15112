"""Orbit-position diagnostics of a few of Study 2's ViTs, retrained from their seeds.

Study 2's checkpoints were not kept. Its training is deterministic in each model's seed, so a
model can be retrained and checked against its stored train/test error (bit-exact training
reproduces them). For the first ``K`` models of ``results/vit-mnist`` this retrains the model,
checks the errors, and writes the same diagnostics row Study 4 computes
(``ClassifierStudy.diagnose``, the method ``VitOrbitStudy`` uses: orbit position of every head
and the ascent optima of adaptive ℓ2 and geodesic inv at Study 2's middle radii, with
``key_bias="quotient"`` as in Study 4) to ``results/vit-orbit/study2_diagnostics.csv``.

Usage: ``python results/vit-orbit/study2_diagnostics.py [K]`` (default 6).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import torch

from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy
from geosharp.studies.vit_orbit import append_diagnostics, read_diagnostics

HERE = Path(__file__).resolve().parent
STUDY2 = HERE.parent / "vit-mnist" / "study.sqlite"
OUT = HERE / "study2_diagnostics.csv"


def main(k: int) -> None:
    """Retrain and diagnose the first ``k`` models of Study 2."""
    torch.set_num_threads(1)
    study = ViTMNISTStudy(ViTMNISTConfig())
    with sqlite3.connect(STUDY2) as conn:
        stored = {
            mid: (json.loads(h), json.loads(m))
            for mid, h, m in conn.execute("SELECT model_id, hparams, metrics FROM models")
        }
    done = read_diagnostics(OUT)
    for mid, hp in study.population()[:k]:
        if mid in done:
            continue
        t0 = time.perf_counter()
        state, metrics = study.fit(hp)
        ref = stored[mid][1]
        same = all(metrics[key] == ref[key] for key in ("train_error", "test_error"))
        model = study.build()
        model.load_state_dict(state)
        model.float().eval()
        row = study.diagnose(model, key_bias="quotient")
        row["reproduced_errors"] = float(same)
        row["weight_decay"] = hp["weight_decay"]
        row["time_s"] = time.perf_counter() - t0
        append_diagnostics(OUT, mid, row)
        print(
            mid, "errors reproduced" if same else f"errors differ: {metrics} vs {ref}", flush=True
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
