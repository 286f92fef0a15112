"""Extra tables of a study report (:class:`Section`) and where they come from.

A section is a titled table with a caption, rendered into ``tau_table.md`` and ``report.html``
after the τ tables. Three sources:

- the paired geodesic-vs-adaptive comparison of :mod:`geosharp.studies.analysis`
  (:func:`paired_section`);
- the ``sections`` argument of :func:`geosharp.studies.report.write_report`;
- files found in the study folder, by the providers of :func:`folder_sections` (see there).
"""

from __future__ import annotations

import csv
import html
import importlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geosharp.stats import correlation_summary
from geosharp.studies.analysis import MIN_MODELS
from geosharp.studies.formatting import fmt

__all__ = [
    "DIAGNOSTICS_FILE",
    "FOLDER_SECTION_PROVIDERS",
    "RESULT_FILES",
    "SECTIONS_FILE",
    "FolderSectionProvider",
    "Section",
    "diagnostics_section",
    "diagnostics_sections",
    "folder_sections",
    "json_sections",
    "paired_section",
    "register_folder_section",
]


@dataclass(frozen=True)
class Section:
    """An extra table of a report (e.g. the symmetry test), shown after the τ tables.

    Attributes:
        title: Heading.
        header: Column names.
        rows: Cells, already formatted.
        caption: How the numbers were obtained (one paragraph).
    """

    title: str
    header: list[str]
    rows: list[list[str]]
    caption: str

    def markdown(self) -> str:
        """The section as Markdown: heading, table, caption."""

        def esc(text: str) -> str:
            return text.replace("|", "\\|")

        lines = ["", f"## {self.title}", "", "| " + " | ".join(map(esc, self.header)) + " |"]
        lines.append("|" + "---|" * len(self.header))
        lines += ["| " + " | ".join(map(esc, row)) + " |" for row in self.rows]
        return "\n".join([*lines, "", self.caption, ""])

    def html(self) -> list[str]:
        """The section as HTML lines."""
        e = html.escape
        out = [f"<h2>{e(self.title)}</h2>", f'<p class="method">{e(self.caption)}</p>', "<table>"]
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in self.header) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in self.rows]
        return [*out, "</table>"]


PAIRED_HEAD = [
    "geodesic",
    "adaptive",
    "grid position",
    "τ geodesic",
    "τ adaptive",
    "Δτ [CI]",
    "verdict",
]
PAIRED_METHOD = (
    "Δτ = τ-a(geodesic) − τ-a(adaptive) on the same models, at the same position of the two ρ "
    "grids; [low, high] = {level:g} % paired percentile bootstrap CI (both τ recomputed on each "
    "resample of the models). Stronger: correlates more strongly with the gap in the expected "
    "direction, i.e. the CI of s·Δτ lies above 0 (geodesic) or below 0 (adaptive), where s is "
    "the sign of the paper's τ for the geodesic family or, with no paper value, the sign of "
    "τ-geodesic + τ-adaptive; a CI containing 0 is no clear difference."
)


def paired_rows(paired: Sequence[Mapping[str, object]]) -> list[list[str]]:
    rows = []
    for p in paired:
        k, size = int(p["position"]), int(p["grid_size"])  # type: ignore[call-overload]
        position = (
            "single ρ"
            if size == 1
            else "smallest ρ"
            if k == 0
            else "largest ρ"
            if k == size - 1
            else "middle ρ"
            if size == 3
            else f"ρ #{k + 1}"
        )
        rows.append(
            [
                f"{p['geodesic']} (ρ = {p['rho_geodesic']:g})",
                f"{p['adaptive']} (ρ = {p['rho_adaptive']:g})",
                position,
                fmt(float(p["tau_geodesic"])),  # type: ignore[arg-type]
                fmt(float(p["tau_adaptive"])),  # type: ignore[arg-type]
                f"{fmt(float(p['diff']))} [{fmt(float(p['ci_low']))}, "  # type: ignore[arg-type]
                f"{fmt(float(p['ci_high']))}]",  # type: ignore[arg-type]
                str(p["verdict"]),
            ]
        )
    return rows


