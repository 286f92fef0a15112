"""Relative flatness against the full Hessian built by torch.func (float64)."""

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

import geosharp as gs

DT = torch.float64


def brute_force_kappa(model, loss_fn, x, y, layer):
    """Σ_{s,s'} ⟨w_s, w_s'⟩ Tr(H_{s,s'}) from the dense Hessian w.r.t. the layer's weight."""
    name = f"{layer}.weight"
    W = dict(model.named_parameters())[name].detach()

    def loss_of(w):
        return loss_fn(functional_call(model, {name: w}, (x,)), y)

    Hs = hessian(loss_of)(W)  # (k, d, k, d)
    traces = torch.einsum("sjtj->st", Hs)
    return float(((W @ W.T) * traces).sum())


@pytest.mark.parametrize("loss_fn", [nn.functional.cross_entropy, nn.functional.mse_loss])
def test_relative_flatness_matches_dense_hessian(loss_fn):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)
    x = torch.randn(11, 5, generator=g, dtype=DT)
    if loss_fn is nn.functional.cross_entropy:
        y = torch.randint(0, 3, (11,), generator=g)
    else:
        y = torch.randn(11, 3, generator=g, dtype=DT)
    res = gs.relative_flatness(model, loss_fn, [(x, y)])
    expected = brute_force_kappa(model, loss_fn, x, y, "2")
    assert math.isclose(res.value, expected, rel_tol=1e-10), (res.value, expected)
    assert res.settings["layer"] == "2"


def test_relative_flatness_errors():
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    with pytest.raises(ValueError, match=r"must name an nn\.Linear"):
        gs.relative_flatness(model, nn.functional.cross_entropy, [], layer="1")
    with pytest.raises(ValueError, match="batches is empty"):
        gs.relative_flatness(model, nn.functional.cross_entropy, [])
