"""Study 6's analysis: H1 and H2 of PREREGISTRATION.md decided by its rules, and the secondaries.

Committed before the first τ of the study was computed. Reads, for each level's recipe, the
population command's folder ``OUT/<recipe>/measure`` (``results.csv``: one row per model,
measure and ρ; the orbit rows it recorded, :func:`geosharp.studies.orbit_spread.folder_rows`)
and writes ``OUT/analysis.md`` and ``OUT/analysis.json``. Statistics as preregistered:

* per level l and grid position: Δτ_l = τ-a(geodesic inv, gap) − τ-a(adaptive, gap) with the
  paired 95 % bootstrap CI of :func:`geosharp.stats.tau_difference` (2000 resamples, seed 0),
  D_l = s·Δτ_l with s = −1;
* **H1**: C = D_high − D_low at the middle ρ with the level-stratified bootstrap of
  ``power.py``'s :func:`trend` (each level's models resampled within the level, 2000 resamples,
  seed 0; the same arithmetic as ``tau_difference``); "low" and "high" are the levels of
  smallest and largest orbit spread *measured on the study's own models*;
* **H2**: Δτ of the lowest-spread level inside [−0.05, +0.05];
* secondary: D_middle, the order D_low ≤ D_middle ≤ D_high, every τ with its CI and
  permutation p (:func:`geosharp.stats.correlation_summary`), the outer grid positions, the
  spread per level and block kind, and the pooled population.

    .venv/bin/python results/study6-orbit-dose/analysis.py runs/study6
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

from geosharp.stats import correlation_summary, tau_difference
from geosharp.studies.orbit_spread import folder_rows, population_spread, spread_level

HERE = Path(__file__).resolve().parent
S = -1.0  # the stated direction (PREREGISTRATION.md): τ < 0 on these ViTs
LEVELS = {"low": "adamw", "middle": "sgd-wd0", "high": "sgd-init"}  # the pilot's (pilot.md)
ADA, INV = "adaptive worst l2", "geodesic-inv-o2 worst l2"
GRIDS = {ADA: (0.1, 0.316, 1.0), INV: (0.0316, 0.1, 0.316)}
POSITIONS = ("smallest", "middle", "largest")
N_BOOT, SEED, MARGIN = 2000, 0, 0.05


def _power():
    """``power.py`` of this folder (its ``boot_diffs`` and ``trend`` are H1's arithmetic)."""
    spec = importlib.util.spec_from_file_location("_study6_power", HERE / "power.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_study6_power"] = mod
    spec.loader.exec_module(mod)
    return mod


def load(folder: Path) -> tuple[dict[tuple[str, str], dict[str, float]], dict[str, float]]:
    """(values[(measure, position)][model], gap[model]) of one level's study folder."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    gap: dict[str, float] = {}
    with (folder / "results.csv").open(newline="") as fh:
        for r in csv.DictReader(fh):
            m = r["measure"]
            if m not in GRIDS:
                continue
            rho = float(r["rho"])
            pos = POSITIONS[int(np.argmin([abs(math.log(rho / g)) for g in GRIDS[m]]))]
            v = float(r["value"]) if r["value"] not in ("", "nan") else math.nan
            values.setdefault((m, pos), {})[r["model_id"]] = v
            gap[r["model_id"]] = float(r["gap"])
    return values, gap


def columns(values, gap, pos: str) -> np.ndarray:
    """(gap, adaptive, inv) per model at a grid position, models with every value finite."""
    rows = []
    for m in sorted(gap):
        a = values.get((ADA, pos), {}).get(m, math.nan)
        b = values.get((INV, pos), {}).get(m, math.nan)
        if math.isfinite(gap[m]) and math.isfinite(a) and math.isfinite(b):
            rows.append((gap[m], a, b))
    return np.array(rows, dtype=float).reshape(-1, 3)


def fmt(x: float, nd: int = 2) -> str:
    """A signed number, or – when not finite."""
    return "–" if not math.isfinite(x) else f"{x:+.{nd}f}"


def level_record(folder: Path) -> dict:
    """Every statistic of one level."""
    values, gap = load(folder)
    rows = folder_rows(folder)
    kinds = population_spread(rows, models=sorted(gap)) if rows else []
    rec: dict = {
        "models": len(gap),
        "spread": spread_level(kinds) if kinds else math.nan,
        "kinds": {
            k.category: {
                "models": k.models,
                "imbalance_median": k.imbalance[0],
                "across": k.across,
                "within": k.within,
                "headwise": k.headwise,
            }
            for k in kinds
        },
        "positions": {},
    }
    for pos in POSITIONS:
        v = columns(values, gap, pos)
        d = tau_difference(v[:, 0], v[:, 2], v[:, 1], n_boot=N_BOOT, seed=SEED)
        taus = {}
        for name, col in ((ADA, 1), (INV, 2)):
            c = correlation_summary(v[:, 0], v[:, col], n_boot=N_BOOT, n_perm=N_BOOT, seed=SEED)
            taus[name] = {"tau": c.tau_a, "ci": [c.ci_low, c.ci_high], "p": c.p_value}
        rec["positions"][pos] = {
            "n": d.n_models,
            "dtau": d.diff,
            "ci": [d.ci_low, d.ci_high],
            "D": S * d.diff,
            "taus": taus,
            "_v": v,
        }
    return rec


def verdict_h1(lo: float, hi: float) -> str:
    """H1's rule on the CI of C."""
    if lo > 0:
        return "supported (CI above 0)"
    if hi < 0:
        return "contradicted (CI below 0)"
    return "not supported (CI contains 0)"


def verdict_h2(lo: float, hi: float) -> str:
    """H2's rule on the CI of Δτ_low."""
    if -MARGIN <= lo and hi <= MARGIN:
        return f"supported (CI inside ±{MARGIN})"
    side = "below" if lo < -MARGIN else "above"
    return f"not supported (CI reaches {side} ±{MARGIN})"


def analyse(out: Path) -> dict:
    """The analysis of the study in ``out`` (one folder per level recipe)."""
    power = _power()
    levels = {name: level_record(out / recipe / "measure") for name, recipe in LEVELS.items()}
    # "low" and "high" by the study's own spread (PREREGISTRATION.md), the pilot's if unmeasured
    order = sorted(LEVELS, key=lambda n: (levels[n]["spread"], list(LEVELS).index(n)))
    if not all(math.isfinite(levels[n]["spread"]) for n in LEVELS):
        order = list(LEVELS)
    low, mid, high = order
    result: dict = {
        "levels": {
            n: {**{k: v for k, v in levels[n].items() if k != "positions"}, "recipe": LEVELS[n]}
            for n in LEVELS
        },
        "order_by_study_spread": order,
        "reordered": order != list(LEVELS),
        "positions": {},
    }
    for pos in POSITIONS:
        vs = [levels[n]["positions"][pos]["_v"] for n in (low, mid, high)]
        c, lo, hi = (
            power.trend(vs, N_BOOT, SEED)
            if all(len(v) >= 3 for v in vs)
            else (math.nan, math.nan, math.nan)
        )
        per = {
            n: {k: v for k, v in levels[n]["positions"][pos].items() if k != "_v"} for n in LEVELS
        }
        result["positions"][pos] = {"C": c, "C_ci": [lo, hi], "levels": per}
    mid_pos = result["positions"]["middle"]
    c, (lo, hi) = mid_pos["C"], mid_pos["C_ci"]
    d_low = mid_pos["levels"][low]
    result["H1"] = {"C": c, "ci": [lo, hi], "verdict": verdict_h1(lo, hi)}
    result["H2"] = {
        "level": low,
        "dtau": d_low["dtau"],
        "ci": d_low["ci"],
        "verdict": verdict_h2(*d_low["ci"]),
    }
    ds = [mid_pos["levels"][n]["D"] for n in (low, mid, high)]
    result["monotone"] = bool(ds[0] <= ds[1] <= ds[2])
    # the pooled population, read as one study (levels differ in their gap distributions)
    pooled = np.concatenate([levels[n]["positions"]["middle"]["_v"] for n in LEVELS])
    d = tau_difference(pooled[:, 0], pooled[:, 2], pooled[:, 1], n_boot=N_BOOT, seed=SEED)
    result["pooled"] = {"n": d.n_models, "dtau": d.diff, "ci": [d.ci_low, d.ci_high]}
    return result


def markdown(r: dict) -> str:
    """The analysis as the Markdown of ``analysis.md``."""
    low, mid, high = r["order_by_study_spread"]
    w: list[str] = ["# Study 6 — analysis (analysis.py, as preregistered)", ""]
    h1, h2 = r["H1"], r["H2"]
    w.append(
        f"**H1** (C = D_high − D_low at the middle ρ, D = −Δτ(inv − adaptive)): "
        f"C = {fmt(h1['C'])} [{fmt(h1['ci'][0])}, {fmt(h1['ci'][1])}] — {h1['verdict']}."
    )
    w.append(
        f"**H2** (Δτ at the lowest spread, {h2['level']} = {r['levels'][h2['level']]['recipe']}): "
        f"{fmt(h2['dtau'])} "
        f"[{fmt(h2['ci'][0])}, {fmt(h2['ci'][1])}] — {h2['verdict']}."
    )
    rec = {n: r["levels"][n]["recipe"] for n in r["levels"]}
    w += ["", f"Levels by the study's own spread: low = {rec[low]}, middle = {rec[mid]}, high = "]
    w[-1] += rec[high]
    w[-1] += " (reordered from the pilot's)." if r["reordered"] else " (the pilot's order)."
    w.append(f"D_low ≤ D_middle ≤ D_high: {r['monotone']}.")
    p = r["pooled"]
    w.append(
        f"Pooled ({p['n']} models; levels differ in their gaps): Δτ {fmt(p['dtau'])} "
        f"[{fmt(p['ci'][0])}, {fmt(p['ci'][1])}]."
    )
    w += ["", "## Orbit spread per level (the study's models)", ""]
    w += ["| level | recipe | models | orbit spread | kind: median imbalance, spread, within |"]
    w += ["|---|---|---|---|---|"]
    for n in ("low", "middle", "high"):
        lv = r["levels"][n]
        kinds = "; ".join(
            f"{k}: {v['imbalance_median']:.3f}, {v['across']:.3g}, {v['within']:.3g}"
            for k, v in lv["kinds"].items()
        )
        w.append(f"| {n} | {lv['recipe']} | {lv['models']} | {lv['spread']:.3g} | {kinds} |")
    w += ["", "## Δτ(inv − adaptive) per level and grid position", ""]
    w += ["| position | level | n | τ adaptive [CI] | τ inv [CI] | Δτ [CI] | D | C [CI] |"]
    w += ["|---|---|---|---|---|---|---|---|"]
    for pos, pr in r["positions"].items():
        for i, n in enumerate(("low", "middle", "high")):
            x = pr["levels"][n]
            ta, ti = x["taus"][ADA], x["taus"][INV]
            cc = f"{fmt(pr['C'])} [{fmt(pr['C_ci'][0])}, {fmt(pr['C_ci'][1])}]" if i == 0 else ""
            w.append(
                f"| {pos if i == 0 else ''} | {n} | {x['n']} | {fmt(ta['tau'])} "
                f"[{fmt(ta['ci'][0])}, {fmt(ta['ci'][1])}] | {fmt(ti['tau'])} "
                f"[{fmt(ti['ci'][0])}, {fmt(ti['ci'][1])}] | {fmt(x['dtau'])} "
                f"[{fmt(x['ci'][0])}, {fmt(x['ci'][1])}] | {fmt(x['D'])} | {cc} |"
            )
    w += [
        "",
        "Grids: adaptive worst ℓ2 ρ = 0.1, 0.316, 1; geodesic inv ρ = 0.0316, 0.1, 0.316 "
        "(Study 2's). 95 % CIs, 2000 bootstrap resamples, seed 0.",
        "",
    ]
    return "\n".join(w)


def main() -> None:
    """Analyse the folder given, write analysis.md and analysis.json there."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the study's folder (OUT of study.sh)")
    args = ap.parse_args()
    r = analyse(args.out)
    (args.out / "analysis.json").write_text(json.dumps(r, indent=1, allow_nan=True) + "\n")
    (args.out / "analysis.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
