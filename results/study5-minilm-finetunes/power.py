"""Power of Study 5's primary test: the CI half-width of a paired Δτ as a function of n.

The primary test (PREREGISTRATION.md, H1) is the paired Δτ = τ-a(geodesic inv, gap) −
τ-a(adaptive, gap) at the middle ρ, with the 95 % paired percentile bootstrap CI of
``geosharp.stats.tau_difference`` (2000 resamples). This script estimates, for a population of
n models, the CI's half-width and the probability that the CI excludes 0 in the paper's
direction (Δτ > 0), from Study 3's per-model values (``results/minilm-text/results.csv``:
23 fine-tunes measured, the 24th excluded by its rule).

Models of the joint distribution of (gap, adaptive, inv, mix) over the models:

* ``study3-resample``: n models drawn with replacement from Study 3's 23 (their exact joint
  values; a model drawn twice is a tie, which τ-a counts as 0). The true Δτ is Study 3's (+0.03
  inv, −0.01 mix at the middle ρ): the half-width under "no difference".
* ``study3-copula``: a Gaussian copula with Study 3's pairwise Kendall τ (r = sin(πτ/2));
  the same as above without ties.
* ``effect d=…, c=…``: a Gaussian copula of (gap, adaptive, geodesic) with the paper's
  τ(adaptive, gap) = 0.06, τ(geodesic, gap) = 0.06 + d for d ∈ {0.2, 0.3} (the paper's Δτ:
  0.22 inv, 0.32 mix) and a between-measure τ(adaptive, geodesic) = c ∈ {0.3, 0.5, 0.7, 0.8}.
  Study 3's own c (≈ 0.9) is not possible with d ≥ 0.2 (the copula is not positive definite):
  two measures that rank the models alike cannot differ much in their τ with the gap, so a
  real difference of 0.2–0.3 comes with a smaller c, and a wider CI.

A Gaussian copula's τ are those of the population, so the simulated Δτ is centred on the
target. Every scenario: R replications per n, each a fresh population of n models and one
``tau_difference`` call (2000 resamples, seed = replication).

    .venv/bin/python results/study5-minilm-finetunes/power.py  [--reps 100]

Writes ``power.csv`` and ``power.md`` beside this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _stats():
    """geosharp.stats, loaded from its file (it imports only numpy and scipy)."""
    spec = importlib.util.spec_from_file_location("_gs_stats", ROOT / "src/geosharp/stats.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_gs_stats"] = mod
    spec.loader.exec_module(mod)
    return mod


stats = _stats()

MEASURES = {
    "adaptive": "adaptive worst l2",
    "inv": "geodesic-inv-o2 worst l2",
    "mix": "geodesic-mix-o2 worst l2",
}
#: Study 3's grids (smallest, middle, largest) per measure.
GRIDS = {"adaptive": (0.1, 0.316, 1.0), "inv": (0.01, 0.0316, 0.1), "mix": (0.01, 0.0316, 0.1)}
PAPER = {"adaptive": 0.06, "inv": 0.28, "mix": 0.38}
NS = (24, 32, 48, 64, 80, 96)
ORDER = ("gap", "adaptive", "inv", "mix")


def study3(position: int = 1) -> pd.DataFrame:
    """Study 3's models × (gap, adaptive, inv, mix) at one grid position (1 = middle)."""
    d = pd.read_csv(ROOT / "results/minilm-text/results.csv")
    d = d[d["excluded"].isna()]
    cols = {}
    for key, name in MEASURES.items():
        rho = GRIDS[key][position]
        s = d[(d["measure"] == name) & np.isclose(d["rho"], rho)].set_index("model_id")
        cols[key] = s["value"]
        cols["gap"] = s["gap"]
    return pd.DataFrame(cols)[list(ORDER)].dropna()


def tau_matrix(w: pd.DataFrame) -> np.ndarray:
    v = w[list(ORDER)].to_numpy()
    k = len(ORDER)
    out = np.eye(k)
    for i in range(k):
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = stats.kendall_tau_a(v[:, i], v[:, j])
    return out


def copula(tau: np.ndarray) -> np.ndarray | None:
    """The Gaussian correlation of a τ matrix (None if not positive definite)."""
    r = np.sin(np.pi * tau / 2)
    np.fill_diagonal(r, 1.0)
    if np.linalg.eigvalsh(r).min() <= 1e-6:
        return None
    return r


def _three(v: np.ndarray) -> np.ndarray:
    """(gap, adaptive, geodesic) as the four columns (gap, adaptive, inv, mix = inv)."""
    return np.column_stack([v, v[:, 2]])


