"""The studies of ``geosharp study NAME`` and ``geosharp symmetry-test NAME``.

* :data:`STUDIES` — name → (help text, factory building the study from the arguments);
* the checks before any work: :data:`STUDY_ONLY_OPTIONS` (options some studies do not take),
  :data:`STUDY_REQUIRES` (packages a study needs beyond the core install) and the output
  folder, all in :func:`_make_study`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from geosharp._io import ensure_writable_dir
from geosharp.cli_threads import set_threads

__all__ = ["STUDIES", "STUDY_ONLY_OPTIONS", "STUDY_REQUIRES"]


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
