"""Merge the results folders of the shards of one study (``geosharp merge OUT SHARD...``).

A population split with ``--shard k/n`` can write into one shared folder (the SQLite database
runs in WAL mode, so several processes may write to it) or into one folder per shard, e.g. on
machines without a shared file system. :func:`merge_shards` puts per-shard folders together:

1. every shard must record the same study and configuration as the others (and as ``OUT``, if
   it already holds a database), the same report settings (the data, the batches asked, …) and
   the same population (the manifest's models, in any order) — otherwise nothing is written,
   and one line names the folder, the setting and both values (or the models that differ);
   what ran each shard (versions, threads, CPUs, device, platform) is kept for every shard
   (:func:`~geosharp.studies.shards.merged_report`);
2. every model row and every measurement row is copied once. A row found in more than one
   place must agree — same hyperparameters, metrics and gap for a model; same value, per-batch
   values, clean losses and settings for a measurement (wall times and dates may differ) — or
   the merge stops before writing anything, naming the row;
3. the checkpoints are copied (before the rows that refer to them are written);
4. the shards' ``twin_check.csv`` (``--twin-check``), the heads of their models (the ``orbit``
   table) and a manifest study's ``models.json`` are joined, every model once, and its
   ``manifest.json`` copied;
5. ``results.csv`` and the report are rebuilt from the merged database.

The merge is idempotent: merging the same shards again changes nothing, and a shard finished
later can be merged into ``OUT`` afterwards.

Example:
    >>> import tempfile, pathlib
    >>> from geosharp.studies.store import Store
    >>> with tempfile.TemporaryDirectory() as d:
    ...     root = pathlib.Path(d)
    ...     for k in (1, 2):
    ...         with Store(root / f"s{k}" / "study.sqlite", "demo", {"n": 2}) as s:
    ...             s.put_model(f"m{k}", hparams={}, metrics={}, gap=0.1 * k)
    ...             s.put_measurement(f"m{k}", "adaptive worst l2", 0.1, {}, float(k), [float(k)])
    ...     summary = merge_shards(root / "all", [root / "s1", root / "s2"], report=False)
    ...     (summary.models, summary.measurements)
    (2, 2)
"""

from __future__ import annotations

import filecmp
import json
import math
import shutil
import sqlite3
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.studies.population_records import read_json
from geosharp.studies.population_sections import MANIFEST_FILE, MODELS_FILE
from geosharp.studies.report import ReportPaths
from geosharp.studies.shards import (
    SHARD_RULE,
    SHARDS_META,
    merged_report,
    ran_with,
    shard_of,
    shard_record,
)
from geosharp.studies.store import Store, StudyMismatchError, orbit_rows, report_info
from geosharp.studies.study_report import report_from_folder
from geosharp.studies.twin_section import TWIN_FILE, merge_twin_files

#: Columns of a model row that must agree between copies (not its training time or date).
MODEL_IDENTITY = ("hparams", "metrics", "gap", "checkpoint", "seed")
#: Columns of a measurement row that must agree between copies (not its time, versions, date).
MEASUREMENT_IDENTITY = ("value", "per_batch", "clean_losses", "settings", "seed")
#: The primary key of a measurement row.
MEASUREMENT_KEY = ("model_id", "measure", "rho", "settings_key")


class MergeConflictError(ValueError):
    """Two shards hold different results for the same row."""


@dataclass
class MergeSummary:
    """What :func:`merge_shards` did.

    Attributes:
        out_dir: The merged folder.
        models: Model rows in the merged database.
        measurements: Measurement rows in the merged database.
        new_models: Model rows added by this merge.
        new_measurements: Measurement rows added by this merge.
        duplicates: Rows found more than once (identical, kept once).
        checkpoints: Checkpoint files copied.
        missing: Models of the study's population with no row in the merged database (no shard
            measured them; the report and ``results.csv`` list them as not measured).
        measured_twice: Models recorded by more than one shard folder → those folders.
        population: The models of the study's population (the manifest every shard was run
            with).
        warnings: Anything a user should know (missing checkpoint files, models no shard
            measured, models two shards measured, shards split differently).
        report: The report written, if any.
    """

    out_dir: Path
    models: int = 0
    measurements: int = 0
    new_models: int = 0
    new_measurements: int = 0
    duplicates: int = 0
    checkpoints: int = 0
    missing: list[str] = field(default_factory=list)
    measured_twice: dict[str, list[str]] = field(default_factory=dict)
    population: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    report: ReportPaths | None = None


