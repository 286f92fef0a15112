"""The tokenizer of text data: which one, checked against the model, and what it makes of the text.

* :func:`_tokenizer_and_source` — ``--tokenizer`` or the model's own; a folder without a
  tokenizer file, or a tokenizer that does not fit the model's embedding table
  (:data:`MIN_VOCAB_COVERAGE`, :func:`_check_fit`), is refused;
* :func:`tokenizer_line` — the line saying which tokenizer is used; text that is mostly the
  unknown token is refused;
* :func:`_max_length` — ``--max-length`` capped to what the model accepts.

Used by :mod:`geosharp.measuring.data_loading` (classification text) and
:mod:`geosharp.measuring.lm` (language-model and sequence-to-sequence text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from geosharp.measuring.errors import MeasureError
from geosharp.measuring.loaded_model import LoadedModel
from geosharp.models.hf import quiet_transformers

__all__ = ["MIN_VOCAB_COVERAGE", "tokenizer_line"]


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
