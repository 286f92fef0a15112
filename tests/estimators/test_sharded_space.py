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
from geosharp.estimators.sharded_space import _Layout, _padded, _rows

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
    """With the placement, a bias-free model's every factor is a recipe (no position tensor).

    The recipe's positions are the rank's own (``_rows``); a factor with a bias row held by
    some ranks only (BERT's ``G`` of Q/K at worlds 2 and 4) keeps a padded position tensor.
    """
    from geosharp.estimators.sharded_space import _local_blocks
    from geosharp.symmetry.positions import Positions

    for model, recipes_only in ((tiny_llama(), True), (tiny_bert(heads=4), world == 1)):
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
                    if type(pos) is Positions:
                        mine, _ = _rows(gl[local.name], field, space, lay)
                        assert torch.equal(pos.tensor().long(), mine), (field, rank)
            assert kinds == ({True} if recipes_only else {True, False}), (model, rank)
