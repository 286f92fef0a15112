"""Which loss a model folder gets (its task), and which class and base model load it.

:func:`detect_task` chooses one of :data:`TASKS` from the folder's config (``--task`` forces
one): a causal language model (``*ForCausalLM``, ``*LMHeadModel``) is ``causal-lm``, an
encoder-decoder (T5, BART) ``seq2seq``, anything else ``classification``; a PEFT adapter folder
says its task in ``adapter_config.json`` (:func:`read_adapter_config`), and names its base
model folder (:func:`adapter_base`). :func:`model_class` is the ``transformers`` class a folder
is loaded with for a task. This module reads configs only: loading the model, a PEFT adapter
included, is :mod:`~geosharp.measuring.model_loading`'s; the tasks' data are read by
:mod:`~geosharp.measuring.lm`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from geosharp.measuring.errors import MeasureError
from geosharp.models.hf import quiet_transformers

__all__ = [
    "TASKS",
    "adapter_base",
    "detect_task",
    "model_class",
    "read_adapter_config",
]

#: The tasks of ``geosharp measure --task`` (``auto`` chooses one of them).
TASKS = ("classification", "causal-lm", "seq2seq")
_PEFT_TASKS = {"CAUSAL_LM": "causal-lm", "SEQ_2_SEQ_LM": "seq2seq", "SEQ_CLS": "classification"}
_CLASSIFIER = re.compile(
    r"For(SequenceClassification|TokenClassification|QuestionAnswering|MultipleChoice)$"
)


def _is_causal_lm(arch: str | None) -> bool:
    return bool(arch) and (arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"))


def model_class(task: str, arch: str | None) -> Any:
    """The ``transformers`` class to load a folder with for ``task`` (its own, if it fits).

    Args:
        task: ``"causal-lm"`` or ``"seq2seq"``.
        arch: The first entry of the config's ``architectures``.

    Returns:
        A class with ``from_pretrained``.
    """
    import transformers

    cls = getattr(transformers, arch, None) if arch else None
    if task == "causal-lm":
        fits = _is_causal_lm(arch) or (arch or "").endswith("ForConditionalGeneration")
        return cls if cls is not None and fits else transformers.AutoModelForCausalLM
    if cls is not None and (arch or "").endswith("ForConditionalGeneration"):
        return cls
    return transformers.AutoModelForSeq2SeqLM


# --------------------------------------------------------------------------------------------
# which task


def read_adapter_config(folder: str | Path) -> dict[str, Any] | None:
    """The ``adapter_config.json`` of a PEFT adapter folder (``None`` if it is none).

    Raises:
        MeasureError: If the file is there but unreadable.
    """
    path = Path(folder).expanduser() / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise MeasureError(f"cannot read {path}: {err}") from err
    if not isinstance(cfg, dict):
        raise MeasureError(f"{path} is not a JSON object")
    return cfg


def adapter_base(folder: str | Path, adapter: dict[str, Any], base: str | Path | None) -> Path:
    """The base model folder of a PEFT adapter: ``base``, or the config's base model.

    A relative ``base_model_name_or_path`` is looked up from the current folder, then from the
    adapter's folder. Nothing is downloaded.

    Raises:
        MeasureError: If it names no local model folder.
    """
    folder = Path(folder).expanduser()
    spec = base if base is not None else adapter.get("base_model_name_or_path")
    origin = "--base" if base is not None else "base_model_name_or_path in adapter_config.json"
    if not spec:
        raise MeasureError(
            f"{folder / 'adapter_config.json'} names no base model (base_model_name_or_path); "
            "pass the base model's folder with --base PATH"
        )
    path = Path(str(spec)).expanduser()
    if not path.is_absolute() and not path.exists() and (folder / path).exists():
        path = folder / path
    if not (path / "config.json").is_file():
        raise MeasureError(
            f"the base model of the adapter {folder}, {str(spec)!r} ({origin}), is not a local "
            "model folder with config.json (nothing is downloaded); pass the base model's "
            "folder with --base PATH"
        )
    return path


def _config(folder: Path) -> tuple[list[str], bool]:
    """``(architectures, is_encoder_decoder)`` of a model folder."""
    try:
        from transformers import AutoConfig

        with quiet_transformers():
            cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return list(getattr(cfg, "architectures", None) or []), bool(cfg.is_encoder_decoder)
    except Exception:  # an unknown model type: read the JSON itself
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise MeasureError(f"cannot read {path}: {err}") from err
        return list(raw.get("architectures") or []), bool(raw.get("is_encoder_decoder"))


def detect_task(
    spec: str, *, base: str | Path | None = None, forced: str | None = None
) -> tuple[str, str]:
    """Which task to measure ``spec`` with, and why.

    ``forced`` (``--task``) wins. A PEFT adapter's ``task_type`` comes next, then the model
    folder's (or the adapter's base model's) config: an ``architectures`` class ending in
    ``ForCausalLM`` or ``LMHeadModel`` is a causal LM; an encoder-decoder config
    (``is_encoder_decoder``, e.g. ``T5ForConditionalGeneration``) is seq2seq; a decoder-only
    ``*ForConditionalGeneration`` is a causal LM; anything else (a classification head, a bare
    encoder, a model that is not a Hugging Face folder) is classification.

    Args:
        spec: The model (as ``geosharp measure`` takes it).
        base: ``--base``, the base model folder of an adapter.
        forced: ``--task``: one of :data:`TASKS`, or ``"auto"``/``None``.

    Returns:
        ``(task, reason)``, the reason a short phrase.

    Raises:
        MeasureError: On an unknown task, or an adapter whose base model cannot be found.

    Example:
        >>> detect_task("mypkg.models:build")
        ('classification', 'not a Hugging Face model folder: the loss comes from the targets')
    """
    if forced not in (None, "auto"):
        if forced not in TASKS:
            raise MeasureError(f"unknown --task {forced!r}: use auto, {', '.join(TASKS)}")
        return forced, f"--task {forced}"
    path = Path(spec).expanduser()
    if not path.is_dir():
        return "classification", "not a Hugging Face model folder: the loss comes from the targets"
    adapter = read_adapter_config(path)
    prefix = ""
    if adapter is not None:
        task_type = adapter.get("task_type")
        if task_type in _PEFT_TASKS:
            return _PEFT_TASKS[task_type], f"the adapter's task_type {task_type}"
        path = adapter_base(path, adapter, base)
        prefix = f"the adapter's base model {path}: "
    elif not (path / "config.json").is_file():
        return "classification", "no config.json"
    archs, enc_dec = _config(path)
    arch = archs[0] if archs else None
    if arch and _CLASSIFIER.search(arch):
        return "classification", f"{prefix}config architectures {arch}, a classification head"
    if _is_causal_lm(arch):
        return "causal-lm", f"{prefix}config architectures {arch}, a causal language model"
    if enc_dec:
        return "seq2seq", f"{prefix}config architectures {arch or 'none'}, an encoder-decoder"
    if arch and arch.endswith("ForConditionalGeneration"):
        return "causal-lm", f"{prefix}config architectures {arch}, a decoder-only generator"
    return (
        "classification",
        f"{prefix}config architectures {arch or 'none'}, neither a causal language model nor "
        "an encoder-decoder (--task causal-lm or seq2seq measures a language-model loss)",
    )
