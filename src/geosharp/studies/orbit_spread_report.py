r"""What a population's orbit spread says, beside the committed studies: the report's reading.

:mod:`geosharp.studies.orbit_spread` measures the spread (:func:`~geosharp.studies.orbit_spread.
population_spread`); this module reads it. :data:`REFERENCE` holds what the committed studies
found at their spreads (the spread and the paired Δτ of geodesic inv against adaptive),
:data:`SMALL_SPREAD` and :data:`LARGE_SPREAD` the levels that separate "one orbit position" from
"as large as where the measures differed", :func:`spread_note` the sentence the report's headline
gets, and :func:`spread_sections` the report's two orbit spread sections (the population's
spread per block kind; its spread beside its paired Δτ and the committed studies').
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geosharp.studies.orbit_spread import KindSpread, population_spread, spread_level
from geosharp.studies.sections import Section

__all__ = [
    "LARGE_SPREAD",
    "REFERENCE",
    "SMALL_SPREAD",
    "Reference",
    "spread_note",
    "spread_sections",
]

#: At or below this orbit spread (standard deviation over models of the model imbalance, the
#: largest over the block kinds) the models sit at one orbit position: ten times Study 3's
#: spread (1.0e-4, fine-tunes that kept the pretrained position).
SMALL_SPREAD = 1e-3
#: At or above this spread a committed study saw the measures differ: Study 4's (0.23–0.24,
#: geodesic inv stronger than adaptive, Δτ −0.06 [−0.12, −0.01]), rounded down; Study 6's high
#: level reached 0.23 by training and did not (Δτ +0.04 [−0.03, +0.10]).
LARGE_SPREAD = 0.2


@dataclass(frozen=True)
class Reference:
    """A committed study's orbit spread and its paired Δτ (geodesic inv − adaptive, worst ℓ2).

    Attributes:
        study: Its name and folder.
        population: What its models are.
        spread: Block kind → orbit spread (sd over models of the model imbalance); empty when
            not recorded.
        delta_tau: Δτ(geodesic inv − adaptive) [95 % CI] at the middle ρ, as committed.
        differed: Whether that CI excludes 0.
        source: The committed files the numbers come from.
    """

    study: str
    population: str
    spread: Mapping[str, float]
    delta_tau: str
    differed: bool
    source: str


#: What the committed studies found (transformer populations; worst-case ℓ2, middle ρ). The
#: spreads are the standard deviations (ddof 1) of the committed per-model ``imbalance_QK`` /
#: ``imbalance_VO`` columns of the named ``diagnostics.csv``.
REFERENCE: tuple[Reference, ...] = (
    Reference(
        "Study 3 (results/minilm-text)",
        "23 MiniLM-L6 fine-tunes, embeddings frozen",
        {"QK": 2.4e-5, "VO": 1.0e-4},
        "+0.03 [−0.07, +0.13]",
        False,
        "results/curvature/minilm-text/diagnostics.csv; results/minilm-text/tau_table.md",
    ),
    Reference(
        "Study 5 (results/study5-minilm-finetunes)",
        "54 MiniLM-L6 fine-tunes, every weight",
        {},
        "+0.08 [−0.01, +0.18]",
        False,
        "gpu-run/analysis.md (the models were not kept: spread not recorded)",
    ),
    Reference(
        "Study 2 (results/vit-mnist)",
        "48 ViTs trained on MNIST from scratch",
        {"QK": 0.038, "VO": 0.049},
        "−0.03 [−0.07, +0.01]",
        False,
        "results/curvature/vit-mnist/diagnostics.csv; results/vit-mnist/tau_table.md",
    ),
    Reference(
        "Study 4 (results/vit-orbit)",
        "48 ViTs, Q/K and V/O init scale drawn by hand",
        {"QK": 0.24, "VO": 0.23},
        "−0.06 [−0.12, −0.01]",
        True,
        "results/vit-orbit/diagnostics.csv; results/vit-orbit/analysis.md",
    ),
    Reference(
        "Study 6, low (results/study6-orbit-dose)",
        "64 ViTs trained by AdamW with weight decay",
        {"QK": 0.028, "VO": 0.030},
        "+0.00 [−0.05, +0.06]",
        False,
        "results/study6-orbit-dose/run/analysis.md (the study's own orbit rows)",
    ),
    Reference(
        "Study 6, middle (results/study6-orbit-dose)",
        "64 ViTs trained by SGD without weight decay",
        {"QK": 0.051, "VO": 0.056},
        "+0.03 [−0.01, +0.07]",
        False,
        "results/study6-orbit-dose/run/analysis.md (the study's own orbit rows)",
    ),
    Reference(
        "Study 6, high (results/study6-orbit-dose)",
        "64 ViTs trained by SGD, Q/O init scales drawn",
        {"QK": 0.16, "VO": 0.23},
        "+0.04 [−0.03, +0.10]",
        False,
        "results/study6-orbit-dose/run/analysis.md (the study's own orbit rows)",
    ),
)


def _reference_text(ref: Reference) -> str:
    return f"{ref.study.split(' (')[0]}: {max(ref.spread.values()):.2g}, Δτ {ref.delta_tau}"


def spread_note(spreads: Sequence[KindSpread]) -> str | None:
    """One sentence on what the population's spread allows, from the committed studies.

    ``None`` for a population without GL-type heads. At most :data:`SMALL_SPREAD`: too small
    for the orbit position to separate adaptive and geodesic sharpness; at least
    :data:`LARGE_SPREAD`: as large as where a committed study saw them differ (and another, at a
    spread reached by training, did not); between: as the
    committed populations there, which did not tell them apart.
    """
    level = spread_level(spreads)
    if not math.isfinite(level):
        if spreads:
            return (
                "Only element-wise GL(1) pairs: adaptive sharpness is invariant to their orbit, "
                "so the orbit position cannot separate it from geodesic sharpness, whatever the "
                "spread."
            )
        return None
    small, mid, large, trained = (REFERENCE[0], REFERENCE[2], REFERENCE[3], REFERENCE[6])
    if level <= SMALL_SPREAD:
        return (
            f"Orbit spread {level:.2g} (≤ {SMALL_SPREAD:g}): the models sit at one orbit position, "
            "so adaptive and geodesic sharpness cannot differ through it here (as in "
            f"{_reference_text(small)}); a paired Δτ away from 0 would have another cause."
        )
    if level >= LARGE_SPREAD:
        return (
            f"Orbit spread {level:.2g} (≥ {LARGE_SPREAD:g}): as large as where a committed study "
            f"saw adaptive and geodesic sharpness differ ({_reference_text(large)}, orbit "
            f"positions drawn by hand) and where another did not ({_reference_text(trained)}, "
            "reached by training): this population's paired Δτ is the answer."
        )
    return (
        f"Orbit spread {level:.2g}, between {SMALL_SPREAD:g} and {LARGE_SPREAD:g}: the committed "
        f"study at such a spread did not tell the measures apart ({_reference_text(mid)})."
    )


def _fmt(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.2g}"


def spread_sections(
    rows: Sequence[Mapping[str, Any]],
    gaps: Mapping[str, float],
    paired: Sequence[Mapping[str, Any]] = (),
) -> list[Section]:
    """The report's orbit spread sections (none without rows).

    The population's spread per block kind, and its spread beside its paired Δτ and the
    committed studies'.
    """
    spreads = population_spread(rows, gaps)
    if not spreads:
        return []
    head = [
        "block kind",
        "models",
        "heads per model",
        "model imbalance median [min, max]",
        "orbit spread (sd across models)",
        "head spread within a model (mean sd)",
        "head by head across models (median sd)",
        "log scale sd across models",
    ]
    body = [
        [
            s.category,
            str(s.models),
            str(s.heads),
            f"{s.imbalance[0]:.4g} [{s.imbalance[1]:.4g}, {s.imbalance[2]:.4g}]",
            _fmt(s.across),
            _fmt(s.within),
            _fmt(s.headwise),
            _fmt(s.log_scale_sd),
        ]
        for s in spreads
    ]
    note = spread_note(spreads) or ""
    caption = (
        "Where the analysed models' heads sit on their GL(h) orbits (orbit_spread.csv, one row "
        "per head; geosharp.estimators.diagnostics.balance). Model imbalance = √Σ‖GᵀG−HᵀH‖² / "
        "√Σ‖GᵀG+HᵀH‖² over the model's heads of a kind (0: balanced). The orbit spread is its "
        "standard deviation over the models: adaptive sharpness depends on the orbit position, "
        "geodesic sharpness does not, so only a population whose models sit at different "
        "positions lets the orbit position separate the two. " + note
    )
    level = spread_level(spreads)
    rows2 = []
    for p in paired:
        rows2.append(
            [
                "this study",
                _fmt(level),
                f"{p['geodesic']} − {p['adaptive']} ({_position(p)})",
                f"{float(p['diff']):+.2f} [{float(p['ci_low']):+.2f}, {float(p['ci_high']):+.2f}]",
                str(p.get("verdict", "")),
            ]
        )
    for ref in REFERENCE:
        spread = (
            ", ".join(f"{k} {v:.2g}" for k, v in ref.spread.items())
            if ref.spread
            else "not recorded"
        )
        rows2.append(
            [
                f"{ref.study}: {ref.population}",
                spread,
                "geodesic-inv-o2 − adaptive, worst ℓ2 (middle ρ)",
                ref.delta_tau,
                "differed (CI excludes 0)" if ref.differed else "no clear difference",
            ]
        )
    caption2 = (
        "This study's orbit spread (the largest over its block kinds) beside its paired Δτ = "
        "τ geodesic − τ adaptive, and what the committed studies found: the spread has gone "
        "with disagreement only at Study 4's size (orbit positions drawn by hand at "
        "initialization), not at the same size reached by training (Study 6's high level); "
        "populations near one orbit position (fine-tunes) or near balance (ViTs trained the "
        "ordinary way) ranked generalization alike under both measures. "
        "Spreads of the committed studies: sd over models of their diagnostics.csv "
        "imbalance columns (Study 6: of its own orbit rows)."
    )
    return [
        Section("Orbit spread of the population", head, body, caption),
        Section(
            "Orbit spread and the paired Δτ, beside the committed studies",
            ["population", "orbit spread", "pair", "Δτ [CI]", "verdict"],
            rows2,
            caption2,
        ),
    ]


def _position(p: Mapping[str, Any]) -> str:
    k, size = int(p["position"]), int(p["grid_size"])
    if size == 1:
        return "single ρ"
    if k == 0:
        return "smallest ρ"
    if k == size - 1:
        return "largest ρ"
    return "middle ρ" if size == 3 else f"ρ #{k + 1}"
