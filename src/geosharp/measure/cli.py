"""``geosharp measure MODEL DATA``: loading (:mod:`~geosharp.measure.loading`), then measuring.

:func:`add_parser` adds the subcommand to the ``geosharp`` parser and :func:`run` executes it;
every error a user can cause ends as ``geosharp: error: ...`` on stderr and exit status 2,
never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from geosharp.measure.core import (
    DEFAULT_CURVATURE_ITERS,
    DEFAULT_CURVATURE_PROBES,
    DEFAULT_MEASURES,
    DEFAULT_RHOS,
    DEFAULT_STEPS,
    MeasureError,
    measure,
)
from geosharp.measure.lm import SOURCE_COLS, TARGET_COLS, TASKS, TXT_MODES

__all__ = ["add_parser", "check_out_dir", "run"]

_EPILOG = """\
examples:
  geosharp measure ./my-bert-folder train.csv --text-col sentence --label-col label
  geosharp measure ./my-bert-folder ./mnli_train_ds --text-col premise,hypothesis --samples 1024
  geosharp measure model.pt data.npz --measures adaptive-linf geodesic-inv-exact --rho 0.05
  geosharp measure mypkg.models:build data.npz --weights ckpt.pt --report --out runs/m1
  geosharp measure mypkg.models:build mypkg.data:batches --weights ckpt.pt --device cuda
  geosharp measure ./my-llama-folder corpus.txt --max-length 256 --batch-size 8
  geosharp measure ./my-gpt2-folder docs.jsonl --text-col body --task causal-lm
  geosharp measure ./my-t5-folder pairs.jsonl --source-col question --target-col answer
  geosharp measure ./my-lora-adapter corpus.txt --base ./my-llama-folder

