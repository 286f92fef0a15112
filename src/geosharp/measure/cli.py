"""``geosharp measure MODEL DATA``: loading (:mod:`~geosharp.measure.loading`), then measuring.

:func:`add_parser` adds the subcommand to the ``geosharp`` parser and :func:`run` executes it;
every error a user can cause ends as ``geosharp: error: ...`` on stderr and exit status 2,
an operating system's error during the work (disk full, ...) as one such line and exit status
1, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from geosharp._io import OutputFolderError, ensure_writable_dir, os_error_line, os_error_status
from geosharp.measure.cli_parser import add_parser as add_parser
from geosharp.measure.core import (
    DEFAULT_MEASURES,
    DEFAULT_RHOS,
    MeasureError,
    measure,
)

__all__ = ["add_parser", "check_out_dir", "run"]


def _warn(msg: str) -> None:
    print(f"geosharp: warning: {msg}", file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _validate(args: argparse.Namespace) -> None:
    """Fail on a bad option before anything is loaded (the measures are parsed here too)."""
    from geosharp.measure.names import parse_measure

    for text in args.measures or ():
        parse_measure(text)
    if args.steps < 1:
        raise MeasureError(f"--steps must be >= 1, got {args.steps}")
    if args.iters < 1:
        raise MeasureError(f"--iters must be >= 1, got {args.iters}")
    if args.probes < 1:
        raise MeasureError(f"--probes must be >= 1, got {args.probes}")
    if args.batch_size < 1:
        raise MeasureError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.samples < 0:
        raise MeasureError(f"--samples must be >= 0 (0: all), got {args.samples}")
    if args.max_length < 1:
        raise MeasureError(f"--max-length must be >= 1, got {args.max_length}")
    if args.rho is not None and any(not r > 0 for r in args.rho):
        raise MeasureError(f"--rho values must be > 0, got {args.rho}")
    if args.num_labels is not None and args.num_labels < 1:
        raise MeasureError(f"--num-labels must be >= 1, got {args.num_labels}")
    if args.eps < 0:
        raise MeasureError(f"--eps must be >= 0, got {args.eps}")
    if args.threads is not None and args.threads < 1:
        raise MeasureError(f"--threads must be >= 1, got {args.threads}")


def _needs_head(model_spec: str, task: str = "classification") -> bool:
    """Whether ``model_spec`` is a Hugging Face folder without a head for ``task``."""
    from geosharp.measure.model_loading import _is_base_architecture, _lm_head

    cfg = Path(model_spec).expanduser() / "config.json"
    if not cfg.is_file():
        return False
    try:
        archs = json.loads(cfg.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as err:
        raise MeasureError(f"cannot read {cfg}: {err}") from err
    arch = archs[0] if archs else None
    return _is_base_architecture(arch) or (task == "classification" and _lm_head(arch))


def check_out_dir(out: Path) -> None:
    """Fail at once, in one line, if the output folder cannot be created or written to.

    Creates the folder (and its parents) and writes and removes a temporary file in it
    (:func:`geosharp._io.ensure_writable_dir`, the check of every command), so a run that would
    measure for minutes and then fail to write its results fails before any work instead.

    Raises:
        MeasureError: If the folder cannot be created or a file cannot be written in it.
    """
    try:
        ensure_writable_dir(out, "--out")
    except OutputFolderError as err:
        raise MeasureError(str(err)) from err


def _label_map_line(label_map: dict[str, int]) -> str:
    shown = ", ".join(f"{k!r} → {v}" for k, v in list(label_map.items())[:20])
    more = f", … ({len(label_map)} in all)" if len(label_map) > 20 else ""
    return f"labels: text labels mapped to class ids: {shown}{more}"


def _execute(args: argparse.Namespace) -> int:
    import torch

    from geosharp.measure.lm_tasks import detect_task
    from geosharp.measure.model_loading import check_model_spec
    from geosharp.measure.resolve import resolve_device, resolve_dtype

    _validate(args)
    check_out_dir(args.out)  # before any work: a read-only --out fails now, not after measuring
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    samples = None if args.samples == 0 else args.samples
    loss = _loss(args.loss)  # fail on an unknown name before loading anything

    check_model_spec(args.model)  # before reading any data
    task, why = detect_task(args.model, base=args.base, forced=args.task)
    if task != "classification" and isinstance(loss, str) and loss.strip().lower() == "mse":
        raise MeasureError(f"--loss mse does not fit the {task} task (a cross-entropy over tokens)")
    _say(f"task: {task} ({why})")
    table, num_labels, label2id = _read_labels(args, task, samples)
    loaded = _load_model(args, task, device, dtype, num_labels, label2id)
    data = _load_batches(args, task, loaded, table, samples, dtype)
    flushed = _flush_unrepresentable(loaded.model, dtype)

    report = measure(
        loaded.model,
        data.batches,
        loss,
        measures=args.measures or list(DEFAULT_MEASURES),
        rhos=args.rho or list(DEFAULT_RHOS),
        steps=args.steps,
        eps=args.eps,
        seed=args.seed,
        iters=args.iters,
        probes=args.probes,
        trace_method=args.trace_method,
        check=not args.no_check,
        low_memory=args.low_memory,
        buffer_budget=args.buffer_budget,
        progress=False if args.no_progress else None,
        log=_say,
        warn=_warn,
    )
    report.warnings[:0] = [*loaded.notes, *data.warnings] + (
        [f"{sum(flushed.values())} weight(s) with 1/w² overflowing {dtype} were set to 0"]
        if flushed
        else []
    )
    report.settings = {
        "model": loaded.name,
        "model_kind": loaded.kind,
        "task": task,
        "task_reason": why,
        "weights": args.weights,
        "data": data.description,
        "batch_size": args.batch_size,
        "samples": data.n_samples,
        "max_length": args.max_length,
        **({"n_tokens": data.n_tokens} if data.n_tokens is not None else {}),
        **({"label_map": data.label_map} if data.label_map else {}),
        **({"model_info": loaded.info} if loaded.info else {}),
        **report.settings,
    }
    if not torch.cuda.is_available() and device.type == "cpu":
        report.settings["threads"] = torch.get_num_threads()
    _write(report, args)
    if report.failed:
        _warn(f"{len(report.failed)} measurement(s) failed; see the table")
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# the steps of _execute


def _loss(spec: str | None) -> Any:
    """``--loss``: a name (checked now) or ``module:function`` (imported now)."""
    from geosharp.measure.losses import resolve_loss
    from geosharp.measure.resolve import import_callable

    if spec not in (None, "auto") and ":" in spec:
        return import_callable(spec, "loss function")
    resolve_loss(spec)
    return spec


def _read_labels(args: argparse.Namespace, task: str, samples: int | None) -> tuple:
    """A classification table read once: ``(table, num_labels, label2id)`` for a fresh head.

    The label column is checked first, so a missing one is named before a missing task head.
    """
    from geosharp.measure.data_files import _columns, data_kind, infer_num_labels, read_table

    table, rows = None, None
    num_labels, label2id = args.num_labels, None
    kind = data_kind(args.data)  # a missing data path fails here, before the model loads
    if task == "classification" and kind in (
        "csv",
        "jsonl",
        "json",
        "parquet",
        "hf_dataset",
        "txt",
    ):
        table = read_table(args.data, split=args.split, limit=samples)
        rows = table[0]
        if not rows:
            raise MeasureError(f"the data set {args.data} is empty: it holds no rows")
        col = args.label_col or "label"
        cols = _columns(rows)
        if col not in cols:  # say so first, before "no task head" or anything else
            raise MeasureError(
                f"{Path(args.data).name} has no label column {col!r} (columns: "
                f"{', '.join(cols)}); name it with --label-col"
                + (
                    ", or measure a language-model loss with --task causal-lm or seq2seq"
                    if args.label_col is None
                    else ""
                )
            )
    if _needs_head(args.model, task) and num_labels is None and rows is not None:
        col = args.label_col or "label"
        values = [r.get(col) for r in rows[:samples] if r.get(col) not in (None, "")]
        if values:
            num_labels, label2id = infer_num_labels(values)
    return table, num_labels, label2id


def _load_model(
    args: argparse.Namespace,
    task: str,
    device: Any,
    dtype: Any,
    num_labels: int | None,
    label2id: dict[str, int] | None,
) -> Any:
    """The :class:`~geosharp.measure.model_loading.LoadedModel`, its notes and size said."""
    from geosharp.measure.model_loading import load_model

    loaded = load_model(
        args.model,
        weights=args.weights,
        device=device,
        dtype=dtype,
        num_labels=num_labels,
        label2id=label2id,
        seed=args.seed,
        task=task,
        base=args.base,
    )
    for note in loaded.notes:
        _warn(note)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    n_train = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
    trainable = f" ({n_train:,} trainable)" if n_train != n_params else ""
    _say(
        f"model: {loaded.name}, {n_params:,} parameters{trainable}, {dtype} on {device}".replace(
            "torch.", ""
        )
    )
    for line in loaded.info:
        _say(line)
    return loaded


def _load_batches(
    args: argparse.Namespace, task: str, loaded: Any, table: Any, samples: int | None, dtype: Any
) -> Any:
    """The :class:`~geosharp.measure.data_loading.DataSet` of the task, its warnings said."""
    from geosharp.measure.data_loading import load_data
    from geosharp.measure.lm import load_lm_data, load_seq2seq_data

    common = {
        "batch_size": args.batch_size,
        "samples": samples,
        "max_length": args.max_length,
        "split": args.split,
        "tokenizer": args.tokenizer,
        "dtype": dtype,
    }
    if task == "causal-lm":
        data = load_lm_data(
            args.data, loaded, text_col=args.text_col, txt_mode=args.txt_mode, **common
        )
    elif task == "seq2seq":
        data = load_seq2seq_data(
            args.data, loaded, source_col=args.source_col, target_col=args.target_col, **common
        )
    else:
        data = load_data(
            args.data, loaded, text_col=args.text_col, label_col=args.label_col, table=table,
            **common,
        )  # fmt: skip
    for w in data.warnings:
        _warn(w)
    _say(f"data: {data.description}")
    for line in data.info:
        _say(line)
    if data.label_map:
        _say(_label_map_line(data.label_map))
    return data


def _flush_unrepresentable(model: Any, dtype: Any) -> dict[str, int]:
    """Set the weights whose ``1/w²`` overflows to 0, in place, with a warning."""
    from geosharp.measure.checks import flush_unrepresentable

    flushed = flush_unrepresentable(model)
    if flushed:
        where = ", ".join(f"{k} ({v})" for k, v in list(flushed.items())[:4])
        _warn(
            f"{sum(flushed.values())} weight(s) are so small that 1/w² overflows {dtype} "
            f"({where}); they were set to 0, which freezes them in the adaptive ball (its radius "
            "ρ|w| was below 1e-19 there anyway)".replace("torch.", "")
        )
    return flushed


def _write(report: Any, args: argparse.Namespace) -> None:
    """Print the table and write results.json, results.csv (and report.html: ``--report``)."""
    _say("")
    _say(report.table())
    out = args.out
    json_path = report.write_json(out / "results.json")
    csv_path = report.write_csv(out / "results.csv")
    _say(f"\nresults: {json_path}, {csv_path}")
    if args.report:
        title = f"geosharp measure: {Path(str(args.model)).name or args.model}"
        html_path = report.write_html(out / "report.html", title=title)
        _say(f"report: {html_path}")


def run(args: argparse.Namespace) -> int:
    """Execute ``geosharp measure`` with parsed arguments.

    Returns:
        0 on success, 1 if some measurement failed (the others are reported) or the operating
        system failed during the work (disk full, ...), 2 on bad input, 130 if interrupted.
    """
    try:
        return _execute(args)
    except KeyboardInterrupt:
        print("geosharp: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if getattr(args, "debug", False):
            raise
        if isinstance(err, OSError):  # its own message (exit 2) or the system's (exit 1)
            print(f"geosharp: error: {os_error_line(err)}", file=sys.stderr)
            return os_error_status(err)
        known = isinstance(err, (MeasureError, ValueError, ImportError))
        text = str(err) if known else f"{type(err).__name__}: {err} (--debug shows the traceback)"
        print(f"geosharp: error: {text}", file=sys.stderr)
        return 2
