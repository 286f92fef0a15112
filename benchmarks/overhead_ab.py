"""Per-step cost of the ascent without the network, versions side by side (interleaved A/B).

The loss is linear, ``Σ_n θ′_n · R_n`` with fixed random ``R``: its forward and backward are
two passes over the parameters, so what is timed is geosharp's own work per Auto-PGD step —
the endpoint, the assembly of the perturbed weights, the pull-back of their gradient, the
ascent direction and the momentum step — free of the model's noise. A linear loss reaches the
ball's boundary in a couple of steps and then stalls, so its ascent restarts at checkpoints
(which a real model may not): compare versions, not this figure with ``setup_ab.py``'s.

Versions are packages importable under their own names (``perparam_ab.py`` explains how to
make ``geosharp_old`` from a commit); ``geosharp`` is the working tree. Per repetition each
version (order alternating) times ``autopgd`` with 1 and with 6 steps on the same
``Perturbation``; the step is ``(T(6) − T(1)) / 5``, medians over repetitions.

Run:

    PYTHONPATH=/tmp/oldpkg:benchmarks OMP_NUM_THREADS=1 .venv/bin/python \\
        benchmarks/overhead_ab.py --versions geosharp_old,geosharp --metric inv
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regimes as R


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default="geosharp_old,geosharp")
    ap.add_argument("--config", default="minilm-small")
    ap.add_argument("--metric", default="inv", help="inv, mix or adaptive (adaptive sharpness)")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    case = R.build(args.config, torch.device("cpu"), torch.float32)
    base = {n: p.detach() for n, p in case.model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=g) * 1e-3 for n, p in base.items()}

    def evaluate(params):
        return sum((params[n] * weights[n]).sum() for n in weights)

    rho = 0.316 if args.metric == "adaptive" else 0.0316
    kw = dict(measure="adaptive") if args.metric == "adaptive" else dict(metric=args.metric)
    setups = {}
    for v in args.versions.split(","):
        gs = importlib.import_module(v)
        P = importlib.import_module(v + ".estimators.perturbation")
        A = importlib.import_module(v + ".estimators.apgd")
        space = gs.find_symmetries(
            case.model, **({} if case.key_bias is None else {"key_bias": case.key_bias})
        )
        setups[v] = (P.Perturbation(space, base, **kw), A)

    def run(v: str, n: int) -> float:
        pert, A = setups[v]

        def loss(xi, need_grad):
            value, grad = pert.loss_and_grad(evaluate, xi, need_grad)
            return float(value), grad

        t0 = time.perf_counter()
        A.autopgd(pert, loss, rho, n, None)
        return time.perf_counter() - t0

    names = list(setups)
    for v in names:
        run(v, 2)  # warm-up
    steps: dict[str, list[float]] = {v: [] for v in names}
    for rep in range(args.repeats):
        for v in names if rep % 2 == 0 else names[::-1]:
            t1, t6 = run(v, 1), run(v, 6)
            steps[v].append((t6 - t1) / 5 * 1e3)
    for v in names:
        runs = ", ".join(f"{x:.0f}" for x in steps[v])
        med = statistics.median(steps[v])
        print(f"{args.config} {args.metric} {v}: {med:.1f} ms per step ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
