"""Turn a study's results into files a person would rather look at (SPEC §7).

:func:`write_report` takes the trained models (with their generalization gaps) and the sharpness
measurements of a study and writes, into one folder:

- ``tau_table.md``: Kendall τ-a of every measure at every ρ, with a bootstrap CI and a
  permutation p-value, next to the paper's τ where the measure belongs to a family the paper
  reports (SPEC §7);
- ``plots/<measure>.png``: sharpness against gap, one colour per ρ;
- ``report.html``: one self-contained page (inline CSS, images embedded as base64) with the
  settings, the τ table, a plain verdict on whether our τ agrees with the paper's in sign and
  in the ordering of the families, the plots, the per-model table and notes;
- ``summary.json``: every τ, CI and p-value, machine-readable (NaN written as ``null``).

The statistics come from :mod:`geosharp.stats`; the plots need matplotlib (Agg backend, no
display needed).

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

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from geosharp._html import page_end, page_start
from geosharp._io import atomic_write_bytes, atomic_write_text
from geosharp.stats import CorrelationSummary, correlation_summary, tau_difference

__all__ = ["ReportPaths", "default_paper_match", "measure_family", "write_report"]

#: A (measure, ρ) cell needs at least this many models with finite values for τ.
MIN_MODELS = 3

_OPTIONAL_MODEL_FIELDS = ("train_loss", "test_loss", "train_err", "test_err")


@dataclass(frozen=True)
class ReportPaths:
    """Where :func:`write_report` wrote its files.

    Attributes:
        out_dir: The report folder.
        html: The self-contained HTML page.
        tau_table: The Markdown τ table.
        summary_json: Every τ, CI and p-value as JSON.
        plots: Measure name → its scatter plot (PNG).
    """

    out_dir: Path
    html: Path
    tau_table: Path
    summary_json: Path
    plots: dict[str, Path] = field(default_factory=dict)


#: The kinds of rows of a τ table, in the order they are listed (a stable sort by kind).
FAMILY_ORDER = ("sharpness", "relative flatness", "curvature")


def measure_family(measure: str) -> str:
    """The kind of a measure: ``"curvature"``, ``"relative flatness"`` or ``"sharpness"``.

    Curvature rows (:func:`geosharp.curvature`, named like ``"geodesic-inv curvature
    lambda_max"``) are their own family: no paper τ, listed after the sharpness measures.

    Example:
        >>> measure_family("adaptive curvature trace"), measure_family("adaptive worst l2")
        ('curvature', 'sharpness')
    """
    name = re.sub(r"[\s_]+", "-", measure.strip().lower())
    if re.search(r"(^|-)curvature(-|$)", name):
        return "curvature"
    if name == "relative-flatness":
        return "relative flatness"
    return "sharpness"


def default_paper_match(measure: str) -> str | None:
    """Map a measure name to the family label the paper reports it under (SPEC §7).

    Names are compared case-insensitively with spaces and underscores read as hyphens.

    Args:
        measure: A measure name, e.g. ``"geodesic-inv-o2 worst l2"``.

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
    name = re.sub(r"[\s_]+", "-", measure.strip().lower())
    if "adaptivenorm" in name or measure_family(measure) == "curvature":
        return None
    if "adaptive" in name:
        return "adaptive"
    if name.startswith("geodesic-inv"):
        return "geodesic inv"
    if name.startswith("geodesic-mix"):
        return "geodesic mix"
    return None


# --------------------------------------------------------------------------------------------
# input validation


def _number(value: object, where: str, *, none_is_nan: bool) -> float:
    if value is None and none_is_nan:
        return math.nan
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{where} must be a number; got {value!r:.80}")
    try:  # int, float, numpy scalars, 0-d arrays and tensors
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} must be a number; got {value!r:.80}") from err


