"""Preregistered analysis of Study 1's second population (written before the run).

Usage: ``python results/diagonal-2/analysis.py DIR`` (a folder with ``study.sqlite``; needs no
checkpoints). Writes ``DIR/analysis.md``: τ of the gap with batch size and step size (H0), every
measure's τ at every ρ with its CI (H1, H3), and the paired Δτ of the preregistered pairs (H2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from geosharp.stats import bootstrap_ci, kendall_tau_a, tau_difference
from geosharp.studies.store import Store

ADA = "adaptive worst l2"
INV = "geodesic-inv-oexact worst l2"
MIX = "geodesic-mix-oexact worst l2"
PAIRS = [
    (INV, ADA),
    (MIX, ADA),
    (MIX, INV),
    ("geodesic-inv-o2 worst l2", INV),
    ("geodesic-mix-o2 worst l2", MIX),
]


def _ci(t, s) -> str:
    t, s = np.asarray(t, float), np.asarray(s, float)
    lo, hi = bootstrap_ci(t, s, n_boot=2000, seed=0)
    return f"{kendall_tau_a(t, s):+.2f} [{lo:+.2f}, {hi:+.2f}]"


def main(folder: str) -> str:
    """Write and return ``analysis.md`` of ``folder``."""
    out = Path(folder)
    with Store(out / "study.sqlite", None, None) as store:
        models = [m for m in store.models() if not m.get("excluded")]
        rows = [r for r in store.measurements() if not r.get("error") and r["value"] is not None]
    gap = {m["model_id"]: m["gap"] for m in models}
    hp = {m["model_id"]: m["hparams"] for m in models}
    ids = sorted(gap)
    vals: dict[tuple[str, float], dict[str, float]] = {}
    for r in rows:
        if r["model_id"] in gap:
            vals.setdefault((r["measure"], r["rho"]), {})[r["model_id"]] = r["value"]
    g = [gap[m] for m in ids]
    lines = ["# Study 1, second population — preregistered analysis", ""]
    lines += [f"{len(ids)} models analysed.", "", "## H0: the gap against the SGD axis", ""]
    lines += ["| hyperparameter | τ-a with the gap [95 % CI] |", "|---|---|"]
    for key in ("batch_size", "lr"):
        lines.append(f"| {key} | {_ci(g, [hp[m][key] for m in ids])} |")
    lines += ["", "## τ-a of every measure (H1, H3)", "", "| measure | ρ | τ-a [95 % CI] |"]
    lines.append("|---|---|---|")
    for (measure, rho), v in sorted(vals.items()):
        ms = [m for m in ids if m in v]
        lines.append(f"| {measure} | {rho:g} | {_ci([gap[m] for m in ms], [v[m] for m in ms])} |")
    lines += ["", "## Paired Δτ (H2)", "", "| measure 1 | measure 2 | ρ | Δτ = τ₁ − τ₂ [95 % CI] |"]
    lines.append("|---|---|---|---|")
    for a, b in PAIRS:
        for rho in sorted({r for m, r in vals if m == a}):
            va, vb = vals.get((a, rho), {}), vals.get((b, rho), {})
            ms = [m for m in ids if m in va and m in vb]
            d = tau_difference(
                [gap[m] for m in ms], [va[m] for m in ms], [vb[m] for m in ms], seed=0
            )
            lines.append(
                f"| {a} | {b} | {rho:g} | {d.diff:+.2f} [{d.ci_low:+.2f}, {d.ci_high:+.2f}] |"
            )
    text = "\n".join(lines) + "\n"
    (out / "analysis.md").write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    print(main(sys.argv[1]))
