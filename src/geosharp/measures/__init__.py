"""Measures as objects: what a measure is, the one grammar, and every built-in measure.

:class:`Measure` (in :mod:`~geosharp.measures.base`) is the interface; each other module of
this package defines measure classes and registers them (:func:`register`), and is imported
here, so adding a measure is one module (or one class in one) and its tests:

* :class:`Sharpness` (:mod:`~geosharp.measures.sharpness`): geodesic, adaptive, Euclidean;
* :class:`Curvature` (:mod:`~geosharp.measures.curvature`): the Hessian spectrum on the quotient;
* :class:`RelativeFlatness` (:mod:`~geosharp.measures.flatness`).

Example:
    >>> from geosharp.measures import parse_measure
    >>> m = parse_measure("geodesic-inv-o2")
    >>> m.name, m.family, m.uses_rho
    ('geodesic-inv-o2 worst l2', 'sharpness', True)
"""

import importlib
import pkgutil

from geosharp.measures.base import (
    Measure,
    MeasureError,
    Outcome,
    accepted,
    from_kwargs,
    grammar,
    parse_measure,
    register,
    registered,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

from geosharp.measures.curvature import Curvature, curvature_name  # noqa: E402
from geosharp.measures.flatness import RelativeFlatness  # noqa: E402
from geosharp.measures.sharpness import Sharpness  # noqa: E402

__all__ = [
    "Curvature",
    "Measure",
    "MeasureError",
    "Outcome",
    "RelativeFlatness",
    "Sharpness",
    "accepted",
    "curvature_name",
    "from_kwargs",
    "grammar",
    "parse_measure",
    "register",
    "registered",
]
