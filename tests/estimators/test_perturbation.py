"""The perturbed parameters: ``endpoint_params`` is ``unflatten(endpoint)``, bit for bit."""

import pytest
import torch
from torch import nn

from geosharp.estimators.perturbation import Perturbation
from geosharp.symmetry import declare_block, find_symmetries

from ..symmetry.cases import CASE_IDS, CASES, DT

SETTINGS = [
    dict(measure="geodesic", metric="inv", order=2),
    dict(measure="geodesic", metric="mix", order=1),
    dict(measure="geodesic", metric="inv", order=2, corrected_norm=False),
    dict(measure="geodesic", metric="adaptive"),
    dict(measure="adaptive"),
]


def _same_params_and_gradients(model, space, **kw):
    theta0 = space.flatten_module(model).detach()
    pert = Perturbation(space, theta0, **kw)
    xi = pert.random(torch.Generator().manual_seed(0), 0.1)
    leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in xi]
    flat = [t for x in leaves for t in x]
    fast = pert.endpoint_params(leaves)
    slow = space.unflatten(pert.endpoint(leaves))
    assert list(fast) == list(slow) == list(space.param_names)
    for name in slow:
        assert torch.equal(fast[name], slow[name]), name
    # The same gradient with respect to ξ for an arbitrary function of the parameters.
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in slow.items()}

    def grads(params):
        total = sum((weights[n] * torch.sin(p)).sum() for n, p in params.items())
        return torch.autograd.grad(total, flat, allow_unused=True)

    for a, b in zip(grads(fast), grads(slow), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "-".join(map(str, kw.values())))
@pytest.mark.parametrize("make", CASES, ids=CASE_IDS)
def test_endpoint_params_equal_unflattened_endpoint(make, kw):
    case = make()
    model = case.build()
    _same_params_and_gradients(model, find_symmetries(model), **kw)


def test_parameters_partly_in_a_block_and_partly_adaptive():
    """A block over half of the rows of q and v: those parameters are gathered from both."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q", nn.Linear(8, 8))
    model.add_module("v", nn.Linear(8, 8))
    model.add_module("head", nn.Linear(8, 3))
    model = model.to(DT)
    block = declare_block(
        model,
        name="half[QV]",
        g=[("q.weight", 0, 0, 4), ("q.bias", 0, 0, 4)],
        h=[("v.weight", 0, 2, 6)],
        head_dim=4,
    )
    space = find_symmetries(model, adapters=[], extra_blocks=[block])
    assert 0 < space.adaptive_numel < space.numel()
    for kw in SETTINGS:
        _same_params_and_gradients(model, space, **kw)


def test_model_without_symmetries():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(DT)
    _same_params_and_gradients(model, find_symmetries(model), measure="geodesic")


@pytest.mark.parametrize(
    "kw",
    [*SETTINGS, dict(measure="geodesic", metric="inv", order=2, eps=1e-3)],
    ids=lambda kw: "-".join(map(str, kw.values())),
)
def test_ascent_direction_norms_equal_the_metric_ones(kw):
    """``Perturbation.ascent_direction``: ``d`` is the projected Riemannian gradient, ``‖d‖²`` and
    ``⟨ξ, d⟩`` (a horizontal ξ) equal the ball's metric norms, whether a piece reads them off the
    gradient (metric-orthogonal projection) or not (eps > 0, the adaptive-norm ablation)."""
    case = CASES[CASE_IDS.index("hf_bert")]()
    model = case.build()
    space = find_symmetries(model)
    pert = Perturbation(space, space.flatten_module(model).detach(), **kw)
    g = torch.Generator().manual_seed(5)
    e = [tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in x) for x in pert.zeros()]
    xi = pert.random(g, 0.1)
    ref = pert.riemannian_grad([tuple(t.clone() for t in x) for x in e])
    xi2 = pert.random(g, 0.2)
    d, dd, (xd, xd2, zero) = pert.ascent_direction(
        [tuple(t.clone() for t in x) for x in e], (xi, xi2, None), inplace=True
    )
    for a, b in zip(d, ref, strict=True):
        for s, t in zip(a, b, strict=True):
            torch.testing.assert_close(s, t, rtol=1e-13, atol=0)
    norm = float(pert.norm_sq(d))
    inner = sum(
        float(p.norm_geometry.inner(x, y).sum()) for p, x, y in zip(pert.pieces, xi, d, strict=True)
    )
    assert abs(dd - norm) <= 1e-10 * norm
    assert abs(xd - inner) <= 1e-9 * (norm * float(pert.norm_sq(xi))) ** 0.5
    inner2 = pert.inner(xi2, d)
    assert abs(xd2 - inner2) <= 1e-9 * (norm * float(pert.norm_sq(xi2))) ** 0.5 and zero == 0.0
    _, dd0, none = pert.ascent_direction(e)
    assert none == [] and abs(dd0 - norm) <= 1e-10 * norm


def test_piece_sums_add_each_list_in_order():
    """The pieces' scalars summed in one stack where they line up, term by term otherwise."""
    from geosharp.estimators.reductions import _piece_sums

    g = torch.Generator().manual_seed(3)
    terms = [
        [torch.randn((), generator=g, dtype=torch.float64) for _ in (1, 2, 3)] for _ in (1, 2, 3)
    ]
    got = _piece_sums(terms)
    for vs, s in zip(terms, got, strict=True):
        assert float(s) == float((vs[0] + vs[1]) + vs[2])  # left to right, as before
    assert _piece_sums([[terms[0][0]], []]) == [terms[0][0], None]  # uneven: term by term
    one = _piece_sums([[terms[0][0]], [terms[1][0]]])  # one piece: the scalars themselves
    assert one[0] is terms[0][0] and one[1] is terms[1][0]
