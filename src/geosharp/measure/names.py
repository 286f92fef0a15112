"""Measure names: the one grammar of ``gs.measure``, ``geosharp measure`` and the study reports.

A user writes a measure as ``FAMILY[-OPTION...]`` (``"geodesic-inv-o2"``, ``"adaptive-linf"``,
``"curvature-mix-trace"``, or a name as a table prints it); :func:`parse_measure` reads it into
a :class:`MeasureSpec`, whose :attr:`~MeasureSpec.name` is the canonical name every result
carries:

* sharpness (:func:`measure_name`): ``"geodesic-inv-o2 worst l2"``, ``"adaptive worst linf"``,
  the attention-only measures with ``-blocks`` (``"geodesic-mix-o2-blocks worst l2"``,
  ``"adaptive-blocks worst l2"``) and the "no corrected norm" ablation with ``-adaptivenorm``
  (``"geodesic-inv-o2-adaptivenorm worst l2"``);
* curvature (:func:`curvature_name`): ``"geodesic-inv curvature lambda_max"``,
  ``"euclidean curvature trace"``;
* relative flatness: ``"relative_flatness"``.

The study reports sort and compare rows by name: :func:`measure_family` (sharpness, relative
flatness or curvature), :func:`default_paper_match` (the paper family a row is compared with)
and :func:`is_geodesic_main` (the geodesic measures paired with adaptive ℓ2). These read any
string, canonical or not, and never raise.

:func:`measure_name` is defined in :mod:`geosharp.estimators.sharpness` (the estimators do not
import ``geosharp.measure``) and re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from geosharp.estimators.sharpness import measure_name
from geosharp.measure.errors import MeasureError

__all__ = [
    "MeasureSpec",
    "curvature_name",
    "default_paper_match",
    "is_geodesic_main",
    "measure_family",
    "measure_name",
    "parse_measure",
]

_FAMILIES = {
    "geodesic": "geodesic",
    "geo": "geodesic",
    "adaptive": "adaptive",
    "ada": "adaptive",
    "euclidean": "euclidean",
    "eucl": "euclidean",
}
_RELATIVE_FLATNESS = {"relative-flatness", "relative_flatness", "relflat", "rf"}
_ORDERS = {"o1": 1, "1": 1, "o2": 2, "2": 2, "exact": "exact", "oexact": "exact"}
_KINDS = {"worst": "worst", "average": "average", "avg": "average"}
_QUANTITIES = {
    "lmax": "lambda_max",
    "lambda_max": "lambda_max",
    "lambdamax": "lambda_max",
    "λmax": "lambda_max",
    "lmin": "lambda_min",
    "lambda_min": "lambda_min",
    "lambdamin": "lambda_min",
    "λmin": "lambda_min",
    "trace": "trace",
    "tr": "trace",
}
_GRAMMAR = (
    "a measure is FAMILY[-OPTION...] with FAMILY one of geodesic, adaptive, euclidean, "
    "relative-flatness, curvature and options metric inv|mix (geodesic), order o1|o2|exact "
    "(geodesic), norm l2|linf (adaptive, euclidean), kind worst|average, blocks (geodesic, "
    "adaptive l2: attention-only), adaptivenorm (geodesic: no corrected norm); a curvature "
    "measure is curvature[-geodesic|adaptive|euclidean][-inv|mix]-lmax|lmin|trace (no rho); "
    "e.g. geodesic-inv-o2, geodesic-mix-exact, adaptive-linf, adaptive-l2-average, "
    "curvature-inv-lmax, curvature-euclidean-trace, or a name as the table prints it "
    "('geodesic-inv-o2 worst l2', 'geodesic-inv curvature lambda_max')"
)


def curvature_name(measure: str, metric: str, quantity: str) -> str:
    """Canonical name of a curvature measure: :attr:`geosharp.CurvatureResult.measure` + quantity.

    Args:
        measure: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
        metric: Block metric of the geodesic measure (ignored otherwise).
        quantity: ``"lambda_max"``, ``"lambda_min"`` or ``"trace"``.

    Example:
        >>> curvature_name("geodesic", "mix", "trace")
        'geodesic-mix curvature trace'
        >>> curvature_name("euclidean", "", "lambda_max")
        'euclidean curvature lambda_max'
    """
    base = f"geodesic-{metric or 'inv'}" if measure == "geodesic" else measure
    return f"{base} curvature {quantity}"


# --------------------------------------------------------------------------------------------
# parsing a user's text


def _set(opts: dict[str, Any], key: str, value: Any, text: str) -> None:
    if key in opts and opts[key] != value:
        raise MeasureError(f"measure {text!r} gives the {key} twice: {_GRAMMAR}")
    opts[key] = value


def _parse_curvature(text: str, tokens: list[str]) -> dict[str, Any]:
    """The options of a curvature measure; ``tokens`` hold ``"curvature"`` once."""
    opts: dict[str, Any] = {}
    for tok in tokens:
        if tok == "curvature":
            continue
        if tok in _FAMILIES:
            key, value = "of", _FAMILIES[tok]
        elif tok in ("inv", "mix"):
            key, value = "metric", tok
        elif tok in _QUANTITIES:
            key, value = "quantity", _QUANTITIES[tok]
        elif tok in _ORDERS or tok in _KINDS or tok in ("l2", "linf"):
            raise MeasureError(
                f"measure {text!r}: a curvature measure has no order, kind or norm (it is the "
                "Hessian spectrum on the quotient, SPEC §9: second-order geodesics, no rho); "
                f"{_GRAMMAR}"
            )
        else:
            raise MeasureError(f"unknown option {tok!r} in measure {text!r}: {_GRAMMAR}")
        _set(opts, key, value, text)
    if "quantity" not in opts:
        raise MeasureError(
            f"measure {text!r}: say which curvature quantity, lmax (largest eigenvalue), lmin "
            f"(smallest) or trace; {_GRAMMAR}"
        )
    of = opts.get("of", "geodesic")
    if of != "geodesic" and "metric" in opts:
        raise MeasureError(
            f"measure {text!r}: the metric inv|mix belongs to geodesic curvature only; {of} "
            "curvature has its own (element-wise) metric"
        )
    return {
        "of": of,
        "metric": opts.get("metric", "inv") if of == "geodesic" else "",
        "quantity": opts["quantity"],
    }


def _parse_sharpness(text: str, tokens: list[str]) -> dict[str, Any]:
    """The fields of a sharpness measure; ``tokens[0]`` is its family."""
    if not tokens or tokens[0] not in _FAMILIES:
        raise MeasureError(f"unknown measure {text!r}: {_GRAMMAR}")
    family = _FAMILIES[tokens[0]]
    opts: dict[str, Any] = {}
    for tok in tokens[1:]:
        if tok in ("inv", "mix"):
            key, value = "metric", tok
        elif tok in _ORDERS:
            key, value = "order", _ORDERS[tok]
        elif tok in ("l2", "linf"):
            key, value = "norm", tok
        elif tok in _KINDS:
            key, value = "kind", _KINDS[tok]
        elif tok == "blocks":
            key, value = "perturb", "blocks"
        elif tok == "adaptivenorm":
            key, value = "corrected_norm", False
        else:
            raise MeasureError(f"unknown option {tok!r} in measure {text!r}: {_GRAMMAR}")
        _set(opts, key, value, text)
    if family != "geodesic" and ("metric" in opts or opts.get("order", 1) != 1):
        raise MeasureError(
            f"measure {text!r}: metric and order belong to geodesic sharpness only; "
            f"{family} sharpness is measured along straight lines"
        )
    if family == "geodesic" and opts.get("norm") == "linf":
        raise MeasureError(
            f"measure {text!r}: the l-infinity box is defined for adaptive and euclidean "
            "sharpness only (geodesic sharpness uses the metric's own l2 ball)"
        )
    if family != "geodesic" and "corrected_norm" in opts:
        raise MeasureError(
            f"measure {text!r}: adaptivenorm (the 'no corrected norm' ablation) belongs to "
            "geodesic sharpness only"
        )
    if opts.get("perturb") == "blocks" and (family == "euclidean" or opts.get("norm") == "linf"):
        raise MeasureError(
            f"measure {text!r}: blocks (attention-only: only the symmetry blocks are perturbed) "
            "is defined for the geodesic and adaptive l2 measures only"
        )
    if family != "geodesic":
        opts.setdefault("order", 1)
        opts["metric"] = ""
    return {"measure": family, **opts}


def parse_measure(text: str | MeasureSpec) -> MeasureSpec:
    """Read a measure as a user writes it (or as a table prints it) into a :class:`MeasureSpec`.

    Tokens are separated by hyphens or spaces, case-insensitively; options may come in any
    order, and omitted ones take their defaults (metric inv, order 2, kind worst, norm l2).

    Args:
        text: The measure, or a :class:`MeasureSpec` (returned as is).

    Returns:
        The :class:`MeasureSpec`.

    Raises:
        MeasureError: If the text is not a measure (the message gives the grammar).

    Example:
        >>> parse_measure("geo-mix-exact").name
        'geodesic-mix-oexact worst l2'
        >>> parse_measure("geodesic-inv-o2-blocks worst l2").perturb
        'blocks'
        >>> parse_measure("curvature-euclidean-lmax").name
        'euclidean curvature lambda_max'
    """
    if isinstance(text, MeasureSpec):
        return text
    if not isinstance(text, str):
        raise MeasureError(f"a measure must be a string, got {type(text).__name__}; {_GRAMMAR}")
    raw = text.strip().lower()
    if raw in _RELATIVE_FLATNESS:
        return MeasureSpec("relative_flatness", metric="", order=1, kind="", norm="")
    tokens = [t for t in re.split(r"[\s\-]+", raw) if t]
    if tokens.count("curvature") > 1:
        raise MeasureError(f"measure {text!r} names curvature twice: {_GRAMMAR}")
    if "curvature" in tokens:
        c = _parse_curvature(text, tokens)
        return MeasureSpec("curvature", order=2, kind="", norm="", **c)
    return MeasureSpec(**_parse_sharpness(text, tokens))


@dataclass(frozen=True)
class MeasureSpec:
    """One sharpness measure, as :func:`geosharp.sharpness` takes it.

    A curvature measure (:func:`geosharp.curvature`, SPEC §9) has ``measure="curvature"``, the
    measure whose Hessian spectrum it is in :attr:`of`, the quantity in :attr:`quantity`, and
    neither ρ, kind nor norm.

    Attributes:
        measure: ``"geodesic"``, ``"adaptive"``, ``"euclidean"``, ``"relative_flatness"`` or
            ``"curvature"``.
        metric: Block metric of geodesic sharpness or curvature (``"inv"`` or ``"mix"``).
        order: Geodesic order (``1``, ``2`` or ``"exact"``; ``2`` for curvature).
        kind: ``"worst"`` or ``"average"`` (``""`` for curvature).
        norm: ``"l2"`` or ``"linf"`` (``""`` for curvature).
        of: Curvature only: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
        quantity: Curvature only: ``"lambda_max"``, ``"lambda_min"`` or ``"trace"``.
        perturb: ``"all"``, or ``"blocks"`` for the attention-only measures (name ``-blocks``).
        corrected_norm: ``False`` for the "no corrected norm" ablation of geodesic sharpness
            (name ``-adaptivenorm``).

    Example:
        >>> MeasureSpec.parse("geodesic-mix-exact").name
        'geodesic-mix-oexact worst l2'
        >>> MeasureSpec.parse("adaptive-linf").name
        'adaptive worst linf'
        >>> MeasureSpec.parse("geodesic-mix-oexact worst l2") == MeasureSpec.parse("geo-mix-exact")
        True
        >>> MeasureSpec.parse("curvature-mix-trace").name
        'geodesic-mix curvature trace'
        >>> MeasureSpec.parse("curvature-euclidean-lmax").name
        'euclidean curvature lambda_max'
    """

    measure: str
    metric: str = "inv"
    order: int | str = 2
    kind: str = "worst"
    norm: str = "l2"
    of: str = ""
    quantity: str = ""
    perturb: str = "all"
    corrected_norm: bool = True

    @classmethod
    def parse(cls, text: str | MeasureSpec) -> MeasureSpec:
        """Parse ``"geodesic-inv-o2"``, ``"adaptive-linf"``, ``"curvature-inv-lmax"``, ....

        The same as :func:`parse_measure`.

        Args:
            text: The measure, or a :class:`MeasureSpec` (returned as is).

        Returns:
            The :class:`MeasureSpec`.

        Raises:
            MeasureError: If the text is not a measure (the message gives the grammar).
        """
        return parse_measure(text)

    @property
    def name(self) -> str:
        """Canonical name, as :attr:`geosharp.SharpnessResult.measure` spells it."""
        if self.measure == "relative_flatness":
            return "relative_flatness"
        if self.measure == "curvature":
            return curvature_name(self.of, self.metric, self.quantity)
        return measure_name(
            self.measure,
            self.metric,
            self.order,
            self.kind,
            self.norm,
            corrected_norm=self.corrected_norm,
            perturb=self.perturb,
        )

    @property
    def uses_rho(self) -> bool:
        """Whether the measure has a radius (relative flatness and curvature have none)."""
        return self.measure not in ("relative_flatness", "curvature")

    def __str__(self) -> str:
        return self.name


# --------------------------------------------------------------------------------------------
# reading names in the study reports (any string; never raises)

#: The kinds of rows of a τ table, in the order the study reports list them.
FAMILY_ORDER = ("sharpness", "relative flatness", "curvature")

_GEODESIC_MAIN = re.compile(r"^geodesic-(inv|mix)-o2 (worst|average) l2$")


def _hyphenated(name: str) -> str:
    """Lower case, with every run of spaces and underscores read as one hyphen."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


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
        ``None`` for the "no corrected norm" ablation (``…-adaptivenorm``, not a paper
        family) and for curvature (:func:`measure_family`; the paper reports sharpness only),
        ``"adaptive"`` if the name contains "adaptive", ``"geodesic inv"`` if it starts with
        "geodesic-inv", ``"geodesic mix"`` if it starts with "geodesic-mix", else ``None``.

    Example:
        >>> default_paper_match("geodesic-inv-o2 worst l2"), default_paper_match("euclidean")
        ('geodesic inv', None)
        >>> default_paper_match("geodesic-inv curvature lambda_max") is None
        True
    """
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
    :func:`parse_measure`'s. Attention-only (``-blocks``) and ablation (``-adaptivenorm``)
    names, other orders and loose spellings are not.

    Args:
        name: A canonical measure name.

    Returns:
        ``True`` for the four main geodesic names.

    Example:
        >>> is_geodesic_main("geodesic-mix-o2 average l2"), is_geodesic_main("geodesic-inv-o2")
        (True, False)
        >>> spec = parse_measure("geodesic-mix-o2 average l2")
        >>> f"geodesic {spec.metric}", f"adaptive {spec.kind} l2"
        ('geodesic mix', 'adaptive average l2')
    """
    return isinstance(name, str) and _GEODESIC_MAIN.match(name) is not None
