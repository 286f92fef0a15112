"""How much the key-bias quotient moves the stored geodesic values of Studies 2 and 3.

For the first ``--models`` included models of each study (retrained from their seeds when the
checkpoints were not kept, which reproduces them bit for bit), the geodesic measures at the
middle ρ of their grids are measured twice: with ``key_bias="keep"`` (the setting the studies
were run with; must equal the stored value — the regression test of the block protocol) and with
``key_bias="quotient"`` (the key biases held fixed). Writes ``key_bias_effect.md`` and ``.json``
beside this file.

    OMP_NUM_THREADS=1 .venv/bin/python results/key-bias/measure_key_bias.py --models 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import torch

from geosharp.estimators import sharpness
from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy
from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
STUDIES = {
    "vit-mnist": (ViTMNISTStudy, ViTMNISTConfig),
    "minilm-text": (MiniLMTextStudy, MiniLMTextConfig),
}


def _config(cls, stored: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k in fields}
    return cls(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--studies", nargs="*", default=list(STUDIES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.studies:
        study_cls, cfg_cls = STUDIES[name]
        db = sqlite3.connect(RESULTS / name / "study.sqlite")
        meta = dict(db.execute("select key, value from meta").fetchall())
        study = study_cls(_config(cfg_cls, json.loads(meta["config"])))
        stored = {
            (m, meas, rho): v
            for m, meas, rho, v in db.execute(
                "select model_id, measure, rho, value from measurements"
            ).fetchall()
        }
        included = [
            mid
            for (mid, excluded) in db.execute(
                "select model_id, json_extract(metrics, '$.excluded') from models order by model_id"
            ).fetchall()
            if not excluded
        ][: args.models]
        population = dict(study.population())
        specs = [
            s
            for s in study.plan()
            if s.kwargs.get("measure") == "geodesic"
            and s.kwargs.get("order") == 2
            and s.kwargs.get("corrected_norm", True)
        ]
        for mid in included:
            t0 = time.perf_counter()
            state, _ = study.fit(population[mid])
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{mid}.pt"
                torch.save(state, path)
                model = study.load({"model_id": mid, "checkpoint_path": str(path)})
            print(f"{name} {mid}: retrained in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for spec in specs:
                rho = spec.rhos[1]
                kw = dict(spec.kwargs)
                values = {
                    kb: sharpness(
                        model, study.loss_fn, study.batches(), rho=rho, progress=False,
                        key_bias=kb, **kw,
                    ).value
                    for kb in ("keep", "quotient")
                }
                row = {
                    "study": name,
                    "model": mid,
                    "measure": spec.name,
                    "rho": rho,
                    "stored": stored.get((mid, spec.name, rho)),
                    "keep": values["keep"],
                    "quotient": values["quotient"],
                }
                row["keep_vs_stored"] = (
                    abs(row["keep"] - row["stored"]) / abs(row["stored"])
                    if row["stored"]
                    else None
                )
                row["quotient_change"] = (row["quotient"] - row["keep"]) / row["keep"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    (HERE / "key_bias_effect.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# The key-bias quotient on stored models of Studies 2 and 3",
        "",
        "Produced by `results/key-bias/measure_key_bias.py` (models retrained from their seeds).",
        "`keep`: key biases as rows of H_QK (the studies' setting); `quotient`: held fixed.",
        "",
        "| study | model | measure | ρ | stored | keep | keep vs stored | quotient | change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kvs = "—" if r["keep_vs_stored"] is None else f"{r['keep_vs_stored']:.1e}"
        lines.append(
            f"| {r['study']} | {r['model']} | {r['measure']} | {r['rho']:g} | "
            f"{r['stored']:.6g} | {r['keep']:.6g} | {kvs} | {r['quotient']:.6g} | "
            f"{100 * r['quotient_change']:+.2f} % |"
        )
    (HERE / "key_bias_effect.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
