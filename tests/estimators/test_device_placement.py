"""Every tensor geosharp makes is made on its parameter's device (issue 27, models split
across devices).

A CPU machine cannot show two devices, so this checks the construction instead: the calls run
with the *meta* device as PyTorch's default device (``with torch.device("meta")``) on a model
whose parameters are on the CPU. A tensor created without an explicit device (or one taken from
a parameter or a batch) would be a meta tensor, and the first operation mixing it with the
model's tensors, or reading its value, fails. Each call below finishing with the value of an
ordinary call shows that none was made.
"""

import pytest
import torch
from torch import nn

import geosharp as gs


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
}


#: Not yet placed by construction: a symmetry block's index tables are built on the host and
#: moved to the *first* parameter's device, and the base point of the blocks is gathered from
#: one flat concatenation of every parameter (``ParameterSpace.flatten``): on a model split
#: across devices (``device_map="auto"``) both would be wrong. Strict: a fix turns them green.
NOT_YET = {"geodesic-inv", "geodesic-mix", "geodesic-exact", "average"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=pytest.mark.xfail(
                strict=True, reason="block index tables built on the host (see NOT_YET)"
            ),
        )
        if n in NOT_YET
        else n
        for n in sorted(CALLS)
    ],
)
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


@pytest.mark.parametrize(
    "measure",
    [
        "adaptive",
        pytest.param(
            "geodesic",
            marks=pytest.mark.xfail(
                strict=True, reason="block index tables built on the host (see NOT_YET)"
            ),
        ),
    ],
)
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
