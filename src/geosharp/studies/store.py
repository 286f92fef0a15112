"""The results database of a study: SQLite, atomic, resumable.

One file ``study.sqlite`` per study folder holds

* ``meta``: the study's name and configuration (so that a folder is never silently reused by a
  different study), the geosharp/torch versions;
* ``models``: one row per trained or loaded model — hyperparameters, train/test metrics, the
  generalization gap, checkpoint path, seed, training time;
* ``measurements``: one row per (model, measure, ρ, settings) — the value, the per-batch values,
  the clean losses, wall time, versions, seed.

Every write is one transaction (``with conn:``), so a run killed at any point leaves only
complete rows; a rerun asks :meth:`Store.has_measurement` / :meth:`Store.get_model` and skips
what is done. The database runs in WAL mode so that several processes (shards of a population
on one machine) can write to it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from geosharp._io import atomic_write_text
from geosharp._version import __version__
from geosharp.measuring.results import flags_text

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY,
    hparams TEXT NOT NULL,
    metrics TEXT NOT NULL,
    gap REAL,
    checkpoint TEXT,
    seed INTEGER,
    train_time_s REAL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS measurements (
    model_id TEXT NOT NULL,
    measure TEXT NOT NULL,
    rho REAL,
    settings_key TEXT NOT NULL,
    value REAL,
    per_batch TEXT NOT NULL,
    clean_losses TEXT NOT NULL,
    settings TEXT NOT NULL,
    time_s REAL,
    versions TEXT NOT NULL,
    seed INTEGER,
    created REAL NOT NULL,
    PRIMARY KEY (model_id, measure, rho, settings_key)
);
"""


#: What a measurement's check found (:mod:`geosharp.measuring.flags`), kept in its settings
#: but not part of its identity: a resumed study matches a finished row without them.
CELL_CHECKS = ("flags", "instability", "carried")
_NOT_KEYED = ("error", *CELL_CHECKS)


class StudyMismatchError(ValueError):
    """The output folder holds the database of a different study."""


def report_info(meta: Mapping[str, str]) -> dict[str, Any]:
    """What a run recorded for its report (meta ``report``), as a dict.

    Its title, settings, population, environments, …; ``{}`` when none was recorded or it
    does not parse.
    """
    try:
        info = json.loads(meta.get("report") or "{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def orbit_rows(conn: sqlite3.Connection) -> dict[str, list[dict[str, Any]]]:
    """Model id → its recorded head rows of a study database (:meth:`Store.put_orbit`).

    Empty when none was recorded (no ``orbit`` table). :meth:`Store.orbit_rows` of an open
    store; ``geosharp merge`` reads the shards' databases with it.
    """
    found = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'orbit'"
    ).fetchone()
    if found is None:
        return {}
    cur = conn.execute("SELECT model_id, heads FROM orbit ORDER BY model_id")
    return {mid: json.loads(heads) for mid, heads in cur.fetchall()}


def versions() -> dict[str, str]:
    """Versions recorded with every measurement."""
    return {"geosharp": __version__, "torch": torch.__version__}


