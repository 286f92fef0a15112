"""Sharpness estimators: the perturbation set, Auto-PGD, sampling and baselines (SPEC §2, §6)."""

from geosharp.estimators.apgd import AscentResult, autopgd, checkpoints
from geosharp.estimators.curvature import CurvatureResult, curvature
from geosharp.estimators.perturbation import Perturbation
from geosharp.estimators.relative_flatness import relative_flatness
from geosharp.estimators.sharpness import SharpnessResult, sharpness
from geosharp.symmetry.verify import call_model, eval_mode

__all__ = [
    "AscentResult",
    "CurvatureResult",
    "Perturbation",
    "SharpnessResult",
    "autopgd",
    "call_model",
    "checkpoints",
    "curvature",
    "eval_mode",
    "relative_flatness",
    "sharpness",
]
