"""Paired bootstrap Δτ between the curvature rows of a study folder (geosharp.stats.tau_difference).

.venv/bin/python results/curvature/paired.py results/curvature/vit-mnist
"""

import sqlite3
import sys
from pathlib import Path

from geosharp.stats import kendall_tau_a, tau_difference

PAIRS = [
    ("geodesic-inv", "adaptive"),
    ("geodesic-mix", "adaptive"),
    ("geodesic-inv", "euclidean"),
    ("adaptive", "euclidean"),
]

folder = Path(sys.argv[1])
conn = sqlite3.connect(f"file:{folder / 'study.sqlite'}?mode=ro", uri=True)
gap = dict(conn.execute("select model_id, gap from models where metrics not like '%excluded%'"))
vals: dict[str, dict[str, float]] = {}
for mid, measure, value in conn.execute("select model_id, measure, value from measurements"):
    if mid in gap and value is not None:
        vals.setdefault(measure, {})[mid] = value
lines = [
    "| quantity | measure 1 | measure 2 | τ 1 | τ 2 | Δτ = τ 1 − τ 2 [95 % CI] |",
    "|---|---|---|---|---|---|",
]
for q in ("lambda_max", "trace"):
    for a, b in PAIRS:
        if f"{a} curvature {q}" not in vals or f"{b} curvature {q}" not in vals:
            continue  # a measure the study did not measure (Study 3: inv and adaptive only)
        s1, s2 = vals[f"{a} curvature {q}"], vals[f"{b} curvature {q}"]
        ids = sorted(set(s1) & set(s2))
        g, x1, x2 = [gap[m] for m in ids], [s1[m] for m in ids], [s2[m] for m in ids]
        d = tau_difference(g, x1, x2)
        lines.append(
            f"| {q} | {a} | {b} | {kendall_tau_a(g, x1):+.2f} | {kendall_tau_a(g, x2):+.2f} | "
            f"{d.diff:+.2f} [{d.ci_low:+.2f}, {d.ci_high:+.2f}] |"
        )
text = "\n".join(lines) + "\n"
print(text)
(folder / "paired_curvature.md").write_text(text)
