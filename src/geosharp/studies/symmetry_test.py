"""Does a study's τ survive re-parametrizations that leave every model's function unchanged?

The paper's argument (SPEC §1) is that GL(h) symmetries make adaptive sharpness depend on
which of many equivalent weight settings training happened to return. This test makes that
concrete on a finished study: every model is replaced by a random *equivalent* model
(:func:`geosharp.reparametrize`: each attention head's ``(G, H) ↦ (G A⁻¹, H Aᵀ)`` with a random
``A`` of scale ``a``, ``a`` drawn log-uniformly per model), which computes the same function
and so has the same generalization gap, and the worst-case measures are measured again at the
middle radius of their grids. A measure that is a property of the function keeps its values
and its τ; one that is not changes them.

Outputs, in the study folder: ``symmetry_test.csv`` (one line per model and measure; written
as it goes, so a killed run resumes) and ``symmetry_test.md`` (τ before and after, with CIs, the
paired Δτ, and how much the values moved).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geosharp._io import atomic_write_text
from geosharp.estimators import sharpness
from geosharp.stats import correlation_summary, tau_difference
from geosharp.studies.runner import Study, StudyMeasure
from geosharp.studies.sections import Section
from geosharp.studies.store import Store
from geosharp.symmetry import find_symmetries, reparametrize
from geosharp.symmetry.verify import call_model
from geosharp.symmetry.verify import flatten_outputs as _flatten_outputs

__all__ = [
    "CSV_FILE",
    "SymmetryTestRow",
    "default_specs",
    "folder_sections",
    "read_rows",
    "symmetry_section",
    "symmetry_test",
]

#: Where :func:`symmetry_test` writes its rows in a study folder.
CSV_FILE = "symmetry_test.csv"

_FIELDS = [
    "model_id",
    "measure",
    "rho",
    "scale",
    "gap",
    "original",
    "reparametrized",
    "output_rel_change",
]


@dataclass(frozen=True)
class SymmetryTestRow:
    """One model under one measure, before and after a random equivalent re-parametrization."""

    model_id: str
    measure: str
    rho: float
    scale: float
    gap: float
    original: float
    reparametrized: float
    output_rel_change: float


def default_specs(study: Study) -> list[tuple[StudyMeasure, float]]:
    """The worst-case adaptive and order-2 geodesic measures of the plan, at their middle ρ."""
    out = []
    for spec in study.plan():
        kw = spec.kwargs
        if kw.get("kind", "worst") != "worst" or kw.get("corrected_norm", True) is False:
            continue
        if kw.get("measure") == "adaptive" or (
            kw.get("measure") == "geodesic" and kw.get("order") == 2
        ):
            rhos = sorted(r for r in spec.rhos if r is not None)
            out.append((spec, rhos[len(rhos) // 2]))
    return out


def _relative_output_change(model: torch.nn.Module, twin: torch.nn.Module, inputs: Any) -> float:
    """``‖f_twin − f‖ / ‖f‖`` over every floating output, as :func:`check_invariance` measures."""
    with torch.no_grad():
        a, b = (
            _flatten_outputs(call_model(m, dict(m.named_parameters()), inputs))
            for m in (model, twin)
        )
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


def read_rows(path: str | Path) -> list[SymmetryTestRow]:
    """The rows of a ``symmetry_test.csv`` (empty if there is none)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        return [
            SymmetryTestRow(r["model_id"], r["measure"], *(float(r[k]) for k in _FIELDS[2:]))  # type: ignore[arg-type]
            for r in csv.DictReader(fh)
        ]


def symmetry_test(
    study: Study,
    out_dir: str | Path,
    *,
    scales: tuple[float, float] = (0.1, 10.0),
    seed: int = 0,
    specs: Sequence[tuple[StudyMeasure, float]] | None = None,
    n_boot: int = 2000,
    log: Callable[[str], None] | None = None,
) -> tuple[list[SymmetryTestRow], str]:
    """Re-measure every model of a finished study after a random equivalent re-parametrization.

    Args:
        study: The study (its configuration must be the folder's).
        out_dir: The study's output folder, with its checkpoints.
        scales: Range of the group elements' scale ``a`` (drawn log-uniformly per model).
        seed: Seed of the scales and of the group elements.
        specs: ``(measure, ρ)`` pairs (default: :func:`default_specs`).
        n_boot: Bootstrap resamples of the CIs.
        log: Progress lines (default: silent).

    Returns:
        The rows and the Markdown table (also written to the folder).

    Raises:
        FileNotFoundError: If the folder holds no finished study.
    """
    out = Path(out_dir)
    if not (out / "study.sqlite").is_file():
        raise FileNotFoundError(f"{out} holds no study.sqlite; run `geosharp study ...` first")
    specs = list(specs) if specs is not None else default_specs(study)
    say = log or (lambda msg: None)
    csv_path = out / CSV_FILE
    rows = read_rows(csv_path)
    done = {(r.model_id, r.measure) for r in rows}
    batches = study.batches()
    rng = np.random.default_rng(seed)
    with Store(out / "study.sqlite", study.name, study.config()) as store:
        models = [m for m in store.models() if study.included(m) and math.isfinite(m["gap"])]
        stored = {(r["model_id"], r["measure"], r["rho"]): r["value"] for r in store.measurements()}
    for i, row in enumerate(models):
        a = float(math.exp(rng.uniform(math.log(scales[0]), math.log(scales[1]))))
        todo = [(s, rho) for s, rho in specs if (row["model_id"], s.name) not in done]
        if not todo:
            continue
        if row.get("checkpoint"):
            row = {**row, "checkpoint_path": str(out / row["checkpoint"])}
        ready = study.prepare(row, batches)
        model, loss_fn, data = ready.model, ready.loss_fn, ready.batches
        space = ready.settings.get("space") or find_symmetries(model, key_bias=study.key_bias)
        gen = torch.Generator().manual_seed(seed + 1 + i)
        twin = reparametrize(model, generator=gen, scale=a, space=space)
        change = _relative_output_change(model, twin, data[0][0])
        for spec, rho in todo:
            kw = dict(spec.kwargs)
            original = stored.get((row["model_id"], spec.name, rho))
            if original is None:
                original = sharpness(
                    model, loss_fn, data, rho=rho, progress=False, space=space, **kw
                )
                original = original.value
            value = sharpness(twin, loss_fn, data, rho=rho, progress=False, space=space, **kw).value
            new = SymmetryTestRow(
                model_id=row["model_id"],
                measure=spec.name,
                rho=rho,
                scale=a,
                gap=row["gap"],
                original=original,
                reparametrized=value,
                output_rel_change=change,
            )
            rows.append(new)
            _append(csv_path, new)
        say(f"{row['model_id']}: a = {a:.3g}, outputs changed by {change:.1e}")
    table = _table(study, rows, n_boot)
    atomic_write_text(out / "symmetry_test.md", table)
    return rows, table


