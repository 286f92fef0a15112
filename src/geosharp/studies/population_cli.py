"""``geosharp study MANIFEST --data DATA --out OUT``: the command line of a population study.

``geosharp study`` takes the name of a built-in study or a manifest file; :func:`is_manifest`
tells them apart, :func:`parser` reads a manifest study's options (``geosharp measure``'s data
options, its measure grammar, the study's resume, shard and report options) and :func:`run`
executes it (:func:`geosharp.studies.population.run_population`).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from geosharp.studies.shards import SHARD_HELP

__all__ = ["MANIFEST_SUFFIXES", "is_manifest", "parser", "run"]

#: What a manifest's file name ends with.
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")

_EPILOG = """\
the manifest: one row per model
  model            a Hugging Face folder, a PEFT adapter folder, a torch.save file, or
                   module:function (with a weights column); paths relative to the manifest
  base, weights    optional: the base of a PEFT adapter, the weights of module:function
  name (or id)     optional: the model's name in the results (default: model)
  the gap          gap, or train_error+test_error, or train_accuracy+test_accuracy, or
                   train_loss+test_loss (--gap picks one when several are there)
  anything else    a hyperparameter (granulated tau and the CMI score in the report)

radii (--rho, decided and recorded before any tau):
  auto | auto:NAME               the rho rule on a pilot model (default: the median gap's,
                                 skipping models at chance)
  0.01 0.1 1                     one grid for every measure
  adaptive=0.1,0.3 geodesic=0.01,0.03   one grid per family (geodesic, adaptive, euclidean)
                                        or per measure (geodesic-mix-o2=...)

examples:
  geosharp study runs.csv --data train.csv --text-col sentence --out runs/mine
  geosharp study runs.csv --data train.csv --rho 0.01 0.0316 0.1 --measures adaptive geodesic-inv
  geosharp study lora.jsonl --data corpus.txt --base ./llama --task causal-lm --out runs/lora
  geosharp study runs.csv --data train.csv --twin-check   # does the promise hold on yours?

sharded models (--fsdp, one process per rank under torchrun; docs/cluster.md):
  torchrun --standalone --nproc-per-node 8 -m geosharp study runs.csv --data corpus.txt \\
      --fsdp --measures adaptive-l2 geodesic-inv-o2 --batch-size 64 --out runs/big
  every rank loads each model, shards it with FSDP2 as geosharp measure --fsdp does and
  measures its rows of every batch; rank 0 alone writes OUT (a killed run resumes with the
  same command, with or without --fsdp: the configuration is the same); --curvature too.
  Refused in one line before any work: what geosharp measure --fsdp refuses (relative
  flatness, ...), --twin-check and symmetry-test.