def _check_models(models: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    if not models:
        raise ValueError("models is empty; pass one dict per trained model")
    out: list[dict[str, object]] = []
    seen: set[str] = set()
    for i, model in enumerate(models):
        if not isinstance(model, Mapping):
            raise ValueError(f"models[{i}] must be a dict; got {type(model).__name__}")
        for key in ("model_id", "gap"):
            if key not in model:
                raise ValueError(f"models[{i}] has no {key!r}; every model needs model_id and gap")
        model_id = model["model_id"]
        if not isinstance(model_id, str):
            raise ValueError(f"models[{i}]['model_id'] must be a str; got {model_id!r:.80}")
        if model_id in seen:
            raise ValueError(f"model_id {model_id!r} appears twice in models; ids must be unique")
        seen.add(model_id)
        row: dict[str, object] = {
            "model_id": model_id,
            "gap": _number(model["gap"], f"models[{i}]['gap']", none_is_nan=False),
        }
        for key in _OPTIONAL_MODEL_FIELDS:
            if model.get(key) is not None:
                row[key] = _number(model[key], f"models[{i}][{key!r}]", none_is_nan=True)
        hparams = model.get("hparams") or {}
        if not isinstance(hparams, Mapping):
            raise ValueError(f"models[{i}]['hparams'] must be a dict; got {hparams!r:.80}")
        row["hparams"] = dict(hparams)
        out.append(row)
    return out


@dataclass
class _Cell:
    """The measurements of one (measure, ρ) pair and their correlation with the gap."""

    measure: str
    rho: float | None
    model_ids: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    summary: CorrelationSummary | None = None


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


def _collect(
    measurements: Sequence[Mapping[str, object]], model_ids: set[str]
) -> dict[str, dict[float | None, _Cell]]:
    cells: dict[str, dict[float | None, _Cell]] = {}
    seen: set[tuple[str, str, float | None]] = set()
    for i, meas in enumerate(measurements):
        if not isinstance(meas, Mapping):
            raise ValueError(f"measurements[{i}] must be a dict; got {type(meas).__name__}")
        for key in ("model_id", "measure", "value"):
            if key not in meas:
                raise ValueError(
                    f"measurements[{i}] has no {key!r}; every measurement needs model_id, "
                    "measure, rho and value"
                )
        model_id, measure = meas["model_id"], meas["measure"]
        if model_id not in model_ids:
            raise ValueError(
                f"measurements[{i}] refers to model_id {model_id!r}, which is not in models"
            )
        if not isinstance(measure, str) or not measure:
            raise ValueError(f"measurements[{i}]['measure'] must be a non-empty str")
        rho_raw = meas.get("rho")
        rho = (
            None
            if rho_raw is None
            else _number(rho_raw, f"measurements[{i}]['rho']", none_is_nan=False)
        )
        key = (str(model_id), measure, rho)
        if key in seen:
            raise ValueError(
                f"measurements[{i}] repeats model {model_id!r}, measure {measure!r}, ρ={rho}; "
                "pass each (model, measure, ρ) once (average replicates beforehand)"
            )
        seen.add(key)
        cell = cells.setdefault(measure, {}).setdefault(rho, _Cell(measure, rho))
        cell.model_ids.append(str(model_id))
        cell.values.append(_number(meas["value"], f"measurements[{i}]['value']", none_is_nan=True))
        if meas.get("time_s") is not None:
            cell.times.append(
                _number(meas["time_s"], f"measurements[{i}]['time_s']", none_is_nan=True)
            )
    return cells


def _rho_key(rho: float | None) -> tuple[int, float]:
    return (0, 0.0) if rho is None else (1, rho)


def _rho_label(rho: float | None) -> str:
    return "no ρ" if rho is None else f"ρ = {rho:g}"


def _layout(
    cells: dict[str, dict[float | None, _Cell]], rhos: list[float | None]
) -> tuple[list[str], dict[str, list[float | str | None]], bool]:
    """Columns of the τ table: one per ρ, or one per grid position when grids differ.

    When every measure has its own ρ grid (radii of different balls are not comparable), a
    column per distinct ρ leaves most cells empty; the table then has one column per position
    in a measure's sorted grid (smallest, next, …, largest) and every cell names its ρ.

    Returns:
        Column headers, the ρ of every (measure, column) (``"missing"`` where a measure has no
        such column), and whether cells must name their ρ.
    """
    longest = max((len(by_rho) for by_rho in cells.values()), default=0)
    if len(rhos) <= longest or longest < 2:
        return [_rho_label(r) for r in rhos], {m: list(rhos) for m in cells}, False
    middle = ["middle ρ"] if longest == 3 else [f"ρ #{k}" for k in range(2, longest)]
    headers = ["smallest ρ", *middle, "largest ρ"]
    grid: dict[str, list[float | str | None]] = {}
    for measure, by_rho in cells.items():
        own: list[float | str | None] = sorted(by_rho, key=_rho_key)
        if len(own) == 1:  # a single ρ (or none, e.g. relative flatness) goes first
            grid[measure] = own + ["missing"] * (longest - 1)
        else:
            grid[measure] = own + ["missing"] * (longest - len(own))
    return headers, grid, True


# --------------------------------------------------------------------------------------------
# formatting


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "undefined"


def _p(p: float) -> str:
    return f"{p:.2g}" if math.isfinite(p) else "undefined"


def _undefined_reason(summary: CorrelationSummary) -> str:
    return summary.note.replace(": τ undefined", "")


def _cell_text(cell: _Cell | None, n_total: int) -> str:
    if cell is None:
        return "–"
    s = cell.summary
    assert s is not None
    if not s.defined:
        return f"undefined ({_undefined_reason(s)})"
    text = f"{_f(s.tau_a)} [{_f(s.ci_low)}, {_f(s.ci_high)}], p = {_p(s.p_value)}"
    if s.n_models != n_total:
        text += f" (n = {s.n_models})"
    return text


def _json_safe(obj: object) -> object:
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (bool, str)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def _display(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "–"
    return json.dumps(_json_safe(value), ensure_ascii=False)


def _slug(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "measure"
    slug, k = base, 2
    while slug in taken:
        slug, k = f"{base}-{k}", k + 1
    taken.add(slug)
    return slug


# --------------------------------------------------------------------------------------------
# comparison with the paper


@dataclass
class _Family:
    label: str
    paper_tau: float
    cells: list[_Cell]

    @property
    def defined(self) -> list[_Cell]:
        return [c for c in self.cells if c.summary is not None and c.summary.defined]

    def sign_verdict(self) -> str:
        cells = self.defined
        if not cells:
            return "undefined"
        same = sum(np.sign(c.summary.tau_a) == np.sign(self.paper_tau) for c in cells)
        if same == len(cells):
            return "same"
        return "opposite" if same == 0 else "mixed"

    def best(self) -> _Cell | None:
        cells = self.defined
        return max(cells, key=lambda c: abs(c.summary.tau_a)) if cells else None


def _family_of(
    measure: str, paper: Mapping[str, float] | None, paper_match: Callable[[str], str | None]
) -> str | None:
    if not paper:
        return None
    label = paper_match(measure)
    return label if label is not None and label in paper else None


_GEODESIC_MAIN = re.compile(r"^geodesic-(inv|mix)-o2 (worst|average) l2$")


def _geodesic_vs_adaptive(
    cells: dict[str, dict[float | None, _Cell]],
    gaps: Mapping[str, float],
    paper: Mapping[str, float] | None,
    n_boot: int,
    level: float,
    seed: int,
) -> list[dict[str, object]]:
    """Paired comparison of each geodesic measure with adaptive ℓ2 of the same kind.

    ``geodesic-{inv,mix}-o2 {worst,average} l2`` is compared with ``adaptive {worst,average}
    l2`` at the same position of their ρ grids (smallest with smallest, …; radii of different
    balls are not comparable, positions are): ``Δτ = τ_geo − τ_ada`` on the models that have
    both values, with a paired bootstrap CI (:func:`geosharp.stats.tau_difference`). The
    direction that counts as "stronger" is the sign of the paper's τ for the geodesic family,
    or of τ_geo when the study has no paper value.
    """
    out: list[dict[str, object]] = []
    for name, by_rho in cells.items():
        match = _GEODESIC_MAIN.match(name)
        base = f"adaptive {match.group(2)} l2" if match else None
        if base is None or base not in cells:
            continue
        geo_rhos = sorted(by_rho, key=_rho_key)
        ada_rhos = sorted(cells[base], key=_rho_key)
        if len(geo_rhos) != len(ada_rhos):
            continue
        family = f"geodesic {match.group(1)}"  # type: ignore[union-attr]
        for k, (rg, ra) in enumerate(zip(geo_rhos, ada_rhos, strict=True)):
            cg, ca = by_rho[rg], cells[base][ra]
            va = dict(zip(ca.model_ids, ca.values, strict=True))
            ids = [m for m in cg.model_ids if m in va]
            vg = dict(zip(cg.model_ids, cg.values, strict=True))
            d = tau_difference(
                [gaps[m] for m in ids],
                [vg[m] for m in ids],
                [va[m] for m in ids],
                n_boot=n_boot,
                level=level,
                seed=seed,
            )
            tg = cg.summary.tau_a if cg.summary else math.nan
            ta = ca.summary.tau_a if ca.summary else math.nan
            ref = float(paper[family]) if paper and family in paper else tg
            sign = 1.0 if ref > 0 else -1.0
            if not math.isfinite(d.ci_low):
                verdict = "undefined"
            else:  # in the expected direction: > 0 means the geodesic τ is stronger
                lo, hi = sorted((sign * d.ci_low, sign * d.ci_high))
                verdict = (
                    "geodesic stronger"
                    if lo > 0
                    else "adaptive stronger"
                    if hi < 0
                    else "no clear difference (CI contains 0)"
                )
            out.append(
                {
                    "geodesic": name,
                    "adaptive": base,
                    "position": k,
                    "grid_size": len(geo_rhos),
                    "rho_geodesic": rg,
                    "rho_adaptive": ra,
                    "tau_geodesic": tg,
                    "tau_adaptive": ta,
                    "diff": d.diff,
                    "ci_low": d.ci_low,
                    "ci_high": d.ci_high,
                    "n_models": d.n_models,
                    "direction": "negative" if sign < 0 else "positive",
                    "verdict": verdict,
                }
            )
    return out


def _compare_with_paper(
    cells: dict[str, dict[float | None, _Cell]],
    paper: Mapping[str, float],
    paper_match: Callable[[str], str | None],
    level: float,
) -> dict[str, object]:
    families: dict[str, _Family] = {}
    for measure, by_rho in cells.items():
        label = _family_of(measure, paper, paper_match)
        if label is None:
            continue
        fam = families.setdefault(label, _Family(label, float(paper[label]), []))
        fam.cells.extend(by_rho[r] for r in sorted(by_rho, key=_rho_key))
    sentences: list[str] = []
    fam_json: dict[str, object] = {}
    pct = f"{100 * level:g} %"
    for fam in families.values():
        verdict = fam.sign_verdict()
        defined = fam.defined
        ours = ", ".join(
            f"{_f(c.summary.tau_a)} ({c.measure}, {_rho_label(c.rho)})" for c in defined
        )
        if verdict == "undefined":
            text = (
                f"{fam.label}: the paper reports τ = {_f(fam.paper_tau)}; our τ is undefined for "
                "every matching measure, so the sign cannot be compared."
            )
        else:
            excl = sum(not (c.summary.ci_low <= 0.0 <= c.summary.ci_high) for c in defined)
            head = {
                "same": "our τ-a has the same sign as the paper's",
                "opposite": "our τ-a has the opposite sign to the paper's",
                "mixed": (
                    f"our τ-a has the paper's sign in "
                    f"{sum(np.sign(c.summary.tau_a) == np.sign(fam.paper_tau) for c in defined)}"
                    f" of {len(defined)} (measure, ρ) cells"
                ),
            }[verdict]
            text = (
                f"{fam.label}: {head} (paper {_f(fam.paper_tau)}; ours {ours}); the {pct} CI "
                f"excludes 0 in {excl} of {len(defined)} cell(s)."
            )
        sentences.append(text)
        fam_json[fam.label] = {
            "paper_tau": fam.paper_tau,
            "sign_verdict": verdict,
            "cells": [
                {"measure": c.measure, "rho": c.rho, "tau_a": c.summary.tau_a} for c in defined
            ],
        }
    ordering = _ordering(list(families.values()))
    sentences.append(ordering["sentence"])
    unmatched = [k for k in paper if k not in families]
    if unmatched:
        sentences.append(
            "Paper families with no matching measure here: " + ", ".join(unmatched) + "."
        )
    return {
        "families": fam_json,
        "ordering_by": "|τ|",
        "ordering_holds": ordering["holds"],
        "paper_order": ordering["paper_order"],
        "our_order": ordering["our_order"],
        "unmatched_paper_families": unmatched,
        "sentences": sentences,
    }


def _ordering(families: list[_Family]) -> dict[str, object]:
    """Check the paper's ordering of the families by |τ| against ours (best cell per family)."""
    usable = [(f, f.best()) for f in families]
    usable = [(f, b) for f, b in usable if b is not None]
    result: dict[str, object] = {"holds": None, "paper_order": [], "our_order": []}
    if len(usable) < 2:
        result["sentence"] = (
            "Ordering of families: fewer than two paper families have a defined τ here, so "
            "there is no ordering to check."
        )
        return result
    paper_order = sorted(usable, key=lambda fb: -abs(fb[0].paper_tau))
    our_order = sorted(usable, key=lambda fb: -abs(fb[1].summary.tau_a))
    violated = [
        (f.label, g.label)
        for f, bf in usable
        for g, bg in usable
        if abs(f.paper_tau) > abs(g.paper_tau) and not abs(bf.summary.tau_a) > abs(bg.summary.tau_a)
    ]
    holds = not violated
    paper_txt = " > ".join(f"{f.label} ({_f(abs(f.paper_tau))})" for f, _ in paper_order)
    our_txt = " > ".join(f"{f.label} ({_f(abs(b.summary.tau_a))})" for f, b in our_order)
    verdict = (
        "The paper's ordering holds in our results."
        if holds
        else "The paper's ordering does not hold in our results: "
        + "; ".join(f"{a} is not stronger than {b}" for a, b in violated)
        + "."
    )
    result.update(
        holds=holds,
        paper_order=[f.label for f, _ in paper_order],
        our_order=[f.label for f, _ in our_order],
        sentence=(
            "Ordering of families by |τ| (the strength of the correlation, whatever its sign, "
            "since the paper's sign differs between tasks): the paper has "
            f"{paper_txt}; ours, taking for each family its largest |τ-a| over its measures "
            f"and ρ values (the paper does not state its ρ), is {our_txt}. {verdict}"
        ),
    )
    return result


# --------------------------------------------------------------------------------------------
# plots


def _log_x(values: np.ndarray) -> bool:
    """Log axis when every value is positive and they span more than two decades."""
    return bool(values.size) and bool(np.all(values > 0)) and values.max() / values.min() > 100.0


def _plot(
    path: Path,
    measure: str,
    by_rho: dict[float | None, _Cell],
    gaps: Mapping[str, float],
    gap_label: str,
) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "write_report draws its scatter plots with matplotlib; install it "
            "(pip install matplotlib)"
        ) from err
    fig = Figure(figsize=(5.6, 4.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    all_x: list[float] = []
    all_y: list[float] = []
    for k, rho in enumerate(sorted(by_rho, key=_rho_key)):
        cell = by_rho[rho]
        x = np.asarray(cell.values, dtype=float)
        y = np.asarray([gaps[m] for m in cell.model_ids], dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        all_x.extend(x[ok].tolist())
        all_y.extend(y[ok].tolist())
        s = cell.summary
        tau = f"τ-a = {_f(s.tau_a)}" if s is not None and s.defined else "τ undefined"
        ax.scatter(
            x[ok], y[ok], s=22, color=f"C{k % 10}", alpha=0.8, label=f"{_rho_label(rho)}: {tau}"
        )
    xs = np.asarray(all_x)
    if _log_x(xs):
        ax.set_xscale("log")
    if _log_x(np.asarray(all_y)):
        ax.set_yscale("log")
    if not xs.size:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"sharpness ({measure})")
    ax.set_ylabel(gap_label)
    ax.set_title(measure if len(measure) <= 60 else measure[:57] + "...", fontsize=10)
    ax.grid(alpha=0.3)
    # Below the axes, never over the points (constrained layout makes room for it).
    ax.legend(
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(2, max(1, len(by_rho))),
        frameon=False,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return data


# --------------------------------------------------------------------------------------------
# writers


def _markdown_table(
    title: str,
    gap_label: str,
    cells: dict[str, dict[float | None, _Cell]],
    rhos: list[float | None],
    paper_col: dict[str, str] | None,
    n_total: int,
    method: str,
) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    columns, grid, named = _layout(cells, rhos)
    header = ["measure", *columns]
    if paper_col is not None:
        header.append("paper τ")
    lines = [
        f"# {esc(title)}: Kendall τ-a between sharpness and {esc(gap_label)}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for measure, by_rho in cells.items():
        row = [esc(measure)]
        for r in grid[measure]:
            if isinstance(r, str):
                row.append("–")
                continue
            text = _cell_text(by_rho.get(r), n_total)
            row.append(esc(f"{_rho_label(r)}: {text}" if named and r is not None else text))
        if paper_col is not None:
            row.append(esc(paper_col.get(measure, "–")))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", method, ""]
    return "\n".join(lines)


_PAIRED_HEAD = [
    "geodesic",
    "adaptive",
    "grid position",
    "τ geodesic",
    "τ adaptive",
    "Δτ [CI]",
    "verdict",
]
_PAIRED_METHOD = (
    "Δτ = τ-a(geodesic) − τ-a(adaptive) on the same models, at the same position of the two ρ "
    "grids; [low, high] = {level:g} % paired percentile bootstrap CI (both τ recomputed on each "
    "resample of the models). Stronger means larger |τ| in the direction of the paper's sign "
    "for the geodesic family (of τ-geodesic when there is no paper value); a CI containing 0 "
    "is no clear difference."
)


def _paired_rows(paired: Sequence[Mapping[str, object]]) -> list[list[str]]:
    rows = []
    for p in paired:
        k, size = int(p["position"]), int(p["grid_size"])  # type: ignore[call-overload]
        position = (
            "smallest ρ"
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
                _f(float(p["tau_geodesic"])),  # type: ignore[arg-type]
                _f(float(p["tau_adaptive"])),  # type: ignore[arg-type]
                f"{_f(float(p['diff']))} [{_f(float(p['ci_low']))}, "  # type: ignore[arg-type]
                f"{_f(float(p['ci_high']))}]",  # type: ignore[arg-type]
                str(p["verdict"]),
            ]
        )
    return rows


def _paired_section(paired: Sequence[Mapping[str, object]], level: float) -> list[Section]:
    """The paired comparison as a report section (none when nothing was compared)."""
    if not paired:
        return []
    title = "Geodesic against adaptive sharpness, model by model"
    method = _PAIRED_METHOD.format(level=100 * level)
    return [Section(title, list(_PAIRED_HEAD), _paired_rows(paired), method)]


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
    import csv

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
        tau = f"{_f(s.tau_a)} [{_f(s.ci_low)}, {_f(s.ci_high)}]" if s.defined else "undefined"
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


def folder_sections(out_dir: str | Path, gaps: Mapping[str, float]) -> list[Section]:
    """Sections stored in a study folder: ``diagnostics.csv``, then ``sections.json``.

    ``sections.json`` is a list of ``{"title", "header", "rows", "caption"}`` written by a
    study's own analysis (e.g. ``python -m geosharp.studies.vit_orbit analyse DIR``).
    """
    out = Path(out_dir)
    found: list[Section] = []
    diag = diagnostics_section(out / DIAGNOSTICS_FILE, gaps)
    if diag is not None:
        found.append(diag)
    path = out / SECTIONS_FILE
    if path.is_file():
        for item in json.loads(path.read_text(encoding="utf-8")):
            found.append(
                Section(
                    str(item["title"]),
                    [str(h) for h in item["header"]],
                    [[str(c) for c in r] for r in item["rows"]],
                    str(item.get("caption", "")),
                )
            )
    return found


_CSS = """
td.undef { color: #8a8a8a; font-style: italic; }
.ci { color: #555; font-size: .9em; }
.method { color: #444; font-size: .92em; }
figure { display: inline-block; margin: .5em 1em .5em 0; }
"""


def _html_page(
    *,
    title: str,
    gap_label: str,
    settings: Mapping[str, object],
    models: list[dict[str, object]],
    cells: dict[str, dict[float | None, _Cell]],
    rhos: list[float | None],
    paper_col: dict[str, str] | None,
    comparison: dict[str, object] | None,
    sections: Sequence[Section],
    images: dict[str, bytes],
    notes: Sequence[str],
    method: str,
    version: str,
    generated_at: str,
) -> str:
    e = html.escape
    n_total = len(models)
    out = [
        *page_start(title, _CSS),
        f"<p>{n_total} models, {len(cells)} sharpness measure(s); generalization measured by "
        f"the {e(gap_label)}. τ &lt; 0 means sharper models generalize better.</p>",
        "<h2>Settings</h2>",
    ]
    if settings:
        out.append("<table>")
        for key, value in settings.items():
            out.append(f"<tr><th>{e(str(key))}</th><td>{e(_display(value))}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No settings recorded.</p>")

    out.append(f"<h2>Kendall τ between sharpness and {e(gap_label)}</h2>")
    out.append("<table>")
    columns, grid, named = _layout(cells, rhos)
    head = ["measure", *columns] + (["paper τ"] if paper_col else [])
    out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    for measure, by_rho in cells.items():
        row = [f"<th>{e(measure)}</th>"]
        for rho in grid[measure]:
            cell = None if isinstance(rho, str) else by_rho.get(rho)
            s = None if cell is None else cell.summary
            at = f"{_rho_label(rho)}<br>" if named and cell is not None and rho is not None else ""
            if s is None:
                row.append('<td class="undef">–</td>')
            elif not s.defined:
                row.append(f'<td class="undef">{at}undefined ({e(_undefined_reason(s))})</td>')
            else:
                n = f" · n = {s.n_models}" if s.n_models != n_total else ""
                row.append(
                    f'<td class="num">{at}τ-a = {e(_f(s.tau_a))}<br>'
                    f'<span class="ci">[{e(_f(s.ci_low))}, {e(_f(s.ci_high))}] · '
                    f"p = {e(_p(s.p_value))}{e(n)}</span></td>"
                )
        if paper_col is not None:
            row.append(f"<td>{e(paper_col.get(measure, '–'))}</td>")
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</table>")
    out.append(f'<p class="method">{e(method)}</p>')

    if comparison is not None:
        out.append("<h2>Comparison with the paper</h2>")
        out.append("<ul>")
        out.extend(f"<li>{e(str(s))}</li>" for s in comparison["sentences"])
        out.append("</ul>")

    for section in sections:
        out += section.html()

    out.append("<h2>Sharpness against gap</h2>")
    for measure, data in images.items():
        b64 = base64.b64encode(data).decode("ascii")
        out.append(
            f'<figure><img alt="{e(measure)}: sharpness against {e(gap_label)}" '
            f'src="data:image/png;base64,{b64}"><figcaption>{e(measure)}</figcaption></figure>'
        )

    out.append("<h2>Models</h2>")
    hp_keys: list[str] = []
    for model in models:
        hp_keys.extend(k for k in model["hparams"] if k not in hp_keys)
    opt = [k for k in _OPTIONAL_MODEL_FIELDS if any(k in m for m in models)]
    head = ["model", *hp_keys, *(k.replace("_", " ") for k in opt), gap_label]
    out.append("<table>")
    out.append("<tr>" + "".join(f"<th>{e(str(h))}</th>" for h in head) + "</tr>")
    for model in models:
        row = [f"<td>{e(str(model['model_id']))}</td>"]
        row += [f"<td>{e(_display(model['hparams'].get(k, '–')))}</td>" for k in hp_keys]
        row += [f'<td class="num">{e(_display(model.get(k, "–")))}</td>' for k in opt]
        row.append(f'<td class="num">{e(_display(model["gap"]))}</td>')
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</table>")

    if notes:
        out.append("<h2>Notes</h2>")
        out.append("<ul>")
        out.extend(f"<li>{e(str(n))}</li>" for n in notes)
        out.append("</ul>")
    out += page_end(version, generated_at)
    return "\n".join(out)


def _geosharp_version() -> str:
    import geosharp

    return str(getattr(geosharp, "__version__", "unknown"))


def write_report(
    out_dir: str | Path,
    *,
    title: str,
    models: list[dict],
    measurements: list[dict],
    settings: dict,
    paper: dict[str, float] | None = None,
    notes: Sequence[str] = (),
    gap_label: str = "generalization gap",
    paper_match: Callable[[str], str | None] = default_paper_match,
    sections: Sequence[Section] = (),
    n_boot: int = 2000,
    n_perm: int = 2000,
    level: float = 0.95,
    seed: int = 0,
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
        paper: Family label → the paper's τ for this population (SPEC §7), e.g.
            ``{"adaptive": -0.41, "geodesic inv": -0.71, "geodesic mix": -0.70}``.
        notes: Free-text notes shown at the end of the page.
        sections: Extra tables shown after the τ tables (and appended to ``tau_table.md``).
        gap_label: How the gap is named in tables and axes, e.g. "test − train error".
        paper_match: Measure name → family label in ``paper`` (or None); defaults to
            :func:`default_paper_match`.
        n_boot: Bootstrap resamples for each CI.
        n_perm: Permutations for each p-value.
        level: Coverage of the CIs.
        seed: Seed of the bootstrap and the permutations.

    Returns:
        The paths written, as a :class:`ReportPaths`.

    Raises:
        ValueError: If a model lacks ``model_id`` or ``gap``, ids repeat, a measurement names
            an unknown model or repeats a (model, measure, ρ), or a number is not a number.
        ImportError: If matplotlib is not installed.
    """
    out = Path(out_dir)
    rows = _check_models(models)
    gaps = {str(m["model_id"]): float(m["gap"]) for m in rows}
    cells = _collect(measurements, set(gaps))
    # sharpness, then relative flatness, then curvature (each kind in the order given)
    cells = dict(sorted(cells.items(), key=lambda kv: FAMILY_ORDER.index(measure_family(kv[0]))))
    n_total = len(rows)
    for by_rho in cells.values():
        for cell in by_rho.values():
            cell.summary = correlation_summary(
                [gaps[m] for m in cell.model_ids],
                cell.values,
                n_boot=n_boot,
                n_perm=n_perm,
                level=level,
                seed=seed,
                min_models=MIN_MODELS,
            )
    rhos = sorted({r for by_rho in cells.values() for r in by_rho}, key=_rho_key)

    paper_col: dict[str, str] | None = None
    comparison: dict[str, object] | None = None
    if paper:
        paper_col = {}
        for measure in cells:
            label = _family_of(measure, paper, paper_match)
            if label is not None:
                paper_col[measure] = f"{_f(float(paper[label]))} ({label})"
        comparison = _compare_with_paper(cells, paper, paper_match, level)

    paired = _geodesic_vs_adaptive(cells, gaps, paper, n_boot, level, seed)
    extra_sections = list(sections)  # as given, for summary.json
    extra_sections += folder_sections(out, gaps)  # diagnostics.csv, sections.json, if present
    sections = [*_paired_section(paired, level), *extra_sections]

    method = (
        f"M = {n_total} models. Each cell: Kendall τ-a between sharpness and {gap_label} over "
        f"the models with finite values (n shown where fewer than M), [low, high] = "
        f"{100 * level:g} % percentile bootstrap CI of τ-a ({n_boot} resamples of the models "
        f"with replacement, seed {seed}), p = two-sided permutation p-value of τ = 0 "
        f"({n_perm} permutations). τ < 0: sharper models generalize better. Undefined: fewer "
        f"than {MIN_MODELS} models with finite values, or all gaps (or all values) equal."
    )

    out.mkdir(parents=True, exist_ok=True)
    plot_dir = out / "plots"
    plot_dir.mkdir(exist_ok=True)
    taken: set[str] = set()
    plots: dict[str, Path] = {}
    images: dict[str, bytes] = {}
    for measure, by_rho in cells.items():
        path = plot_dir / f"{_slug(measure, taken)}.png"
        images[measure] = _plot(path, measure, by_rho, gaps, gap_label)
        plots[measure] = path

    version = _geosharp_version()
    generated_at = datetime.now(timezone.utc).isoformat(timespec="seconds")

    tau_table = out / "tau_table.md"
    atomic_write_text(
        tau_table,
        _markdown_table(title, gap_label, cells, rhos, paper_col, n_total, method)
        + "".join(section.markdown() for section in sections),
    )

    summary = {
        "title": title,
        "geosharp_version": version,
        "generated_at": generated_at,
        "n_models": n_total,
        "gap_label": gap_label,
        "settings": settings,
        "statistic": "Kendall tau-a (tau-b also given)",
        "ci": {"method": "percentile bootstrap over models", "level": level, "n_boot": n_boot},
        "p_value": {"method": "two-sided permutation test", "n_perm": n_perm},
        "seed": seed,
        "cells": [
            {
                "measure": cell.measure,
                "rho": cell.rho,
                "tau_a": cell.summary.tau_a,
                "tau_b": cell.summary.tau_b,
                "ci_low": cell.summary.ci_low,
                "ci_high": cell.summary.ci_high,
                "p_value": cell.summary.p_value,
                "n_models": cell.summary.n_models,
                "n_dropped": cell.summary.n_dropped,
                "defined": cell.summary.defined,
                "note": cell.summary.note,
                "paper_family": _family_of(cell.measure, paper, paper_match),
                "paper_tau": (
                    float(paper[fam])
                    if (fam := _family_of(cell.measure, paper, paper_match)) is not None
                    else None
                ),
                "median_time_s": float(np.median(cell.times)) if cell.times else None,
            }
            for by_rho in cells.values()
            for cell in (by_rho[r] for r in sorted(by_rho, key=_rho_key))
        ],
        "paper_comparison": comparison,
        "geodesic_vs_adaptive": paired,
        "sections": [
            {"title": x.title, "header": x.header, "rows": x.rows, "caption": x.caption}
            for x in extra_sections
        ],
        "notes": list(notes),
    }
    summary_json = out / "summary.json"
    atomic_write_text(
        summary_json,
        json.dumps(_json_safe(summary), indent=2, ensure_ascii=False, allow_nan=False) + "\n",
    )

    page = out / "report.html"
    atomic_write_text(
        page,
        _html_page(
            title=title,
            gap_label=gap_label,
            settings=settings,
            models=rows,
            cells=cells,
            rhos=rhos,
            paper_col=paper_col,
            comparison=comparison,
            sections=sections,
            images=images,
            notes=notes,
            method=method,
            version=version,
            generated_at=generated_at,
        ),
    )
    return ReportPaths(
        out_dir=out, html=page, tau_table=tau_table, summary_json=summary_json, plots=plots
    )
