"""The pieces a sharded model's ranks draw their noise with (geosharp.estimators.sharded.draws).

The ranks replay the unsharded stream chunk by chunk (:func:`stream`): CPU ``torch.randn``
fills 16 numbers at a time, so chunks that are multiples of 16 (the last one at least 16)
give the numbers of one draw, and leave the generator where it does. Then each piece's
geometry turns standard normals into its noise (:func:`from_normals`) exactly as its
``random_tangent`` does. The sharded values themselves are compared with one process in
``test_fsdp.py``.
"""

import math

import pytest
import torch

from geosharp.estimators.perturbation import Perturbation
from geosharp.estimators.sharded.draws import from_normals, normal_draws, stream
from geosharp.symmetry import find_symmetries

from ..symmetry.cases import bert_case, llama_case


@pytest.mark.parametrize("sampler", [torch.randn, torch.rand])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_draw_in_chunks_is_the_draw_at_once(sampler, dtype):
    for n in [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 100, 161, 1000]:
        for chunk in (16, 32, 48):
            g = torch.Generator().manual_seed(n)
            whole = sampler(n, generator=g, dtype=dtype)
            after = torch.rand(4, generator=g)
            g = torch.Generator().manual_seed(n)
            parts = list(stream(n, g, dtype, sampler, chunk))
            assert [s for s, _ in parts] == [
                sum(z.numel() for _, z in parts[:i]) for i in range(len(parts))
            ]
            assert all(z.numel() == chunk for _, z in parts[:-1])
            assert not parts or parts[-1][1].numel() >= min(16, n)
            got = torch.cat([z for _, z in parts]) if parts else whole
            assert torch.equal(got, whole), (n, chunk)
            assert torch.equal(torch.rand(4, generator=g), after), (n, chunk)


def test_chunks_that_are_not_multiples_of_16_differ():
    """Why the chunks are multiples of 16: a draw of 24 then 40 is not one of 64."""
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(64, generator=g, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(k, generator=g, dtype=torch.float64) for k in (24, 40)]
    assert not torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="multiple of 16"):
        next(stream(64, g, torch.float64, chunk=24))


@pytest.mark.parametrize(
    "make, kw",
    [
        (bert_case, {"measure": "geodesic", "metric": "inv"}),
        (bert_case, {"measure": "geodesic", "metric": "mix", "corrected_norm": False}),
        (bert_case, {"measure": "geodesic", "metric": "adaptive", "order": 1}),
        (bert_case, {"measure": "adaptive"}),
        (bert_case, {"measure": "euclidean"}),
        (llama_case, {"measure": "geodesic", "metric": "inv"}),  # rotary blocks
    ],
)
def test_from_normals_is_random_tangent(make, kw):
    """Every piece: the normals of :func:`normal_draws`, drawn plainly, give its noise exactly."""
    model = make().build()
    space = find_symmetries(model)
    pert = Perturbation(space, dict(model.named_parameters()), **kw)
    kinds = set()
    for p in pert.pieces:
        g = p.norm_geometry
        kinds.add(type(g).__name__)
        want = g.random_tangent(torch.Generator().manual_seed(3), 0.7)
        gen = torch.Generator().manual_seed(3)
        z = []
        for shapes, dtype in normal_draws(g):
            flat = torch.randn(sum(s.numel() for s in shapes), generator=gen, dtype=dtype)
            parts = flat.split([s.numel() for s in shapes])
            z += [t.view(s) for t, s in zip(parts, shapes, strict=True)]
        got = from_normals(g, z, 0.7)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (p.name, type(g).__name__)
    assert kinds  # the pieces of the measure were compared
    if kw.get("metric") in ("inv", "mix") and kw.get("corrected_norm", True):
        assert any("GL" in k for k in kinds), kinds


