"""Every tensor geosharp makes is made on its parameter's device (issue 27, models split
across devices).

A CPU machine cannot show two devices, so this checks the construction instead: the calls run
with the *meta* device as PyTorch's default device (``with torch.device("meta")``) on a model
whose parameters are on the CPU. A tensor created without an explicit device (or one taken from
a parameter or a batch) would be a meta tensor, and the first operation mixing it with the
model's tensors, or reading its value, fails. Each call below finishing with the value of an
ordinary call shows that none was made.
"""

import dataclasses

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators import pieces
from geosharp.estimators.pieces import _block_params, _block_point, _group_blocks
from geosharp.symmetry import GLBlock, ParameterSpace


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0),
        nn.Flatten(),
        nn.Linear(5 * 8, 3),
    ).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 5, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(2)
    ]


def _space(model, blocks):
    """The model's space, found outside the meta context, its blocks' index tables built.

    The symmetry search and the blocks' index tables are bookkeeping made once on the host
    and moved to the parameters' device where they are used.
    """
    space = gs.find_symmetries(model, adapters=None if blocks else [])
    for b in space.blocks:
        b.indices  # noqa: B018 - built lazily: build them here
    return space


CALLS = {
    "adaptive": dict(measure="adaptive", rho=0.1),
    "geodesic-inv": dict(measure="geodesic", metric="inv", rho=0.05),
    "geodesic-mix": dict(measure="geodesic", metric="mix", rho=0.05),
    "geodesic-exact": dict(measure="geodesic", metric="inv", order="exact", rho=0.05),
    "average": dict(measure="geodesic", kind="average", rho=0.05, samples=3),
    "restarts": dict(measure="adaptive", rho=0.1, restarts=2, steps=3),
    "linf": dict(measure="adaptive", norm="linf", rho=0.01),
    "geodesic-blocks": dict(measure="geodesic", metric="mix", perturb="blocks", rho=0.05),
    "geodesic-adaptivenorm": dict(measure="geodesic", corrected_norm=False, rho=0.05),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_sharpness_makes_no_tensor_off_its_parameters_device(name):
    kw = dict(steps=4, progress=False, cache=False) | CALLS[name]
    ce = nn.functional.cross_entropy
    want = gs.sharpness(_model(), ce, _batches(), **kw)
    model, batches = _model(), _batches()
    space = _space(model, kw["measure"] == "geodesic")
    with torch.device("meta"):
        got = gs.sharpness(model, ce, batches, space=space, **kw)
    assert got.value == want.value
    assert got.per_batch == want.per_batch


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_curvature_makes_no_tensor_off_its_parameters_device(measure):
    ce = nn.functional.cross_entropy
    kw = dict(measure=measure, iters=4, progress=False)
    want = gs.curvature(_model(), ce, _batches(), **kw)
    model, batches = _model(), _batches()
    space = _space(model, measure == "geodesic")
    with torch.device("meta"):
        got = gs.curvature(model, ce, batches, space=space, **kw)
    assert got.values == want.values
    assert got.eigenvalues == want.eigenvalues


# -- the construction: a batched geometry never mixes devices ---------------------------------
def _two_layers():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()


def _by_layer(space, where):
    """A device map (no device is touched): every parameter's device from its name."""
    return [where(name) for name in space.param_names]


def _layer_device(name):
    return torch.device("cuda", 1) if name.startswith("layers.1.") else torch.device("cuda", 0)


def test_block_params_are_the_blocks_own_module_read_from_recipe_or_tensor():
    space = gs.find_symmetries(_two_layers())
    for b in space.blocks:
        own = _block_params(space, b)
        assert own and all(space.param_names[j].startswith(b.module + ".") for j in own)
        plain = dataclasses.replace(b, **dict(zip(b.index_fields, b.indices, strict=True)))
        assert _block_params(space, plain) == own  # a hand-made position tensor, located


def test_block_groups_never_mix_devices():
    space = gs.find_symmetries(_two_layers())
    keys: dict = {}
    for b in space.blocks:
        keys.setdefault(b.batch_key(), []).append(b)
    # one device: the groups of the batch keys alone, in first-seen order (the same pieces)
    one = _group_blocks(space, _by_layer(space, lambda _: torch.device("cpu")))
    assert [blocks for _, blocks in one] == list(keys.values())
    assert {d for d, _ in one} == {torch.device("cpu")}
    # layers on two devices (device_map="auto"): every key cut by device, no block lost
    devices = _by_layer(space, _layer_device)
    split = _group_blocks(space, devices)
    for device, blocks in split:
        for b in blocks:
            assert {devices[j] for j in _block_params(space, b)} == {device}, b.name
    assert [b.name for _, blocks in split for b in blocks] == [
        b.name
        for d in ("layers.0.", "layers.1.")
        for blocks in keys.values()
        for b in blocks
        if b.module.startswith(d)
    ]
    assert len(split) == 2 * len(keys)


def test_a_block_across_two_devices_is_refused():
    space = gs.find_symmetries(_two_layers())
    # layer 0's Q/K/V weights on one device, its biases on another: its QK block spans both
    devices = _by_layer(
        space, lambda n: torch.device("cuda", 1 if n.endswith("in_proj_bias") else 0)
    )
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\[QK\]' has parameters on sev"):
        _group_blocks(space, devices)


@pytest.mark.parametrize("chunk", [1 << 22, 12, 1])
def test_block_point_is_read_from_each_parameter_without_a_concatenation(chunk, monkeypatch):
    """A block over two parameters of two dtypes: ``θ₀[i]``, in the dtype of ``θ₀``, exactly.

    ``chunk``: positions gathered at once (whole rows of dimension 0; 12 = one row of ``g``,
    1 = still one row): every chunking reads the same values.
    """
    monkeypatch.setattr(pieces, "_GATHER_CHUNK", chunk)
    g = torch.arange(20, 44).view(2, 6, 2)  # across the end of "a" and into "b"
    h = torch.arange(2, 22).view(2, 5, 2)
    space = ParameterSpace(
        ("a", "b"),
        (torch.Size([30]), torch.Size([4, 5])),
        (0, 30),
        [GLBlock("blk", "QK", "", 2, 2, g, h)],
    )
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(30, generator=gen), torch.randn(4, 5, generator=gen).double()]
    index = space.blocks[0].indices
    point = _block_point(space, index, params, torch.float64)
    theta = space.flatten(dict(zip(space.param_names, params, strict=True)))
    assert theta.dtype == torch.float64
    for p, i in zip(point, index, strict=True):
        assert p.dtype == torch.float64 and p.shape == i.shape
        assert torch.equal(p, theta[i])
