"""Study 5's analysis: H1–H3 of PREREGISTRATION.md decided by its rules, and every secondary row.

Reads the exported study (``RUN/main/results.csv``: the six measures at ρ₀; ``RUN/outer/
results.csv``: adaptive, geodesic inv and mix at the outer ρ), the manifest and the pilot's
plan, and writes ``RUN/analysis.md`` and ``RUN/analysis.json``. Statistics as preregistered:
τ-a with the 95 % percentile bootstrap CI and permutation p
(:func:`geosharp.stats.correlation_summary`, 2000 resamples and permutations, seed 0), paired
Δτ with :func:`geosharp.stats.tau_difference` (2000 resamples, seed 0), over the models not
excluded with finite values (n per cell).

    python results/study5-minilm-finetunes/analysis.py results/study5-minilm-finetunes/gpu-run
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

from geosharp.stats import correlation_summary, kendall_tau_a, tau_difference

ADA, INV, MIX = "adaptive worst l2", "geodesic-inv-o2 worst l2", "geodesic-mix-o2 worst l2"
ADA_B, INV_B, MIX_B = (m.replace(" worst", "-blocks worst") for m in (ADA, INV, MIX))
PAPER = {"inv": 0.22, "mix": 0.32}  # the paper's Δτ(geodesic − adaptive) on MNLI


def load(run: Path) -> tuple[dict, dict, dict, list[str]]:
    """(values[(measure, position)][model], gap[model], hp[model], models)."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    gap: dict[str, float] = {}
    hp: dict[str, dict] = {}
    plan = json.loads((run / "plan.json").read_text())
    for folder in ("main", "outer"):
        path = run / folder / "results.csv"
        if not path.is_file():
            continue
        for r in csv.DictReader(open(path, newline="")):
            m, rho = r["measure"], float(r["rho"])
            grid = plan["grids"][m]
            pos = ["small", "rho0", "large"][int(np.argmin([abs(math.log(rho / g)) for g in grid]))]
            v = float(r["value"]) if r["value"] not in ("", "nan") else math.nan
            values.setdefault((m, pos), {})[r["model_id"]] = v
            gap[r["model_id"]] = float(r["gap"])
            hp[r["model_id"]] = {k[3:]: float(v) for k, v in r.items() if k.startswith("hp_")}
    return values, gap, hp, sorted(gap)


def vec(values: dict, key: tuple[str, str], models: list[str]) -> np.ndarray:
    return np.array([values.get(key, {}).get(m, math.nan) for m in models], dtype=float)


def fmt(x: float, nd: int = 2) -> str:
    return "–" if not math.isfinite(x) else f"{x:+.{nd}f}"


