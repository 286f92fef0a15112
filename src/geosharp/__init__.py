"""geosharp — symmetry-aware (geodesic) sharpness of neural networks.

Layers, each importing only from the ones before it: :mod:`geosharp.geometry` (tensor math) ←
:mod:`geosharp.symmetry` (finds symmetry blocks in an ``nn.Module``) ←
:mod:`geosharp.estimators` (Auto-PGD, sampling, baselines) ← studies ← CLI.

Example:
    >>> import geosharp as gs
    >>> "sharpness" in gs.__all__ and "find_symmetries" in gs.__all__
    True
"""

from geosharp import geometry
from geosharp._version import __version__
from geosharp.estimators import SharpnessResult, relative_flatness, sharpness
from geosharp.estimators.checks import check_geometry, check_invariance
from geosharp.estimators.curvature import CurvatureResult, curvature
from geosharp.estimators.sharded.placement import shard_placement
from geosharp.measures import Measure, parse_measure
from geosharp.measuring import TwinCheck, measure, twin_check
from geosharp.studies.population_call import study
from geosharp.symmetry import (
    GLBlock,
    ParameterSpace,
    declare_block,
    find_symmetries,
    prove,
    reparametrize,
)

__all__ = [
    "CurvatureResult",
    "GLBlock",
    "Measure",
    "ParameterSpace",
    "SharpnessResult",
    "TwinCheck",
    "__version__",
    "check_geometry",
    "check_invariance",
    "curvature",
    "declare_block",
    "find_symmetries",
    "geometry",
    "measure",
    "parse_measure",
    "prove",
    "relative_flatness",
    "reparametrize",
    "shard_placement",
    "sharpness",
    "study",
    "twin_check",
]
