"""Loading a Hugging Face model folder, or a PEFT adapter folder on its base model.

* :func:`_load_hf` — a folder with ``config.json``, offline, ``attn_implementation="eager"``:
  its own class, a language-model head (``task``), or a fresh classification head;
* :func:`load_peft` — an adapter folder (``adapter_config.json``) on its base model folder: the
  base is frozen, the adapter's weights are the trainable parameters.

Dispatched to by :func:`geosharp.measuring.model_loading.load_model`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from geosharp.measuring.checkpoint_files import (
    _check_weight_files,
    check_safetensors,
    has_tokenizer_files,
)
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.lm_tasks import adapter_base, detect_task, model_class, read_adapter_config
from geosharp.measuring.loaded_model import LoadedModel
from geosharp.models.hf import quiet_transformers

__all__ = ["load_peft"]


def _is_base_architecture(arch: str | None) -> bool:
    """``BertModel``-like (no task head; ``GPT2LMHeadModel`` has one)."""
    return arch is None or (
        arch.endswith("Model") and "For" not in arch and not arch.endswith("LMHeadModel")
    )


def _lm_head(arch: str | None) -> bool:
    """A language-model head (``*ForCausalLM``, ``*LMHeadModel``, ``*ForConditionalGeneration``)."""
    return bool(arch) and arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))


def _load_hf(
    folder: Path,
    *,
    dtype: torch.dtype,
    num_labels: int | None,
    seed: int,
    label2id: Mapping[str, int] | None,
    task: str | None = None,
) -> LoadedModel:
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as err:
        raise MeasureError(
            f"{folder} is a Hugging Face model folder, and loading it needs transformers: "
            "pip install 'geosharp[hf]'"
        ) from err
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:
            raise MeasureError(f"cannot read the config of {folder}: {err}") from err
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else None
    notes = []
    cls = getattr(transformers, arch, None) if arch else None
    fresh_head = False
    kwargs: dict[str, Any] = {"local_files_only": True, "attn_implementation": "eager"}
    kwargs["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    if task in ("causal-lm", "seq2seq"):
        cls = model_class(task, arch)
    elif (
        _is_base_architecture(arch) or cls is None or (task == "classification" and _lm_head(arch))
    ):
        if num_labels is None:
            raise MeasureError(
                f"{folder} holds a model without a task head (architectures: {archs or 'none'}); "
                "pass --num-labels (or give data with a label column) so that a classification "
                "head can be attached"
            )
        cls = AutoModelForSequenceClassification
        kwargs["num_labels"] = num_labels
        if label2id:
            kwargs["label2id"] = dict(label2id)
            kwargs["id2label"] = {v: k for k, v in label2id.items()}
        fresh_head = True
    elif num_labels is not None and num_labels != config.num_labels:
        raise MeasureError(
            f"{folder} has a head with {config.num_labels} labels but {num_labels} were asked "
            "for (--num-labels); drop --num-labels or use a matching checkpoint"
        )
    _check_weight_files(folder)
    torch.manual_seed(seed)  # a fresh head is drawn reproducibly
    with quiet_transformers():
        try:
            model, info = cls.from_pretrained(str(folder), output_loading_info=True, **kwargs)
        except Exception as err:
            if type(err).__name__ == "SafetensorError":
                raise MeasureError(
                    f"a weights file in {folder} is corrupt or truncated: re-save it ({err})"
                ) from err
            raise MeasureError(
                f"cannot load the model in {folder} as {cls.__name__}: {type(err).__name__}: {err}"
            ) from err
    if fresh_head:
        notes.append(
            f"the checkpoint has no classification head (architectures: {archs or 'none'}): "
            f"a fresh head with {num_labels} labels was drawn (seed {seed}), so the measured "
            "sharpness includes a random head"
        )
    elif task in ("causal-lm", "seq2seq") and info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        shown = ", ".join(missing[:4]) + (
            f", … ({len(missing)} in all)" if len(missing) > 4 else ""
        )
        notes.append(
            f"{folder} does not hold every weight of {type(model).__name__} (architectures: "
            f"{archs or 'none'}): {shown} were drawn fresh (seed {seed}), so the measured "
            "sharpness includes random weights"
        )
    if task in ("causal-lm", "seq2seq") and hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # no key/value cache in the outputs: the loss needs none
    tokenizer = None
    if has_tokenizer_files(folder):  # else transformers 5 builds a 5-token one from config.json
        with quiet_transformers():
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            except Exception:
                tokenizer = None
    cfg = model.config
    lm = task in ("causal-lm", "seq2seq")
    regression = not lm and (
        getattr(cfg, "problem_type", None) == "regression" or cfg.num_labels == 1
    )
    return LoadedModel(
        model=model.eval(),
        kind="huggingface",
        name=f"{folder} ({type(model).__name__})",
        tokenizer=tokenizer,
        num_labels=None if regression or lm else int(cfg.num_labels),
        regression=regression,
        label2id={}
        if lm
        else {str(k): int(v) for k, v in (getattr(cfg, "label2id", None) or {}).items()},
        max_positions=getattr(cfg, "max_position_embeddings", None),
        notes=notes,
        task=task or "classification",
        tokenizer_source=f"the model folder {folder}",
    )


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
        task: The task (default: :func:`~geosharp.measuring.lm_tasks.detect_task`).
        num_labels: The classes of a fresh classification head of the base.
        label2id: Names of those classes.
        seed: Seed of fresh weights.

    Returns:
        A :class:`LoadedModel` whose trainable parameters are the
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
