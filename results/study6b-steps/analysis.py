"""Study 6b's analysis: H1 and H2 of PREREGISTRATION.md decided by its rules, and the secondaries.

Committed before the study measured anything. Reads ``results.csv`` of Study 6's committed
``sgd-wd0`` folder (20 steps) and of this study's merged folder (80 steps), and writes
``analysis.md`` and ``analysis.json`` into the latter's parent:

    .venv/bin/python results/study6b-steps/analysis.py runs/study6b/sgd-wd0/measure
    .venv/bin/python results/study6b-steps/analysis.py runs/study6b/adamw/measure --level adamw

(``--level``: which of Study 6's levels the 80-step folder measured again; Amendment 1.)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

from geosharp.stats import correlation_summary, tau_difference

HERE = Path(__file__).resolve().parent
STUDY6 = HERE.parent / "study6-orbit-dose" / "run"  # <level>/measure: the 20-step folders
ADA, INV = "adaptive worst l2", "geodesic-inv-o2 worst l2"
#: grid position → (adaptive ρ, geodesic ρ), Study 6's pairing
PAIRS = {"middle": (0.316, 0.1), "largest": (1.0, 0.316)}
N_BOOT, SEED = 2000, 0


def load(folder: Path) -> tuple[dict, dict, dict]:
    """(value[(measure, ρ)][model], flags[(measure, ρ)][model], gap[model]) of a folder."""
    values: dict = {}
    flags: dict = {}
    gap: dict = {}
    with (folder / "results.csv").open(newline="") as fh:
        for r in csv.DictReader(fh):
            if r["measure"] not in (ADA, INV) or not r["value"]:
                continue
            key = (r["measure"], round(float(r["rho"]), 4))
            v = float(r["value"])
            values.setdefault(key, {})[r["model_id"]] = v
            flags.setdefault(key, {})[r["model_id"]] = r["flags"]
            gap[r["model_id"]] = float(r["gap"])
    return values, flags, gap


def paired(values: dict, gap: dict, pos: str, keep=None) -> np.ndarray:
    """(gap, adaptive, geodesic) per model at a grid position (finite values; ``keep``: filter)."""
    a_rho, g_rho = PAIRS[pos]
    rows = []
    for m in sorted(gap):
        a = values.get((ADA, a_rho), {}).get(m, math.nan)
        g = values.get((INV, g_rho), {}).get(m, math.nan)
        if keep is not None and not keep(m):
            continue
        if math.isfinite(gap[m]) and math.isfinite(a) and math.isfinite(g):
            rows.append((gap[m], a, g))
    return np.array(rows, dtype=float).reshape(-1, 3)


def dtau(v: np.ndarray) -> dict:
    """Δτ(geodesic − adaptive) with its paired CI."""
    d = tau_difference(v[:, 0], v[:, 2], v[:, 1], n_boot=N_BOOT, seed=SEED)
    return {"n": d.n_models, "dtau": d.diff, "ci": [d.ci_low, d.ci_high]}


def tau(v: np.ndarray, col: int) -> dict:
    """τ-a of one column with the gap, its CI and permutation p."""
    c = correlation_summary(v[:, 0], v[:, col], n_boot=N_BOOT, n_perm=N_BOOT, seed=SEED)
    return {"tau": c.tau_a, "ci": [c.ci_low, c.ci_high], "p": c.p_value, "n": len(v)}


def verdict(ci: list[float], expect: str) -> str:
    """H1 (``expect='above'``) or H2 (``expect='contains'``) by the CI of Δτ."""
    lo, hi = ci
    where = "above 0" if lo > 0 else "below 0" if hi < 0 else "contains 0"
    if expect == "above":
        ok = where == "above 0"
    else:
        ok = where == "contains 0"
    return ("supported" if ok else "not supported") + f" (CI {where})"


def main() -> None:
    """Decide H1 and H2 and write analysis.md and analysis.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("after", help="this study's merged folder (80 steps)")
    ap.add_argument("--level", default="sgd-wd0", help="Study 6's level (default sgd-wd0)")
    args = ap.parse_args()
    after = Path(args.after)
    v20, f20, gap20 = load(STUDY6 / args.level / "measure")
    v80, f80, gap80 = load(after)
    if set(gap80) - set(gap20):
        raise SystemExit(f"models not in Study 6: {sorted(set(gap80) - set(gap20))}")
    gap = {m: gap20[m] for m in gap80}
    rec: dict = {"level": args.level, "models": len(gap), "positions": {}, "cells": {}}
    for pos in PAIRS:
        a20, a80 = paired(v20, gap, pos), paired(v80, gap, pos)
        a_rho, g_rho = PAIRS[pos]

        def sound(m, a_rho=a_rho, g_rho=g_rho):
            return not f80[(ADA, a_rho)].get(m) and not f80[(INV, g_rho)].get(m)

        rec["positions"][pos] = {
            "rho": {"adaptive": a_rho, "geodesic": g_rho},
            "steps20": dtau(a20),
            "steps80": dtau(a80),
            "steps80_sound": dtau(paired(v80, gap, pos, sound))
            if len(paired(v80, gap, pos, sound)) >= 3
            else None,
            "taus": {
                "steps20": {ADA: tau(a20, 1), INV: tau(a20, 2)},
                "steps80": {ADA: tau(a80, 1), INV: tau(a80, 2)},
            },
        }
    for measure, rhos in ((ADA, (0.316, 1.0)), (INV, (0.1, 0.316))):
        for rho in rhos:
            key = (measure, rho)
            ms = sorted(set(v80.get(key, {})) & set(v20.get(key, {})))
            ratio = np.array([v80[key][m] / v20[key][m] for m in ms])
            rec["cells"][f"{measure} @ {rho}"] = {
                "n": len(ms),
                "rising20": sum("rising" in f20[key].get(m, "") for m in ms),
                "rising80": sum("rising" in f80[key].get(m, "") for m in ms),
                "flagged20": sum(bool(f20[key].get(m)) for m in ms),
                "flagged80": sum(bool(f80[key].get(m)) for m in ms),
                "ratio_median": float(np.median(ratio)) if len(ratio) else math.nan,
                "ratio_min": float(ratio.min()) if len(ratio) else math.nan,
                "ratio_max": float(ratio.max()) if len(ratio) else math.nan,
                "below_one": int((ratio < 1.0 - 1e-6).sum()),
            }
    h1 = rec["positions"]["largest"]["steps80"]["ci"]
    h2 = rec["positions"]["middle"]["steps80"]["ci"]
    rec["H1"] = verdict(h1, "above")
    rec["H2"] = verdict(h2, "contains")
    (after.parent / "analysis.json").write_text(json.dumps(rec, indent=1) + "\n")
    (after.parent / "analysis.md").write_text(report(rec))
    print(report(rec))


