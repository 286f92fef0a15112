"""The clean gradient from the model's own parameters, and the cache of several base points."""

import math

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.estimators.cache import CACHE, BasePointCache, clear_cache
from geosharp.estimators.harness import Objective
from geosharp.estimators.perturbation import Perturbation
from geosharp.models import VisionTransformer

DT = torch.float64


def _layer(dtype=DT):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(dtype)
    x = torch.randn(3, 5, 8, dtype=dtype)
    return layer, [(x, torch.randn(3, 5, 8, dtype=dtype))]


def _objective(model, batches, pert):
    x, y = batches[0]
    f = Objective(model, nn.functional.mse_loss, pert, x, y)
    return f, f.counter


CASES = [
    dict(measure="geodesic", metric="inv", order=2),
    dict(measure="geodesic", metric="mix", order=2),
    dict(measure="geodesic", metric="inv", order=1),
    dict(measure="geodesic", metric="adaptive", order=1),
    dict(measure="geodesic", metric="mix", order=2, perturb="blocks"),
    dict(measure="geodesic", metric="inv", order=2, work_dtype=True),
    dict(measure="adaptive"),
    dict(measure="euclidean"),
]


@pytest.mark.parametrize("dtype", [DT, torch.float32])
@pytest.mark.parametrize("key_bias", ["quotient", "keep"])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_clean_gradient_from_the_parameters_is_the_gradient_through_the_endpoint(
    kw, key_bias, dtype
):
    layer, batches = _layer(dtype)
    kw = dict(kw)
    if kw.pop("work_dtype", None) is not None:
        if dtype == DT:
            pytest.skip("low_memory is the float64 default for a float64 model")
        kw["work_dtype"] = dtype  # low_memory: the GL tangents in the model's dtype
    adapters = [] if kw["measure"] != "geodesic" else None
    space = (
        gs.find_symmetries(layer, key_bias=key_bias)
        if adapters is None
        else gs.find_symmetries(layer, adapters=[], key_bias=key_bias)
    )
    named = dict(layer.named_parameters())
    pert = Perturbation(space, {n: named[n].detach() for n in space.param_names}, **kw)
    assert pert.pulls_back
    f, counter = _objective(layer, batches, pert)
    ref_loss, ref = f(pert.zeros(), True, False)
    loss, got = f.clean(True)
    assert loss == ref_loss
    assert counter == {"forward": 2, "backward": 2}
    assert len(got) == len(ref)
    for p, a, b in zip(pert.pieces, got, ref, strict=True):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert u.dtype == v.dtype == p.geometry.tangent_dtype and u.shape == v.shape
            assert torch.equal(u, v), p.name
    # the ascent starts from the same direction
    da = pert.riemannian_grad(got)
    db = pert.riemannian_grad(ref)
    for a, b in zip(da, db, strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)


def test_exact_order_and_diagonal_pairs_keep_the_gradient_through_the_endpoint():
    layer, _ = _layer()
    space = gs.find_symmetries(layer)
    named = dict(layer.named_parameters())
    base = {n: named[n].detach() for n in space.param_names}
    assert not Perturbation(space, base, metric="inv", order="exact").pulls_back
    from geosharp.models import DiagonalNet

    net = DiagonalNet(5).double()
    dspace = gs.find_symmetries(net)
    dnamed = dict(net.named_parameters())
    dbase = {n: dnamed[n].detach() for n in dspace.param_names}
    assert not Perturbation(dspace, dbase, metric="inv", order=2).pulls_back


@pytest.mark.parametrize("measure", ["geodesic", "adaptive"])
def test_sharpness_unchanged_by_the_clean_shortcut(measure, monkeypatch):
    torch.manual_seed(0)  # the passes below depend on the weights: the same ones in every run
    model = VisionTransformer(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=1, num_heads=2
    ).to(DT)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 8, 8, dtype=DT, generator=g), torch.tensor([0, 1, 2, 0])
    kw = dict(measure=measure, rho=0.05, steps=6, cache=False)
    fast = gs.sharpness(model, nn.functional.cross_entropy, [(x, y)], **kw)
    monkeypatch.setattr(Perturbation, "pulls_back", property(lambda self: False))
    slow = gs.sharpness(model, nn.functional.cross_entropy, [(x, y)], **kw)
    assert fast.value == slow.value and fast.traces == slow.traces
    assert (fast.n_forward, fast.n_backward) == (slow.n_forward, slow.n_backward)
    # 6 steps: 7 forwards and 6 backwards, one fewer where a checkpoint restarts from an older
    # best iterate (the backward whose gradient the restart would discard is skipped)
    assert fast.n_forward == 7 and fast.n_backward in (5, 6)


def test_alternating_measures_are_all_served_from_the_cache():
    layer, batches = _layer()
    clear_cache()
    runs = [
        dict(measure="adaptive"),
        dict(metric="inv"),
        dict(metric="mix"),
        dict(metric="inv", kind="average", samples=2),
    ]
    first = [gs.sharpness(layer, nn.functional.mse_loss, batches, steps=2, **kw) for kw in runs]
    again = [gs.sharpness(layer, nn.functional.mse_loss, batches, steps=2, **kw) for kw in runs]
    assert [r.settings["cached_base_point"] for r in first] == [False, False, False, True]
    assert all(r.settings["cached_base_point"] for r in again)
    assert [r.value for r in first] == [r.value for r in again]
    clear_cache()
    assert len(CACHE) == 0


def test_cache_keeps_the_most_recently_used_entries_and_drops_stale_ones():
    cache = BasePointCache(max_entries=2)
    built = []

    def build(tag):
        def make():
            built.append(tag)
            return tag

        return make

    layer, _ = _layer()
    assert cache.get("k", layer, "a", build("a")) == ("a", False)
    assert cache.get("k", layer, "b", build("b")) == ("b", False)
    assert cache.get("k", layer, "a", build("a")) == ("a", True)  # a is now the most recent
    assert cache.get("k", layer, "c", build("c")) == ("c", False)  # evicts b
    assert cache.get("k", layer, "a", build("a")) == ("a", True)
    assert cache.get("k", layer, "b", build("b")) == ("b", False)
    assert built == ["a", "b", "c", "b"] and len(cache) == 2
    other, _ = _layer()
    assert cache.get("k", other, "a", build("a2")) == ("a2", False)  # per model
    with torch.no_grad():
        layer.linear1.weight.add_(1.0)  # every entry of `layer` is stale now
    assert cache.get("k", other, "a", build("x")) == ("a2", True)
    assert cache.get("k", layer, "a", build("a3")) == ("a3", False)
    assert len(cache) == 2  # the stale ones were dropped, not kept beside
    del other
    import gc

    gc.collect()
    cache.get("k", layer, "d", build("d"))
    assert len(cache) == 2  # ("a3", "d"): the dead model's entry is gone
    with pytest.raises(ValueError, match="max_entries"):
        BasePointCache(max_entries=0)
    assert math.isfinite(cache.hits + cache.misses)
