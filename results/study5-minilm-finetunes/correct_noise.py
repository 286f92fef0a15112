"""Correct Study 5's committed records to the label noise as applied (no model is retrained).

``train.py`` recorded the drawn noise rate, but flips labels only outside the 1,024 protected
snippets of the sharpness sample: a model with n_train = 1,024 had none flipped whatever was
drawn, and a drawn rate r flipped r · (n_train − 1,024) of its n_train labels. This script
reruns the data and noise selection of every model of ``RUN/manifest.csv`` and
``RUN/excluded.csv`` (its draw, the split, :func:`records.noisy_labels` on the real labels;
deterministic, no training) and rewrites

* the CSVs' ``label_noise`` as the fraction of the training labels flipped, with a new
  ``label_flips`` column (what ``train.py`` now records);
* ``label_noise`` in the hyperparameters of ``RUN/main/study.sqlite`` and
  ``RUN/outer/study.sqlite`` (the copy ``geosharp study`` took of the manifest), and their
  ``results.csv``.

Idempotent: the drawn rate is read from ``draw(i)``, never from the files.

    python results/study5-minilm-finetunes/correct_noise.py results/study5-minilm-finetunes/gpu-run
"""

from __future__ import annotations

import csv
import json
import sqlite3
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import noisy_labels  # noqa: E402
from train import N_HELDOUT, N_SHARP, SEED, draw, split  # noqa: E402

from geosharp.data import load_rotten_tomatoes  # noqa: E402
from geosharp.studies.store import Store  # noqa: E402


def applied(name: str, row: dict, labels_all: np.ndarray, pool: np.ndarray) -> tuple[float, int]:
    """(fraction of the training labels flipped, how many) of the model ``name``."""
    hp = draw(int(name.rsplit("-", 1)[1]), SEED)
    if int(row["seed"]) != hp["seed"] or int(row["n_train"]) != hp["n_train"]:
        raise SystemExit(f"{name}: the record's seed or n_train is not its draw's")
    clean = labels_all[pool[: hp["n_train"]]]
    noisy, n_flip = noisy_labels(clean, hp["label_noise"], N_SHARP, hp["seed"])
    assert int((noisy != clean).sum()) == n_flip
    return n_flip / hp["n_train"], n_flip


def rewrite_csv(path: Path, noise: dict[str, tuple[float, int]]) -> int:
    """``label_noise`` as applied and ``label_flips`` after it; every other cell as it was."""
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    header = rows[0]
    if "label_flips" not in header:
        at = header.index("label_noise") + 1
        header.insert(at, "label_flips")
        for r in rows[1:]:
            r.insert(at, "")
    i_name, i_noise, i_flips = (header.index(c) for c in ("name", "label_noise", "label_flips"))
    changed = 0
    for r in rows[1:]:
        frac, flips = noise[r[i_name]]
        changed += float(r[i_noise]) != frac
        r[i_noise], r[i_flips] = repr(frac), str(flips)
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    return changed


def rewrite_store(folder: Path, noise: dict[str, tuple[float, int]]) -> int:
    """The stored hyperparameters' ``label_noise`` as applied; ``results.csv`` exported again."""
    db = folder / "study.sqlite"
    changed = 0
    with sqlite3.connect(db) as conn:
        for mid, text in conn.execute("SELECT model_id, hparams FROM models").fetchall():
            hp = json.loads(text)
            frac = noise[mid][0]
            if hp.get("label_noise") != frac:
                hp["label_noise"] = frac
                conn.execute(
                    "UPDATE models SET hparams = ? WHERE model_id = ?",
                    (json.dumps(hp, sort_keys=True), mid),
                )
                changed += 1
    with Store(db, None, None) as store:
        store.export_csv(folder / "results.csv")
    return changed


def main(run: Path) -> None:
    corpus = load_rotten_tomatoes()
    labels_all = np.array(corpus.labels, dtype=np.int64)
    _, pool = split(N_HELDOUT, SEED)
    noise: dict[str, tuple[float, int]] = {}
    for name in ("manifest.csv", "excluded.csv"):
        with (run / name).open(newline="") as fh:
            for row in csv.DictReader(fh):
                noise[row["name"]] = applied(row["name"], row, labels_all, pool)
    for name in ("manifest.csv", "excluded.csv"):
        print(f"{name}: {rewrite_csv(run / name, noise)} label_noise cells corrected")
    for folder in ("main", "outer"):
        if (run / folder / "study.sqlite").is_file():
            print(f"{folder}/study.sqlite: {rewrite_store(run / folder, noise)} models corrected")
    flips = [n for _, n in noise.values()]
    print(f"{len(noise)} models: {sum(n > 0 for n in flips)} with flipped labels, "
          f"max {max(f for f, _ in noise.values()):.4f} of the training set")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
