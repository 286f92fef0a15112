"""``twin_check.csv``: the twin check of a study's models, its report section and its merge.

``geosharp study MANIFEST --twin-check`` (:mod:`geosharp.studies.population_twin`) re-measures
every model's cells on one random equivalent twin and writes one line per (model, measure, ρ)
to :data:`TWIN_FILE` in the study folder: the stored value, the twin's, the relative change and
the flags of each side. This module reads and writes that file (:func:`read_rows`,
:func:`add_rows`: every model's lines at once, under a lock, by an atomic rewrite), turns it
into the report's "Twin check" section (:func:`twin_section`, a folder-section provider of
:data:`geosharp.studies.sections.FOLDER_SECTION_PROVIDERS`) and merges the files of shards
(:func:`merge_twin_files`, run by ``geosharp merge``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.measuring.twin import TWIN_TOL, promised
from geosharp.studies.sections import Section

__all__ = [
    "FIELDS",
    "TWIN_FILE",
    "add_rows",
    "folder_sections",
    "is_flagged",
    "merge_twin_files",
    "read_rows",
    "twin_section",
]

#: Where a study's twin check is written, in its folder.
TWIN_FILE = "twin_check.csv"
#: The columns of :data:`TWIN_FILE`. ``flags`` / ``twin_flags``: space-separated (``not
#: recorded`` for a cell stored before flags existed); ``error``: why a side failed, or why the
#: model has no twin (no symmetry block).
FIELDS = (
    "model_id",
    "measure",
    "rho",
    "value",
    "twin_value",
    "relative_change",
    "flags",
    "twin_flags",
    "scale",
    "seed",
    "dtype",
    "output_change",
    "error",
)
_LOCK = ".twin_check.lock"


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The lines of a ``twin_check.csv`` as dicts of text (none when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        return [r for r in csv.DictReader(fh) if r.get("model_id")]


def _text(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r.get(k) for k in FIELDS})
    return buf.getvalue()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the folder's twin-check lock (shards writing into one folder); none off POSIX.

    The lock file exists only while it is held: the holder removes it before it lets go (also
    on an error or Ctrl-C), so a study folder keeps no ``.twin_check.lock``. A waiter that got
    the lock of a file removed meanwhile (its name now free, or another file's) lets go and
    locks the file the name holds now, so two writers never hold two different files.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: one writer per folder
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the file was removed by the holder before us: lock the name's new file
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # before the lock is let go: no waiter can lock this file for good
        os.close(fd)


def add_rows(folder: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Add one model's lines to ``folder/twin_check.csv`` at once.

    Under a lock (shards may write into one folder), the file is read and rewritten with the
    new lines atomically (:func:`geosharp._io.atomic_write_text`): a killed run leaves either
    the old file or the new one, never half a model. Lines of a model already in the file
    are replaced.
    """
    folder = Path(folder)
    path = folder / TWIN_FILE
    new = {str(r["model_id"]) for r in rows}
    with _locked(folder):
        kept = [r for r in read_rows(path) if r["model_id"] not in new]
        return atomic_write_text(path, _text([*kept, *rows]))


def merge_twin_files(out_dir: str | Path, shard_dirs: Sequence[str | Path]) -> int:
    """Put the shards' ``twin_check.csv`` lines into ``out_dir``'s: every model once.

    A model's lines come from the first folder that has them (``out_dir`` first, then the
    shards in order); nothing is written when no shard adds a model.

    Returns:
        The number of models added.
    """
    out = Path(out_dir)
    rows = read_rows(out / TWIN_FILE)
    have = {r["model_id"] for r in rows}
    added: set[str] = set()
    for s in shard_dirs:
        if Path(s).resolve() == out.resolve():
            continue
        theirs = [r for r in read_rows(Path(s) / TWIN_FILE) if r["model_id"] not in have]
        rows += theirs
        added |= {r["model_id"] for r in theirs}
        have |= added
    if added:
        with _locked(out):
            atomic_write_text(out / TWIN_FILE, _text(rows))
    return len(added)


def _float(text: str | None) -> float | None:
    try:
        x = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return x


