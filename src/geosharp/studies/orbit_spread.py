r"""The orbit spread of a population: how far apart its models' heads sit on their GL(h) orbits.

Adaptive sharpness depends on where each head of a GL(h) block ``(G, H)`` (seen only through
``G Hᵀ``) sits on its orbit ``(G A, H A⁻ᵀ)``; geodesic sharpness does not. Where every model of a
population sits at the same orbit position (fine-tunes keep the pretrained one), the orbit
position cannot make the two measures rank the models differently; where the positions differ
from model to model, it can. This module records the orbit position of every head of every
model of a study (the quantities of :func:`geosharp.estimators.diagnostics.balance`), sums them
up per block kind (``QK``, ``VO``, …) and puts the population's spread beside the paired Δτ in
the study's report, with what the committed studies found at their spreads
(:data:`geosharp.studies.orbit_spread_report.REFERENCE`).

Per head: the imbalance ``‖GᵀG − HᵀH‖_F / ‖GᵀG + HᵀH‖_F`` (0 at the balanced point, → 1 far
along the orbit), the log scale ``½ log(‖G‖/‖H‖)`` and the norm excess over the orbit's minimum.
Per model and kind: the imbalance of the kind's heads together, ``√(Σ‖GᵀG − HᵀH‖²) /
√(Σ‖GᵀG + HᵀH‖²)`` (the diagnostics' ``imbalance_<kind>``), and the spread of its heads'
imbalances (standard deviation, ``within``). Per population and kind (:func:`population_spread`):

* ``across`` — **the orbit spread**: the standard deviation over models of the model
  imbalance (the number :data:`~geosharp.studies.orbit_spread_report.REFERENCE` gives for the
  committed studies);
* ``within`` — the mean over models of the within-model spread of the heads;
* ``headwise`` — head by head, the standard deviation over models of that head's imbalance,
  median over heads (only when every model has the same heads: the same architecture);
* ``log_scale_sd`` — the standard deviation over models of the mean log scale.

A study stores the heads of each model in its database
(:meth:`geosharp.studies.store.Store.put_orbit`, by :func:`geosharp.studies.runner.run_study`
when it loads a model), writes them to
``orbit_spread.csv`` of the study folder (:data:`ORBIT_FILE`) and the report shows
:func:`~geosharp.studies.orbit_spread_report.spread_sections` (the report's reading of the
spread: :mod:`geosharp.studies.orbit_spread_report`). A study without the file (every study
committed before issue 44) gets no such section.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from geosharp._io import atomic_write_text

__all__ = [
    "HEAD_COLUMNS",
    "ORBIT_FILE",
    "KindSpread",
    "folder_rows",
    "head_rows",
    "model_stats",
    "population_spread",
    "read_rows",
    "spread_level",
    "write_rows",
]

#: Block kinds whose heads are one-dimensional GL(1) pairs acting coordinate by coordinate
#: (diagonal nets): adaptive sharpness is invariant to their orbit (an element-wise rescaling),
#: so their spread cannot separate the measures and :func:`spread_level` leaves them out.
ELEMENTWISE_KINDS = ("pair",)

#: The per-head file of a study folder.
ORBIT_FILE = "orbit_spread.csv"
#: Its columns: one row per (model, head of a GL-type block).
HEAD_COLUMNS = (
    "model_id",
    "block",
    "category",
    "head",
    "imbalance",
    "log_scale",
    "excess",
    "diff_sq",
    "sum_sq",
)


# ---------------------------------------------------------------------------------------------
# per model
# ---------------------------------------------------------------------------------------------
def head_rows(
    model: nn.Module,
    *,
    model_id: str,
    key_bias: str = "keep",
    space: Any = None,
) -> list[dict[str, Any]]:
    """One row per head of every GL-type block of ``model`` (:data:`HEAD_COLUMNS`).

    Args:
        model: The model (read, never written).
        model_id: Its id in the study.
        key_bias: As the study's measures treat key biases (``find_symmetries(key_bias=…)``).
        space: The model's precomputed :func:`geosharp.find_symmetries` result, if any.
    """
    from geosharp.estimators.diagnostics import balance

    bal = balance(model, space=space, key_bias=key_bias)
    return [
        {
            "model_id": model_id,
            "block": h.block,
            "category": h.category,
            "head": h.head,
            "imbalance": h.imbalance,
            "log_scale": h.log_scale,
            "excess": h.excess,
            "diff_sq": h.diff_sq,
            "sum_sq": h.sum_sq,
        }
        for h in bal.heads
    ]


def write_rows(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write head rows as ``orbit_spread.csv`` (floats with ``repr``: read back exactly)."""
    lines = [",".join(HEAD_COLUMNS)]
    for r in rows:
        cells = []
        for c in HEAD_COLUMNS:
            v = r[c]
            cells.append(repr(float(v)) if isinstance(v, float) else str(v))
        lines.append(",".join(cells))
    p = Path(path)
    atomic_write_text(p, "\n".join(lines) + "\n")
    return p


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The head rows of an ``orbit_spread.csv`` (none when the file is missing)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    with p.open(newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            row: dict[str, Any] = {"model_id": r["model_id"], "block": r["block"]}
            row["category"] = r["category"]
            row["head"] = int(r["head"])
            for c in HEAD_COLUMNS[4:]:
                row[c] = float(r[c])
            out.append(row)
    return out


def model_stats(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (model, kind): the imbalance, spread, scale and count of its heads.

    ``imbalance`` (of the heads together), ``within`` (sd of the heads' imbalances, ddof 0),
    ``log_scale`` (mean), ``heads``.
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["model_id"]), str(r["category"])), []).append(r)
    out = {}
    for key, hs in groups.items():
        imb = np.array([float(h["imbalance"]) for h in hs])
        tot = sum(float(h["sum_sq"]) for h in hs)
        out[key] = {
            "imbalance": math.sqrt(sum(float(h["diff_sq"]) for h in hs) / tot) if tot else math.nan,
            "within": float(imb.std()),
            "log_scale": float(np.mean([float(h["log_scale"]) for h in hs])),
            "heads": float(len(hs)),
        }
    return out


