"""Runs of the studies with their opt-in curvature part (``with_curvature()``, SPEC §9).

``diagonal``: Study 1 in full with curvature (training, sharpness, curvature) into ``--out``,
then a comparison of its sharpness rows and models with the committed ``results/diagonal``
(a copy of its database is read, never the committed file).

``vit-mnist``: the 48 ViTs of Study 2 retrained from their seeds (the checkpoints were not
committed) and only the curvature part measured on them. The retrained models are stored with
their own metrics and gap, so that curvature and gap describe the same weights; the script
prints how they compare with the committed ones.

    OMP_NUM_THREADS=1 .venv/bin/python results/curvature/run_curvature.py diagonal \
        --out runs/curvature-diagonal
    OMP_NUM_THREADS=1 .venv/bin/python results/curvature/run_curvature.py vit-mnist \
        --out runs/curvature-vit-mnist

``vit-mnist-diagnostics``: the diagnostics row (``ClassifierStudy.diagnose``, Study 2's middle
radii, ``key_bias="quotient"`` as in Study 4) of every retrained ViT of ``--out`` (the folder
of the ``vit-mnist`` run, with its checkpoints), into ``--out/diagnostics.csv`` (resumable).

``minilm-text``: the 24 MiniLM fine-tunes of Study 3 retrained from their seeds (the
checkpoints were not committed), each measured right after its fine-tune with the curvature
part of Study 3 (``MINILM_CURVATURE``, see ``minilm-text/SETTINGS.md``) and its diagnostics row
(``key_bias="quotient"``, on Study 3's two sharpness batches); then how the retrained models
compare with the committed ``results/minilm-text`` (``comparison.json``). Resumable.

    OMP_NUM_THREADS=1 .venv/bin/python results/curvature/run_curvature.py minilm-text \
        --out runs/curvature-minilm-text
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import torch

from geosharp.studies.runner import run_study

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent


def _read(db: Path) -> tuple[dict, list, list]:
    """Config, models and measurements of a committed database, read from a temporary copy."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "study.sqlite"
        shutil.copyfile(db, copy)
        conn = sqlite3.connect(copy)
        meta = dict(conn.execute("select key, value from meta").fetchall())
        models = conn.execute("select model_id, metrics, gap from models order by model_id")
        models = models.fetchall()
        meas = conn.execute(
            "select model_id, measure, rho, value, per_batch from measurements "
            "order by model_id, measure, rho"
        ).fetchall()
        conn.close()
    return json.loads(meta["config"]), models, meas


def _compare(out: Path, committed: Path) -> dict:
    """Models and sharpness rows of ``out`` against ``committed``: equal bit for bit?"""
    cfg_new, models_new, meas_new = _read(out / "study.sqlite")
    cfg_old, models_old, meas_old = _read(committed / "study.sqlite")
    old = {(m, n, r): (v, pb) for m, n, r, v, pb in meas_old}
    shared = [(m, n, r, v, pb) for m, n, r, v, pb in meas_new if (m, n, r) in old]
    differ = [(m, n, r) for m, n, r, v, pb in shared if (v, pb) != old[(m, n, r)]]
    worst = max(
        (abs(v / old[(m, n, r)][0] - 1) for m, n, r, v, _ in shared if old[(m, n, r)][0]),
        default=0.0,
    )
    return {
        "config_without_curvature_equal": {k: v for k, v in cfg_new.items() if k != "curvature"}
        == cfg_old,
        "models_equal": [(m, json.loads(x), g) for m, x, g in models_new]
        == [(m, json.loads(x), g) for m, x, g in models_old],
        "committed_rows": len(meas_old),
        "rows_found_in_run": len(shared),
        "rows_differing": len(differ),
        "largest_relative_difference": worst,
        "new_rows": len(meas_new) - len(shared),
    }


def diagonal(args: argparse.Namespace) -> None:
    """Study 1 with curvature, then the comparison with ``results/diagonal``."""
    from geosharp.studies.diagonal import DiagonalStudy

    study = DiagonalStudy().with_curvature()
    t0 = time.perf_counter()
    summary = run_study(study, args.out, progress=False)
    wall = time.perf_counter() - t0
    cmp = _compare(Path(args.out), RESULTS / "diagonal")
    info = {
        "wall_s": wall,
        "trained": summary.trained,
        "measured": summary.measured,
        "failures": summary.failures,
        **cmp,
    }
    print(json.dumps(info, indent=2))
    (Path(args.out) / "comparison.json").write_text(json.dumps(info, indent=2) + "\n")


