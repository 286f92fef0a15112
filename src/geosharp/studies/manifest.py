"""A population manifest: one row per model, its generalization gap, its hyperparameters.

A manifest is a ``.csv``, ``.jsonl`` or ``.parquet`` file. Its columns:

* ``model`` (required): what ``geosharp measure`` takes as MODEL: a Hugging Face folder, a PEFT
  adapter folder, a ``torch.save`` file or ``module:function``; a relative path is read from
  the manifest's folder;
* ``base`` (optional): the base model of a PEFT adapter (or ``--base`` for every row);
  ``weights`` (optional): the weights file of a ``module:function`` model;
* ``name`` or ``id`` (optional): the model's name in the results (default: ``model``; for
  rows whose ``module:function`` is shared and whose ``weights`` differ, the ``weights`` cell);
* the generalization gap, by one of the rules of :data:`GAP_RULES`: a ``gap`` column, or
  ``train_error`` and ``test_error``, or ``train_accuracy`` and ``test_accuracy``, or
  ``train_loss`` and ``test_loss``; when several fit, the first in that order is used unless
  ``gap=`` names one;
* every other column is a hyperparameter of the model (granulated τ and the conditional mutual
  information score read them).

:func:`read_manifest` checks everything before any model is measured and says what is wrong in
one line that names the row; with ``skip_bad`` a bad row is set aside (and listed) instead.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geosharp.errors import MeasureError

__all__ = [
    "GAP_RULES",
    "MIN_MODELS",
    "GapRule",
    "Manifest",
    "ManifestRow",
    "read_manifest",
]

#: A population needs at least this many models for a rank correlation to mean anything.
MIN_MODELS = 3

_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".jsonl": "jsonl", ".parquet": "parquet"}
_ID_COLUMNS = ("name", "id")
_MODEL_COLUMNS = ("model", "base", "weights")


@dataclass(frozen=True)
class GapRule:
    """How the generalization gap is read from a manifest's columns.

    Attributes:
        key: The rule's name (``--gap KEY``).
        columns: The columns it reads.
        sign: ``+1``: ``columns[1] − columns[0]`` (test minus train error or loss); ``-1``:
            ``columns[0] − columns[1]`` (train minus test accuracy); ``0``: the one column.
        text: The formula as the log and the report say it.
    """

    key: str
    columns: tuple[str, ...]
    sign: int
    text: str

    def gap(self, row: Mapping[str, float]) -> float:
        """The gap of one row (its columns already read as numbers)."""
        if self.sign == 0:
            return row[self.columns[0]]
        train, test = (row[c] for c in self.columns)
        return test - train if self.sign > 0 else train - test


#: The gap rules, in the order they are tried when ``gap=`` names none.
GAP_RULES: tuple[GapRule, ...] = (
    GapRule("gap", ("gap",), 0, "the gap column"),
    GapRule("error", ("train_error", "test_error"), 1, "test_error − train_error"),
    GapRule("accuracy", ("train_accuracy", "test_accuracy"), -1, "train_accuracy − test_accuracy"),
    GapRule("loss", ("train_loss", "test_loss"), 1, "test_loss − train_loss"),
)
_GAP_COLUMNS = {c for r in GAP_RULES for c in r.columns}


@dataclass
class ManifestRow:
    """One model of a manifest.

    Attributes:
        line: The row's number in the file (1 = the first model; a CSV's header is not counted).
        model_id: The model's name in the results.
        model: What ``geosharp measure`` loads (a relative path resolved against the manifest).
        base: The base model of a PEFT adapter, or ``None``.
        weights: The weights of a ``module:function`` model, or ``None``.
        gap: The generalization gap.
        hparams: The hyperparameters (every other column), numbers where they read as numbers.
    """

    line: int
    model_id: str
    model: str
    base: str | None
    weights: str | None
    gap: float
    hparams: dict[str, Any] = field(default_factory=dict)


@dataclass
class Manifest:
    """A checked manifest.

    Attributes:
        path: The manifest file.
        rows: The models to measure, in file order.
        gap_rule: The rule the gaps were read with.
        hparam_names: The hyperparameter columns, in file order.
        skipped: ``(line, model, why)`` of every row set aside by ``skip_bad``.
        gap_rules_present: Every rule the columns would fit (the first, or ``gap=``, was used).
    """

    path: Path
    rows: list[ManifestRow]
    gap_rule: GapRule
    hparam_names: list[str]
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    gap_rules_present: list[str] = field(default_factory=list)

    def gap_line(self) -> str:
        """What the log and the report say of the gap, e.g. ``"gap = test_error − train_error"``."""
        others = [k for k in self.gap_rules_present if k != self.gap_rule.key]
        text = f"gap = {self.gap_rule.text} (--gap {self.gap_rule.key})"
        if others:
            text += f"; the columns also fit --gap {', '.join(others)}"
        return text


def _number(value: Any) -> Any:
    """A CSV cell as a number where it reads as one (``"0.1"`` → 0.1, ``"3"`` → 3)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return text
    return value


