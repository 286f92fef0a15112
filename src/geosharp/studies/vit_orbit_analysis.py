"""Study 4's preregistered analysis of a study folder (needs no checkpoints).

:func:`analyse` reads ``study.sqlite`` and ``diagnostics.csv`` and writes ``sections.json``
(report sections) and ``analysis.md``: τ-a [CI] per measure, ρ and subgroup (weight decay 0 /
> 0, AdamW / SGD); paired Δτ of every geodesic measure and its adaptive counterpart
(:data:`PAIRS`), and the difference of the wd subgroups' Δτ (H3); the orbit diagnostics against
the init scales and the decay exposure (:func:`decay_exposure`; H1). Run by
``python -m geosharp.studies.vit_orbit analyse DIR``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from geosharp._io import atomic_write_text
from geosharp.studies.classifier_diagnostics import DIAGNOSTICS_FILE, read_diagnostics
from geosharp.studies.runner import StudyMeasure
from geosharp.studies.store import Store
from geosharp.studies.vit_orbit_radii import FAMILIES

__all__ = ["analyse"]

#: Paired comparisons of the analysis: geodesic measure → its adaptive counterpart (family keys).
PAIRS = (
    ("inv", "adaptive_l2"),
    ("mix", "adaptive_l2"),
    ("inv_blocks", "adaptive_blocks"),
    ("average_inv", "average_adaptive"),
)


def _fmt(x: float) -> str:
    return f"{x:+.2f}" if math.isfinite(x) else "undefined"


def _tau_ci(t: Sequence[float], s: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    from geosharp.stats import bootstrap_ci, kendall_tau_a

    t, s = np.asarray(t, float), np.asarray(s, float)
    keep = np.isfinite(t) & np.isfinite(s)
    t, s = t[keep], s[keep]
    if t.size < 3 or len(set(t)) < 2 or len(set(s)) < 2:
        return math.nan, math.nan, math.nan
    lo, hi = bootstrap_ci(t, s, n_boot=2000, seed=seed)
    return kendall_tau_a(t, s), lo, hi


def _ci_text(v: tuple[float, float, float]) -> str:
    return f"{_fmt(v[0])} [{_fmt(v[1])}, {_fmt(v[2])}]"


def _group_difference(
    a: tuple[np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """τ-a(group a) − τ-a(group b) with a bootstrap CI, the groups resampled separately."""
    from geosharp.stats import kendall_tau_a

    def tau(x: np.ndarray, y: np.ndarray) -> float:
        if x.size < 2 or len(set(x)) < 2 or len(set(y)) < 2:
            return math.nan
        return kendall_tau_a(x, y)

    point = tau(*a) - tau(*b)
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        i = rng.integers(0, a[0].size, a[0].size)
        j = rng.integers(0, b[0].size, b[0].size)
        v = tau(a[0][i], a[1][i]) - tau(b[0][j], b[1][j])
        if math.isfinite(v):
            reps.append(v)
    if not reps:
        return point, math.nan, math.nan
    lo, hi = np.quantile(reps, [0.025, 0.975])
    return point, float(lo), float(hi)


def out_cfg(out: Path) -> dict[str, Any]:
    """The recorded config of a study folder."""
    with Store(out / "study.sqlite", None, None) as store:
        return json.loads(store.meta().get("config", "{}"))


def decay_exposure(hp: dict[str, Any], study_cfg: dict[str, Any]) -> float:
    """``E = 2·wd·Σ_t η_t / (1 − μ)``: the decay term alone multiplies ``GᵀG − HᵀH`` by e^{−E}.

    ``η_t`` is the scheduled learning rate of step t (5 % warm-up, cosine), μ the SGD momentum
    (0 for AdamW's decoupled decay).
    """
    from geosharp.studies.vit_mnist import _schedule

    total = math.ceil(study_cfg["n_train"] / hp["batch_size"]) * hp["epochs"]
    f = _schedule(total)
    lr_sum = hp["lr"] * sum(f(t) for t in range(total))
    mu = study_cfg.get("momentum", 0.9) if hp["optimizer"] == "sgd" else 0.0
    return 2.0 * hp["weight_decay"] * lr_sum / (1.0 - mu)


def _did(
    gaps: dict[str, np.ndarray],
    geo: dict[str, np.ndarray],
    ada: dict[str, np.ndarray],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Δτ(group "0") − Δτ(group ">0") with a bootstrap CI (the groups resampled separately)."""
    from geosharp.stats import kendall_tau_a

    rng = np.random.default_rng(seed)

    def delta(g: str, idx: np.ndarray | None = None) -> float:
        t, a, b = gaps[g], geo[g], ada[g]
        if idx is not None:
            t, a, b = t[idx], a[idx], b[idx]
        if len(set(t)) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
            return math.nan
        return kendall_tau_a(t, a) - kendall_tau_a(t, b)

    point = delta("0") - delta(">0")
    reps = []
    for _ in range(n_boot):
        i0 = rng.integers(0, gaps["0"].size, gaps["0"].size)
        i1 = rng.integers(0, gaps[">0"].size, gaps[">0"].size)
        v = delta("0", i0) - delta(">0", i1)
        if math.isfinite(v):
            reps.append(v)
    if not reps:
        return point, math.nan, math.nan
    lo, hi = np.quantile(reps, [0.025, 0.975])
    return point, float(lo), float(hi)


def analyse(out_dir: str | Path) -> dict[str, Any]:
    """The preregistered analysis of a Study 4 folder (needs no checkpoints).

    Reads ``study.sqlite`` and ``diagnostics.csv``; writes ``sections.json`` (report sections,
    shown by ``geosharp report``) and ``analysis.md``. Subgroups: weight decay 0 / > 0 and
    AdamW / SGD. For every measure and ρ: τ-a [95 % bootstrap CI] in the population and in each
    subgroup; for every geodesic measure and its adaptive counterpart at the same grid
    position: paired Δτ [CI] in the population and in the wd subgroups, and the difference of
    the two subgroup Δτ [CI] (H3); the orbit diagnostics against the init scales (H1).

    Returns:
        The numbers of the analysis (also in ``analysis.md``).
    """
    from geosharp.stats import tau_difference

    out = Path(out_dir)
    with Store(out / "study.sqlite", None, None) as store:
        models = [m for m in store.models() if not m.get("excluded") and m.get("gap") is not None]
        rows = [r for r in store.measurements() if not r.get("error")]
    diag = read_diagnostics(out / DIAGNOSTICS_FILE)
    ids = [m["model_id"] for m in models]
    hp = {m["model_id"]: m["hparams"] for m in models}
    gap = {m["model_id"]: float(m["gap"]) for m in models}
    values: dict[tuple[str, float | None], dict[str, float]] = {}
    for r in rows:
        if r["model_id"] in gap and r["value"] is not None:
            values.setdefault((r["measure"], r["rho"]), {})[r["model_id"]] = float(r["value"])
    groups = {
        "all": ids,
        "wd = 0": [m for m in ids if hp[m]["weight_decay"] == 0],
        "wd > 0": [m for m in ids if hp[m]["weight_decay"] > 0],
        "AdamW": [m for m in ids if hp[m]["optimizer"] == "adamw"],
        "SGD": [m for m in ids if hp[m]["optimizer"] == "sgd"],
    }
    names = {}
    for key, kw in FAMILIES.items():
        names[key] = StudyMeasure(dict(kw), ()).name
    measures = sorted({m for m, _ in values}, key=lambda n: (n == "relative_flatness", n))
    result: dict[str, Any] = {"groups": {g: len(v) for g, v in groups.items()}}

    # τ per measure, ρ and subgroup
    tau_rows, tau_data = [], []
    for measure in measures:
        for rho in sorted({r for m, r in values if m == measure}, key=lambda r: r or 0):
            v = values[(measure, rho)]
            cells = []
            for g, members in groups.items():
                ms = [m for m in members if m in v]
                res = _tau_ci([gap[m] for m in ms], [v[m] for m in ms])
                cells.append(_ci_text(res))
                tau_data.append({"measure": measure, "rho": rho, "group": g, "tau": res})
            rho_text = "–" if rho is None else f"{rho:g}"
            tau_rows.append([measure, rho_text, *cells])

    # paired Δτ
    pair_rows, pair_data = [], []
    for geo_key, ada_key in PAIRS:
        gname, aname = names[geo_key], names[ada_key]
        grho = sorted(r for m, r in values if m == gname)
        arho = sorted(r for m, r in values if m == aname)
        if len(grho) != len(arho):
            continue
        for k, (rg, ra) in enumerate(zip(grho, arho, strict=True)):
            vg, va = values[(gname, rg)], values[(aname, ra)]
            cells, entry = [], {"geodesic": gname, "adaptive": aname, "position": k}
            sub: dict[str, dict[str, np.ndarray]] = {"t": {}, "g": {}, "a": {}}
            for g in ("all", "wd = 0", "wd > 0"):
                ms = [m for m in groups[g] if m in vg and m in va]
                d = tau_difference(
                    [gap[m] for m in ms], [vg[m] for m in ms], [va[m] for m in ms], seed=0
                )
                cells.append(_ci_text((d.diff, d.ci_low, d.ci_high)))
                entry[g] = (d.diff, d.ci_low, d.ci_high)
                if g != "all":
                    label = "0" if g == "wd = 0" else ">0"
                    sub["t"][label] = np.array([gap[m] for m in ms])
                    sub["g"][label] = np.array([vg[m] for m in ms])
                    sub["a"][label] = np.array([va[m] for m in ms])
            did = _did(sub["t"], sub["g"], sub["a"])
            entry["difference wd=0 − wd>0"] = did
            cells.append(_ci_text(did))
            pos = ["smallest ρ", "middle ρ", "largest ρ"][k] if len(grho) == 3 else f"ρ #{k + 1}"
            pair_rows.append([f"{gname} (ρ = {rg:g})", f"{aname} (ρ = {ra:g})", pos, *cells])
            pair_data.append(entry)
    result["tau"] = tau_data
    result["paired"] = pair_data

    # H1: orbit position against the init scales
    h1_rows, h1_data = [], []
    if diag:
        for kind, s_key in (("QK", "s_qk"), ("VO", "s_vo")):
            for label, dkey, transform in (
                (f"imbalance_{kind} vs |log s|", f"imbalance_{kind}", abs),
                (f"log_scale_{kind} vs log s", f"log_ratio_{kind}", lambda x: x),
                (f"excess_{kind} vs |log s|", f"excess_{kind}", abs),
            ):
                cells, xy = [], {}
                for g in ("all", "wd = 0", "wd > 0"):
                    ms = [m for m in groups[g] if m in diag and dkey in diag[m]]
                    x = [transform(math.log(hp[m][s_key])) for m in ms]
                    y = [diag[m][dkey] for m in ms]
                    xy[g] = (np.asarray(x, float), np.asarray(y, float))
                    res = _tau_ci(x, y)
                    cells.append(_ci_text(res))
                    h1_data.append({"test": label, "group": g, "tau": res})
                diff = _group_difference(xy["wd = 0"], xy["wd > 0"])
                h1_data.append({"test": label, "group": "wd = 0 minus wd > 0", "tau": diff})
                h1_rows.append([label, *cells, _ci_text(diff)])
        # exploratory: the decay exposure E = 2·wd·Σ_t η_t / (1 − μ) within wd > 0
        recorded = out_cfg(out)
        expo = {m: decay_exposure(hp[m], recorded) for m in groups["wd > 0"]}
        result["exposure"] = expo
        for kind in ("QK", "VO"):
            ms = [m for m in groups["wd > 0"] if m in diag]
            res = _tau_ci([expo[m] for m in ms], [diag[m][f"imbalance_{kind}"] for m in ms])
            h1_data.append({"test": f"imbalance_{kind} vs E", "group": "wd > 0", "tau": res})
            h1_rows.append([f"imbalance_{kind} vs decay exposure E", "–", "–", _ci_text(res), "–"])
    result["h1"] = h1_data

    # diagnostics summary by subgroup
    diag_rows = []
    if diag:
        keys = [k for k in next(iter(diag.values())) if not k.endswith("_time_s")]
        for k in keys:
            cells = []
            for g in ("all", "wd = 0", "wd > 0", "AdamW", "SGD"):
                vals = np.array([diag[m][k] for m in groups[g] if m in diag and k in diag[m]])
                vals = vals[np.isfinite(vals)]
                cells.append(
                    f"{np.median(vals):.3g} [{vals.min():.3g}, {vals.max():.3g}]"
                    if vals.size
                    else "–"
                )
            ms = [m for m in ids if m in diag and k in diag[m]]
            cells.append(_ci_text(_tau_ci([gap[m] for m in ms], [diag[m][k] for m in ms])))
            diag_rows.append([k, *cells])

    n = result["groups"]
    sections = [
        {
            "title": "Study 4: τ by subgroup",
            "header": [
                "measure",
                "ρ",
                f"all ({n['all']})",
                f"wd = 0 ({n['wd = 0']})",
                f"wd > 0 ({n['wd > 0']})",
                f"AdamW ({n['AdamW']})",
                f"SGD ({n['SGD']})",
            ],
            "rows": tau_rows,
            "caption": "Kendall τ-a between sharpness and the gap [95 % percentile bootstrap CI, "
            "2000 resamples, seed 0] in the population and in the preregistered subgroups.",
        },
        {
            "title": "Study 4: geodesic against adaptive, by weight decay",
            "header": [
                "geodesic",
                "adaptive",
                "position",
                "Δτ all",
                "Δτ wd = 0",
                "Δτ wd > 0",
                "Δτ(wd = 0) − Δτ(wd > 0)",
            ],
            "rows": pair_rows,
            "caption": "Δτ = τ-a(geodesic) − τ-a(adaptive) on the same models at the same grid "
            "position, paired bootstrap CI (tau_difference); the last column is the difference "
            "of the two subgroups' Δτ with a bootstrap CI resampling each subgroup separately "
            "(H3). τ < 0 is the expected direction: Δτ < 0 means geodesic is stronger.",
        },
        {
            "title": "Study 4: orbit position against the init scales (H1)",
            "header": ["test", "all", "wd = 0", "wd > 0", "τ(wd = 0) − τ(wd > 0)"],
            "rows": h1_rows,
            "caption": "Kendall τ-a [95 % bootstrap CI] between a model's diagnostic (QK or VO "
            "heads, pooled over heads: diagnostics.csv) and its init scale s of the same block "
            "kind (|log s| for the unsigned diagnostics); the last column resamples the two "
            "subgroups separately (H1b). Exploratory: τ of the imbalance with the decay exposure "
            "E = 2·wd·Σ_t η_t/(1 − μ) (μ = 0.9 for SGD, 0 for AdamW) within wd > 0.",
        },
        {
            "title": "Study 4: diagnostics by subgroup",
            "header": [
                "diagnostic",
                "all",
                "wd = 0",
                "wd > 0",
                "AdamW",
                "SGD",
                "τ with the gap",
            ],
            "rows": diag_rows,
            "caption": "Median [min, max] over the analysed models of every column of "
            "diagnostics.csv, and its Kendall τ-a with the gap [95 % bootstrap CI]. imbalance = "
            "√Σ‖GᵀG−HᵀH‖²/√Σ‖GᵀG+HᵀH‖² over the heads of a kind; excess = Σ(‖G‖²+‖H‖²)/Σ min − 1 "
            "(min over the orbit, 2Σ√λ((GᵀG)(HᵀH))); log_ratio = mean ½log(‖G‖/‖H‖); "
            "<measure>_share_<kind> = share of ‖ξ*‖² at the Auto-PGD optimum (middle ρ); "
            "<measure>_order2 = ‖½Γ(ξ*,ξ*)‖/‖ξ*‖ (whole ξ*; _blocks: relative to its block part).",
        },
    ]
    atomic_write_text(
        out / "sections.json", json.dumps(sections, indent=1, ensure_ascii=False) + "\n"
    )
    md = []
    for s in sections:
        md += ["", f"## {s['title']}", "", "| " + " | ".join(s["header"]) + " |"]
        md.append("|" + "---|" * len(s["header"]))
        md += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in s["rows"]]
        md += ["", s["caption"]]
    atomic_write_text(out / "analysis.md", "# Study 4 — analysis\n" + "\n".join(md) + "\n")
    return result
