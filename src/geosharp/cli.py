"""The ``geosharp`` command line: run studies and (re)build their reports.

Examples:
    geosharp study diagonal --out runs/diagonal
    geosharp study diagonal --models 10 --rho 0.01 0.1 --out runs/small
    geosharp report runs/diagonal
    geosharp measure ./my-bert-folder train.csv --report
    geosharp merge runs/all runs/shard1 runs/shard2
    geosharp --debug study diagonal --out runs/x   # an error shows its traceback

Every command that writes a folder checks that it can create and write it before any work
(:func:`geosharp._io.ensure_writable_dir`); an error a user can fix, an operating system's
error included (disk full, read-only, permission denied), ends as one line
``geosharp: error: ...`` on stderr, never a traceback (``--debug`` shows it).

This module holds the parser and the commands' dispatch; the studies the commands run, and
their checks, are :mod:`geosharp.cli_studies`'s, the threads :mod:`geosharp.cli_threads`'s.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

from geosharp._io import ensure_writable_dir, os_error_line, os_error_status, sqlite_os_error
from geosharp.cli_studies import STUDIES, _make_study
from geosharp.cli_threads import DEFAULT_STUDY_THREADS, set_threads
from geosharp.studies.population_cli import is_manifest
from geosharp.studies.shards import SHARD_HELP

_CURVATURE_HELP = (
    "also measure the study's opt-in curvature part: λ_max and trace of the loss Hessian in "
    "the metrics of the study's curvature plan (geodesic, adaptive and for some studies "
    "Euclidean; no ρ), reported as their own rows beside the sharpness measures. Recorded in "
    "the study's configuration: adding it to a folder measured without it needs --force (its "
    "rows are kept, only the curvature rows are added)"
)

_DEBUG_HELP = (
    "show the full traceback of an error instead of its one line (also before the command: "
    "geosharp --debug COMMAND ...)"
)

_LIBRARY_THREADS_HELP = (
    "CPU threads of torch and NumPy's BLAS (default: the libraries' own; statistics and plots only)"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="geosharp",
        description=(
            "Symmetry-aware (geodesic) sharpness of neural networks, and whether it predicts "
            "generalization. A study trains a population of models, measures the sharpness of "
            "each under several measures and radii, and reports Kendall's tau against the "
            "generalization gap."
        ),
        epilog="An error prints one line, geosharp: error: ...; --debug shows its traceback.",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error instead of its one line (every command "
        "also takes --debug after its name)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "study",
        help="train a population, measure sharpness, write results.csv and report.html",
        description=(
            "Run a study end to end. Everything computed is stored in OUT/study.sqlite as soon "
            "as it is finished: rerunning the same command resumes where a killed run stopped."
        ),
    )
    s.add_argument(
        "name",
        choices=sorted(STUDIES),
        help="; ".join(f"{k}: {v[0]}" for k, v in sorted(STUDIES.items()))
        + "; or your own population: geosharp study MANIFEST.csv --data DATA (see "
        "geosharp study MANIFEST.csv -h)",
    )
    s.add_argument("--out", type=Path, default=None, help="output folder (default: runs/NAME)")
    s.add_argument(
        "--models", type=int, default=None, help="population size (default: the study's own)"
    )
    s.add_argument(
        "--rho",
        type=float,
        nargs="+",
        default=None,
        metavar="RHO",
        help="diagonal only: its radii (default: 0.001 0.01 0.1). vit-mnist, minilm-text and "
        "vit-orbit fix one ρ grid per measure by their ρ rule and refuse --rho",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of data and population")
    s.add_argument(
        "--population",
        choices=("alpha", "sgd-batch"),
        default=None,
        help="diagonal only: alpha (Study 1, the default) or sgd-batch (the second population)",
    )
    s.add_argument("--quick", action="store_true", help="a tiny configuration (seconds)")
    s.add_argument("--curvature", action="store_true", help=_CURVATURE_HELP)
    s.add_argument(
        "--force",
        action="store_true",
        help="reuse an output folder that holds a different configuration (rows are kept)",
    )
    s.add_argument(
        "--shard",
        default=None,
        metavar="K/N",
        help=SHARD_HELP,
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"CPU threads of torch and of NumPy's BLAS, for every study (default "
        f"{DEFAULT_STUDY_THREADS}: two studies side by side on a 2-core machine)",
    )
    t = sub.add_parser(
        "symmetry-test",
        help="re-measure a finished study's models after random equivalent re-parametrizations",
        description=(
            "Replace every model of a finished study by a random equivalent one (each symmetry "
            "block re-parametrized by a random group element: the same function, the same gap) "
            "and measure its worst-case adaptive and geodesic sharpness again at the middle "
            "radius of each grid. Writes OUT/symmetry_test.csv (resumable) and "
            "OUT/symmetry_test.md (τ before and after, with CIs). Needs the checkpoints."
        ),
    )
    t.add_argument("name", choices=sorted(STUDIES), help="the study")
    t.add_argument("--out", type=Path, default=None, help="its folder (default: runs/NAME)")
    t.add_argument("--models", type=int, default=None, help="as given to geosharp study")
    t.add_argument("--seed", type=int, default=0, help="as given to geosharp study")
    t.add_argument("--quick", action="store_true", help="as given to geosharp study")
    t.add_argument("--curvature", action="store_true", help="as given to geosharp study")
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"CPU threads of torch and NumPy's BLAS (default {DEFAULT_STUDY_THREADS})",
    )
    t.add_argument(
        "--scale",
        type=float,
        nargs=2,
        default=(0.1, 10.0),
        metavar=("LOW", "HIGH"),
        help="scale a of the group elements, log-uniform per model (default: 0.1 10)",
    )
    t.add_argument("--test-seed", type=int, default=0, help="seed of the group elements")
    t.set_defaults(rho=None, population=None)
    r = sub.add_parser(
        "report",
        help="rebuild results.csv and report.html of a study folder",
        description="Rebuild results.csv, tau_table.md, the plots and report.html from OUT.",
    )
    r.add_argument("out", type=Path, help="the study's output folder")
    r.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="DEST",
        help="write the report into DEST instead, with a consistent copy of study.sqlite and "
        "without checkpoints: a small folder to share or commit (safe while the study runs)",
    )
    r.add_argument("--threads", type=int, default=None, help=_LIBRARY_THREADS_HELP)
    m = sub.add_parser(
        "merge",
        help="merge the output folders of the shards of one study, then write its report",
        description=(
            "Copy the rows and checkpoints of per-shard study folders (--shard k/n) into OUT. "
            "Shards of different configurations, settings or manifests, or a row with different "
            "values in two shards, are refused in one line before anything is written; what ran "
            "each shard (threads, device, machine) is kept for each."
        ),
    )
    m.add_argument("out", type=Path, help="the merged folder (created if missing)")
    m.add_argument("shards", type=Path, nargs="+", help="the shards' output folders")
    m.add_argument("--threads", type=int, default=None, help=_LIBRARY_THREADS_HELP)
    from geosharp.measuring.cli import add_parser as add_measure_parser

    add_measure_parser(sub)
    for command in (s, t, r, m):  # measure's parser has its own --debug
        # SUPPRESS: a subcommand that is not given --debug keeps the top level's value
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP
        )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``geosharp`` command.

    Returns:
        The exit status: 0 on success, 2 on bad input found before any work (an output folder
        that cannot be written included), 1 on an operating system's error during the work
        (disk full, ...), 130 if interrupted. Errors print one line (``--debug``: the
        traceback).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[1:] if argv[:1] == ["--debug"] else argv
    if len(rest) >= 2 and rest[0] in ("study", "symmetry-test") and is_manifest(rest[1]):
        return _population(rest[0], rest[1:], debug="--debug" in argv)
    args = _parser().parse_args(argv)
    from geosharp.studies.runner import run_study
    from geosharp.studies.shards import Shard
    from geosharp.studies.store import StudyMismatchError
    from geosharp.studies.study_report import report_from_folder

    if args.command == "measure":
        from geosharp.measuring.cli import run as run_measure

        if args.threads is not None and args.threads >= 1:  # measure reports a bad value itself
            set_threads(args.threads)  # torch again in measure's own run, NumPy's BLAS here
        return run_measure(args)
    try:
        if args.command in ("report", "merge"):
            set_threads(args.threads, default=None)
        if args.command == "study":
            if args.models is not None and args.models < 2:
                raise ValueError("--models must be at least 2 (τ needs pairs of models)")
            if args.rho is not None and any(r <= 0 for r in args.rho):
                raise ValueError("--rho values must be > 0")
            shard = Shard.parse(args.shard) if args.shard else None
            out = args.out or Path("runs") / args.name
            study = _make_study(args, out)
            progress = False if args.no_progress else None
            summary = run_study(study, out, force=args.force, progress=progress, shard=shard)
            print(
                f"{args.name}: trained {summary.trained}, measured {summary.measured}, "
                f"reused {summary.reused} rows in {summary.time_s:.1f} s"
            )
            if summary.report is not None:
                print(" ".join(summary.report.headline))
                print(f"report: {summary.report.html}")
                print(f"tau table: {summary.report.tau_table}")
                print(f"results: {out / 'results.csv'}")
        elif args.command == "symmetry-test":
            from geosharp.studies.symmetry_test import symmetry_test

            if not 0 < args.scale[0] <= args.scale[1]:
                raise ValueError("--scale needs 0 < LOW <= HIGH")
            out = args.out or Path("runs") / args.name
            study = _make_study(args, out)
            _, table = symmetry_test(
                study,
                out,
                scales=tuple(args.scale),
                seed=args.test_seed,
                log=lambda msg: print(msg, file=sys.stderr),
            )
            print(table)
            print(f"written: {out / 'symmetry_test.md'}, {out / 'symmetry_test.csv'}")
        elif args.command == "report":
            if args.export is not None:
                from geosharp.studies.study_report import export_study

                ensure_writable_dir(args.export, "--export", keep=False)  # created once checked
                paths = export_study(args.out, args.export)
            else:
                if args.out.is_dir():  # rebuilt in place; a missing folder holds no study
                    ensure_writable_dir(
                        args.out, "OUT", fix="write the report elsewhere: --export DEST"
                    )
                paths = report_from_folder(args.out)
            print(f"report: {paths.html}")
        elif args.command == "merge":
            from geosharp.studies.merge import merge_shards

            ensure_writable_dir(args.out, "OUT", keep=False)  # nothing written before the check
            merged = merge_shards(args.out, args.shards)
            print(f"report: {merged.report.html}")
    except (StudyMismatchError, ValueError, OSError, sqlite3.Error) as err:
        said = None if args.debug else _error_line(err)
        if said is None:
            raise
        print(f"geosharp: error: {said[0]}", file=sys.stderr)
        return said[1]
    except KeyboardInterrupt:
        print(_interrupted(args), file=sys.stderr)
        return 130
    return 0


def _population(command: str, argv: Sequence[str], debug: bool) -> int:
    """``geosharp study|symmetry-test MANIFEST ...`` (:mod:`geosharp.studies.population_cli`).

    With ``--fsdp`` (one process per rank under ``torchrun``) the process ends here once a
    process group was started (:func:`geosharp.measuring.fsdp.finish`), with the same status.
    """
    rc = _population_status(command, argv, debug)
    if "--fsdp" in argv:
        from geosharp.measuring.fsdp import finish

        finish(rc)
    return rc


def _population_status(command: str, argv: Sequence[str], debug: bool) -> int:
    from geosharp.studies.population_cli import run
    from geosharp.studies.store import StudyMismatchError

    args = argparse.Namespace(command=command, name=argv[0], out=None)
    try:
        args, status = run([a for a in argv if a != "--debug"], command, set_threads)
        return status
    except (StudyMismatchError, ValueError, OSError, sqlite3.Error) as err:
        said = None if debug else _error_line(err)
        if said is None:
            raise
        print(f"geosharp: error: {said[0]}", file=sys.stderr)
        return said[1]
    except KeyboardInterrupt:
        args.out = args.out or Path("runs") / Path(argv[0]).stem
        print(_interrupted(args), file=sys.stderr)
        return 130


def _error_line(err: Exception) -> tuple[str, int] | None:
    """The one line of an error the user can act on, and the exit status; ``None``: a bug.

    Our own messages (a :class:`ValueError`, :class:`StudyMismatchError`, an :class:`OSError`
    raised with a message) exit 2, found before the work; an operating system's error, or
    SQLite's that stands for one (disk full, read-only), exits 1 and says what to do.
    """
    if isinstance(err, sqlite3.Error):
        os_err = sqlite_os_error(err)
        if os_err is None:
            return None  # a bug of the database code: its traceback
        err = os_err
    if isinstance(err, OSError):
        return os_error_line(err), os_error_status(err)
    return str(err), 2


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupted command kept, and how to go on."""
    again = "geosharp " + " ".join(sys.argv[1:]) if sys.argv[1:] else "the same command"
    if args.command in ("study", "symmetry-test"):
        out = args.out or Path("runs") / args.name
        kept = (
            f"every finished row is saved in {out / 'study.sqlite'}"
            if args.command == "study"
            else f"every finished row is saved in {out / 'symmetry_test.csv'}"
        )
        return f"geosharp: interrupted; {kept}. Resume with: {again}"
    return f"geosharp: interrupted; nothing half-written was kept. Run again with: {again}"


if __name__ == "__main__":
    sys.exit(main())
