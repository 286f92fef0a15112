"""gs.sharpness against closed forms, invariance and hand-checkable cases (SPEC §2, §5, §6)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators import checkpoints
from geosharp.geometry.diagonal import closed_form_sharpness_inv, closed_form_sharpness_mix
from geosharp.models import DiagonalNet, VisionTransformer

DT = torch.float64


# -- a trained small transformer (module-scoped: trained once) -------------------------------------
@pytest.fixture(scope="module")
def trained_vit():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=16, depth=2, num_heads=2
    ).to(DT)
    x = torch.randn(64, 1, 8, 8, generator=g, dtype=DT)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, :, :4].mean((1, 2, 3)) > 0.2).long()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    batches = [(x[:32], y[:32]), (x[32:], y[32:])]
    return model, batches


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_sharpness_is_invariant_under_reparametrization(trained_vit, metric):
    model, batches = trained_vit
    kw = dict(measure="geodesic", metric=metric, order=2, rho=0.05, steps=10, eps=0.0, seed=0)
    ref = gs.sharpness(model, nn.functional.cross_entropy, batches, **kw)
    assert ref.value > 1e-4  # a real rise, not a trivially invariant zero
    for a in (1e-2, 1e-1, 1.0, 1e1, 1e2):
        rep = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=a)
        res = gs.sharpness(rep, nn.functional.cross_entropy, batches, **kw)
        assert abs(res.value - ref.value) <= 1e-6 * ref.value, (a, res.value, ref.value)


def test_adaptive_sharpness_is_not_invariant(trained_vit):
    model, batches = trained_vit
    kw = dict(measure="adaptive", rho=0.05, steps=10)
    ref = gs.sharpness(model, nn.functional.cross_entropy, batches, **kw)
    changes = []
    for a in (1e-2, 1e-1, 1.0, 1e1, 1e2):
        rep = gs.reparametrize(model, generator=torch.Generator().manual_seed(7), scale=a)
        res = gs.sharpness(rep, nn.functional.cross_entropy, batches, **kw)
        changes.append(abs(res.value / ref.value - 1))
    assert max(changes) > 0.05, changes


def test_order1_with_adaptive_metric_equals_adaptive_l2(trained_vit):
    """SPEC §5 / paper App. F: geodesic order 1 + element-wise metric everywhere = adaptive ℓ2."""
    model, batches = trained_vit
    kw = dict(rho=0.05, steps=10, seed=3)
    ada = gs.sharpness(model, nn.functional.cross_entropy, batches, measure="adaptive", **kw)
    geo = gs.sharpness(
        model,
        nn.functional.cross_entropy,
        batches,
        measure="geodesic",
        metric="adaptive",
        order=1,
        **kw,
    )
    # Same iterates, summed in a different order: float64 roundoff only.
    assert abs(geo.value - ada.value) <= 1e-9 * abs(ada.value)
    for t1, t2 in zip(geo.traces, ada.traces, strict=True):
        np.testing.assert_allclose(t1, t2, rtol=1e-9)


def test_one_forward_and_one_backward_per_step(trained_vit):
    model, batches = trained_vit
    res = gs.sharpness(model, nn.functional.cross_entropy, batches, rho=0.01, steps=7)
    # Per batch: the clean loss comes from the first gradient evaluation, then 7 steps, the last
    # evaluated by a forward pass only.
    assert (res.n_forward, res.n_backward) == (2 * 8, 2 * 7)
    assert all(len(t) == 8 for t in res.traces)


# -- diagonal networks: Auto-PGD approaches the closed form of SPEC §5 -----------------------------
def _diagonal_problem(d=6, seed=0):
    rng = np.random.default_rng(seed)
    X = np.linalg.qr(rng.standard_normal((3 * d, d)))[0]  # XᵀX = I
    beta_star = np.zeros(d)
    beta_star[:2] = [1.0, -0.7]
    y = X @ beta_star + 0.05 * rng.standard_normal(3 * d)
    net = DiagonalNet(d).to(DT)
    with torch.no_grad():
        net.u.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, d)))
        net.v.copy_(torch.from_numpy(rng.uniform(-1.0, 1.0, d)))
    beta = (net.u * net.v).detach().numpy()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    return net, [(Xt, yt)], beta, X.T @ y


def _sq_loss(pred, y):
    return ((pred - y) ** 2).sum()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_diagonal_worst_case_matches_closed_form(metric):
    net, batches, beta, beta_star = _diagonal_problem()
    closed = {"inv": closed_form_sharpness_inv, "mix": closed_form_sharpness_mix}[metric]
    for rho in (1e-3, 1e-2):
        res = gs.sharpness(
            net, _sq_loss, batches, measure="geodesic", metric=metric, order="exact", rho=rho
        )
        expected = closed(beta, beta_star, rho)
        # Auto-PGD from 0 on this smooth problem: measured agreement 1e-13 to 2e-13 relative.
        assert res.value <= expected * (1 + 1e-9)  # never above the true maximum
        assert res.value >= expected * (1 - 1e-8), (rho, res.value, expected)


# -- a hand-checkable case: at a minimum of a quadratic, worst case = ½ρ²λ_max ---------------------
def _least_squares_at_minimum(seed=1):
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 2, bias=False).to(DT)
    X = torch.randn(40, 4, generator=g, dtype=DT) * torch.tensor([3.0, 1.0, 0.5, 0.2], dtype=DT)
    Y = torch.randn(40, 2, generator=g, dtype=DT)
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(X, Y).solution.T)
    loss = lambda out, y: 0.5 * ((out - y) ** 2).sum()  # noqa: E731
    # Hessian of ½‖X Wᵀ − Y‖² w.r.t. row-major vec(W): I₂ ⊗ XᵀX.
    H = torch.kron(torch.eye(2, dtype=DT), X.T @ X)
    return model, loss, [(X, Y)], H


def test_euclidean_worst_case_is_half_rho_squared_lambda_max():
    model, loss, batches, H = _least_squares_at_minimum()
    rho = 0.1
    expected = 0.5 * rho**2 * float(torch.linalg.eigvalsh(H)[-1])
    res = gs.sharpness(
        model, loss, batches, measure="euclidean", rho=rho, steps=40, random_init=True, seed=0
    )
    # Gradient ascent from a random start = power iteration on H; eigengap 9/1: converged.
    assert math.isclose(res.value, expected, rel_tol=1e-6), (res.value, expected)


def test_adaptive_worst_case_is_half_rho_squared_lambda_max_of_scaled_hessian():
    model, loss, batches, H = _least_squares_at_minimum()
    rho = 0.1
    D = torch.diag(model.weight.detach().reshape(-1).abs())
    expected = 0.5 * rho**2 * float(torch.linalg.eigvalsh(D @ H @ D)[-1])
    res = gs.sharpness(
        model, loss, batches, measure="adaptive", rho=rho, steps=60, random_init=True, seed=0
    )
    assert math.isclose(res.value, expected, rel_tol=1e-4), (res.value, expected)


def test_average_case_matches_half_rho_squared_trace():
    """E[½δᵀHδ] = ½ρ² tr(H) for δ ~ N(0, ρ²I); 4000 samples → ~2 % standard error."""
    model, loss, batches, H = _least_squares_at_minimum()
    rho = 0.01
    res = gs.sharpness(
        model, loss, batches, measure="euclidean", kind="average", rho=rho, samples=4000
    )
    expected = 0.5 * rho**2 * float(torch.trace(H))
    assert abs(res.value / expected - 1) < 0.08


def test_adaptive_linf_on_a_linear_loss_is_exact():
    """L(w) = cᵀw: the max over |δ_i| ≤ ρ|w_i| is ρ Σ|c_i w_i|, reached by one sign step."""
    model = nn.Linear(5, 1, bias=False).to(DT)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0, 0.0, 0.5, 3.0]], dtype=DT))
    c = torch.tensor([[0.3, 0.1, -4.0, -1.0, 2.0]], dtype=DT)
    loss = lambda out, y: out.sum()  # noqa: E731
    res = gs.sharpness(model, loss, [(c, None)], measure="adaptive", norm="linf", rho=0.1)
    expected = 0.1 * float((c * model.weight.detach()).abs().sum())
    assert math.isclose(res.value, expected, rel_tol=1e-12)


def test_checkpoints_match_spec():
    assert checkpoints(20) == [5, 9, 12, 15, 16, 18, 19]


# -- safety: weights bit-identical, mode restored, errors ------------------------------------------
def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weights_bit_identical_and_mode_restored_even_on_exception(trained_vit):
    model, batches = trained_vit
    before = _snapshot(model)
    model.train()
    for measure in ("geodesic", "adaptive", "euclidean"):
        gs.sharpness(model, nn.functional.cross_entropy, batches, measure=measure, steps=3)
    calls = {"n": 0}

    def exploding(out, y):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="boom"):
        gs.sharpness(model, exploding, batches, steps=5)
    assert model.training
    after = _snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_frozen_parameters_are_excluded_and_reported(trained_vit):
    model, batches = trained_vit
    model.head.weight.requires_grad_(False)
    try:
        res = gs.sharpness(model, nn.functional.cross_entropy, batches, steps=2)
    finally:
        model.head.weight.requires_grad_(True)
    assert "head.weight" in res.excluded


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"rho": 0.0}, ValueError, "rho must be"),
        ({"rho": -1.0}, ValueError, "rho must be"),
        ({"measure": "sam"}, ValueError, "measure must be one of"),
        ({"kind": "best"}, ValueError, "kind must be one of"),
        ({"metric": "euclid"}, ValueError, "metric must be one of"),
        ({"order": 3}, ValueError, "order must be one of"),
        ({"norm": "linf"}, ValueError, "norm='linf' is defined for"),
        ({"steps": 0}, ValueError, "steps must be"),
    ],
)
def test_bad_arguments(trained_vit, kwargs, exc, match):
    model, batches = trained_vit
    with pytest.raises(exc, match=match):
        gs.sharpness(model, nn.functional.cross_entropy, batches, **kwargs)


def test_empty_batches_and_nonfinite_clean_loss(trained_vit):
    model, batches = trained_vit
    with pytest.raises(ValueError, match="batches is empty"):
        gs.sharpness(model, nn.functional.cross_entropy, [])
    nan_loss = lambda out, y: out.sum() * float("nan")  # noqa: E731
    with pytest.raises(ValueError, match="clean loss of batch 0 is nan"):
        gs.sharpness(model, nan_loss, batches)
    with pytest.raises(TypeError, match="scalar tensor"):
        gs.sharpness(model, lambda out, y: out, batches)


def test_data_are_moved_to_the_model_device_and_dtype_kept(trained_vit):
    model, batches = trained_vit
    x, y = batches[0]
    res = gs.sharpness(model, nn.functional.cross_entropy, [({"images": x}, y)], steps=2)
    assert res.settings["device"] == "cpu" and res.settings["dtype"] == "torch.float64"


def test_singular_block_error_names_the_head():
    model = VisionTransformer(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=1, num_heads=2
    ).to(DT)
    with torch.no_grad():
        model.blocks[0].attn.q.weight[4:8] = 0.0  # head 1 of the query projection
        model.blocks[0].attn.q.bias[4:8] = 0.0
    x, y = torch.randn(4, 1, 8, 8, dtype=DT), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"head 1.*pass eps>0"):
        gs.sharpness(model, nn.functional.cross_entropy, [(x, y)])
    res = gs.sharpness(model, nn.functional.cross_entropy, [(x, y)], eps=1e-6, steps=2)
    assert math.isfinite(res.value)


def test_base_point_work_is_cached_across_calls_and_never_stale():
    from geosharp.estimators.cache import CACHE, clear_cache

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    batches = [(x, x)]
    clear_cache()
    a = gs.sharpness(layer, nn.functional.mse_loss, batches, rho=0.05, steps=3)
    b = gs.sharpness(layer, nn.functional.mse_loss, batches, rho=0.05, steps=3)
    assert not a.settings["cached_base_point"] and b.settings["cached_base_point"]
    assert a.value == b.value  # the cache changes no number
    fresh = gs.sharpness(layer, nn.functional.mse_loss, batches, rho=0.05, steps=3, cache=False)
    assert fresh.value == a.value and not fresh.settings["cached_base_point"]
    # an in-place weight update (an optimizer step) invalidates the entry
    with torch.no_grad():
        layer.linear1.weight.mul_(1.5)
    c = gs.sharpness(layer, nn.functional.mse_loss, batches, rho=0.05, steps=3)
    assert not c.settings["cached_base_point"] and c.value != a.value
    # another measure setting is another entry
    d = gs.sharpness(layer, nn.functional.mse_loss, batches, rho=0.05, steps=3, metric="mix")
    assert not d.settings["cached_base_point"]
    assert CACHE.hits >= 1
    clear_cache()


def test_geodesic_without_blocks_warns_and_progress_has_a_total(capsys):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    batches = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]
    with pytest.warns(UserWarning, match="no symmetry blocks, so geodesic sharpness is adaptive"):
        gs.sharpness(mlp, nn.functional.mse_loss, batches, rho=0.1, steps=3, progress=True)
    err = capsys.readouterr().err
    assert "/8" in err  # 2 batches × (1 clean + 3 steps) forward passes, with a total and ETA
