"""Random group elements and the group action (SPEC §3)."""

import pytest
import torch
from torch import nn

from geosharp.models import DiagonalNet
from geosharp.symmetry import (
    GroupElement,
    find_symmetries,
    group_action,
    random_group_elements,
    reparametrize,
)

DT = torch.float64


def space_of_mha():
    return find_symmetries(nn.MultiheadAttention(12, num_heads=3).to(DT))


def gl_parts(space, el):
    return [A for b, A in zip(space.blocks, el.parts, strict=True) if b in space.gl_blocks]


def test_group_elements_are_well_conditioned_and_scaled():
    space = space_of_mha()
    for scale in (1e-2, 1.0, 1e2):
        el = random_group_elements(space, generator=torch.Generator().manual_seed(0), scale=scale)
        for A in gl_parts(space, el):
            assert A.shape == (3, 4, 4) and A.dtype == DT
            assert (torch.linalg.cond(A) <= 1e3).all()
            # entries are scale·N(0,1): their RMS over 2 × 48 draws is near `scale`
        rms = torch.cat([A.flatten() for A in gl_parts(space, el)]).square().mean().sqrt() / scale
        assert 0.6 < rms.item() < 1.5


def test_group_elements_are_reproducible_and_reject_small_cond():
    space = space_of_mha()
    a = random_group_elements(space, generator=torch.Generator().manual_seed(5))
    b = random_group_elements(space, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(a.parts, b.parts, strict=True))
    with pytest.raises(RuntimeError, match="max_cond"):
        random_group_elements(space, generator=torch.Generator().manual_seed(5), max_cond=1.0)
    with pytest.raises(ValueError, match="positive"):
        random_group_elements(space, scale=0.0)


def test_group_action_matches_explicit_formula():
    space = space_of_mha()
    theta = torch.randn(space.numel(), dtype=DT)
    el = random_group_elements(space, generator=torch.Generator().manual_seed(1))
    out = group_action(space, theta, el)
    for blk, A in zip(space.gl_blocks, gl_parts(space, el), strict=True):
        G, H = blk.gather(theta)
        G2, H2 = blk.gather(out)
        torch.testing.assert_close(G2, G @ torch.linalg.inv(A), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(H2, H @ A.mT, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(G2 @ H2.mT, G @ H.mT, rtol=1e-10, atol=1e-12)
    assert torch.equal(out[space.rest_index], theta[space.rest_index])
    # the key bias is translated: b_k ↦ b_k + t
    ((blk, t),) = [(b, p) for b, p in zip(space.blocks, el.parts, strict=True) if b.kind == "b_k"]
    torch.testing.assert_close(blk.gather(out)[0], blk.gather(theta)[0] + t, rtol=0, atol=0)


def test_group_action_is_differentiable():
    space = space_of_mha()
    theta = torch.randn(space.numel(), dtype=DT, requires_grad=True)
    el = random_group_elements(space, generator=torch.Generator().manual_seed(2))
    assert torch.autograd.gradcheck(lambda t: group_action(space, t, el), (theta,), fast_mode=True)


def test_group_action_rejects_mismatched_element():
    space = space_of_mha()
    with pytest.raises(ValueError, match="0 parts but the space has 3 symmetry blocks"):
        group_action(space, torch.zeros(space.numel(), dtype=DT), GroupElement([]))


def test_diagonal_net_reparametrization():
    torch.manual_seed(0)
    net = DiagonalNet(6).to(DT)
    with torch.no_grad():
        net.u.copy_(torch.randn(6, dtype=DT))
        net.v.copy_(torch.randn(6, dtype=DT))
    space = find_symmetries(net)
    assert len(space.diagonal_pairs) == 1
    assert space.gl_blocks == [] and space.adaptive_numel == 0
    el = random_group_elements(space, generator=torch.Generator().manual_seed(3), scale=10.0)
    (alpha,) = el.parts
    assert (alpha.abs() >= 1.0 - 1e-12).all()  # |α| ≥ 0.1·scale
    twin = reparametrize(net, torch.Generator().manual_seed(3), scale=10.0)
    torch.testing.assert_close(twin.u, net.u * alpha, rtol=1e-15, atol=0)
    torch.testing.assert_close(twin.beta, net.beta, rtol=1e-14, atol=1e-15)
