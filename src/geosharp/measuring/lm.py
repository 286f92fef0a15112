"""The language-model tasks of ``geosharp measure``, and PEFT adapter folders.

Three tasks say what a model's loss is (:func:`~geosharp.measuring.lm_tasks.detect_task`
chooses one from the folder's config, ``--task`` forces one):

* ``classification``: labels (or float targets) from a column of the data, cross-entropy (or
  squared error) of the model's prediction per sample; read by
  :func:`geosharp.measuring.data_loading.load_data`.
* ``causal-lm``: next-token cross-entropy on a text corpus (:func:`load_lm_data`). The corpus
  is a ``.txt`` file (one document per line, or the whole file cut into chunks of
  ``max_length`` tokens), a ``.jsonl``/``.json``/``.csv``/``.parquet`` file or a ``datasets``
  folder with a text column. Documents are tokenized with the model's tokenizer, truncated to
  ``max_length`` tokens and batched in file order, padded on the right; the targets are the
  inputs shifted by one token with every padded position set to ``-100``
  (:func:`next_token_targets`), so the default loss — cross-entropy per token, ignoring
  ``-100`` — is the mean next-token cross-entropy over the real tokens of a batch, the loss a
  Hugging Face causal LM computes from ``labels=input_ids``.
* ``seq2seq``: teacher-forced cross-entropy of the target text given the source text, for
  encoder-decoder models (T5, BART; :func:`load_seq2seq_data`). The decoder's inputs are the
  targets shifted right by the model itself (``prepare_decoder_input_ids_from_labels``); padded
  target positions are ``-100``. This is the model's own ``labels=`` loss.

A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) is loaded on its
base model folder (:func:`~geosharp.measuring.model_loading.load_peft`): the base is frozen and
the adapter's weights (LoRA A and B) are the trainable parameters, so sharpness is measured over
the adapter alone.

This module reads the data of the language-model tasks; choosing the task is
:mod:`~geosharp.measuring.lm_tasks`', loading PEFT adapters
:mod:`~geosharp.measuring.model_loading`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measuring.data_files import (
    TEXT_ENCODING,
    _columns,
    data_kind,
    read_table,
    text_column,
)
from geosharp.measuring.data_loading import DataSet, _check_batch_size, _load_function
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.loaded_model import LoadedModel
from geosharp.measuring.losses import IGNORE_INDEX
from geosharp.measuring.tokenizer import _max_length, _tokenizer_and_source, tokenizer_line

__all__ = [
    "SOURCE_COLS",
    "TARGET_COLS",
    "TXT_MODES",
    "load_lm_data",
    "load_seq2seq_data",
    "next_token_targets",
]
#: How a ``.txt`` corpus is cut into sequences.
TXT_MODES = ("lines", "chunks")
#: The source column of a seq2seq table is the first of these that it has (unless given).
SOURCE_COLS = ("source", "src", "input", "inputs", "document", "article", "question", "text")
#: The target column of a seq2seq table is the first of these that it has (unless given).
TARGET_COLS = ("target", "tgt", "output", "outputs", "summary", "highlights", "answer", "label")
_TXT_PIECE_LINES = 256  # a chunked .txt corpus is tokenized this many lines at a time


# --------------------------------------------------------------------------------------------
# batches


def next_token_targets(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Targets of next-token prediction: ``input_ids`` shifted left, padding ``-100``.

    Position ``t`` predicts token ``t + 1``; a position whose own token or next token is padding
    (``attention_mask == 0``), and the last position, get :data:`IGNORE_INDEX`. Cross-entropy of
    the logits against these targets (ignoring ``-100``) is the next-token loss of a causal LM.

    Example:
        >>> ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
        >>> next_token_targets(ids, (ids != 0).long()).tolist()
        [[6, 7, -100, -100], [9, -100, -100, -100]]
    """
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    real = attention_mask.bool()
    keep = real[:, :-1] & real[:, 1:]
    targets[:, :-1] = input_ids[:, 1:].masked_fill(~keep, IGNORE_INDEX)
    return targets


