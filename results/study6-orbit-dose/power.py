"""Power of Study 6's tests: the trend of Δτ over the spread levels and the equivalence at the
lowest level, as functions of n (models per level).

Study 6 (PREREGISTRATION.md) has three levels (low, middle, high orbit spread). Within level l,
Δτ_l = τ-a(geodesic inv, gap) − τ-a(adaptive, gap) (worst case ℓ2, middle ρ), and
D_l = s·Δτ_l with s = −1 (the stated direction: on these ViTs sharper models generalize better,
τ < 0 in Studies 2 and 4, so a more negative τ is the stronger measure and D_l > 0 says geodesic
inv is stronger). Tests:

* **trend** (H1): the linear contrast C = D_high − D_low, with the 95 % percentile CI of a
  bootstrap stratified by level (each level's models resampled within the level, both τ of each
  level recomputed on the same draw, self-pairs of a model drawn twice left out, as
  ``geosharp.stats.tau_difference``); supported if the CI lies above 0;
* **equivalence** (H2): the 95 % paired CI of Δτ_low (``tau_difference``) inside [−0.05, +0.05].

Models of the joint (gap, adaptive, inv) per level, from the committed per-model values at the
middle ρ (adaptive ρ = 0.316, inv ρ = 0.1):

* ``null (Study 2 x3)``: every level resampled with replacement from Study 2's 48 ViTs
  (``results/vit-mnist/results.csv``; orbit spread 0.04–0.05): C = 0 in truth;
* ``committed (2, 2, 4)``: low and middle from Study 2, high from Study 4's 48 ViTs
  (``results/vit-orbit/results.csv``, spread 0.23–0.24): C = the committed difference
  (D 0.03 → 0.06);
* ``copula d``: Gaussian copulas with Study 2's τ(adaptive, gap) and τ(adaptive, inv) at the
  low level (D = 0) and D = d/2, d at the middle and high levels (τ(inv, gap) = τ(adaptive, gap)
  − d, the between-measure τ at the high level Study 4's), d ∈ {0.1, 0.15, 0.2};
* equivalence: ``Study 2 resampled`` (Δτ ≈ −0.03, its own) and ``copula D = 0`` (Study 2's τ,
  no difference).

    .venv/bin/python results/study6-orbit-dose/power.py [--reps 100]

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
S = -1.0  # the stated direction (τ < 0 on these ViTs)
NS = (32, 48, 64, 96)
RHO = {"adaptive worst l2": 0.316, "geodesic-inv-o2 worst l2": 0.1}


def _tau_module():
    """geosharp.stats.tau, loaded from its file (numpy and scipy only)."""
    path = ROOT / "src/geosharp/stats/tau.py"
    spec = importlib.util.spec_from_file_location("_gs_tau", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_gs_tau"] = mod
    spec.loader.exec_module(mod)
    return mod


tau = _tau_module()


def committed(folder: str) -> np.ndarray:
    """(gap, adaptive, inv) per model of a committed study at the middle ρ."""
    d = pd.read_csv(ROOT / "results" / folder / "results.csv")
    cols = {}
    for name, rho in RHO.items():
        s = d[(d["measure"] == name) & np.isclose(d["rho"], rho)].set_index("model_id")
        cols[name] = s["value"]
        cols["gap"] = s["gap"]
    w = pd.DataFrame(cols).dropna()
    return w[["gap", *RHO]].to_numpy()


def kendall(v: np.ndarray) -> np.ndarray:
    k = v.shape[1]
    out = np.eye(k)
    for i in range(k):
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = tau.kendall_tau_a(v[:, i], v[:, j])
    return out


def copula_draw(tmat: np.ndarray):
    r = np.sin(np.pi * tmat / 2)
    np.fill_diagonal(r, 1.0)
    if np.linalg.eigvalsh(r).min() <= 1e-6:
        raise ValueError(f"not positive definite: {tmat}")
    return lambda n, g: g.multivariate_normal(np.zeros(3), r, n)


def boot_diffs(v: np.ndarray, n_boot: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Δτ(inv − adaptive) of ``v`` = (gap, adaptive, inv) and its bootstrap replicates
    (``tau_difference``'s arithmetic: self-pairs left out; undefined replicates NaN)."""
    t, a, b = v[:, 0], v[:, 2], v[:, 1]
    m = len(t)
    sm = lambda x: np.sign(x[:, None] - x[None, :])  # noqa: E731
    st, s1, s2 = sm(t), sm(a), sm(b)
    total = m * (m - 1) / 2.0
    diff = ((st * s1).sum() - (st * s2).sum()) / 2.0 / total
    conc = st * s1 - st * s2
    counts = np.zeros((n_boot, m))
    idx = rng.integers(0, m, size=(n_boot, m))
    np.add.at(counts, (np.arange(n_boot)[:, None], idx), 1.0)
    quad = lambda mat: np.einsum("bi,bi->b", counts @ mat, counts)  # noqa: E731
    self_pairs = (np.einsum("bi,bi->b", counts, counts) - m) / 2.0
    ties = [(quad((x == 0).astype(float)) - m) / 2.0 for x in (st, s1, s2)]
    ok = np.all([x < total - 0.5 for x in ties], axis=0)
    reps = quad(conc) / 2.0 / (total - self_pairs)
    reps[~ok] = np.nan
    return float(diff), reps