def _rows(conn: sqlite3.Connection, table: str) -> tuple[list[str], list[tuple]]:
    cur = conn.execute(f"SELECT * FROM {table}")  # table: a fixed name
    return [d[0] for d in cur.description], cur.fetchall()


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN (a failed row's value is NULL, never NaN, but be safe)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _describe_difference(cols: Sequence[str], a: dict, b: dict, identity: Sequence[str]) -> str:
    parts = []
    for c in identity:
        if c in cols and not _same(a[c], b[c]):
            va, vb = str(a[c]), str(b[c])
            va = va if len(va) <= 80 else va[:77] + "..."
            vb = vb if len(vb) <= 80 else vb[:77] + "..."
            parts.append(f"{c}: {va} vs {vb}")
    return "; ".join(parts)


def _study_of(folder: Path) -> tuple[str | None, str | None, dict[str, str]]:
    db = folder / "study.sqlite"
    if not db.is_file():
        raise FileNotFoundError(f"{folder} holds no study.sqlite: is it the --out of a shard?")
    with Store(db, None, None) as store:
        meta = store.meta()
    return meta.get("study"), meta.get("config"), meta


def _flat(config: str | None) -> dict[str, Any]:
    """A recorded configuration with its nested dicts spelled out (``options.dtype``)."""
    try:
        cfg = json.loads(config or "{}")
    except json.JSONDecodeError:
        return {"configuration": config}
    flat: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    return flat


def _config_difference(a: str | None, b: str | None, where_a: str, where_b: str) -> str:
    """``"OTHER was run with seed=3 but FIRST with seed=0 (and 1 more setting: steps)"``."""
    da, db = _flat(a), _flat(b)
    keys = sorted(k for k in set(da) | set(db) if da.get(k, "∅") != db.get(k, "∅"))
    if not keys:
        return f"{where_b} and {where_a} record the same configuration"
    k = keys[0]
    more = f" (and {len(keys) - 1} more: {', '.join(keys[1:4])})" if len(keys) > 1 else ""
    return ran_with(where_b, k, db.get(k, "∅"), where_a, da.get(k, "∅")) + more


def _own(owned: dict[str, list[str]], counted: set[Path], folder: Path, ids: Sequence[str]) -> None:
    """Count the models of a folder once (a folder given twice, or OUT among the shards)."""
    if folder.resolve() in counted:
        return
    counted.add(folder.resolve())
    for mid in ids:
        owned.setdefault(mid, []).append(str(folder))


def _merge_json_records(out: Path, shards: Sequence[Path]) -> list[str]:
    """Put a manifest study's ``models.json`` and ``manifest.json`` into ``out``.

    ``models.json``: every model once (``out``'s entry, else the first folder's);
    ``manifest.json``: the same in every folder, else the first folder's is kept and the
    warning returned names the folders and the keys that differ.
    """
    warnings = []
    folders = [out, *(s for s in shards if s.resolve() != out.resolve())]
    models: dict[str, Any] = {}
    for f in folders:
        for mid, rec in read_json(f / MODELS_FILE).items():
            models.setdefault(mid, rec)
    if models and models != read_json(out / MODELS_FILE):
        atomic_write_text(out / MODELS_FILE, json.dumps(models, indent=1) + "\n")
    found = [(f, rec) for f in folders if (rec := read_json(f / MANIFEST_FILE))]
    if found:
        first, kept = found[0]
        for f, rec in found[1:]:
            if rec != kept:
                keys = sorted(k for k in {*rec, *kept} if rec.get(k) != kept.get(k))
                warnings.append(
                    f"{MANIFEST_FILE} differs between {first} and {f} ({', '.join(keys)}): "
                    f"{out} keeps {first}'s"
                )
        if first != out:
            atomic_write_text(out / MANIFEST_FILE, json.dumps(kept, indent=1) + "\n")
    return warnings


def _split_of(meta: dict[str, str]) -> tuple[str, int] | None:
    rec = shard_record(meta)
    if rec is None or rec.get("n") is None:
        return None
    return str(rec.get("rule", SHARD_RULE)), int(rec["n"])


def _owners(missing: Sequence[str], splits: set[tuple[str, int]]) -> str:
    """``" (part 2/3 owns m1; part 1/3 owns m4)"``: which part to rerun, under the name hash."""
    if len(splits) != 1:
        return ""
    rule, n = next(iter(splits))
    if rule != SHARD_RULE:
        return ""
    parts: dict[int, list[str]] = {}
    for mid in missing[:10]:
        parts.setdefault(shard_of(mid, n), []).append(mid)
    return (
        " ("
        + "; ".join(f"part {k}/{n} owns {', '.join(ids)}" for k, ids in sorted(parts.items()))
        + ": rerun it, then merge again)"
    )


def merge_shards(
    out_dir: str | Path,
    shard_dirs: Sequence[str | Path],
    *,
    report: bool = True,
    log: Callable[[str], None] | None = None,
) -> MergeSummary:
    """Merge the folders of the shards of one study into ``out_dir``.

    Args:
        out_dir: The merged folder (created if missing; may already hold a database of the
            same study and configuration, or be one of the shard folders).
        shard_dirs: Study folders written by ``geosharp study ... --shard k/n --out DIR`` (each
            with ``study.sqlite`` and ``checkpoints/``).
        report: Rebuild ``results.csv`` and the report in ``out_dir``.
        log: Where to print one-line status messages (default: stderr).

    Returns:
        A :class:`MergeSummary`.

    Raises:
        FileNotFoundError: If a shard folder holds no ``study.sqlite``.
        StudyMismatchError: If the shards (or ``out_dir``) record different studies,
            configurations, report settings or populations.
        MergeConflictError: If a row appears twice with different results.
        ValueError: If no shard folder is given.
    """
    say = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(out_dir)
    if not shard_dirs:
        raise ValueError("give at least one shard folder to merge")
    shards = [Path(s) for s in shard_dirs]
    metas = [_study_of(s) for s in shards]
    study, config, _ = metas[0]
    for s, (other_study, other_config, _) in zip(shards[1:], metas[1:], strict=True):
        if other_study != study:
            raise StudyMismatchError(
                f"{s} holds study {other_study!r} but {shards[0]} holds {study!r}: "
                "only shards of one study can be merged"
            )
        if other_config != config:
            raise StudyMismatchError(
                f"{_config_difference(config, other_config, str(shards[0]), str(s))}: they are "
                f"not shards of one run of study {study!r}; merge each configuration into its "
                "own folder"
            )
    in_shards = out.resolve() in {s.resolve() for s in shards}
    records = [(str(s), report_info(m)) for s, (_, _, m) in zip(shards, metas, strict=True)]
    if (out / "study.sqlite").is_file() and not in_shards:
        out_study, out_config, out_meta = _study_of(out)
        if out_study != study:
            raise StudyMismatchError(
                f"{out} already holds study {out_study!r}, not the shards' {study!r}; merge "
                "into a new folder"
            )
        if out_config != config:
            raise StudyMismatchError(
                f"{_config_difference(out_config, config, str(out), str(shards[0]))}: {out} "
                "already holds another configuration than the shards; merge into a new folder"
            )
        records.insert(0, (str(out), report_info(out_meta)))
    # The shards' records (population, settings, what ran them) as one, or a refusal in one
    # line, before OUT is touched.
    info = merged_report(records)
    population = info.get("population")
    summary = MergeSummary(out)
    # Opening OUT with the shards' study and configuration refuses a folder of another study.
    with Store(out / "study.sqlite", study, json.loads(config or "{}")) as dest:
        dest_meta = dest.meta()
        splits = {split for _, _, m in metas if (split := _split_of(m)) is not None}
        # OUT holds the parts merged, not one part: its report says so, and a study resumed
        # in it (unsharded, or a part) takes the stable rule, not a folder's from before it.
        merged = shard_record(dest_meta) or {"rule": SHARD_RULE, "n": None, "parts": []}
        meta_rows = [(SHARDS_META, json.dumps({**merged, "merged": True}, sort_keys=True))]
        if info:
            meta_rows.append(("report", json.dumps(info, default=str)))
        owned: dict[str, list[str]] = {}  # model → the shard folders that recorded it
        counted: set[Path] = set()
        model_cols, existing_models = _rows(dest.conn, "models")
        meas_cols, existing_meas = _rows(dest.conn, "measurements")
        models = {r[0]: (dict(zip(model_cols, r, strict=True)), out) for r in existing_models}
        meas = {}
        for r in existing_meas:
            row = dict(zip(meas_cols, r, strict=True))
            meas[tuple(row[c] for c in MEASUREMENT_KEY)] = (row, out)
        new_models: dict[str, tuple] = {}
        new_meas: dict[tuple, tuple] = {}
        sources: dict[str, Path] = {}
        orbit = dest.orbit_rows()  # model → the heads recorded (OUT's first)
        had_orbit = set(orbit)
        # 1. Read everything and check for conflicts before writing anything.
        for s in shards:
            if s.resolve() == out.resolve():  # OUT is one of the shards: its own models
                _own(owned, counted, s, [r[0] for r in existing_models])
                continue
            with sqlite3.connect(s / "study.sqlite") as conn:
                cols, rows = _rows(conn, "models")
                if cols != model_cols:
                    raise StudyMismatchError(f"{s}/study.sqlite has another schema: {cols}")
                _own(owned, counted, s, [r[0] for r in rows])  # a folder given twice: once
                for r in rows:
                    row = dict(zip(cols, r, strict=True))
                    if r[0] in models:
                        first, where = models[r[0]]
                        diff = _describe_difference(cols, first, row, MODEL_IDENTITY)
                        if diff:
                            raise MergeConflictError(
                                f"model {r[0]!r} differs between {where} and {s} ({diff}); "
                                "nothing was merged"
                            )
                        summary.duplicates += 1
                        continue
                    models[r[0]] = (row, s)
                    new_models[r[0]] = r
                    sources[r[0]] = s
                cols, rows = _rows(conn, "measurements")
                if cols != meas_cols:
                    raise StudyMismatchError(f"{s}/study.sqlite has another schema: {cols}")
                for r in rows:
                    row = dict(zip(cols, r, strict=True))
                    key = tuple(row[c] for c in MEASUREMENT_KEY)
                    if key in meas:
                        first, where = meas[key]
                        diff = _describe_difference(cols, first, row, MEASUREMENT_IDENTITY)
                        if diff:
                            raise MergeConflictError(
                                f"measurement (model {key[0]!r}, measure {key[1]!r}, "
                                f"rho={key[2]}) differs between {where} and {s} ({diff}); "
                                "nothing was merged"
                            )
                        summary.duplicates += 1
                        continue
                    meas[key] = (row, s)
                    new_meas[key] = r
                for mid, heads in orbit_rows(conn).items():  # its models' heads (issue 44)
                    orbit.setdefault(mid, heads)
            conn.close()
        # 2. Checkpoints first, so that no merged row ever refers to a missing file.
        for mid in new_models:
            ckpt = models[mid][0]["checkpoint"]
            if not ckpt or Path(ckpt).is_absolute():
                continue
            src, dst = sources[mid] / ckpt, out / ckpt
            if not src.is_file():
                summary.warnings.append(
                    f"checkpoint {ckpt} of model {mid!r} is missing in {sources[mid]}: the "
                    "rows are merged, but measuring this model again needs the file"
                )
                continue
            if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".merge-tmp")
            shutil.copy2(src, tmp)
            tmp.replace(dst)
            summary.checkpoints += 1
        # 3. All rows in one transaction, with the population and the split merged.
        with dest.conn:
            dest.conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta_rows
            )
            marks = ", ".join("?" * len(model_cols))
            dest.conn.executemany(
                f"INSERT INTO models VALUES ({marks})",
                list(new_models.values()),
            )
            marks = ", ".join("?" * len(meas_cols))
            dest.conn.executemany(
                f"INSERT INTO measurements VALUES ({marks})",
                list(new_meas.values()),
            )
        for mid in orbit.keys() - had_orbit:  # extras of the rows: after them, model by model
            dest.put_orbit(mid, orbit[mid])
        summary.new_models, summary.new_measurements = len(new_models), len(new_meas)
        summary.models, summary.measurements = len(models), len(meas)
        summary.population = population or []
        summary.missing = [mid for mid in summary.population if mid not in models]
    summary.warnings += _merge_json_records(out, shards)  # manifest.json, models.json
    summary.measured_twice = {mid: ws for mid, ws in owned.items() if len(ws) > 1}
    if len(splits) > 1:
        shown = "; ".join(
            f"{s}: {rec['parts']} of {rec['n']} by {rec.get('rule', SHARD_RULE)}"
            for s, (_, _, m) in zip(shards, metas, strict=True)
            if (rec := shard_record(m)) is not None and rec.get("n") is not None
        )
        summary.warnings.append(
            f"the shard folders were split differently ({shown}): together they may miss or "
            "repeat models (the lines below name them)"
        )
    elif len(splits) == 1 and all(_split_of(m) is not None for _, _, m in metas):
        rule, n = next(iter(splits))
        given = {
            int(k)
            for _, _, m in metas
            if (rec := shard_record(m)) is not None
            for k in rec.get("parts", [])
        }
        absent = [k for k in range(1, n + 1) if k not in given]
        if absent:
            summary.warnings.append(
                f"part(s) {', '.join(f'{k}/{n}' for k in absent)} of the split ({rule}) are in "
                "none of the folders given"
            )
    if summary.missing:
        names = ", ".join(summary.missing[:10]) + (", …" if len(summary.missing) > 10 else "")
        summary.warnings.append(
            f"{len(summary.missing)} of the {len(summary.population)} models of the population "
            f"were measured by no shard: {names}{_owners(summary.missing, splits)}; is a shard "
            "missing or unfinished? The report and results.csv list them as not measured"
        )
    if summary.measured_twice:
        shown = "; ".join(
            f"{mid} ({', '.join(ws)})" for mid, ws in list(summary.measured_twice.items())[:5]
        )
        more = ", …" if len(summary.measured_twice) > 5 else ""
        summary.warnings.append(
            f"{len(summary.measured_twice)} model(s) were measured by more than one shard: "
            f"{shown}{more}; their rows agree and are kept once"
        )
    say(
        f"merged {len(shards)} shard folder(s) into {out}: {summary.new_models} new model and "
        f"{summary.new_measurements} new measurement rows ({summary.models} and "
        f"{summary.measurements} in all, {summary.duplicates} identical duplicates kept once, "
        f"{summary.checkpoints} checkpoints copied)"
    )
    for w in summary.warnings:
        say(f"warning: {w}")
    twins = merge_twin_files(out, shards)  # --twin-check's lines: every model once
    if twins:
        say(f"twin check: the lines of {twins} model(s) merged into {out / TWIN_FILE}")
    if report:
        summary.report = report_from_folder(out)
    return summary
