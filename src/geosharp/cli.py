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
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

from geosharp._io import ensure_writable_dir, os_error_line, os_error_status, sqlite_os_error
from geosharp.studies.population_cli import is_manifest

#: Threads of ``geosharp study`` and ``geosharp symmetry-test`` without ``--threads``: one, so
#: that two studies can run side by side on a 2-core machine without oversubscribing it.
DEFAULT_STUDY_THREADS = 1


def _limit_numpy_blas(threads: int) -> bool:
    """Limit the BLAS under NumPy to ``threads`` threads, for the rest of the process.

    NumPy's BLAS (OpenBLAS in the wheels) keeps its own thread pool, which
    :func:`torch.set_num_threads` does not touch; the diagonal study trains with NumPy matmuls.
    Uses ``threadpoolctl`` when it is installed, else OpenBLAS's own ``*set_num_threads*``
    function found among the loaded libraries (Linux).

    Returns:
        Whether a limit was applied.
    """
    import numpy  # noqa: F401  (loads the BLAS, so that it can be found)

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(limits=threads, user_api="blas")
        return True
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower()}
    except OSError:
        return False
    names = (
        "scipy_openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads",
        "openblas_set_num_threads64_",
        "openblas_set_num_threads",
    )
    done = False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(threads))
                done = True
                break
    return done


def set_threads(threads: int | None, default: int | None = DEFAULT_STUDY_THREADS) -> int | None:
    """Apply ``--threads``: torch's intra-op threads and NumPy's BLAS threads.

    Args:
        threads: The option's value (``None``: not given).
        default: Threads when the option is not given; ``None`` leaves the libraries' own.

    Returns:
        The number of threads set, or ``None`` if nothing was changed.

    Raises:
        ValueError: If ``threads < 1``.
    """
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    n = threads if threads is not None else default
    if n is None:
        return None
    torch.set_num_threads(n)
    _limit_numpy_blas(n)
    return n


def _diagonal_study(args: argparse.Namespace):
    from geosharp.studies.diagonal import DiagonalConfig, DiagonalStudy

    set_threads(args.threads)
    overrides = {"seed": args.seed}
    if args.models is not None:
        overrides["n_models"] = args.models
    if args.rho is not None:
        overrides["rhos"] = tuple(args.rho)
    if getattr(args, "population", None) is not None:
        overrides["population"] = args.population
    cfg = DiagonalConfig.quick(**overrides) if args.quick else DiagonalConfig(**overrides)
    return DiagonalStudy(cfg)


def _threads_and_overrides(args: argparse.Namespace, name: str) -> dict:
    """Shared options of the transformer studies: threads, --models, --seed.

    (``--rho`` and ``--population`` were refused before, by :func:`_check_study_options`.)
    """
    set_threads(args.threads)
    overrides = {"seed": args.seed}
    if args.models is not None:
        overrides["n_models"] = args.models
    return overrides


def _vit_mnist_study(args: argparse.Namespace):
    from geosharp.data import MNIST_FILE
    from geosharp.studies.vit_mnist import ViTMNISTConfig, ViTMNISTStudy

    overrides = _threads_and_overrides(args, "vit-mnist")
    MNIST_FILE.locate()  # a missing wheel fails now, with the install command
    cfg = ViTMNISTConfig.quick(**overrides) if args.quick else ViTMNISTConfig(**overrides)
    return ViTMNISTStudy(cfg)


def _minilm_text_study(args: argparse.Namespace):
    from geosharp.data import ROTTEN_TOMATOES_FILE, MissingDataError
    from geosharp.models import minilm_path
    from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy

    overrides = _threads_and_overrides(args, "minilm-text")
    ROTTEN_TOMATOES_FILE.locate()
    try:
        minilm_path()
    except ImportError as err:
        raise MissingDataError(str(err)) from err
    cfg = MiniLMTextConfig.quick(**overrides) if args.quick else MiniLMTextConfig(**overrides)
    return MiniLMTextStudy(cfg)


