"""A/B of how the perturbed parameters are built, interleaved in one process.

``A``: ``space.unflatten(pert.endpoint(ξ))`` — one permutation of all of θ (forwards a gather of
every coordinate, backwards a scatter into a θ-sized zero vector). ``B``:
``pert.endpoint_params(ξ)`` — parameters outside symmetry blocks are views of the adaptive
piece; only block coordinates are gathered. Both give bit-identical results (tested); this
times one ascent step of geodesic inv (order 2) on MiniLM-L6 as ``(T(8) − T(3)) / 5`` for each
variant in turn, so that slow phases of a noisy machine hit both.

Run: ``python benchmarks/endpoint_ab.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ascent_step import minilm_case

import geosharp as gs
from geosharp.estimators.perturbation import Perturbation


def _through_theta(self: Perturbation, xi):
    return self.space.unflatten(self.endpoint(xi))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _, model, x, y, loss = minilm_case()
    variants = {
        "A: permute all of θ": _through_theta,
        "B: endpoint_params": Perturbation.endpoint_params,
    }

    def seconds(steps: int) -> float:
        t0 = time.perf_counter()
        gs.sharpness(model, loss, [(x, y)], measure="geodesic", rho=0.03, steps=steps)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in variants}
    original = Perturbation.endpoint_params
    try:
        for _ in range(args.repeats):
            for label, fn in variants.items():
                Perturbation.endpoint_params = fn
                times[label].append((seconds(8) - seconds(3)) / 5)
    finally:
        Perturbation.endpoint_params = original
    for label, values in times.items():
        ms = ", ".join(f"{1000 * v:.0f}" for v in values)
        median = 1000 * statistics.median(values)
        print(f"{label:22s} per ascent step: median {median:.0f} ms ({ms})")


if __name__ == "__main__":
    main()
