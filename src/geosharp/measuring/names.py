"""Reading measure names in the study reports (any string; never raises).

A user writes a measure in the one grammar of :mod:`geosharp.measures`
(:func:`geosharp.measures.parse_measure`); its :attr:`~geosharp.measures.Measure.name` is the
canonical name every result carries:

* sharpness (:func:`geosharp.estimators.sharpness_settings.measure_name`):
  ``"geodesic-inv-o2 worst l2"``, ``"adaptive worst linf"``, the attention-only measures with
  ``-blocks`` (``"geodesic-mix-o2-blocks worst l2"``, ``"adaptive-blocks worst l2"``) and the "no
  corrected norm" ablation with ``-adaptivenorm`` (``"geodesic-inv-o2-adaptivenorm worst l2"``);
* curvature (:func:`geosharp.measures.curvature_name`): ``"geodesic-inv curvature lambda_max"``,
  ``"euclidean curvature trace"``;
* relative flatness: ``"relative_flatness"``.

The study reports sort and compare rows by name: :func:`measure_family` (sharpness, relative
flatness or curvature), :func:`default_paper_match` (the paper family a row is compared with)
and :func:`is_geodesic_main` (the geodesic measures paired with adaptive ℓ2). These read any
string, canonical or not, and never raise: the canonical name of a registered measure is
asked of its class (:attr:`~geosharp.measures.Measure.family`,
:attr:`~geosharp.measures.Measure.paper_column`); the text is read only for other names (a
loose spelling, an old store's name no registered class claims).
"""

from __future__ import annotations

import re
from functools import lru_cache

from geosharp.errors import MeasureError
from geosharp.measures import Measure, parse_measure, registered

__all__ = [
    "FAMILY_ORDER",
    "default_paper_match",
    "is_geodesic_main",
    "measure_family",
    "registered_measure",
]

#: The kinds of rows of a τ table, in the order the study reports list them.
FAMILY_ORDER = ("sharpness", "relative flatness", "curvature")

_GEODESIC_MAIN = re.compile(r"^geodesic-(inv|mix)-o2 (worst|average) l2$")


def _hyphenated(name: str) -> str:
    """Lower case, with every run of spaces and underscores read as one hyphen."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def registered_measure(name: str) -> Measure | None:
    """The registered measure whose canonical name ``name`` is, or ``None`` (never raises).

    A loose spelling (``"rf"``, ``"geo-mix-exact"``) is not a canonical name: it is read as
    text, as before, by the functions here.
    """
    return _parse(name, registered()) if isinstance(name, str) else None


@lru_cache(maxsize=4096)
def _parse(name: str, classes: tuple[type, ...]) -> Measure | None:
    # keyed by the registered classes: registering a measure is seen at once
    try:
        spec = parse_measure(name)
    except MeasureError:
        return None
    return spec if spec.name == name else None


def measure_family(name: str) -> str:
    """The kind of a measure: ``"curvature"``, ``"relative flatness"`` or ``"sharpness"``.

    Names are compared case-insensitively with spaces and underscores read as hyphens: a name
    with the word ``curvature`` is curvature (:func:`curvature_name`), ``relative-flatness``
    (or ``relative_flatness``) is relative flatness, anything else is sharpness.

    Args:
        name: A measure name, e.g. ``"geodesic-inv curvature lambda_max"``.

    Returns:
        ``"curvature"``, ``"relative flatness"`` or ``"sharpness"``.

    Example:
        >>> measure_family("adaptive curvature trace"), measure_family("adaptive worst l2")
        ('curvature', 'sharpness')
        >>> measure_family("relative_flatness")
        'relative flatness'
    """
    spec = registered_measure(name)
    if spec is not None:
        return spec.family
    hyphenated = _hyphenated(name)
    if re.search(r"(^|-)curvature(-|$)", hyphenated):
        return "curvature"
    if hyphenated == "relative-flatness":
        return "relative flatness"
    return "sharpness"


def default_paper_match(name: str) -> str | None:
    """The family label the paper reports a measure under (SPEC §7), or ``None``.

    Names are compared case-insensitively with spaces and underscores read as hyphens.

    Args:
        name: A measure name, e.g. ``"geodesic-inv-o2 worst l2"``.

    Returns:
        The :attr:`~geosharp.measures.Measure.paper_column` of the registered measure whose
        canonical name it is; for another name: ``None`` for the "no corrected norm"
        ablation (``…-adaptivenorm``, not a paper family) and for curvature
        (:func:`measure_family`; the paper reports sharpness only), ``"adaptive"`` if the name
        contains "adaptive", ``"geodesic inv"`` if it starts with "geodesic-inv",
        ``"geodesic mix"`` if it starts with "geodesic-mix", else ``None``.

    Example:
        >>> default_paper_match("geodesic-inv-o2 worst l2"), default_paper_match("euclidean")
        ('geodesic inv', None)
        >>> default_paper_match("geodesic-inv curvature lambda_max") is None
        True
    """
    spec = registered_measure(name)
    if spec is not None:
        return spec.paper_column
    hyphenated = _hyphenated(name)
    if "adaptivenorm" in hyphenated or measure_family(name) == "curvature":
        return None
    if "adaptive" in hyphenated:
        return "adaptive"
    if hyphenated.startswith("geodesic-inv"):
        return "geodesic inv"
    if hyphenated.startswith("geodesic-mix"):
        return "geodesic mix"
    return None


def is_geodesic_main(name: str) -> bool:
    """Whether a name is ``geodesic-{inv,mix}-o2 {worst,average} l2``, exactly as printed.

    These are the geodesic measures a study report pairs with adaptive ℓ2 of the same kind
    (``"adaptive worst l2"``, ``"adaptive average l2"``); their metric and kind are
    :func:`geosharp.measures.parse_measure`'s. Attention-only (``-blocks``) and ablation
    (``-adaptivenorm``) names, other orders and loose spellings are not.

    Args:
        name: A canonical measure name.

    Returns:
        ``True`` for the four main geodesic names.

    Example:
        >>> is_geodesic_main("geodesic-mix-o2 average l2"), is_geodesic_main("geodesic-inv-o2")
        (True, False)
        >>> from geosharp.measures import parse_measure
        >>> spec = parse_measure("geodesic-mix-o2 average l2")
        >>> f"geodesic {spec.metric}", f"adaptive {spec.kind} l2"
        ('geodesic mix', 'adaptive average l2')
    """
    return isinstance(name, str) and _GEODESIC_MAIN.match(name) is not None