def _key(settings: Mapping[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True, default=str)


class Store:
    """A study's SQLite results database.

    Args:
        path: The database file (created with its folder if missing).
        study: Name of the study (e.g. ``"diagonal"``); ``None`` with ``config=None``.
        config: The study's configuration; a folder whose database records a different study or
            configuration is refused unless ``force=True``. ``None``: open an existing database
            as it is (for reading and adding rows), checking and recording nothing.
        force: Reuse the folder anyway, replacing its recorded configuration (rows are kept).

    Raises:
        StudyMismatchError: If the database belongs to another study or configuration.
        FileNotFoundError: If ``config`` is ``None`` and the database does not exist.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as d:
        ...     store = Store(pathlib.Path(d) / "study.sqlite", "demo", {"n": 1})
        ...     store.put_model("m0", hparams={"lr": 0.1}, metrics={"test_loss": 0.2}, gap=0.2)
        ...     store.put_measurement("m0", "adaptive worst l2", 0.1, {"steps": 20}, 0.5, [0.5])
        ...     store.has_measurement("m0", "adaptive worst l2", 0.1, {"steps": 20})
        True
    """

    def __init__(
        self,
        path: str | Path,
        study: str | None,
        config: Mapping[str, Any] | None,
        force: bool = False,
    ) -> None:
        self.path = Path(path)
        if config is None and not self.path.is_file():
            raise FileNotFoundError(f"no study database at {self.path}")
        if config is None and not (
            os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK)
        ):
            # an existing study on a read-only file system or folder: read it as it is (no
            # journal, no WAL index beside it), so it can still be reported and exported
            uri = f"{self.path.resolve().as_uri()}?mode=ro&immutable=1"
            self.conn = sqlite3.connect(uri, uri=True, timeout=60.0)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, timeout=60.0)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        with self.conn:
            self.conn.executescript(SCHEMA)
        if config is None:  # open an existing study as it is, writing nothing
            return
        config_json = json.dumps(config, sort_keys=True, default=str)
        meta = self.meta()
        if meta and not force:
            if meta.get("study") != study:
                raise StudyMismatchError(
                    f"{self.path.parent} holds the results of study {meta.get('study')!r}, not "
                    f"{study!r}; choose another --out folder or pass --force to reuse it"
                )
            if meta.get("config") != config_json:
                diff = _config_diff(json.loads(meta.get("config") or "{}"), json.loads(config_json))
                raise StudyMismatchError(
                    f"{self.path.parent} holds study {study!r} with a different configuration "
                    f"({diff}); choose another --out folder or pass --force to reuse it "
                    "(finished rows are kept)"
                )
        with self.conn:
            self.conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [
                    ("study", study),
                    ("config", config_json),
                    ("versions", json.dumps(versions())),
                ],
            )

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def backup(self, path: str | Path) -> Path:
        """A consistent single-file copy of the store at ``path`` (SQLite online backup).

        Safe while other processes write to the store; the copy holds every committed row.
        An existing file at ``path`` is replaced.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        target = sqlite3.connect(tmp)
        try:
            self.conn.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # one file, no -wal/-shm beside it
        finally:
            target.close()
        os.replace(tmp, path)
        return path

    # -- meta ----------------------------------------------------------------------------------
    def meta(self) -> dict[str, str]:
        """The ``meta`` table as a dict."""
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())

    @property
    def config(self) -> dict[str, Any]:
        """The recorded configuration."""
        return json.loads(self.meta().get("config", "{}"))

    # -- models -------------------------------------------------------------------------------
    def put_model(
        self,
        model_id: str,
        *,
        hparams: Mapping[str, Any],
        metrics: Mapping[str, Any],
        gap: float,
        checkpoint: str | None = None,
        seed: int | None = None,
        train_time_s: float | None = None,
    ) -> None:
        """Record a trained model (atomically; replaces a row with the same id)."""
        with self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    model_id,
                    json.dumps(dict(hparams), sort_keys=True, default=str),
                    json.dumps(dict(metrics), sort_keys=True, default=str),
                    float(gap),
                    checkpoint,
                    seed,
                    train_time_s,
                    time.time(),
                ),
            )

    def get_model(self, model_id: str) -> dict[str, Any] | None:
        """The row of a model, or ``None``."""
        rows = self._models("WHERE model_id = ?", (model_id,))
        return rows[0] if rows else None

    def models(self) -> list[dict[str, Any]]:
        """All models, ordered by id."""
        return self._models("ORDER BY model_id", ())

    def _models(self, clause: str, args: tuple) -> list[dict[str, Any]]:
        cur = self.conn.execute(
            "SELECT model_id, hparams, metrics, gap, checkpoint, seed, train_time_s "
            f"FROM models {clause}",
            args,
        )
        out = []
        for mid, hp, metrics, gap, ckpt, seed, t in cur.fetchall():
            row = {"model_id": mid, "hparams": json.loads(hp), "gap": gap}
            row.update(json.loads(metrics))
            row.update({"checkpoint": ckpt, "seed": seed, "train_time_s": t})
            out.append(row)
        return out

    # -- measurements -------------------------------------------------------------------------
    def has_measurement(
        self, model_id: str, measure: str, rho: float | None, settings: Mapping[str, Any]
    ) -> bool:
        """Whether this (model, measure, ρ, settings) row is already finished."""
        cur = self.conn.execute(
            "SELECT 1 FROM measurements WHERE model_id = ? AND measure = ? AND rho IS ? "
            "AND settings_key = ?",
            (model_id, measure, rho, _key(settings)),
        )
        return cur.fetchone() is not None

    def put_measurement(
        self,
        model_id: str,
        measure: str,
        rho: float | None,
        settings: Mapping[str, Any],
        value: float,
        per_batch: Iterable[float],
        clean_losses: Iterable[float] = (),
        time_s: float | None = None,
        seed: int | None = None,
        error: str | None = None,
    ) -> None:
        """Record one measurement (atomically); a failed one has ``value`` NaN and ``error``."""
        settings = dict(settings)
        if error is not None:
            settings = {**settings, "error": error}
        with self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO measurements VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    model_id,
                    measure,
                    rho,
                    _key({k: v for k, v in settings.items() if k not in _NOT_KEYED}),
                    None if error is not None else float(value),
                    json.dumps([float(v) for v in per_batch]),
                    json.dumps([float(v) for v in clean_losses]),
                    json.dumps(dict(settings), sort_keys=True, default=str),
                    time_s,
                    json.dumps(versions()),
                    seed,
                    time.time(),
                ),
            )

    def nested_below(
        self, model_id: str, measure: str, rho: float | None, settings: Mapping[str, Any]
    ) -> list[float] | None:
        """The per-batch values of the largest smaller ρ measured with these settings, or None.

        The same model and measure, every setting but ``rho`` equal, the measurement finished:
        the ball it maximized over lies inside this one (:func:`geosharp.measuring.flags.nest`).
        """
        if rho is None:
            return None
        want = {k: v for k, v in settings.items() if k != "rho"}
        cur = self.conn.execute(
            "SELECT per_batch, settings FROM measurements WHERE model_id = ? AND measure = ? "
            "AND rho < ? AND value IS NOT NULL ORDER BY rho DESC",
            (model_id, measure, rho),
        )
        for pb, st in cur.fetchall():
            stored = json.loads(st)
            same = {k: v for k, v in stored.items() if k != "rho" and k in want}
            if set(same) == set(want) and _key(same) == _key(want):
                return [float(v) for v in json.loads(pb)]
        return None

    def measurements(self) -> list[dict[str, Any]]:
        """All measurements, ordered by model, measure and ρ."""
        cur = self.conn.execute(
            "SELECT model_id, measure, rho, value, per_batch, clean_losses, settings, time_s, "
            "versions, seed FROM measurements ORDER BY model_id, measure, rho"
        )
        rows = [
            {
                "model_id": mid,
                "measure": measure,
                "rho": rho,
                "value": value,
                "per_batch": json.loads(pb),
                "clean_losses": json.loads(cl),
                "settings": json.loads(st),
                "time_s": t,
                "versions": json.loads(v),
                "seed": seed,
            }
            for mid, measure, rho, value, pb, cl, st, t, v, seed in cur.fetchall()
        ]
        for r in rows:
            r["error"] = r["settings"].pop("error", None)
            for key in CELL_CHECKS:  # None: recorded before flags existed
                r[key] = r["settings"].pop(key, None)
        return rows

    # -- orbit positions (issue 44) -------------------------------------------------------------
    # One row per (model, head of a GL-type block): geosharp.studies.orbit_spread.head_rows.
    # The table is created by the first put_orbit, so a study that never records one (every
    # study committed before it) keeps its database as it was.
    def put_orbit(self, model_id: str, rows: list[dict[str, Any]]) -> None:
        """Record the orbit position of every head of a model (replacing what it had)."""
        with self.conn:
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS orbit (model_id TEXT PRIMARY KEY, heads TEXT NOT NULL)"
            )
            self.conn.execute(
                "INSERT OR REPLACE INTO orbit (model_id, heads) VALUES (?, ?)",
                (model_id, json.dumps(rows)),
            )

    def orbit_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Model id → its recorded head rows (empty when none was recorded)."""
        return orbit_rows(self.conn)

    # -- export ---------------------------------------------------------------------------------
    def export_csv(self, path: str | Path) -> Path:
        """Write ``results.csv``: one row per measurement, joined with its model's metrics.

        A model of the study's population (as recorded by the run) that has no row, e.g. one
        no merged shard measured, gets one line of its own: its id, empty cells and the flag
        ``not-measured``.

        Returns:
            The path written.
        """
        path = Path(path)
        models = {m["model_id"]: m for m in self.models()}
        hp_keys = sorted({k for m in models.values() for k in m["hparams"]})
        metric_keys = sorted(
            {
                k
                for m in models.values()
                for k in m
                if k not in {"model_id", "hparams", "gap", "checkpoint", "seed", "train_time_s"}
            }
        )
        header = ["model_id", "measure", "rho", "value", "gap", *metric_keys]
        header += [f"hp_{k}" for k in hp_keys] + ["time_s", "n_batches", "per_batch_std"]
        header += ["flags"]
        fh = io.StringIO(newline="")
        w = csv.writer(fh)
        w.writerow(header)
        for r in self.measurements():
            m = models.get(r["model_id"], {"hparams": {}})
            pb = r["per_batch"]
            mean = sum(pb) / len(pb) if pb else float("nan")
            std = (sum((v - mean) ** 2 for v in pb) / (len(pb) - 1)) ** 0.5 if len(pb) > 1 else 0.0
            w.writerow(
                [r["model_id"], r["measure"], r["rho"], r["value"], m.get("gap")]
                + [m.get(k) for k in metric_keys]
                + [m["hparams"].get(k) for k in hp_keys]
                + [r["time_s"], len(pb), std, _flags_cell(r)]
            )
        listed = report_info(self.meta()).get("population") or []
        for mid in listed:  # a model of the population without a row: said, not left out
            if mid not in models:
                w.writerow([mid, "", "", "", ""] + [""] * (len(header) - 6) + [NOT_MEASURED])
        atomic_write_text(path, fh.getvalue())
        return path


#: results.csv's ``flags`` of a model of the population with no row (no shard measured it).
NOT_MEASURED = "not-measured"


def _flags_cell(row: Mapping[str, Any]) -> str:
    """results.csv's ``flags``: the flags, space-separated; empty when sound or failed."""
    return "" if row.get("error") else flags_text(row.get("flags"))


def _config_diff(stored: dict[str, Any], new: dict[str, Any], shown: int = 5) -> str:
    """The keys on which two configurations differ, with both values, e.g. ``seed: 0 → 1``."""
    parts = []
    for key in sorted(set(stored) | set(new)):
        a, b = stored.get(key, "<absent>"), new.get(key, "<absent>")
        if a != b:
            parts.append(f"{key}: stored {_short(a)}, now {_short(b)}")
    more = f"; and {len(parts) - shown} more" if len(parts) > shown else ""
    return "; ".join(parts[:shown]) + more


def _short(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"
