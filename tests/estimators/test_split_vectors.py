"""Curvature's flat vectors on a model split across devices (issue 27).

On a model whose parameters lie on several devices, :class:`~geosharp.estimators.hessian.Flat`
keeps one flat tensor per run of one device (:class:`SplitVector`) instead of one concatenation.
A CPU machine has one device, so these tests cut the runs of a one-device model by hand and
check that Lanczos, Hutchinson and the exact trace give the values of the plain flat vectors
(float64; only the order of the dot products' sums differs).
"""

import importlib
import math

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators.hessian import Flat, SplitVector

from .test_device_placement import _batches, _model  # the same tiny encoder and batches

# the module (the package exports a function of the same name)
curvature_module = importlib.import_module("geosharp.estimators.curvature")


class _CutFlat(Flat):
    """A :class:`Flat` whose leaves are cut into runs of at most two leaves, as if on devices."""

    def __init__(self, template, dtype):
        super().__init__(template, dtype)
        n = sum(count for _, count in self.runs)
        self.runs = [(self.device, min(2, n - k)) for k in range(0, n, 2)]
        assert self.split  # these tests' models have more than two leaves


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
@pytest.mark.parametrize("trace_method", ["hutchinson", "exact"])
def test_split_flat_vectors_give_the_values_of_plain_ones(monkeypatch, measure, trace_method):
    kw = dict(
        measure=measure,
        quantities=("lambda_max", "lambda_min", "trace"),
        trace_method=trace_method,
        iters=12,
        probes=4,
        progress=False,
    )
    ce = nn.functional.cross_entropy
    want = gs.curvature(_model(), ce, _batches(), **kw)
    monkeypatch.setattr(curvature_module, "Flat", _CutFlat)
    got = gs.curvature(_model(), ce, _batches(), **kw)
    for q in kw["quantities"]:
        assert math.isclose(got.values[q], want.values[q], rel_tol=1e-9, abs_tol=1e-12), q
    for a, b in zip(got.eigenvalues, want.eigenvalues, strict=True):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert got.lanczos_iters == want.lanczos_iters


def test_split_vector_arithmetic():
    a = SplitVector([torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0])])
    b = SplitVector([torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([2.0])])
    assert float(a @ b) == 0.5 - 2.0 + 6.0
    c = (a * 2.0).clone().sub_(b / 0.5)
    assert [p.tolist() for p in c.parts] == [[1.0, 6.0], [2.0]]
    assert a.numel() == 3 and a.dtype == torch.float64 and a.any()
    assert not SplitVector([torch.zeros(2), torch.zeros(1)]).any()
