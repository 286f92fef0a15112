"""The self-contained HTML report of ``geosharp measure``, with the loss-ascent curves.

One page (inline CSS, plots embedded as base64 PNG, drawn with matplotlib's Agg backend): the
results table (curvature rows with their Hessian-vector products and the trace's standard
error), the invariance self-check, the warnings, for every worst-case measure the loss rise
``L_S(w′_k) − L_S(w)`` at every Auto-PGD iterate ``k`` of every batch (one panel per ρ), the
symmetry summary, the coordinates in the adaptive geometry (a table of parameter patterns) and
the settings, written as a person reads them (``none``, ``yes``, ``0.01, 0.1``; no JSON
literals). Nothing scrolls sideways: long lines wrap.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geosharp._html import page_end, page_start
from geosharp._io import atomic_write_text

if TYPE_CHECKING:
    from geosharp.measuring.results import MeasureReport, MeasureRow

__all__ = ["write_html"]

_CSS = """
pre { background: #f7f7f7; border: 1px solid #e2e2e2; padding: .8em; font-size: .85em;
      white-space: pre-wrap; overflow-wrap: anywhere; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #b42318; font-weight: bold; }
.warn { color: #9a6700; }
td.num, table.settings th { white-space: nowrap; }
td.pattern { font-family: ui-monospace, monospace; font-size: .9em; overflow-wrap: anywhere; }
figure { margin: 1.5em 0; }
"""

#: How the settings table names the keys of ``MeasureReport.settings`` (others: ``_`` → space).
_SETTING_LABELS = {
    "model_kind": "model kind",
    "task_reason": "why this task",
    "batch_size": "batch size",
    "max_length": "max length (tokens)",
    "n_tokens": "predicted tokens",
    "label_map": "text labels → class ids",
    "model_info": "about the model",
    "rhos": "radii ρ",
    "steps": "Auto-PGD steps",
    "eps": "ε (Gram-matrix damping)",
    "check": "invariance self-check",
    "n_params": "parameters",
    "n_gl_heads": "GL heads (attention GL(h), rotary, LoRA GL(r))",
    "symmetry_groups": "symmetry block kinds",
    "largest_batch": "largest batch (samples)",
    "longest_input": "longest input (tokens)",
    "estimated_time_s": "estimated time before measuring (s)",
    "one_pass_s": "one forward+backward of batch 0 (s)",
    "n_diagonal_pairs": "diagonal pairs",
    "n_symmetry_blocks": "symmetry blocks",
    "n_group_factors": "group factors",
}
#: How the self-check draws a random element of each kind of block (``settings["symmetry_groups"]``
#: names the kinds; the ``random_element`` methods of :mod:`geosharp.symmetry.blocks`).
_GROUP_DRAWS = {
    "GL(h) blocks": "attention heads, GL(h): A = a·N(0, 1)<sup>h×h</sup>",
    "LoRA GL(r) blocks": "LoRA adapters, GL(r): M = a·N(0, 1)<sup>r×r</sup> acting by (B M⁻¹, M A)",
    "rotary Q/K blocks": "rotary Q/K heads, the rotary commutant: a·(x I₂ + y J₂) per rotation "
    "plane, x, y ~ N(0, 1), and a·N(0, 1) on features not rotated",
    "diagonal pairs": "diagonal pairs, GL(1): α = a·N(0, 1) per coordinate",
    "key-bias translations (held fixed)": "key biases: a translation t = a·N(0, 1)",
}
#: The short guide to the numbers under the results table (the long one: reading-results.md).
_READING = (
    "<p><b>Reading these numbers.</b> A worst-case value is the largest rise of the training "
    "loss, L<sub>S</sub>(w′) − L<sub>S</sub>(w), that Auto-PGD found within the ball of radius ρ "
    "around the measured weights, averaged over batches: a loss difference in the loss's own "
    "units (nats for cross-entropy), to set against the clean loss below. It is a lower bound "
    "of the true maximum, and a warning says when the ascent was still rising. ρ is relative "
    "to the weights for adaptive and geodesic inv, but geodesic mix weighs a move of a head's "
    "factors by the size of the head's product G Hᵀ (SPEC §4.1), so the same ρ is a move of "
    "another size there — many times larger on heads with small weights, such as LoRA "
    "adapters or freshly initialized layers — and its values can rise far faster with ρ. No "
    "value is sharp or flat by itself: compare models at the same ρ, on the same data and "
    "batch size, with the same measure. The documentation page <i>Reading one model's "
    "results</i> (docs/reading-results.md in the geosharp repository) says how to choose ρ and "
    "read each measure.</p>"
)
#: What each flag of a cell means (geosharp.measuring.flags).
_FLAGS = (
    "<p><b>Flags.</b> A cell without a flag is sound. <i>rising</i>: on some batch the loss "
    "was still rising at the last Auto-PGD step, so the value is a lower bound (more steps may "
    "find more). <i>unstable</i>: the ascent did not settle — its last iterates fell back by "
    "more than 0.1 % of the loss rise, or a smaller ball held a better point (that value is "
    "kept, so the values grow with ρ); rounding, or an equivalent re-parametrization of the "
    "weights, can then move the value by a large fraction. <i>saturated</i>: the perturbed "
    "loss reaches the loss of a trivial predictor (all-zero outputs): the ball has left the "
    "basin, and the value ranks how fast the model can be destroyed rather than the shape of "
    "its minimum. Compare models on sound cells; use a smaller ρ where cells saturate.</p>"
)
_NOTE_ROW = re.compile(r"^  (?P<pattern>\S+)\s+(?P<count>[\d,]+)$")


def _num(x: float | None, digits: int = 5) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)


def _display(value: Any) -> str:
    """A setting as a person reads it: no JSON literals (``null``, ``true``, brackets, quotes).

    Example:
        >>> _display(None), _display(True), _display([0.01, 0.1]), _display({"neg": 0, "pos": 1})
        ('none', 'yes', '0.01, 0.1', 'neg → 0, pos → 1')
        >>> _display({"iters": 50, "trace_method": "hutchinson"}), _display(3298)
        ('iters 50, trace method hutchinson', '3,298')
    """
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, Mapping):
        if not value:
            return "none"
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
            return ", ".join(f"{k} → {v}" for k, v in value.items())  # a label map
        return ", ".join(f"{str(k).replace('_', ' ')} {_display(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return ", ".join(_display(v) for v in value) if value else "none"
    return str(value)


def _draws(settings: Mapping[str, Any]) -> str:
    """How the self-check drew the group elements of the kinds of blocks the model has.

    Example:
        >>> _draws({"symmetry_groups": ["LoRA GL(r) blocks"]})
        'LoRA adapters, GL(r): M = a·N(0, 1)<sup>r×r</sup> acting by (B M⁻¹, M A)'
        >>> _draws({}).startswith("attention heads, GL(h)")
        True
    """
    kinds = settings.get("symmetry_groups") or ["GL(h) blocks"]
    return "; ".join(_GROUP_DRAWS.get(k, html.escape(str(k))) for k in kinds)


def _adaptive_html(note: str) -> str:
    """The adaptive-geometry note as a paragraph and a table of parameter patterns.

    Falls back to wrapped preformatted text if the note is not in
    :func:`~geosharp.measuring.prepare.adaptive_note`'s format.
    """
    e = html.escape
    head, *lines = note.splitlines()
    rows, more = [], ""
    for line in lines:
        m = _NOTE_ROW.match(line)
        if m:
            rows.append((m["pattern"], m["count"]))
        elif line.startswith("  … ") and not more:
            more = line.strip()
        else:
            return f"<pre>{e(note)}</pre>"
    out = [f"<p>{e(head)}</p>"]
    if rows:
        out.append("<table><tr><th>parameters (layer index: *)</th><th>coordinates</th></tr>")
        out += [
            f"<tr><td class='pattern'>{e(p)}</td><td class='num'>{e(c)}</td></tr>" for p, c in rows
        ]
        if more:
            out.append(f"<tr><td colspan='2'>{e(more)}</td></tr>")
        out.append("</table>")
    return "\n".join(out)


def _curves_png(measure: str, rows: list[MeasureRow]) -> bytes:
    """One panel per ρ: loss rise at every iterate, one thin line per batch, the mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = len(rows)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.4), squeeze=False, sharey=False)
    for ax, row in zip(axes[0], rows, strict=True):
        rises = [
            [v - c for v in trace] for trace, c in zip(row.traces, row.clean_losses, strict=True)
        ]
        for k, rise in enumerate(rises):
            ax.plot(range(len(rise)), rise, lw=0.9, alpha=0.6, label="batches" if k == 0 else None)
        if len(rises) > 1 and len({len(r) for r in rises}) == 1:
            mean = [sum(col) / len(col) for col in zip(*rises, strict=True)]
            ax.plot(range(len(mean)), mean, color="black", lw=2.0, label="mean")
        ax.axhline(0.0, color="#888", lw=0.6)
        ax.set_title(f"ρ = {row.rho:g}: sharpness {_num(row.value, 3)}", fontsize=10)
        ax.set_xlabel("Auto-PGD iterate")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("L(w′) − L(w)")
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle(measure, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_html(report: MeasureReport, path: str | Path, title: str = "geosharp measure") -> Path:
    """Write the report page.

    Args:
        report: The :class:`~geosharp.measuring.MeasureReport`.
        path: The ``.html`` file to write (its folder is created).
        title: Page title.

    Returns:
        The path written.
    """
    from geosharp._version import __version__

    e = html.escape
    out = [
        *page_start(title, _CSS),
        f"<p>{report.n_batches} batch(es)"
        + (f", {report.n_samples} samples" if report.n_samples is not None else "")
        + f"; total time {report.time_s:.1f} s. Sharpness is the loss rise "
        "L<sub>S</sub>(w′) − L<sub>S</sub>(w) averaged over batches (SPEC §2, §6); curvature "
        "(no ρ) is the largest eigenvalue or the trace of the Hessian on the quotient, per "
        "batch, averaged over batches (SPEC §9; HVPs: Hessian-vector products, s.e.: the "
        "Hutchinson standard error of the trace).</p>",
        "<h2>Results</h2>",
        "<table>",
        "<tr><th>measure</th><th>ρ</th><th>value</th><th>std over batches</th>"
        "<th>min</th><th>max</th><th>time (s)</th><th>forward / backward</th>"
        "<th>HVPs</th><th>s.e. (trace)</th><th>flags</th></tr>",
    ]
    for r in report.rows:
        if r.error is not None:
            out.append(
                f"<tr><th>{e(r.measure)}</th><td class='num'>{e(_num(r.rho))}</td>"
                f"<td colspan='9' class='fail'>failed: {e(r.error)}</td></tr>"
            )
            continue
        out.append(
            f"<tr><th>{e(r.measure)}</th><td class='num'>{e(_num(r.rho))}</td>"
            f"<td class='num'>{e(_num(r.value))}</td><td class='num'>{e(_num(r.std, 3))}</td>"
            f"<td class='num'>{e(_num(r.min, 4))}</td><td class='num'>{e(_num(r.max, 4))}</td>"
            f"<td class='num'>{r.time_s:.1f}</td>"
            f"<td class='num'>{r.n_forward} / {r.n_backward}</td>"
            f"<td class='num'>{r.n_hvp or '–'}</td><td class='num'>{e(_num(r.stderr, 3))}</td>"
            f"<td class='{'warn' if r.flags else ''}'>{e(' '.join(r.flags))}</td>"
            "</tr>"
        )
    out.append("</table>")
    n_flagged = sum(bool(r.flags) for r in report.rows)
    if n_flagged:
        out.append(
            f"<p class='warn'>{n_flagged} of {len(report.rows)} cells are flagged: their values "
            "cannot be trusted as they are (see <i>Flags</i> below).</p>"
        )
    out.append(_READING)
    out.append(_FLAGS)

    out.append("<h2>Self-check</h2>")
    inv = report.invariance
    skipped = (report.settings.get("sharded") or {}).get("skipped", {}).get("self_check")
    if inv is None and skipped:
        out.append(f"<p class='warn'>The invariance check was {e(skipped)}.</p>")
    elif inv is None:
        out.append("<p class='warn'>The invariance check was skipped (--no-check).</p>")
    elif inv.n_blocks == 0:
        out.append("<p>No symmetry blocks were found, so there was nothing to re-parametrize.</p>")
    else:
        cls = "pass" if inv.passed else "fail"
        out.append(
            f"<p><span class='{cls}'>{'PASSED' if inv.passed else 'FAILED'}</span>: every one of "
            f"the {inv.n_blocks} symmetry blocks found ({inv.n_factors} group factors) was "
            f"re-parametrized by a random element of its group ({_draws(report.settings)}); "
            "the relative change of the model's outputs was, beside that of a random move of "
            "the same size</p>"
            "<table><tr><th>scale a</th><th>‖f(g·w) − f(w)‖ / ‖f(w)‖</th>"
            "<th>random move</th></tr>"
            + "".join(
                f"<tr><td class='num'>{a:g}</td><td class='num'>{c:.2e}</td>"
                f"<td class='num'>{r:.2e}</td></tr>"
                for a, c, r in zip(
                    inv.scales,
                    inv.rel_changes,
                    inv.random_changes or [float("nan")] * len(inv.scales),
                    strict=True,
                )
            )
            + f"</table><p>tolerance {inv.tol:g}.</p>"
        )
    finite = all(math.isfinite(c) for c in report.clean_losses)
    if report.clean_losses:
        mean = sum(report.clean_losses) / len(report.clean_losses)
        out.append(
            f"<p>Clean loss: mean {_num(mean)} over {len(report.clean_losses)} batch(es), "
            f"{'all finite' if finite else 'NOT all finite'}.</p>"
        )

    if report.warnings:
        out.append("<h2>Warnings</h2><ul>")
        out.extend(f"<li class='warn'>{e(w)}</li>" for w in report.warnings)
        out.append("</ul>")

    out.append("<h2>Loss-ascent curves</h2>")
    by_measure: dict[str, list[MeasureRow]] = {}
    for r in report.rows:
        if r.error is None and r.traces and r.rho is not None:
            by_measure.setdefault(r.measure, []).append(r)
    if not by_measure:
        out.append("<p>No worst-case measurement, so there are no ascent curves.</p>")
    for name, rows in by_measure.items():
        b64 = base64.b64encode(_curves_png(name, rows)).decode("ascii")
        out.append(
            f'<figure><img alt="{e(name)}: loss rise at every Auto-PGD iterate" '
            f'src="data:image/png;base64,{b64}"><figcaption>{e(name)}: loss rise at every '
            "Auto-PGD iterate, one line per batch (the iterates are not monotone: Auto-PGD "
            "keeps the best one).</figcaption></figure>"
        )

    out.append("<h2>Symmetries</h2>")
    out.append(f"<pre>{e(report.symmetry_summary)}</pre>")
    out.append("<h3>Adaptive geometry</h3>")
    out.append(_adaptive_html(report.adaptive_note))

    out.append("<h2>Settings</h2><table class='settings'>")
    for key, value in report.settings.items():
        label = _SETTING_LABELS.get(str(key), str(key).replace("_", " "))
        out.append(
            f"<tr><th title='{e(str(key))} in results.json'>{e(label)}</th>"
            f"<td>{e(_display(value))}</td></tr>"
        )
    out.append("</table>")
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out += page_end(__version__, stamp)
    return atomic_write_text(path, "\n".join(out))
