"""Turn a study's results into files a person would rather look at (SPEC §7).

:func:`write_report` takes the trained models (with their generalization gaps) and the sharpness
measurements of a study and writes, into one folder:

- ``tau_table.md``: Kendall τ-a of every measure at every ρ, with a bootstrap CI and a
  permutation p-value, next to the paper's τ where the measure belongs to a family the paper
  reports (SPEC §7);
- ``plots/<measure>.png``: the measure against the gap, one panel per ρ;
- ``report.html``: one self-contained page (inline CSS, images embedded as base64) with the
  settings, the τ table, a plain verdict on whether our τ agrees with the paper's in sign and
  in the ordering of the families, the plots, the per-model table and notes;
- ``summary.json``: every τ, CI and p-value, machine-readable (NaN written as ``null``).

The statistics come from :mod:`geosharp.stats`; the plots need matplotlib (Agg backend, no
display needed).

This module only orchestrates; each concern has its own module:

- :mod:`geosharp.studies.analysis`: validation, τ per (measure, ρ) cell and the paired
  geodesic-vs-adaptive verdicts;
- :mod:`geosharp.studies.paper`: the comparison with the paper's τ (sign, ordering);
- :mod:`geosharp.studies.sections`: extra tables (:class:`Section`) and the study-folder files
  that become sections (:func:`folder_sections`, :func:`register_folder_section`);
- :mod:`geosharp.studies.plots`: the scatter plots;
- :mod:`geosharp.studies.render`: the Markdown table and the HTML page;
- :mod:`geosharp.studies.formatting`: how numbers and radii are written.

Example:
    A minimal call (not run as a doctest, it writes files)::

        from geosharp.studies.report import write_report

        models = [
            {"model_id": "m0", "gap": 0.12, "hparams": {"lr": 1e-3}},
            {"model_id": "m1", "gap": 0.08, "hparams": {"lr": 3e-3}},
            {"model_id": "m2", "gap": 0.15, "hparams": {"lr": 1e-2}},
        ]
        measurements = [
            {"model_id": "m0", "measure": "adaptive worst l2", "rho": 0.1, "value": 0.9},
            {"model_id": "m1", "measure": "adaptive worst l2", "rho": 0.1, "value": 0.4},
            {"model_id": "m2", "measure": "adaptive worst l2", "rho": 0.1, "value": 1.3},
        ]
        paths = write_report(
            "out/report",
            title="Toy study",
            models=models,
            measurements=measurements,
            settings={"batch size": 128, "ascent steps": 20},
            paper={"adaptive": -0.41},
        )
        print(paths.html)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from geosharp._io import atomic_write_text
from geosharp.studies.analysis import (
    FAMILY_ORDER,
    MIN_MODELS,
    Cell,
    check_models,
    collect,
    correlate,
    default_paper_match,
    geodesic_vs_adaptive,
    measure_family,
)
from geosharp.studies.flagged import flags_section, flags_sentence
from geosharp.studies.formatting import json_safe, rho_key, slug
from geosharp.studies.headline import headline
from geosharp.studies.paper import family_of, paper_columns
from geosharp.studies.plots import plot_measure
from geosharp.studies.render import Page, html_page, markdown_table, method_text
from geosharp.studies.sections import (
    DIAGNOSTICS_FILE,
    SECTIONS_FILE,
    Section,
    diagnostics_section,
    folder_sections,
    paired_section,
    register_folder_section,
)

__all__ = [
    "DIAGNOSTICS_FILE",
    "FAMILY_ORDER",
    "MIN_MODELS",
    "SECTIONS_FILE",
    "ReportOptions",
    "ReportPaths",
    "Section",
    "default_paper_match",
    "diagnostics_section",
    "folder_sections",
    "measure_family",
    "register_folder_section",
    "write_report",
]


@dataclass(frozen=True)
class ReportPaths:
    """Where :func:`write_report` wrote its files.

    Attributes:
        out_dir: The report folder.
        html: The self-contained HTML page.
        tau_table: The Markdown τ table.
        summary_json: Every τ, CI and p-value as JSON.
        plots: Measure name → its scatter plot (PNG).
        headline: The report's headline sentences (:func:`geosharp.studies.headline.headline`).
    """

    out_dir: Path
    html: Path
    tau_table: Path
    summary_json: Path
    plots: dict[str, Path] = field(default_factory=dict)
    headline: list[str] = field(default_factory=list)


@dataclass
class _Analysis:
    """Everything :func:`write_report` computed before writing a file."""

    models: list[dict[str, object]]
    gaps: dict[str, float]
    cells: dict[str, dict[float | None, Cell]]
    rhos: list[float | None]
    paper_col: dict[str, str] | None
    comparison: dict[str, object] | None
    paired: list[dict[str, object]]


def _geosharp_version() -> str:
    from geosharp._version import __version__

    return __version__


@dataclass(frozen=True)
class ReportOptions:
    """The optional choices of :func:`write_report` (each also accepted as its keyword).

    Attributes:
        paper: Family label → the paper's τ for this population (SPEC §7), e.g.
            ``{"adaptive": -0.41, "geodesic inv": -0.71, "geodesic mix": -0.70}``.
        notes: Free-text notes shown at the end of the page.
        gap_label: How the gap is named in tables and axes, e.g. "test − train error".
        paper_match: Measure name → family label in ``paper`` (or None); defaults to
            :func:`default_paper_match`.
        sections: Extra tables shown after the τ tables (and appended to ``tau_table.md``).
        n_boot: Bootstrap resamples for each CI.
        n_perm: Permutations for each p-value.
        level: Coverage of the CIs.
        seed: Seed of the bootstrap and the permutations.
        expected: ``"positive"`` or ``"negative"``: the sign of τ stated before measuring,
            the paired verdict's direction when there is no paper τ (``None``: from the data).
    """

    paper: Mapping[str, float] | None = None
    notes: Sequence[str] = ()
    gap_label: str = "generalization gap"
    paper_match: Callable[[str], str | None] = default_paper_match
    sections: Sequence[Section] = ()
    n_boot: int = 2000
    n_perm: int = 2000
    level: float = 0.95
    seed: int = 0
    expected: str | None = None


def write_report(
    out_dir: str | Path,
    *,
    title: str,
    models: list[dict],
    measurements: list[dict],
    settings: dict,
    options: ReportOptions | None = None,
    **choices: Any,
) -> ReportPaths:
    """Write the τ table, scatter plots, HTML page and JSON summary of a study.

    For every measure and ρ, τ-a is computed between the models' gaps and the measured
    sharpness over the models that have a finite value for both (:mod:`geosharp.stats`), with a
    percentile-bootstrap CI over models and a two-sided permutation p-value. A cell with fewer
    than 3 such models, or where all gaps (or all values) are equal, is reported as
    "undefined"; nothing is ever written as a bare NaN.

    Args:
        out_dir: Folder to write into (created if missing; existing files are overwritten).
        title: Title of the report.
        models: One dict per trained model with ``model_id`` (str, unique) and ``gap``
            (float), optionally ``train_loss``, ``test_loss``, ``train_err``, ``test_err``
            and ``hparams`` (dict).
        measurements: One dict per (model, measure, ρ) with ``model_id``, ``measure`` (str),
            ``rho`` (float, or None for a measure without a radius) and ``value`` (float; None
            or NaN for a failed measurement), optionally ``per_batch`` (ignored here) and
            ``time_s`` (its median per cell goes into ``summary.json``).
        settings: Free-form settings of the study (shown as a table).
        options: The optional choices (:class:`ReportOptions`: paper τ, notes, gap label,
            sections, bootstrap and permutation counts, level, seed, expected sign).
        **choices: Any field of :class:`ReportOptions` by keyword (``paper=…``,
            ``gap_label=…``), replacing that of ``options``.

    Returns:
        The paths written, as a :class:`ReportPaths`.

    Raises:
        ValueError: If a model lacks ``model_id`` or ``gap``, ids repeat, a measurement names
            an unknown model or repeats a (model, measure, ρ), or a number is not a number.
        TypeError: On a keyword that is not a field of :class:`ReportOptions`.
        ImportError: If matplotlib is not installed.
    """
    unknown = sorted(set(choices) - {f.name for f in fields(ReportOptions)})
    if unknown:
        raise TypeError(f"write_report() got unexpected keyword argument(s): {', '.join(unknown)}")
    opts = replace(options or ReportOptions(), **choices)
    out = Path(out_dir)
    analysis = _analyse(models, measurements, opts)
    level = opts.level
    lead = headline(len(analysis.models), analysis.cells, analysis.paired, level)
    flagged = flags_sentence(measurements)
    if flagged is not None:
        lead.append(flagged)
    flag_table = flags_section(
        measurements,
        analysis.gaps,
        level=level,
        n_boot=opts.n_boot,
        n_perm=opts.n_perm,
        seed=opts.seed,
    )
    # the orbit spread (when recorded: issue 44), as given, the flagged cells (when
    # recorded), the folder's
    spread = _orbit_spread(out, analysis, lead)
    extra_sections = [*spread, *opts.sections, *flag_table, *folder_sections(out, analysis.gaps)]
    all_sections = [*paired_section(analysis.paired, level), *extra_sections]
    method = method_text(
        n_total=len(analysis.models),
        gap_label=opts.gap_label,
        level=level,
        n_boot=opts.n_boot,
        n_perm=opts.n_perm,
        seed=opts.seed,
    )
    out.mkdir(parents=True, exist_ok=True)
    plots, images = _write_plots(out / "plots", analysis, opts.gap_label)
    written = _Written(
        title=title,
        settings=settings,
        options=opts,
        sections=extra_sections,
        version=_geosharp_version(),
        generated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )

    tau_table = out / "tau_table.md"
    atomic_write_text(
        tau_table,
        markdown_table(
            title,
            opts.gap_label,
            analysis.cells,
            analysis.rhos,
            paper_col=analysis.paper_col,
            n_total=len(analysis.models),
            method=method,
            headline=lead,
        )
        + "".join(section.markdown() for section in all_sections),
    )
    summary = _summary(analysis, written=written)
    summary = {"title": summary["title"], "headline": lead, **summary}  # said first
    summary_json = out / "summary.json"
    atomic_write_text(
        summary_json,
        json.dumps(json_safe(summary), indent=2, ensure_ascii=False, allow_nan=False) + "\n",
    )
    page = out / "report.html"
    content = Page(
        title=title,
        gap_label=opts.gap_label,
        settings=settings,
        models=analysis.models,
        cells=analysis.cells,
        rhos=analysis.rhos,
        paper_col=analysis.paper_col,
        comparison=analysis.comparison,
        sections=all_sections,
        images=images,
        notes=opts.notes,
        method=method,
        version=written.version,
        generated_at=written.generated_at,
        headline=lead,
    )
    atomic_write_text(page, html_page(page=content))
    return ReportPaths(
        out_dir=out,
        html=page,
        tau_table=tau_table,
        summary_json=summary_json,
        plots=plots,
        headline=lead,
    )


@dataclass(frozen=True)
class _Written:
    """What ``summary.json`` says besides the analysis (:func:`_summary`)."""

    title: str
    settings: Mapping[str, object]
    options: ReportOptions
    sections: Sequence[Section]
    version: str
    generated_at: str


def _orbit_spread(out: Path, analysis: _Analysis, lead: list[str]) -> list[Section]:
    """The orbit spread sections of a folder that recorded its heads (none otherwise).

    With their one-line note added to the headline.
    """
    from geosharp.studies.orbit_spread import folder_rows, population_spread
    from geosharp.studies.orbit_spread_report import spread_note, spread_sections

    rows = folder_rows(out)
    found = spread_sections(rows, analysis.gaps, analysis.paired)
    note = spread_note(population_spread(rows, analysis.gaps)) if found else None
    if note is not None:
        lead.append(note)
    return found


def _analyse(models: list[dict], measurements: list[dict], opts: ReportOptions) -> _Analysis:
    """Step 1 of :func:`write_report`: validate, correlate, compare with the paper, pair."""
    rows = check_models(models)
    gaps = {str(m["model_id"]): float(m["gap"]) for m in rows}  # type: ignore[arg-type]
    cells = correlate(
        collect(measurements, set(gaps)),
        gaps,
        n_boot=opts.n_boot,
        n_perm=opts.n_perm,
        level=opts.level,
        seed=opts.seed,
    )
    rhos = sorted({r for by_rho in cells.values() for r in by_rho}, key=rho_key)
    paper_col, comparison = paper_columns(cells, opts.paper, opts.paper_match, opts.level)
    paired = geodesic_vs_adaptive(
        cells,
        gaps,
        opts.paper,
        n_boot=opts.n_boot,
        level=opts.level,
        seed=opts.seed,
        expected=opts.expected,
    )
    return _Analysis(
        models=rows,
        gaps=gaps,
        cells=cells,
        rhos=rhos,
        paper_col=paper_col,
        comparison=comparison,
        paired=paired,
    )


def _write_plots(
    plot_dir: Path, analysis: _Analysis, gap_label: str
) -> tuple[dict[str, Path], dict[str, bytes]]:
    """Step 2: one PNG per measure; returns measure → path and measure → PNG bytes."""
    plot_dir.mkdir(exist_ok=True)
    taken: set[str] = set()
    plots: dict[str, Path] = {}
    images: dict[str, bytes] = {}
    for measure, by_rho in analysis.cells.items():
        path = plot_dir / f"{slug(measure, taken)}.png"
        images[measure] = plot_measure(path, measure, by_rho, analysis.gaps, gap_label)
        plots[measure] = path
    return plots, images


def _summary(analysis: _Analysis, *, written: _Written) -> dict[str, object]:
    """Step 3: the content of ``summary.json`` (before NaN becomes ``null``)."""
    opts = written.options
    paper = opts.paper

    def cell_json(cell: Cell) -> dict[str, object]:
        s = cell.summary
        assert s is not None
        fam = family_of(cell.measure, paper, opts.paper_match)
        return {
            "measure": cell.measure,
            "rho": cell.rho,
            "tau_a": s.tau_a,
            "tau_b": s.tau_b,
            "ci_low": s.ci_low,
            "ci_high": s.ci_high,
            "p_value": s.p_value,
            "n_models": s.n_models,
            "n_dropped": s.n_dropped,
            "defined": s.defined,
            "note": s.note,
            "paper_family": fam,
            "paper_tau": float(paper[fam]) if paper is not None and fam is not None else None,
            "median_time_s": float(np.median(cell.times)) if cell.times else None,
        }

    return {
        "title": written.title,
        "geosharp_version": written.version,
        "generated_at": written.generated_at,
        "n_models": len(analysis.models),
        "gap_label": opts.gap_label,
        "settings": written.settings,
        "statistic": "Kendall tau-a (tau-b also given)",
        "ci": {
            "method": "percentile bootstrap over models",
            "level": opts.level,
            "n_boot": opts.n_boot,
        },
        "p_value": {"method": "two-sided permutation test", "n_perm": opts.n_perm},
        "seed": opts.seed,
        "cells": [
            cell_json(by_rho[r])
            for by_rho in analysis.cells.values()
            for r in sorted(by_rho, key=rho_key)
        ],
        "paper_comparison": analysis.comparison,
        "geodesic_vs_adaptive": analysis.paired,
        "sections": [
            {"title": x.title, "header": x.header, "rows": x.rows, "caption": x.caption}
            for x in written.sections
        ],
        "notes": list(opts.notes),
    }
