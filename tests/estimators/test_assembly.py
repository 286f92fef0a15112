"""The perturbed parameters built through views of the blocks' layouts, on every architecture.

:class:`~geosharp.estimators.assembly._Assembly` writes the symmetry pieces into the Q/K/V/O
parameters through :func:`~geosharp.symmetry.specs.slice_view` (no position tensor held) when
the blocks' positions are recipes it can view, and falls back to a gather index otherwise. Both
must give the same parameters, the same gradients and the same pull-back, bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch

import geosharp as gs
from geosharp.estimators import assembly, factor_plan
from geosharp.estimators.assembly import _Assembly
from geosharp.estimators.perturbation import Perturbation
from geosharp.symmetry import GLBlock, ParameterSpace
from geosharp.symmetry.specs import ParamSlice, slice_positions, slice_view

from ..symmetry.cases import CASE_IDS, CASES
from ..symmetry.test_architectures import CASES as ARCH

MODELS = {**dict(zip(CASE_IDS, CASES, strict=True)), **ARCH}


def _perturbation(model):
    space = gs.find_symmetries(model)
    base = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return space, Perturbation(space, base, measure="geodesic", metric="inv", eps=1e-6)


def _random(parts, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in x) for x in parts]


@pytest.mark.parametrize("name", list(MODELS))
def test_views_and_index_build_the_same_parameters(name):
    model = MODELS[name]().build()
    space, pert = _perturbation(model)
    asm = pert._assembly
    ref = _Assembly(space, pert.pieces, pert.rest_index, pert._layout, torch.device("cpu"))
    assert ref.plan is None and (ref.index is not None or not ref.gathered)
    if asm.gathered:  # every layout found is a view: no index held
        assert asm.plan is not None and asm.index is None, name
    moved = pert._moved(_random(pert.zeros(), 1))
    leaves = [tuple(t.requires_grad_(True) for t in x) for x in moved]
    a, b = asm(leaves), ref(leaves)
    assert list(a) == list(b) == list(space.param_names)
    weights = _random([tuple(b.values())], 2)[0]
    grads = []
    for out in (a, b):
        assert all(torch.equal(out[n], b[n]) for n in out)
        total = sum((w * t).sum() for w, t in zip(weights, out.values(), strict=True))
        flat = [t for x in leaves for t in x]
        grads.append(torch.autograd.grad(total, flat, allow_unused=True))
    for ga, gb in zip(*grads, strict=True):
        assert (ga is None) == (gb is None)
        assert ga is None or torch.equal(ga, gb)
    pa, pb = asm.pull_back(pert.pieces, weights), ref.pull_back(pert.pieces, weights)
    for xa, xb in zip(pa, pb, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(xa, xb, strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_written_parts_adjoint_is_the_views_own_to_second_order(name, monkeypatch):
    """``_WriteParts`` (one read per part in the backward) against autograd through the views.

    The same first-order gradient bit for bit, and with ``create_graph=True`` the same
    derivative of that gradient in the weights it was taken against (``A u`` for ``g = Aᵀw``).
    """
    model = MODELS[name]().build()
    _, pert = _perturbation(model)
    asm = pert._assembly
    if asm.plan is None:
        pytest.skip("no parameter holds block coordinates")
    moved = pert._moved(_random(pert.zeros(), 4))
    names = [pert.space.param_names[j] for j in asm.gathered]
    shapes = [asm.shapes[j] for j in asm.gathered]
    calls = []
    real = assembly._WriteParts.apply
    monkeypatch.setattr(assembly._WriteParts, "apply", lambda *a: calls.append(1) or real(*a))
    results = []
    for hand in (True, False):
        if not hand:
            monkeypatch.setattr(assembly, "_reverse_mode_only", lambda inputs: False)
        leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in moved]
        flat = [t for x in leaves for t in x]
        w = [t.requires_grad_(True) for t in _random([tuple(torch.empty(s) for s in shapes)], 5)[0]]
        out = asm(leaves)
        total = sum((a * out[n]).sum() for a, n in zip(w, names, strict=True))
        g = torch.autograd.grad(total, flat, create_graph=True, allow_unused=True)
        u = _random([tuple(flat)], 6)[0]
        inner = sum((gi * ui).sum() for gi, ui in zip(g, u, strict=True) if gi is not None)
        results.append((g, torch.autograd.grad(inner, w, allow_unused=True)))
    assert len(calls) == 1  # the first pass went through _WriteParts, the second did not
    (ga, sa), (gb, sb) = results
    for x, y in zip((*ga, *sa), (*gb, *sb), strict=True):
        assert (x is None) == (y is None)
        assert x is None or torch.equal(x, y)


def test_hand_made_positions_keep_the_gather_index():
    """A block built from plain position tensors (no recipe) is assembled by the index."""
    g = torch.arange(24).view(2, 6, 2)
    h = torch.arange(24, 44).view(2, 5, 2)
    space = ParameterSpace(
        ("theta",), (torch.Size([50]),), (0,), [GLBlock("blk", "QK", "", 2, 2, g, h)]
    )
    theta = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pert = Perturbation(space, theta)
    assert pert._assembly.plan is None and pert._assembly.index is not None
    xi = _random(pert.zeros(), 3)
    moved = pert.pieces[0].geometry.geodesic(xi[0])
    out = pert.endpoint(xi)
    assert torch.equal(out[g.reshape(-1)], moved[0].reshape(-1))
    assert torch.equal(out[h.reshape(-1)], moved[1].reshape(-1))


@pytest.mark.parametrize(
    ("shape", "piece", "heads", "head_dim"),
    [
        ((12, 5), ParamSlice("w", 0), 2, 2),
        ((12,), ParamSlice("b", 0), 3, 2),
        ((5, 12), ParamSlice("w", 1), 2, 2),
        ((36, 5), ParamSlice("w", 0, 12, 24), 3, 2),
        ((24, 5), ParamSlice("w", 0, parts=2, part=1), 2, 2),
        ((3, 12, 4), ParamSlice("w", 1), 2, 2),
        ((48, 5), ParamSlice("w", 0, parts=3, part=(0, 2)), 16, 2),  # two heads per unit
        ((48, 5), ParamSlice("w", 0, parts=4, part=(0, 2)), 3, 2),  # two units per block
    ],
)
def test_slice_view_arranges_values_as_slice_positions(shape, piece, heads, head_dim):
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    v = slice_view(t, piece, heads, head_dim)
    assert v is not None  # a view: writing into it writes into t
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert torch.equal(
        v.reshape(heads, -1, head_dim), slice_positions(shape, piece, heads, head_dim)
    )


def test_slice_view_declines_parts_that_do_not_split_into_blocks():
    """Two selected parts per unit, three per block: blocks cut units in half, no view."""
    t = torch.arange(18 * 5).view(18, 5)
    piece = ParamSlice("w", 0, parts=3, part=(0, 2))
    assert slice_positions((18, 5), piece, 2, 2).shape == (2, 15, 2)
    assert slice_view(t, piece, 2, 2) is None


def _rest_layout_from_positions(space):
    """``rest_layout`` read from every block's built positions (the rule before the views)."""
    touched = {}
    for b in space.blocks:
        pos = b.positions().reshape(-1).long()
        owner = space.owners(pos)
        for j in torch.unique(owner).tolist():
            mask = touched.setdefault(j, torch.zeros(space.shapes[j].numel(), dtype=torch.bool))
            mask[pos[owner == j] - space.offsets[j]] = True
    out = []
    for j, shape in enumerate(space.shapes):
        if j not in touched:
            if shape.numel():
                out.append((j, None))
            continue
        local = torch.nonzero(~touched[j]).reshape(-1)
        if local.numel():
            out.append((j, local))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_set_up_through_views_equals_the_positions(name, monkeypatch):
    """The set-up reads the blocks through views of the parameters, with no position built
    (issue 27: a 1.1 B Llama's set-up went from 76 to 9 s): the blocks' base point, the rest
    layout, and, past ``_CHECK_LIMIT``, the assembly checked by its cover instead of a gather
    index, equal what the positions give, bit for bit."""
    from geosharp.estimators.pieces import _block_point, _group_blocks

    model = MODELS[name]().build()
    space, pert = _perturbation(model)
    for b in space.blocks:  # the recipes' shapes, from their arithmetic, are the built ones'
        assert b.index_shapes == tuple(t.shape for t in b.indices), b.name
    named = dict(model.named_parameters())
    params = [named[n].detach() for n in space.param_names]
    groups = _group_blocks(space)
    for (_, blocks), piece in zip(groups, pert.pieces, strict=False):
        want = _block_point(space, type(blocks[0]).batch(blocks), params, params[0].dtype)
        got = piece.geometry.point
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    got_layout, want_layout = space.rest_layout(), _rest_layout_from_positions(space)
    assert [j for j, _ in got_layout] == [j for j, _ in want_layout]
    for (_, a), (_, b) in zip(got_layout, want_layout, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    if not pert._assembly.gathered:
        return
    monkeypatch.setattr(assembly, "_CHECK_LIMIT", 0)
    lean = Perturbation(
        space,
        {n: p for n, p in zip(space.param_names, params, strict=True)},
        measure="geodesic",
        metric="inv",
        eps=1e-6,
    )
    assert lean._assembly.plan is not None and lean._assembly.index is None
    xi = _random(pert.zeros(), 7)
    a, b = pert.endpoint_params(xi), lean.endpoint_params(xi)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_plan_that_misses_coordinates_fails_its_cover_check(monkeypatch):
    """Past ``_CHECK_LIMIT`` a plan is trusted only once it writes every coordinate once."""
    model = MODELS[next(iter(MODELS))]().build()
    _, pert = _perturbation(model)
    asm = pert._assembly
    assert asm.plan is not None
    j = asm.gathered[0]
    asm.mixed_local.append((j, torch.tensor([0])))  # coordinate 0 of parameter j written twice
    with pytest.raises(ValueError, match="do not cover parameter"):
        asm._check_cover(asm.plan, pert.pieces)


@pytest.mark.parametrize("name", ["hf_bert", "hf_llama_gqa_rotary", "phi3_fused_gqa"])
def test_the_cover_check_through_one_table_names_a_parameter_written_twice_or_never(
    name, monkeypatch
):
    """The cover check counts a parameter at a time through one reused table: a plan that
    covers every coordinate once passes (the table is cleared between parameters of different
    sizes), and a coordinate written twice, or never, fails naming its parameter."""
    model = MODELS[name]().build()
    _, pert = _perturbation(model)
    asm = pert._assembly
    assert asm.plan is not None and len(asm.gathered) > 1
    asm._check_cover(asm.plan, pert.pieces)  # once each: passes
    j = asm.gathered[-1]  # after every other parameter has used the table
    size = asm.shapes[j].numel()
    asm.mixed_local.append((j, torch.tensor([size - 1])))  # its last coordinate written twice
    with pytest.raises(ValueError, match=re.escape(f"cover parameter {asm.names[j]!r} once")):
        asm._check_cover(asm.plan, pert.pieces)
    asm.mixed_local.pop()
    split = factor_plan._Factor.split
    dropped: list[int] = []

    def lose_last(self, t):  # every factor's last part written by nothing
        out = split(self, t)
        dropped.append(out[-1][1].param)
        return out[:-1]

    monkeypatch.setattr(factor_plan._Factor, "split", lose_last)
    with pytest.raises(ValueError, match="do not cover parameter") as err:
        asm._check_cover(asm.plan, pert.pieces)
    never = next(g for g in asm.gathered if g in dropped)  # the first one checked
    assert repr(asm.names[never]) in str(err.value)


@pytest.mark.parametrize("name", list(MODELS))
def test_transposed_parts_read_a_head_at_a_time_are_the_same_copy(name, monkeypatch):
    """``read_parts`` copies a transposed part (Q/K/V rows read as ``(heads, in, h)``) a 2-D
    slice at a time, for ATen's blocked transpose: the same values as one copy of the view."""
    from geosharp.estimators.pieces import _group_blocks

    model = MODELS[name]().build()
    space = gs.find_symmetries(model)
    named = dict(model.named_parameters())
    params = [named[n].detach() for n in space.param_names]
    sliced = []
    transposed = factor_plan._transposed

    def spy(dst, src):
        sliced.append(transposed(dst, src))
        return sliced[-1]

    for _, blocks in _group_blocks(space):
        plan = factor_plan._factor_plan(space, blocks)
        if plan is None:
            continue
        for f, shape in zip(plan, factor_plan.batched_shapes(blocks), strict=True):
            monkeypatch.setattr(factor_plan, "_transposed", lambda d, s: False)
            want = factor_plan.read_parts(f, params, shape, params[0].dtype, params[0].device)
            monkeypatch.setattr(factor_plan, "_BLOCKED_MIN", 0)  # the small models' parts too
            monkeypatch.setattr(factor_plan, "_transposed", spy)
            got = factor_plan.read_parts(f, params, shape, params[0].dtype, params[0].device)
            assert torch.equal(got, want)
    if name in ("hf_llama_gqa_rotary", "hf_bert"):
        assert any(sliced)  # their Q/K parts took the sliced copy


@pytest.mark.parametrize(
    "name",
    ["hf_bert", "hf_llama_gqa_rotary", "hf_gpt2", "falcon_multi_query_rotary", "phi3_fused_gqa"],
)
def test_no_position_is_built_by_the_set_up_past_the_check_limit(name, monkeypatch):
    """Finding the blocks, laying out the rest, reading the blocks' base point and checking
    the assembly's plan use views of the parameters only: no block position is built (a
    1.1 B Llama's positions were 1.7 GB of int64 per pass)."""
    from geosharp.symmetry.positions import Positions

    model = MODELS[name]().build()

    def build(self):
        raise AssertionError("a block position was built")

    monkeypatch.setattr(Positions, "_build", build)
    monkeypatch.setattr(assembly, "_CHECK_LIMIT", 0)
    space = gs.find_symmetries(model)
    base = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    pert = Perturbation(space, base, measure="geodesic", metric="inv", eps=1e-6)
    assert pert._assembly.plan is not None and space.blocks


@pytest.mark.parametrize("name", list(MODELS))
def test_the_ranges_of_a_factor_are_where_its_split_views_lie(name):
    """``_Factor.ranges`` (heads and rows of every part, what the sharded endpoint writes from)
    names the same slices of the component as ``split`` views, in the same order."""
    model = MODELS[name]().build()
    _, pert = _perturbation(model)
    asm = pert._assembly
    if asm.plan is None:
        pytest.skip("no plan")
    for k, factors in zip(asm.sym_pieces, asm.plan, strict=True):
        for c, factor in enumerate(factors):
            if factor.flat is not None:
                with pytest.raises(ValueError, match="flat"):
                    factor.ranges()
                continue
            if pert.pieces[k].geometry.point[c].dim() != 3:  # GL pieces: (heads, rows, h)
                continue
            comp = torch.arange(pert.pieces[k].geometry.point[c].numel()).view(
                pert.pieces[k].geometry.point[c].shape
            )
            views = factor.split(comp)
            ranges = factor.ranges()
            assert len(views) == len(ranges)
            for (v, part), (heads, rows, p) in zip(views, ranges, strict=True):
                assert p is part
                assert torch.equal(v, comp[heads] if rows is None else comp[heads, rows])


@pytest.mark.parametrize("name", list(MODELS))
def test_heads_read_from_the_parameters_are_slices_of_the_point(name):
    """``read_heads`` (what a sharded model's geometry reads its point through, a chunk of heads
    at a time) equals the heads of the blocks' base point, for chunks cutting the parts'
    ranges of heads anywhere, in the point's dtype and widened."""
    model = MODELS[name]().build()
    space, pert = _perturbation(model)
    asm = pert._assembly
    if asm.plan is None:
        pytest.skip("no plan")
    named = dict(model.named_parameters())
    tensors = [named[n].detach() for n in space.param_names]
    checked = 0
    for k, factors in zip(asm.sym_pieces, asm.plan, strict=True):
        for factor, point in zip(factors, pert.pieces[k].geometry.point, strict=True):
            if factor.flat is not None or point.dim() != 3:
                continue
            n = point.shape[0]
            for per in (1, 2, 3, n):
                for lo in range(0, n, per):
                    sl = slice(lo, min(lo + per, n))
                    shape, dtype = point.shape, point.dtype
                    got = factor_plan.read_heads(factor, tensors, sl, shape, dtype, "cpu")
                    assert torch.equal(got, point[sl])
                    checked += 1
            wide = factor_plan.read_heads(
                factor, tensors, slice(None), point.shape, torch.float64, "cpu"
            )
            assert torch.equal(wide, point.double())
    if not checked:
        pytest.skip("no (heads, rows, h) component")
