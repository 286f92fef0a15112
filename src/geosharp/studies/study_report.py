"""The report of a study folder: ``results.csv``, ``report.html`` and the rest from its store.

:func:`make_report` writes them at the end of :func:`~geosharp.studies.runner.run_study`;
:func:`report_from_folder` rebuilds them from a folder's ``study.sqlite`` (``geosharp report
DIR``), and :func:`export_study` copies a study's results without its checkpoints into another
folder and writes the report there (``geosharp report DIR --export DEST``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from geosharp._io import atomic_write_bytes
from geosharp.studies.report import ReportPaths, write_report
from geosharp.studies.sections import RESULT_FILES
from geosharp.studies.store import Store, report_info

__all__ = ["export_study", "make_report", "report_from_folder"]


def make_report(out_dir: str | Path, store: Store, notes: Sequence[str] = ()) -> ReportPaths:
    """Write ``results.csv`` and the report of the study recorded in ``store``.

    Models whose gap is not finite are left out of the analysis (and listed in the notes).
    Files that add-ons or a study's own analysis left in the folder become sections of the
    report through the providers of :func:`geosharp.studies.sections.folder_sections`; the
    runner knows none of them.
    """
    out = Path(out_dir)
    info = report_info(store.meta())
    models, excluded = [], []
    for m in store.models():
        if m["gap"] is None or not math.isfinite(m["gap"]) or m.get("excluded"):
            excluded.append(m["model_id"])
            continue
        models.append(m)
    ids = {m["model_id"] for m in models}
    measurements = [r for r in store.measurements() if r["model_id"] in ids]
    all_notes = list(notes) + list(info.get("notes", []))
    failed = [r for r in measurements if r.get("error")]
    if failed:
        all_notes.append(
            f"{len(failed)} measurement(s) failed and count as missing values: "
            + "; ".join(
                f"{r['model_id']} {r['measure']} ρ={r['rho']}: {r['error']}" for r in failed[:10]
            )
        )
    for r in measurements:
        if r.get("error"):
            r["value"] = None
    for m in store.models():
        if m.get("note"):
            all_notes.append(f"{m['model_id']}: {m['note']}")
    listed = info.get("population") or []
    recorded = {m["model_id"] for m in store.models()}
    missing = [mid for mid in listed if mid not in recorded]
    if missing:  # never rank fewer models silently (a shard not merged, or not finished)
        split = _split_text(store.meta().get("shards"))
        all_notes.insert(0, not_measured_line(missing, len(listed), len(models), split))
    if excluded:
        all_notes.append(
            f"{len(excluded)} model(s) left out of the analysis: " + ", ".join(excluded[:20])
        )
    settings = dict(info.get("settings", {}))
    settings["models analysed"] = len(models)
    if missing:
        settings["models not measured"] = (
            f"{len(missing)} of {len(listed)}: "
            + ", ".join(missing[:20])
            + (" …" if len(missing) > 20 else "")
        )
    if models:
        settings["population"] = _population_summary(models)
    if info.get("environments"):
        settings["run by"] = "; ".join(_environment_text(e) for e in info["environments"])
    return write_report(
        out,
        title=info.get("title", "Study"),
        models=models,
        measurements=measurements,
        settings=settings,
        paper=info.get("paper"),
        expected=info.get("expected"),
        notes=all_notes,
        gap_label=info.get("gap_label", "generalization gap"),
    )


def not_measured_line(
    missing: Sequence[str], listed: int, analysed: int, split: str | None = None
) -> str:
    """The report's one line on the models of the population that have no row.

    ``split``: the parts of a shard folder (``"part 1/2"``), whose other models are the other
    parts'.
    """
    shown = ", ".join(missing[:10]) + (", …" if len(missing) > 10 else "")
    why = (
        f"this folder holds {split} of the population; geosharp merge joins the parts"
        if split
        else "a shard not merged or not finished? geosharp merge names them"
    )
    return (
        f"not measured: {len(missing)} of the {listed} models of the population have no row "
        f"here ({shown}); τ and every table rank the {analysed} analysed ({why}; results.csv "
        "lists them as not-measured)"
    )


def _split_text(record: str | None) -> str | None:
    """``"part 1/2"`` of a shard folder's record (meta ``shards``), ``None`` for a whole one."""
    try:
        rec = json.loads(record or "{}")
    except ValueError:
        return None
    if not isinstance(rec, dict) or not rec.get("n") or not rec.get("parts"):
        return None
    if rec.get("merged"):
        return None
    parts = ", ".join(f"{k}/{rec['n']}" for k in rec["parts"])
    return f"part{'s' if len(rec['parts']) > 1 else ''} {parts}"