def _read_rows(path: Path) -> list[dict[str, Any]]:
    from geosharp.measuring.data_files import read_table

    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise MeasureError(
            f"the manifest {path} must be a .csv, .jsonl or .parquet file (one row per model)"
        )
    if not path.is_file():
        raise MeasureError(f"the manifest {path} does not exist")
    rows, _ = read_table(str(path))
    return rows


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _resolve(spec: str, folder: Path) -> str:
    """A relative path of the manifest resolved against its folder; ``module:function`` as is."""
    from geosharp.measuring.resolve import _is_function_spec

    path = Path(spec).expanduser()
    if path.is_absolute():
        return str(path)
    if (folder / path).exists() or not _is_function_spec(spec):
        return str(folder / path)
    return spec


def _default_name(row: Mapping[str, Any], label: str, builders: Counter[str]) -> str:
    """A row's name when no name column gives one.

    Its ``model`` cell; or its ``weights`` cell when several rows load their weights into the
    same ``module:function`` (``model`` is then the same in each; the weights tell them apart).
    """
    if builders[label] > 1 and not _blank(row.get("weights")):
        return str(row["weights"]).strip()
    return label


def _choose_rule(columns: Sequence[str], gap: str | None, where: str) -> tuple[GapRule, list[str]]:
    present = [r for r in GAP_RULES if all(c in columns for c in r.columns)]
    keys = [r.key for r in present]
    if gap is not None:
        by_key = {r.key: r for r in GAP_RULES}
        if gap not in by_key:
            raise MeasureError(f"--gap must be one of {', '.join(by_key)}, got {gap!r}")
        if gap not in keys:
            need = " and ".join(by_key[gap].columns)
            raise MeasureError(f"{where}: --gap {gap} needs the column(s) {need}")
        return by_key[gap], keys
    if not present:
        rules = "; ".join(" + ".join(r.columns) for r in GAP_RULES)
        raise MeasureError(
            f"{where} has no generalization gap: give a gap column, or one of the pairs "
            f"{rules} (its columns: {', '.join(columns)})"
        )
    return present[0], keys


