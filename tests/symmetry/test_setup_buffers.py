"""The set-up's reused buffers (issue 43): the same results as the one-tensor-each rules.

``find_symmetries`` counts the claims a parameter at a time in one table, ``rest_layout`` marks
the blocks' coordinates a parameter at a time in one mask, ``gram_matrices`` widens every chunk
into one buffer and ``_frozen_of`` writes ``|w|`` into one buffer per dtype: each is checked
here against the rule it replaced (positions, a fresh tensor per chunk).
"""

import pytest
import torch
from torch import nn

from geosharp.geometry import elementwise_frozen, gl_factors
from geosharp.geometry.elementwise import ElementwiseGeometry, _frozen_of
from geosharp.symmetry import declare_block, find_symmetries
from geosharp.symmetry.find import _claimed_once, _Resolver

from .cases import CASE_IDS, CASES, DT


def _rest_by_positions(space) -> torch.Tensor:
    """The coordinates in no block, from the blocks' positions (the rule before the views)."""
    taken = torch.zeros(space.numel(), dtype=torch.bool)
    for b in space.blocks:
        taken[b.positions().reshape(-1)] = True
    return torch.nonzero(~taken).reshape(-1)


@pytest.mark.parametrize("make", CASES, ids=CASE_IDS)
def test_rest_layout_and_claims_match_the_positions(make):
    model = make().build()
    space = find_symmetries(model)
    assert torch.equal(space.rest_index, _rest_by_positions(space))
    for j, local in space.rest_layout():  # whole parameters stored as None, others sorted
        if local is not None:
            assert 0 < local.numel() < space.shapes[j].numel()
    assert _claimed_once(space.blocks, _Resolver(model))


class Scores(nn.Module):
    """Two heads of scores on plain parameters (test_find's ``Bilinear``)."""

    def __init__(self):
        super().__init__()
        self.wa = nn.Parameter(torch.randn(8, 5, dtype=DT))
        self.wb = nn.Parameter(torch.randn(5, 8, dtype=DT))
        self.bb = nn.Parameter(torch.randn(12, dtype=DT))


def test_partly_covered_parameter_and_clashes():
    torch.manual_seed(0)
    model = Scores()
    part = declare_block(
        model, name="part", g=[("wa", 0)], h=[("wb", 1), ("bb", 0, 2, 10)], head_dim=4
    )
    space = find_symmetries(model, extra_blocks=[part])
    assert torch.equal(space.rest_index, _rest_by_positions(space))
    (j, local), *_ = [(j, loc) for j, loc in space.rest_layout() if loc is not None]
    assert space.param_names[j] == "bb" and local.tolist() == [0, 1, 10, 11]
    res = _Resolver(model)
    assert _claimed_once(space.blocks, res)
    # a clash between two blocks, and a block with itself: not once (counted block by block)
    other = declare_block(model, name="other", g=[("wa", 0, 4, 8)], h=[("bb", 0, 0, 4)], head_dim=4)
    both = find_symmetries(model, extra_blocks=[part], adapters=[]).blocks
    both = both + find_symmetries(model, extra_blocks=[other], adapters=[]).blocks
    assert not _claimed_once(both, res)
    twice = declare_block(model, name="twice", g=[("wa", 0)], h=[("wa", 0)], head_dim=4)
    with pytest.raises(ValueError, match="twice"):
        find_symmetries(model, extra_blocks=[twice])


def _grams_one_copy_per_chunk(G, H, dtype):
    """``gram_matrices`` as it was: each chunk widened into a fresh tensor."""
    out = []
    for X in (G, H):
        flat = X.reshape(-1, *X.shape[-2:])
        M = torch.empty((flat.shape[0], X.shape[-1], X.shape[-1]), dtype=dtype, device=X.device)
        per = max(1, gl_factors.GRAM_CHUNK // max(1, X.shape[-2] * X.shape[-1]))
        for i in range(0, flat.shape[0], per):
            chunk = flat[i : i + per].to(dtype)
            torch.matmul(chunk.mT, chunk, out=M[i : i + per])
        out.append(M.view(*X.shape[:-2], *M.shape[-2:]))
    return out


@pytest.mark.parametrize("chunk", [1 << 22, 200, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gram_matrices_one_buffer_is_bit_identical(monkeypatch, chunk, dtype):
    monkeypatch.setattr(gl_factors, "GRAM_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    G = torch.randn(3, 5, 17, 4, generator=g, dtype=dtype)
    H = torch.randn(3, 5, 4, 9, generator=g, dtype=dtype).transpose(-1, -2)  # not contiguous
    MG, MH = gl_factors.gram_matrices(G, H, torch.float64)
    RG, RH = _grams_one_copy_per_chunk(G, H, torch.float64)
    assert MG.shape == (3, 5, 4, 4) and MH.shape == (3, 5, 4, 4)
    assert torch.equal(MG, RG) and torch.equal(MH, RH)


def test_frozen_of_one_buffer_matches_a_fresh_one(monkeypatch):
    monkeypatch.setattr(elementwise_frozen, "_FROZEN_CHUNK", 16)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(100, generator=g)
    big[[3, 50, 97]] = 0.0
    mostly = torch.randn(40, generator=g, dtype=torch.float64)
    mostly[::2] = 0.0  # past one in 16: a mask
    small = torch.randn(5, generator=g)
    small[1] = 1e-30  # 1/w² overflows float32
    clear = nn.Parameter(torch.randn(7, generator=g) + 10.0)  # needs grad: read detached
    parts = (small, big, mostly, clear)
    scratch: dict = {}
    got = [_frozen_of(t, scratch) for t in parts]
    assert set(scratch) == {(torch.float32, small.device), (torch.float64, small.device)}
    assert scratch[(torch.float32, small.device)].numel() == 16  # grown once, to one chunk
    for t, f in zip(parts, got, strict=True):
        want = _frozen_of(t)
        assert (f is None) == (want is None)
        if f is not None:
            assert torch.equal(f, want)
    assert got[0].tolist() == [False, True, False, False, False]  # one in 5: a mask
    assert got[1].tolist() == [3, 50, 97] and got[3] is None
    assert got[2].dtype == torch.bool and got[2].sum() == 20
    geom = ElementwiseGeometry(parts)
    assert geom.has_frozen and [f is None for f in geom._frozen] == [False, False, False, True]


def _buffers_on(device: torch.device, monkeypatch) -> None:
    """The Gram buffer and ``_frozen_of``'s made on ``device``, the results as fresh tensors'."""
    monkeypatch.setattr(gl_factors, "GRAM_CHUNK", 200)
    monkeypatch.setattr(elementwise_frozen, "_FROZEN_CHUNK", 16)
    g = torch.Generator().manual_seed(0)
    G = torch.randn(3, 5, 17, 4, generator=g).to(device)
    H = torch.randn(3, 5, 9, 4, generator=g).to(device)
    got = gl_factors.gram_matrices(G, H, torch.float64)
    want = _grams_one_copy_per_chunk(G, H, torch.float64)
    for t, w in zip(got, want, strict=True):
        assert t.device == device and torch.equal(t, w)
    w = torch.randn(100, generator=g)
    w[[3, 50, 97]] = 0.0
    scratch: dict = {}
    assert _frozen_of(w.to(device), scratch).tolist() == [3, 50, 97]
    assert [t.device for t in scratch.values()] == [device]


def test_buffers_on_the_tensors_device(monkeypatch):
    _buffers_on(torch.device("cpu"), monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buffers_on_a_gpu(monkeypatch):
    _buffers_on(torch.device("cuda", 0), monkeypatch)