def paired_section(paired: Sequence[Mapping[str, object]], level: float) -> list[Section]:
    """The paired comparison as a report section (none when nothing was compared)."""
    if not paired:
        return []
    title = "Geodesic against adaptive sharpness, model by model"
    method = PAIRED_METHOD.format(level=100 * level)
    stated = {p["direction"] for p in paired if p.get("direction_from") == "stated (--expect)"}
    if stated:
        method += (
            f" Here s is the direction stated before measuring (--expect {', '.join(stated)}),"
            " not the sign of τ-geodesic + τ-adaptive."
        )
    return [Section(title, list(PAIRED_HEAD), paired_rows(paired), method)]


#: Files of a study folder that :func:`write_report` turns into sections when present.
DIAGNOSTICS_FILE = "diagnostics.csv"
SECTIONS_FILE = "sections.json"


def diagnostics_section(
    path: str | Path, gaps: Mapping[str, float], level: float = 0.95, seed: int = 0
) -> Section | None:
    """The per-model diagnostics of a study folder (``diagnostics.csv``) as a report section.

    The file has one row per model (``model_id`` and numeric columns, written by a study:
    :mod:`geosharp.estimators.diagnostics`, e.g. Study 4's orbit position and ascent optima).
    Each column becomes a row: median [min, max] over the analysed models and its Kendall τ-a
    with the gap [bootstrap CI]. Models not in ``gaps`` (excluded) are left out.

    Returns:
        The section, or ``None`` when the file is missing or has no analysed model.
    """
    p = Path(path)
    if not p.is_file():
        return None
    data: dict[str, dict[str, float]] = {}
    with p.open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if None in row or row.get("model_id") not in gaps:
                continue
            try:
                data[row["model_id"]] = {
                    k: float(v) for k, v in row.items() if k != "model_id" and v not in ("", None)
                }
            except ValueError:
                continue
    if not data:
        return None
    columns = list(dict.fromkeys(k for d in data.values() for k in d))
    rows = []
    for col in columns:
        ids = [m for m, d in data.items() if col in d and math.isfinite(d[col])]
        vals = np.array([data[m][col] for m in ids])
        if not vals.size:
            continue
        s = correlation_summary(
            [gaps[m] for m in ids],
            vals,
            n_boot=2000,
            n_perm=200,
            level=level,
            seed=seed,
            min_models=MIN_MODELS,
        )
        tau = f"{fmt(s.tau_a)} [{fmt(s.ci_low)}, {fmt(s.ci_high)}]" if s.defined else "undefined"
        rows.append(
            [
                col,
                f"{np.median(vals):.4g}",
                f"{vals.min():.4g}",
                f"{vals.max():.4g}",
                tau,
                str(len(ids)),
            ]
        )
    caption = (
        f"One row per column of {p.name} (one line per model): median, min and max over the "
        f"analysed models, and Kendall τ-a with the gap [{100 * level:g} % percentile bootstrap "
        "CI]. imbalance = √Σ‖GᵀG−HᵀH‖²/√Σ‖GᵀG+HᵀH‖² over the heads of a block kind; excess = "
        "Σ(‖G‖²+‖H‖²)/Σ min − 1, min = 2Σ√λ((GᵀG)(HᵀH)) the orbit's minimum norm; log_ratio = "
        "mean ½log(‖G‖/‖H‖); <measure>_share_<kind> = share of ‖ξ*‖² at the Auto-PGD optimum; "
        "<measure>_order2 = ‖½Γ(ξ*,ξ*)‖/‖ξ*‖ (_blocks: relative to the block part of ξ*) "
        "(geosharp.estimators.diagnostics)."
    )
    header = ["diagnostic", "median", "min", "max", "τ-a with the gap [CI]", "models"]
    return Section(
        "Diagnostics: orbit position and where the ascent spends its budget", header, rows, caption
    )


def json_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """The sections of a study folder's ``sections.json`` (none if it is missing).

    ``sections.json`` is a list of ``{"title", "header", "rows", "caption"}`` written by a
    study's own analysis (e.g. ``python -m geosharp.studies.vit_orbit analyse DIR``).
    """
    path = Path(out_dir) / SECTIONS_FILE
    if not path.is_file():
        return []
    return [
        Section(
            str(item["title"]),
            [str(h) for h in item["header"]],
            [[str(c) for c in r] for r in item["rows"]],
            str(item.get("caption", "")),
        )
        for item in json.loads(path.read_text(encoding="utf-8"))
    ]


def diagnostics_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """:func:`diagnostics_section` of a study folder's ``diagnostics.csv``, as a list."""
    found = diagnostics_section(Path(out_dir) / DIAGNOSTICS_FILE, gaps)
    return [] if found is None else [found]


