"""``geosharp measure MODEL DATA``: loading (:mod:`~geosharp.measuring.pipeline`), then measuring.

:func:`add_parser` adds the subcommand to the ``geosharp`` parser and :func:`run` executes it;
every error a user can cause ends as ``geosharp: error: ...`` on stderr and exit status 2,
an operating system's error during the work (disk full, ...) as one such line and exit status
1, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from geosharp._io import OutputFolderError, ensure_writable_dir, os_error_line, os_error_status
from geosharp.measuring.cli_parser import add_parser as add_parser
from geosharp.measuring.core import DEFAULT_MEASURES, measure
from geosharp.measuring.errors import MeasureError

__all__ = ["add_parser", "check_out_dir", "run"]


def _warn(msg: str) -> None:
    print(f"geosharp: warning: {msg}", file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _validate(args: argparse.Namespace) -> None:
    """Fail on a bad option before anything is loaded (the measures are parsed here too)."""
    from geosharp.measures import parse_measure

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


def _quiet(_msg: str) -> None:
    """What a rank other than 0 of ``--fsdp`` says: nothing (rank 0 says it)."""


def _execute(args: argparse.Namespace) -> int:
    import torch

    from geosharp.measuring import fsdp
    from geosharp.measuring.pipeline import ModelSource, load_for_measure, options_from_args

    _validate(args)
    run = fsdp.check_args(args) if getattr(args, "fsdp", False) else None  # before any loading
    check_out_dir(args.out)  # before any work: a read-only --out fails now, not after measuring
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    opts = options_from_args(args)
    say, warn = (_say, _warn) if run is None or run.rank == 0 else (_quiet, _quiet)
    source = ModelSource(args.model, weights=args.weights, base=args.base)
    if run is not None:
        run.start()
        ready, model, batches, loss = run.load(source, opts, say, warn)  # sharded, its rows
    else:
        ready = load_for_measure(source, opts, say=say, warn=warn)
        model, batches, loss = ready.model, ready.batches, ready.loss
    default = fsdp.DEFAULT_MEASURES if run is not None else DEFAULT_MEASURES

    report = measure(
        model,
        batches,
        loss,
        measures=args.measures or list(default),
        rhos=args.rho or None,  # None: the defaults, mix scaled to the model (said)
        steps=args.steps,
        eps=args.eps,
        seed=args.seed,
        iters=args.iters,
        probes=args.probes,
        trace_method=args.trace_method,
        check=not args.no_check,
        low_memory=args.low_memory,
        buffer_budget=args.buffer_budget,
        exact_steps=args.exact_steps,
        progress=False if args.no_progress else None,
        log=say,
        warn=warn,
    )
    report.warnings[:0] = ready.warnings
    report.settings = {**ready.settings(), **report.settings}
    if run is not None:
        report.settings["fsdp"] = run.describe()
    if not torch.cuda.is_available() and opts.device.type == "cpu":
        report.settings["threads"] = torch.get_num_threads()
    if run is None or run.rank == 0:
        _write(report, args)
    if report.failed:
        warn(f"{len(report.failed)} measurement(s) failed; see the table")
        return 1
    return 0


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

    With ``--fsdp`` (one process per rank under ``torchrun``, :mod:`~geosharp.measuring.fsdp`)
    the process ends here once a process group was started (:func:`~geosharp.measuring.fsdp.
    finish`), with the same exit status.

    Returns:
        0 on success, 1 if some measurement failed (the others are reported) or the operating
        system failed during the work (disk full, ...), 2 on bad input, 130 if interrupted.
    """
    rc = _run(args)
    if getattr(args, "fsdp", False):
        from geosharp.measuring.fsdp import finish

        finish(rc)
    return rc


def _run(args: argparse.Namespace) -> int:
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