def _percent(x: float) -> str:
    """``2060``, ``12.5``, ``0.000168``: three significant digits, never an exponent."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def _append(path: Path, row: SymmetryTestRow) -> None:
    new = not path.is_file()
    with path.open("a", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(_FIELDS)
        w.writerow([getattr(row, k) for k in _FIELDS])


def symmetry_section(rows: Sequence[SymmetryTestRow], n_boot: int = 2000) -> Section:
    """The symmetry test as a report section: τ before and after, per measure.

    Args:
        rows: Rows of :func:`symmetry_test` (or read back with :func:`read_rows`).
        n_boot: Bootstrap resamples of the CIs.

    Returns:
        A :class:`~geosharp.studies.sections.Section`.
    """

    def f(x: float) -> str:
        return f"{x:+.2f}" if math.isfinite(x) else "undefined"

    body = []
    for measure in dict.fromkeys(r.measure for r in rows):
        sel = [r for r in rows if r.measure == measure]
        gaps = [r.gap for r in sel]
        before = correlation_summary(gaps, [r.original for r in sel], n_boot=n_boot, n_perm=1)
        after = correlation_summary(gaps, [r.reparametrized for r in sel], n_boot=n_boot, n_perm=1)
        d = tau_difference(
            gaps, [r.reparametrized for r in sel], [r.original for r in sel], n_boot=n_boot
        )
        moved = np.median([abs(r.reparametrized / r.original - 1) for r in sel if r.original])
        body.append(
            [
                measure,
                f"{sel[0].rho:g}",
                f"{f(before.tau_a)} [{f(before.ci_low)}, {f(before.ci_high)}]",
                f"{f(after.tau_a)} [{f(after.ci_low)}, {f(after.ci_high)}]",
                f"{f(d.diff)} [{f(d.ci_low)}, {f(d.ci_high)}]",
                f"{_percent(100 * moved)} %",
                str(len(sel)),
            ]
        )
    scales = [r.scale for r in rows]
    worst = max((r.output_rel_change for r in rows), default=math.nan)
    caption = (
        "Every model was replaced by an equivalent one: each symmetry block (GL(h) heads, "
        "diagonal pairs) re-parametrized by a random group element, its scale a drawn "
        f"log-uniformly per model (here from {min(scales, default=math.nan):.3g} to "
        f"{max(scales, default=math.nan):.3g}). The largest relative change of a model's "
        f"outputs was {worst:.1e} (rounding); the gaps are unchanged. Δτ = τ re-parametrized − "
        f"τ original with a paired bootstrap CI ({n_boot} resamples of the models); "
        "|value change| = |s(re-parametrized)/s(original) − 1|, median over the models."
    )
    header = [
        "measure",
        "ρ",
        "τ-a original [CI]",
        "τ-a re-parametrized [CI]",
        "Δτ [CI]",
        "median |value change|",
        "models",
    ]
    return Section(
        "τ before and after random equivalent re-parametrizations", header, body, caption
    )


def folder_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """The symmetry test of a study folder as report sections (none if it was not run).

    A folder-section provider of :data:`geosharp.studies.sections.FOLDER_SECTION_PROVIDERS`:
    every study report of a folder holding ``symmetry_test.csv`` shows this section. The
    gaps are the ones recorded in the rows (``gaps`` is not needed).
    """
    path = Path(out_dir) / CSV_FILE
    return [symmetry_section(read_rows(path))] if path.is_file() else []


def _table(study: Study, rows: Sequence[SymmetryTestRow], n_boot: int) -> str:
    return f"# {study.title}\n" + symmetry_section(rows, n_boot).markdown()
