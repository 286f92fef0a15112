"""Loading the data to measure on, cut into ``(inputs, targets)`` batches for the model.

Data: a Hugging Face ``datasets`` folder (``save_to_disk``), a CSV/TSV, JSONL, JSON or Parquet
file of text and labels (read by :mod:`~geosharp.measuring.data_files`, tokenized here with the
model's tokenizer, padded per batch), an ``.npz`` of arrays, or ``module:function`` returning
``(inputs, targets)`` batches. The language-model and sequence-to-sequence tasks (a ``.txt``
corpus too) are read by :mod:`~geosharp.measuring.lm`. :func:`load_data` returns a
:class:`DataSet`: the batches and what was read, warned about and mapped. Which tokenizer is
used, and its checks against the model, is :mod:`~geosharp.measuring.tokenizer`'s.

Labels outside the model's classes, an empty data set, a missing column raise
:class:`~geosharp.measuring.errors.MeasureError` saying what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geosharp.measuring.data_files import (
    _as_int,
    _columns,
    data_kind,
    parse_labels,
    read_table,
    text_column,
)
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.loaded_model import LoadedModel
from geosharp.measuring.resolve import import_callable
from geosharp.measuring.tokenizer import (
    MIN_VOCAB_COVERAGE,
    _first_batch_ids,
    _max_length,
    _tokenizer_and_source,
    tokenizer_line,
)

__all__ = [
    "MIN_VOCAB_COVERAGE",
    "NPZ_TARGET_KEYS",
    "DataOptions",
    "DataSet",
    "load_data",
    "read_data",
    "tokenize_rows",
    "tokenizer_line",
]

#: Target arrays of an ``.npz`` are looked up under these names (first found), unless given.
NPZ_TARGET_KEYS = ("y", "targets", "target", "labels", "label", "Y")


@dataclass
class DataSet:
    """Batches ready to measure, and how they were made.

    Attributes:
        batches: ``(inputs, targets)`` pairs.
        description: One line saying what was read.
        n_samples: Number of samples in the batches.
        warnings: E.g. how many texts were truncated.
        label_map: Text label → class index, for every text label met (empty if the labels
            were class indices already).
        info: What was read, said without a warning (e.g. which columns were chosen).
        n_tokens: Number of predicted tokens (language-model and sequence-to-sequence tasks).
        max_length: Tokens per sequence the batches were cut to (after capping ``--max-length``
            to what the model accepts); ``None`` for data that are not token sequences.
    """

    batches: list[tuple[Any, Any]]
    description: str
    n_samples: int
    warnings: list[str] = field(default_factory=list)
    label_map: dict[str, int] = field(default_factory=dict)
    info: list[str] = field(default_factory=list)
    n_tokens: int | None = None
    max_length: int | None = None


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, Mapping):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def tokenize_rows(
    rows: list[dict[str, Any]],
    *,
    tokenizer: Any,
    text_cols: Sequence[str],
    targets: Tensor,
    batch_size: int,
    max_length: int,
    where: str,
) -> tuple[list[tuple[dict[str, Tensor], Tensor]], list[str]]:
    """Tokenize text rows in batches (padded per batch, truncated to ``max_length``).

    Returns:
        ``(batches, warnings)``; the warning counts the truncated rows.
    """
    texts = [text_column(rows, c, where, "text") for c in text_cols]
    pairs = texts[1] if len(texts) > 1 else None
    warns = []
    lengths = [
        len(ids) for ids in tokenizer(texts[0], pairs, truncation=False, verbose=False)["input_ids"]
    ]
    long = [n for n in lengths if n > max_length]
    if long:
        warns.append(
            f"{len(long)} of {len(rows)} text(s) are longer than --max-length {max_length} "
            f"tokens (longest: {max(long)}) and were truncated"
        )
    batches = []
    for s in range(0, len(rows), batch_size):
        enc = tokenizer(
            texts[0][s : s + batch_size],
            pairs[s : s + batch_size] if pairs is not None else None,
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batches.append((dict(enc), targets[s : s + batch_size]))
    return batches, warns


def _pretokenized(
    rows: list[dict[str, Any]], targets: Tensor, batch_size: int, pad_id: int
) -> list[tuple[dict[str, Tensor], Tensor]]:
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in rows[0]]
    batches = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        enc = {}
        for k in keys:
            fill = pad_id if k == "input_ids" else 0
            enc[k] = torch.tensor(
                [list(r[k]) + [fill] * (width - len(r[k])) for r in chunk], dtype=torch.long
            )
        if "attention_mask" not in enc:
            enc["attention_mask"] = torch.tensor(
                [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in chunk]
            )
        batches.append((enc, targets[s : s + batch_size]))
    return batches


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MeasureError(f"--batch-size must be an int >= 1, got {batch_size!r}")


@dataclass(frozen=True)
class DataOptions:
    """How :func:`load_data` reads a data set and cuts it into batches, checked when built.

    The fields are :func:`load_data`'s keywords of the same names.

    Raises:
        MeasureError: On a ``batch_size`` or ``samples`` below 1.
    """

    batch_size: int = 128
    samples: int | None = 1024
    text_col: str = "text"
    label_col: str | None = None
    max_length: int = 128
    split: str | None = None
    tokenizer: str | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_batch_size(self.batch_size)
        samples = self.samples
        if samples is not None and (isinstance(samples, bool) or samples < 1):
            raise MeasureError(f"--samples must be >= 1, got {samples!r}")


def load_data(
    spec: str,
    loaded: LoadedModel,
    *,
    batch_size: int = 128,
    samples: int | None = 1024,
    text_col: str = "text",
    label_col: str | None = None,
    max_length: int = 128,
    split: str | None = None,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DataSet:
    """Read the data and cut it into batches for ``loaded``'s model.

    Args:
        spec: The data (see the module docstring).
        loaded: The model it is for (its tokenizer, number of labels, ...).
        batch_size: Samples per batch (the ``m`` of m-sharpness).
        samples: Use at most this many samples (the first ones); ``None``: all.
        text_col: Text column (``"premise,hypothesis"`` for pairs).
        label_col: Label column or ``.npz`` key (default ``label``; ``.npz``: the first of
            :data:`NPZ_TARGET_KEYS`).
        max_length: Longest tokenized text; longer texts are truncated with a warning.
        split: Split of a Hugging Face ``DatasetDict`` folder.
        tokenizer: A Hugging Face tokenizer folder (default: the model folder's).
        dtype: Floating inputs and targets are cast to this dtype.

    Returns:
        A :class:`DataSet`.

    Raises:
        MeasureError: On every problem with the data.
    """
    options = DataOptions(
        batch_size=batch_size,
        samples=samples,
        text_col=text_col,
        label_col=label_col,
        max_length=max_length,
        split=split,
        tokenizer=tokenizer,
        dtype=dtype,
    )
    return read_data(spec, loaded, options)


def read_data(
    spec: str,
    loaded: LoadedModel,
    options: DataOptions,
    *,
    table: tuple[list[dict[str, Any]], str] | None = None,
) -> DataSet:
    """:func:`load_data` with its options as one :class:`DataOptions`.

    Args:
        spec: The data (see the module docstring).
        loaded: The model it is for.
        options: How to read it and cut it into batches.
        table: What :func:`~geosharp.measuring.data_files.read_table` returned for ``spec``,
            to read a file only once.

    Returns:
        A :class:`DataSet`.

    Raises:
        MeasureError: On every problem with the data.
    """
    batch_size, samples, dtype = options.batch_size, options.samples, options.dtype
    label_col, max_length = options.label_col, options.max_length
    kind = data_kind(spec)
    if kind == "npz":
        return _load_npz(Path(spec).expanduser(), loaded, batch_size, samples, label_col, dtype)
    if kind == "function":
        return _load_function(spec, batch_size, samples, dtype)
    rows, desc = table if table is not None else read_table(spec, split=options.split)
    where = str(Path(spec).name)
    if not rows:
        raise MeasureError(f"the data set {spec} is empty: it holds no rows")
    total = len(rows)
    if samples is not None:
        rows = rows[:samples]
    cols = _columns(rows)
    label_col = label_col or "label"
    if label_col not in cols:
        raise MeasureError(
            f"{where} has no label column {label_col!r} (columns: {', '.join(cols)}); "
            "name it with --label-col"
        )
    values = [r.get(label_col) for r in rows]
    targets = parse_labels(
        values,
        regression=loaded.regression,
        label2id=loaded.label2id,
        num_labels=loaded.num_labels,
        where=where,
    )
    label_map: dict[str, int] = {}
    if not loaded.regression:
        for v in values:
            if _as_int(v) is None and str(v) not in label_map:
                label_map[str(v)] = int(loaded.label2id[str(v)])
        label_map = dict(sorted(label_map.items(), key=lambda kv: (kv[1], kv[0])))
    if targets.is_floating_point():
        targets = targets.to(dtype)
    text_cols = [c.strip() for c in options.text_col.split(",") if c.strip()]
    warns: list[str] = []
    info: list[str] = []
    if all(c in cols for c in text_cols) and text_cols:
        tok, source = _tokenizer_and_source(loaded, options.tokenizer, where)
        max_length = _max_length(loaded, tok, max_length, warns)
        batches, more = tokenize_rows(
            rows,
            tokenizer=tok,
            text_cols=text_cols,
            targets=targets,
            batch_size=batch_size,
            max_length=max_length,
            where=where,
        )
        warns.extend(more)
        info.append(tokenizer_line(loaded, tok, source, _first_batch_ids(batches[0][0]), where))
        what = f"text column(s) {', '.join(repr(c) for c in text_cols)}"
    elif "input_ids" in cols:
        pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0
        too_long = sum(len(r["input_ids"]) > max_length for r in rows)
        if too_long:
            warns.append(
                f"{too_long} of {len(rows)} row(s) have more than --max-length {max_length} "
                "tokens and were truncated"
            )
            rows = [
                {
                    k: (
                        v[:max_length]
                        if k in ("input_ids", "attention_mask", "token_type_ids")
                        else v
                    )
                    for k, v in r.items()
                }
                for r in rows
            ]
        batches = _pretokenized(rows, targets, batch_size, pad)
        what = "pre-tokenized input_ids"
    else:
        missing = [c for c in text_cols if c not in cols]
        raise MeasureError(
            f"{where} has no text column {', '.join(map(repr, missing))} and no input_ids "
            f"(columns: {', '.join(cols)}); name the text column with --text-col"
        )
    used = f"{len(rows)} of {total} rows (--samples)" if len(rows) < total else f"{total} rows"
    return DataSet(
        batches=batches,
        description=f"{desc}: {used}, {what}, labels {label_col!r}, "
        f"{len(batches)} batch(es) of ≤ {batch_size}",
        n_samples=len(rows),
        warnings=warns,
        label_map=label_map,
        info=info,
        max_length=max_length,
    )


def _load_npz(
    path: Path,
    loaded: LoadedModel,
    batch_size: int,
    samples: int | None,
    label_col: str | None,
    dtype: torch.dtype,
) -> DataSet:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as err:
        raise MeasureError(f"cannot read {path} as an .npz of arrays: {err}") from err
    if not arrays:
        raise MeasureError(f"the data set {path} is empty: it holds no arrays")
    if label_col is not None:
        if label_col not in arrays:
            raise MeasureError(
                f"{path.name} has no array {label_col!r} (arrays: {', '.join(arrays)})"
            )
        tkey = label_col
    else:
        tkey = next((k for k in NPZ_TARGET_KEYS if k in arrays), None)
        if tkey is None:
            raise MeasureError(
                f"{path.name} has no target array (looked for {', '.join(NPZ_TARGET_KEYS)}; "
                f"arrays: {', '.join(arrays)}); name it with --label-col"
            )
    inputs = {k: v for k, v in arrays.items() if k != tkey}
    if not inputs:
        raise MeasureError(f"{path.name} holds only the targets {tkey!r}, no input array")
    n = len(arrays[tkey]) if arrays[tkey].ndim else 0
    for k, v in arrays.items():
        if v.ndim == 0 or len(v) != n:
            raise MeasureError(
                f"{path.name}: every array needs the samples along its first axis; {tkey!r} has "
                f"{n} but {k!r} has shape {v.shape}"
            )
    if n == 0:
        raise MeasureError(f"the data set {path} is empty: its arrays have 0 samples")

    def tensor(a: np.ndarray) -> Tensor:
        if a.dtype.kind == "f":
            return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        if a.dtype.kind in "iu":
            return torch.from_numpy(a.astype(np.int64))
        if a.dtype.kind == "b":
            return torch.from_numpy(a)
        raise MeasureError(f"{path.name}: array of dtype {a.dtype} cannot become a tensor")

    used = n if samples is None else min(n, samples)
    targets = tensor(arrays[tkey][:used])
    if not targets.is_floating_point() and loaded.num_labels is not None:
        parse_labels(
            targets.tolist() if targets.dim() == 1 else [],
            regression=False,
            label2id=None,
            num_labels=loaded.num_labels,
            where=path.name,
        )
    x = {k: tensor(v[:used]) for k, v in inputs.items()}
    single = next(iter(x.values())) if len(x) == 1 else None
    batches = []
    for s in range(0, used, batch_size):
        xb = (
            single[s : s + batch_size]
            if single is not None
            else {k: v[s : s + batch_size] for k, v in x.items()}
        )
        batches.append((xb, targets[s : s + batch_size]))
    how = "one input array" if single is not None else f"keyword inputs {', '.join(x)}"
    used_txt = f"{used} of {n} samples (--samples)" if used < n else f"{n} samples"
    return DataSet(
        batches=batches,
        description=f"{path} (npz): {used_txt}, {how} ({', '.join(inputs)}), targets {tkey!r}, "
        f"{len(batches)} batch(es) of ≤ {batch_size}",
        n_samples=used,
    )


def _load_function(spec: str, batch_size: int, samples: int | None, dtype: torch.dtype) -> DataSet:
    fn = import_callable(spec, "data function")
    try:
        obj = fn()
    except Exception as err:
        raise MeasureError(
            f"the data function {spec!r} failed: {type(err).__name__}: {err}"
        ) from err
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(t, Tensor) for t in obj):
        x, y = obj  # one (inputs, targets) pair of the whole data set: cut it into batches
        if len(x) != len(y):
            raise MeasureError(
                f"the data function {spec!r} returned inputs of {len(x)} and targets of {len(y)} "
                "samples"
            )
        n = len(y) if samples is None else min(len(y), samples)
        obj = [
            (x[s : min(s + batch_size, n)], y[s : min(s + batch_size, n)])
            for s in range(0, n, batch_size)
        ]
    if not isinstance(obj, Iterable):
        raise MeasureError(
            f"the data function {spec!r} must return an iterable of (inputs, targets) batches, "
            f"got {type(obj).__name__}"
        )
    batches, n_samples = [], 0
    try:
        for b, batch in enumerate(obj):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise MeasureError(
                    f"the data function {spec!r}: batch {b} is not an (inputs, targets) pair"
                )
            x, y = batch
            batches.append((_cast(x, dtype), _cast(y, dtype)))
            n_samples += len(y) if isinstance(y, Tensor) and y.dim() else 1
            if samples is not None and n_samples >= samples:
                break
    except MeasureError:
        raise
    except Exception as err:
        raise MeasureError(
            f"iterating the batches of {spec!r} failed: {type(err).__name__}: {err}"
        ) from err
    if not batches:
        raise MeasureError(f"the data set is empty: the data function {spec!r} returned no batches")
    return DataSet(
        batches=batches,
        description=f"{spec} (function): {len(batches)} batch(es), {n_samples} samples",
        n_samples=n_samples,
    )
