"""The fused order-2 endpoint and the Gram-matrix norms of GLGeometry equal their definitions."""

import dataclasses

import pytest
import torch

from geosharp.geometry import GLSubgroupGeometry, flat, gl_execution
from geosharp.geometry.gl import GLGeometry
from geosharp.geometry.gl_endpoint import _eye_like, eye_plus_mm, scaled_mm
from geosharp.geometry.gl_execution import GLExecution, chunked_on
from geosharp.geometry.gl_math import christoffel, lam_from, order2_endpoint
from geosharp.geometry.gl_subgroup import BlockDiagonalAlgebra

DT = torch.float64


def _block(seed, lead=(3,), n=7, m=6, h=4):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(*lead, n, h, dtype=DT, generator=g)
    H = torch.randn(*lead, m, h, dtype=DT, generator=g)
    xi = (0.1 * torch.randn_like(G), 0.1 * torch.randn_like(H))
    return G, H, xi


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_fused_order2_endpoint_is_point_plus_xi_minus_half_christoffel(metric, lead):
    G, H, (xG, xH) = _block(0, lead)
    geom = GLGeometry(G, H, metric=metric)
    gG, gH = christoffel(G, H, xG, xH, geom.factors.MG_inv, geom.factors.MH_inv, metric)
    Gp, Hp = order2_endpoint(G, H, xG, xH, geom.factors.MG_inv, geom.factors.MH_inv, metric)
    assert _rel(Gp, G + xG - 0.5 * gG) < 1e-14
    assert _rel(Hp, H + xH - 0.5 * gH) < 1e-14
    # the geometry's order-2 geodesic is that endpoint, and so is its gradient in ξ
    Gq, Hq = geom.geodesic((xG, xH), order=2)
    assert torch.equal(Gq, Gp) and torch.equal(Hq, Hp)
    a = tuple(t.clone().requires_grad_(True) for t in (xG, xH))
    b = tuple(t.clone().requires_grad_(True) for t in (xG, xH))
    w = (torch.randn_like(G), torch.randn_like(H))
    fused = geom.geodesic(a, order=2)
    c = christoffel(G, H, *b, geom.factors.MG_inv, geom.factors.MH_inv, metric)
    plain = (G + b[0] - 0.5 * c[0], H + b[1] - 0.5 * c[1])
    ga = torch.autograd.grad(sum((p * q).sum() for p, q in zip(fused, w, strict=True)), a)
    gb = torch.autograd.grad(sum((p * q).sum() for p, q in zip(plain, w, strict=True)), b)
    for u, v in zip(ga, gb, strict=True):
        assert _rel(u, v) < 1e-13


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_float32_order2_endpoint_within_rounding_of_the_float64_one(metric):
    G, H, xi = _block(1, (5,), n=33, m=32, h=8)
    wide = GLGeometry(G, H, metric=metric)
    lo = GLGeometry(G.float(), H.float(), metric=metric)  # float64 tangents, float32 endpoint
    ref = wide.geodesic(xi, order=2)
    got = lo.geodesic(xi, order=2)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == torch.float32
        assert _rel(a.double(), b) < 1e-6


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_norm_and_inner_from_gram_matrices_equal_the_trace_definition(metric):
    G, H, xi = _block(2, (4,))
    _, _, eta = _block(3, (4,))
    geom = GLGeometry(G, H, metric=metric)
    MG, MH = G.mT @ G, H.mT @ H
    if metric == "inv":
        MG, MH = torch.linalg.inv(MG), torch.linalg.inv(MH)
    else:
        MG, MH = MH, MG

    def tr(a, b, M):
        return torch.einsum("...ij,...ij->...", a @ M, b)  # tr(M aᵀ b) = Σ (a M) ⊙ b

    ref = tr(xi[0], eta[0], MG) + tr(xi[1], eta[1], MH)
    assert _rel(geom.inner(xi, eta), ref) < 1e-13
    ref_sq = tr(xi[0], xi[0], MG) + tr(xi[1], xi[1], MH)
    assert _rel(geom.norm_sq(xi), ref_sq) < 1e-13
    assert torch.equal(geom.norm_sq(xi), geom.inner(xi, xi))
    assert (geom.norm_sq(xi) > 0).all()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_subgroup_projection_with_fused_update_is_horizontal(metric):
    G, H, xi = _block(4, (3,), n=7, m=8, h=6)
    alg = BlockDiagonalAlgebra(6, planes=((0, 2), (1, 3)), free=(4, 5))
    geom = GLSubgroupGeometry(G, H, alg, metric=metric)
    p = geom.project(xi)
    assert float(geom.horizontal_residual(p).abs().max()) < 1e-10
    q = geom.project(p)
    assert _rel(q[0], p[0]) < 1e-12 and _rel(q[1], p[1]) < 1e-12


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_hand_written_backward_passes_gradcheck_and_gradgradcheck(metric):
    G, H, xi = _block(5, (2,), n=5, m=4, h=3)
    geom = GLGeometry(G, H, metric=metric)
    a = tuple(t.clone().requires_grad_(True) for t in xi)
    out = geom.geodesic(a, order=2)
    assert type(out[0].grad_fn).__name__ == "_Order2EndpointBackward"

    def endpoint(u, v):
        return geom.geodesic((u, v), order=2)

    assert torch.autograd.gradcheck(endpoint, a)
    assert torch.autograd.gradgradcheck(endpoint, a)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_forward_mode_and_torch_func_use_plain_autograd(metric):
    G, H, xi = _block(6, (2,), n=5, m=4, h=3)
    geom = GLGeometry(G, H, metric=metric)
    v = (torch.randn_like(xi[0]), torch.randn_like(xi[1]))
    _, jv = torch.func.jvp(lambda u, w: geom.geodesic((u, w), order=2), xi, v)
    eps = 1e-6
    plus = geom.geodesic((xi[0] + eps * v[0], xi[1] + eps * v[1]), order=2)
    minus = geom.geodesic((xi[0] - eps * v[0], xi[1] - eps * v[1]), order=2)
    for j, p, m in zip(jv, plus, minus, strict=True):
        assert _rel(j, (p - m) / (2 * eps)) < 1e-7
    g = torch.func.grad(lambda u: geom.geodesic((u, xi[1]), order=2)[0].sum())(xi[0])
    u = xi[0].clone().requires_grad_(True)
    ref = torch.autograd.grad(geom.geodesic((u, xi[1]), order=2)[0].sum(), u)[0]
    assert _rel(g, ref) < 1e-13


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(3, 8), (21, 64), (72, 32)])
def test_one_launch_factors_give_the_plain_values_bit_for_bit(dtype, shape):
    """``I + α·A@B`` and ``α·A@B`` in fewer launches (issue 43): the values of the plain forms."""
    b, h = shape
    g = torch.Generator().manual_seed(b * h)
    A, B = (torch.randn(b, h, h, generator=g, dtype=dtype) for _ in range(2))
    eye = torch.eye(h, dtype=dtype)
    for alpha in (0.5, -0.5):
        assert torch.equal(eye_plus_mm(A, B, alpha), eye + alpha * (A @ B))
        assert torch.equal(scaled_mm(A, B, alpha), alpha * (A @ B))
        assert torch.equal(scaled_mm(A, B, alpha), A @ (alpha * B))  # a power of two
    assert torch.equal(eye_plus_mm(A[0], B[0], 0.5), eye + 0.5 * (A[0] @ B[0]))  # 2-D: plain
    assert _eye_like(A) is _eye_like(B)  # made once, shared
    assert torch.equal(_eye_like(A), eye)


