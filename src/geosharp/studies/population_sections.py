"""The hyperparameter sections of a population's report: granulated τ and the CMI score.

For a study whose models carry hyperparameters (a manifest's other columns, SPEC §2.5), every
(measure, ρ) cell of the τ table gets

* **granulated τ** (Jiang et al. 2020): ψ_k per hyperparameter k, the mean τ-a over groups of
  models that differ in k only, and Ψ, the mean of the defined ψ_k
  (:func:`geosharp.stats.granulated.granulated_kendall`);
* **the conditional mutual information score** of the PGDL competition: the minimum over pairs
  of hyperparameters S (single ones when there is one) of ``I(V_s; V_gap | U_S) / H(V_gap |
  U_S)`` (:func:`geosharp.stats.granulated.cmi_score`), with the minimizing S.

:func:`population_sections` is a folder-section provider (:mod:`geosharp.studies.sections`):
it reads the hyperparameters recorded in ``study.sqlite`` and runs only for a folder that holds
a population manifest's record (:data:`MANIFEST_FILE`), so the built-in studies' reports are
unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from geosharp.stats import cmi_score, granulated_kendall
from geosharp.studies.formatting import fmt
from geosharp.studies.sections import Section

__all__ = [
    "MANIFEST_FILE",
    "MODELS_FILE",
    "batches_used",
    "hyperparameter_rows",
    "population_sections",
]

#: What a manifest study records of its manifest in its folder (gap rule, hyperparameters,
#: skipped rows, the ρ rule's grids); its presence makes :func:`population_sections` run.
MANIFEST_FILE = "manifest.json"
#: The architecture, task and symmetry blocks of every model measured (model id → record).
MODELS_FILE = "models.json"


def batches_used(
    models: Mapping[str, Mapping[str, Any]], batch_size: int, samples: int | None, max_length: int
) -> str | None:
    """The report's "batches" setting as the models were measured (``models.json``).

    Each model's data are cut by ``geosharp measure``'s own path: at most the samples the file
    holds, at most the length the model accepts. Says the values used (a range when the models
    differ) and, where they differ, what was asked; ``None`` when no model recorded them.
    """
    used = [
        m for m in models.values() if all(k in m for k in ("batch_size", "samples", "max_length"))
    ]
    if not used:
        return None

    def span(key: str) -> str:
        lo, hi = min(m[key] for m in used), max(m[key] for m in used)
        return f"{lo}" if lo == hi else f"{lo}–{hi}"

    asked = [
        text
        for key, value, text in (
            ("batch_size", batch_size, f"{batch_size} per batch"),
            ("samples", samples, f"{samples} samples"),
            ("max_length", max_length, f"max length {max_length}"),
        )
        if value is not None and span(key) != str(value)
    ]
    text = (
        f"{span('batch_size')} per batch, {span('samples')} samples, "
        f"max length {span('max_length')}"
    )
    return text + (f" (asked: {', '.join(asked)})" if asked else "")


def _varying(hparams: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """The hyperparameters that take at least two values."""
    return {k: list(v) for k, v in hparams.items() if len({json.dumps(x) for x in v}) > 1}


def hyperparameter_rows(
    cells: Mapping[tuple[str, float | None], Mapping[str, float]],
    gaps: Mapping[str, float],
    hparams: Mapping[str, Mapping[str, Any]],
) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """The granulated-τ and CMI rows of every (measure, ρ) cell.

    Args:
        cells: ``(measure, ρ)`` → model id → value.
        gaps: Model id → gap.
        hparams: Model id → hyperparameter name → value.

    Returns:
        ``(names, granulated rows, CMI rows)``: the varying hyperparameters, then one row of
        formatted cells per (measure, ρ) for each table.
    """
    granulated, cmi = [], []
    names: list[str] = []
    for (measure, rho), by_model in cells.items():
        ids = [m for m, v in by_model.items() if m in gaps and math.isfinite(v)]
        hp = _varying({k: [hparams[m].get(k) for m in ids] for k in _names(hparams, ids)})
        names = list(hp)
        t = [gaps[m] for m in ids]
        s = [by_model[m] for m in ids]
        rho_text = "–" if rho is None else f"{rho:g}"
        g = granulated_kendall(t, s, hp) if hp else {"psi": {}, "Psi": float("nan")}
        psi = g["psi"]
        granulated.append(
            [measure, rho_text, *(fmt(psi.get(k, float("nan"))) for k in names), fmt(g["Psi"])]
        )
        size = 2 if len(hp) >= 2 else 1
        if hp:
            c = cmi_score(t, s, hp, max_condition=size, min_condition=size)
            where = ", ".join(c.condition) if c.condition else "–"
            cmi.append([measure, rho_text, fmt(c.score), where, str(c.n_models)])
        else:
            cmi.append([measure, rho_text, fmt(float("nan")), "–", str(len(ids))])
    return names, granulated, cmi


def _names(hparams: Mapping[str, Mapping[str, Any]], ids: Sequence[str]) -> list[str]:
    out: dict[str, None] = {}
    for m in ids:
        out.update(dict.fromkeys(hparams[m]))
    return list(out)


def population_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """Granulated τ and the CMI score of a manifest study's folder (none elsewhere).

    Args:
        out_dir: The study folder.
        gaps: Model id → gap of the analysed models.

    Returns:
        Two sections when the models vary in at least one hyperparameter, else none.
    """
    out = Path(out_dir)
    if not (out / MANIFEST_FILE).is_file() or not (out / "study.sqlite").is_file():
        return []
    sections = _model_sections(out)
    from geosharp.studies.store import Store

    with Store(out / "study.sqlite", None, None) as store:
        hparams = {m["model_id"]: m["hparams"] for m in store.models()}
        cells: dict[tuple[str, float | None], dict[str, float]] = {}
        for r in store.measurements():
            if r["value"] is None or r["model_id"] not in gaps:
                continue
            cells.setdefault((r["measure"], r["rho"]), {})[r["model_id"]] = float(r["value"])
    names, granulated, cmi = hyperparameter_rows(cells, gaps, hparams)
    if not names:
        return sections
    return [
        *sections,
        Section(
            "Granulated τ per hyperparameter",
            ["measure", "ρ", *(f"ψ {n}" for n in names), "Ψ"],
            granulated,
            "ψ_k = mean τ-a (measure vs. gap) over the groups of models that differ in "
            "hyperparameter k only (groups where k takes one value are skipped; nan: no such "
            "group); Ψ = mean of the defined ψ_k (Jiang et al. 2020, SPEC §2.5). In plain words: "
            "ψ for a hyperparameter asks, of two models trained alike but for it, whether the "
            "sharper one also has the larger gap: +1 always, −1 always the reverse, 0 no more "
            "often than not; nan: no two models differ in it alone. A measure that tracks the "
            "gap itself, not one hyperparameter that moves both, has ψ > 0 for each of them.",
        ),
        Section(
            "Conditional mutual information score (PGDL)",
            ["measure", "ρ", "score", "minimizing S", "models"],
            cmi,
            "score = min over sets S of "
            + ("two hyperparameters" if len(names) >= 2 else "one hyperparameter")
            + " of I(V_measure; V_gap | U_S) / H(V_gap | U_S) over ordered pairs of models with "
            "different gaps, V = sign of the pairwise difference, U_S = both models' values of "
            "S (Jiang et al. 2020; the NeurIPS 2020 PGDL competition; SPEC §2.5). 1: the measure "
            "orders every pair like the gap beyond what S explains; 0: no information. It is "
            "blind to direction: read it with τ. In plain words: once the values of the "
            "hyperparameters S are known, the share of the uncertainty left about which of two "
            "models has the larger gap that the measure removes; S is the set that leaves it "
            "least (0: the measure follows those hyperparameters and no more).",
        ),
    ]


def _model_sections(out: Path) -> list[Section]:
    """The models by architecture, with the symmetry blocks found in each (``models.json``)."""
    path = out / MODELS_FILE
    if not path.is_file():
        return []
    models = json.loads(path.read_text(encoding="utf-8"))
    by_arch: dict[tuple[str, str, str], list[str]] = {}
    for mid, rec in sorted(models.items()):
        key = (str(rec.get("kind", "")), str(rec.get("task", "")), str(rec.get("blocks", "")))
        by_arch.setdefault(key, []).append(mid)
    rows = [
        [kind, task, blocks, str(len(ids)), ", ".join(ids[:6]) + (" …" if len(ids) > 6 else "")]
        for (kind, task, blocks), ids in by_arch.items()
    ]
    return [
        Section(
            "Models and their symmetry blocks",
            ["model kind", "task", "symmetry blocks found", "models", "which"],
            rows,
            "Every model was loaded, tokenized and self-checked as geosharp measure does it; "
            "the blocks are those found and proven on its first batch (the geodesic measures "
            "move them on the quotient, everything else with the adaptive geometry).",
        )
    ]