def _vit_orbit_study(args: argparse.Namespace):
    from geosharp.data import MNIST_FILE
    from geosharp.studies.vit_orbit import VitOrbitConfig, VitOrbitStudy

    overrides = _threads_and_overrides(args, "vit-orbit")
    MNIST_FILE.locate()
    cfg = VitOrbitConfig.quick(**overrides) if args.quick else VitOrbitConfig(**overrides)
    return VitOrbitStudy(cfg)


#: Options of ``geosharp study`` that only some studies take: option → (the studies that take
#: it, why the others do not). Checked before any work (:func:`_check_study_options`).
STUDY_ONLY_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "rho": (
        ("diagonal",),
        "the transformer studies fix one ρ grid per measure by their ρ rule (listed in the "
        "report's settings)",
    ),
    "population": (("diagonal",), "the other studies have one population"),
}


def _check_study_options(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any work, an option the chosen study does not take."""
    for option, (studies, why) in STUDY_ONLY_OPTIONS.items():
        if getattr(args, option, None) is not None and args.name not in studies:
            raise ValueError(
                f"--{option} is an option of the {' and '.join(studies)} study only, not of "
                f"{args.name}: {why}"
            )


#: ``geosharp study NAME``: name → (help text, factory building the Study from the arguments).
STUDIES = {
    "diagonal": ("paper's Study 1: diagonal linear networks", _diagonal_study),
    "vit-mnist": ("Study 2: small ViTs trained on MNIST", _vit_mnist_study),
    "minilm-text": ("Study 3: MiniLM-L6 fine-tuned on review sentiment", _minilm_text_study),
    "vit-orbit": (
        "Study 4: Study 2's ViTs with drawn init scales and weight decay",
        _vit_orbit_study,
    ),
}


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
    s.add_argument("--shard", default=None, help="only this part k/n of the population")
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
            "Shards of different configurations, or a row with different values in two "
            "shards, are refused before anything is written."
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


#: Python packages a study needs beyond the core install, and the extra that brings them.
STUDY_REQUIRES: dict[str, tuple[tuple[str, ...], str]] = {
    "minilm-text": (("transformers", "safetensors"), "hf"),
}


def _check_requirements(name: str) -> None:
    """Fail before any work when a study's packages are missing, naming what to install."""
    import importlib.util

    modules, extra = STUDY_REQUIRES.get(name, ((), ""))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"study {name} needs {', '.join(missing)} (the [{extra}] extra): "
            f"pip install 'geosharp[{extra}]' (in this repository: make install)"
        )


#: What to do when a finished study's folder, written in place by ``symmetry-test``, is not
#: writable.
_IN_PLACE_FIX = "copy the study's folder somewhere writable and give that as --out"


def _make_study(args: argparse.Namespace, out: Path):
    """The study of ``args``, after the checks that need no work.

    Its options, its packages, then its folder ``out``: shown creatable and writable before
    anything is built (and removed again if it was created here, so a study that then refuses,
    e.g. for a missing data wheel, leaves nothing behind; the runner creates it). ``symmetry-test``
    works in a finished study's folder: a missing one is not created (the test then says that it
    holds no study).
    """
    _check_study_options(args)
    _check_requirements(args.name)
    if args.command == "study":
        ensure_writable_dir(out, keep=False)
    elif out.is_dir():
        ensure_writable_dir(out, fix=_IN_PLACE_FIX)
    study = STUDIES[args.name][1](args)
    if getattr(args, "curvature", False):
        study.with_curvature()  # the study's own default curvature plan
    return study


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
    from geosharp.studies.runner import Shard, report_from_folder, run_study
    from geosharp.studies.store import StudyMismatchError

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
                from geosharp.studies.runner import export_study

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
    """``geosharp study|symmetry-test MANIFEST ...`` (:mod:`geosharp.studies.population_cli`)."""
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