def _pad(seqs: Sequence[Sequence[int]], value: int) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    return ids, mask


def _pad_id(tok: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tok, name, None) if tok is not None else None
        if isinstance(value, int):
            return value
    return 0  # padded positions are masked out of the attention and the loss: any id will do


def _vocab_size(model: nn.Module) -> int | None:
    try:
        out = model.get_output_embeddings()
    except Exception:
        out = None
    weight = getattr(out, "weight", None)
    if isinstance(weight, Tensor):
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def _check_vocab(loaded: LoadedModel, seqs: Sequence[Sequence[int]], where: str) -> None:
    n = _vocab_size(loaded.model)
    top = max((max(s) for s in seqs if s), default=-1)
    if n is not None and top >= n:
        raise MeasureError(
            f"{where}: the tokenizer produced token id {top}, but the model's vocabulary has "
            f"{n} entries (0..{n - 1}); the tokenizer does not belong to the model (check "
            "--tokenizer)"
        )


#: Above this size of one batch's logits, a warning says how to make batches smaller.
LOGITS_WARN_BYTES = 2 * 1024**3


def _logits_size(loaded: LoadedModel, batches: list, warns: list[str]) -> None:
    """Warn if the logits of the largest batch (batch × length × vocabulary) are large."""
    n_vocab = _vocab_size(loaded.model)
    params = [p for p in loaded.model.parameters() if p.is_floating_point()]
    if n_vocab is None or not params or not batches:
        return
    width = max(t.numel() for _, t in batches)
    size = width * n_vocab * params[0].element_size()
    if size > LOGITS_WARN_BYTES:
        warns.append(
            f"the logits of one batch take {size / 1024**3:.1f} GiB ({width:,} positions × "
            f"{n_vocab:,} tokens), and the ascent keeps several such tensors and their "
            "gradients; lower --batch-size or --max-length if memory runs out"
        )


def _encode(tok: Any, texts: list[str], **kwargs: Any) -> list[list[int]]:
    try:
        return [
            list(ids) for ids in tok(texts, truncation=False, verbose=False, **kwargs)["input_ids"]
        ]
    except Exception as err:
        raise MeasureError(f"tokenizing the text failed: {type(err).__name__}: {err}") from err


def _texts(rows: list[dict[str, Any]], col: str, where: str, what: str) -> list[str]:
    return text_column(rows, col, where, what)


def _read_txt(path: Path) -> str:
    try:
        return path.read_text(encoding=TEXT_ENCODING)
    except (OSError, UnicodeDecodeError) as err:
        raise MeasureError(f"cannot read {path}: {err}") from err


def _chunks(tok: Any, text: str, max_length: int, limit: int | None) -> list[list[int]]:
    """Token ids of ``text`` cut into blocks of ``max_length`` (the last one may be shorter).

    The text is tokenized ``_TXT_PIECE_LINES`` lines at a time (special tokens only at its
    start), and no further than the first ``limit`` blocks need.
    """
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    need = None if limit is None else limit * max_length + 1
    for s in range(0, len(lines), _TXT_PIECE_LINES):
        piece = "".join(lines[s : s + _TXT_PIECE_LINES])
        ids.extend(_encode(tok, [piece], add_special_tokens=s == 0)[0])
        if need is not None and len(ids) >= need:
            break
    return [ids[s : s + max_length] for s in range(0, len(ids), max_length)]


