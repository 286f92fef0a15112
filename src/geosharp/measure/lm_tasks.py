"""Which loss a model folder gets (its task), and PEFT adapter folders on their base model.

:func:`detect_task` chooses one of :data:`TASKS` from the folder's config (``--task`` forces
one): a causal language model (``*ForCausalLM``, ``*LMHeadModel``) is ``causal-lm``, an
encoder-decoder (T5, BART) ``seq2seq``, anything else ``classification``; a PEFT adapter folder
says its task in ``adapter_config.json``. :func:`load_peft` loads an adapter
(``adapter_config.json`` + ``adapter_model.safetensors``) on its base model folder: the base is
frozen and the adapter's weights (LoRA A and B) are the trainable parameters, so sharpness is
measured over the adapter alone. The tasks' data are read by :mod:`~geosharp.measure.lm`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from geosharp.measure.errors import MeasureError
from geosharp.measure.model_loading import (
    LoadedModel,
    _load_hf,
    check_safetensors,
    has_tokenizer_files,
)
from geosharp.models.hf import quiet_transformers

__all__ = [
    "TASKS",
    "adapter_base",
    "detect_task",
    "load_peft",
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


# --------------------------------------------------------------------------------------------
# PEFT adapters


def load_peft(
    folder: Path,
    *,
    base: str | Path | None,
    dtype: torch.dtype,
    task: str | None,
    num_labels: int | None = None,
    label2id: dict[str, int] | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load a PEFT adapter folder on its base model: a ``PeftModel``, base frozen.

    Args:
        folder: The adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
        base: The base model folder (default: the adapter config's ``base_model_name_or_path``).
        dtype: Parameter dtype.
        task: The task (default: :func:`detect_task`).
        num_labels: The classes of a fresh classification head of the base.
        label2id: Names of those classes.
        seed: Seed of fresh weights.

    Returns:
        A :class:`~geosharp.measure.model_loading.LoadedModel` whose trainable parameters are the
        adapter's (``kind="peft"``).

    Raises:
        MeasureError: If peft is missing, the base cannot be found, or the adapter does not fit.
    """
    folder = Path(folder).expanduser()
    cfg = read_adapter_config(folder) or {}
    base_folder = adapter_base(folder, cfg, base)
    names = ("adapter_model.safetensors", "adapter_model.bin")
    if not any((folder / n).is_file() for n in names):
        raise MeasureError(
            f"{folder} has adapter_config.json but no adapter weights (adapter_model.safetensors "
            "or adapter_model.bin)"
        )
    if (folder / names[0]).is_file():
        check_safetensors(folder / names[0])
    try:
        import peft
    except ImportError as err:
        raise MeasureError(
            f"{folder} is a PEFT adapter, and loading it needs peft: pip install peft"
        ) from err
    if task is None:
        task = detect_task(str(folder), base=base)[0]
    inner = _load_hf(
        base_folder, dtype=dtype, num_labels=num_labels, seed=seed, label2id=label2id, task=task
    )
    if cfg.get("modules_to_save"):  # the adapter holds the head: it was not left fresh
        inner.notes = [n for n in inner.notes if "fresh head" not in n]
    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = peft.PeftModel.from_pretrained(inner.model, str(folder), is_trainable=True)
        except Exception as err:
            raise MeasureError(
                f"cannot load the adapter {folder} on {base_folder}: {type(err).__name__}: {err}"
            ) from err
    tokenizer = None
    if has_tokenizer_files(folder):
        try:
            from transformers import AutoTokenizer

            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception:
            tokenizer = None
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    n_train = sum(p.numel() for _, p in trainable)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    peft_type = str(cfg.get("peft_type") or type(model.peft_config.get("default")).__name__)
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        targets = ", ".join(sorted(map(str, targets)))
    shape = ", ".join(
        x
        for x in (
            f"r={cfg['r']}" if cfg.get("r") is not None else "",
            f"on {targets}" if targets else "",
        )
        if x
    )
    what = "LoRA A/B" if peft_type.upper() == "LORA" else "adapter weights"
    if any("lora_" not in n for n, _ in trainable) and peft_type.upper() == "LORA":
        what += " and modules_to_save"
    info = [
        f"PEFT {peft_type} adapter{f' ({shape})' if shape else ''} on the base model "
        f"{base_folder} ({type(inner.model).__name__}): sharpness is measured over the "
        f"adapter's {n_train:,} trainable parameters ({what}); the base model's {n_frozen:,} "
        "parameters are frozen"
    ]
    info.append(_frozen_base_note(inner.model, peft_type))
    return LoadedModel(
        model=model.eval(),
        kind="peft",
        name=f"{folder} (PEFT {peft_type} adapter on {base_folder}, {type(inner.model).__name__})",
        tokenizer=tokenizer if tokenizer is not None else inner.tokenizer,
        num_labels=inner.num_labels,
        regression=inner.regression,
        label2id=inner.label2id,
        max_positions=inner.max_positions,
        notes=inner.notes,
        info=[*inner.info, *info],
        task=task,
        tokenizer_source=(
            f"the adapter folder {folder}"
            if tokenizer is not None
            else f"the base model folder {base_folder}"
            if inner.tokenizer is not None
            else f"the adapter folder {folder} nor in the base model folder {base_folder}"
        ),
    )


def _frozen_base_note(base: torch.nn.Module, peft_type: str) -> str:
    """Why the base model's attention symmetries play no part in an adapter's sharpness."""
    rotary = any("rotary" in type(m).__name__.lower() for m in base.modules())
    groups = "the rotary commutant of Q/K and GL(h) of V/O" if rotary else "GL(h) of Q/K and of V/O"
    lora = peft_type.upper() == "LORA"
    return (
        f"note: the frozen base model's attention symmetries ({groups}, per head) are not in "
        "play: only the adapter's weights are perturbed, and such a group element would have "
        "to move the frozen base weights W_q, W_k, W_v, W_o too (in general a rank-r update "
        "cannot absorb it), so it is no symmetry of the adapter's parameters"
        + (
            "; what is quotiented is GL(r) of each LoRA pair, (B M⁻¹, M A), which leaves B A "
            "unchanged"
            if lora
            else ""
        )
    )
