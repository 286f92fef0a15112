"""Tangent components in one flat buffer (geometry/flat.py, issue 43): same values, fewer ops."""

from __future__ import annotations

import pytest
import torch

from geosharp.geometry.flat import (
    COMBINE_CHUNK,
    axpy,
    clone,
    combine_into_,
    flat_exact,
    flat_of,
    flatten,
    lists,
    pair_buffer,
    scale_,
    untracked,
    views,
    widen_pair,
)
from geosharp.geometry.gl_execution import chunked_on

SHAPES = [(3, 5), (7,), (2, 3, 4), (1,), (129,)]


def _parts(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype) for s in SHAPES)


def test_flat_of_finds_consecutive_views_only():
    ts = _parts(torch.float32, 0)
    assert flat_of(ts) is None  # separate tensors
    f = flatten(ts)
    base = flat_of(f)
    assert base is not None and base.numel() == sum(t.numel() for t in ts)
    assert all(torch.equal(a, b) for a, b in zip(f, ts, strict=True))
    assert flat_of(f[::-1]) is None  # out of order
    assert flat_of(f[1:]) is not None  # a run of consecutive views
    assert all(a is b for a, b in zip(flatten(f), f, strict=True))  # flat already: no copy
    base.zero_()  # the views are the buffer
    assert all(bool((t == 0).all()) for t in f)


def test_half_precision_is_left_per_component():
    ts = _parts(torch.bfloat16, 1)
    assert flatten(ts) == ts  # no flat copy
    f = views(torch.cat([t.reshape(-1) for t in ts]), ts)
    assert flat_of(f) is not None and flat_exact(f) is None
    assert all(len(x) == len(ts) for x in lists(f, f))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("flat", [True, False])
def test_axpy_and_scale_give_the_per_component_values(dtype, reuse, flat):
    x, v = _parts(dtype, 2), _parts(dtype, 3)
    want = [torch.add(a, b, alpha=0.3711) for a, b in zip(x, v, strict=True)]
    xs, vs = (flatten(x), flatten(v)) if flat else (x, tuple(t.clone() for t in v))
    got = axpy(xs, vs, 0.3711, reuse)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if reuse:  # written into v
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, vs, strict=True))
    want2 = [t.clone().mul_(0.37) for t in got]
    scale_(got, 0.37)
    assert all(torch.equal(a, b) for a, b in zip(got, want2, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 1000, COMBINE_CHUNK, 2 * COMBINE_CHUNK + 37])
@pytest.mark.parametrize("k", [1.0, 0.731])
@pytest.mark.parametrize("threads", [1, 2])
def test_combine_into_gives_the_three_ops_values_in_p(dtype, size, k, threads):
    g = torch.Generator().manual_seed(size)
    shapes = [(size,), (3, 5)]
    x, v, p = (
        flatten(tuple(torch.randn(s, generator=g, dtype=dtype) for s in shapes)) for _ in "xvp"
    )
    t = axpy(x, v, 0.3711, False)  # what _l2_step forms without it
    torch._foreach_add_(*lists(t, p), alpha=-0.0917)
    if k != 1.0:
        scale_(t, k)
    ptr = flat_of(p).data_ptr()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = combine_into_(x, v, 0.3711, p, -0.0917, k)
    finally:
        torch.set_num_threads(old)
    assert got is not None and all(a is b for a, b in zip(got, p, strict=True))
    assert flat_of(got).data_ptr() == ptr  # written over p: no new buffer
    assert all(torch.equal(a, b) for a, b in zip(got, t, strict=True))  # bit for bit


def test_combine_into_declines_what_is_not_flat():
    x, v, p = _parts(torch.float32, 7), _parts(torch.float32, 8), _parts(torch.float32, 9)
    assert combine_into_(x, v, 0.5, p, 0.25, 1.0) is None  # separate tensors
    fx, fv = flatten(x), flatten(v)
    assert combine_into_(fx, fv, 0.5, flatten(p)[:-1], 0.25, 1.0) is None  # another size
    half = flatten(tuple(t.double() for t in p))
    assert combine_into_(fx, fv, 0.5, half, 0.25, 1.0) is None  # another dtype


def test_combine_into_runs_as_on_a_gpu_under_chunked_on():
    """``chunked_on(())`` (``launches.py --path device``) counts a GPU's three whole passes."""
    fx, fv, fp = (flatten(_parts(torch.float32, n)) for n in (7, 8, 9))
    with chunked_on(()):
        assert combine_into_(fx, fv, 0.5, fp, 0.25, 1.0) is None
    assert combine_into_(fx, fv, 0.5, fp, 0.25, 1.0) is not None


def test_clone_keeps_a_flat_tangent_flat():
    f = flatten(_parts(torch.float32, 4))
    c = clone(f)
    assert flat_of(c) is not None and flat_of(c).data_ptr() != flat_of(f).data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(c, f, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widen_pair_gives_the_casts_in_one_buffer(dtype):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 5, 2, generator=g).to(dtype), torch.randn(3, 4, 2, generator=g).to(dtype)
    for pair in ((a, b), flatten((a, b))):  # separate tensors, then one flat buffer
        wa, wb = widen_pair(pair[0], pair[1], torch.float64)
        assert torch.equal(wa, a.double()) and torch.equal(wb, b.double())
        assert flat_of((wa, wb)) is not None  # one buffer: one dot, one copy after
    assert all(x is y for x, y in zip(widen_pair(a, b, dtype), (a, b), strict=True))
    tracked = a.clone().requires_grad_(True)  # a graph sees it: plain differentiable casts
    wa, wb = widen_pair(tracked, b, torch.float64)
    assert wa.requires_grad and torch.equal(wa.detach(), a.double())
    wa.sum().backward()
    assert torch.equal(tracked.grad, torch.ones_like(a))


def test_pair_buffer_and_untracked():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)
    x, y = pair_buffer(a, b, torch.float64)
    assert x.shape == a.shape and y.shape == b.shape and flat_of((x, y)) is not None
    assert untracked((a, b))
    assert not untracked((a.requires_grad_(True), b))
    with torch.no_grad():
        assert untracked((a, b))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(b, torch.ones_like(b))
        assert not untracked((dual,))
