"""The files of a checkpoint: weight files checked before loading, a state dict into a model.

A ``.safetensors`` file is checked from its header (:func:`check_safetensors`: a truncated or
corrupt file is one line, not a ``SafetensorError``); a state dict (``.pt``/``.pth``/``.bin`` or
``.safetensors``) is loaded into a built model with its keys and shapes compared first
(:func:`load_state_dict`); a folder holds a tokenizer only if it has one of
:data:`TOKENIZER_FILES` (:func:`has_tokenizer_files`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measuring.errors import MeasureError

__all__ = ["TOKENIZER_FILES", "check_safetensors", "has_tokenizer_files", "load_state_dict"]

#: A folder holds a tokenizer if it has one of these files (or a ``*.model``/``*.spm``
#: SentencePiece or ``*.tiktoken`` file). Without one, ``AutoTokenizer`` of transformers 5 still
#: returns a tokenizer built from ``config.json`` alone — a ``BertTokenizer`` of its 5 special
#: tokens, which turns every word into ``[UNK]`` — so it is never asked for one.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)
_TOKENIZER_SUFFIXES = (".model", ".spm", ".tiktoken")


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds a tokenizer file (:data:`TOKENIZER_FILES`, SentencePiece, ...).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> has_tokenizer_files(d)
        False
        >>> _ = (d / "tokenizer.json").write_text("{}")
        >>> has_tokenizer_files(d)
        True
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return False
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return True
    return any(p.suffix in _TOKENIZER_SUFFIXES and p.is_file() for p in folder.iterdir())


def _corrupt(path: Path, why: str) -> MeasureError:
    return MeasureError(f"the weights file {path} is corrupt or truncated: re-save it ({why})")


def check_safetensors(path: str | Path) -> None:
    """Raise a one-line error if a ``.safetensors`` file is truncated or its header is corrupt.

    Reads the header only (8 bytes of length, then JSON): the tensors it describes must end
    exactly where the file does, as the safetensors library itself requires, so a file cut
    short by a full disk or an interrupted copy is named, with what to do, before any loading.

    Raises:
        MeasureError: ``the weights file PATH is corrupt or truncated: re-save it (...)``.
    """
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"it is {size:,} bytes long, shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise _corrupt(
                    path, f"its header says {n:,} header bytes, but the file has {size:,} bytes"
                )
            raw = fh.read(n)
    except OSError as err:
        raise MeasureError(f"cannot read the weights file {path}: {err.strerror or err}") from err
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        ends = [
            int(v["data_offsets"][1])
            for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict)
        ]
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as err:
        raise _corrupt(path, f"its header cannot be read: {err}") from err
    data = size - 8 - n
    end = max(ends, default=0)
    if end != data:
        raise _corrupt(
            path,
            f"its header describes {end:,} bytes of tensors, the file holds {data:,}",
        )


def _check_weight_files(folder: Path) -> None:
    """:func:`check_safetensors` for every ``*.safetensors`` file of a model folder."""
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path)


def _state_dict_from(obj: Any, path: Path) -> dict[str, Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model_state_dict", "model"):
            inner = obj.get(key)
            if (
                isinstance(inner, Mapping)
                and inner
                and all(isinstance(v, Tensor) for v in inner.values())
            ):
                return dict(inner)
        if obj and all(isinstance(v, Tensor) for v in obj.values()):
            return dict(obj)
    raise MeasureError(
        f"{path} holds no state dict (a mapping from parameter names to tensors, or a dict with "
        f"one under 'state_dict'), but a {type(obj).__name__}"
    )


def load_state_dict(model: nn.Module, path: str | Path) -> list[str]:
    """Load a state dict file into ``model``, strictly, with a readable error on mismatch.

    A ``module.`` prefix on every key (``nn.DataParallel``) is removed.

    Args:
        model: The model.
        path: ``.safetensors`` or anything ``torch.load(weights_only=True)`` reads.

    Returns:
        Notes on what was done.

    Raises:
        MeasureError: If the file is missing or unreadable, or its keys or shapes do not match.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MeasureError(f"weights file not found: {path}")
    notes = []
    if path.suffix == ".safetensors":
        check_safetensors(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise MeasureError(
            f"cannot read the weights {path}: {type(err).__name__}: {err}. A state dict is "
            "expected (torch.save(model.state_dict(), path) or a .safetensors file)"
        ) from err
    sd = _state_dict_from(obj, path)
    expected = model.state_dict()
    if (
        sd
        and all(k.startswith("module.") for k in sd)
        and not any(k.startswith("module.") for k in expected)
    ):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
        notes.append(f"removed the prefix 'module.' from the keys of {path.name}")
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or shapes:

        def few(keys: Sequence[str]) -> str:
            return ", ".join(keys[:5]) + (f", … ({len(keys)} in all)" if len(keys) > 5 else "")

        parts = []
        if missing:
            parts.append(
                f"{len(missing)} key(s) of the model missing from the checkpoint: {few(missing)}"
            )
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected key(s) in the checkpoint: {few(unexpected)}"
            )
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es): {few(shapes)}")
        raise MeasureError(
            f"the weights {path} do not match the model: "
            + "; ".join(parts)
            + ". Check that the function builds the architecture the weights were saved from"
        )
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
    return notes