"""


def is_manifest(name: str) -> bool:
    """Whether ``geosharp study NAME`` names a manifest file rather than a built-in study."""
    return Path(name).suffix.lower() in MANIFEST_SUFFIXES


def parser(command: str = "study") -> argparse.ArgumentParser:
    """The options of ``geosharp study MANIFEST`` (or ``geosharp symmetry-test MANIFEST``)."""
    from geosharp.geometry.base import DEFAULT_RK4_STEPS
    from geosharp.measuring.cli_parser import add_data_arguments
    from geosharp.studies.population import DEFAULT_POPULATION_MEASURES

    p = argparse.ArgumentParser(
        prog=f"geosharp {command} MANIFEST",
        description=textwrap.fill(
            "Measure every model of a manifest (its generalization gap and hyperparameters "
            "beside it) on the same data, as geosharp measure does one, and report Kendall's "
            "tau between each measure and the gap, with bootstrap CIs, granulated tau and the "
            "conditional mutual information score. Everything is stored in OUT/study.sqlite as "
            "soon as it is finished: rerunning the same command resumes.",
            width=92,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("manifest", help="a .csv, .tsv, .jsonl or .parquet file, one row per model")
    p.add_argument("--data", required=True, help="the data every model is measured on")
    p.add_argument("--out", type=Path, default=None, help="output folder (runs/<manifest name>)")
    p.add_argument(
        "--measures",
        nargs="+",
        default=list(DEFAULT_POPULATION_MEASURES),
        metavar="MEASURE",
        help=f"measures (default: {' '.join(DEFAULT_POPULATION_MEASURES)})",
    )
    p.add_argument("--rho", nargs="+", default=None, metavar="R", help="radii: see below")
    p.add_argument("--steps", type=int, default=20, help="Auto-PGD steps per batch (20)")
    p.add_argument("--eps", type=float, default=0.0, help="Gram damping of the blocks (0)")
    p.add_argument(
        "--exact-steps",
        type=int,
        default=DEFAULT_RK4_STEPS,
        metavar="N",
        help=f"RK4 steps of the exact geodesic, the -exact measures ({DEFAULT_RK4_STEPS}); a "
        "head moved k times its size needs about 2k",
    )
    p.add_argument(
        "--gap", default=None, choices=("gap", "error", "accuracy", "loss"), help="the gap rule"
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="measure the other models when one does not load (listed in the report)",
    )
    p.add_argument("--no-check", action="store_true", help="no invariance self-check per model")
    p.add_argument(
        "--expect",
        choices=("positive", "negative"),
        default=None,
        help="the sign of τ you expect, stated before measuring (positive: sharper models "
        "generalize worse): the direction of the paired verdict (default: from the data)",
    )
    p.add_argument(
        "--curvature",
        action="store_true",
        help="also λ_max and the trace of geodesic inv and mix, adaptive and Euclidean curvature",
    )
    p.add_argument("--iters", type=int, default=50, help="curvature: Lanczos iterations (50)")
    p.add_argument("--probes", type=int, default=100, help="curvature: Hutchinson probes (100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the self-check and the ascent")
    p.add_argument("--force", action="store_true", help="reuse a folder of another config")
    p.add_argument(
        "--shard",
        default=None,
        metavar="K/N",
        help=SHARD_HELP,
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads of torch and BLAS")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun (torchrun --standalone --nproc-per-node N -m geosharp study "
        "MANIFEST ... --fsdp): shard every model with FSDP2's fully_shard as geosharp measure "
        "--fsdp does (nccl on GPUs, gloo on CPUs), split the rows of every batch evenly over "
        "the ranks; rank 0 alone writes OUT. Every sharpness and curvature measure (and "
        "--curvature); relative flatness is refused in one line (docs/cluster.md)",
    )
    if command == "study":
        p.add_argument(
            "--twin-check",
            action="store_true",
            help="then re-measure every model's cells on one random equivalent twin (same "
            "function, other weights; the model's dtype): OUT/twin_check.csv and the report's "
            "'Twin check' section, the relative change per measure and rho",
        )
    if command == "symmetry-test":
        p.description = (
            "Re-measure a finished population after a random equivalent re-parametrization of "
            "every model (give the options the study was run with)."
        )
        p.add_argument("--scale", type=float, nargs=2, default=(0.1, 10.0), metavar=("LO", "HI"))
        p.add_argument("--test-seed", type=int, default=0, help="seed of the group elements")
    add_data_arguments(p)
    return p


def run(
    argv: Sequence[str],
    command: str = "study",
    set_threads: Callable[[int], object] | None = None,
) -> tuple[argparse.Namespace, int]:
    """Parse and run ``geosharp study MANIFEST ...`` (``argv`` without the command's name).

    ``command="symmetry-test"`` re-measures the finished population of the same options after
    random equivalent re-parametrizations (:func:`geosharp.studies.symmetry_test.symmetry_test`).

    Errors are raised (the ``geosharp`` entry point turns them into one line).

    Returns:
        ``(args, 0)`` on success.
    """
    from geosharp._io import ensure_writable_dir
    from geosharp.errors import MeasureError
    from geosharp.measuring.pipeline import options_from_args
    from geosharp.studies.population import PopulationSettings, parse_rho, run_population
    from geosharp.studies.shards import Shard

    args = parser(command).parse_args(list(argv))
    args.command = command
    args.name = args.manifest
    if args.steps < 1:
        raise MeasureError(f"--steps must be >= 1, got {args.steps}")
    for key in ("batch_size", "max_length", "iters", "probes"):
        if getattr(args, key) < 1:
            raise MeasureError(f"--{key.replace('_', '-')} must be >= 1")
    fsdp = None
    if args.fsdp:  # before the manifest is read, on every rank alike
        from geosharp.studies.population_fsdp import check_study_args

        fsdp = check_study_args(args)
    if args.threads is not None and set_threads is not None:
        set_threads(args.threads)
    out = args.out or Path("runs") / Path(args.manifest).stem
    args.out = out
    shard = Shard.parse(args.shard) if args.shard else None
    rho = parse_rho(args.rho)
    opts = options_from_args(args)
    options = {k: getattr(opts, k) for k in opts.__dataclass_fields__}
    if not options["freeze"]:  # the identity of a study measured before --freeze existed
        del options["freeze"]
    settings = PopulationSettings(
        manifest=args.manifest,
        options=options,
        measures=tuple(args.measures),
        rho=rho,
        steps=args.steps,
        eps=args.eps,
        seed=args.seed,
        curvature=args.curvature,
        curvature_iters=args.iters,
        curvature_probes=args.probes,
        gap=args.gap,
        base=args.base,
        skip_bad=args.skip_bad,
        check=not args.no_check,
        exact_steps=args.exact_steps,
    )
    if command == "symmetry-test":
        return args, _symmetry_test(settings, args)
    study = None
    if fsdp is not None:  # the manifest read and checked before the process group starts
        from geosharp.studies.population_fsdp import ShardedPopulation

        study = ShardedPopulation(settings, fsdp, log=_say)
    if fsdp is None or fsdp.rank == 0:
        ensure_writable_dir(out)
    if fsdp is not None:
        fsdp.start()
    progress = False if args.no_progress else None
    summary = run_population(
        settings,
        out,
        force=args.force,
        progress=progress,
        shard=shard,
        log=_say,
        expected=getattr(args, "expect", None),
        study=study,
        twin_check=getattr(args, "twin_check", False),
    )
    if fsdp is not None and fsdp.rank != 0:
        return args, 0
    print(
        f"{Path(args.manifest).name}: measured {summary.measured}, reused {summary.reused} "
        f"rows in {summary.time_s:.1f} s"
    )
    if summary.report is not None:
        print(" ".join(summary.report.headline))
        print(f"report: {summary.report.html}")
        print(f"tau table: {summary.report.tau_table}")
        print(f"results: {out / 'results.csv'}")
        if getattr(args, "twin_check", False):
            print(f"twin check: {out / 'twin_check.csv'} (the report's Twin check section)")
    return args, 0


def _symmetry_test(settings, args: argparse.Namespace) -> int:
    from geosharp.studies.population import PopulationStudy
    from geosharp.studies.symmetry_test import symmetry_test

    if not 0 < args.scale[0] <= args.scale[1]:
        raise ValueError("--scale needs 0 < LOW <= HIGH")
    study = PopulationStudy(settings, log=_say)
    study.decide_radii(args.out)
    _, table = symmetry_test(
        study, args.out, scales=tuple(args.scale), seed=args.test_seed, log=_say
    )
    print(table)
    print(f"written: {args.out / 'symmetry_test.md'}, {args.out / 'symmetry_test.csv'}")
    return 0


def _say(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)