def test_eig_sums_are_the_solve_denominators_and_leave_the_projection_as_it_was():
    G, H, xi = _block(5, (4,))
    geom = GLGeometry(G, H, metric="inv")
    F = geom.factors
    assert F.eig_sums is not None
    assert torch.equal(F.eig_sums, F.eig.unsqueeze(-1) + F.eig.unsqueeze(-2))
    plain = dataclasses.replace(F, eig_sums=None)
    XH, GX = xi[1].mT @ H, G.mT @ xi[0]
    assert torch.equal(lam_from(XH, GX, F, "inv"), lam_from(XH, GX, plain, "inv"))


def test_chunked_on_sets_the_default_chunks_for_a_while():
    G, H, xi = _block(6, (40,), n=30, m=30, h=8)
    small = GLExecution(chunk_elements=512)  # 2 heads a chunk on the CPU
    chunked = GLGeometry(G, H, metric="inv", execution=small)
    assert len(chunked._slices) == 20
    with chunked_on(()):
        one = GLGeometry(G, H, metric="inv", execution=GLExecution(chunk_elements=512))
        assert len(one._slices) == 1  # one batched pass, as on a GPU
        assert gl_execution.CHUNK_DEVICES == flat.COMBINE_DEVICES == ()
    assert gl_execution.CHUNK_DEVICES == flat.COMBINE_DEVICES == ("cpu",)
    with pytest.raises(RuntimeError), chunked_on(()):
        raise RuntimeError
    assert (
        gl_execution.CHUNK_DEVICES == flat.COMBINE_DEVICES == ("cpu",)
    )  # put back on an error too
    a, b = chunked.ascent_direction(xi), one.ascent_direction(xi)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))  # head by head
    assert abs(float(a[1]) - float(b[1])) <= 1e-14 * abs(float(b[1]))  # a sum in chunks


def test_a_large_piece_off_the_cpu_runs_in_a_few_chunks():
    """Off the chunk devices (a GPU) a piece runs in one pass, or in at most a few chunks of
    ``device_chunk_elements`` when larger (the float64 copies of a whole piece at once: issue
    43's GPU peak); checked on the CPU through ``chunked_on(())``."""
    G, H, _ = _block(7, (40,), n=30, m=30, h=8)  # 40 heads of 240 elements
    with chunked_on(()):
        ex = GLExecution(device_chunk_elements=2400)  # 10 heads a chunk: 4 chunks
        assert len(ex.head_slices(G, H)) == 4
        ex = GLExecution(device_chunk_elements=480)  # 2 heads a chunk, but at most 4 chunks
        assert [s.stop - s.start for s in ex.head_slices(G, H)] == [10, 10, 10, 10]
        assert GLExecution().head_slices(G, H) == [slice(None)]  # fits in one: one pass
        ex = GLExecution(device_chunk_elements=480, device_max_chunks=3)
        assert [s.stop - s.start for s in ex.head_slices(G, H)] == [14, 14, 12]
