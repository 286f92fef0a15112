"""Why an exact (RK4) GL(h) geodesic came out unusable: a too coarse step or a singular metric.

The BERT case behind it (SPEC §4.6; ``geosharp.geometry.gl_diagnose``): with the mix metric and
small weights, a ball of modest radius holds velocities many times a head's own size; 10 fixed
RK4 steps then overflow although the geodesic is regular. Checked here against the dense
float64 reference (the metric as a matrix, Christoffel symbols by autodiff, DOP853 at 1e-13),
which shares no code with the integrator.
"""

import torch

from geosharp.geometry import GLExecution
from geosharp.geometry.gl import GLGeometry
from geosharp.geometry.gl_action import act, act_tangent
from geosharp.geometry.gl_diagnose import relative_speed

from .reference import integrate_geodesic, random_block, random_gl


def flat(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def fast_head(kappa=10.0):
    """A 5×3 / 4×3 block and a horizontal mix velocity of relative speed ``kappa``."""
    G, H, g = random_block((), 5, 4, 3, seed=1)
    geom = GLGeometry(G, H, "mix")
    xi = geom.project((torch.randn(G.shape, generator=g, dtype=G.dtype),
                       torch.randn(H.shape, generator=g, dtype=G.dtype)))  # fmt: skip
    scale = kappa / float(relative_speed(geom, xi))
    return G, H, geom, tuple(scale * t for t in xi)


def finite(point):
    return all(bool(torch.isfinite(t).all()) for t in point)


def test_ten_rk4_steps_blow_up_on_a_regular_mix_geodesic_that_more_steps_resolve():
    G, H, geom, xi = fast_head()
    assert float(xi[0].norm() / G.norm()) > 4  # the velocity is 4× the head's size
    assert not finite(geom.geodesic(xi, order="exact", steps=10))
    # The geodesic itself is regular: the dense reference reaches t = 1, its Gram matrices
    # grow (smallest eigenvalues 0.355 / 0.123 at t = 0, 2.90 / 1.50 at t = 1) ...
    rG, rH = integrate_geodesic(G, H, *xi, "mix", 0.0)
    for X, R in ((G, rG), (H, rH)):
        assert torch.linalg.eigvalsh(R.T @ R)[0] > torch.linalg.eigvalsh(X.T @ X)[0]
    # ... and RK4 converges to it at fourth order (measured: 20 steps 8.2e-2, 40: 4.2e-3,
    # 100: 1.1e-4, 200: 7.8e-6, 400: 5.4e-7): the integrator and Γ are right, 10 steps too few.
    ref = flat(rG, rH)
    err = {s: float((flat(*geom.geodesic(xi, order="exact", steps=s)) - ref).abs().max())
           for s in (100, 200, 400)}  # fmt: skip
    assert err[400] < 2e-6, err
    assert err[100] / err[200] > 10 and err[200] / err[400] > 10, err


def test_trouble_says_the_step_is_too_coarse_and_how_many_steps_do():
    _, _, geom, xi = fast_head()
    line = geom.endpoint_trouble(xi, "exact", 10)
    assert "blew up with 10 RK4 steps" in line and "the geodesic itself is regular" in line, line
    assert "relative speed κ ≈ 10" in line and "exact_steps >= 40" in line, line
    assert "\n" not in line
    assert geom.endpoint_trouble(xi, "exact", 40) is None  # a usable endpoint: nothing to say
    assert geom.endpoint_trouble(xi, 2, 10) is None  # only the exact geodesic is diagnosed


def test_trouble_names_the_heads_and_says_when_the_geodesic_reaches_a_singular_metric():
    """h = 1, velocity b·(G, H): the mix geodesic is (G, H)·√(1 + 2bt), singular at t = −1/(2b)."""
    G, H, _ = random_block((3,), 5, 4, 1, seed=0)
    b = torch.tensor([-0.2, -1.0, -0.2], dtype=G.dtype)[:, None, None]  # head 1: t = 0.5
    names = ["layer 0 head 0", "layer 0 head 1", "layer 0 head 2"]
    geom = GLGeometry(G, H, "mix", head_names=names)
    line = geom.endpoint_trouble((b * G, b * H), "exact", 10)
    assert "'layer 0 head 1'" in line and "head 0" not in line and "head 2" not in line, line
    assert "leaves the region where the metric is defined" in line, line
    assert "by t ≈ 0.625" in line and "eps > 0" in line, line  # the first sample after 0.5
    unnamed = GLGeometry(G, H, "mix", name="blk").endpoint_trouble((b * G, b * H), "exact", 10)
    assert "'blk' at batch index (1,)" in unnamed, unnamed


def test_relative_speed_is_invariant_and_is_the_inv_norm_of_each_factor():
    G, H, geom, xi = fast_head(kappa=3.0)
    A = random_gl((), 3, torch.Generator().manual_seed(7))
    moved = GLGeometry(*act(G, H, A), "mix")
    k = float(relative_speed(geom, xi))
    assert abs(float(relative_speed(moved, act_tangent(*xi, A))) - k) <= 1e-12 * k
    inv = GLGeometry(G, H, "inv")
    parts = [float(inv.norm_sq((xi[0], 0 * xi[1]))), float(inv.norm_sq((0 * xi[0], xi[1])))]
    assert abs(max(parts) ** 0.5 - k) <= 1e-12 * k


def test_trouble_on_rows_split_over_ranks_is_the_one_process_line():
    """Every rank (threads, SPEC §10.2) finds the same heads and says the same line."""
    from .test_gl_rows import ThreadSum, on_ranks

    G, H, geom, xi = fast_head()
    whole = geom.endpoint_trouble(xi, "exact", 10)
    cutG, cutH = (0, 3, 5), (0, 2, 4)
    ring = ThreadSum(2)

    def rank(r):
        sl_G, sl_H = slice(cutG[r], cutG[r + 1]), slice(cutH[r], cutH[r + 1])
        ex = GLExecution(row_sum=ring.for_rank(r))
        local = GLGeometry(G[sl_G], H[sl_H], "mix", execution=ex)
        return local.endpoint_trouble((xi[0][sl_G], xi[1][sl_H]), "exact", 10)

    assert on_ranks(rank, ring, world=2) == [whole, whole]