def vit_mnist(args: argparse.Namespace) -> None:
    """The ViTs retrained, only the curvature part measured on them."""
    from geosharp.studies.classifier import curvature_specs
    from geosharp.studies.vit_mnist import ViTMNISTStudy

    class CurvatureOnly(ViTMNISTStudy):
        """Study 2 with curvature; this run measures only the curvature part of the plan.

        The config (and so the folder's identity) is that of the whole plan with curvature;
        the sharpness rows were measured by the committed run on the original weights.
        """

        def plan(self):
            return curvature_specs(self.curvature)

    study = CurvatureOnly().with_curvature()
    t0 = time.perf_counter()
    summary = run_study(study, args.out, progress=False)
    wall = time.perf_counter() - t0
    _, models_new, _ = _read(Path(args.out) / "study.sqlite")
    _, models_old, _ = _read(RESULTS / "vit-mnist" / "study.sqlite")
    old = {m: (json.loads(x), g) for m, x, g in models_old}
    same_error, gap_diff = 0, []
    for m, x, g in models_new:
        metrics = json.loads(x)
        o_metrics, o_gap = old[m]
        same_error += (metrics["train_error"], metrics["test_error"]) == (
            o_metrics["train_error"],
            o_metrics["test_error"],
        )
        gap_diff.append(abs(g - o_gap))
    with sqlite3.connect(Path(args.out) / "study.sqlite") as conn:
        train = [t for (t,) in conn.execute("select train_time_s from models")]
        curv = [t for (t,) in conn.execute("select time_s from measurements")]
    info = {
        "wall_s": wall,
        "trained": summary.trained,
        "measured": summary.measured,
        "failures": summary.failures,
        "training_s": sum(train),
        "curvature_s": sum(curv),
        "models_with_the_committed_train_and_test_error": same_error,
        "models": len(models_new),
        "largest_gap_difference": max(gap_diff, default=math.nan),
        "median_gap_difference": sorted(gap_diff)[len(gap_diff) // 2] if gap_diff else None,
    }
    print(json.dumps(info, indent=2))
    (Path(args.out) / "comparison.json").write_text(json.dumps(info, indent=2) + "\n")


def vit_mnist_diagnostics(args: argparse.Namespace) -> None:
    """The diagnostics of the retrained Study 2 ViTs of ``--out``."""
    from geosharp.studies.classifier import diagnose_folder
    from geosharp.studies.vit_mnist import ViTMNISTStudy

    t0 = time.perf_counter()
    n = diagnose_folder(
        ViTMNISTStudy(),
        args.out,
        key_bias="quotient",
        extra=lambda row: {"weight_decay": row["hparams"]["weight_decay"]},
        log=lambda msg: print(msg, flush=True),
    )
    print(json.dumps({"diagnosed": n, "wall_s": time.perf_counter() - t0}), flush=True)


def _compare_models(out: Path, committed: Path) -> dict:
    """The retrained models of ``out`` against the committed ones: metrics equal bit for bit?"""
    _, models_new, _ = _read(out / "study.sqlite")
    _, models_old, _ = _read(committed / "study.sqlite")
    old = {m: (json.loads(x), g) for m, x, g in models_old}
    bit_exact, same_error, gap_diff, loss_diff = [], 0, [], []
    for m, x, g in models_new:
        metrics = json.loads(x)
        o_metrics, o_gap = old[m]
        if metrics == o_metrics:
            bit_exact.append(m)
        errors = [k for k in metrics if k.endswith("_error")]
        same_error += all(metrics[k] == o_metrics[k] for k in errors)
        gap_diff.append(abs(g - o_gap))
        losses = [k for k in metrics if k.endswith("_loss")]
        loss_diff += [abs(metrics[k] / o_metrics[k] - 1) for k in losses if o_metrics[k]]
    return {
        "models": len(models_new),
        "models_bit_exact": len(bit_exact),
        "models_with_the_committed_errors": same_error,
        "largest_gap_difference": max(gap_diff, default=math.nan),
        "median_gap_difference": sorted(gap_diff)[len(gap_diff) // 2] if gap_diff else None,
        "largest_relative_loss_difference": max(loss_diff, default=math.nan),
    }


def minilm_text(args: argparse.Namespace) -> None:
    """Study 3 retrained, each fine-tune measured (curvature, diagnostics) right after."""
    from geosharp.studies.classifier import (
        DIAGNOSTICS_FILE,
        append_diagnostics,
        curvature_specs,
        read_diagnostics,
    )
    from geosharp.studies.minilm_text import MINILM_CURVATURE, MiniLMTextStudy
    from geosharp.studies.runner import Shard

    out = Path(args.out)

    class CurvatureOnly(MiniLMTextStudy):
        """Study 3 with curvature; this run measures only the curvature part of the plan.

        A model's diagnostics row is computed when it is first loaded (as Study 4 does).
        """

        def plan(self):
            return curvature_specs(self.curvature)

        def load(self, row):
            model = super().load(row)
            if row["model_id"] not in read_diagnostics(out / DIAGNOSTICS_FILE):
                t0 = time.perf_counter()
                diag = self.diagnose(model, key_bias="quotient")
                diag["weight_decay"] = row["hparams"]["weight_decay"]
                diag["diagnostics_time_s"] = time.perf_counter() - t0
                append_diagnostics(out / DIAGNOSTICS_FILE, row["model_id"], diag)
            return model

    study = CurvatureOnly().with_curvature(MINILM_CURVATURE)
    n = study.cfg.n_models
    t0 = time.perf_counter()
    failures = []
    for k in range(1, n + 1):  # one model at a time: fine-tune, then measure it
        summary = run_study(study, out, progress=False, shard=Shard(k, n), report=False)
        failures += summary.failures
        print(f"model {k}/{n} done at {time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    with sqlite3.connect(out / "study.sqlite") as conn:
        train = [t for (t,) in conn.execute("select train_time_s from models")]
        curv = [t for (t,) in conn.execute("select time_s from measurements")]
    diag = read_diagnostics(out / DIAGNOSTICS_FILE)
    info = {
        "wall_s": wall,
        "failures": failures,
        "training_s": sum(train),
        "curvature_s": sum(curv),
        "diagnostics_s": sum(d.get("diagnostics_time_s", 0.0) for d in diag.values()),
        **_compare_models(out, RESULTS / "minilm-text"),
    }
    print(json.dumps(info, indent=2))
    (out / "comparison.json").write_text(json.dumps(info, indent=2) + "\n")


def main() -> None:
    """Parse the arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "study", choices=("diagonal", "vit-mnist", "vit-mnist-diagnostics", "minilm-text")
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = {
        "diagonal": diagonal,
        "vit-mnist": vit_mnist,
        "vit-mnist-diagnostics": vit_mnist_diagnostics,
        "minilm-text": minilm_text,
    }
    run[args.study](args)


if __name__ == "__main__":
    main()
