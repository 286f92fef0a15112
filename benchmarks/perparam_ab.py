"""Interleaved A/B in one process: an older geosharp against this one, per ascent step.

The older code is imported under another package name, made from a checkout of its commit:

    git worktree add /tmp/old <commit>
    mkdir -p /tmp/oldpkg && cp -r /tmp/old/src/geosharp /tmp/oldpkg/geosharp_old
    grep -rl geosharp /tmp/oldpkg/geosharp_old --include=*.py | xargs sed -i -E \\
        's/\\bgeosharp\\./geosharp_old./g; s/^import geosharp$/import geosharp_old as geosharp/'
    PYTHONPATH=/tmp/oldpkg:benchmarks OMP_NUM_THREADS=1 .venv/bin/python benchmarks/perparam_ab.py

For each configuration of ``regimes.py`` and each measure, every repetition times a plain
forward+backward, then ``T(N₁)`` and ``T(N₂)`` of both versions in alternating order; the step
ratio is ``(T(N₂) − T(N₁)) / (N₂ − N₁)`` over the plain step timed in the same repetition, and
the set-up of a repeated call ``T(N₁) − N₁·step``. Medians over repetitions. Caches are on (the
second and later calls of a version reuse its base point, as several ρ on one model do).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import regimes as R
import torch

MEASURES = {
    "adaptive-l2": dict(measure="adaptive", rho=0.316),
    "geodesic-inv-o2": dict(measure="geodesic", metric="inv", order=2, rho=0.0316),
    "geodesic-mix-o2": dict(measure="geodesic", metric="mix", order=2, rho=0.0316),
}


def _plain(case: R.Case, params: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    for x, y in case.batches:
        out = case.model(**x) if isinstance(x, dict) else case.model(x)
        torch.autograd.grad(case.loss_fn(out, y), params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="minilm-small,vit-tiny")
    ap.add_argument("--measures", default=",".join(MEASURES))
    ap.add_argument("--old", default="geosharp_old")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", default="1,5")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n1, n2 = (int(s) for s in args.steps.split(","))
    versions = {
        "old": importlib.import_module(args.old),
        "new": importlib.import_module("geosharp"),
    }
    out: dict = {"steps": [n1, n2], "repeats": args.repeats, "configs": {}}
    for name in args.configs.split(","):
        case = R.CONFIGS[name][1](torch.device("cpu"))
        case.model.eval()
        params = [p for p in case.model.parameters() if p.requires_grad]
        kb = {"key_bias": case.key_bias} if case.key_bias else {}
        res: dict = {}
        for m in args.measures.split(","):
            kw = dict(MEASURES[m], progress=False, **kb)
            for v in versions.values():  # first calls: searches, factorizations, warm-up
                v.sharpness(case.model, case.loss_fn, case.batches, steps=n1, **kw)
            rows: dict[str, list] = {"old": [], "new": []}
            for r in range(args.repeats):
                plain = _plain(case, params)
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for key in order:
                    f = versions[key].sharpness
                    t = time.perf_counter()
                    f(case.model, case.loss_fn, case.batches, steps=n1, **kw)
                    t1 = time.perf_counter() - t
                    t = time.perf_counter()
                    f(case.model, case.loss_fn, case.batches, steps=n2, **kw)
                    t2 = time.perf_counter() - t
                    step = (t2 - t1) / (n2 - n1)
                    rows[key].append((step / plain, (t1 - n1 * step) / plain, plain))
            res[m] = {
                key: {
                    "step_ratio": statistics.median(x[0] for x in vals),
                    "repeat_setup_ratio": statistics.median(x[1] for x in vals),
                    "plain_s": statistics.median(x[2] for x in vals),
                    "all": vals,
                }
                for key, vals in rows.items()
            }
            o, n = res[m]["old"], res[m]["new"]
            print(
                f"{name:14s} {m:18s} step ratio old {o['step_ratio']:.2f} new {n['step_ratio']:.2f}"
                f"  | repeated set-up old {o['repeat_setup_ratio']:.2f} new "
                f"{n['repeat_setup_ratio']:.2f}  (plain {n['plain_s'] * 1e3:.0f} ms)",
                flush=True,
            )
        out["configs"][name] = res
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