def simulate(draw, n: int, reps: int, pair: str) -> dict:
    """Half-width, Δτ and P(CI low > 0) of Δτ(pair − adaptive) over ``reps`` populations."""
    j = ORDER.index(pair)
    a = ORDER.index("adaptive")
    hw, diff, hit, miss = [], [], 0, 0
    for rep in range(reps):
        v = draw(n, np.random.default_rng(10_000 + rep))
        res = stats.tau_difference(v[:, 0], v[:, j], v[:, a], n_boot=2000, seed=rep)
        if not math.isfinite(res.ci_low):
            miss += 1
            continue
        hw.append((res.ci_high - res.ci_low) / 2)
        diff.append(res.diff)
        hit += res.ci_low > 0
    k = len(hw)
    return {
        "n": n,
        "pair": f"{pair} - adaptive",
        "mean_diff": float(np.mean(diff)),
        "half_width_mean": float(np.mean(hw)),
        "half_width_q10": float(np.quantile(hw, 0.1)),
        "half_width_q90": float(np.quantile(hw, 0.9)),
        "power": hit / k,
        "reps": k,
        "undefined": miss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--ns", type=int, nargs="*", default=list(NS))
    args = ap.parse_args()

    w = study3(1)
    t3 = tau_matrix(w)
    lines = ["# Study 5 power computation (output of power.py)", ""]
    lines.append(f"Study 3, middle ρ, {len(w)} models. Kendall τ-a matrix ({', '.join(ORDER)}):")
    lines.append("")
    lines.append("| | " + " | ".join(ORDER) + " |")
    lines.append("|---" * (len(ORDER) + 1) + "|")
    for i, k in enumerate(ORDER):
        lines.append(f"| {k} | " + " | ".join(f"{x:+.2f}" for x in t3[i]) + " |")
    for p in ("inv", "mix"):
        r = stats.tau_difference(w["gap"], w[p], w["adaptive"], n_boot=2000, seed=0)
        lines.append("")
        lines.append(
            f"Study 3 observed Δτ({p} − adaptive) = {r.diff:+.3f} "
            f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}], half-width {(r.ci_high - r.ci_low) / 2:.3f}"
        )
    gaps = w["gap"].to_numpy()
    lines.append("")
    lines.append(
        f"Study 3 gaps: sd {gaps.std(ddof=1):.4f}, IQR {np.subtract(*np.quantile(gaps, [0.75, 0.25])):.4f}, "
        f"range [{gaps.min():.4f}, {gaps.max():.4f}]"
    )

    v3 = w[list(ORDER)].to_numpy()
    scenarios = {"study3-resample": lambda n, g: v3[g.integers(0, len(v3), n)]}
    r3 = copula(t3)
    scenarios["study3-copula"] = lambda n, g, r=r3: g.multivariate_normal(np.zeros(4), r, n)
    for d in (0.2, 0.3):
        for c in (0.3, 0.5, 0.7, 0.8):
            tau = np.eye(3)
            tau[0, 1] = tau[1, 0] = PAPER["adaptive"]
            tau[0, 2] = tau[2, 0] = PAPER["adaptive"] + d
            tau[1, 2] = tau[2, 1] = c
            r = copula(tau)
            label = f"effect d={d:.1f} c={c:.1f}"
            if r is None:
                lines.append(f"\n{label}: not positive definite, skipped")
                continue
            scenarios[label] = lambda n, g, r=r: _three(g.multivariate_normal(np.zeros(3), r, n))

    rows = []
    for label, draw in scenarios.items():
        for pair in ("inv", "mix") if label.startswith("study3") else ("inv",):
            for n in args.ns:
                row = simulate(draw, n, args.reps, pair)
                row["scenario"] = label
                rows.append(row)
                print(f"{label:28s} {row['pair']:16s} n={n:4d} Δτ={row['mean_diff']:+.3f} "
                      f"half-width={row['half_width_mean']:.3f} power={row['power']:.2f}",
                      flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(HERE / "power.csv", index=False)
    lines.append("")
    lines.append(f"Simulated ({args.reps} populations per cell; 2000 bootstrap resamples each): "
                 "mean Δτ, mean 95 % CI half-width [10 %, 90 % quantiles], "
                 "power = P(CI low > 0).")
    lines.append("")
    lines.append("| scenario | pair | n | mean Δτ | half-width | power |")
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['pair']} | {r['n']} | {r['mean_diff']:+.3f} | "
            f"{r['half_width_mean']:.3f} [{r['half_width_q10']:.3f}, {r['half_width_q90']:.3f}] "
            f"| {r['power']:.2f} |"
        )
    (HERE / "power.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
