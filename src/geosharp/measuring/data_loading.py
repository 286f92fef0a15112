"""Loading the data to measure on, cut into ``(inputs, targets)`` batches for the model.

Data: a Hugging Face ``datasets`` folder (``save_to_disk``), a CSV/TSV, JSONL, JSON or Parquet
file of text and labels (read by :mod:`~geosharp.measuring.data_files`, tokenized here with the
model's tokenizer, padded per batch), an ``.npz`` of arrays, or ``module:function`` returning
``(inputs, targets)`` batches. The language-model and sequence-to-sequence tasks (a ``.txt``
corpus too) are read by :mod:`~geosharp.measuring.lm`. :func:`load_data` returns a
:class:`DataSet`: the batches and what was read, warned about and mapped.

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
)
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.model_loading import LoadedModel
from geosharp.measuring.resolve import import_callable
from geosharp.models.hf import quiet_transformers

__all__ = [
    "MIN_VOCAB_COVERAGE",
    "NPZ_TARGET_KEYS",
    "DataSet",
    "load_data",
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
    texts = []
    for c in text_cols:
        col = []
        for i, r in enumerate(rows, 1):
            v = r.get(c)
            if v is None:
                raise MeasureError(f"{where}, row {i}: the text column {c!r} is empty")
            col.append(str(v))
        texts.append(col)
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
    table: tuple[list[dict[str, Any]], str] | None = None,
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
        table: What :func:`read_table` returned for ``spec``, to read a file only once.

    Returns:
        A :class:`DataSet`.

    Raises:
        MeasureError: On every problem with the data.
    """
    _check_batch_size(batch_size)
    if samples is not None and (isinstance(samples, bool) or samples < 1):
        raise MeasureError(f"--samples must be >= 1, got {samples!r}")
    kind = data_kind(spec)
    if kind == "npz":
        return _load_npz(Path(spec).expanduser(), loaded, batch_size, samples, label_col, dtype)
    if kind == "function":
        return _load_function(spec, batch_size, samples, dtype)
    rows, desc = table if table is not None else read_table(spec, split=split)
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
    text_cols = [c.strip() for c in text_col.split(",") if c.strip()]
    warns: list[str] = []
    info: list[str] = []
    if all(c in cols for c in text_cols) and text_cols:
        tok, source = _tokenizer_and_source(loaded, tokenizer, where)
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


#: A tokenizer must cover at least this share of the model's embedding rows. Real models pad
#: their embedding table to a multiple of 64 or 128 or keep a few reserved rows (Qwen2: 151,665
#: tokens for 151,936 rows, 99.8 %; Phi-2: 50,295 for 51,200, 98 %; T5: 32,100 for 32,128), so
#: a tokenizer covering less than half of the table is another model's, or one rebuilt from
#: ``config.json`` alone (its special tokens: 5 of BERT's 30,522 rows). One with more tokens than
#: rows is refused too: its ids past the table cannot be looked up.
MIN_VOCAB_COVERAGE = 0.5


def _embedding_rows(model: Any) -> int | None:
    """Rows of the model's input embedding table (``None`` if it has none that is known)."""
    try:
        emb = model.get_input_embeddings()
    except Exception:
        emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and not isinstance(size, bool) else None


def _files_named() -> str:
    from geosharp.measuring.checkpoint_files import TOKENIZER_FILES

    return ", ".join(TOKENIZER_FILES) + " or a SentencePiece .model"


def _tokenizer_and_source(loaded: LoadedModel, folder: str | None, where: str) -> tuple[Any, str]:
    """The tokenizer for text data and where it was read, checked against the model.

    ``folder`` (``--tokenizer``) wins; else the model's own (its folder's, an adapter's or its
    base model's). A folder without a tokenizer file is refused rather than asked for one
    (transformers 5 would build a tokenizer of the special tokens alone from ``config.json``),
    and so is a tokenizer whose size does not fit the model's embedding table
    (:data:`MIN_VOCAB_COVERAGE`).

    Raises:
        MeasureError: No tokenizer, or one that is not the model's.
    """
    from geosharp.measuring.checkpoint_files import has_tokenizer_files

    if folder is not None:
        path = Path(str(folder)).expanduser()
        if path.is_dir() and not has_tokenizer_files(path):
            raise MeasureError(
                f"--tokenizer {folder} holds no tokenizer file (no {_files_named()}): pass the "
                "folder the model's tokenizer was saved to (tokenizer.save_pretrained)"
            )
        try:
            from transformers import AutoTokenizer

            with quiet_transformers():
                tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except ImportError as err:
            raise MeasureError(
                "tokenizing text needs transformers: pip install transformers"
            ) from err
        except Exception as err:
            raise MeasureError(f"cannot load the tokenizer in {folder}: {err}") from err
        source = f"--tokenizer {folder}"
    elif loaded.tokenizer is None:
        if loaded.kind in ("huggingface", "peft") and loaded.tokenizer_source:
            where_none = (
                f"its folder has none: no {_files_named()} in "
                f"{loaded.tokenizer_source.removeprefix('the model folder ')}"
                if loaded.kind == "huggingface"
                else f"there is no {_files_named()} in {loaded.tokenizer_source}"
            )
            raise MeasureError(
                f"{where} holds text, but the model comes with no tokenizer ({where_none}): "
                "save the model's tokenizer beside it (tokenizer.save_pretrained(FOLDER)) or "
                "pass its folder with --tokenizer"
            )
        raise MeasureError(
            f"{where} holds text, but the model comes with no tokenizer; pass a Hugging Face "
            "tokenizer folder with --tokenizer"
        )
    else:
        tok, source = loaded.tokenizer, loaded.tokenizer_source or "the model"
    _check_fit(loaded, tok, source)
    return tok, source