def trend(levels: list[np.ndarray], n_boot: int, seed: int) -> tuple[float, float, float]:
    """C = s·Δτ_high − s·Δτ_low and its 95 % stratified-bootstrap CI."""
    rng = np.random.default_rng(seed)
    (d_low, r_low), _, (d_high, r_high) = (boot_diffs(v, n_boot, rng) for v in levels)
    reps = S * r_high - S * r_low
    reps = reps[np.isfinite(reps)]
    lo, hi = np.quantile(reps, [0.025, 0.975])
    return S * (d_high - d_low), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--ns", type=int, nargs="*", default=list(NS))
    args = ap.parse_args()
    s2, s4 = committed("vit-mnist"), committed("vit-orbit")
    k2, k4 = kendall(s2), kendall(s4)
    lines = ["# Study 6 power computation (output of power.py)", ""]
    for label, v, k in (("Study 2", s2, k2), ("Study 4", s4, k4)):
        r = tau.tau_difference(v[:, 0], v[:, 2], v[:, 1], n_boot=2000, seed=0)
        lines.append(
            f"{label} ({len(v)} models, middle ρ): τ(adaptive, gap) {k[0, 1]:+.3f}, "
            f"τ(inv, gap) {k[0, 2]:+.3f}, τ(adaptive, inv) {k[1, 2]:+.3f}; Δτ(inv − adaptive) "
            f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
        )
    lines.append("")
    resample = lambda v: (lambda n, g: v[g.integers(0, len(v), n)])  # noqa: E731
    t_ada, c2, c4 = k2[0, 1], k2[1, 2], k4[1, 2]

    used: dict[str, float] = {}

    def level_copula(d: float, c: float):
        """The copula of a level; c lowered by 0.05 until it is positive definite (a real
        difference d between the measures' τ with the gap bounds their τ with each other)."""
        while True:
            m = np.eye(3)
            m[0, 1] = m[1, 0] = t_ada
            m[0, 2] = m[2, 0] = t_ada - d  # s = −1: geodesic stronger by d
            m[1, 2] = m[2, 1] = c
            try:
                draw = copula_draw(m)
            except ValueError:
                c -= 0.05
                continue
            used[f"d={d:g}"] = c
            return draw

    scenarios = {
        "null (Study 2 x3)": [resample(s2)] * 3,
        "committed (2, 2, 4)": [resample(s2), resample(s2), resample(s4)],
    }
    for d in (0.1, 0.15, 0.2):
        scenarios[f"copula d={d:g}"] = [
            level_copula(0.0, c2),
            level_copula(d / 2, 0.5 * (c2 + c4)),
            level_copula(d, c4),
        ]
    rows = []
    for label, draws in scenarios.items():
        for n in args.ns:
            cs, hw, hit = [], [], 0
            for rep in range(args.reps):
                g = np.random.default_rng(60_000 + rep)
                levels = [draw(n, g) for draw in draws]
                c, lo, hi = trend(levels, args.boot, rep)
                cs.append(c)
                hw.append((hi - lo) / 2)
                hit += lo > 0
            row = {"test": "trend", "scenario": label, "n_per_level": n,
                   "mean_estimate": float(np.mean(cs)), "half_width": float(np.mean(hw)),
                   "power": hit / args.reps}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    for label, draw in (("Study 2 resampled", resample(s2)), ("copula D=0", level_copula(0, c2))):
        for n in args.ns:
            ds, hw, hit = [], [], 0
            for rep in range(args.reps):
                v = draw(n, np.random.default_rng(70_000 + rep))
                r = tau.tau_difference(v[:, 0], v[:, 2], v[:, 1], n_boot=args.boot, seed=rep)
                ds.append(r.diff)
                hw.append((r.ci_high - r.ci_low) / 2)
                hit += (r.ci_low > -0.05) and (r.ci_high < 0.05)
            row = {"test": "equivalence", "scenario": label, "n_per_level": n,
                   "mean_estimate": float(np.mean(ds)), "half_width": float(np.mean(hw)),
                   "power": hit / args.reps}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    lines.append("Between-measure τ(adaptive, inv) of the copula levels (lowered until positive "
                 "definite): " + ", ".join(f"{k}: {v:.2f}" for k, v in used.items()))
    lines.append("")
    df = pd.DataFrame(rows)
    df.to_csv(HERE / "power.csv", index=False)
    lines.append(f"{args.reps} simulated studies per cell, {args.boot} bootstrap resamples each. "
                 "Trend: C = s·Δτ_high − s·Δτ_low, power = P(95 % CI above 0). Equivalence: "
                 "Δτ_low, power = P(95 % CI inside [−0.05, +0.05]).")  # fmt: skip
    lines += ["", "| test | scenario | n per level | mean estimate | mean CI half-width | power |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['test']} | {r['scenario']} | {r['n_per_level']} | "
                     f"{r['mean_estimate']:+.3f} | {r['half_width']:.3f} | {r['power']:.2f} |")  # fmt: skip
    (HERE / "power.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _ = math


if __name__ == "__main__":
    main()
