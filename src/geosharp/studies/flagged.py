"""A study's flagged cells: how many, why, and τ with and without them (issue 40).

Every measurement a study makes since flags exist records them
(:mod:`geosharp.measuring.flags`: ``rising``, ``unstable``, ``saturated``; an empty list when the
cell is sound). A ranking built on flagged cells ranks numbers that rounding or an equivalent
re-parametrization can move, or that only say how fast a model is destroyed, so the report
gives, per measure and ρ, how many models' cells are flagged and by what, and τ over all models
beside τ over the sound ones alone; the headline says when flagged cells are many
(:func:`flags_sentence`).

Measurements recorded before flags existed carry none (``flags`` is ``None``): a report of such
a study has no flag section and no flag sentence, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from geosharp.measuring.flags import FLAGS
from geosharp.stats import correlation_summary
from geosharp.studies.analysis import MIN_MODELS
from geosharp.studies.formatting import fmt, rho_key
from geosharp.studies.sections import Section

__all__ = ["MANY", "flag_counts", "flags_section", "flags_sentence"]

#: At least this fraction of a study's measured cells flagged: the headline says so.
MANY = 0.1


def _recorded(measurements: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [m for m in measurements if m.get("flags") is not None and m.get("value") is not None]


def flag_counts(
    measurements: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, float | None], dict[str, Any]]:
    """Per (measure, ρ): the models measured, their values, those flagged, each flag's count.

    Only measurements that recorded flags count; failed ones (no value) are left out.
    """
    out: dict[tuple[str, float | None], dict[str, Any]] = {}
    for m in _recorded(measurements):
        c = out.setdefault(
            (m["measure"], m.get("rho")),
            {"n": 0, "flagged": [], "values": {}, **{f: 0 for f in FLAGS}},
        )
        c["n"] += 1
        c["values"][str(m["model_id"])] = float(m["value"])
        if m["flags"]:
            c["flagged"].append(str(m["model_id"]))
        for f in m["flags"]:
            c[f] = c.get(f, 0) + 1
    return out


def flags_section(
    measurements: Sequence[Mapping[str, Any]],
    gaps: Mapping[str, float],
    *,
    level: float = 0.95,
    n_boot: int = 2000,
    n_perm: int = 2000,
    seed: int = 0,
) -> list[Section]:
    """The report's "Flagged cells" table, or nothing when no measurement recorded flags.

    One row per (measure, ρ): flagged / measured, the count of each flag, τ-a over every model
    with its CI, and τ-a over the sound models alone with its CI (undefined under 3).
    """
    counts = flag_counts(measurements)
    if not counts:
        return []
    rows = []
    for (measure, rho), c in sorted(counts.items(), key=lambda kv: (kv[0][0], rho_key(kv[0][1]))):
        ids = [mid for mid in c["values"] if mid in gaps]
        sound = [mid for mid in ids if mid not in set(c["flagged"])]
        taus = []
        for group in (ids, sound):
            s = correlation_summary(
                [gaps[mid] for mid in group],
                [c["values"][mid] for mid in group],
                n_boot=n_boot,
                n_perm=n_perm,
                level=level,
                seed=seed,
                min_models=MIN_MODELS,
            )
            taus.append(
                f"{fmt(s.tau_a)} [{fmt(s.ci_low)}, {fmt(s.ci_high)}] (n = {s.n_models})"
                if s.defined
                else f"undefined (n = {s.n_models})"
            )
        rows.append(
            [
                measure,
                "–" if rho is None else f"{rho:g}",
                f"{len(c['flagged'])} / {c['n']}",
                *(str(c[f]) for f in FLAGS),
                *taus,
            ]
        )
    caption = (
        "A cell is flagged when its value cannot be trusted as it is: rising (the ascent was "
        "still rising at its last step on some batch: a lower bound), unstable (the ascent did "
        "not settle, or a smaller ball held a better point: rounding or an equivalent "
        "re-parametrization can move the value), saturated (the perturbed loss reaches a "
        "trivial predictor's: the ball left the basin). τ over the sound models alone drops "
        "the flagged ones; where it differs from τ over all, the ranking rests on flagged "
        f"cells. CIs: {round(100 * level)} % percentile bootstrap over models."
    )
    header = ["measure", "ρ", "flagged", *FLAGS, "τ-a, all models", "τ-a, sound only"]
    return [Section("Flagged cells", header, rows, caption)]


def flags_sentence(measurements: Sequence[Mapping[str, Any]]) -> str | None:
    """The headline's sentence when at least :data:`MANY` of the measured cells are flagged.

    Example:
        >>> rows = [{"model_id": i, "measure": "m", "rho": 1.0, "value": 1.0,
        ...          "flags": ["unstable"] if i < 3 else []} for i in range(10)]
        >>> flags_sentence(rows)
        '3 of 10 measured cells are flagged (unstable 3): see Flagged cells for τ on the sound cells alone.'
    """  # noqa: E501
    counts = flag_counts(measurements)
    n = sum(c["n"] for c in counts.values())
    flagged = sum(len(c["flagged"]) for c in counts.values())
    if not n or flagged < MANY * n:
        return None
    why = ", ".join(f"{f} {k}" for f in FLAGS if (k := sum(c[f] for c in counts.values())))
    return (
        f"{flagged} of {n} measured cells are flagged ({why}): see Flagged cells for τ on the "
        "sound cells alone."
    )
