"""Re-measure stored rows of a committed study with today's code (issue 11: values unchanged).

Study 2's checkpoints were not committed; ``runs/curvature-vit-mnist/checkpoints`` holds the
48 ViTs retrained from their seeds (``results/curvature/run_curvature.py``), of which
``vit-000`` reproduces the committed train/test errors. This loads such a checkpoint, measures
the rows of the committed ``results/vit-mnist/study.sqlite`` for that model with the study's
own plan, loss, batches and ``key_bias``, and prints stored value, new value and their
relative difference.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remeasure_committed.py \
        --checkpoints runs/curvature-vit-mnist/checkpoints --model vit-000
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

import torch

from geosharp.estimators.sharpness import sharpness
from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=str(ROOT / "results/vit-mnist/study.sqlite"))
    ap.add_argument("--checkpoints", default=str(ROOT / "runs/curvature-vit-mnist/checkpoints"))
    ap.add_argument("--model", default="vit-000")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--low-memory", action="store_true", help="measure with gs.sharpness(low_memory=True)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    study = ViTMNISTStudy(ViTMNISTConfig())
    conn = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True)
    stored = {
        (m, r): v
        for m, r, v in conn.execute(
            "select measure, rho, value from measurements where model_id = ?", (args.model,)
        )
    }
    row = {"checkpoint_path": str(Path(args.checkpoints) / f"{args.model}.pt")}
    model = study.load(row)
    batches = study.batches()
    out = []
    for spec in study.plan():
        kw = dict(spec.kwargs)
        if kw.get("measure") not in ("adaptive", "geodesic"):
            continue
        for rho in spec.rhos:
            if (spec.name, rho) not in stored:
                continue
            res = sharpness(
                model,
                study.loss_fn,
                batches,
                rho=rho,
                progress=False,
                key_bias=study.key_bias,
                low_memory=args.low_memory,
                **kw,
            )
            old = stored[(spec.name, rho)]
            rel = abs(res.value - old) / abs(old)
            out.append(
                {"measure": spec.name, "rho": rho, "stored": old, "new": res.value, "rel": rel}
            )
            print(
                f"{spec.name:40s} rho={rho:<8g} stored {old:.10g}  "
                f"new {res.value:.10g}  rel {rel:.1e}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
