"""Every adapter on a tiny float64 model: counts, round trip, coverage, invariance, indexing."""

import copy

import pytest
import torch

from geosharp.symmetry import find_symmetries, reparametrize

from ..invariance import assert_invariant
from .cases import CASE_IDS, CASES

# Reparametrized float64 outputs: A has cond ≤ 1e3 and entries up to ~10·N(0,1); the error of
# one solve/matmul is ~cond·eps ≈ 2e-13 per layer, so 1e-10 leaves a wide margin while any
# indexing mistake changes the outputs at order 1 (see test_invariance_check_can_fail). A model
# whose forward computes part of its arithmetic in float32 is judged against a random move of the
# same size instead (tests/invariance.py), so a new upstream float32 kernel is not a failure.
INVARIANCE_RTOL = 1e-10


@pytest.fixture(scope="module", params=range(len(CASES)), ids=CASE_IDS)
def setup(request):
    case = CASES[request.param]()
    model = case.build()
    space = find_symmetries(model)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = case.forward(model, inputs)
    return case, model, space, inputs, out


def rel_change(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_block_counts(setup):
    case, _, space, _, _ = setup
    got = [(b.kind, b.heads, b.head_dim, b.n, b.m) for b in space.gl_blocks]
    assert got == case.expected
    assert len(space.diagonal_pairs) == case.n_pairs
    assert sum(b.kind == "b_k" for b in space.blocks) == case.n_translations
    assert len({b.name for b in space.blocks}) == len(space.blocks)
    for note in case.notes:
        assert any(note in n for n in space.notes), space.notes
    for b in space.gl_blocks:
        assert b.g_index.shape == (b.heads, b.n, b.head_dim)
        assert b.h_index.shape == (b.heads, b.m, b.head_dim)


def test_round_trip_is_bit_exact(setup):
    _, model, space, _, _ = setup
    theta = space.flatten_module(model)
    rebuilt = torch.full_like(theta, float("nan"))
    for b in space.blocks:
        rebuilt = b.scatter(rebuilt, *b.gather(theta))
    rebuilt[space.rest_index] = theta[space.rest_index]
    params = dict(model.named_parameters())
    unflat = space.unflatten(rebuilt)
    assert set(unflat) == {n for n, p in params.items() if p.requires_grad}
    for name, value in unflat.items():
        assert torch.equal(value, params[name]), name


def test_coverage_is_a_permutation(setup):
    _, model, space, _, _ = setup
    everything = torch.cat([space.rest_index, *(b.positions() for b in space.blocks)])
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert space.numel() == n
    assert torch.equal(everything.sort().values, torch.arange(n))
    assert space.block_numel + space.adaptive_numel == n


@pytest.mark.parametrize("scale", [1e-1, 1.0, 10.0])
def test_reparametrization_invariance(setup, scale):
    case, model, space, inputs, out = setup
    twin = reparametrize(model, generator=torch.Generator().manual_seed(7), scale=scale)
    with torch.no_grad():
        out_twin = case.forward(twin, inputs)
    theta, theta_twin = space.flatten_module(model), space.flatten_module(twin)
    assert_invariant(
        rel_change(out_twin, out),
        rtol=INVARIANCE_RTOL,
        forward=case.forward,
        model=model,
        space=space,
        moved=theta_twin.detach(),
        inputs=inputs,
        out=out,
        what=f"{case.name}, scale {scale}",
    )
    # ... and the weights really moved (otherwise the check above would be empty)
    for b in space.blocks:
        first = b.indices[0].reshape(-1)
        assert rel_change(theta_twin[first], theta[first]) > 1e-2, b.name
    # the input model is untouched
    assert torch.equal(space.flatten_module(model), theta)


def test_invariance_check_can_fail(setup):
    case, model, space, inputs, out = setup
    # a random perturbation of a query weight changes the outputs
    broken = copy.deepcopy(model)
    q_weight = case.q_weight(model) if callable(case.q_weight) else case.q_weight
    name, axis, start, stop = q_weight
    with torch.no_grad():
        w = dict(broken.named_parameters())[name]
        part = w.narrow(axis, start, stop - start)
        part.add_(1e-2 * torch.randn(part.shape, generator=torch.Generator().manual_seed(3)))
        assert rel_change(case.forward(broken, inputs), out) > 1e-6
    # so does a "half" group action: G ↦ G A⁻¹ without H ↦ H Aᵀ
    theta = space.flatten_module(model).detach()
    g = torch.Generator().manual_seed(4)
    if space.gl_blocks:
        b = space.gl_blocks[0]
        G, H = b.gather(theta)
        A = torch.randn(b.heads, b.head_dim, b.head_dim, generator=g, dtype=theta.dtype)
        half = b.scatter(theta, torch.linalg.solve(A, G, left=False), H)
    else:
        p = space.diagonal_pairs[0]
        u, v = p.gather(theta)
        half = p.scatter(theta, 2.0 * u, v)
    broken = copy.deepcopy(model)
    space.write_to(broken, half)
    with torch.no_grad():
        assert rel_change(case.forward(broken, inputs), out) > 1e-6


def test_blocks_match_per_head_reference(setup):
    case, model, space, _, _ = setup
    theta = space.flatten_module(model).detach()
    ref = case.reference(model)
    assert set(ref) == {b.name for b in space.blocks if b.kind != "pair"}
    for b in space.gl_blocks:
        G, H = b.gather(theta)
        G_ref, H_ref = ref[b.name]
        # the bilinear form G Hᵀ the network sees, per head, from the module's own weights
        torch.testing.assert_close(G @ H.mT, G_ref @ H_ref.mT, rtol=0, atol=0)
        assert torch.equal(G, G_ref) and torch.equal(H, H_ref), b.name
    for b in space.blocks:
        if b.kind == "b_k":
            (bias,) = b.gather(theta)
            assert torch.equal(bias, ref[b.name][0]), b.name
    for p in space.diagonal_pairs:
        u, v = p.gather(theta)
        assert torch.equal(u * v, model.beta)


def test_outputs_ignore_the_key_bias(setup):
    """The translation blocks are exact symmetries: any b_k, even a huge one, changes nothing."""
    case, model, space, inputs, out = setup
    theta = space.flatten_module(model).detach()
    biases = [b for b in space.blocks if b.kind == "b_k"]
    if not biases:
        pytest.skip("no key bias the softmax ignores")
    g = torch.Generator().manual_seed(11)
    moved = theta
    for b in biases:
        (bias,) = b.gather(theta)
        moved = b.scatter(
            moved, bias + 100.0 * torch.randn(bias.shape, generator=g, dtype=bias.dtype)
        )
    twin = copy.deepcopy(model)
    space.write_to(twin, moved)
    with torch.no_grad():
        change = rel_change(case.forward(twin, inputs), out)
    # logits move by ~1e3 at most: the softmax removes the shift up to that many ulps
    assert_invariant(
        change,
        rtol=1e-11,
        forward=case.forward,
        model=model,
        space=space,
        moved=moved,
        inputs=inputs,
        out=out,
        what=f"{case.name}: key biases",
        everywhere=True,
    )
