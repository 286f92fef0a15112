"""Diagonal-net geometry (SPEC §5) against independent float64 references.

References used, none sharing code with ``geosharp.geometry.diagonal``: the metric as an explicit
``2d × 2d`` matrix (Christoffel symbols by autodiff, projections by dense linear algebra), the
geodesic ODE integrated by SciPy (its right-hand side derived here from the Euler–Lagrange
equations of a diagonal metric), the GL(h) block geometry at ``n = m = h = 1``, and brute-force
maximisation of the actual loss ``‖Xβ − y‖²`` for the closed-form sharpness values.
"""

import math
import time

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp
from scipy.optimize import minimize
from torch.autograd import gradcheck
from torch.func import grad, jvp

from geosharp.geometry.diagonal import (
    DiagonalGeometry,
    closed_form_sharpness_inv,
    closed_form_sharpness_mix,
    horizontal_coordinate,
    horizontal_residual,
    two_regime_sharpness_inv,
)
from geosharp.geometry.gl import GLGeometry

DT = torch.float64
METRICS = ["inv", "mix"]
D = 5


def base_point(seed, d=D):
    """Random (u, v) with |u_i|, |v_i| in [0.5, 2] and random signs (well away from 0)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(2, d, generator=g, dtype=DT) < 0.5, -1.0, 1.0)
    mag = 0.5 + 1.5 * torch.rand(2, d, generator=g, dtype=DT)
    u, v = sign * mag
    return u, v, g


def randn(d, g):
    return torch.randn(d, generator=g, dtype=DT)


def flat(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def rel(a, b):
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------
# Dense references
# ------------------------------------------------------------------------------------------------
def metric_diag(w, metric, eps):
    """Diagonal of the metric matrix at w = (u, v) (SPEC §5): inv 1/u², 1/v²; mix v², u²."""
    u, v = w.chunk(2)
    if metric == "inv":
        return torch.cat([1.0 / (u * u + eps), 1.0 / (v * v + eps)])
    return torch.cat([v * v + eps, u * u + eps])


def dense_metric(w, metric, eps):
    return torch.diag(metric_diag(w, metric, eps))


def dense_christoffel(w, xi, metric, eps):
    """Γ(ξ, ξ) = g⁻¹ [ Dg[ξ] ξ − ½ ∇_w (ξᵀ g(w) ξ) ] from the Euler–Lagrange equations."""

    def g_of(y):
        return dense_metric(y, metric, eps)

    _, dg_xi = jvp(g_of, (w,), (xi,))
    quad_grad = grad(lambda y: xi @ g_of(y) @ xi)(w)
    return torch.linalg.solve(g_of(w), dg_xi @ xi - 0.5 * quad_grad)


def dense_projection(u, v, xi, metric, eps):
    """Metric-orthogonal projection I − V (VᵀgV)⁻¹ Vᵀg onto the complement of the orbits."""
    d = u.numel()
    w = torch.cat([u, v])
    g = dense_metric(w, metric, eps)
    V = torch.cat([torch.diag(u), -torch.diag(v)])  # column i: vertical vector (u_i, −v_i)
    x = flat(*xi)
    coef = torch.linalg.solve(V.T @ g @ V, V.T @ g @ x)
    out = x - V @ coef
    return out[:d], out[d:]


def ode_rhs(metric, eps):
    """Geodesic ODE of a diagonal metric a(u,v) du² + c(u,v) dv², coordinate by coordinate.

    Euler–Lagrange of ½(a u̇² + c v̇²):
      ü = −[(a_u u̇ + a_v v̇) u̇ − ½ (a_u u̇² + c_u v̇²)] / a,
      v̈ = −[(c_u u̇ + c_v v̇) v̇ − ½ (a_v u̇² + c_v v̇²)] / c,
    with the partial derivatives of a and c written out by hand for each metric.
    """

    def rhs(_, y):
        u, v, du, dv = np.split(y, 4)
        zero = np.zeros_like(u)
        if metric == "inv":
            a, c = 1.0 / (u**2 + eps), 1.0 / (v**2 + eps)
            a_u, a_v = -2.0 * u / (u**2 + eps) ** 2, zero
            c_u, c_v = zero, -2.0 * v / (v**2 + eps) ** 2
        else:
            a, c = v**2 + eps, u**2 + eps
            a_u, a_v = zero, 2.0 * v
            c_u, c_v = 2.0 * u, zero
        ddu = -((a_u * du + a_v * dv) * du - 0.5 * (a_u * du**2 + c_u * dv**2)) / a
        ddv = -((c_u * du + c_v * dv) * dv - 0.5 * (a_v * du**2 + c_v * dv**2)) / c
        return np.concatenate([du, dv, ddu, ddv])

    return rhs


def integrate(u, v, xi, metric, eps=0.0):
    """γ(1) by solve_ivp (DOP853, rtol = atol = 1e-12)."""
    y0 = torch.cat([u, v, *xi]).numpy()
    sol = solve_ivp(ode_rhs(metric, eps), (0.0, 1.0), y0, method="DOP853", rtol=1e-12, atol=1e-12)
    assert sol.success, sol.message
    d = u.numel()
    return torch.from_numpy(sol.y[:d, -1]), torch.from_numpy(sol.y[d : 2 * d, -1])


def horizontal_velocity(u, v, g, scale):
    """ξ = (u b, v b) with b uniform in [−scale, scale]."""
    b = scale * (2 * torch.rand(u.numel(), generator=g, dtype=DT) - 1)
    return (u * b, v * b), b


# ------------------------------------------------------------------------------------------------
# Geodesics and Christoffel symbols
# ------------------------------------------------------------------------------------------------
def test_exact_inv_geodesic_solves_the_ode_for_any_velocity():
    u, v, g = base_point(0)
    xi = (0.4 * u * randn(D, g), 0.4 * v * randn(D, g))  # not horizontal
    assert float(horizontal_residual(u, v, xi).abs().max()) > 0.1
    got = DiagonalGeometry(u, v, "inv").geodesic(xi, order="exact")
    ref = integrate(u, v, xi, "inv")
    # DOP853 at rtol = atol = 1e-12 over t ∈ [0, 1] with O(1) states: global error ≲ 1e-11.
    err = float((flat(*got) - flat(*ref)).abs().max())
    assert err <= 1e-9, err


def test_exact_mix_geodesic_solves_the_ode_for_horizontal_velocity():
    u, v, g = base_point(1)
    xi, b = horizontal_velocity(u, v, g, 0.4)  # 1 + 2b ≥ 0.2 > 0
    got = DiagonalGeometry(u, v, "mix").geodesic(xi, order="exact")
    ref = integrate(u, v, xi, "mix")
    err = float((flat(*got) - flat(*ref)).abs().max())
    assert err <= 1e-9, err  # same integrator tolerance argument as for inv
    # β moves linearly along the mix geodesic: β ⊙ (1 + 2b) (SPEC §5).
    assert torch.allclose(got[0] * got[1], u * v * (1 + 2 * b), rtol=1e-13, atol=0)


def test_exact_mix_geodesic_falls_back_to_rk4_off_the_horizontal_space():
    u, v, g = base_point(2)
    xi = (0.2 * randn(D, g), 0.2 * randn(D, g))
    got = DiagonalGeometry(u, v, "mix").geodesic(xi, order="exact", steps=200)
    ref = integrate(u, v, xi, "mix")
    # RK4 with h = 1/200 on a smooth O(1) problem: error ~ C h⁴ ≈ 1e-9·C; 1e-8 leaves room.
    err = float((flat(*got) - flat(*ref)).abs().max())
    assert err <= 1e-8, err


@pytest.mark.parametrize("metric", METRICS)
def test_damped_exact_geodesic_is_rk4_of_the_damped_ode(metric):
    u, v, g = base_point(3)
    xi = (0.3 * randn(D, g), 0.3 * randn(D, g))
    got = DiagonalGeometry(u, v, metric, eps=0.2).geodesic(xi, order="exact", steps=200)
    ref = integrate(u, v, xi, metric, eps=0.2)
    err = float((flat(*got) - flat(*ref)).abs().max())
    assert err <= 1e-8, err  # RK4 at h = 1/200, as above


def test_mix_exact_geodesic_continues_through_the_origin_in_function_space():
    """Past β_i = 0 the mix geodesic is the straight line β(1 + 2b) (Euclidean in β)."""
    u, v, _ = base_point(4)
    b = torch.linspace(-2.0, 1.0, D, dtype=DT)  # 1 + 2b from −3 to 3, crossing 0
    up, vp = DiagonalGeometry(u, v, "mix").geodesic((u * b, v * b), order="exact")
    assert torch.allclose(up * vp, u * v * (1 + 2 * b), rtol=1e-14, atol=1e-15)
    ok = 1 + 2 * b >= 1e-2  # where the chart is regular: the true geodesic itself
    assert torch.allclose(up[ok], (u * torch.sqrt(1 + 2 * b))[ok], rtol=1e-14)
    assert torch.allclose(vp[ok], (v * torch.sqrt(1 + 2 * b))[ok], rtol=1e-14)
    # and the derivative of the product in b is exact on both sides: d(u′v′)/db = 2uv
    bb = b.clone().requires_grad_()
    up, vp = DiagonalGeometry(u, v, "mix").geodesic((u * bb, v * bb), order="exact")
    (grad,) = torch.autograd.grad((up * vp).sum(), bb)
    assert torch.allclose(grad, 2 * u * v, rtol=1e-13)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_christoffel_matches_dense_levi_civita(metric, eps):
    u, v, g = base_point(5)
    xi = (randn(D, g), randn(D, g))  # any velocity: Γ is defined on the whole tangent space
    geom = DiagonalGeometry(u, v, metric, eps)
    expected = dense_christoffel(torch.cat([u, v]), flat(*xi), metric, eps)
    # O(1) entries, a handful of flops each: 1e-12 relative is far above float64 roundoff.
    assert rel(flat(*geom.christoffel(xi)), expected) < 1e-12
    # christoffel_at evaluates the metric at the given point, not the base point.
    p = (u + 0.3, v - 0.2)
    expected_p = dense_christoffel(flat(*p), flat(*xi), metric, eps)
    assert rel(flat(*geom.christoffel_at(p, xi)), expected_p) < 1e-12


@pytest.mark.parametrize("metric", METRICS)
def test_order2_error_is_third_order(metric):
    """‖γ₂(s) − γ(s)‖ = O(s³): the error ratio between s = 0.1 and 0.01 is ~1000 (≥ 500)."""
    u, v, g = base_point(6)
    geom = DiagonalGeometry(u, v, metric)
    xi, _ = horizontal_velocity(u, v, g, 1.0)
    xi = tuple(x / float(geom.norm_sq(xi).sqrt()) for x in xi)  # unit speed
    errs = {}
    for s in (1e-1, 1e-2):
        vel = tuple(s * x for x in xi)
        exact = flat(*geom.geodesic(vel, order="exact"))
        errs[s] = float((flat(*geom.geodesic(vel, order=2)) - exact).norm())
        assert errs[s] < float((flat(*geom.geodesic(vel, order=1)) - exact).norm())
    ratio = errs[1e-1] / errs[1e-2]
    assert ratio >= 500, (errs, ratio)


@pytest.mark.parametrize("metric", METRICS)
def test_geodesics_are_differentiable_in_xi(metric):
    """Autograd matches finite differences; horizontal velocities are kept horizontal by P."""
    u, v, g = base_point(7, d=3)
    geom = DiagonalGeometry(u, v, metric)
    xi, _ = horizontal_velocity(u, v, g, 0.2)
    for order in (1, 2, "exact"):

        def endpoint(xu, xv, order=order):
            return geom.geodesic(geom.project((xu, xv)), order=order)

        inputs = tuple(x.clone().requires_grad_() for x in xi)
        assert gradcheck(endpoint, inputs)


def test_closed_form_mix_geodesic_gives_the_rk4_riemannian_gradient():
    """The mix closed form differentiates as γ_{P(ξ)}(1); after g⁻¹ and P that is the gradient of
    the true exact geodesic (P is g-orthogonal, so P g⁻¹ Pᵀ = P g⁻¹)."""
    u, v, g = base_point(8, d=4)
    geom = DiagonalGeometry(u, v, "mix")
    xi, _ = horizontal_velocity(u, v, g, 0.3)
    w = randn(4, g)

    def horizontal_rgrad(**kw):
        x = tuple(t.clone().requires_grad_() for t in xi)
        u1, v1 = geom.geodesic(x, order="exact", **kw)
        e = torch.autograd.grad(((u1 * v1 - w) ** 2).sum(), x)
        return flat(*geom.project(geom.riemannian_grad(e)))

    closed = horizontal_rgrad()
    tilt = (xi[0] * (1 + 1e-6), xi[1])  # off the horizontal space: forces RK4
    x = tuple(t.clone().requires_grad_() for t in tilt)
    u1, v1 = geom.geodesic(x, order="exact", steps=400)
    e = torch.autograd.grad(((u1 * v1 - w) ** 2).sum(), x)
    rk4 = flat(*geom.project(geom.riemannian_grad(e)))
    # The 1e-6 tilt perturbs the gradient by O(1e-6); RK4 at h = 1/400 adds ~1e-10.
    assert rel(closed, rk4) < 1e-5


# ------------------------------------------------------------------------------------------------
# Metric, projection, Riemannian gradient
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_inner_and_riemannian_grad_match_dense_metric(metric, eps):
    u, v, g = base_point(8)
    geom = DiagonalGeometry(u, v, metric, eps)
    a, b, e = (randn(D, g), randn(D, g)), (randn(D, g), randn(D, g)), (randn(D, g), randn(D, g))
    gd = dense_metric(torch.cat([u, v]), metric, eps)
    got = geom.inner(a, b)
    assert got.dim() == 0
    # O(10) sums of O(1) products: 1e-12 is a wide margin above float64 roundoff.
    assert abs(float(got) - float(flat(*a) @ gd @ flat(*b))) <= 1e-12 * float(gd.abs().max())
    expected = torch.linalg.solve(gd, flat(*e))
    assert rel(flat(*geom.riemannian_grad(e)), expected) < 1e-12


@pytest.mark.parametrize("metric", METRICS)
def test_projection_is_the_metric_orthogonal_projection(metric):
    u, v, g = base_point(9)
    geom = DiagonalGeometry(u, v, metric)
    xi = (randn(D, g), randn(D, g))
    p = geom.project(xi)
    # Each test quantity is O(1) and computed with O(1) flops: 1e-13 bounds float64 roundoff.
    assert rel(flat(*geom.project(p)), flat(*p)) < 1e-13  # idempotent
    assert torch.allclose(p[0] / u, p[1] / v, rtol=1e-13, atol=1e-14)  # ξ_u/u = ξ_v/v
    assert float(horizontal_residual(u, v, p).abs().max()) < 1e-13
    # metric-orthogonal to every vertical vector (u_i, −v_i) e_i
    for i in range(D):
        vert = (torch.zeros(D, dtype=DT), torch.zeros(D, dtype=DT))
        vert[0][i], vert[1][i] = u[i], -v[i]
        assert abs(float(geom.inner(p, vert))) < 1e-13
    # and equal to the dense orthogonal projection
    assert rel(flat(*p), flat(*dense_projection(u, v, xi, metric, 0.0))) < 1e-13
    # (u b, v b) with b = ½(ξ_u/u + ξ_v/v)  (SPEC §5)
    b = 0.5 * (xi[0] / u + xi[1] / v)
    assert rel(flat(*p), flat(u * b, v * b)) < 1e-13
    assert rel(horizontal_coordinate(u, v, p), b) < 1e-13


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_agrees_with_gl_block_at_h_equal_1(metric, eps):
    """Each coordinate is the GL(h) block with n = m = h = 1 (SPEC §4): batch them as (d, 1, 1)."""
    u, v, g = base_point(10)
    geom = DiagonalGeometry(u, v, metric, eps)
    block = GLGeometry(u.reshape(D, 1, 1), v.reshape(D, 1, 1), metric, eps)

    def as_block(x):
        return tuple(t.reshape(D, 1, 1) for t in x)

    a, b = (randn(D, g), randn(D, g)), (randn(D, g), randn(D, g))
    # Same formulas up to association order: roundoff-level agreement.
    assert abs(float(geom.inner(a, b) - block.inner(as_block(a), as_block(b)).sum())) < 1e-12
    assert rel(flat(*geom.project(a)), flat(*block.project(as_block(a)))) < 1e-12
    assert rel(flat(*geom.christoffel(a)), flat(*block.christoffel(as_block(a)))) < 1e-12
    assert rel(flat(*geom.riemannian_grad(a)), flat(*block.riemannian_grad(as_block(a)))) < 1e-12


def test_damped_projection_is_the_spec_relaxation():
    """eps > 0: Λ solves 2 M_H M_G Λ = ξ_v v M_G − M_H u ξ_u (SPEC §4, h = 1); horizontal to O(ε)"""
    u, v, g = base_point(11)
    xi = (randn(D, g), randn(D, g))
    for eps in (1e-2, 1e-4):
        mg, mh = u * u + eps, v * v + eps
        lam = (xi[1] * v * mg - mh * u * xi[0]) / (2 * mh * mg)
        expected = (xi[0] + u * lam, xi[1] - v * lam)
        p = DiagonalGeometry(u, v, "inv", eps).project(xi)
        assert rel(flat(*p), flat(*expected)) < 1e-13
        # Exact damped condition u ξ_u M_H = M_G v ξ_v is violated by −ε Λ (M_G + M_H) only.
        res = u * p[0] * mh - mg * v * p[1]
        assert torch.allclose(res, -eps * lam * (mg + mh), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("metric", METRICS)
def test_invariance_under_the_gl1_action(metric):
    """(u, v) ↦ (αu, v/α), tangents (ξ_u α, ξ_v/α), gradients (e_u/α, e_v α), per coordinate."""
    u, v, g = base_point(12)
    alpha = torch.exp(2.0 * randn(D, g))  # scales from ~e^-4 to ~e^4
    alpha = alpha * torch.where(randn(D, g) < 0, -1.0, 1.0)
    geom, geom_a = DiagonalGeometry(u, v, metric), DiagonalGeometry(alpha * u, v / alpha, metric)

    def push(x):
        return x[0] * alpha, x[1] / alpha

    a, b = (randn(D, g), randn(D, g)), (randn(D, g), randn(D, g))
    # Invariant scalars: relative 1e-12 (α up to ~e^4 multiplies and divides exactly once).
    ref_ab = float(geom.inner(a, b))
    assert abs(float(geom_a.inner(push(a), push(b))) - ref_ab) < 1e-12 * max(1.0, abs(ref_ab))
    assert abs(float(geom_a.norm_sq(push(a)) / geom.norm_sq(a)) - 1.0) < 1e-12
    # Equivariant maps.
    assert rel(flat(*geom_a.project(push(a))), flat(*push(geom.project(a)))) < 1e-12
    assert rel(flat(*geom_a.christoffel(push(a))), flat(*push(geom.christoffel(a)))) < 1e-12
    e = (randn(D, g), randn(D, g))
    e_a = (e[0] / alpha, e[1] * alpha)
    assert rel(flat(*geom_a.riemannian_grad(e_a)), flat(*push(geom.riemannian_grad(e)))) < 1e-12
    # The perturbed function β′ = u′ ⊙ v′ is invariant (order 2 and exact).
    xi, _ = horizontal_velocity(u, v, g, 0.2)
    for order in (2, "exact"):
        ua, va = geom_a.geodesic(push(xi), order=order)
        u1, v1 = geom.geodesic(xi, order=order)
        assert rel(ua * va, u1 * v1) < 1e-12


@pytest.mark.parametrize("metric", METRICS)
def test_random_tangent(metric):
    u, v, _ = base_point(13)
    geom = DiagonalGeometry(u, v, metric)
    # Same stream as the implementation documents (Z₁ then Z₂): exact reproduction. At ε = 0
    # the covariant factors are R(u) = u, R(v) = v (inv) and R(v)^{-T} = 1/v, R(u)^{-T} = 1/u.
    z = torch.randn(2, D, generator=torch.Generator().manual_seed(3), dtype=DT)
    expected = (
        (0.5 * z[0] * u, 0.5 * z[1] * v) if metric == "inv" else (0.5 * z[0] / v, 0.5 * z[1] / u)
    )
    got = geom.random_tangent(torch.Generator().manual_seed(3), scale=0.5, horizontal=False)
    assert rel(flat(*got), flat(*expected)) < 1e-14
    # Isotropy in the metric: E‖ξ‖² = 2N s² (N coordinates), and N s² after the projection
    # (one of two directions per coordinate is removed, metric-orthogonally). A χ² with k dof
    # has relative std √(2/k) ≤ 0.006 here; 0.03 is a 5σ bound.
    n = 50_000
    uu, vv, _ = base_point(14, d=n)
    big = DiagonalGeometry(uu, vv, metric)
    gen = torch.Generator().manual_seed(0)
    full = big.random_tangent(gen, scale=0.7, horizontal=False)
    assert abs(float(big.norm_sq(full)) / (2 * n * 0.49) - 1) < 0.03
    hor = big.random_tangent(gen, scale=0.7)
    assert abs(float(big.norm_sq(hor)) / (n * 0.49) - 1) < 0.03
    assert float(horizontal_residual(uu, vv, hor).abs().max()) < 1e-12


def test_float32_and_any_shape():
    u, v, _ = base_point(15, d=6)
    u32, v32 = u.float().reshape(2, 3), v.float().reshape(2, 3)
    geom = DiagonalGeometry(u32, v32, "mix")
    xi = geom.random_tangent(torch.Generator().manual_seed(0), scale=0.1)
    geom._rk4 = lambda *a, **k: pytest.fail("closed form expected, RK4 used")
    out = geom.geodesic(xi, order="exact")
    assert all(t.dtype == torch.float32 and t.shape == (2, 3) for t in out)
    assert geom.norm_sq(xi).dtype == torch.float32
    # The float32 projection is horizontal to a few ulps, so the closed form (not RK4) is used
    # and agrees with the float64 computation to float32 precision.
    geom64 = DiagonalGeometry(u32.double(), v32.double(), "mix")
    ref = geom64.geodesic(tuple(x.double() for x in xi), order="exact", steps=400)
    assert rel(flat(*out).double(), flat(*ref)) < 1e-6


# ------------------------------------------------------------------------------------------------
# Closed-form sharpness vs brute force on the actual loss ‖Xβ − y‖²
# ------------------------------------------------------------------------------------------------
def regression(beta0, interpolating, seed):
    """X (n = 6, d = 3) with XᵀX = I from a QR; y with β* = Xᵀy = beta0 (+ residual if not)."""
    rng = np.random.default_rng(seed)
    X, _ = np.linalg.qr(rng.standard_normal((6, 3)))
    y = X @ beta0
    if not interpolating:
        noise = rng.standard_normal(6)
        y = y + noise - X @ (X.T @ noise)  # orthogonal to range(X): β* unchanged, L(β*) > 0
    return X, y


def fibonacci_ball(n_dir=3000, n_rad=25):
    """Quasi-uniform points of the unit 3-ball: Fibonacci sphere × radii in (0, 1]."""
    k = np.arange(n_dir) + 0.5
    z = 1 - 2 * k / n_dir
    phi = math.pi * (1 + 5**0.5) * k
    s = np.sqrt(1 - z * z)
    dirs = np.stack([s * np.cos(phi), s * np.sin(phi), z], axis=1)
    radii = np.linspace(1.0 / n_rad, 1.0, n_rad)
    return (radii[:, None, None] * dirs[None]).reshape(-1, 3)


def brute_force(rise, radius):
    """max_{‖c‖ ≤ radius} rise(c): dense grid over the ball, SLSQP from the 10 best points."""
    grid = radius * fibonacci_ball()
    vals = rise(grid)
    best_val, best_c = float(vals.max()), grid[int(np.argmax(vals))]
    for i in np.argsort(-vals)[:10]:
        res = minimize(
            lambda c: -rise(c[None])[0],
            grid[i],
            method="SLSQP",
            constraints=[{"type": "ineq", "fun": lambda c: radius**2 - c @ c}],
            options={"ftol": 1e-15, "maxiter": 500},
        )
        c = res.x * min(1.0, radius / np.linalg.norm(res.x))  # keep it feasible
        val = float(rise(c[None])[0])
        if val > best_val:
            best_val, best_c = val, c
    return best_val, best_c


def loss(X, y, beta):
    return np.sum((beta @ X.T - y) ** 2, axis=-1)


# (β, β*) pairs. "interp": β = β* with two tied |β_i| (the inv optimum puts the whole budget on
# one of them — where plain Lagrangian bisection has a duality gap). "noninterp": a case whose
# inv maximiser has one coordinate past its local maximum (the "special" KKT branch).
CASES = {
    "interp": (np.array([1.2, -1.2, 0.7]), np.array([1.2, -1.2, 0.7])),
    "noninterp": (np.array([0.7, 1.4, -0.7]), np.array([1.0, 1.1, -1.8])),
}


def factors(beta, seed):
    """(u, v) with u ⊙ v = β and a random split of the scale (the geometry must not care)."""
    rng = np.random.default_rng(seed)
    u = np.sign(beta) * np.sqrt(np.abs(beta)) * rng.uniform(0.5, 2.0, beta.size)
    return torch.from_numpy(u), torch.from_numpy(beta / u)


@pytest.mark.parametrize("rho", [0.05, 0.3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_closed_form_mix_matches_brute_force(case, rho):
    beta, beta_star = CASES[case]
    X, y = regression(beta_star, interpolating=case == "interp", seed=1)
    u, v = factors(beta, seed=2)
    base = loss(X, y, beta)

    def rise(c):  # c = √2 b β, so ‖c‖₂ = ‖ξ‖_mix; endpoint (u√(1+2b), v√(1+2b)) of SPEC §5
        b = c / (math.sqrt(2) * beta)
        s = np.sqrt(1 + 2 * b)
        return loss(X, y, (u.numpy() * s) * (v.numpy() * s)) - base

    brute, c = brute_force(rise, rho)
    exact = closed_form_sharpness_mix(beta, beta_star, rho)
    # The closed form is the supremum, brute force a feasible point reached by SLSQP with
    # ftol = 1e-15 on an O(1) objective: they agree to ~1e-13; 1e-10 leaves margin.
    assert brute <= exact + 1e-12
    assert exact - brute <= 1e-10 * max(1.0, exact), (exact, brute)
    # The brute-force maximiser, followed by the geometry's own exact geodesic: the same rise.
    b = torch.from_numpy(c / (math.sqrt(2) * beta))
    geom = DiagonalGeometry(u, v, "mix")
    xi = (u * b, v * b)
    assert abs(float(geom.norm_sq(xi)) - float(c @ c)) < 1e-12
    u1, v1 = geom.geodesic(xi, order="exact")
    assert abs(float(loss(X, y, (u1 * v1).numpy())) - base - brute) < 1e-12


@pytest.mark.parametrize("rho", [0.05, 0.3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_closed_form_inv_matches_brute_force(case, rho):
    beta, beta_star = CASES[case]
    X, y = regression(beta_star, interpolating=case == "interp", seed=3)
    u, v = factors(beta, seed=4)
    base = loss(X, y, beta)

    def rise(b):  # ‖ξ‖_inv = √2 ‖b‖; endpoint (u e^b, v e^b) of SPEC §5
        return loss(X, y, (u.numpy() * np.exp(b)) * (v.numpy() * np.exp(b))) - base

    brute, _ = brute_force(rise, rho / math.sqrt(2))
    exact, b = closed_form_sharpness_inv(beta, beta_star, rho, return_b=True)
    # Same tolerance argument as for mix.
    assert brute <= exact + 1e-12
    assert exact - brute <= 1e-10 * max(1.0, exact), (exact, brute)
    # The returned maximiser is feasible and attains the value through the geometry's geodesic.
    geom = DiagonalGeometry(u, v, "inv")
    xi = (u * torch.from_numpy(b), v * torch.from_numpy(b))
    assert float(geom.norm_sq(xi)) <= rho**2 * (1 + 1e-12)
    u1, v1 = geom.geodesic(xi, order="exact")
    assert abs(float(loss(X, y, (u1 * v1).numpy())) - base - exact) < 1e-12


def test_closed_form_inv_at_d200_is_a_global_maximum_and_fast():
    rng = np.random.default_rng(0)
    beta_star = rng.standard_normal(200) * (rng.uniform(size=200) < 0.1)  # 90 % sparse
    beta = beta_star + 0.05 * rng.standard_normal(200)
    rho = 0.3
    radius = rho / math.sqrt(2)
    t0 = time.perf_counter()
    exact, b = closed_form_sharpness_inv(beta, beta_star, rho, return_b=True)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, elapsed  # typically ~0.1 s; generous bound for loaded CI machines

    def total(bb):
        return float(np.sum(beta**2 * np.expm1(4 * bb) - 2 * beta_star * beta * np.expm1(2 * bb)))

    assert np.linalg.norm(b) <= radius * (1 + 1e-14)
    assert abs(total(b) - exact) <= 1e-12 * exact

    # No local ascent on the sphere (the maximum is on it) improves on it, whether started from
    # the returned point or from random ones. L-BFGS stops at a relative change of ~1e-15 in f;
    # 1e-12 relative leaves room for the roundoff of a 200-term sum.
    def neg(z):  # −Σ f(ρ′ z/‖z‖) and its gradient (chain rule through the normalisation)
        n = np.linalg.norm(z)
        bb = radius * z / n
        fp = 4 * beta**2 * np.exp(4 * bb) - 4 * beta_star * beta * np.exp(2 * bb)
        return -total(bb), -(radius / n) * (fp - (fp @ z) * z / n**2)

    starts = [b / radius] + [rng.standard_normal(200) for _ in range(3)]
    for z0 in starts:
        res = minimize(neg, z0, jac=True, method="L-BFGS-B", options={"ftol": 1e-16})
        assert -res.fun <= exact * (1 + 1e-12), (-res.fun, exact)


@pytest.mark.parametrize("case", ["interpolating", "non-interpolating"])
def test_two_regime_approximation_at_small_rho(case):
    """ρ = 1e-3: first term dominates when r ≠ 0, second when r = 0 (SPEC §5); both ~1e-3 exact."""
    rng = np.random.default_rng(7)
    beta_star = rng.standard_normal(20)
    beta = beta_star if case == "interpolating" else beta_star + 0.3 * rng.standard_normal(20)
    rho = 1e-3
    approx = two_regime_sharpness_inv(beta, beta_star, rho)
    exact = closed_form_sharpness_inv(beta, beta_star, rho)
    # Neglected terms are O(ρ′) relative to the leading one (ρ′ ≈ 7e-4): 1e-2 is the spec's bound.
    assert abs(approx - exact) <= 1e-2 * exact, (approx, exact)
    rho_p = rho / math.sqrt(2)
    if case == "interpolating":
        assert approx == pytest.approx(4 * rho_p**2 * np.max(beta**2), rel=1e-15)
    else:
        r = beta * (beta - beta_star)
        assert 4 * rho_p * np.linalg.norm(r) >= 0.99 * approx


def test_closed_forms_edge_cases():
    assert closed_form_sharpness_inv([1.0, 2.0], [0.0, 1.0], 0.0) == 0.0
    assert closed_form_sharpness_mix([1.0, 2.0], [0.0, 1.0], 0.0) == 0.0
    # β = 0: nothing can move.
    assert closed_form_sharpness_inv([0.0, 0.0], [1.0, 1.0], 0.3) == 0.0
    assert closed_form_sharpness_mix([0.0, 0.0], [1.0, 1.0], 0.3) == 0.0
    # d = 1: the maximum is at an end of [−ρ′, ρ′].
    rp = 0.3 / math.sqrt(2)
    f = [4 * math.expm1(4 * s * rp) - 2 * 1.0 * 2 * math.expm1(2 * s * rp) for s in (1, -1)]
    assert closed_form_sharpness_inv([2.0], [1.0], 0.3) == pytest.approx(max(f), rel=1e-14)
    # Tensors are accepted.
    t = torch.tensor([1.0, -2.0])
    assert closed_form_sharpness_mix(t, t, 0.1) == pytest.approx(0.02, rel=1e-14)
    # The maximiser moves β₁ through 0, along the straight line in β: the formula still holds.
    expected = 2 * math.sqrt(2) * 1.0 * 0.9 + 2.0
    assert closed_form_sharpness_mix([0.1, 2.0], [1.0, 2.0], 1.0) == pytest.approx(expected)
    with pytest.raises(ValueError, match="same shape"):
        closed_form_sharpness_inv([1.0, 2.0], [1.0], 0.1)
    with pytest.raises(ValueError, match="rho"):
        closed_form_sharpness_inv([1.0], [1.0], -0.1)
    with pytest.raises(TypeError, match="rho"):
        two_regime_sharpness_inv([1.0], [1.0], "0.1")


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
def test_bad_input():
    u, v, _ = base_point(20)
    with pytest.raises(ValueError, match="shape"):
        DiagonalGeometry(u, v[:-1])
    with pytest.raises(ValueError, match="metric"):
        DiagonalGeometry(u, v, metric="euclid")
    with pytest.raises(ValueError, match="eps"):
        DiagonalGeometry(u, v, eps=-1e-3)
    with pytest.raises(TypeError, match="floating"):
        DiagonalGeometry(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="dtype"):
        DiagonalGeometry(u, v.float())
    u0 = u.clone()
    u0[1] = 0.0
    v0 = v.clone()
    v0[3] = 0.0
    with pytest.raises(ValueError, match=r"2 of the 5 coordinates.*eps>0"):
        DiagonalGeometry(u0, v0)
    DiagonalGeometry(u0, v0, eps=1e-6)  # damping makes it regular
    geom = DiagonalGeometry(u, v)
    with pytest.raises(TypeError, match="pair"):
        geom.inner(u, v)
    with pytest.raises(ValueError, match="shape"):
        geom.project((u[:-1], v[:-1]))
    with pytest.raises(ValueError, match="order"):
        geom.geodesic((u, v), order=3)
