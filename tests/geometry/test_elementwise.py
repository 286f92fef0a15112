"""Adaptive (element-wise) and Euclidean geometry against dense references (SPEC §5)."""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from geosharp.geometry.adaptive_balls import (
    adaptive_norm,
    linf_norm,
    project_l2_ball,
    project_linf_ball,
)
from geosharp.geometry.elementwise import ElementwiseGeometry, EuclideanGeometry
from geosharp.geometry.flat import flatten

DT = torch.float64


def weights(seed=0, zeros=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 5, generator=g, dtype=DT)
    if zeros:
        w[1, 2] = 0.0
        w[3, 0] = 0.0
    return w, g


def test_inner_grad_norm_match_dense_diagonal_metric():
    w, g = weights(zeros=False)
    geom = ElementwiseGeometry(w)
    a, b = torch.randn(w.shape, generator=g, dtype=DT), torch.randn(w.shape, generator=g, dtype=DT)
    gd = torch.diag(1.0 / w.reshape(-1) ** 2)
    assert math.isclose(
        float(geom.inner((a,), (b,))), float(a.reshape(-1) @ gd @ b.reshape(-1)), rel_tol=1e-12
    )
    r = geom.riemannian_grad((a,))[0]
    assert torch.allclose(r.reshape(-1), torch.linalg.solve(gd, a.reshape(-1)), rtol=1e-12)
    assert math.isclose(float(geom.norm_sq((a,)).sqrt()), float(adaptive_norm(w, a)), rel_tol=1e-12)


def test_zero_weights_are_frozen_never_nan():
    w, g = weights()
    geom = ElementwiseGeometry(w)
    xi = torch.randn(w.shape, generator=g, dtype=DT)
    for out in (
        geom.project((xi,))[0],
        geom.riemannian_grad((xi,))[0],
        geom.random_tangent(g)[0],
        geom.christoffel((xi,))[0],
        geom.geodesic((xi,), order="exact")[0] - w,
        project_l2_ball(w, xi, 0.1),
        project_linf_ball(w, xi, 0.1),
    ):
        assert bool(torch.isfinite(out).all())
        assert float(out[1, 2]) == 0.0 and float(out[3, 0]) == 0.0
    assert bool(torch.isfinite(geom.inner((xi,), (xi,))))
    # Frozen coordinates do not count in the norm.
    xi0 = torch.zeros_like(w)
    xi0[1, 2] = 7.0
    assert float(geom.norm_sq((xi0,))) == 0.0


def test_exact_geodesic_solves_its_ode_and_order2_is_third_order():
    """ẍ = ẋ²/x (Euler–Lagrange of ẋ²/x²), integrated independently by solve_ivp."""
    w, g = weights(zeros=False)
    geom = ElementwiseGeometry(w)
    xi = torch.randn(w.shape, generator=g, dtype=DT) * w.abs()
    x0, v0 = w.reshape(-1).numpy(), xi.reshape(-1).numpy()
    n = x0.size

    def rhs(_, y):
        x, v = y[:n], y[n:]
        return np.concatenate([v, v**2 / x])

    errs = []
    for s in (0.3, 1e-1, 1e-2):
        sol = solve_ivp(
            rhs, (0, 1), np.concatenate([x0, s * v0]), method="DOP853", rtol=1e-13, atol=1e-13
        )
        ref = torch.from_numpy(sol.y[:n, -1]).reshape(w.shape)
        exact = geom.geodesic((s * xi,), order="exact")[0]
        assert float((exact - ref).abs().max()) < 1e-10
        errs.append(float((geom.geodesic((s * xi,), order=2)[0] - ref).norm()))
    assert errs[1] / errs[2] >= 500  # O(s³)


