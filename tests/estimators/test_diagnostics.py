"""Orbit-position and ascent diagnostics against direct float64 computations (issue 14)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators.diagnostics import (
    ascent_diagnostics,
    balance,
    budget_split,
    order2_displacement,
    summary_row,
)
from geosharp.estimators.orbit import (
    balanced_point,
    imbalance,
    log_scale,
    norm_excess,
    orbit_min_norm_sq,
)
from geosharp.estimators.perturbation import Perturbation
from geosharp.models.transformer import Block

DT = torch.float64


def _pair(seed: int, n: int = 7, m: int = 6, h: int = 3, heads: int = 4):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, n, h, generator=g, dtype=DT),
        torch.randn(heads, m, h, generator=g, dtype=DT),
    )


def test_imbalance_and_log_ratio_match_numpy():
    G, H = _pair(0)
    for b in range(G.shape[0]):
        g, h = G[b].numpy(), H[b].numpy()
        d = np.linalg.norm(g.T @ g - h.T @ h) / np.linalg.norm(g.T @ g + h.T @ h)
        assert float(imbalance(G, H)[b]) == pytest.approx(d, rel=1e-13)
        r = 0.25 * math.log((g**2).sum() / (h**2).sum())
        assert float(log_scale(G, H)[b]) == pytest.approx(r, rel=1e-13)
    assert torch.allclose(imbalance(G, G), torch.zeros(G.shape[0], dtype=DT))


def test_orbit_minimum_is_twice_the_nuclear_norm():
    G, H = _pair(1)
    nuclear = torch.linalg.svdvals(G @ H.mT).sum(-1)
    assert torch.allclose(orbit_min_norm_sq(G, H), 2 * nuclear, rtol=1e-12)


def _numerical_min(g: torch.Tensor, h: torch.Tensor) -> float:
    """min_A ‖G A⁻¹‖² + ‖H Aᵀ‖² by L-BFGS over A, from several starts (float64)."""
    best = math.inf
    for start in range(3):
        gen = torch.Generator().manual_seed(start)
        A = (
            torch.eye(g.shape[1], dtype=DT)
            + 0.3 * start * torch.randn(g.shape[1], g.shape[1], generator=gen, dtype=DT)
        ).requires_grad_(True)
        opt = torch.optim.LBFGS(
            [A],
            lr=1,
            max_iter=500,
            tolerance_grad=1e-14,
            tolerance_change=1e-16,
            line_search_fn="strong_wolfe",
        )

        def closure(A=A, opt=opt):
            opt.zero_grad()
            f = torch.linalg.solve(A, g, left=False).square().sum() + (h @ A.mT).square().sum()
            f.backward()
            return f

        for _ in range(5):
            opt.step(closure)
        with torch.no_grad():
            f = torch.linalg.solve(A, g, left=False).square().sum() + (h @ A.mT).square().sum()
        best = min(best, float(f))
    return best


def test_orbit_minimum_matches_numerical_minimization():
    G, H = _pair(2, heads=3)
    H = H * torch.tensor([0.2, 1.0, 5.0], dtype=DT)[:, None, None]  # unbalanced heads
    closed = orbit_min_norm_sq(G, H)
    for b in range(G.shape[0]):
        num = _numerical_min(G[b], H[b])
        assert num >= float(closed[b]) * (1 - 1e-10)  # nothing beats the closed form
        assert num == pytest.approx(float(closed[b]), rel=1e-7)


def test_balanced_point_is_balanced_minimal_and_on_the_orbit():
    G, H = _pair(3)
    Gs, Hs, _ = balanced_point(G, H)
    assert torch.allclose(Gs @ Hs.mT, G @ H.mT, atol=1e-11)  # same function
    assert torch.allclose(Gs.mT @ Gs, Hs.mT @ Hs, atol=1e-10)  # balanced
    total = Gs.square().sum((-2, -1)) + Hs.square().sum((-2, -1))
    assert torch.allclose(total, orbit_min_norm_sq(G, H), rtol=1e-11)
    assert torch.allclose(norm_excess(Gs, Hs), torch.zeros(G.shape[0], dtype=DT), atol=1e-11)
    assert torch.allclose(imbalance(Gs, Hs), torch.zeros(G.shape[0], dtype=DT), atol=1e-10)
    assert (norm_excess(G, H) > 0).all()


def test_scalar_rescaling_of_a_balanced_pair():
    G, H = _pair(4)
    Gs, Hs, _ = balanced_point(G, H)
    for s in (0.25, 0.5, 2.0, 4.0):
        assert torch.allclose(
            norm_excess(s * Gs, Hs / s),
            torch.full((4,), (s**2 + s**-2) / 2 - 1, dtype=DT),
            rtol=1e-10,
        )
        assert torch.allclose(
            log_scale(s * Gs, Hs / s), torch.full((4,), math.log(s), dtype=DT), atol=1e-11
        )
        want = (s**2 - s**-2) / (s**2 + s**-2)  # ‖s²M − M/s²‖ / ‖s²M + M/s²‖, M = GsᵀGs
        assert torch.allclose(
            imbalance(s * Gs, Hs / s), torch.full((4,), abs(want), dtype=DT), rtol=1e-10
        )


def _block_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Block(dim=8, num_heads=2, mlp_dim=12).to(DT).eval()


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(3, 5, 8, generator=g, dtype=DT), torch.randn(3, 5, 8, generator=g, dtype=DT))
        for _ in range(2)
    ]


def test_model_balance_per_head_matches_the_weights():
    model = _block_model()
    a = model.attn
    h = a.head_dim
    bal = balance(model, key_bias="quotient")
    got = {(x.block.split("[")[1].rstrip("]"), x.head): x for x in bal.heads}
    assert len(got) == 2 * a.num_heads
    for i in range(a.num_heads):
        r = slice(i * h, (i + 1) * h)
        pairs = {
            "QK": (torch.cat([a.q.weight[r], a.q.bias[r, None]], 1).T, a.k.weight[r].T),
            "VO": (torch.cat([a.v.weight[r], a.v.bias[r, None]], 1).T, a.o.weight[:, r]),
        }
        for kind, (g, hh) in pairs.items():
            g, hh = g.detach().numpy(), hh.detach().numpy()
            x = got[(kind, i)]
            d = np.linalg.norm(g.T @ g - hh.T @ hh) / np.linalg.norm(g.T @ g + hh.T @ hh)
            assert x.imbalance == pytest.approx(d, rel=1e-12)
            nuc = np.linalg.svd(g @ hh.T, compute_uv=False).sum()
            assert x.min_norm_sq == pytest.approx(2 * nuc, rel=1e-12)
            assert x.excess == pytest.approx(
                ((g**2).sum() + (hh**2).sum()) / (2 * nuc) - 1, rel=1e-10
            )
    agg = bal.aggregate("QK")
    qk = [x for x in bal.heads if x.category == "QK"]
    assert agg["imbalance"] == pytest.approx(
        math.sqrt(sum(x.diff_sq for x in qk) / sum(x.sum_sq for x in qk))
    )
    row = summary_row(bal)
    assert {"imbalance_QK", "imbalance_VO", "excess_all", "log_ratio_VO"} <= set(row)


def test_init_scaling_moves_only_the_orbit_position():
    """(sG, H/s) on every head: same outputs, log ratio + log s, imbalance towards 1."""
    model = _block_model()
    x = _data()[0][0]
    before = balance(model)
    y0 = model(x)
    s = 3.0
    with torch.no_grad():
        a = model.attn
        a.q.weight.mul_(s)
        a.q.bias.mul_(s)
        a.k.weight.div_(s)
        a.k.bias.div_(s)
    assert torch.allclose(model(x), y0, atol=1e-12)
    after = balance(model)
    for b0, b1 in zip(before.heads, after.heads, strict=True):
        if b0.category == "QK":
            assert b1.log_scale == pytest.approx(b0.log_scale + math.log(s), abs=1e-12)
            assert b1.min_norm_sq == pytest.approx(b0.min_norm_sq, rel=1e-11)  # orbit invariant
            assert b1.imbalance > b0.imbalance
        else:
            assert b1.imbalance == pytest.approx(b0.imbalance, rel=1e-12)


MEASURES = [
    {"measure": "adaptive"},
    {"measure": "geodesic", "metric": "inv", "order": 2},
    {"measure": "geodesic", "metric": "mix", "order": 2},
    {"measure": "geodesic", "metric": "inv", "order": 2, "perturb": "blocks"},
    {"measure": "adaptive", "perturb": "blocks"},
]


@pytest.mark.parametrize("kw", MEASURES, ids=lambda k: "-".join(map(str, k.values())))
def test_ascent_reproduces_sharpness_and_splits_the_whole_budget(kw):
    model = _block_model()
    batches = _data()
    loss = nn.functional.mse_loss
    ref = gs.sharpness(model, loss, batches, rho=0.05, steps=6, progress=False, **kw)
    diag = ascent_diagnostics(model, loss, batches, rho=0.05, steps=6, **kw)
    assert diag.value == ref.value  # the same ascent, bit for bit
    assert sum(diag.budget.values()) == pytest.approx(1.0, rel=1e-12)
    assert 0 < diag.radius_used <= 1 + 1e-9
    if kw.get("perturb") == "blocks":
        assert diag.budget["rest"] == 0.0
    if kw["measure"] == "geodesic" and kw.get("perturb", "all") == "all":
        assert diag.budget["b_k"] == 0.0  # held fixed: spends nothing
        assert diag.budget["rest"] > 0
    if kw["measure"] == "adaptive" and kw.get("perturb", "all") == "all":
        # adaptive sharpness could move the key bias, but the ascent from 0 follows the
        # gradient, which vanishes there (the softmax ignores b_k): nothing but rounding
        assert diag.budget["b_k"] < 1e-10


def _space_theta(model):
    space = gs.find_symmetries(model, key_bias="quotient")
    return space, space.flatten(dict(model.named_parameters())).detach()


def test_budget_split_adaptive_matches_coordinates():
    model = _block_model()
    space, theta = _space_theta(model)
    pert = Perturbation(space, theta, measure="adaptive")
    xi = pert.random(torch.Generator().manual_seed(0), 0.1)
    split = budget_split(pert, xi)
    flat = torch.cat([t.reshape(-1) for t in xi[0]])  # one component per parameter, θ order
    c = torch.where(theta != 0, flat / theta, 0.0).square()  # zero weights are frozen
    for blk in space.blocks:
        cat = {"QK": "QK", "VO": "VO", "b_k": "b_k"}[blk.kind]
        assert split[cat] == pytest.approx(
            sum(float(c[b.positions()].sum()) for b in space.blocks if b.kind == blk.kind),
            rel=1e-12,
        )
    assert split["rest"] == pytest.approx(float(c[space.rest_index].sum()), rel=1e-12)
    assert sum(split.values()) == pytest.approx(float(pert.norm_sq(xi)), rel=1e-12)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_budget_split_and_order2_of_gl_blocks_match_the_formulas(metric):
    model = _block_model()
    space, theta = _space_theta(model)
    pert = Perturbation(space, theta, measure="geodesic", metric=metric, order=2)
    xi = pert.project(pert.random(torch.Generator().manual_seed(1), 0.05))
    split = budget_split(pert, xi)
    # ξ and the order-2 correction as flat vectors in θ coordinates
    line = Perturbation(space, theta, measure="geodesic", metric=metric, order=1).endpoint(xi)
    flat_xi, corr = line - theta, pert.endpoint(xi) - line
    by_kind = {"QK": 0.0, "VO": 0.0}
    disp_sq, blocks_sq = 0.0, 0.0
    for blk in space.gl_blocks:
        G, H = (t.numpy() for t in blk.gather(theta))
        xG, xH = (t.numpy() for t in blk.gather(flat_xi))
        cG, cH = (t.numpy() for t in blk.gather(corr))
        for b in range(G.shape[0]):
            g, h, xg, xh = G[b], H[b], xG[b], xH[b]
            MG, MH = g.T @ g, h.T @ h
            if metric == "inv":
                WG, WH = np.linalg.inv(MG), np.linalg.inv(MH)
                gG = -xg @ WG @ (xg.T @ g + g.T @ xg) + g @ WG @ xg.T @ xg
                gH = -xh @ WH @ (xh.T @ h + h.T @ xh) + h @ WH @ xh.T @ xh
            else:
                WG, WH = MH, MG
                gG = xg @ (xh.T @ h + h.T @ xh) @ np.linalg.inv(MH) - g @ xh.T @ xh @ np.linalg.inv(
                    MH
                )
                gH = xh @ (xg.T @ g + g.T @ xg) @ np.linalg.inv(MG) - h @ xg.T @ xg @ np.linalg.inv(
                    MG
                )

            def nsq(a, c, WG=WG, WH=WH):
                return np.trace(WG @ a.T @ a) + np.trace(WH @ c.T @ c)

            by_kind[blk.kind] += nsq(xg, xh)
            blocks_sq += nsq(xg, xh)
            disp_sq += nsq(0.5 * gG, 0.5 * gH)
            # endpoint(order 2) − endpoint(order 1) = −½Γ(ξ, ξ) (SPEC §4.6)
            assert np.allclose(cG[b], -0.5 * gG, atol=1e-13)
            assert np.allclose(cH[b], -0.5 * gH, atol=1e-13)
    for kind, v in by_kind.items():
        assert split[kind] == pytest.approx(v, rel=1e-10)
    w, x = theta[space.rest_index], flat_xi[space.rest_index]
    c_rest = torch.where(w != 0, x / w, 0.0).square().sum()
    assert split["rest"] == pytest.approx(float(c_rest), rel=1e-10)
    d = order2_displacement(pert, xi)
    assert d["displacement"] == pytest.approx(math.sqrt(disp_sq), rel=1e-10)
    assert d["norm_blocks"] == pytest.approx(math.sqrt(blocks_sq), rel=1e-10)
    assert d["relative"] == pytest.approx(math.sqrt(disp_sq) / pert.norm(xi), rel=1e-10)
    # ½Γ is quadratic: doubling ξ doubles the relative displacement
    d2 = order2_displacement(pert, [tuple(2 * t for t in x) for x in xi])
    assert d2["relative_blocks"] == pytest.approx(2 * d["relative_blocks"], rel=1e-10)
    # the order-1 endpoint does not move off the line
    p1 = Perturbation(space, theta, measure="geodesic", metric=metric, order=1)
    assert order2_displacement(p1, xi)["displacement"] == 0.0
