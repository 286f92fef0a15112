"""Reading data files: rows of text and labels, and the labels as class ids.

:func:`data_kind` tells what a data argument is (a ``datasets`` folder, a file format, an
``.npz``, a ``.txt`` corpus or ``module:function``); :func:`read_table` reads the rows of a
CSV/TSV, JSONL/JSON or Parquet file or a Hugging Face ``datasets`` folder
(``save_to_disk``); :func:`parse_labels` turns a label column into a target tensor (text
labels mapped to class ids, every label checked) and :func:`infer_num_labels` counts the
classes of a fresh classification head. Batching and tokenizing is
:mod:`~geosharp.measuring.data_loading`'s.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geosharp.measuring.errors import MeasureError
from geosharp.measuring.resolve import _is_function_spec

__all__ = [
    "TEXT_ENCODING",
    "data_kind",
    "infer_num_labels",
    "parse_labels",
    "read_table",
    "text_column",
]

#: How users' text files (CSV/TSV, JSONL/JSON, a ``.txt`` corpus, a manifest) are decoded:
#: UTF-8, a leading byte-order mark dropped (Excel's "CSV UTF-8" and Windows editors write one,
#: which would otherwise become part of the first column's name or the first word).
TEXT_ENCODING = "utf-8-sig"


def data_kind(spec: str) -> str:
    """The kind of the data ``spec``: a datasets folder, a file format, or a function.

    One of ``"hf_dataset"``, ``"csv"``, ``"jsonl"``, ``"json"``, ``"parquet"``, ``"txt"``,
    ``"npz"`` or ``"function"``.

    Raises:
        MeasureError: If the path does not exist or its kind is unknown.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        if any((path / m).is_file() for m in markers):
            return "hf_dataset"
        raise MeasureError(
            f"{path} is a folder but not a Hugging Face datasets folder (no dataset_info.json, "
            "state.json or dataset_dict.json; write one with Dataset.save_to_disk)"
        )
    if path.is_file():
        suffix = path.suffix.lower()
        kinds = {
            ".csv": "csv",
            ".tsv": "csv",
            ".jsonl": "jsonl",
            ".json": "json",
            ".parquet": "parquet",
            ".txt": "txt",
            ".npz": "npz",
        }
        if suffix in kinds:
            return kinds[suffix]
        raise MeasureError(
            f"unknown data format {suffix or '(no suffix)'} of {path}: use a Hugging Face "
            "datasets folder, .csv/.tsv, .jsonl/.json, .parquet, .txt (a text corpus, for "
            "--task causal-lm), .npz, or module:function"
        )
    if _is_function_spec(spec):
        return "function"
    raise MeasureError(
        f"data not found: {spec!r} is neither an existing file or folder nor module:function"
    )


def text_column(rows: Sequence[Mapping[str, Any]], col: str, where: str, what: str) -> list[str]:
    """The cells of a text column, refusing rows where it is missing or blank.

    An empty text is not an error a tokenizer notices: it becomes a sequence of special tokens
    alone and is measured like any other row, pulling the loss toward that of no input. So
    every such row is named, in one line, before anything is measured.

    Args:
        rows: The data rows.
        col: The column.
        where: The file's name, for the message.
        what: What the column holds (``"text"``, ``"target"``), for the message.

    Raises:
        MeasureError: If the column is missing or blank (only whitespace) in any row.
    """
    out: list[str] = []
    blank: list[int] = []
    for i, r in enumerate(rows, 1):
        v = r.get(col)
        if v is None or not str(v).strip():
            blank.append(i)
        else:
            out.append(str(v))
    if blank:
        shown = ", ".join(map(str, blank[:10])) + (
            f" and {len(blank) - 10} more" if len(blank) > 10 else ""
        )
        rows_text = "row" if len(blank) == 1 else "rows"
        raise MeasureError(
            f"{where}: the {what} column {col!r} is empty in {rows_text} {shown} of {len(rows)} "
            "(rows numbered from 1 after the header): an empty text would be measured as its "
            "special tokens alone; remove or fill those rows"
        )
    return out