def is_flagged(row: Mapping[str, Any]) -> bool:
    """Whether a line's cell is flagged on either side (``not recorded`` is no flag)."""
    flags = [row.get(k) or "" for k in ("flags", "twin_flags")]
    return any(f and f != "not recorded" for f in flags)


def twin_section(rows: Sequence[Mapping[str, str]], tol: float = TWIN_TOL) -> Section:
    """The twin check as a report section: per (measure, ρ), how far the twins moved.

    Args:
        rows: Lines of ``twin_check.csv`` (:func:`read_rows`).
        tol: The relative change beyond which a cell moved (1e-3).

    Returns:
        A :class:`~geosharp.studies.sections.Section`: per (measure, ρ) the models compared,
        the median and worst relative change, how many moved by more than ``tol``, how many
        of those are flagged on either side, and how many moved with no flag ("silent").
    """
    cells: dict[tuple[str, float], list[Mapping[str, str]]] = {}
    left_out = 0
    for r in rows:
        rho = _float(r.get("rho"))
        if _float(r.get("relative_change")) is None or rho is None:
            left_out += 1
            continue
        cells.setdefault((r["measure"], rho), []).append(r)
    order = list(dict.fromkeys(m for m, _ in cells))
    body = []
    for measure, rho in sorted(cells, key=lambda k: (order.index(k[0]), k[1])):
        sel = cells[(measure, rho)]
        changes = [_float(r["relative_change"]) or 0.0 for r in sel]
        moved = [r for r, c in zip(sel, changes, strict=True) if c > tol]
        flagged = sum(is_flagged(r) for r in moved)
        body.append(
            [
                measure,
                f"{rho:g}",
                "yes" if promised(measure) else "no",
                str(len(sel)),
                f"{statistics.median(changes):.1e}",
                f"{max(changes):.1e}",
                str(len(moved)),
                str(flagged),
                str(len(moved) - flagged) if promised(measure) else "n/a",
            ]
        )
    scales = sorted({f"{x:g}" for x in (_float(r.get("scale")) for r in rows) if x is not None})
    outputs = [x for x in (_float(r.get("output_change")) for r in rows) if x is not None]
    dtypes = sorted({r.get("dtype", "") for r in rows if r.get("dtype")})
    worst = f" (by at most {max(outputs):.1e} relative)" if outputs else ""
    no_blocks = len({r["model_id"] for r in rows if "no symmetry blocks" in (r.get("error") or "")})
    caption = (
        "Every model was measured again on one random equivalent twin: a copy of it with one "
        f"random group element of scale {', '.join(scales) or '?'} applied to each of its "
        "symmetry blocks (seeded by the study's seed and the model's name), in the model's own "
        f"dtype ({', '.join(dtypes) or '?'}). It computes the same function: its outputs "
        f"differ from the model's by rounding alone{worst}. Relative change = |twin − model| / "
        f"|model| of each cell, median and worst over the models. Geodesic measures promise "
        f"the same value for the same function (invariant: yes): a cell that moved by more than "
        f"{tol:g} is either flagged on either side (still rising, unstable or saturated: its "
        "value cannot be trusted as it is, which the flag already says; not a broken promise) "
        "or silent (moved with no flag: the promise failing, which should be 0). Adaptive and "
        "Euclidean sharpness are not invariant under the symmetry and are shown for contrast."
    )
    if left_out:
        caption += f" {left_out} cell(s) with no value on either side are left out."
    if no_blocks:
        caption += f" {no_blocks} model(s) have no symmetry block, hence no twin to compare."
    header = [
        "measure",
        "ρ",
        "invariant",
        "models",
        "median rel. change",
        "worst",
        f"moved > {tol:g}",
        "of those flagged",
        "silent",
    ]
    return Section("Twin check", header, body, caption)


def folder_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """The twin check of a study folder as a report section (none without ``twin_check.csv``).

    A folder-section provider of :data:`geosharp.studies.sections.FOLDER_SECTION_PROVIDERS`;
    every model of the file is counted (the check is about the function, not the gap).
    """
    rows = read_rows(Path(out_dir) / TWIN_FILE)
    return [twin_section(rows)] if rows else []
