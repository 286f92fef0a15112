"""Forward and backward passes of ``gs.sharpness`` per configuration and measure of ``regimes.py``.

Prints, for each call, the passes and what :func:`geosharp.estimators.apgd.best_direction_rule`
chose for each batch's ascent (``True``: the best direction kept always; ``None``: while free)
with its ``(4·ξ + held) / P`` — the cut perturbation's, as the call sees it.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/passes.py --configs minilm-small --steps 20``
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regimes as R

import geosharp as gs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="minilm-small")
    ap.add_argument("--measures", default="adaptive-l2,geodesic-inv-o2,geodesic-mix-o2")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    S = importlib.import_module("geosharp.estimators.worst")  # where the rule is looked up
    chosen: list[str] = []
    rule = S.best_direction_rule

    def logged(pert, low_memory=False):
        keep = rule(pert, low_memory)
        xi, held = pert.buffer_bytes()
        chosen.append(f"{keep} ({(4 * xi + held) / pert.param_bytes:.2f})")
        return keep

    S.best_direction_rule = logged
    try:
        for cfg in args.configs.split(","):
            case = R.build(cfg, torch.device("cpu"), torch.float32)
            for m in args.measures.split(","):
                chosen.clear()
                kw = dict(R.MEASURES[m])
                kw["steps"] = args.steps
                if case.key_bias is not None:
                    kw["key_bias"] = case.key_bias
                res = gs.sharpness(case.model, case.loss_fn, case.batches, progress=False, **kw)
                print(
                    f"{cfg} {m}: {res.n_forward} forwards, {res.n_backward} backwards, "
                    f"value {res.value:.6g}; best direction {', '.join(chosen)}",
                    flush=True,
                )
    finally:
        S.best_direction_rule = rule
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