def _ci(d: dict | None, key: str = "dtau") -> str:
    if d is None:
        return "– (fewer than 3 models)"
    lo, hi = d["ci"]
    return f"{d[key]:+.2f} [{lo:+.2f}, {hi:+.2f}] (n = {d['n']})"


def report(rec: dict) -> str:
    """analysis.md."""
    pos = rec["positions"]
    out = [
        "# Study 6b — Study 6's rising cells at four times the ascent steps: analysis",
        "",
        f"{rec['models']} models of the `{rec['level']}` level (PREREGISTRATION.md).",
        "",
        f"- **H1** (largest ρ, Δτ CI above 0 at 80 steps): **{rec['H1']}**.",
        f"- **H2** (middle ρ, Δτ CI contains 0 at 80 steps): **{rec['H2']}**.",
        "",
        "## Δτ(geodesic − adaptive), paired",
        "",
        "| position | ρ (adaptive / geodesic) | 20 steps | 80 steps | 80 steps, sound cells |",
        "|---|---|---|---|---|",
    ]
    for p, d in pos.items():
        out.append(
            f"| {p} | {d['rho']['adaptive']} / {d['rho']['geodesic']} | {_ci(d['steps20'])} | "
            f"{_ci(d['steps80'])} | {_ci(d['steps80_sound'])} |"
        )
    out += [
        "",
        "## τ-a with the gap",
        "",
        "| measure | ρ | 20 steps | 80 steps |",
        "|---|---|---|---|",
    ]
    for d in pos.values():
        for m, rho in ((ADA, d["rho"]["adaptive"]), (INV, d["rho"]["geodesic"])):
            t20, t80 = d["taus"]["steps20"][m], d["taus"]["steps80"][m]
            out.append(
                f"| {m} | {rho} | {_ci(t20, 'tau')}, p = {t20['p']:.2g} | "
                f"{_ci(t80, 'tau')}, p = {t80['p']:.2g} |"
            )
    out += [
        "",
        "## The cells",
        "",
        "| cell | models | rising 20 → 80 | flagged 20 → 80 | value 80 / 20: median [min, max] "
        "| below 1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in rec["cells"].items():
        out.append(
            f"| {name} | {c['n']} | {c['rising20']} → {c['rising80']} | "
            f"{c['flagged20']} → {c['flagged80']} | {c['ratio_median']:.3f} "
            f"[{c['ratio_min']:.3f}, {c['ratio_max']:.3f}] | {c['below_one']} |"
        )
    out += [
        "",
        "CIs: 95 % percentile bootstrap over models (2000 resamples, seed 0); p: permutation "
        "(2000). Sound cells: neither of the pair flagged at 80 steps.",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
