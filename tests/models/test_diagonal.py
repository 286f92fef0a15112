"""The diagonal linear network."""

import torch

from geosharp.models import DiagonalNet
from geosharp.symmetry import find_symmetries


def test_forward_is_x_times_u_v():
    net = DiagonalNet(4, init_scale=0.5).double()
    assert torch.equal(net.u, torch.full((4,), 0.5, dtype=torch.float64))
    assert torch.equal(net.v, net.u)
    with torch.no_grad():
        net.u.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0]))
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = torch.stack([sum(x[i, j] * net.u[j] * net.v[j] for j in range(4)) for i in range(5)])
    torch.testing.assert_close(net(x), expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(net.beta, net.u * net.v)


def test_pair_is_found_automatically():
    net = DiagonalNet(5)
    space = find_symmetries(net)
    (pair,) = space.diagonal_pairs
    assert pair.name == "<model>[u*v]"
    assert torch.equal(pair.u_index, torch.arange(5)) and torch.equal(
        pair.v_index, torch.arange(5, 10)
    )
    nested = find_symmetries(torch.nn.ModuleDict({"a": DiagonalNet(2), "b": DiagonalNet(3)}))
    assert [p.name for p in nested.diagonal_pairs] == ["a[u*v]", "b[u*v]"]
    assert "2 symmetry blocks (5 group factors" in nested.summary()