def test_linf_and_l2_balls():
    w = torch.tensor([1.0, -2.0, 0.0, 4.0], dtype=DT)
    xi = torch.tensor([0.5, 0.5, 0.5, -1.0], dtype=DT)
    box = project_linf_ball(w, xi, 0.2)
    assert box.tolist() == [0.2, 0.4, 0.0, -0.8]
    assert math.isclose(float(linf_norm(w, box)), 0.2, rel_tol=1e-15)
    ball = project_l2_ball(w, xi, 0.1)
    assert math.isclose(float(adaptive_norm(w, ball)), 0.1, rel_tol=1e-14)
    small = 1e-3 * torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=DT)
    assert torch.equal(project_l2_ball(w, small, 0.1), small)  # inside: untouched
    with pytest.raises(ValueError, match="p must be 2 or inf"):
        adaptive_norm(w, xi, p=1)


def test_adaptive_sampling_scales_with_weights():
    w = torch.tensor([1.0, -10.0, 0.0], dtype=DT).repeat(20000, 1)
    g = torch.Generator().manual_seed(3)
    (z,) = ElementwiseGeometry(w).random_tangent(g, scale=0.5)
    std = z.std(dim=0)
    # δ_i ~ N(0, ρ² w_i²): stds 0.5, 5, 0 with ~0.5 % standard error.
    assert (
        abs(float(std[0]) - 0.5) < 0.02 and abs(float(std[1]) - 5.0) < 0.2 and float(std[2]) == 0.0
    )


def test_euclidean_geometry_is_flat():
    w, g = weights()
    geom = EuclideanGeometry(w)
    xi = torch.randn(w.shape, generator=g, dtype=DT)
    assert torch.equal(geom.project((xi,))[0], xi)
    assert torch.equal(geom.geodesic((xi,), order="exact")[0], w + xi)
    assert math.isclose(float(geom.norm_sq((xi,))), float((xi**2).sum()), rel_tol=1e-14)


def test_bad_input():
    w, _ = weights()
    with pytest.raises(TypeError, match="floating dtype"):
        ElementwiseGeometry(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="xi must have the shape of w"):
        ElementwiseGeometry(w).project((torch.zeros(3, dtype=DT),))
    with pytest.raises(TypeError, match="1-tuple"):
        ElementwiseGeometry(w).project(torch.zeros_like(w))


def test_weights_whose_inverse_square_overflows_are_frozen_not_nan():
    """float32 1/w² overflows for |w| ≲ 1e-19 (MiniLM has LayerNorm weights ~5e-33)."""
    w = torch.tensor([1.0, 4.8e-33, -2.0], dtype=torch.float32)
    geom = ElementwiseGeometry(w)
    xi = torch.tensor([0.1, 0.1, 0.1])
    assert bool(torch.isfinite(geom.norm_sq((xi,))))
    assert math.isclose(float(geom.norm_sq(geom.project((xi,)))), 0.01 + 0.0025, rel_tol=1e-6)
    assert float(geom.project((xi,))[0][1]) == 0.0
    assert float(geom.riemannian_grad((xi,))[0][1]) == 0.0


