"""Block positions are kept as recipes (issue 11): the space holds no position tensor."""

import pickle

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.symmetry.positions import Positions, as_tensor
from geosharp.symmetry.specs import ParamSlice, slice_positions


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_found_blocks_hold_recipes_that_build_the_eager_positions():
    model = _encoder()
    space = gs.find_symmetries(model)
    assert space.blocks
    offsets = dict(zip(space.param_names, space.offsets, strict=True))
    for b in space.blocks:
        fields = [getattr(b, f) for f in b.index_fields]
        assert all(isinstance(f, Positions) for f in fields)  # nothing held between uses
        built = b.indices
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in built)
        assert b.index_shapes == tuple(t.shape for t in built)
        assert b.numel == sum(t.numel() for t in built)
    # the first QK block, by hand: Q rows of in_proj_weight, head by head
    qk = space.gl_blocks[0]
    name = "layers.0.self_attn.in_proj_weight"
    shape = dict(model.named_parameters())[name].shape
    ref = slice_positions(shape, ParamSlice(name, axis=0, start=0, stop=16), 4, 4)
    g = qk.indices[0]
    assert torch.equal(g[:, : ref.shape[1]].long(), ref + offsets[name])
    # every coordinate is covered once, as with eager positions
    pos = torch.cat([b.positions().long() for b in space.blocks])
    assert pos.unique().numel() == pos.numel() == space.block_numel


def test_positions_answer_like_a_tensor_and_pickle():
    p = Positions.slices([((12, 5), ParamSlice("w", axis=0), 100)], heads=3, head_dim=2, numel=200)
    t = p.tensor()
    assert p.shape == t.shape == (3, 10, 2) and p.numel() == t.numel() and p.ndim == 3
    assert p.dtype == torch.int32 and p.size(1) == 10
    assert torch.equal(p, t) and torch.equal(p.reshape(-1), t.reshape(-1))
    q = pickle.loads(pickle.dumps(p))
    assert torch.equal(q.tensor(), t)
    moved = p.to("cpu")
    assert isinstance(moved, Positions) and torch.equal(moved.tensor(), t)
    assert p.to(torch.int64).dtype == torch.int64  # a conversion builds the tensor
    assert torch.equal(as_tensor(p), t) and as_tensor(t) is t
    a = Positions.arange(7, (2, 3), numel=100)
    assert torch.equal(a.tensor(), torch.arange(7, 13, dtype=torch.int32).view(2, 3))
    big = Positions.arange(0, (4,), numel=2**31)
    assert big.tensor().dtype == torch.int64


def test_bad_slices_fail_when_found_not_when_used():
    with pytest.raises(ValueError, match="cannot be cut into heads"):
        Positions.slices([((12, 5), ParamSlice("w", axis=0), 0)], heads=5, head_dim=2, numel=60)