def _tokenizer(loaded: LoadedModel, folder: str | None, where: str) -> Any:
    """The tokenizer of :func:`_tokenizer_and_source`, without where it was read."""
    return _tokenizer_and_source(loaded, folder, where)[0]


def _describe(tok: Any, source: str) -> str:
    return f"the tokenizer of {source} ({type(tok).__name__}, {len(tok):,} tokens)"


def _check_fit(loaded: LoadedModel, tok: Any, source: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows, or far fewer."""
    rows = _embedding_rows(loaded.model)
    if rows is None:
        return
    n = len(tok)
    fix = "pass the tokenizer the model was trained with (--tokenizer FOLDER)"
    if n > rows:
        raise MeasureError(
            f"{_describe(tok, source)} does not fit the model: its ids reach {n - 1:,}, but the "
            f"model's embedding table has {rows:,} rows (ids 0..{rows - 1:,}), so it is not the "
            f"model's tokenizer; {fix}"
        )
    if n < MIN_VOCAB_COVERAGE * rows:
        raise MeasureError(
            f"{_describe(tok, source)} does not fit the model: it covers {n:,} of the model's "
            f"{rows:,} embedding rows, less than half, so it is not the model's tokenizer (a "
            f"tokenizer rebuilt from config.json holds only the special tokens); {fix}"
        )


def tokenizer_line(
    loaded: LoadedModel, tok: Any, source: str, first: Sequence[Sequence[int]], where: str
) -> str:
    """The line saying which tokenizer is used; refuses text that is mostly unknown tokens.

    Args:
        loaded: The model.
        tok: The tokenizer.
        source: Where it was read (``"the model folder /m"``, ``"--tokenizer /t"``).
        first: The token ids of the first batch (one list per sequence; padding left out).
        where: The data file's name.

    Returns:
        E.g. ``"tokenizer: the model folder /m (BertTokenizer, 80 tokens; the model's embedding
        table: 82 rows); unknown token [UNK]: 0 of 23 tokens of the first batch"``.

    Raises:
        MeasureError: If more than half of the first batch's tokens (special tokens aside) are
            the unknown token: the tokenizer does not know the text's words.
    """
    rows = _embedding_rows(loaded.model)
    table = f"; the model's embedding table: {rows:,} rows" if rows is not None else ""
    line = f"tokenizer: {source} ({type(tok).__name__}, {len(tok):,} tokens{table})"
    unk = getattr(tok, "unk_token_id", None)
    if not isinstance(unk, int):
        return line + "; it has no unknown token (byte-level: every text is representable)"
    special = set(getattr(tok, "all_special_ids", None) or ()) - {unk}
    ids = [i for seq in first for i in seq if i not in special]
    n_unk = sum(i == unk for i in ids)
    name = getattr(tok, "unk_token", None) or unk
    if ids and 2 * n_unk > len(ids):
        raise MeasureError(
            f"{n_unk:,} of the {len(ids):,} tokens of the first batch of {where} "
            f"({100 * n_unk / len(ids):.0f} %) are the unknown token {name}: "
            f"{_describe(tok, source)} does not know the text's words, so it is not the model's "
            "tokenizer or the text is not in the model's language; pass the tokenizer the "
            "model was trained with (--tokenizer FOLDER), or data it was trained on"
        )
    return line + f"; unknown token {name}: {n_unk:,} of {len(ids):,} tokens of the first batch"


def _first_batch_ids(batch_inputs: Mapping[str, Any]) -> list[list[int]]:
    """The token ids of a tokenized batch, one list per sequence, padding left out."""
    ids = batch_inputs["input_ids"]
    mask = batch_inputs.get("attention_mask")
    out = []
    for i in range(ids.shape[0]):
        row = ids[i] if mask is None else ids[i][mask[i].bool()]
        out.append([int(t) for t in row.tolist()])
    return out


def _max_length(loaded: LoadedModel, tok: Any, max_length: int, warns: list[str]) -> int:
    """``--max-length`` capped to what the model accepts (:func:`_length_limit`), with a warning."""
    limit = _length_limit(loaded, tok)
    if limit is not None and max_length > limit:
        warns.append(
            f"--max-length {max_length} exceeds what the model accepts ({limit} tokens); "
            f"using {limit}"
        )
        return limit
    return max_length


def _length_limit(loaded: LoadedModel, tok: Any) -> int | None:
    limits = []
    if loaded.max_positions:
        limits.append(int(loaded.max_positions))
    tml = getattr(tok, "model_max_length", None)
    if isinstance(tml, int) and 0 < tml < 1_000_000:
        limits.append(tml)
    return min(limits) if limits else None


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
