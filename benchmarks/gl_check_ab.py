"""Interleaved A/B: GLGeometry._check_tangent with and without the float32 cast of float64 tangents
(shape checks only), on the GL pieces of MiniLM-L6: Riemannian gradient, projection and norm.
"""

import statistics
import time

import torch

torch.set_num_threads(1)
import geosharp as gs
from geosharp.estimators.perturbation import Perturbation
from geosharp.geometry import gl as glmod
from geosharp.geometry._validate import check_like, check_tensor
from geosharp.models import load_minilm

model = load_minilm()
space = gs.find_symmetries(model, key_bias="keep")
theta = space.flatten_module(model).detach()
pert = Perturbation(space, theta, measure="geodesic", metric="inv", order=2)
gl_pieces = [p for p in pert.pieces if isinstance(p.geometry, glmod.GLGeometry)]
new = glmod.GLGeometry._check_tangent


def old(self, xi, name="xi"):
    for part, t, ref, ref_name in (
        (f"{name}_G", xi[0], self.G, "G"),
        (f"{name}_H", xi[1], self.H, "H"),
    ):
        check_tensor(part, t)
        check_like(part, t.to(self.dtype), ref_name, ref)
    return xi[0].to(self.compute_dtype), xi[1].to(self.compute_dtype)


xis = [
    p.geometry.random_tangent(torch.Generator().manual_seed(0), 1.0, dtype=torch.float64)
    for p in gl_pieces
]


def work():
    for p, x in zip(gl_pieces, xis):
        g = p.geometry
        g.norm_sq(g.project(g.riemannian_grad(x)))


res = {"old": [], "new": []}
for r in range(7):
    for name, fn in (("old", old), ("new", new)) if r % 2 else (("new", new), ("old", old)):
        glmod.GLGeometry._check_tangent = fn
        t0 = time.perf_counter()
        work()
        res[name].append(time.perf_counter() - t0)
print(
    {k: f"{1000 * statistics.median(v):.1f} ms" for k, v in res.items()},
    "GL coords:",
    space.gl_numel,
)