def read_manifest(
    path: str | Path,
    *,
    gap: str | None = None,
    base: str | None = None,
    skip_bad: bool = False,
    check_model: Callable[[ManifestRow], None] | None = None,
) -> Manifest:
    """Read and check a manifest before any model is measured.

    Args:
        path: The ``.csv``, ``.jsonl`` or ``.parquet`` file.
        gap: The gap rule to use (a key of :data:`GAP_RULES`) when several fit.
        base: The base model of every PEFT adapter without a ``base`` cell.
        skip_bad: Set bad rows aside (listed in :attr:`Manifest.skipped`) instead of failing.
        check_model: Called with every row; raises :class:`MeasureError` for a model that does
            not load (e.g. ``geosharp.measuring``'s loader).

    Returns:
        The :class:`Manifest`.

    Raises:
        MeasureError: With one line naming the row: a missing ``model``, a missing or non-finite
            gap, a duplicate model, a model that does not load (unless ``skip_bad``), columns
            that fit no gap rule, or fewer than :data:`MIN_MODELS` models.
    """
    path = Path(path).expanduser()
    raw = _read_rows(path)
    where = path.name
    if not raw:
        raise MeasureError(f"the manifest {path} holds no rows")
    columns = list(dict.fromkeys(c for r in raw for c in r))
    if "model" not in columns:
        raise MeasureError(
            f"{where} has no model column (its columns: {', '.join(columns)}): one row per "
            "model, with the model's folder or file in a column named model"
        )
    rule, present = _choose_rule(columns, gap, where)
    id_col = next((c for c in _ID_COLUMNS if c in columns), None)
    reserved = {*_MODEL_COLUMNS, *_GAP_COLUMNS, *_ID_COLUMNS}
    hparam_names = [c for c in columns if c not in reserved]
    rows: list[ManifestRow] = []
    skipped: list[tuple[int, str, str]] = []
    seen: dict[tuple[str, str | None, str | None], int] = {}
    ids: dict[str, int] = {}
    builders = Counter(
        str(r.get("model") or "").strip() for r in raw if not _blank(r.get("weights"))
    )

    for line, r in enumerate(raw, 1):
        label = str(r.get("model") or "").strip()
        try:
            if _blank(r.get("model")):
                raise MeasureError(f"{where} row {line}: the model cell is empty")
            model = _resolve(label, path.parent)
            row_base = None if _blank(r.get("base")) else _resolve(str(r["base"]), path.parent)
            row_base = row_base or (_resolve(base, path.parent) if base else None)
            weights = None if _blank(r.get("weights")) else _resolve(str(r["weights"]), path.parent)
            values: dict[str, float] = {}
            for col in rule.columns:
                value = _number(r.get(col))
                if _blank(value) or isinstance(value, str) or isinstance(value, bool):
                    raise MeasureError(
                        f"{where} row {line} ({label}): {col} is missing or not a number "
                        f"({r.get(col)!r})"
                    )
                if not math.isfinite(float(value)):
                    raise MeasureError(f"{where} row {line} ({label}): {col} is {value}")
                values[col] = float(value)
            key = (model, row_base, weights)
            if key in seen:
                raise MeasureError(
                    f"{where} row {line} ({label}): the same model as row {seen[key]} "
                    "(a model is measured once)"
                )
            model_id = _default_name(r, label, builders)
            if id_col and not _blank(r.get(id_col)):
                model_id = str(r[id_col]).strip()
            if model_id in ids:
                raise MeasureError(
                    f"{where} row {line}: the name {model_id!r} is also row {ids[model_id]}'s"
                )
            row = ManifestRow(
                line=line,
                model_id=model_id,
                model=model,
                base=row_base,
                weights=weights,
                gap=rule.gap(values),
                hparams={c: _number(r.get(c)) for c in hparam_names},
            )
            if check_model is not None:
                try:
                    check_model(row)
                except MeasureError as err:
                    raise MeasureError(f"{where} row {line} ({label}): {err}") from err
        except MeasureError as err:
            if not skip_bad:
                raise
            skipped.append((line, label, str(err)))
            continue
        seen[key] = line
        ids[model_id] = line
        rows.append(row)
    if len(rows) < MIN_MODELS:
        extra = f" ({len(skipped)} skipped as bad)" if skipped else ""
        raise MeasureError(
            f"{where} has {len(rows)} usable model(s){extra}: a rank correlation needs at least "
            f"{MIN_MODELS}"
        )
    return Manifest(path, rows, rule, hparam_names, skipped, present)
