"""Per-model diagnostics of a classifier study folder: its ``diagnostics.csv``.

Per model, the orbit position of every attention head
(:func:`geosharp.estimators.diagnostics.balance`) and the Auto-PGD optima of adaptive ℓ2 and
geodesic inv at the middle ρ of their grids (:data:`DIAGNOSTIC_FAMILIES`; computed by
:meth:`geosharp.studies.classifier.ClassifierStudy.diagnose`), one row per model in the folder's
:data:`DIAGNOSTICS_FILE`, which the study report turns into a section:

* :func:`read_diagnostics` and :func:`append_diagnostics` — the file;
* :func:`diagnose_folder` — every analysed model of a folder, resumably.

Study 4 (:mod:`geosharp.studies.vit_orbit`) computes its rows with the same method.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geosharp.studies.store import Store

if TYPE_CHECKING:
    from geosharp.studies.classifier import ClassifierStudy

__all__ = [
    "DIAGNOSTICS_FILE",
    "DIAGNOSTIC_FAMILIES",
    "append_diagnostics",
    "diagnose_folder",
    "read_diagnostics",
]


#: Worst-case ℓ2 measures whose Auto-PGD optimum :meth:`ClassifierStudy.diagnose` inspects, at
#: the middle ρ of the config's grid ``rhos_<key>`` (key → measure keywords).
DIAGNOSTIC_FAMILIES: dict[str, dict[str, Any]] = {
    "adaptive_l2": {"measure": "adaptive"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
}

#: Name of the per-model diagnostics file in a study folder (the study report shows it).
DIAGNOSTICS_FILE = "diagnostics.csv"


def read_diagnostics(path: str | Path) -> dict[str, dict[str, float]]:
    """``model_id`` → its diagnostics (complete rows only; a missing file is empty)."""
    p = Path(path)
    if not p.is_file():
        return {}
    out: dict[str, dict[str, float]] = {}
    with p.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            if None in row or any(v is None for v in row.values()):
                continue  # a torn last line
            try:
                out[row["model_id"]] = {
                    k: float(v) for k, v in row.items() if k != "model_id" and v != ""
                }
            except ValueError:
                continue
    return out


def append_diagnostics(path: str | Path, model_id: str, values: dict[str, float]) -> None:
    """Append one model's row (the header is written with the first row)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.is_file() or p.stat().st_size == 0
    if new:
        header = ["model_id", *values]
    else:
        with p.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh))
    with p.open("a", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=header, extrasaction="ignore", restval="")
        if new:
            w.writeheader()
        w.writerow({"model_id": model_id, **{k: repr(float(v)) for k, v in values.items()}})
        fh.flush()


def diagnose_folder(
    study: ClassifierStudy,
    out_dir: str | Path,
    *,
    key_bias: str | None = None,
    path: str | Path | None = None,
    extra: Callable[[dict[str, Any]], dict[str, float]] | None = None,
    log: Callable[[str], None] | None = None,
) -> int:
    """The diagnostics row of every analysed model of a study folder (resumable).

    Every stored model that the study includes and whose checkpoint is in ``out_dir`` and
    that has no row yet is loaded (:meth:`ClassifierStudy.load`), diagnosed
    (:meth:`ClassifierStudy.diagnose`) and appended to ``path`` with its
    ``diagnostics_time_s`` and the columns of ``extra(model_row)``.

    Args:
        study: The study of the folder.
        out_dir: The folder (``study.sqlite`` and the checkpoints).
        key_bias: Passed to :meth:`ClassifierStudy.diagnose`.
        path: The CSV (default ``out_dir / "diagnostics.csv"``).
        extra: More columns of a model's row (e.g. its weight decay).
        log: Called with one line per model.

    Returns:
        The number of rows written.
    """
    out = Path(out_dir)
    target = Path(path) if path is not None else out / DIAGNOSTICS_FILE
    with Store(out / "study.sqlite", None, None) as store:
        rows = sorted(store.models(), key=lambda r: r["model_id"])
    written = 0
    for row in rows:
        if not study.included(row) or not row.get("checkpoint"):
            continue
        if row["model_id"] in read_diagnostics(target):
            continue
        row = {**row, "checkpoint_path": str(out / row["checkpoint"])}
        t0 = time.perf_counter()
        values = study.diagnose(study.load(row), key_bias=key_bias)
        if extra is not None:
            values.update(extra(row))
        values["diagnostics_time_s"] = time.perf_counter() - t0
        append_diagnostics(target, row["model_id"], values)
        written += 1
        if log is not None:
            log(f"{row['model_id']} diagnosed in {values['diagnostics_time_s']:.1f} s")
    return written
