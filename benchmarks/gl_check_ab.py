"""Interleaved A/B: GLGeometry._check_tangent with and without the cast of float64 tangents.

The old check cast every float64 tangent to the model's dtype only to compare shapes. Timed on
the GL pieces of MiniLM-L6 (Riemannian gradient, projection and norm), old and new alternating
in one process:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gl_check_ab.py
"""

import statistics
import time

import torch

import geosharp as gs
from geosharp.estimators.perturbation import Perturbation
from geosharp.geometry import gl as glmod
from geosharp.geometry._validate import check_like, check_tensor
from geosharp.models import load_minilm


def old_check(self, xi, name="xi"):
    """The check before: a cast to the model's dtype for the shape comparison."""
    for part, t, ref, ref_name in (
        (f"{name}_G", xi[0], self.G, "G"),
        (f"{name}_H", xi[1], self.H, "H"),
    ):
        check_tensor(part, t)
        check_like(part, t.to(self.dtype), ref_name, ref)
    return self.execution.widen(xi[0], xi[1])


def main(repeats: int = 7) -> None:
    torch.set_num_threads(1)
    model = load_minilm()
    space = gs.find_symmetries(model, key_bias="keep")
    theta = space.flatten_module(model).detach()
    pert = Perturbation(space, theta, measure="geodesic", metric="inv", order=2)
    pieces = [p for p in pert.pieces if isinstance(p.geometry, glmod.GLGeometry)]
    gen = torch.Generator().manual_seed(0)
    xis = [p.geometry.random_tangent(gen, 1.0, dtype=torch.float64) for p in pieces]
    new_check = glmod.GLGeometry._check_tangent

    def work():
        for p, x in zip(pieces, xis, strict=True):
            g = p.geometry
            g.norm_sq(g.project(g.riemannian_grad(x)))

    times = {"old": [], "new": []}
    for r in range(repeats):
        order = (("old", old_check), ("new", new_check))
        for name, fn in order if r % 2 else order[::-1]:
            glmod.GLGeometry._check_tangent = fn
            t0 = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - t0)
    glmod.GLGeometry._check_tangent = new_check
    medians = {k: f"{1000 * statistics.median(v):.1f} ms" for k, v in times.items()}
    print(medians, "GL coordinates:", space.gl_numel)


if __name__ == "__main__":
    main()