def load_lm_data(
    spec: str,
    loaded: LoadedModel,
    *,
    batch_size: int = 128,
    samples: int | None = 1024,
    text_col: str = "text",
    max_length: int = 128,
    split: str | None = None,
    tokenizer: str | None = None,
    txt_mode: str = "lines",
    dtype: torch.dtype = torch.float32,
) -> DataSet:
    """Read a text corpus and cut it into next-token batches for a causal LM.

    Every batch is ``({"input_ids", "attention_mask"}, targets)``, padded on the right to its
    longest sequence, with :func:`next_token_targets` as targets; sequences keep the corpus's
    order, so the batches are the same on every run.

    Args:
        spec: A ``.txt`` file, a ``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet`` file or a
            Hugging Face ``datasets`` folder with a text column (or an ``input_ids`` column of
            token ids), or ``module:function`` returning ``(inputs, targets)`` batches.
        loaded: The model (its tokenizer and vocabulary).
        batch_size: Sequences per batch.
        samples: Use the first this many sequences (``None``: all).
        text_col: The text column of a table.
        max_length: Longest sequence in tokens; longer documents are truncated (with a warning),
            and a chunked ``.txt`` corpus is cut into blocks of this length.
        split: Split of a ``datasets`` folder.
        tokenizer: A tokenizer folder (default: the model's).
        txt_mode: ``"lines"`` (one document per non-empty line of a ``.txt`` file) or
            ``"chunks"`` (the whole file, cut into blocks of ``max_length`` tokens).
        dtype: Floating tensors of a data function are cast to this dtype.

    Returns:
        A :class:`~geosharp.measuring.data_loading.DataSet` (``n_tokens``: the predicted tokens).

    Raises:
        MeasureError: On every problem with the corpus or its tokenization.
    """
    _check_batch_size(batch_size)
    if txt_mode not in TXT_MODES:
        raise MeasureError(f"unknown --txt-mode {txt_mode!r}: use {' or '.join(TXT_MODES)}")
    kind = data_kind(spec)
    if kind == "function":
        return _load_function(spec, batch_size, samples, dtype)
    if kind == "npz":
        raise MeasureError(
            f"the causal-lm task reads a text corpus (.txt, .jsonl, .csv, .parquet or a "
            f"datasets folder), not an .npz: {spec}"
        )
    path = Path(spec).expanduser()
    where = path.name
    warns: list[str] = []
    seqs: list[list[int]]
    too_long = []
    source = None
    if kind == "txt":
        tok, source = _tokenizer_and_source(loaded, tokenizer, where)
        max_length = _max_length(loaded, tok, max_length, warns)
        text = _read_txt(path)
        if txt_mode == "chunks":
            seqs = _chunks(tok, text, max_length, samples)
            desc = f"{path} (text, the whole file in chunks of ≤ {max_length} tokens)"
            what = "chunks"
        else:
            docs = [line for line in text.splitlines() if line.strip()]
            total = len(docs)
            docs = docs if samples is None else docs[:samples]
            seqs = _encode(tok, docs)
            desc = f"{path} (text, one document per line)"
            what = f"{len(docs)} of {total} documents" if len(docs) < total else "documents"
    else:
        rows, desc = read_table(spec, split=split, limit=samples)
        if not rows:
            raise MeasureError(f"the data set {spec} is empty: it holds no rows")
        total = len(rows)
        rows = rows if samples is None else rows[:samples]
        cols = _columns(rows)
        if text_col in cols:
            tok, source = _tokenizer_and_source(loaded, tokenizer, where)
            max_length = _max_length(loaded, tok, max_length, warns)
            seqs = _encode(tok, _texts(rows, text_col, where, "text"))
            what = f"text column {text_col!r}"
        elif "input_ids" in cols:
            tok = loaded.tokenizer
            seqs = [list(map(int, r["input_ids"])) for r in rows]
            what = "pre-tokenized input_ids"
        else:
            raise MeasureError(
                f"{where} has no text column {text_col!r} and no input_ids (columns: "
                f"{', '.join(cols)}); name the text column with --text-col"
            )
        what = f"{len(rows)} of {total} rows, {what}" if len(rows) < total else what
    if kind != "txt" or txt_mode == "lines":
        too_long = [len(s) for s in seqs if len(s) > max_length]
        if too_long:
            warns.append(
                f"{len(too_long)} of {len(seqs)} document(s) are longer than --max-length "
                f"{max_length} tokens (longest: {max(too_long)}) and were truncated"
            )
        seqs = [s[:max_length] for s in seqs]
    short = sum(len(s) < 2 for s in seqs)
    if short:
        warns.append(
            f"{short} sequence(s) of fewer than 2 tokens were left out: they have no next token "
            "to predict"
        )
        seqs = [s for s in seqs if len(s) >= 2]
    if samples is not None:
        seqs = seqs[:samples]
    if not seqs:
        raise MeasureError(
            f"the data set {spec} is empty: it holds no sequence of 2 tokens or more"
        )
    info = [] if source is None else [tokenizer_line(loaded, tok, source, seqs[:batch_size], where)]
    _check_vocab(loaded, seqs, where)
    pad = _pad_id(tok)
    batches = []
    for s in range(0, len(seqs), batch_size):
        ids, mask = _pad(seqs[s : s + batch_size], pad)
        batches.append(({"input_ids": ids, "attention_mask": mask}, next_token_targets(ids, mask)))
    n_tokens = sum(int((t != IGNORE_INDEX).sum()) for _, t in batches)
    _logits_size(loaded, batches, warns)
    return DataSet(
        batches=batches,
        description=f"{desc}: {len(seqs)} sequence(s) ({what}), {len(batches)} batch(es) of "
        f"≤ {batch_size}, {n_tokens:,} predicted tokens, padded on the right",
        n_samples=len(seqs),
        warnings=warns,
        n_tokens=n_tokens,
        info=info,
        max_length=max_length,
    )


