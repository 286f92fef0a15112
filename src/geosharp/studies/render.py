"""The words of a study report: the Markdown τ table and the self-contained HTML page.

Both take the analysed cells of :mod:`geosharp.studies.analysis`; nothing here computes a
statistic.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from geosharp._html import page_end, page_start
from geosharp.studies.analysis import MIN_MODELS, OPTIONAL_MODEL_FIELDS, Cell
from geosharp.studies.formatting import display, fmt, fmt_p, rho_key, rho_label, undefined_reason
from geosharp.studies.plots import value_label
from geosharp.studies.sections import Section

__all__ = ["Page", "cell_text", "html_page", "layout", "markdown_table", "method_text"]


def layout(
    cells: dict[str, dict[float | None, Cell]], rhos: list[float | None]
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
        return [rho_label(r) for r in rhos], {m: list(rhos) for m in cells}, False
    middle = ["middle ρ"] if longest == 3 else [f"ρ #{k}" for k in range(2, longest)]
    headers = ["smallest ρ", *middle, "largest ρ"]
    grid: dict[str, list[float | str | None]] = {}
    for measure, by_rho in cells.items():
        own: list[float | str | None] = sorted(by_rho, key=rho_key)
        if len(own) == 1:  # a single ρ (or none, e.g. relative flatness) goes first
            grid[measure] = own + ["missing"] * (longest - 1)
        else:
            grid[measure] = own + ["missing"] * (longest - len(own))
    return headers, grid, True


def cell_text(cell: Cell | None, n_total: int) -> str:
    """One τ cell as text: ``τ [low, high], p = …`` (n when fewer than all models)."""
    if cell is None:
        return "–"
    s = cell.summary
    assert s is not None
    if not s.defined:
        return f"undefined ({undefined_reason(s)})"
    text = f"{fmt(s.tau_a)} [{fmt(s.ci_low)}, {fmt(s.ci_high)}], p = {fmt_p(s.p_value)}"
    if s.n_models != n_total:
        text += f" (n = {s.n_models})"
    return text


def markdown_table(
    title: str,
    gap_label: str,
    cells: dict[str, dict[float | None, Cell]],
    rhos: list[float | None],
    paper_col: dict[str, str] | None,
    n_total: int,
    method: str,
    headline: Sequence[str] = (),
) -> str:
    """The ``tau_table.md`` τ table: one row per measure, one column per ρ (see :func:`layout`).

    ``headline``: sentences said first, under the title (:func:`geosharp.studies.headline`).
    """

    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    columns, grid, named = layout(cells, rhos)
    header = ["measure", *columns]
    if paper_col is not None:
        header.append("paper τ")
    lines = [
        f"# {esc(title)}: Kendall τ-a between sharpness and {esc(gap_label)}",
        "",
        *([f"**{' '.join(headline)}**", ""] if headline else []),
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for measure, by_rho in cells.items():
        row = [esc(measure)]
        for r in grid[measure]:
            if isinstance(r, str):
                row.append("–")
                continue
            text = cell_text(by_rho.get(r), n_total)
            row.append(esc(f"{rho_label(r)}: {text}" if named and r is not None else text))
        if paper_col is not None:
            row.append(esc(paper_col.get(measure, "–")))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", method, ""]
    return "\n".join(lines)


CSS = """
p.headline { font-size: 1.1em; font-weight: 600; }
td.undef { color: #8a8a8a; font-style: italic; }
.ci { color: #555; font-size: .9em; }
.method { color: #444; font-size: .92em; }
figure { display: inline-block; margin: .5em 1em .5em 0; }
table.models { font-size: .8em; }
table.models th, table.models td { padding: .2em .4em; }
table.models td:first-child { white-space: nowrap; }
"""


@dataclass(frozen=True)
class Page:
    """Everything ``report.html`` shows (:func:`html_page`).

    Attributes:
        title: The report's title.
        gap_label: How the gap is named.
        settings: The study's settings (a table).
        models: The analysed models (the models table).
        cells: Measure → ρ → its τ cell.
        rhos: Every ρ of the τ table, in order.
        paper_col: Measure → the paper's τ as text, or ``None`` (no paper column).
        comparison: The comparison with the paper (its ``"sentences"``), or ``None``.
        sections: Extra tables after the τ table.
        images: Measure → its scatter plot (PNG bytes).
        notes: Notes at the end of the page.
        method: The paragraph under the τ table (:func:`method_text`).
        version: The geosharp version that wrote the page.
        generated_at: When (ISO time).
        headline: Sentences said first, under the title.
    """

    title: str
    gap_label: str
    settings: Mapping[str, object]
    models: list[dict[str, object]]
    cells: dict[str, dict[float | None, Cell]]
    rhos: list[float | None]
    paper_col: dict[str, str] | None
    comparison: dict[str, object] | None
    sections: Sequence[Section]
    images: dict[str, bytes]
    notes: Sequence[str]
    method: str
    version: str
    generated_at: str
    headline: Sequence[str] = ()


def html_page(*, page: Page) -> str:
    """The self-contained ``report.html`` page (``page.headline``: said first, under the title)."""
    e = html.escape
    out = [
        *page_start(page.title, CSS),
        *([f'<p class="headline">{e(" ".join(page.headline))}</p>'] if page.headline else []),
        f"<p>{len(page.models)} models, {len(page.cells)} sharpness measure(s); generalization "
        f"measured by the {e(page.gap_label)}. τ &lt; 0 means sharper models generalize "
        "better.</p>",
        "<h2>Settings</h2>",
    ]
    out += _settings_html(page.settings)
    out += _tau_html(page)
    if page.comparison is not None:
        out.append("<h2>Comparison with the paper</h2>")
        out.append("<ul>")
        out.extend(f"<li>{e(str(s))}</li>" for s in page.comparison["sentences"])  # type: ignore[attr-defined]
        out.append("</ul>")
    for section in page.sections:
        out += section.html()
    out += _plots_html(page.images, page.gap_label)
    out += _models_html(page.models, page.gap_label)
    if page.notes:
        out.append("<h2>Notes</h2>")
        out.append("<ul>")
        out.extend(f"<li>{e(str(n))}</li>" for n in page.notes)
        out.append("</ul>")
    out += page_end(page.version, page.generated_at)
    return "\n".join(out)


def _settings_html(settings: Mapping[str, object]) -> list[str]:
    e = html.escape
    if not settings:
        return ["<p>No settings recorded.</p>"]
    rows = [f"<tr><th>{e(str(k))}</th><td>{e(display(v))}</td></tr>" for k, v in settings.items()]
    return ["<table>", *rows, "</table>"]


def _tau_html(page: Page) -> list[str]:
    """The τ table, its method paragraph."""
    e = html.escape
    n_total = len(page.models)
    out = [f"<h2>Kendall τ between sharpness and {e(page.gap_label)}</h2>", "<table>"]
    columns, grid, named = layout(page.cells, page.rhos)
    head = ["measure", *columns] + (["paper τ"] if page.paper_col else [])
    out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    for measure, by_rho in page.cells.items():
        row = [f"<th>{e(measure)}</th>"]
        for rho in grid[measure]:
            cell = None if isinstance(rho, str) else by_rho.get(rho)
            s = None if cell is None else cell.summary
            at = f"{rho_label(rho)}<br>" if named and cell is not None and rho is not None else ""
            if s is None:
                row.append('<td class="undef">–</td>')
            elif not s.defined:
                row.append(f'<td class="undef">{at}undefined ({e(undefined_reason(s))})</td>')
            else:
                n = f" · n = {s.n_models}" if s.n_models != n_total else ""
                row.append(
                    f'<td class="num">{at}τ-a = {e(fmt(s.tau_a))}<br>'
                    f'<span class="ci">[{e(fmt(s.ci_low))}, {e(fmt(s.ci_high))}] · '
                    f"p = {e(fmt_p(s.p_value))}{e(n)}</span></td>"
                )
        if page.paper_col is not None:
            row.append(f"<td>{e(page.paper_col.get(measure, '–'))}</td>")
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</table>")
    out.append(f'<p class="method">{e(page.method)}</p>')
    return out


def _plots_html(images: Mapping[str, bytes], gap_label: str) -> list[str]:
    e = html.escape
    kinds = {value_label(m).split(" (")[0] for m in images}
    heading = "Sharpness" if kinds == {"sharpness"} else "Each measure"
    out = [f"<h2>{heading} against {e(gap_label)}</h2>"]
    out.append(
        '<p class="method">One panel per ρ, each with its own horizontal axis (the values at '
        "different radii differ by orders of magnitude; logarithmic where they span more than "
        "two decades).</p>"
    )
    for measure, data in images.items():
        b64 = base64.b64encode(data).decode("ascii")
        out.append(
            f'<figure><img alt="{e(measure)}: {e(value_label(measure))} against '
            f'{e(gap_label)}" src="data:image/png;base64,{b64}"></figure>'
        )
    return out


def _models_html(models: list[dict[str, object]], gap_label: str) -> list[str]:
    e = html.escape
    out = ["<h2>Models</h2>"]
    hp_keys: list[str] = []
    for model in models:
        hp_keys.extend(k for k in model["hparams"] if k not in hp_keys)  # type: ignore[attr-defined]
    opt = [k for k in OPTIONAL_MODEL_FIELDS if any(k in m for m in models)]
    # Headers wrap at spaces (``label_smoothing`` → "label smoothing"), numbers align right:
    # the table of a dozen hyperparameters fits the page's width.
    head = ["model", *(k.replace("_", " ") for k in [*hp_keys, *opt]), gap_label]
    out.append('<table class="models">')
    out.append("<tr>" + "".join(f"<th>{e(str(h))}</th>" for h in head) + "</tr>")
    for model in models:
        row = [f"<td>{e(str(model['model_id']))}</td>"]
        row += [_value_cell(model["hparams"].get(k, "–")) for k in hp_keys]  # type: ignore[attr-defined]
        row += [f'<td class="num">{e(display(model.get(k, "–")))}</td>' for k in opt]
        row.append(f'<td class="num">{e(display(model["gap"]))}</td>')
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</table>")
    return out


def _value_cell(value: object) -> str:
    """A table cell: numbers right-aligned (``td.num``), anything else as text."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    cls = ' class="num"' if numeric else ""
    return f"<td{cls}>{html.escape(display(value))}</td>"


def method_text(
    *, n_total: int, gap_label: str, level: float, n_boot: int, n_perm: int, seed: int
) -> str:
    """The paragraph under the τ table saying how every cell was computed."""
    return (
        f"M = {n_total} models. Each cell: Kendall τ-a between sharpness and {gap_label} over "
        f"the models with finite values (n shown where fewer than M), [low, high] = "
        f"{100 * level:g} % percentile bootstrap CI of τ-a ({n_boot} resamples of the models "
        f"with replacement, seed {seed}), p = two-sided permutation p-value of τ = 0 "
        f"({n_perm} permutations). τ < 0: sharper models generalize better. Undefined: fewer "
        f"than {MIN_MODELS} models with finite values, or all gaps (or all values) equal."
    )