def test_the_global_rest_layout_is_the_spaces():
    """``_rest_layout`` (no mask of a whole parameter) lists what ``rest_layout`` does."""
    from torch import nn

    from geosharp.estimators.sharded.draws import _rest_layout
    from geosharp.symmetry import declare_block

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q", nn.Linear(8, 8))
    model.add_module("v", nn.Linear(8, 8))
    model.add_module("head", nn.Linear(8, 3))
    block = declare_block(  # half of q's and v's rows: those two partly in a block
        model,
        name="half[QV]",
        g=[("q.weight", 0, 0, 4), ("q.bias", 0, 0, 4)],
        h=[("v.weight", 0, 2, 6)],
        head_dim=4,
    )
    spaces = [
        find_symmetries(model, adapters=[], extra_blocks=[block]),
        find_symmetries(bert_case().build()),
        find_symmetries(llama_case().build()),
    ]
    partial = 0
    for space in spaces:
        want, got = space.rest_layout(), _rest_layout(space)
        assert [j for j, _ in got] == [j for j, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                partial += 1
                assert torch.equal(a, b)
    assert partial == 3  # q.weight, q.bias, v.weight


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_simulated_ranks_keep_their_part_of_the_rest_draw(world, chunk):
    """The coordinates outside blocks, parameters partly in blocks, sharded along 0 or 1.

    Every simulated rank replays the stream (small chunks: the chunks cut the parameters and
    their rows anywhere) and keeps its coordinates; the reference reads each of them off one
    draw of the whole stream by its global position.
    """
    from types import SimpleNamespace

    from geosharp.estimators.sharded import draws as sharded_draws
    from geosharp.estimators.sharded.space import _Layout

    shapes = [(8, 6), (5,), (3, 4, 2), (6, 5), (2, 6, 3)]
    dims = [1, 0, 0, 1, 1]
    offsets = [0, 48, 53, 77, 107]
    # global rest: param 0 without its rows 1 and 2, param 1 whole, param 2 without its first
    # 5, params 3 and 4 whole
    rest0 = torch.tensor([q for q in range(48) if q // 6 not in (1, 2)])
    rest_global = [(0, rest0), (1, None), (2, torch.arange(5, 24)), (3, None), (4, None)]
    stream_of = {}  # (param, flat position in it) → position in the unsharded stream
    s = 0
    for j, local in rest_global:
        for q in range(math.prod(shapes[j])) if local is None else local.tolist():
            stream_of[(j, q)] = s
            s += 1
    whole = torch.randn(s, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    seen = set()
    for rank in range(world):
        layouts, locals_, local_offset = [], [], 0
        for shape, dim, off in zip(shapes, dims, offsets, strict=True):
            size = shape[dim]
            start = min(size, rank * -(-size // world))  # torch.chunk's split (maybe empty)
            length = max(0, min(size, start + -(-size // world)) - start)
            layouts.append(_Layout(off, shape, dim, start, length, local_offset))
            local_shape = list(shape)
            local_shape[dim] = length
            locals_.append(torch.zeros(local_shape))
            local_offset += math.prod(local_shape)
        # the rank's rest layout: the global rest positions it holds, as local flat positions
        rest_rank, where = [], []
        for j, local in rest_global:
            qs = torch.arange(math.prod(shapes[j])) if local is None else local
            held, p = layouts[j].local(qs + offsets[j])
            mine = p[held] - layouts[j].local_offset
            if not mine.numel():
                continue
            everything = mine.numel() == locals_[j].numel()
            rest_rank.append((j, None if everything else mine))
            where += [stream_of[(j, int(q))] for q in qs[held]]
        shards = SimpleNamespace(names=("a", "b", "c", "d", "e"), locals=locals_)
        space = SimpleNamespace(shapes=[torch.Size(t) for t in shapes])
        draw = sharded_draws._rest_draw(space, layouts, rest_global, rest_rank, shards)
        gen = torch.Generator().manual_seed(5)
        got = draw.replay(gen, torch.float64, torch.randn, chunk=chunk)
        assert torch.equal(got, whole[torch.tensor(where, dtype=torch.long)]), rank
        seen.update(where)
    assert seen == set(range(s))  # the ranks hold every coordinate once


@pytest.mark.parametrize("chunk", [16, 48])
def test_rows_of_a_block_land_at_the_ranks_rows(chunk):
    """A GL-type field: every head's held rows at the rank's rows, in order; padding stays 0."""
    from geosharp.estimators.sharded.draws import _Draw, _Rows

    heads, n, h, here = 3, 5, 3, 3  # the rank's field: 3 heads × 3 rows (padded) × 3
    held = torch.tensor(
        [[1, 0, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool
    )  # head 0: 2 rows (one padding row), head 1: 3, head 2: 1 (two padding rows)
    first = torch.arange(heads).unsqueeze(1) * here
    dest = torch.where(held, first + torch.cumsum(held, 1) - 1, -1).reshape(-1)
    offset = 7  # the field after another one in the rank's buffer
    draw = _Draw([_Rows(dest, h, offset, heads * here)], offset + heads * here * h)
    got = draw.replay(torch.Generator().manual_seed(2), torch.float64, torch.randn, chunk=chunk)
    whole = torch.randn(
        heads, n, h, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    want = torch.zeros(heads, here, h, dtype=torch.float64)
    for b in range(heads):
        rows = whole[b][held[b]]
        want[b, : rows.shape[0]] = rows
    assert torch.equal(got[:offset], torch.zeros(offset, dtype=torch.float64))
    assert torch.equal(got[offset:].view(heads, here, h), want)
