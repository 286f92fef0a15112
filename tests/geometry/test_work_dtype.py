"""GL geometries with their per-step products in float32 (``GLExecution(work_dtype=...)``).

The factorizations stay float64; only the products of an ascent step (projection, Riemannian
gradient, norm, Christoffel term) run in the model's dtype. Against the float64 geometry on the
same float32 point, every result must agree to float32 roundoff amplified by the conditioning
of the block (cond(M_G), cond(M_H) ≤ 10 here, so 1e-5 relative), and the float32 projection
must be horizontal to that accuracy in the float64 metric.
"""

import pytest
import torch

from geosharp.geometry import BlockDiagonalAlgebra, GLExecution, GLGeometry, GLSubgroupGeometry

LEAN = GLExecution(work_dtype=torch.float32)


def _point(seed=0, batch=(3,), n=12, m=10, h=4):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(*batch, n, h, generator=g) + 2 * torch.eye(n, h)
    H = torch.randn(*batch, m, h, generator=g) + 2 * torch.eye(m, h)
    return G, H, g


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("subgroup", [False, True])
def test_float32_products_match_the_float64_geometry(metric, subgroup):
    G, H, g = _point()
    if subgroup:  # rotary-like: one rotated plane and a gl(2) block
        alg = BlockDiagonalAlgebra(4, planes=((0, 2),), free=(1, 3))
        ref = GLSubgroupGeometry(G, H, alg, metric=metric, eps=0.0)
        lo = GLSubgroupGeometry(G, H, alg, metric=metric, eps=0.0, execution=LEAN)
    else:
        ref = GLGeometry(G, H, metric=metric, eps=0.0)
        lo = GLGeometry(G, H, metric=metric, eps=0.0, execution=LEAN)
    assert ref.tangent_dtype == lo.tangent_dtype == torch.float32  # the model's dtype
    assert lo._held[0].data_ptr() == G.data_ptr()  # the model's own G: no copy
    xi = (torch.randn(G.shape, generator=g), torch.randn(H.shape, generator=g))
    p_ref, p_lo = ref.project(xi), lo.project(xi)
    assert all(t.dtype == torch.float32 for t in p_lo)
    for a, b in zip(p_lo, p_ref, strict=True):
        assert _rel(a, b) < 1e-5
    # horizontal in the float64 metric, to float32 accuracy: the residual of the projection is
    # small next to that of ξ itself
    res = ref.horizontal_residual(tuple(t.double() for t in p_lo)).norm()
    assert float(res) < 1e-5 * float(ref.horizontal_residual(xi).norm())
    for a, b in zip(lo.riemannian_grad(xi), ref.riemannian_grad(xi), strict=True):
        assert _rel(a, b) < 1e-5
    assert _rel(lo.norm_sq(p_lo), ref.norm_sq(p_ref)) < 1e-5
    for a, b in zip(lo.geodesic(p_lo, order=2), ref.geodesic(p_ref, order=2), strict=True):
        assert _rel(a, b) < 1e-6