def read_table(
    spec: str, *, split: str | None = None, limit: int | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Rows of a CSV/TSV, JSONL/JSON or Parquet file or Hugging Face datasets folder.

    Args:
        spec: The path.
        split: Split of a ``DatasetDict`` folder (default ``train`` if there, else the only one).
        limit: Read at most this many rows of a datasets folder or Parquet file (its first ones).

    Returns:
        ``(rows, description)``.

    Raises:
        MeasureError: If the file cannot be read.
    """
    path = Path(spec).expanduser()
    kind = data_kind(spec)
    try:
        if kind == "csv":
            with path.open(newline="", encoding=TEXT_ENCODING) as f:
                delim = "\t" if path.suffix.lower() == ".tsv" else ","
                rows = [dict(r) for r in csv.DictReader(f, delimiter=delim)]
            return rows, f"{path} (CSV)"
        if kind == "jsonl":
            rows = []
            with path.open(encoding=TEXT_ENCODING) as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as err:
                            raise MeasureError(f"{path}, line {i}: not JSON ({err})") from err
                        if not isinstance(row, dict):
                            raise MeasureError(f"{path}, line {i}: not a JSON object")
                        rows.append(row)
            return rows, f"{path} (JSONL)"
        if kind == "json":
            obj = json.loads(path.read_text(encoding=TEXT_ENCODING))
            if isinstance(obj, dict) and isinstance(obj.get("data"), list):
                obj = obj["data"]
            if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
                raise MeasureError(
                    f"{path}: a JSON list of objects (or {{'data': [...]}}) is expected"
                )
            return obj, f"{path} (JSON)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as err:
        raise MeasureError(f"cannot read {path}: {err}") from err
    if kind == "hf_dataset":
        return _read_hf_dataset(path, split, limit)
    if kind == "parquet":
        return _read_parquet(path, limit)
    if kind == "txt":
        raise MeasureError(
            f"{path} is a plain-text corpus: it has no columns or labels. Measure a language "
            "model on it (--task causal-lm), or give a table (.csv, .jsonl, ...) with a label "
            "column"
        )
    raise MeasureError(f"{path} is not a table of rows")  # pragma: no cover


def _read_parquet(path: Path, limit: int | None) -> tuple[list[dict[str, Any]], str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MeasureError(
            f"reading the Parquet file {path} needs pyarrow (pip install pyarrow)"
        ) from err
    try:
        table = pq.read_table(str(path))
    except Exception as err:
        raise MeasureError(f"cannot read {path} as Parquet: {err}") from err
    desc = f"{path} (Parquet"
    if limit is not None and table.num_rows > limit:
        desc += f", the first {limit} of {table.num_rows} rows"
        table = table.slice(0, limit)
    return table.to_pylist(), desc + ")"


def _read_hf_dataset(
    path: Path, split: str | None, limit: int | None
) -> tuple[list[dict[str, Any]], str]:
    try:
        import datasets
    except ImportError as err:
        raise MeasureError(
            f"{path} is a Hugging Face datasets folder; reading it needs the package datasets "
            "(pip install datasets)"
        ) from err
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise MeasureError(f"cannot load the datasets folder {path}: {err}") from err
    desc = f"{path} (Hugging Face datasets"
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        if split is None:
            if "train" in ds:
                split = "train"
            elif len(names) == 1:
                split = names[0]
            else:
                raise MeasureError(
                    f"{path} holds the splits {names}; choose one with --split (sharpness is "
                    "measured on training data)"
                )
        if split not in ds:
            raise MeasureError(f"{path} has no split {split!r}; its splits are {names}")
        ds = ds[split]
        desc += f", split {split!r}"
    elif split is not None and split != "train":
        desc += f", one split; --split {split!r} ignored"
    if limit is not None and len(ds) > limit:
        desc += f", the first {limit} of {len(ds)} rows"
        ds = ds.select(range(limit))
    return ds.to_list(), desc + ")"


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows[:100]:
        cols.extend(k for k in r if k not in cols)
    return cols


def parse_labels(
    values: Sequence[Any],
    *,
    regression: bool,
    label2id: Mapping[str, int] | None,
    num_labels: int | None,
    where: str,
) -> Tensor:
    """Turn a label column into a target tensor, checking every label.

    Integers (also written as ``"3"`` or ``3.0``) are class indices; other strings are looked up
    in ``label2id``; with ``regression`` every label is a float.

    Raises:
        MeasureError: On a missing, unparseable or out-of-range label.

    Example:
        >>> parse_labels(["1", 0, "neg"], regression=False, label2id={"neg": 0},
        ...              num_labels=2, where="data.csv").tolist()
        [1, 0, 0]
    """
    out: list[Any] = []
    for i, v in enumerate(values, 1):
        if v is None or (isinstance(v, str) and not v.strip()):
            raise MeasureError(f"{where}, row {i}: the label is missing")
        if regression:
            try:
                out.append(float(v))
            except (TypeError, ValueError) as err:
                raise MeasureError(f"{where}, row {i}: label {v!r} is not a number") from err
            continue
        idx = _as_int(v)
        if idx is None and label2id and str(v) in label2id:
            idx = int(label2id[str(v)])
        if idx is None:
            names = f" nor one of the model's label names {sorted(label2id)}" if label2id else ""
            raise MeasureError(
                f"{where}, row {i}: label {v!r} is not an integer class index{names}"
            )
        out.append(idx)
    if regression:
        return torch.tensor(out, dtype=torch.float64)
    targets = torch.tensor(out, dtype=torch.long)
    if num_labels is not None:
        bad = [(i + 1, t) for i, t in enumerate(out) if not 0 <= t < num_labels]
        if bad:
            shown = ", ".join(f"{t} (row {r})" for r, t in bad[:5])
            more = f", … ({len(bad)} rows in all)" if len(bad) > 5 else ""
            raise MeasureError(
                f"{where}: labels outside the model's {num_labels} classes "
                f"(0..{num_labels - 1}): {shown}{more}. Check --label-col, or measure a model "
                "with as many labels as the data has"
            )
    return targets


def _as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v):
        return int(v)
    return None


def infer_num_labels(values: Sequence[Any]) -> tuple[int, dict[str, int]]:
    """Number of classes (and names) of a label column, for a fresh classification head.

    Integer labels give ``max + 1`` classes (at least 2); string labels one class per name, in
    sorted order.
    """
    ints = [_as_int(v) for v in values]
    if all(i is not None for i in ints):
        return max(2, max(ints) + 1), {}
    names = sorted({str(v) for v in values})
    return max(2, len(names)), {n: i for i, n in enumerate(names)}