def _population_summary(models: Sequence[dict[str, Any]]) -> str:
    """Range and median of the gap and of every error metric of the analysed models."""
    metrics = {k for m in models for k in m if k.endswith(("_error", "_loss"))}
    keys = ["gap", *sorted(metrics)]
    parts = []
    for k in keys:
        vals = np.asarray([m.get(k) for m in models if _is_number(m.get(k))], dtype=float)
        if vals.size:
            parts.append(
                f"{k.replace('_', ' ')} {vals.min():.4g} to {vals.max():.4g} "
                f"(median {np.median(vals):.4g})"
            )
    return "; ".join(parts)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _environment_text(env: dict[str, Any]) -> str:
    device = env.get("cuda") or f"CPU ({env.get('cpus')} cores, {env.get('threads')} threads)"
    ran = f" (ran {', '.join(env['folders'])})" if env.get("folders") else ""  # geosharp merge
    return (
        f"geosharp {env.get('geosharp')}, torch {env.get('torch')}, Python {env.get('python')}, "
        f"{device}, {env.get('platform')}{ran}"
    )


def report_from_folder(out_dir: str | Path) -> ReportPaths:
    """Regenerate ``results.csv`` and the report of a study folder (``geosharp report DIR``).

    Raises:
        FileNotFoundError: If the folder holds no ``study.sqlite``.
    """
    out = Path(out_dir)
    db = out / "study.sqlite"
    if not db.is_file():
        raise FileNotFoundError(f"{out} holds no study.sqlite; run `geosharp study ...` first")
    with Store(db, None, None) as store:
        store.export_csv(out / "results.csv")
        return make_report(out, store)


def export_study(out_dir: str | Path, dest: str | Path) -> ReportPaths:
    """Copy a study's results without its checkpoints into ``dest`` and write the report there.

    ``dest`` receives a consistent snapshot of ``study.sqlite`` (SQLite's online backup, so a
    study may still be running), the result files of the folder that exist
    (:data:`geosharp.studies.sections.RESULT_FILES`: the symmetry test's rows and table, a
    study's ``diagnostics.csv``, ``sections.json``, ``analysis.md``, ``PREREGISTRATION.md``),
    and ``results.csv``, ``tau_table.md``, ``summary.json``, the plots and ``report.html``
    built from them: a small folder to share or commit, which ``geosharp report`` can rebuild
    with the same sections. Checkpoints stay behind (``dest`` cannot resume training or
    measure again).

    Args:
        out_dir: The study's output folder.
        dest: Where to export (created; must not be ``out_dir``).

    Returns:
        The paths of the exported report.

    Raises:
        FileNotFoundError: If ``out_dir`` holds no ``study.sqlite``.
        ValueError: If ``dest`` is ``out_dir``.
    """
    src, dst = Path(out_dir), Path(dest)
    if not (src / "study.sqlite").is_file():
        raise FileNotFoundError(f"{src} holds no study.sqlite; run `geosharp study ...` first")
    if dst.resolve() == src.resolve():
        raise ValueError("--export needs another folder than the study's own")
    dst.mkdir(parents=True, exist_ok=True)
    with Store(src / "study.sqlite", None, None) as store:
        store.backup(dst / "study.sqlite")
    for name in RESULT_FILES:  # what add-ons and the study's own analysis wrote
        if (src / name).is_file():
            atomic_write_bytes(dst / name, (src / name).read_bytes())
    return report_from_folder(dst)
