"""The symmetry blocks of a sharded model laid out on one rank's rows (SPEC §10.3, §10.6).

No process group is needed: a rank's share of every parameter is a slice along its sharded
dimension, made here by hand (:class:`_Layout`), as FSDP2 makes it (``torch.chunk``). The
end-to-end check under FSDP2 (worlds 1, 2 and 4, values equal to the unsharded ones) is
``test_fsdp.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from geosharp import find_symmetries, shard_placement
from geosharp.estimators.sharded.space import _Layout, _padded, _rows

pytest.importorskip("torch.distributed.tensor")


def tiny_bert(heads: int = 2) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=heads,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    model = BertModel(cfg).double().eval()
    with torch.no_grad():  # every value distinct (BERT's biases start at zero)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype))
    return model


def layouts(space, dims: dict[str, int], rank: int, world: int) -> list[_Layout]:
    """Rank ``rank``'s slice of every parameter along ``dims[name]`` (default 0), chunked."""
    out, local_start = [], 0
    for name, shape, off in zip(space.param_names, space.shapes, space.offsets, strict=True):
        d = dims.get(name, 0)
        chunk = math.ceil(shape[d] / world)
        start = min(rank * chunk, shape[d])
        length = min(chunk, shape[d] - start)
        out.append(_Layout(off, tuple(shape), d, start, length, local_start))
        local_start += math.prod(shape) // shape[d] * length
    return out


def local_vector(model, space, lay: list[_Layout]) -> torch.Tensor:
    named = dict(model.named_parameters())
    parts = [
        named[n].detach().narrow(x.dim, x.start, x.length).reshape(-1)
        for n, x in zip(space.param_names, lay, strict=True)
    ]
    return torch.cat(parts)


def test_shard_placement_splits_the_projections_whose_rows_are_input_features():
    model = tiny_bert()
    place = shard_placement(model)
    want = {f"encoder.layer.0.attention.self.{p}.weight" for p in ("query", "key", "value")}
    assert set(place.parameters) == want
    named = dict(model.named_parameters())
    assert place(named["encoder.layer.0.attention.self.query.weight"]).dim == 1
    assert place(named["encoder.layer.0.attention.output.dense.weight"]) is None  # W_o: dim 0


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holds_whole_rows_and_reads_them_where_they_are(world):
    """With the placement, every rank's rows of every head gather the global rows' values.

    4 heads of 4: the bias rows of ``b_q`` and ``b_v`` lie whole on one rank at worlds 2 and 4.
    """
    model = tiny_bert(heads=4)
    space = find_symmetries(model)
    dims = dict.fromkeys(shard_placement(model).parameters, 1)
    theta = space.flatten_module(model).detach()
    seen: dict = {}
    for rank in range(world):
        lay = layouts(space, dims, rank, world)
        mine = local_vector(model, space, lay)
        for b in space.gl_blocks:
            for field in b.index_fields:
                local, count = _rows(b, field, space, lay)
                glob = getattr(b, field).tensor()
                for head in range(glob.shape[0]):
                    got = mine[local[head, : int(count[head])]]
                    for row in got:  # the one global row of this head with these values
                        match = [
                            i
                            for i in range(glob.shape[1])
                            if torch.equal(theta[glob[head, i]], row)
                        ]
                        assert len(match) == 1
                        seen.setdefault((b.name, field, head), []).append(match[0])
    for key, rows in seen.items():  # every row on exactly one rank, in order
        b = next(x for x in space.gl_blocks if x.name == key[0])
        assert sorted(rows) == list(range(getattr(b, key[1]).shape[1])), key


def test_a_row_split_across_ranks_is_refused_in_one_line():
    """FSDP's default placement cuts ``W_q``'s head columns at 4 ranks of 2 heads of 8."""
    model = tiny_bert()
    space = find_symmetries(model)
    lay = layouts(space, {}, 0, 4)
    qk = next(b for b in space.gl_blocks if b.kind == "QK")
    with pytest.raises(ValueError, match=r"split across ranks.*shard_placement") as err:
        _rows(qk, "g_index", space, lay)
    assert "\n" not in str(err.value)


