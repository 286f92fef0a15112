"""Coverage sweep: which symmetry blocks the finder claims in common architectures, checked.

Every architecture is built tiny from its config (random weights, no download), in float64,
with every parameter nudged by ``0.05·N(0, 1)`` so that no bias or norm sits at its default.
The finder's blocks are counted by kind (full-GL Q/K, rotary Q/K, V/O, key-bias translations,
LoRA), and the model is re-parametrized by a random element of the claimed group
(:func:`geosharp.symmetry.reparametrize`, ``A = 10·N(0,1)`` per head): if every claim is true
the outputs stay the same up to rounding, and a false claim moves them at order one.

The relative change is ``max |f(θ′) − f(θ)| / max |f(θ)|`` over all outputs. A float64 model
changes by ~1e-14; a few models compute part of their forward in float32 even when their
weights are float64 (GPT-Neo casts Q and K to float32 before ``Q·Kᵀ``), and there rounding of
the transformed ``Q A⁻¹`` alone gives ~1e-7. Such an architecture is marked with the reason,
and its tolerance is the float32 one. Changes are reported in coarse bands (``< 1e-12``,
``< 1e-5``, ``< 1e-3``, ``≥ 1e-3``), so that the table is the same on every CPU.

This module renders the table and runs the command; the architectures are
:mod:`geosharp.demos.coverage_architectures`, the check and the sweep
:mod:`geosharp.demos.coverage_sweep` (their names are importable from here too).

Run::

    python -m geosharp.demos.coverage                    # print the table
    python -m geosharp.demos.coverage --write docs/architectures.md  # refresh the table
    python -m geosharp.demos.coverage --check docs/architectures.md  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from geosharp.demos.coverage_architectures import ARCHITECTURES, Architecture
from geosharp.demos.coverage_sweep import CoverageRow, block_counts, measure, sweep

__all__ = [
    "ARCHITECTURES",
    "END_MARKER",
    "START_MARKER",
    "Architecture",
    "CoverageRow",
    "band",
    "block_counts",
    "main",
    "measure",
    "render_table",
    "replace_section",
    "sweep",
]

#: Upper edges of the reported bands of the relative output change: float64 rounding (~1e-14)
#: and float32 rounding (~1e-9 … 1e-7) each sit two decades or more inside their band.
BANDS = (1e-12, 1e-5, 1e-3)

START_MARKER = "<!-- coverage:start -->"
END_MARKER = "<!-- coverage:end -->"


# -- rendering ------------------------------------------------------------------------------------
def band(change: float) -> str:
    """The reported band of a relative change, e.g. ``"< 1e-12"``.

    Args:
        change: Relative output change.

    Returns:
        ``"< 1e-k"`` for the first band edge above the change, else ``"≥ 1e-3"``.
    """
    for edge in BANDS:
        if change < edge:
            return f"< {edge:.0e}".replace("e-0", "e-")
    return f"≥ {BANDS[-1]:.0e}".replace("e-0", "e-")


def _blocks_cell(counts: dict[str, int]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def render_table(rows: Sequence[CoverageRow]) -> str:
    """The Markdown table of a sweep (deterministic: no timings, changes in bands).

    Args:
        rows: The sweep results.

    Returns:
        The table, ending with a newline.
    """
    lines = [
        "| architecture | blocks found | notes | max rel. output change | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        notes = "; ".join(r.notes) or "—"
        lines.append(
            f"| {r.name} | {_blocks_cell(r.counts)} | {notes} | {band(r.change)} | {r.verdict} |"
        )
    return "\n".join(lines) + "\n"


def replace_section(text: str, table: str) -> str:
    """``text`` with the part between :data:`START_MARKER` and :data:`END_MARKER` replaced.

    Args:
        text: The page's text.
        table: The new content (the rendered table).

    Returns:
        The new text.

    Raises:
        ValueError: If the markers are missing or out of order.
    """
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {START_MARKER} … {END_MARKER} section")
    return text[: start + len(START_MARKER)] + "\n" + table + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the coverage table; optionally check or rewrite its section of a page.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 1 if ``--check`` found a stale table or a claim was false.
    """
    parser = argparse.ArgumentParser(prog="python -m geosharp.demos.coverage")
    parser.add_argument("--check", metavar="PAGE", help="exit 1 if the page's table differs")
    parser.add_argument("--write", metavar="PAGE", help="replace the page's table")
    parser.add_argument("--only", nargs="*", help="measure only these architectures")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()  # config warnings of the tiny models
    rows = sweep(args.only or None)
    table = render_table(rows)
    print(table, end="")
    status = 0
    if any(not r.exact for r in rows):
        print("false claims: " + ", ".join(r.name for r in rows if not r.exact), file=sys.stderr)
        status = 1
    for path, write in ((args.check, False), (args.write, True)):
        if path is None:
            continue
        readme = Path(path)
        old = readme.read_text(encoding="utf-8")
        new = replace_section(old, table)
        if write:
            if new != old:
                readme.write_text(new, encoding="utf-8")
        elif new != old:
            print(f"{path}: the coverage section is stale; rerun with --write", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