def _ill_conditioned(seed=3, batch=(4,), n=24, m=20, h=4, cond=1e4):
    """A float32 point whose Gram matrices have condition numbers ≈ ``cond``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, 0.5 * torch.log10(torch.tensor(cond)).item(), h)
    G = (torch.randn(*batch, n, h, generator=g, dtype=torch.float64) * scale).float()
    H = (torch.randn(*batch, m, h, generator=g, dtype=torch.float64) / scale).float()
    return G, H, g


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("subgroup", [False, True])
def test_float32_tangents_are_the_float64_results_rounded_once(metric, subgroup):
    """The default: tangents kept in the model's float32, every product in float64.

    Each method widens its float32 tangents, computes what the float64-tangent geometry
    computes on the same (widened) tangent and rounds once: its results are *exactly* the
    float64 results rounded to float32, however ill conditioned the block, and no float64 copy
    of the base point is held.
    """

    def build(**kw):
        if subgroup:
            alg = BlockDiagonalAlgebra(4, planes=((0, 2),), free=(1, 3))
            return GLSubgroupGeometry(G, H, alg, metric=metric, eps=0.0, **kw)
        return GLGeometry(G, H, metric=metric, eps=0.0, **kw)

    G, H, g = _ill_conditioned()
    wide = build(
        execution=GLExecution(tangent_dtype=torch.float64)
    )  # float64 tangents, the float64 point held
    lean = build()
    assert wide.tangent_dtype == torch.float64 and lean.tangent_dtype == torch.float32
    assert lean.execution.work_dtype == torch.float64
    assert lean._held is None
    assert wide._held[0].dtype == torch.float64
    assert torch.linalg.cond(wide.factors.MG).max() > 1e4
    xi = (torch.randn(G.shape, generator=g), torch.randn(H.shape, generator=g))
    xi64 = tuple(t.double() for t in xi)
    assert lean.zeros()[0].dtype == torch.float32 and wide.zeros()[0].dtype == torch.float64
    for name in ("project", "riemannian_grad", "christoffel"):
        ref = getattr(wide, name)(xi64)
        out = getattr(lean, name)(xi)
        assert all(t.dtype == torch.float32 for t in out), name
        assert all(t.dtype == torch.float64 for t in ref), name
        for a, b in zip(out, ref, strict=True):
            assert torch.equal(a, b.float()), name
    p = lean.project(xi)
    p64 = tuple(t.double() for t in p)
    assert torch.equal(lean.norm_sq(p), wide.norm_sq(p64).float())
    assert torch.equal(lean.inner(p, xi), wide.inner(p64, xi64).float())
    # the stored (rounded) projection is horizontal to float32 rounding in the float64 metric
    res = float(wide.horizontal_residual(p64).norm())
    assert res < 1e-6 * float(wide.horizontal_residual(xi64).norm())


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "subgroup",
    [None, dict(planes=((0, 2),), free=(1, 3)), dict(planes=((0, 1), (2, 3)), free=())],
    ids=["gl", "rotary-plane-and-free", "rotary-planes"],
)
def test_chunked_products_equal_one_pass(metric, dtype, subgroup):
    """Heads in cache-sized chunks (CPU): the same numbers as one batched pass.

    The rotary subgroup geometry is included: its own per-head tensors must not be mistaken
    for the chunk helpers (it names an algebra index ``_rows``).
    """
    G, H, g = _ill_conditioned(batch=(2, 5))
    G, H = G.to(dtype), H.to(dtype)

    def build(**kw):
        if subgroup:
            alg = BlockDiagonalAlgebra(4, **subgroup)
            return GLSubgroupGeometry(G, H, alg, metric=metric, eps=0.0, **kw)
        return GLGeometry(G, H, metric=metric, eps=0.0, **kw)

    whole = build()
    parts = build(execution=GLExecution(chunk_elements=2 * 24 * 4))  # 2 heads per chunk
    assert whole._slices == [slice(None)] and len(parts._slices) == 5
    shape = dict(generator=g, dtype=dtype)
    xi = (torch.randn(G.shape, **shape), torch.randn(H.shape, **shape))
    eta = (torch.randn(G.shape, **shape), torch.randn(H.shape, **shape))
    tol = dict(rtol=1e-12 if dtype == torch.float64 else 0, atol=0)
    for name in ("project", "horizontal_grad"):
        for a, b in zip(getattr(parts, name)(xi), getattr(whole, name)(xi), strict=True):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, **tol)
    # the ascent direction's norm, summed chunk by chunk: the same number to float64 rounding
    (dp, np_), (dw, nw) = parts.ascent_direction(xi), whole.ascent_direction(xi)
    assert np_.dtype == nw.dtype == torch.float64
    torch.testing.assert_close(np_, nw, rtol=1e-12, atol=0)
    for a, b in zip(dp, dw, strict=True):
        torch.testing.assert_close(a, b, **tol)
    pairs = ((parts.norm_sq(xi), whole.norm_sq(xi)), (parts.inner(xi, eta), whole.inner(xi, eta)))
    for got, ref in pairs:
        assert got.shape == ref.shape == (2, 5)
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_ascent_direction_norm_of_float32_tangents_is_the_float64_norm(metric):
    """On ill-conditioned blocks (cond > 1e4) the norm from ``e·d`` in float64 over float32
    tangents is the float64 metric norm of the float64 direction, to 1e-12."""
    G, H, g = _ill_conditioned()
    lean = GLGeometry(G.float(), H.float(), metric=metric, eps=0.0)
    wide = GLGeometry(G, H, metric=metric, eps=0.0)
    e = (torch.randn(G.shape, generator=g), torch.randn(H.shape, generator=g))
    d, dd = lean.ascent_direction(e)
    d64 = wide.horizontal_grad(tuple(t.double() for t in e))
    for a, b in zip(d, d64, strict=True):
        assert torch.equal(a, b.float())
    ref = float(wide.norm_sq(d64).sum())
    assert dd.dtype == torch.float64 and abs(float(dd) - ref) <= 1e-12 * ref


def test_ascent_direction_with_damping_uses_the_metric_norm():
    """At eps > 0 the projection is not exactly metric-orthogonal: the norm is norm_sq(d)."""
    G, H, g = _ill_conditioned()
    geom = GLGeometry(G, H, metric="inv", eps=1e-3)
    assert not geom.orthogonal_projection
    e = (
        torch.randn(G.shape, generator=g, dtype=G.dtype),
        torch.randn(H.shape, generator=g, dtype=G.dtype),
    )
    d, dd = geom.ascent_direction(e)
    assert float(dd) == float(geom.norm_sq(d).sum())