def _decoder_inputs(model: nn.Module) -> Any:
    """A function ``labels → decoder_input_ids`` (the model's own shift right)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    prepare = getattr(inner, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return lambda labels: prepare(labels=labels)
    cfg = getattr(inner, "config", None)
    start = getattr(cfg, "decoder_start_token_id", None)
    pad = getattr(cfg, "pad_token_id", None)
    if start is None:
        raise MeasureError(
            f"{type(inner).__name__} has neither prepare_decoder_input_ids_from_labels nor a "
            "decoder_start_token_id in its config, so the decoder's inputs cannot be made from "
            "the targets; is it an encoder-decoder model (--task)?"
        )

    def shift(labels: Tensor) -> Tensor:
        out = labels.new_full(labels.shape, int(start))
        out[:, 1:] = labels[:, :-1]
        return out.masked_fill(out == IGNORE_INDEX, int(pad if pad is not None else 0))

    return shift


def _pick(cols: list[str], given: str | None, defaults: Sequence[str], other: str | None) -> Any:
    if given is not None:
        return given
    return next((c for c in defaults if c in cols and c != other), None)


def load_seq2seq_data(
    spec: str,
    loaded: LoadedModel,
    *,
    batch_size: int = 128,
    samples: int | None = 1024,
    source_col: str | None = None,
    target_col: str | None = None,
    max_length: int = 128,
    split: str | None = None,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DataSet:
    """Read (source, target) text pairs and cut them into teacher-forced batches.

    Every batch is ``({"input_ids", "attention_mask", "decoder_input_ids"}, labels)``: the
    source padded on the right, the labels the target's token ids with ``-100`` on padding,
    the decoder's inputs the labels shifted right by the model. Rows keep the file's order.

    Args:
        spec: A ``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet`` file or ``datasets`` folder,
            or ``module:function`` returning ``(inputs, targets)`` batches.
        loaded: The model (its tokenizer and decoder).
        batch_size: Pairs per batch.
        samples: Use the first this many pairs (``None``: all).
        source_col: The source column (default: the first of :data:`SOURCE_COLS` there).
        target_col: The target column (default: the first of :data:`TARGET_COLS` there).
        max_length: Longest source and target in tokens; longer ones are truncated.
        split: Split of a ``datasets`` folder.
        tokenizer: A tokenizer folder (default: the model's).
        dtype: Floating tensors of a data function are cast to this dtype.

    Returns:
        A :class:`~geosharp.measuring.data_loading.DataSet` (``n_tokens``: the target tokens).

    Raises:
        MeasureError: On every problem with the data.
    """
    _check_batch_size(batch_size)
    kind = data_kind(spec)
    if kind == "function":
        return _load_function(spec, batch_size, samples, dtype)
    if kind in ("npz", "txt"):
        raise MeasureError(
            f"the seq2seq task reads a table of source and target texts (.jsonl, .json, .csv, "
            f".parquet or a datasets folder), not {Path(spec).suffix or spec}"
        )
    where = Path(spec).expanduser().name
    rows, desc = read_table(spec, split=split, limit=samples)
    if not rows:
        raise MeasureError(f"the data set {spec} is empty: it holds no rows")
    total = len(rows)
    rows = rows if samples is None else rows[:samples]
    cols = _columns(rows)
    src = _pick(cols, source_col, SOURCE_COLS, None)
    tgt = _pick(cols, target_col, TARGET_COLS, src)
    for role, col, defaults in (("source", src, SOURCE_COLS), ("target", tgt, TARGET_COLS)):
        if col is None or col not in cols:
            looked = f"{col!r}" if col is not None else f"(looked for {', '.join(defaults)})"
            raise MeasureError(
                f"{where} has no {role} column {looked} (columns: {', '.join(cols)}); name it "
                f"with --{role}-col"
            )
    tok, source = _tokenizer_and_source(loaded, tokenizer, where)
    warns: list[str] = []
    max_length = _max_length(loaded, tok, max_length, warns)
    sources = _encode(tok, _texts(rows, src, where, "source"))
    try:
        targets = [
            list(ids)
            for ids in tok(
                text_target=_texts(rows, tgt, where, "target"), truncation=False, verbose=False
            )["input_ids"]
        ]
    except MeasureError:
        raise
    except Exception as err:
        raise MeasureError(f"tokenizing the targets failed: {type(err).__name__}: {err}") from err
    for name, seqs in (("source", sources), ("target", targets)):
        long = [len(s) for s in seqs if len(s) > max_length]
        if long:
            warns.append(
                f"{len(long)} of {len(seqs)} {name} text(s) are longer than --max-length "
                f"{max_length} tokens (longest: {max(long)}) and were truncated"
            )
    pairs = [(s[:max_length], t[:max_length]) for s, t in zip(sources, targets, strict=True)]
    empty = sum(not t or not s for s, t in pairs)
    if empty:
        warns.append(f"{empty} row(s) with an empty source or target were left out")
        pairs = [(s, t) for s, t in pairs if s and t]
    if not pairs:
        raise MeasureError(f"the data set {spec} is empty: no row has a source and a target")
    first = [seq for pair in pairs[:batch_size] for seq in pair]
    info = [tokenizer_line(loaded, tok, source, first, where)]
    _check_vocab(loaded, [t for _, t in pairs], where)
    pad = _pad_id(tok)
    shift = _decoder_inputs(loaded.model)
    batches = []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s : s + batch_size]
        ids, mask = _pad([p[0] for p in chunk], pad)
        labels, tmask = _pad([p[1] for p in chunk], pad)
        labels = labels.masked_fill(tmask == 0, IGNORE_INDEX)
        try:
            dec = shift(labels)
        except Exception as err:
            raise MeasureError(
                f"making the decoder's inputs from the targets failed: {type(err).__name__}: {err}"
            ) from err
        batches.append(
            ({"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, labels)
        )
    n_tokens = sum(int((t != IGNORE_INDEX).sum()) for _, t in batches)
    _logits_size(loaded, batches, warns)
    used = f"{len(rows)} of {total} rows (--samples)" if len(rows) < total else f"{total} rows"
    return DataSet(
        batches=batches,
        description=f"{desc}: {used}, source {src!r} → target {tgt!r}, {len(batches)} batch(es) "
        f"of ≤ {batch_size}, {n_tokens:,} target tokens",
        n_samples=len(pairs),
        warnings=warns,
        n_tokens=n_tokens,
        info=info,
        max_length=max_length,
    )