tasks (--task, default auto: from the folder's config; the chosen task is printed):
  classification  labels from --label-col (integers or the model's label names),
                  cross-entropy; float targets: squared error. Any model kind.
  causal-lm       next-token cross-entropy on a text corpus: a .txt file (one document per
                  line, or --txt-mode chunks: the whole file in blocks of --max-length
                  tokens), or .jsonl/.json/.csv/.parquet/datasets folder with a --text-col
                  column (default text). Tokenized with the folder's tokenizer (or
                  --tokenizer), truncated to --max-length, padded on the right; padding is
                  masked out of the loss; batches keep the corpus's order. Auto for config
                  architectures *ForCausalLM and *LMHeadModel (Llama, Qwen, GPT-2, ...).
  seq2seq         teacher-forced cross-entropy of --target-col given --source-col (defaults:
                  source/src/input/... and target/tgt/output/...) from .jsonl/.json/.csv/
                  .parquet/datasets; target padding masked. Auto for encoder-decoder configs
                  (T5, BART: *ForConditionalGeneration).
  A folder with adapter_config.json is a PEFT adapter, loaded with peft on its base model
  (base_model_name_or_path of the adapter config, a local folder, or --base PATH): the base
  is frozen, so sharpness is measured over the adapter's trainable parameters (LoRA A/B).
  With --loss module:function, causal-lm targets are the inputs shifted by one token
  (-100 on padding and at the end), seq2seq targets the target token ids (-100 on padding).

measures: FAMILY[-OPTION...], FAMILY one of geodesic, adaptive, euclidean, relative-flatness;
options: inv|mix, o1|o2|exact (geodesic), l2|linf (adaptive, euclidean), worst|average.
Curvature (the Hessian on the quotient, SPEC §9; no rho, measured once):
curvature[-geodesic|adaptive|euclidean][-inv|mix]-lmax|lmin|trace, e.g. curvature-inv-lmax,
curvature-mix-trace, curvature-adaptive-lmax, curvature-euclidean-trace (PyHessian's numbers);
Lanczos for lmax/lmin (--iters), Hutchinson for the trace (--probes, with its standard error).
The default is the paper's three measures: adaptive-l2, geodesic-inv-o2, geodesic-mix-o2, worst
case, 20 Auto-PGD steps, at rho 0.01, 0.1 and 1 (the paper reports no rho; one decade apart).
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``measure`` to the subparsers ``sub`` of the ``geosharp`` command.

    Returns:
        The new parser.
    """
    m = sub.add_parser(
        "measure",
        help="measure the sharpness of one trained model (HF folder, saved model, or builder)",
        description=textwrap.fill(
            "Measure the sharpness of one trained model on its data under several measures and "
            "radii. Before measuring, the symmetry blocks found are printed and a self-check "
            "runs: the clean loss must be finite and the model's outputs unchanged under a "
            "random re-parametrization of the blocks (else a wrong adapter would be measured). "
            "Results: a table here, results.json and results.csv in --out, and with --report "
            "an HTML page with the per-batch loss-ascent curves.",
            width=92,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "model",
        help="a Hugging Face model folder (config.json), a PEFT adapter folder "
        "(adapter_config.json), a torch.save(model) or torch.jit.save file, or module:function "
        "building the model (with --weights)",
    )
    m.add_argument(
        "data",
        help="a Hugging Face datasets folder, a .csv/.tsv/.jsonl/.json/.parquet file of text "
        "and labels (causal-lm: of text; seq2seq: of source and target texts), a .txt corpus "
        "(causal-lm), an .npz of arrays, or module:function returning (inputs, targets) batches",
    )
    m.add_argument(
        "--task",
        default="auto",
        choices=("auto", *TASKS),
        help="what the loss is (default auto: causal-lm for *ForCausalLM/*LMHeadModel "
        "configs, seq2seq for encoder-decoder configs, else classification); see below",
    )
    m.add_argument("--weights", default=None, help="a state dict to load into the model")
    m.add_argument(
        "--measures",
        nargs="+",
        default=None,
        metavar="MEASURE",
        help=f"measures (default: {' '.join(DEFAULT_MEASURES)})",
    )
    m.add_argument(
        "--rho",
        type=float,
        nargs="+",
        default=None,
        help=f"radii (default: {' '.join(f'{r:g}' for r in DEFAULT_RHOS)})",
    )
    m.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="Auto-PGD steps per batch (default 20)"
    )
    m.add_argument(
        "--eps",
        type=float,
        default=0.0,
        help="damping ε of the symmetry blocks' metrics: the geodesic measures invert the Gram "
        "matrices GᵀG + εI of every GL(h) block (one per attention head's query-key and "
        "value-output factors; also the diagonal-pair metrics). Default 0: exactly invariant. "
        "Set it only if a measure fails because a block's Gram matrix is singular (a head "
        "with rank-deficient weights, e.g. pruned or zero-initialized), to about 1e-6 times "
        "the block's typical squared weight; the invariance then holds up to about that much",
    )
    m.add_argument(
        "--iters",
        type=int,
        default=DEFAULT_CURVATURE_ITERS,
        help=f"curvature lmax/lmin: most Lanczos iterations per batch ({DEFAULT_CURVATURE_ITERS})",
    )
    m.add_argument(
        "--probes",
        type=int,
        default=DEFAULT_CURVATURE_PROBES,
        help=f"curvature trace: Hutchinson probes per batch ({DEFAULT_CURVATURE_PROBES})",
    )
    m.add_argument(
        "--trace-method",
        default="hutchinson",
        choices=("hutchinson", "hutch++", "exact"),
        help="curvature trace: hutchinson (with its standard error), hutch++ or exact (one "
        "product per coordinate: small models only)",
    )
    m.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="samples per batch, the m of m-sharpness (default 128, the paper's for BERT)",
    )
    m.add_argument(
        "--samples",
        type=int,
        default=1024,
        help="use the first N samples (default 1024, the paper's for BERT); 0: all",
    )
    m.add_argument(
        "--text-col",
        default="text",
        help="text column (default text); classification: a,b for sentence pairs",
    )
    m.add_argument(
        "--label-col", default=None, help="label column or .npz array (label; npz: y, targets, ...)"
    )
    m.add_argument(
        "--source-col",
        default=None,
        help="seq2seq: source text column (default: the first of "
        f"{', '.join(SOURCE_COLS)} present)",
    )
    m.add_argument(
        "--target-col",
        default=None,
        help="seq2seq: target text column (default: the first of "
        f"{', '.join(TARGET_COLS)} present)",
    )
    m.add_argument(
        "--txt-mode",
        default="lines",
        choices=TXT_MODES,
        help="causal-lm on a .txt file: one document per non-empty line (lines, the default) "
        "or the whole file cut into blocks of --max-length tokens (chunks)",
    )
    m.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="longest tokenized text (causal-lm: document or chunk; seq2seq: source and "
        "target); longer is truncated (128)",
    )
    m.add_argument("--split", default=None, help="split of a datasets folder (default train)")
    m.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the model's)")
    m.add_argument(
        "--base",
        default=None,
        help="the base model folder of a PEFT adapter (default: the adapter config's "
        "base_model_name_or_path)",
    )
    m.add_argument(
        "--num-labels",
        type=int,
        default=None,
        help="classes of the fresh head of a checkpoint without one (default: from the labels)",
    )
    m.add_argument(
        "--loss",
        default="auto",
        help="auto (cross-entropy for integer labels, squared error for float targets), ce, "
        "mse, or module:function(outputs, targets)",
    )
    m.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (auto)")
    m.add_argument(
        "--dtype", default="float32", help="float32, float64 or bfloat16 (default float32)"
    )
    m.add_argument("--seed", type=int, default=0, help="seed of the check, starts and fresh heads")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    m.add_argument(
        "--out", type=Path, default=Path("runs/measure"), help="output folder (runs/measure)"
    )
    m.add_argument("--report", action="store_true", help="also write OUT/report.html")
    m.add_argument(
        "--no-check",
        action="store_true",
        help="measure even if the invariance self-check fails (not recommended)",
    )
    m.add_argument("--no-progress", action="store_true", help="no progress bars")
    m.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return m


def _warn(msg: str) -> None:
    print(f"geosharp: warning: {msg}", file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _validate(args: argparse.Namespace) -> None:
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

    Creates the folder (and its parents) and writes and removes a temporary file in it, so a
    run that would measure for minutes and then fail to write its results fails before any
    work instead.

    Raises:
        MeasureError: If the folder cannot be created or a file cannot be written in it.
    """
    import tempfile

    out = Path(out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MeasureError(
            f"cannot create the output folder {out} (--out): {err.strerror or err}"
        ) from err
    if not out.is_dir():
        raise MeasureError(f"the output folder {out} (--out) is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".geosharp-write-test-"):
            pass
    except OSError as err:
        raise MeasureError(
            f"cannot write to the output folder {out} (--out): {err.strerror or err}"
        ) from err


def _label_map_line(label_map: dict[str, int]) -> str:
    shown = ", ".join(f"{k!r} → {v}" for k, v in list(label_map.items())[:20])
    more = f", … ({len(label_map)} in all)" if len(label_map) > 20 else ""
    return f"labels: text labels mapped to class ids: {shown}{more}"


def _execute(args: argparse.Namespace) -> int:
    import torch

    from geosharp.measure.checks import flush_unrepresentable
    from geosharp.measure.data_files import _columns, data_kind, infer_num_labels, read_table
    from geosharp.measure.data_loading import load_data
    from geosharp.measure.lm import load_lm_data, load_seq2seq_data
    from geosharp.measure.lm_tasks import detect_task
    from geosharp.measure.losses import resolve_loss
    from geosharp.measure.model_loading import check_model_spec, load_model
    from geosharp.measure.resolve import import_callable, resolve_device, resolve_dtype

    _validate(args)
    check_out_dir(args.out)  # before any work: a read-only --out fails now, not after measuring
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    measures = args.measures or list(DEFAULT_MEASURES)
    rhos = args.rho or list(DEFAULT_RHOS)
    samples = None if args.samples == 0 else args.samples
    loss = args.loss
    if loss not in (None, "auto") and ":" in loss:
        loss = import_callable(loss, "loss function")
    else:
        resolve_loss(loss)  # fail on an unknown name before loading anything

    check_model_spec(args.model)  # before reading any data
    task, why = detect_task(args.model, base=args.base, forced=args.task)
    if task != "classification" and isinstance(loss, str) and loss.strip().lower() == "mse":
        raise MeasureError(f"--loss mse does not fit the {task} task (a cross-entropy over tokens)")
    _say(f"task: {task} ({why})")
    kind = data_kind(args.data)
    rows, table = None, None
    num_labels, label2id = args.num_labels, None
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
    flushed = flush_unrepresentable(loaded.model)
    if flushed:
        where = ", ".join(f"{k} ({v})" for k, v in list(flushed.items())[:4])
        _warn(
            f"{sum(flushed.values())} weight(s) are so small that 1/w² overflows {dtype} "
            f"({where}); they were set to 0, which freezes them in the adaptive ball (its radius "
            "ρ|w| was below 1e-19 there anyway)".replace("torch.", "")
        )

    report = measure(
        loaded.model,
        data.batches,
        loss,
        measures=measures,
        rhos=rhos,
        steps=args.steps,
        eps=args.eps,
        seed=args.seed,
        iters=args.iters,
        probes=args.probes,
        trace_method=args.trace_method,
        check=not args.no_check,
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
    if report.failed:
        _warn(f"{len(report.failed)} measurement(s) failed; see the table")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``geosharp measure`` with parsed arguments.

    Returns:
        0 on success, 1 if some measurement failed (the others are reported), 2 on bad input,
        130 if interrupted.
    """
    try:
        return _execute(args)
    except KeyboardInterrupt:
        print("geosharp: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if getattr(args, "debug", False):
            raise
        known = isinstance(err, (MeasureError, ValueError, OSError, ImportError))
        text = str(err) if known else f"{type(err).__name__}: {err} (--debug shows the traceback)"
        print(f"geosharp: error: {text}", file=sys.stderr)
        return 2
