r"""Orbit-position and ascent diagnostics of the diagonal-net studies (issue 14).

For every analysed model of a diagonal study folder whose checkpoint is kept, one row of
``diagnostics.csv`` (the file a study report turns into its diagnostics section):

* the orbit position of the pairs ``(u_j, v_j)`` under GL(1)^d, ``(u, v) ↦ (a u, v / a)``, in
  the formulas of the attention heads with every coordinate a 1 × 1 "head": imbalance
  ``√Σ(u²−v²)² / √Σ(u²+v²)²`` (gradient flow conserves ``u² − v²``), excess
  ``Σ(u²+v²) / Σ 2|u v| − 1`` (0 at the balanced point) and ``log_ratio`` the mean of
  ``½ log(|u_j| / |v_j|)`` (:func:`geosharp.estimators.orbit.log_scale` per pair);
* the Auto-PGD optimum of adaptive ℓ2 and geodesic inv (order 2) at the study's middle ρ with
  the study's steps (:func:`geosharp.estimators.diagnostics.ascent_diagnostics`, the study's
  own ascent): the radius used, the order-2 displacement and the value (every coordinate is
  in a pair, so the budget split is 1 on the pairs).

Study 1's checkpoints were not committed; ``runs/curvature-diagonal`` holds its 50 models
retrained from their seeds (metrics equal to the committed ones to 9.5e-12,
``results/curvature/README.md``). Study 1b's are in ``runs/diagonal-2``.

    OMP_NUM_THREADS=1 .venv/bin/python results/diagonal-2/diagnostics.py runs/diagonal-2 \\
        results/diagonal-2/diagnostics.csv
    OMP_NUM_THREADS=1 .venv/bin/python results/diagonal-2/diagnostics.py \\
        runs/curvature-diagonal results/diagonal/diagnostics.csv
"""

from __future__ import annotations

import csv
import json
import sqlite3
import sys
import time
from pathlib import Path

import torch

from geosharp.estimators.diagnostics import ascent_diagnostics
from geosharp.estimators.orbit import log_scale
from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy

FAMILIES = {
    "adaptive_l2": {"measure": "adaptive"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
}


def pair_balance(u: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Imbalance, norm excess and mean log scale of the pairs ``(u_j, v_j)``."""
    u, v = u.double().reshape(-1), v.double().reshape(-1)
    u2, v2 = u.square(), v.square()
    imbalance = float((u2 - v2).norm() / (u2 + v2).norm())
    excess = float((u2 + v2).sum() / (2 * (u * v).abs()).sum() - 1)
    log_ratio = float(log_scale(u.reshape(-1, 1, 1), v.reshape(-1, 1, 1)).mean())
    return {"imbalance_pairs": imbalance, "excess_pairs": excess, "log_ratio_pairs": log_ratio}


def main(folder: str, out: str) -> None:
    """Diagnose every analysed model of ``folder`` with a checkpoint, appending to ``out``."""
    torch.set_num_threads(1)
    root = Path(folder)
    conn = sqlite3.connect(f"file:{root / 'study.sqlite'}?mode=ro", uri=True)
    meta = dict(conn.execute("select key, value from meta").fetchall())
    cfg = json.loads(meta["config"])
    cfg.pop("curvature", None)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
    study = DiagonalStudy(DiagonalConfig(**fields))
    rho = sorted(study.cfg.rhos)[len(study.cfg.rhos) // 2]
    rows = conn.execute(
        "select model_id, hparams, metrics, checkpoint from models order by model_id"
    )
    done: set[str] = set()
    path = Path(out)
    if path.is_file():
        with path.open(newline="") as fh:
            done = {r["model_id"] for r in csv.DictReader(fh)}
    writer, fh = None, None
    for model_id, hparams, metrics, checkpoint in rows.fetchall():
        info = {**json.loads(hparams), **json.loads(metrics)}
        if model_id in done or not checkpoint or not study.included(info):
            continue
        t0 = time.perf_counter()
        model = study.load({"checkpoint_path": str(root / checkpoint)})
        row: dict[str, float | str] = {"model_id": model_id, **pair_balance(model.u, model.v)}
        for key, family in FAMILIES.items():
            try:
                a = ascent_diagnostics(
                    model, study.loss_fn, study.batches(), rho=rho, steps=study.cfg.steps, **family
                )
            except FloatingPointError as err:  # the study recorded the same failure for its row
                print(f"{model_id} {key}: {err}")
                continue
            # (no budget split: every coordinate of a diagonal net is in a pair, share 1)
            row[f"{key}_radius_used"] = a.radius_used
            row[f"{key}_order2"] = a.order2
            row[f"{key}_value"] = a.value
        row["diagnostics_time_s"] = time.perf_counter() - t0
        if writer is None:
            new = not path.is_file()
            fh = path.open("a", newline="")
            writer = csv.DictWriter(fh, fieldnames=list(row))
            if new:
                writer.writeheader()
        writer.writerow({k: (f"{v:.10g}" if isinstance(v, float) else v) for k, v in row.items()})
        fh.flush()
        print(model_id, {k: v for k, v in row.items() if k.startswith(("imb", "inv_order2"))})
    if fh is not None:
        fh.close()
    print(f"rho = {rho}; written {path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