#: A folder-section provider: ``(study folder, model id → gap of the analysed models)`` →
#: the sections it finds there (an empty list when its files are missing).
FolderSectionProvider = Callable[[Path, Mapping[str, float]], Sequence[Section]]

#: The providers :func:`folder_sections` asks, in the order their sections appear: a
#: callable, or ``"module:function"`` imported when a report is written (so an add-on such as
#: ``geosharp symmetry-test`` is known by the report's list of providers, not by the study
#: runner, and is imported only when a report is made). Add one with
#: :func:`register_folder_section`.
FOLDER_SECTION_PROVIDERS: list[str | FolderSectionProvider] = [
    "geosharp.studies.symmetry_test:folder_sections",  # symmetry_test.csv
    "geosharp.studies.twin_section:folder_sections",  # twin_check.csv (--twin-check)
    diagnostics_sections,  # diagnostics.csv
    json_sections,  # sections.json
    "geosharp.studies.population_sections:population_sections",  # manifest.json, models.json
]


#: Files of a study folder that are results rather than checkpoints, beside ``study.sqlite``:
#: what the providers read, and what a study's own analysis wrote.
#: :func:`geosharp.studies.study_report.export_study` copies those that exist (and rebuilds the
#: report from them).
RESULT_FILES: list[str] = [
    "symmetry_test.csv",  # geosharp symmetry-test: rows
    "symmetry_test.md",  # geosharp symmetry-test: its table
    "twin_check.csv",  # geosharp study MANIFEST --twin-check: model and twin, cell by cell
    DIAGNOSTICS_FILE,
    SECTIONS_FILE,
    "analysis.md",  # a study's preregistered analysis (e.g. Study 4)
    "PREREGISTRATION.md",
    "manifest.json",  # a population study's manifest record (geosharp study MANIFEST)
    "models.json",  # its models' architectures and symmetry blocks
]


def register_folder_section(
    provider: str | FolderSectionProvider,
    *,
    files: Sequence[str] = (),
    before: str | FolderSectionProvider | None = None,
) -> None:
    """Make :func:`folder_sections` (and so every study report) ask ``provider`` too.

    Args:
        provider: A callable ``(folder, gaps) -> list[Section]``, or ``"module:function"``.
        files: The names of the files it reads in a study folder (added to
            :data:`RESULT_FILES`, so an exported study keeps the section).
        before: Insert it before this provider (default: last). Registering a provider that is
            already there (the same callable, or its ``"module:function"``) does nothing.

    Example:
        >>> def notes(folder, gaps):
        ...     return []
        >>> register_folder_section(notes)
        >>> FOLDER_SECTION_PROVIDERS[-1] is notes
        True
        >>> FOLDER_SECTION_PROVIDERS.remove(notes)
    """
    RESULT_FILES.extend(f for f in files if f not in RESULT_FILES)
    if _key(provider) in {_key(p) for p in FOLDER_SECTION_PROVIDERS}:
        return
    at = len(FOLDER_SECTION_PROVIDERS) if before is None else FOLDER_SECTION_PROVIDERS.index(before)
    FOLDER_SECTION_PROVIDERS.insert(at, provider)


def _key(provider: str | FolderSectionProvider) -> str:
    """``"module:function"`` of a provider, so a callable and its name count as one."""
    if isinstance(provider, str):
        return provider
    module = getattr(provider, "__module__", "")
    return f"{module}:{getattr(provider, '__qualname__', repr(provider))}"


def _resolve(provider: str | FolderSectionProvider) -> FolderSectionProvider:
    if callable(provider):
        return provider
    module, _, name = provider.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def folder_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """Every section the providers find in a study folder (:data:`FOLDER_SECTION_PROVIDERS`).

    By default: the symmetry test (``symmetry_test.csv``, :mod:`geosharp.studies.symmetry_test`),
    the twin check (``twin_check.csv``, :mod:`geosharp.studies.twin_section`), then
    ``diagnostics.csv`` (:func:`diagnostics_section`), then ``sections.json``
    (:func:`json_sections`).
    """
    out = Path(out_dir)
    found: list[Section] = []
    for provider in FOLDER_SECTION_PROVIDERS:
        found.extend(_resolve(provider)(out, gaps))
    return found