def test_padding_rows_get_fresh_positions():
    local = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [-1, -1]]])
    index, nxt = _padded(local, torch.tensor([2, 1]), 3, 100)
    assert nxt == 100 + 3 * 2  # head 0: one pad row, head 1: two
    assert index[0, :2].tolist() == [[0, 1], [2, 3]] and index[1, 0].tolist() == [4, 5]
    pads = torch.cat([index[0, 2], index[1, 1:].reshape(-1)])
    assert sorted(pads.tolist()) == list(range(100, 106))


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    return LlamaModel(cfg).double().eval()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_unpadded_factors_are_recipes_of_the_local_shards(world):
    """With the placement, every factor is a recipe (no position tensor).

    The recipe's positions are the rank's own (``_rows``) where no head is padded; a factor
    with a bias row held by some ranks only (BERT's ``G`` of Q/K and V/O at worlds 2 and 4)
    is a recipe too, of the local ``b_q`` and slices of ``PAD`` (checked in
    ``test_padded_factors_are_recipes_of_the_shards_and_of_pad``).
    """
    from geosharp.estimators.sharded.space import _local_blocks
    from geosharp.symmetry.positions import Positions

    for model, recipes_only in ((tiny_llama(), True), (tiny_bert(heads=4), True)):
        space = find_symmetries(model)
        dims = dict.fromkeys(shard_placement(model).parameters, 1)
        for rank in range(world):
            lay = layouts(space, dims, rank, world)
            n_local = sum(math.prod(x.shape) // x.shape[x.dim] * x.length for x in lay)
            blocks, _ = _local_blocks(space, lay, n_local)
            kinds = set()
            gl = {b.name: b for b in space.gl_blocks}
            for local in blocks:
                if local.name not in gl:  # a key-bias translation, held fixed
                    continue
                for field in local.index_fields:
                    pos = getattr(local, field)
                    kinds.add(type(pos) is Positions)
                    mine, count = _rows(gl[local.name], field, space, lay)
                    if type(pos) is Positions and bool((count == mine.shape[1]).all()):
                        assert torch.equal(pos.tensor().long(), mine), (field, rank)
            assert kinds == ({True} if recipes_only else {True, False}), (model, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_padded_factors_are_recipes_of_the_shards_and_of_pad(world):
    """BERT's bias rows held by some ranks only: every factor a recipe, ``_padded``'s positions.

    The ``G`` of a Q/K (V/O) head is its ``W_q`` rows here, then its bias row: a slice of the
    local ``b_q`` for the heads held here, slices of the ``PAD`` vector for the others (numbered
    as ``_padded`` numbers them); a key-bias translation keeps the rank's slice of ``b_k``. The
    local space's assembly writes them all through views (a plan, no gather index).
    """
    from geosharp.estimators.factor_plan import _factor_plan
    from geosharp.estimators.sharded.space import PAD, _local_blocks
    from geosharp.symmetry import ParameterSpace
    from geosharp.symmetry.blocks import TranslationBlock
    from geosharp.symmetry.positions import Positions

    model = tiny_bert(heads=4)
    space = find_symmetries(model)
    dims = dict.fromkeys(shard_placement(model).parameters, 1)
    gl = {b.name: b for b in space.gl_blocks}
    for rank in range(world):
        lay = layouts(space, dims, rank, world)
        n_local = sum(math.prod(x.shape) // x.shape[x.dim] * x.length for x in lay)
        blocks, n_pad = _local_blocks(space, lay, n_local)
        assert n_pad > 0
        pad_next, ranged = n_local, 0
        for local in blocks:
            for field in local.index_fields:
                pos = getattr(local, field)
                assert type(pos) is Positions, (local.name, field, rank)
                if isinstance(local, TranslationBlock):
                    continue
                mine, count = _rows(gl[local.name], field, space, lay)
                want, pad_next = _padded(mine, count, mine.shape[1], pad_next)
                assert torch.equal(pos.tensor().long(), want.long()), (local.name, field, rank)
                ranged += any(r != (0, 4) for r in pos.head_ranges)
                for shape, piece, off in pos.recipe[0]:  # PAD's parts: its whole length
                    if piece.param == PAD:
                        assert shape == (n_pad,) and off == n_local
        assert pad_next == n_local + n_pad and ranged == 2  # G of Q/K and of V/O
        base = [
            (n, (*x.shape[: x.dim], x.length, *x.shape[x.dim + 1 :]))
            for n, x in zip(space.param_names, lay, strict=True)
        ]
        local_space = ParameterSpace(
            (*(n for n, _ in base), PAD),
            (*(s for _, s in base), (n_pad,)),
            (*(x.local_offset for x in lay), n_local),
            blocks=blocks,
        )
        groups: dict = {}
        for b in blocks:
            groups.setdefault(b.batch_key(), []).append(b)
        # written through the plan's views, every position lands on itself; read back from a
        # gradient that is zero on PAD, the padding rows read zero
        flat = torch.full((n_local + n_pad,), -1, dtype=torch.long)
        params = [
            flat[o : o + math.prod(s)].view(s)
            for s, o in zip(local_space.shapes, local_space.offsets, strict=True)
        ]
        for g in groups.values():
            plan = _factor_plan(local_space, g)
            assert plan is not None
            for factor, field in zip(plan, g[0].index_fields, strict=True):
                batched = torch.cat([getattr(b, field).tensor().long() for b in g])
                for t, part in factor.split(batched.reshape(factor_shape(factor, g, field))):
                    dest = part.view(params[part.param])
                    dest.copy_(t.view(dest.shape))
        written = flat >= 0
        assert torch.equal(flat[written], torch.nonzero(written).reshape(-1))
        assert bool(written[n_local:].all())  # every PAD coordinate, once
        grad = torch.arange(n_local + n_pad, dtype=torch.float64) + 1
        grad[n_local:] = 0
        grads = [
            grad[o : o + math.prod(s)].view(s)
            for s, o in zip(local_space.shapes, local_space.offsets, strict=True)
        ]
        for g in groups.values():
            for factor, field in zip(_factor_plan(local_space, g), g[0].index_fields, strict=True):
                batched = torch.cat([getattr(b, field).tensor().long() for b in g])
                shape = factor_shape(factor, g, field)
                read = torch.empty(shape, dtype=torch.float64)
                for t, part in factor.split(read):
                    src = part.view(grads[part.param])
                    t.view(src.shape).copy_(src)
                assert torch.equal(read.reshape(-1), grad[batched.reshape(-1)])


def factor_shape(factor, group, field) -> tuple[int, ...]:
    """The batched component's shape: the blocks' positions flattened or stacked."""
    if factor.flat is not None:
        return (sum(factor.sizes),)
    return (sum(factor.sizes), *getattr(group[0], field).shape[1:])


def test_head_ranges_tile_the_heads_into_sets_of_rows():
    from geosharp.symmetry.positions import Positions, slots
    from geosharp.symmetry.specs import ParamSlice

    assert slots([(0, 4), (0, 1), (1, 3), (3, 4), (0, 4)], 4) == [[0], [1, 2, 3], [4]]
    assert slots([(0, 0)], 0) == [[0]]  # a whole parameter: no heads
    for bad in ([(0, 1), (2, 4)], [(0, 2)], [(1, 4)]):
        with pytest.raises(ValueError, match="do not tile"):
            slots(bad, 4)
    # heads 0-1 from w's rows, then one row per head: head 0 from b, heads 1.. from pad
    w, b, pad = ParamSlice("w", axis=0), ParamSlice("b", axis=0), ParamSlice("pad", 0, 2, 4)
    parts = [((4, 3), w, 0), ((2,), b, 12), ((6,), pad, 14)]
    p = Positions.slices(parts, heads=2, head_dim=2, numel=20, ranges=[None, (0, 1), (1, 2)])
    assert p.head_ranges == ((0, 2), (0, 1), (1, 2))
    want = torch.tensor([[[0, 3], [1, 4], [2, 5], [12, 13]], [[6, 9], [7, 10], [8, 11], [16, 17]]])
    assert torch.equal(p.tensor().long(), want)
    assert torch.equal(p.to("cpu").tensor(), p.tensor())