def test_ascent_direction_in_place_with_frozen_coordinates():
    """``d = e ⊙ w²`` written into ``e`` (frozen coordinates zero) and ``‖d‖² = Σ (e w)²``."""
    w, g = weights()
    geom = ElementwiseGeometry((w, 2 * w))
    e = (torch.randn(w.shape, generator=g, dtype=DT), torch.randn(w.shape, generator=g, dtype=DT))
    ref = geom.riemannian_grad(e)
    d, dd = geom.ascent_direction(e)  # a copy
    buf = tuple(t.clone() for t in e)
    d_, dd_ = geom.ascent_direction_(buf)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(d_, buf, strict=True))
    for a, b, c in zip(d, d_, ref, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-15, atol=0)
        assert torch.equal(a, b) and float(a[1, 2]) == 0.0 and float(a[3, 0]) == 0.0
    assert geom.orthogonal_projection and float(dd) == float(dd_)
    assert math.isclose(float(dd), float(geom.norm_sq(d)), rel_tol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inner_over_components_frozen_throughout_in_part_and_not(dtype):
    """``Σ (a/w)(b/w)`` over a flat chunk: a zero bias (frozen throughout: zeros for it), a
    weight with two zero entries (frozen in part) and plain weights, against the definition."""
    g = torch.Generator().manual_seed(11)
    plain = torch.randn(6, 5, generator=g, dtype=torch.float64) + 3.0
    part = torch.randn(40, generator=g, dtype=torch.float64) + 3.0
    part[[3, 17]] = 0.0
    point = tuple(t.to(dtype) for t in (plain, torch.zeros(7, dtype=torch.float64), part, plain))
    geom = ElementwiseGeometry(point)
    assert geom._whole_frozen() == [False, True, False, False]

    def tangent():
        x = tuple(torch.randn(w.shape, generator=g).to(dtype) for w in point)
        return tuple(geom.project(x))

    a, b = tangent(), tangent()
    want = 0.0
    for x, y, w in zip(a, b, point, strict=True):
        moving = w != 0
        want += float(((x.double() / w.double()) * (y.double() / w.double()))[moving].sum())
    got = geom.inner(flatten(a), flatten(b)).sum()  # one buffer each: the chunked dot
    tol = 1e-14 if dtype == torch.float64 else 1e-5
    assert math.isclose(float(got), want, rel_tol=tol)
    assert torch.isfinite(got)


# -- frozen coordinates found in chunks (no temporary the size of the weights) ---------------
def _frozen_in_one_pass(t):
    """The rule read on the whole tensor at once (the implementation before chunks)."""
    frozen = (t == 0) | ~torch.isfinite(t.reciprocal().square())
    n = int(frozen.sum())
    if n == 0:
        return None
    return frozen.reshape(-1).nonzero().reshape(-1) if 16 * n <= t.numel() else frozen


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
@pytest.mark.parametrize("share", [0.0, 0.01, 0.06, 0.07, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frozen_coordinates_in_chunks_equal_the_one_pass_rule(monkeypatch, chunk, share, dtype):
    from geosharp.geometry import elementwise_frozen

    monkeypatch.setattr(elementwise_frozen, "_FROZEN_CHUNK", chunk)
    g = torch.Generator().manual_seed(int(share * 100) + chunk)
    t = torch.randn(37, 11, generator=g, dtype=dtype)
    k = int(share * t.numel())
    where = torch.randperm(t.numel(), generator=g)[:k]
    t.view(-1)[where[: k // 2]] = 0.0
    t.view(-1)[where[k // 2 :]] = torch.finfo(dtype).tiny / 8  # 1/w² overflows: frozen too
    want, got = _frozen_in_one_pass(t), elementwise_frozen._frozen_of(t)
    if want is None:
        assert got is None
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [3, 8, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_frozen_coordinates_at_the_edges_of_the_clear_chunk_test(monkeypatch, chunk, dtype):
    """NaN, ±inf, −0, subnormals and weights on either side of the smallest ``|w|`` whose
    ``1/w²`` is finite, between ordinary weights: a chunk is skipped only when nothing in it is
    frozen (the skip test reads ``min |w|``, in which a NaN compares false)."""
    from geosharp.geometry import elementwise_frozen

    monkeypatch.setattr(elementwise_frozen, "_FROZEN_CHUNK", chunk)
    fi = torch.finfo(dtype)
    edge = fi.max**-0.5  # about where 1/w² overflows
    special = [float("nan"), float("inf"), -float("inf"), -0.0, fi.tiny / 4, edge / 2, edge]
    special += [edge * 1.01, -edge * 1.5, 2 * edge, 2.01 * edge, 4 * edge]
    for v in special:
        t = torch.full((5, 4), 0.5, dtype=dtype)
        t.view(-1)[13] = v
        want, got = _frozen_in_one_pass(t), elementwise_frozen._frozen_of(t)
        assert (want is None) == (got is None), v
        if want is not None:
            assert torch.equal(got, want), v
