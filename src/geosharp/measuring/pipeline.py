"""From files to a model ready to measure: the one path of ``geosharp measure`` and populations.

:func:`load_for_measure` takes a model as ``geosharp measure`` names it (:class:`ModelSource`:
a Hugging Face or PEFT folder, a ``torch.save`` file, ``module:function`` with weights) and the
data options (:class:`MeasureOptions`), and returns the model with its batches and loss
(:class:`ReadyModel`): the task detected, the labels read once, the model loaded (with a fresh
head sized from the labels where it has none), the tokenizer checked, the batches built, and
the weights whose ``1/w²`` overflows flushed. ``geosharp measure`` runs it once; a population
study (:mod:`geosharp.studies.population`) runs it for every model of its manifest, so every
model is loaded, tokenized and checked the same way.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geosharp.measuring.errors import MeasureError

__all__ = ["MeasureOptions", "ModelSource", "ReadyModel", "load_for_measure", "options_from_args"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class ModelSource:
    """A model as ``geosharp measure`` names it.

    Attributes:
        model: A Hugging Face folder, a PEFT adapter folder, a ``torch.save`` file or
            ``module:function``.
        weights: The weights of a ``module:function`` model (a state dict file).
        base: The base model of a PEFT adapter (default: the adapter's config names it).
    """

    model: str
    weights: str | None = None
    base: str | None = None


@dataclass(frozen=True)
class MeasureOptions:
    """How the data of ``geosharp measure`` are read (its options of the same names)."""

    data: str
    task: str = "auto"
    tokenizer: str | None = None
    text_col: str = "text"
    label_col: str | None = None
    source_col: str | None = None
    target_col: str | None = None
    txt_mode: str = "lines"
    split: str | None = None
    batch_size: int = 128
    samples: int | None = 1024
    max_length: int = 128
    num_labels: int | None = None
    seed: int = 0
    loss: str | None = "auto"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    #: Parameter-name patterns (``fnmatch``) left out of the measurement (``--freeze``).
    freeze: tuple[str, ...] = ()


def options_from_args(args: argparse.Namespace) -> MeasureOptions:
    """The :class:`MeasureOptions` of parsed ``geosharp measure`` (or study) arguments."""
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    return MeasureOptions(
        data=args.data,
        task=args.task,
        tokenizer=args.tokenizer,
        text_col=args.text_col,
        label_col=args.label_col,
        source_col=args.source_col,
        target_col=args.target_col,
        txt_mode=args.txt_mode,
        split=args.split,
        batch_size=args.batch_size,
        samples=None if args.samples == 0 else args.samples,
        max_length=args.max_length,
        num_labels=args.num_labels,
        seed=args.seed,
        loss=args.loss,
        device=resolve_device(args.device),
        dtype=resolve_dtype(args.dtype),
        freeze=tuple(getattr(args, "freeze", None) or ()),
    )


@dataclass
class ReadyModel:
    """A model loaded for measuring, with its batches and loss (:func:`load_for_measure`)."""

    source: ModelSource
    options: MeasureOptions
    task: str
    task_reason: str
    loaded: Any
    data: Any
    loss: Any
    flushed: dict[str, int]

    @property
    def model(self) -> torch.nn.Module:
        """The model."""
        return self.loaded.model

    @property
    def batches(self) -> list[tuple[Any, Any]]:
        """The batches it is measured on."""
        return self.data.batches

    @property
    def warnings(self) -> list[str]:
        """What the loading had to say (notes of the model and the data, flushed weights)."""
        flushed = (
            [
                f"{sum(self.flushed.values())} weight(s) with 1/w² overflowing "
                f"{self.options.dtype} were set to 0".replace("torch.", "")
            ]
            if self.flushed
            else []
        )
        return [*self.loaded.notes, *self.data.warnings, *flushed]

    def settings(self) -> dict[str, Any]:
        """What a result file records of the model, the task and the data."""
        data, loaded = self.data, self.loaded
        return {
            "model": loaded.name,
            "model_kind": loaded.kind,
            "task": self.task,
            "task_reason": self.task_reason,
            "weights": self.source.weights,
            "data": data.description,
            "batch_size": self.options.batch_size,
            "samples": data.n_samples,
            "max_length": self.options.max_length if data.max_length is None else data.max_length,
            **({"freeze": list(self.options.freeze)} if self.options.freeze else {}),
            **({"n_tokens": data.n_tokens} if data.n_tokens is not None else {}),
            **({"label_map": data.label_map} if data.label_map else {}),
            **({"model_info": loaded.info} if loaded.info else {}),
        }


def load_for_measure(
    source: ModelSource,
    opts: MeasureOptions,
    *,
    say: Say | None = None,
    warn: Say | None = None,
) -> ReadyModel:
    """Load a model and its data the way ``geosharp measure`` does.

    Every check that can fail runs before the heavy work that follows it: the loss name, the
    model's files, the task, the label column, then the model, the tokenizer and the batches.

    Args:
        source: The model.
        opts: The data options.
        say: Where progress lines go (default: nowhere).
        warn: Where warnings go (default: nowhere; they are in :attr:`ReadyModel.warnings`).

    Returns:
        The :class:`ReadyModel`.

    Raises:
        MeasureError: On any bad input, with one line that says what to do.
    """
    from geosharp.measuring.lm_tasks import detect_task
    from geosharp.measuring.model_loading import check_model_spec

    say = say or (lambda _msg: None)
    warn = warn or (lambda _msg: None)
    loss = _loss(opts.loss)  # fail on an unknown name before loading anything
    check_model_spec(source.model)  # before reading any data
    task, why = detect_task(source.model, base=source.base, forced=opts.task)
    if task != "classification" and isinstance(loss, str) and loss.strip().lower() == "mse":
        raise MeasureError(f"--loss mse does not fit the {task} task (a cross-entropy over tokens)")
    say(f"task: {task} ({why})")
    table, num_labels, label2id = _read_labels(source, opts, task)
    loaded = _load_model(
        source, opts, task, num_labels=num_labels, label2id=label2id, say=say, warn=warn
    )
    freeze(loaded.model, opts.freeze, say)  # a pattern matching nothing fails before the data
    data = _load_batches(opts, task, loaded, table, say, warn)
    flushed = _flush_unrepresentable(loaded.model, opts.dtype, warn)
    return ReadyModel(
        source=source,
        options=opts,
        task=task,
        task_reason=why,
        loaded=loaded,
        data=data,
        loss=loss,
        flushed=flushed,
    )


def freeze(model: torch.nn.Module, patterns: Sequence[str], say: Say | None = None) -> int:
    """Leave the parameters whose names match a pattern out of the measurement.

    Each ``fnmatch`` pattern (``"*embeddings*"``, ``"bert.encoder.layer.0.*"``) turns
    ``requires_grad`` off for the parameters it matches, so every measure perturbs only the
    others and lists these as excluded (what a frozen part of a fine-tune is).

    Args:
        model: The model (its parameters' ``requires_grad`` flags are changed).
        patterns: The patterns; each must match at least one parameter name.
        say: Where the count goes (default: nowhere).

    Returns:
        The number of weights frozen.

    Raises:
        MeasureError: If a pattern matches no parameter, or every trainable one is frozen.
    """
    if not patterns:
        return 0
    params = dict(model.named_parameters())
    names = list(params)
    hit: dict[str, torch.nn.Parameter] = {}
    for pat in patterns:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not matched:
            raise MeasureError(
                f"--freeze {pat!r} matches no parameter of the model; its parameters are named "
                f"like {', '.join(names[:3])}{', …' if len(names) > 3 else ''}"
            )
        hit.update((n, params[n]) for n in matched)
    if not any(p.requires_grad for n, p in params.items() if n not in hit):
        raise MeasureError("--freeze leaves no trainable parameter to measure")
    n = 0
    for p in hit.values():
        n += p.numel() if p.requires_grad else 0
        p.requires_grad_(False)
    if say is not None:
        say(f"frozen by --freeze: {len(hit)} parameter tensor(s), {n:,} weights")
    return n


# --------------------------------------------------------------------------------------------
# the steps of load_for_measure


def _loss(spec: str | None) -> Any:
    """``--loss``: a name (checked now) or ``module:function`` (imported now)."""
    from geosharp.measuring.losses import resolve_loss
    from geosharp.measuring.resolve import import_callable

    if spec not in (None, "auto") and ":" in spec:
        return import_callable(spec, "loss function")
    resolve_loss(spec)
    return spec


def _needs_head(model_spec: str, task: str = "classification") -> bool:
    """Whether ``model_spec`` is a Hugging Face folder without a head for ``task``."""
    from geosharp.measuring.hf_loading import _is_base_architecture, _lm_head

    cfg = Path(model_spec).expanduser() / "config.json"
    if not cfg.is_file():
        return False
    try:
        archs = json.loads(cfg.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as err:
        raise MeasureError(f"cannot read {cfg}: {err}") from err
    arch = archs[0] if archs else None
    return _is_base_architecture(arch) or (task == "classification" and _lm_head(arch))


def _read_labels(source: ModelSource, opts: MeasureOptions, task: str) -> tuple:
    """A classification table read once: ``(table, num_labels, label2id)`` for a fresh head.

    The label column is checked first, so a missing one is named before a missing task head.
    """
    from geosharp.measuring.data_files import _columns, data_kind, infer_num_labels, read_table

    table, rows = None, None
    num_labels, label2id = opts.num_labels, None
    kind = data_kind(opts.data)  # a missing data path fails here, before the model loads
    if task == "classification" and kind in (
        "csv",
        "jsonl",
        "json",
        "parquet",
        "hf_dataset",
        "txt",
    ):
        table = read_table(opts.data, split=opts.split, limit=opts.samples)
        rows = table[0]
        if not rows:
            raise MeasureError(f"the data set {opts.data} is empty: it holds no rows")
        col = opts.label_col or "label"
        cols = _columns(rows)
        if col not in cols:  # say so first, before "no task head" or anything else
            raise MeasureError(
                f"{Path(opts.data).name} has no label column {col!r} (columns: "
                f"{', '.join(cols)}); name it with --label-col"
                + (
                    ", or measure a language-model loss with --task causal-lm or seq2seq"
                    if opts.label_col is None
                    else ""
                )
            )
    if _needs_head(source.model, task) and num_labels is None and rows is not None:
        col = opts.label_col or "label"
        values = [r.get(col) for r in rows[: opts.samples] if r.get(col) not in (None, "")]
        if values:
            num_labels, label2id = infer_num_labels(values)
    return table, num_labels, label2id


def _load_model(
    source: ModelSource,
    opts: MeasureOptions,
    task: str,
    *,
    num_labels: int | None,
    label2id: dict[str, int] | None,
    say: Say,
    warn: Say,
) -> Any:
    """The :class:`~geosharp.measuring.model_loading.LoadedModel`, its notes and size said."""
    from geosharp.measuring.model_loading import load_model

    loaded = load_model(
        source.model,
        weights=source.weights,
        device=opts.device,
        dtype=opts.dtype,
        num_labels=num_labels,
        label2id=label2id,
        seed=opts.seed,
        task=task,
        base=source.base,
    )
    for note in loaded.notes:
        warn(note)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    n_train = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
    trainable = f" ({n_train:,} trainable)" if n_train != n_params else ""
    say(
        f"model: {loaded.name}, {n_params:,} parameters{trainable}, {opts.dtype} on "
        f"{opts.device}".replace("torch.", "")
    )
    for line in loaded.info:
        say(line)
    return loaded


def _label_map_line(label_map: dict[str, int]) -> str:
    shown = ", ".join(f"{k!r} → {v}" for k, v in list(label_map.items())[:20])
    more = f", … ({len(label_map)} in all)" if len(label_map) > 20 else ""
    return f"labels: text labels mapped to class ids: {shown}{more}"


def _load_batches(
    opts: MeasureOptions, task: str, loaded: Any, table: Any, say: Say, warn: Say
) -> Any:
    """The :class:`~geosharp.measuring.data_loading.DataSet` of the task, its warnings said."""
    from geosharp.measuring.data_loading import DataOptions, read_data
    from geosharp.measuring.lm import load_lm_data, load_seq2seq_data

    common = {
        "batch_size": opts.batch_size,
        "samples": opts.samples,
        "max_length": opts.max_length,
        "split": opts.split,
        "tokenizer": opts.tokenizer,
        "dtype": opts.dtype,
    }
    if task == "causal-lm":
        data = load_lm_data(
            opts.data, loaded, text_col=opts.text_col, txt_mode=opts.txt_mode, **common
        )
    elif task == "seq2seq":
        data = load_seq2seq_data(
            opts.data, loaded, source_col=opts.source_col, target_col=opts.target_col, **common
        )
    else:
        options = DataOptions(text_col=opts.text_col, label_col=opts.label_col, **common)
        data = read_data(opts.data, loaded, options, table=table)
    for w in data.warnings:
        warn(w)
    say(f"data: {data.description}")
    for line in data.info:
        say(line)
    if data.label_map:
        say(_label_map_line(data.label_map))
    return data


def _flush_unrepresentable(model: Any, dtype: Any, warn: Say) -> dict[str, int]:
    """Set the weights whose ``1/w²`` overflows to 0, in place, with a warning."""
    from geosharp.measuring.checks import flush_unrepresentable

    flushed = flush_unrepresentable(model)
    if flushed:
        where = ", ".join(f"{k} ({v})" for k, v in list(flushed.items())[:4])
        warn(
            f"{sum(flushed.values())} weight(s) are so small that 1/w² overflows {dtype} "
            f"({where}); they were set to 0, which freezes them in the adaptive ball (its radius "
            "ρ|w| was below 1e-19 there anyway)".replace("torch.", "")
        )
    return flushed