# ---------------------------------------------------------------------------------------------
# per population
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KindSpread:
    """The orbit spread of one block kind over a population (see the module docstring).

    Attributes:
        category: The block kind (``"QK"``, ``"VO"``, …).
        models: Models with heads of this kind.
        heads: Heads per model (the median, if they differ).
        imbalance: Median, min and max over models of the model imbalance.
        across: **The orbit spread**: sd (ddof 1) over models of the model imbalance (0 for one
            model).
        within: Mean over models of the sd of the heads' imbalances within the model.
        headwise: Median over heads of each head's sd (ddof 1) over models; NaN unless every
            model has the same heads.
        log_scale_sd: sd (ddof 1) over models of the mean log scale.
    """

    category: str
    models: int
    heads: int
    imbalance: tuple[float, float, float]
    across: float
    within: float
    headwise: float
    log_scale_sd: float


def _sd(values: Sequence[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def population_spread(
    rows: Iterable[Mapping[str, Any]], models: Iterable[str] | None = None
) -> list[KindSpread]:
    """The orbit spread of every block kind over the models (default: every model of ``rows``).

    Args:
        rows: Head rows (:func:`head_rows`, :func:`read_rows`).
        models: Only these model ids (e.g. the analysed ones).
    """
    keep = None if models is None else set(models)
    rows = [r for r in rows if keep is None or str(r["model_id"]) in keep]
    stats = model_stats(rows)
    kinds = list(dict.fromkeys(str(r["category"]) for r in rows))
    out = []
    for kind in kinds:
        per = {m: s for (m, k), s in stats.items() if k == kind}
        imb = [s["imbalance"] for s in per.values()]
        heads: dict[str, dict[tuple[str, int], float]] = {}
        for r in rows:
            if r["category"] == kind:
                heads.setdefault(str(r["model_id"]), {})[(str(r["block"]), int(r["head"]))] = float(
                    r["imbalance"]
                )
        layouts = {tuple(sorted(h)) for h in heads.values()}
        if len(layouts) == 1 and len(heads) > 1:
            names = next(iter(layouts))
            headwise = float(np.median([_sd([h[n] for h in heads.values()]) for n in names]))
        else:
            headwise = math.nan
        out.append(
            KindSpread(
                category=kind,
                models=len(per),
                heads=int(np.median([s["heads"] for s in per.values()])),
                imbalance=(float(np.median(imb)), float(min(imb)), float(max(imb))),
                across=_sd(imb),
                within=float(np.mean([s["within"] for s in per.values()])),
                headwise=headwise,
                log_scale_sd=_sd([s["log_scale"] for s in per.values()]),
            )
        )
    return out


def spread_level(spreads: Sequence[KindSpread]) -> float:
    """The population's orbit spread: the largest ``across`` over its block kinds.

    NaN when it has no block kind but :data:`ELEMENTWISE_KINDS`.
    """
    return max((s.across for s in spreads if s.category not in ELEMENTWISE_KINDS), default=math.nan)


def folder_rows(out_dir: str | Path) -> list[dict[str, Any]]:
    """The head rows of a study folder (none if it recorded none).

    Its ``study.sqlite``'s ``orbit`` table (written by :func:`geosharp.studies.runner.run_study`),
    else its ``orbit_spread.csv``; none if neither holds any (every study recorded before
    issue 44).
    """
    import json
    import sqlite3

    out = Path(out_dir)
    db = out / "study.sqlite"
    if db.is_file():
        try:
            conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=60.0)
            try:
                found = conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'orbit'"
                ).fetchone()
                stored = (
                    conn.execute("SELECT heads FROM orbit ORDER BY model_id").fetchall()
                    if found
                    else []
                )
            finally:
                conn.close()
        except sqlite3.Error:
            stored = []
        rows = [r for (heads,) in stored for r in json.loads(heads)]
        if rows:
            return rows
    return read_rows(out / ORBIT_FILE)