def main(run: Path) -> None:
    values, gap, hp, models = load(run)
    t = np.array([gap[m] for m in models])
    out: dict = {"n_models": len(models)}
    lines: list[str] = []
    w = lines.append

    def diff(a: tuple[str, str], b: tuple[str, str], target: np.ndarray = t) -> dict:
        d = tau_difference(target, vec(values, a, models), vec(values, b, models), n_boot=2000,
                           seed=0)
        return {"diff": d.diff, "ci": [d.ci_low, d.ci_high], "n": d.n_models}

    def dtxt(d: dict) -> str:
        return f"{fmt(d['diff'])} [{fmt(d['ci'][0])}, {fmt(d['ci'][1])}] (n = {d['n']})"

    def verdict(d: dict) -> str:
        lo, hi = d["ci"]
        if lo > 0:
            return "supported (CI above 0)"
        if hi < 0:
            return "contradicted (CI below 0: adaptive stronger)"
        return "not supported (CI contains 0)"

    # -- each measure's τ ------------------------------------------------------------------
    taus = {}
    for key in sorted(values):
        s = correlation_summary(t, vec(values, key, models), n_boot=2000, n_perm=2000, seed=0)
        taus[f"{key[0]} @ {key[1]}"] = {"tau": s.tau_a, "ci": [s.ci_low, s.ci_high],
                                        "p": s.p_value, "n": s.n_models}
    out["tau"] = taus

    # -- H1, H2 ----------------------------------------------------------------------------
    h1 = diff((INV, "rho0"), (ADA, "rho0"))
    h2 = diff((MIX, "rho0"), (ADA, "rho0"))
    for name, d, key in (("H1", h1, "inv"), ("H2", h2, "mix")):
        d["verdict"] = verdict(d)
        d["rules_out_paper"] = bool(d["ci"][1] < PAPER[key])
        out[name] = d

    # -- H3 ----------------------------------------------------------------------------------
    inv = vec(values, (INV, "rho0"), models)
    d3 = tau_difference(inv, vec(values, (ADA_B, "rho0"), models),
                        vec(values, (ADA, "rho0"), models), n_boot=2000, seed=0)
    blocks_vs_full = diff((ADA_B, "rho0"), (ADA, "rho0"))
    f = blocks_vs_full["diff"] / h1["diff"] if h1["diff"] else math.nan
    h3a = d3.ci_low > 0
    h3b = f >= 0.5 and blocks_vs_full["ci"][0] > 0
    if h1["ci"][0] > 0:
        h3 = "supported" if h3a and h3b else ("partly supported" if h3a or h3b else "not supported")
    else:
        h3 = "not applicable (H1 not supported: no difference to account for)"
    out["H3"] = {
        "D3": {"diff": d3.diff, "ci": [d3.ci_low, d3.ci_high], "n": d3.n_models},
        "tau_inv_adaptive_blocks": kendall_tau_a(inv, vec(values, (ADA_B, "rho0"), models)),
        "tau_inv_adaptive": kendall_tau_a(inv, vec(values, (ADA, "rho0"), models)),
        "blocks_minus_full": blocks_vs_full, "f": f, "H3a": bool(h3a), "H3b": bool(h3b),
        "verdict": h3,
    }  # fmt: skip
    secondary = {
        "inv-blocks − adaptive-blocks": diff((INV_B, "rho0"), (ADA_B, "rho0")),
        "mix-blocks − adaptive-blocks": diff((MIX_B, "rho0"), (ADA_B, "rho0")),
        "inv − inv-blocks": diff((INV, "rho0"), (INV_B, "rho0")),
        "mix − mix-blocks": diff((MIX, "rho0"), (MIX_B, "rho0")),
    }
    for pos in ("small", "large"):
        secondary[f"inv − adaptive @ {pos} ρ"] = diff((INV, pos), (ADA, pos))
        secondary[f"mix − adaptive @ {pos} ρ"] = diff((MIX, pos), (ADA, pos))
    out["secondary"] = secondary

    # -- the bound: H1 and H2's 99 % CI ---------------------------------------------------------
    for name, key in (("H1", INV), ("H2", MIX)):
        d = tau_difference(t, vec(values, (key, "rho0"), models), vec(values, (ADA, "rho0"), models),
                           n_boot=2000, level=0.99, seed=0)
        out[name]["ci99"] = [d.ci_low, d.ci_high]

    # -- exploratory: label-noise subgroups, by the labels actually flipped ---------------------
    flips = {r["name"]: int(r["label_flips"]) for r in csv.DictReader(open(run / "manifest.csv"))}
    expl = {}
    for label, keep in (("no label flipped", lambda m: flips[m] == 0),
                        ("labels flipped", lambda m: flips[m] > 0)):
        sub = [m for m in models if keep(m)]
        ts = np.array([gap[m] for m in sub])
        row = {"n": len(sub)}
        for key in ((ADA, "rho0"), (INV, "rho0"), (MIX, "rho0")):
            row[key[0]] = kendall_tau_a(ts, vec(values, key, sub))
        d = tau_difference(ts, vec(values, (INV, "rho0"), sub), vec(values, (ADA, "rho0"), sub),
                           n_boot=2000, seed=0)
        row["inv − adaptive"] = {"diff": d.diff, "ci": [d.ci_low, d.ci_high], "n": d.n_models}
        expl[label] = row
    out["exploratory"] = expl

    # -- descriptives ----------------------------------------------------------------------------
    test_err = [float(r["test_error"]) for r in csv.DictReader(open(run / "manifest.csv"))]
    p = statistics.median(test_err)
    se = math.sqrt(p * (1 - p) / 4000)
    sd = statistics.stdev(t)
    q1, q3 = np.percentile(t, [25, 75])
    out["gap"] = {"mean": float(t.mean()), "sd": sd, "iqr": float(q3 - q1), "min": float(t.min()),
                  "max": float(t.max()), "heldout_median_error": p, "heldout_se": se,
                  "se_over_sd": se / sd}

    # -- the text --------------------------------------------------------------------------------
    plan = json.loads((run / "plan.json").read_text())
    excluded = list(csv.DictReader(open(run / "excluded.csv"))) if (run / "excluded.csv").is_file() else []
    w("# Study 5 — analysis (written by `analysis.py`, every number from the committed files)\n")
    w(f"Models: {len(models)} measured of 64 trained ({len(excluded)} excluded by the preregistered "
      f"held-out rule: " + ", ".join(f"{e['name']} ({float(e['test_error']):.3f})" for e in excluded)
      + ").")
    w(f"Sharpness sample: the first {plan['samples']} snippets of `sharpness.csv` in batches of 128 "
      f"({plan['samples'] // 128} batches), Auto-PGD S = {plan['steps']} steps (the steps rule), "
      "grids by the ρ rule on `study5-000`: "
      + "; ".join(f"{m} {', '.join(f'{r:g}' for r in g)}" for m, g in plan["grids"].items()) + ".")
    w(f"Gap = held-out error − train error: mean {t.mean():.3f}, sd {sd:.3f}, IQR {q3 - q1:.3f}, "
      f"from {t.min():+.3f} to {t.max():+.3f}. Held-out error's standard error at the median "
      f"held-out error {p:.3f} on 4,000 snippets: {se:.4f} (SE / sd of the gaps = {se / sd:.2f}).\n")
    w("## Hypotheses (middle ρ, paired 95 % bootstrap CI; the paper's direction is Δτ > 0)\n")
    w("| hypothesis | Δτ [95 % CI] (n) | verdict | the paper's Δτ ruled out? |")
    w("|---|---|---|---|")
    w(f"| H1: geodesic inv − adaptive | {dtxt(h1)} | {h1['verdict']} | "
      f"{'yes' if h1['rules_out_paper'] else 'no'} (paper 0.22) |")
    w(f"| H2: geodesic mix − adaptive | {dtxt(h2)} | {h2['verdict']} | "
      f"{'yes' if h2['rules_out_paper'] else 'no'} (paper 0.32) |")
    h3d = out["H3"]
    w(f"| H3a: D₃ = τ(inv, adaptive-blocks) − τ(inv, adaptive) | {fmt(d3.diff)} "
      f"[{fmt(d3.ci_low)}, {fmt(d3.ci_high)}] (n = {d3.n_models}) | "
      f"{'holds' if h3a else 'does not hold'} | – |")
    w(f"| H3b: Δτ(adaptive-blocks − adaptive), f = its share of H1's Δτ | "
      f"{dtxt(blocks_vs_full)}, f = {f:.2f} | {'holds' if h3b else 'does not hold'} | – |")
    w(f"| **H3** | | {h3} | |\n")
    w(f"τ between the measures' values (models ranked alike = 1): τ(inv, adaptive) = "
      f"{h3d['tau_inv_adaptive']:.2f}, τ(inv, adaptive-blocks) = {h3d['tau_inv_adaptive_blocks']:.2f}.\n")
    w(f"99 % CIs of the same Δτ (the bound these data set, for this population and protocol): "
      f"H1 [{fmt(h1['ci99'][0])}, {fmt(h1['ci99'][1])}], H2 [{fmt(h2['ci99'][0])}, "
      f"{fmt(h2['ci99'][1])}].\n")
    w("## Each measure's τ with the gap\n")
    w("| measure | ρ position | τ-a [95 % CI] | p | n |")
    w("|---|---|---|---|---|")
    for k, v in taus.items():
        m, pos = k.split(" @ ")
        rho = plan["grids"][m][["small", "rho0", "large"].index(pos)]
        w(f"| {m} | {pos} (ρ = {rho:g}) | {fmt(v['tau'])} [{fmt(v['ci'][0])}, {fmt(v['ci'][1])}] "
          f"| {v['p']:.3g} | {v['n']} |")
    w("\n## Secondary paired differences\n")
    w("| Δτ | [95 % CI] (n) |")
    w("|---|---|")
    for k, d in secondary.items():
        w(f"| {k} | {dtxt(d)} |")
    w("\n## Exploratory: label-noise subgroups (middle ρ)\n")
    w("Grouped by the labels actually flipped (`manifest.csv`'s `label_flips`, as corrected by "
      "`correct_noise.py`): a model with 1,024 training snippets had none flipped whatever noise "
      "was drawn.\n")
    w("| subgroup | n | τ adaptive | τ inv | τ mix | Δτ inv − adaptive [CI] |")
    w("|---|---|---|---|---|---|")
    for k, r in expl.items():
        d = r["inv − adaptive"]
        w(f"| {k} | {r['n']} | {fmt(r[ADA])} | {fmt(r[INV])} | {fmt(r[MIX])} | "
          f"{fmt(d['diff'])} [{fmt(d['ci'][0])}, {fmt(d['ci'][1])}] |")
    (run / "analysis.md").write_text("\n".join(lines) + "\n")
    (run / "analysis.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
