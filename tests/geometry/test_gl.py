"""GL(h) block geometry against dense float64 references (SPEC §4)."""

import pytest
import torch
from torch.autograd import gradcheck

from geosharp.geometry import GLExecution, gl_factors
from geosharp.geometry.gl import GLGeometry
from geosharp.geometry.gl_action import act, act_tangent

from .reference import (
    DT,
    dense_christoffel,
    dense_horizontal_projection,
    dense_metric,
    integrate_geodesic,
    random_block,
    random_gl,
    vertical_basis,
)

METRICS = ["inv", "mix"]
N, M, h = 5, 4, 3


def flat(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def rand_like(t, g):
    return torch.randn(t.shape, generator=g, dtype=t.dtype)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_inner_matches_dense_metric(metric, eps):
    G, H, g = random_block((), N, M, h, seed=1)
    a = (rand_like(G, g), rand_like(H, g))
    b = (rand_like(G, g), rand_like(H, g))
    gd = dense_metric(flat(G, H), N, M, h, metric, eps)
    expected = flat(*a) @ gd @ flat(*b)
    got = GLGeometry(G, H, metric, eps).inner(a, b)
    # Both are O(10) sums of O(1) products in float64: 1e-12 leaves a wide margin above roundoff.
    assert abs(float(got) - float(expected)) <= 1e-12 * max(1.0, abs(float(expected)))


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_christoffel_matches_dense_levi_civita(metric, eps):
    """SPEC's Γ equals the Levi-Civita form computed by autodiff of the dense metric."""
    G, H, g = random_block((), N, M, h, seed=2)
    xi = (rand_like(G, g), rand_like(H, g))  # not horizontal: Γ holds on the whole tangent space
    expected = dense_christoffel(flat(G, H), flat(*xi), N, M, h, metric, eps)
    got = flat(*GLGeometry(G, H, metric, eps).christoffel(xi))
    assert rel(got, expected) < 1e-11


@pytest.mark.parametrize("metric", METRICS)
def test_order2_error_is_third_order(metric):
    """‖γ₂(s) − γ(s)‖ = O(s³): the error ratio between s = 0.1 and 0.01 is ~1000 (≥ 500)."""
    G, H, g = random_block((), N, M, h, seed=3)
    geom = GLGeometry(G, H, metric)
    xi = geom.project((rand_like(G, g), rand_like(H, g)))
    xi = tuple(x / float(geom.norm_sq(xi).sqrt()) for x in xi)  # unit speed
    errs = {}
    for s in (1e-1, 1e-2):
        v = tuple(s * x for x in xi)
        ref = integrate_geodesic(G, H, *v, metric, 0.0)
        got = geom.geodesic(v, order=2)
        errs[s] = float(flat(*got).sub(flat(*ref)).norm())
        first = geom.geodesic(v, order=1)
        err1 = float(flat(*first).sub(flat(*ref)).norm())
        assert errs[s] < err1  # order 2 beats the straight line
    ratio = errs[1e-1] / errs[1e-2]
    assert ratio >= 500, (errs, ratio)


@pytest.mark.parametrize("metric", METRICS)
def test_exact_geodesic_matches_integrated(metric):
    G, H, g = random_block((), N, M, h, seed=4)
    geom = GLGeometry(G, H, metric)
    xi = geom.project((rand_like(G, g), rand_like(H, g)))
    xi = tuple(0.4 * x / float(geom.norm_sq(xi).sqrt()) for x in xi)
    ref = integrate_geodesic(G, H, *xi, metric, 0.0)
    got = geom.geodesic(xi, order="exact", steps=40)
    # RK4 with 40 steps: global error ~ C·(1/40)⁴ ≈ 4e-7·C; measured ≈ 1e-11 at speed 0.4.
    assert float(flat(*got).sub(flat(*ref)).abs().max()) <= 1e-8


@pytest.mark.parametrize("metric", METRICS)
def test_projection_equals_dense_orthogonal_projection(metric):
    G, H, g = random_block((), N, M, h, seed=5)
    xi = (rand_like(G, g), rand_like(H, g))
    expected = flat(*dense_horizontal_projection(G, H, *xi, metric, 0.0))
    got = flat(*GLGeometry(G, H, metric).project(xi))
    assert rel(got, expected) < 1e-10


@pytest.mark.parametrize("metric", METRICS)
def test_projection_is_idempotent_horizontal_and_orthogonal_to_vertical(metric):
    G, H, g = random_block((2, 3), N, M, h, seed=6)
    geom = GLGeometry(G, H, metric)
    xi = (rand_like(G, g), rand_like(H, g))
    p = geom.project(xi)
    pp = geom.project(p)
    assert rel(flat(*pp), flat(*p)) < 1e-12
    scale = float(flat(*p).norm() * flat(G, H).norm() ** 3)
    assert float(geom.horizontal_residual(p).abs().max()) < 1e-12 * scale
    assert float(geom.horizontal_residual(xi).abs().max()) > 1e-3 * scale  # the check can fail
    for _ in range(5):  # ⟨P ξ, (−GΩ, HΩᵀ)⟩ = 0 for random Ω, relative to the norms involved
        omega = torch.randn(2, 3, h, h, generator=g, dtype=DT)
        vert = geom.vertical(omega)
        ip = geom.inner(p, vert)
        bound = geom.norm_sq(p).sqrt() * geom.norm_sq(vert).sqrt()
        assert bool((ip.abs() <= 1e-12 * bound).all())
    # Pythagoras: ξ = Pξ + vertical part, metric-orthogonal.
    v = (xi[0] - p[0], xi[1] - p[1])
    assert torch.allclose(geom.norm_sq(xi), geom.norm_sq(p) + geom.norm_sq(v), rtol=1e-12)


@pytest.mark.parametrize("metric", METRICS)
def test_projection_is_equivariant(metric):
    G, H, g = random_block((3,), N, M, h, seed=7)
    A = random_gl((3,), h, g, scale=3.0)
    xi = (rand_like(G, g), rand_like(H, g))
    p = GLGeometry(G, H, metric).project(xi)
    pA = GLGeometry(*act(G, H, A), metric).project(act_tangent(*xi, A))
    assert rel(flat(*pA), flat(*act_tangent(*p, A))) < 1e-11


def test_inv_projection_solves_the_corrected_sylvester_equation_with_damping():
    """With ε > 0, Λ still solves A Λ + Λ A = B, A = M_H M_G (SPEC §4, corrected)."""
    G, H, g = random_block((4,), N, M, h, seed=8)
    geom = GLGeometry(G, H, "inv", eps=0.7)
    xi = (rand_like(G, g), rand_like(H, g))
    L = geom.lam(xi)
    A = geom.factors.MH @ geom.factors.MG
    B = (xi[1].mT @ H) @ geom.factors.MG - geom.factors.MH @ (G.mT @ xi[0])
    assert rel(A @ L + L @ A, B) < 1e-12
    # The paper's printed form (AΛ + ΛAᵀ = B, A = GᵀG HᵀH) is not what we solve:
    A_paper = (G.mT @ G) @ (H.mT @ H)
    assert rel(A_paper @ L + L @ A_paper.mT, B) > 1e-2


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("scale", [1e-2, 1.0, 1e2])
def test_metric_is_invariant_under_group_action(metric, scale):
    G, H, g = random_block((3,), N, M, h, seed=9)
    A = random_gl((3,), h, g, scale=scale)
    a = (rand_like(G, g), rand_like(H, g))
    b = (rand_like(G, g), rand_like(H, g))
    before = GLGeometry(G, H, metric).inner(a, b)
    after = GLGeometry(*act(G, H, A), metric).inner(act_tangent(*a, A), act_tangent(*b, A))
    # cond(A) ≤ 4, so roundoff is amplified by at most ~cond² ≈ 16 over float64 eps.
    assert torch.allclose(after, before, rtol=1e-11, atol=0)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("order", [1, 2, "exact"])
def test_geodesic_endpoint_product_is_invariant(metric, order):
    G, H, g = random_block((3,), N, M, h, seed=10)
    geom = GLGeometry(G, H, metric)
    xi = geom.project((0.3 * rand_like(G, g), 0.3 * rand_like(H, g)))
    Gp, Hp = geom.geodesic(xi, order=order, steps=8)
    for scale in (1e-2, 1.0, 1e2):
        A = random_gl((3,), h, g, scale=scale)
        geomA = GLGeometry(*act(G, H, A), metric)
        GA, HA = geomA.geodesic(act_tangent(*xi, A), order=order, steps=8)
        assert rel(GA @ HA.mT, Gp @ Hp.mT) < 1e-10


def test_order2_product_invariance_fails_for_an_adaptive_step():
    """The control: an element-wise (adaptive) perturbation is not equivariant."""
    G, H, g = random_block((), N, M, h, seed=11)
    A = random_gl((), h, g, scale=3.0)
    z = (rand_like(G, g), rand_like(H, g))
    Gp, Hp = G + 0.1 * z[0] * G.abs(), H + 0.1 * z[1] * H.abs()
    GA, HA = act(G, H, A)
    GAp, HAp = GA + 0.1 * z[0] * GA.abs(), HA + 0.1 * z[1] * HA.abs()
    assert rel(GAp @ HAp.mT - GA @ HA.mT, Gp @ Hp.mT - G @ H.mT) > 0.1


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_riemannian_grad_matches_dense(metric, eps):
    G, H, g = random_block((), N, M, h, seed=12)
    e = (rand_like(G, g), rand_like(H, g))
    gd = dense_metric(flat(G, H), N, M, h, metric, eps)
    expected = torch.linalg.solve(gd, flat(*e))
    got = flat(*GLGeometry(G, H, metric, eps).riemannian_grad(e))
    assert rel(got, expected) < 1e-12


@pytest.mark.parametrize("metric", METRICS)
def test_riemannian_grad_of_invariant_loss_is_horizontal(metric):
    """For a loss of G Hᵀ only, the Riemannian gradient is horizontal (no projection needed)."""
    G, H, g = random_block((), N, M, h, seed=13)
    T = torch.randn(N, M, generator=g, dtype=DT)
    Gr, Hr = G.clone().requires_grad_(), H.clone().requires_grad_()
    ((Gr @ Hr.T - T) ** 2).sum().backward()
    geom = GLGeometry(G, H, metric)
    r = geom.riemannian_grad((Gr.grad, Hr.grad))
    assert rel(flat(*geom.project(r)), flat(*r)) < 1e-11


@pytest.mark.parametrize("metric", METRICS)
def test_random_tangent_is_isotropic_in_the_metric(metric):
    """E[⟨a, ξ⟩²] = ⟨a, a⟩ for ξ ~ N(0, g⁻¹); 40000 samples: standard error ≈ 0.7 %."""
    G, H, g = random_block((), N, M, h, seed=14)
    geom = GLGeometry(G, H, metric)
    Gb, Hb = G.expand(40000, N, h), H.expand(40000, M, h)
    geom_b = GLGeometry(Gb, Hb, metric)
    xi = geom_b.random_tangent(g, scale=1.0, horizontal=False)
    for _ in range(3):
        a = (rand_like(G, g), rand_like(H, g))
        ab = (a[0].expand_as(Gb), a[1].expand_as(Hb))
        second_moment = float(geom_b.inner(ab, xi).square().mean())
        assert abs(second_moment / float(geom.norm_sq(a)) - 1) < 0.04  # > 5 standard errors
    proj = geom_b.random_tangent(g, scale=0.5)
    assert float(geom_b.horizontal_residual(proj).abs().max()) < 1e-10


def test_batched_equals_per_element():
    G, H, g = random_block((2, 3), N, M, h, seed=15)
    xi = (rand_like(G, g), rand_like(H, g))
    for metric in METRICS:
        geom = GLGeometry(G, H, metric)
        pb, gb = geom.project(xi), geom.geodesic(xi, order=2)
        for i in range(2):
            for j in range(3):
                single = GLGeometry(G[i, j], H[i, j], metric)
                x1 = (xi[0][i, j], xi[1][i, j])
                p1, g1 = single.project(x1), single.geodesic(x1, order=2)
                # Batched and single eigh take different LAPACK paths; the inv projection
                # amplifies their roundoff by about cond(M_G)·cond(M_H) (~1e3 here), so agreement
                # is to ~1e-13 relative, not to the last ulp (2.5e-12 seen on one CPU).
                assert torch.allclose(pb[0][i, j], p1[0], rtol=1e-11, atol=1e-12)
                assert torch.allclose(gb[1][i, j], g1[1], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("order", [2, "exact"])
def test_geodesic_is_differentiable_in_xi(order):
    G, H, g = random_block((2,), 3, 3, 2, seed=16)
    geom = GLGeometry(G, H, "mix")
    xG = (0.1 * rand_like(G, g)).requires_grad_()
    xH = (0.1 * rand_like(H, g)).requires_grad_()
    assert gradcheck(lambda a, b: geom.geodesic((a, b), order=order, steps=3), (xG, xH))


def test_float32_agrees_with_float64():
    G, H, g = random_block((2,), N, M, h, seed=17)
    xi = (0.1 * rand_like(G, g), 0.1 * rand_like(H, g))

    def endpoint(G, H, xi):
        geom = GLGeometry(G, H, "inv")
        return geom.geodesic(geom.project(xi), order=2)

    ref = endpoint(G, H, xi)
    f32 = [t.float() for t in (G, H, *xi)]
    got = endpoint(*f32[:2], tuple(f32[2:]))
    assert got[0].dtype == torch.float32
    assert rel(got[0].double(), ref[0]) < 1e-5  # float32 roundoff on O(10) condition numbers


def test_dense_vertical_basis_is_in_kernel_of_product_derivative():
    """Sanity of the reference itself: vertical vectors leave G Hᵀ unchanged to first order."""
    G, H, _ = random_block((), N, M, h, seed=18)
    V = vertical_basis(G, H)
    for k in range(V.shape[1]):
        dG = V[: N * h, k].reshape(N, h)
        dH = V[N * h :, k].reshape(M, h)
        assert float((dG @ H.T + G @ dH.T).abs().max()) < 1e-12


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_messages():
    G, H, _ = random_block((), N, M, h, seed=19)
    with pytest.raises(ValueError, match="share leading dims and h"):
        GLGeometry(G, torch.randn(M, h + 1, dtype=DT))
    with pytest.raises(ValueError, match="metric must be one of"):
        GLGeometry(G, H, metric="euclid")
    with pytest.raises(ValueError, match="eps must be"):
        GLGeometry(G, H, eps=-1.0)
    with pytest.raises(TypeError, match="floating dtype"):
        GLGeometry(G.long(), H)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        GLGeometry(G.numpy(), H)
    with pytest.raises(ValueError, match="order must be one of"):
        GLGeometry(G, H).geodesic((G, H), order=3)
    with pytest.raises(ValueError, match="xi_G must have the shape of G"):
        GLGeometry(G, H).project((H, H))
    with pytest.raises(ValueError, match="steps must be"):
        GLGeometry(G, H).geodesic((G, H), order="exact", steps=0)


def test_singular_gram_at_zero_eps_suggests_damping():
    G, H, _ = random_block((4,), N, M, h, seed=20)
    G = G.clone()
    G[2, :, 1] = 2.0 * G[2, :, 0]  # head 2: rank-deficient G
    with pytest.raises(ValueError, match=r"singular.*pass eps>0") as err:
        GLGeometry(G, H, name="layer.0[QK]")
    assert "layer.0[QK]" in str(err.value) and "(2,)" in str(err.value)
    geom = GLGeometry(G, H, eps=1e-3)  # damping makes it usable, without NaN
    xi = geom.project((G, H))
    assert all(bool(torch.isfinite(t).all()) for t in xi)


def test_float32_projection_of_ill_conditioned_block_stays_accurate():
    """Float32 inputs, float64 internals: re-projecting an (equivariantly pushed) horizontal
    vector at an ill-conditioned point changes it by float32 roundoff, not cond(M)² × roundoff
    (measured: 1.6e-6 with float64 internals, 0.14 with float32 internals on this block)."""
    G, H, g = random_block((4,), 33, 32, 32, seed=21)
    A = torch.eye(32, dtype=DT) + torch.randn(4, 32, 32, generator=g, dtype=DT) / 4
    xi = GLGeometry(G, H, "inv").project((rand_like(G, g), rand_like(H, g)))
    GA, HA = act(G, H, A)
    xA = act_tangent(*xi, A)
    geom32 = GLGeometry(GA.float(), HA.float(), "inv")
    pA = geom32.project(tuple(x.float() for x in xA))
    assert pA[0].dtype == torch.float32
    assert rel(flat(*pA).double(), flat(*xA)) < 1e-3


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("work_dtype", [None, torch.float32])
def test_sampling_spectra_are_made_on_first_use(metric, work_dtype):
    """The spectra of ``M_G``, ``M_H`` that ``random_tangent`` samples with are not held until
    it is called, and are then the eigendecompositions of the constructor's float64 Gram
    matrices bit for bit; the Sylvester denominators are kept as the eigenvalues ``d``."""
    g = torch.Generator().manual_seed(11)
    G = torch.randn(3, 12, 4, generator=g)
    H = torch.randn(3, 10, 4, generator=g)
    geom = GLGeometry(G, H, metric=metric, eps=0.0, execution=GLExecution(work_dtype=work_dtype))
    held = {k for k, v in vars(geom).items() if isinstance(v, (torch.Tensor, tuple))}
    assert not {"_sampling_spectra", "_sampler_pair", "_denom"} & held
    MG, MH = (gl_factors._gram(X.double(), 0.0) for X in (G, H))
    ref = (gl_factors._spd_funcs(MG), gl_factors._spd_funcs(MH))
    xi = geom.random_tangent(torch.Generator().manual_seed(0))
    assert xi[0].dtype == torch.float32
    assert "_sampling_spectra" in vars(geom)
    for got, want in zip(geom._gram_spectra(), ref, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
