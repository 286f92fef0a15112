"""One contract over every symmetry block and its geometry (the geoopt habit).

Every block kind gets the same battery, in float64, on a point built from random weights and an
invariant function ``f`` of its factors written out independently of the library (the "network"):

* random vertical vectors are symmetry directions: ``f(w + tV) − f(w) = O(t²)``;
* the horizontal projection is idempotent and metric-orthogonal to the vertical space;
* the metric is invariant under the group: ``⟨g_*ξ, g_*η⟩_{g·w} = ⟨ξ, η⟩_w``;
* the order-2 endpoint agrees with an integrated geodesic to ``O(‖ξ‖³)``;
* ``f`` is invariant under random group elements at scales 1e-2 … 1e2, and so is ``f`` at the
  order-2 endpoint of a horizontal velocity pushed forward by the group;
* what callers ask instead of the class holds: ``gl_pairs``/``whole_gl`` blocks are
  ``(G, H)`` pairs whose orbit's least norm is GL(h)'s closed form, ``shard_layout`` is one of
  its values, and a geometry's ``relative_speed`` (where it has one) is invariant under the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from torch.func import jvp

from geosharp.estimators.orbit import orbit_min_norm_sq
from geosharp.symmetry import (
    DiagonalPair,
    GLBlock,
    LoRABlock,
    RotaryBlock,
    RotarySpec,
    SymmetryBlock,
    TranslationBlock,
)

DT = torch.float64
SCALES = (1e-2, 1.0, 1e2)


@dataclass
class Contract:
    name: str
    block: SymmetryBlock
    theta: Tensor
    #: the invariant "network": a scalar function of the block's factors
    f: Callable[[tuple[Tensor, ...]], Tensor]
    #: whether geodesics are straight lines of nothing (the quotient is a point)
    trivial: bool = False


def _gl_block(cls, heads, n, m, h, **kw):
    g = torch.arange(heads * n * h).view(heads, n, h)
    hh = torch.arange(heads * m * h).view(heads, m, h) + g.numel()
    return cls("blk", "QK", "", heads, h, g, hh, **kw), g.numel() + hh.numel()


def _rotations(spec: RotarySpec, h: int, positions: range) -> list[Tensor]:
    """R(δ): rotation by δ·θ_i on every plane (distinct θ_i), identity on the other features."""
    out = []
    for d in positions:
        R = torch.eye(h, dtype=DT)
        for i, (a, b) in enumerate(spec.planes()):
            t = torch.tensor(d * 10000.0 ** (-2.0 * i / spec.dims), dtype=DT)
            R[a, a], R[b, b], R[a, b], R[b, a] = t.cos(), t.cos(), -t.sin(), t.sin()
        out.append(R)
    return out


def gl_case(name="GL(h)", cls=GLBlock) -> Contract:
    block, size = _gl_block(cls, 3, 7, 6, 4)
    theta = torch.randn(size, generator=torch.Generator().manual_seed(0), dtype=DT)
    return Contract(name, block, theta, lambda p: (p[0] @ p[1].mT).sin().sum())


def rotary_case(spec: RotarySpec) -> Contract:
    block, size = _gl_block(RotaryBlock, 2, 7, 9, 6, rotary=spec)
    theta = torch.randn(size, generator=torch.Generator().manual_seed(1), dtype=DT)
    Rs = _rotations(spec, 6, range(-3, 4))

    def f(p):  # scores x_m G R(m − n) Hᵀ x_nᵀ for every offset
        return sum((p[0] @ R @ p[1].mT).sin().sum() for R in Rs)

    return Contract(f"rotary {spec.label(6)}", block, theta, f)


def pair_case() -> Contract:
    block = DiagonalPair("pair", "", torch.arange(5), torch.arange(5, 10))
    theta = torch.randn(10, generator=torch.Generator().manual_seed(2), dtype=DT)
    return Contract("diagonal pair", block, theta, lambda p: (p[0] * p[1]).sin().sum())


def translation_case() -> Contract:
    block = TranslationBlock("b_k", "", 3, 4, torch.arange(12).view(3, 1, 4))
    theta = torch.randn(12, generator=torch.Generator().manual_seed(3), dtype=DT)
    g = torch.Generator().manual_seed(4)
    Q, K, W = (torch.randn(3, 5, 4, generator=g, dtype=DT) for _ in range(3))

    def f(p):  # attention of queries Q on keys K + b_k, values W
        att = torch.softmax(Q @ (K + p[0]).mT, dim=-1)
        return (att @ W).sin().sum()

    return Contract("key-bias translation", block, theta, f, trivial=True)


CONTRACTS = [
    gl_case(),
    gl_case("LoRA GL(r)", LoRABlock),
    rotary_case(RotarySpec(6, "half")),
    rotary_case(RotarySpec(6, "interleaved")),
    rotary_case(RotarySpec(2, "half")),  # partial rotary: (ℂ*)^1 × GL(4)
    rotary_case(RotarySpec(4, "interleaved")),
    pair_case(),
    translation_case(),
]
IDS = [c.name for c in CONTRACTS]
METRICS = ("inv", "mix")


def geometry(c: Contract, metric: str, theta: Tensor | None = None):
    theta = c.theta if theta is None else theta
    point = c.block.gather(theta)
    return type(c.block).geometry([c.block], point, metric=metric, eps=0.0), point


def rand_like(parts, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(p.shape, generator=g, dtype=DT) for p in parts)


def push(block, point, el, xi):
    """The push-forward ``g_*ξ`` of a tangent vector by the action of ``el`` (a JVP)."""
    return jvp(lambda *p: block.act(p, el), point, xi)[1]


def inner(geom, a, b) -> float:
    return float(geom.inner(a, b).sum())


def max_diff(a, b) -> float:
    """The largest entry-wise difference of two tangents."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_vertical_vectors_are_symmetry_directions(c):
    point = c.block.gather(c.theta)
    V = c.block.random_vertical(point, torch.Generator().manual_seed(5))
    f0 = c.f(point)
    # f(w + tV) − f(w) = O(t²): the difference quotient falls tenfold with t (or is roundoff,
    # for the exact translation symmetry); along a non-vertical direction it would stay O(1)
    ratios = []
    for t in (1e-3, 1e-4):
        moved = tuple(p + t * v for p, v in zip(point, V, strict=True))
        ratios.append(float((c.f(moved) - f0).abs()) / t)
    assert ratios[1] < 0.12 * ratios[0] or ratios[1] < 1e-9, ratios
    if not c.trivial:  # ... while a generic direction changes f at first order
        W = rand_like(point, 18)
        moved = tuple(p + 1e-4 * w for p, w in zip(point, W, strict=True))
        assert float((c.f(moved) - f0).abs()) / 1e-4 > 1e2 * ratios[1]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_projection_is_idempotent_and_orthogonal_to_the_vertical_space(c, metric):
    geom, point = geometry(c, metric)
    xi = rand_like(point, 6)
    p1 = geom.project(xi)
    p2 = geom.project(p1)
    scale = max(float(t.abs().max()) for t in xi)
    assert max_diff(p1, p2) < 1e-12 * scale
    for seed in (7, 8, 9):
        V = c.block.random_vertical(point, torch.Generator().manual_seed(seed))
        norm = (abs(inner(geom, p1, p1)) * abs(inner(geom, V, V))) ** 0.5
        assert abs(inner(geom, p1, V)) <= 1e-11 * max(norm, 1e-300)
    # the projection only removes vertical parts: ξ − Pξ is vertical (orthogonal to Pη)
    eta = geom.project(rand_like(point, 10))
    resid = tuple(a - b for a, b in zip(xi, p1, strict=True))
    assert abs(inner(geom, resid, eta)) <= 1e-10 * (1 + abs(inner(geom, xi, xi)))


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_horizontal_grad_is_the_projected_riemannian_gradient(c, metric):
    """The ascent direction ``P(g⁻¹ e)``, fused or not, is the same vector (float64)."""
    geom, point = geometry(c, metric)
    e = rand_like(point, 11)
    fused = geom.horizontal_grad(e)
    ref = geom.project(geom.riemannian_grad(e))
    scale = max(float(t.abs().max()) for t in ref)
    for a, b in zip(fused, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-13 * scale


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_ascent_direction_reads_its_norms_off_the_gradient(c, metric):
    """At eps = 0 every projection is metric-orthogonal, so ``‖d‖² = e·d`` and ``⟨ξ, d⟩ = e·ξ``
    for horizontal ξ (``d = P g⁻¹e``): what Auto-PGD uses instead of metric norms (float64)."""
    from geosharp.geometry.base import euclidean_pairing

    geom, point = geometry(c, metric)
    assert geom.orthogonal_projection
    e = rand_like(point, 11)
    d, dd = geom.ascent_direction(e)
    ref = geom.horizontal_grad(e)
    scale = max(float(t.abs().max()) for t in ref)
    assert max_diff(d, ref) <= 1e-13 * scale
    norm = inner(geom, d, d)
    assert abs(float(dd) - norm) <= 1e-11 * abs(norm)
    xi = geom.project(rand_like(point, 12))
    bound = (abs(inner(geom, xi, xi)) * abs(norm)) ** 0.5
    assert abs(float(euclidean_pairing(e, xi)) - inner(geom, xi, d)) <= 1e-10 * bound


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_metric_is_invariant_under_the_group(c, metric):
    geom, point = geometry(c, metric)
    xi, eta = rand_like(point, 11), rand_like(point, 12)
    for scale in SCALES:
        el = c.block.random_element(torch.Generator().manual_seed(13), scale, 1e3)
        moved = c.block.act(point, el)
        xi_g, eta_g = push(c.block, point, el, xi), push(c.block, point, el, eta)
        geom_g = type(c.block).geometry([c.block], moved, metric=metric, eps=0.0)
        ref = inner(geom, xi, eta)
        got = inner(geom_g, xi_g, eta_g)
        assert abs(got - ref) <= 1e-9 * (abs(ref) + inner(geom, xi, xi)), (scale, got, ref)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_order2_endpoint_matches_the_integrated_geodesic(c, metric):
    geom, point = geometry(c, metric)
    xi = geom.project(rand_like(point, 14))
    norm = inner(geom, xi, xi) ** 0.5 if not c.trivial else 1.0
    errors = []
    for s in (0.1, 0.01):
        v = tuple(s / norm * t for t in xi)
        e2 = geom.geodesic(v, order=2)
        ex = geom.geodesic(v, order="exact", steps=200)
        errors.append(max(float((a - b).abs().max()) for a, b in zip(e2, ex, strict=True)))
    if c.trivial:  # the quotient is a point: both stay at the base point
        assert errors == [0.0, 0.0]
        return
    # error O(‖ξ‖³): a tenth of the velocity gives a thousandth of the error
    assert errors[1] < 1e-5 and errors[0] / max(errors[1], 1e-300) > 300, errors


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_function_invariant_under_random_group_elements(c, scale):
    point = c.block.gather(c.theta)
    el = c.block.random_element(torch.Generator().manual_seed(15), scale, 1e3)
    moved = c.block.act(point, el)
    f0 = c.f(point)
    assert float((c.f(moved) - f0).abs()) <= 1e-9 * (1 + float(f0.abs()))
    assert max(float((a - b).abs().max()) for a, b in zip(moved, point, strict=True)) > 1e-3


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_endpoint_of_pushed_forward_velocity_gives_the_same_function(c, metric):
    """The perturbed function is a property of the function, not of the weights (SPEC §4)."""
    geom, point = geometry(c, metric)
    xi = geom.project(rand_like(point, 16, scale=0.05))
    f_end = c.f(geom.geodesic(xi, order=2))
    for scale in SCALES:
        el = c.block.random_element(torch.Generator().manual_seed(17), scale, 1e3)
        moved = c.block.act(point, el)
        xi_g = push(c.block, point, el, xi)
        geom_g = type(c.block).geometry([c.block], moved, metric=metric, eps=0.0)
        f_g = c.f(geom_g.geodesic(xi_g, order=2))
        assert float((f_g - f_end).abs()) <= 1e-9 * (1 + float(f_end.abs())), scale


@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_what_callers_ask_instead_of_the_class(c):
    block = c.block
    assert block.shard_layout in ("rows", "coordinates", None)
    if block.shard_layout == "rows":  # (heads, rows, h): whole rows of h coordinates
        assert all(len(s) == 3 for s in block.index_shapes)
    assert block.gl_pairs or not block.whole_gl
    if not block.gl_pairs:
        return
    G, H = block.gather(c.theta)
    assert G.dim() == H.dim() == 3 and G.shape[-1] == H.shape[-1]
    if not block.whole_gl:
        return
    # GL(h)'s closed form is the least norm on the orbit: no element goes below it (relative
    # tolerance 1e-9: float64 eigenvalues of h × h products), and the orbit reaches it
    least = orbit_min_norm_sq(G, H)
    for scale in SCALES:
        el = block.random_element(torch.Generator().manual_seed(18), scale, 1e3)
        mG, mH = block.act((G, H), el)
        norm = mG.square().sum((-2, -1)) + mH.square().sum((-2, -1))
        assert bool((least <= norm * (1 + 1e-9)).all()), scale
    assert bool((least > 0).all())


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("c", CONTRACTS, ids=IDS)
def test_relative_speed_is_invariant_under_the_group(c, metric):
    geom, point = geometry(c, metric)
    xi = geom.project(rand_like(point, 19))
    kappa = geom.relative_speed(xi)
    if kappa is None:  # no heads, no scale of their own
        return
    assert kappa.shape == (c.block.count,) and bool((kappa > 0).all())
    for scale in SCALES:
        el = c.block.random_element(torch.Generator().manual_seed(20), scale, 1e3)
        moved = c.block.act(point, el)
        geom_g = type(c.block).geometry([c.block], moved, metric=metric, eps=0.0)
        got = geom_g.relative_speed(push(c.block, point, el, xi))
        # GL(h)-invariant at eps = 0; seen within 1e-13 relative (float64 Gram inverses of
        # elements with condition ≤ 1e3), 1e-10 leaves room for other BLAS
        assert torch.allclose(got, kappa, rtol=1e-10, atol=0.0), (scale, got, kappa)
