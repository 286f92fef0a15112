r"""The symmetry blocks of a sharded model, on one rank's rows (SPEC §10.1–§10.3).

A model sharded by FSDP2 holds on every rank a slice of every parameter along one dimension.
The blocks :func:`~geosharp.symmetry.find_symmetries` finds on it are global (positions in the
whole model's ``θ``). This module lays them out on one rank:

- every row of a GL(h) factor (``G``, ``H``: ``(heads, n, h)``) is either held whole by the
  rank or not at all; the rank's block keeps its rows, in order, so that a contraction over
  rows is the rank's part of the global one (summed over the ranks by the geometry's
  ``row_sum``) and a row-wise product is local;
- heads of one batched geometry need one row count: a head with fewer rows here than the
  longest is padded with **zero rows**, which stay zero through every formula (a zero row of
  the point and of ``ξ`` contributes nothing to a contraction, and a row-wise product of a
  zero row is zero; the loss does not see them, so their gradient is zero). They are
  coordinates of one extra vector of the rank's space, :data:`PAD`, never written to the model;
- key-bias translations keep the rank's positions (held fixed);
- a row split across ranks (a head's columns on two ranks) is refused in one line, with the
  placement that avoids it: :func:`shard_placement` shards every projection whose rows run
  along its dimension 1 (``W_q``, ``W_k``, ``W_v``, LoRA's ``A``) along that dimension.

Each rank's batched geometries keep the global grouping (one per batch key of the global
blocks, in one order), so every rank makes the same collectives in the same order whatever
its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.sharded.fsdp2 import local_shape_and_offset
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.blocks import SymmetryBlock
from geosharp.symmetry.positions import Positions, as_tensor
from geosharp.symmetry.specs import ParamSlice

__all__ = ["PAD", "local_space", "localize_positions", "param_layouts"]

#: The name of the rank's zero rows (padding of heads with fewer rows here than others).
PAD = "<zero rows>"

#: Padding above this share of a rank's real block coordinates is warned about (FSDP's
#: default placement puts whole heads on one rank: the others then pad them whole).
PAD_WARN = 0.25


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a parameter's global positions lie on this rank (a slice along ``dim``)."""

    offset: int  # the parameter's start in the global θ
    shape: tuple[int, ...]  # global shape
    dim: int  # the sharded dimension
    start: int  # the rank's first index along dim
    length: int  # the rank's number of indices along dim
    local_offset: int  # the parameter's start in the rank's flat space

    def local(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """``(held, local positions)`` of global positions ``pos`` in this parameter."""
        q = pos - self.offset
        inner = math.prod(self.shape[self.dim + 1 :])
        size = self.shape[self.dim] if self.shape else 1
        c = (q // inner) % size
        held = (c >= self.start) & (c < self.start + self.length)
        outer = q // (inner * size)
        flat = outer * (inner * self.length) + (c - self.start) * inner + q % inner
        return held, flat + self.local_offset


def param_layouts(space: ParameterSpace, shards: Any) -> list[_Layout]:
    """Each parameter's :class:`_Layout` on this rank (from its ``DTensor`` placement)."""
    local = shards.space()
    out = []
    for j, p in enumerate(shards.params):
        shape, offset = local_shape_and_offset(p)
        dim = p.placements[0].dim
        out.append(
            _Layout(
                space.offsets[j],
                tuple(p.shape),
                dim,
                int(offset[dim]) if len(offset) else 0,
                int(shape[dim]) if len(shape) else 1,
                local.offsets[j],
            )
        )
    return out


def localize_positions(
    pos: Tensor, space: ParameterSpace, layouts: list[_Layout]
) -> tuple[Tensor, Tensor]:
    """``(held, local)`` for global positions ``pos`` (any shape)."""
    flat = pos.reshape(-1).cpu().long()
    held = torch.zeros(flat.shape, dtype=torch.bool)
    local = torch.zeros(flat.shape, dtype=torch.long)
    if flat.numel():
        owner = space.owners(flat)
        for j in torch.unique(owner).tolist():
            sel = owner == j
            h, loc = layouts[j].local(flat[sel])
            held[sel], local[sel] = h, loc
    return held.view(pos.shape), local.view(pos.shape)


@functools.cache
def _local_class(cls: type) -> type:
    """``cls`` whose :meth:`batch_key` is the global group's (a rank's rows keep the grouping).

    Two global groups whose rows on some rank happen to have one shape must stay two
    geometries there, as on every other rank: their collectives must pair up.
    """
    ns = {
        "__annotations__": {"global_key": Hashable},
        "global_key": None,
        "spec_type": None,  # never a builder of the finder
        "batch_key": lambda self: ("rows on this rank", self.global_key),
        "__module__": __name__,
    }
    return dataclasses.dataclass(frozen=True, eq=False, repr=False)(
        type(f"Local{cls.__name__}", (cls,), ns)
    )


def local_space(
    model: nn.Module, shards: Any, key_bias: str = "quotient"
) -> tuple[ParameterSpace, dict[str, Tensor]]:
    """The rank's space of a sharded model, with its blocks on the rank's rows.

    Args:
        model: The model (every trainable parameter a ``DTensor``).
        shards: Its :class:`~geosharp.estimators.sharded.params.ShardedParams`.
        key_bias: As :func:`~geosharp.symmetry.find_symmetries`.

    Returns:
        ``(space, padding)``: the rank's space (the shards' parameters, then :data:`PAD` if
        some head is padded here) and ``{PAD: zeros}``, the base point of its padding rows
        (empty when no head is padded).

    Raises:
        ValueError: If a row of a block's factor is split across ranks (with the placement
            that avoids it), or the model's symmetry blocks do not match its parameters.
        NotImplementedError: For diagonal pairs (their two coordinates on different ranks).
    """
    space = find_symmetries(model, key_bias=key_bias)
    if tuple(space.param_names) != tuple(shards.names):
        raise ValueError(
            "the symmetry search on the sharded model saw other trainable parameters than its "
            "shards (please report this)"
        )
    layouts = param_layouts(space, shards)
    base = shards.space()
    try:
        blocks, n_pad = _local_blocks(space, layouts, base.numel())
        failure = None
    except (ValueError, NotImplementedError) as err:
        failure = (type(err).__name__, str(err))
    _agree(shards, failure)  # a rank that holds no part of a split row raises too
    real = sum(b.numel for b in blocks if b.shard_layout == "rows") - n_pad
    if n_pad > PAD_WARN * max(real, 1):
        warnings.warn(
            f"the symmetry blocks' rows are spread unevenly over the ranks: this rank pads its "
            f"{real:,} block coordinates with {n_pad:,} zeros (rows of heads it holds fewer of), "
            "which every buffer of the ascent holds; shard the model with "
            "fully_shard(..., shard_placement_fn="
            "geosharp.shard_placement(model)) for an even share of every head's rows",
            stacklevel=3,
        )
    padding = {}
    if n_pad:
        like = shards.locals[0]
        padding[PAD] = torch.zeros(n_pad, dtype=like.dtype, device=like.device)
    local = ParameterSpace(
        (*base.param_names, *padding),
        (*base.shapes, *(t.shape for t in padding.values())),
        (*base.offsets, *([base.numel()] if n_pad else [])),
        blocks=blocks,
        excluded=dict(base.excluded),
        notes=list(space.notes),
    )
    return local, padding


def _local_blocks(
    space: ParameterSpace, layouts: list[_Layout], pad_next: int
) -> tuple[list[SymmetryBlock], int]:
    """The global blocks on the rank's rows (padded), and how many padding coordinates."""
    first = pad_next  # the PAD vector's positions follow the shards'
    blocks: list[SymmetryBlock] = []
    groups: dict[Hashable, list[SymmetryBlock]] = {}
    for b in space.blocks:
        groups.setdefault(b.batch_key(), []).append(b)
    bound = pad_next + sum(b.numel for b in space.blocks)  # the rank's coordinates, at most
    recipes: list[tuple[int, str]] = []  # padded factors kept as recipes: (block, field)
    for key, group in groups.items():
        cls = type(group[0])
        layout = group[0].sharded_layout()  # refuses, in one line, a block with none
        if layout == "coordinates":
            for b in group:
                held, local = localize_positions(as_tensor(b.index), space, layouts)
                whole = held.numel() > 0 and bool(held.all())
                recipe = _local_recipe(b.index, space, layouts, local, bound) if whole else None
                mine = recipe if recipe is not None else local[held].reshape(1, 1, -1)
                if recipe is None:  # some heads here: a slice of one local shard, if it is
                    mine = _held_recipe(mine, space, layouts, bound) or mine
                blocks.append(dataclasses.replace(b, index=mine))
            continue
        if layout != "rows":  # pragma: no cover - every layout a block may name is handled
            raise NotImplementedError(f"shard layout {layout!r} of {cls.__name__} blocks")
        rows = [[_rows(b, f, space, layouts) for f in b.index_fields] for b in group]
        width = [max(r[k][0].shape[1] for r in rows) for k in range(len(cls.index_fields))]
        local_cls = _local_class(cls)
        for b, per_field in zip(group, rows, strict=True):
            fields = {}
            for f, (mine, count), n in zip(b.index_fields, per_field, width, strict=True):
                unpadded = n > 0 and bool((count == n).all())
                recipe = (
                    _local_recipe(getattr(b, f), space, layouts, mine, bound) if unpadded else None
                )
                if recipe is not None:  # no position tensor held: built when asked for
                    fields[f] = recipe
                    continue
                index, after = _padded(mine, count, n, pad_next)
                if n > 0:  # padded rows of whole sets of rows: a recipe with PAD's slices
                    recipe = _padded_recipe(getattr(b, f), space, layouts, index, pad_next, first)
                    if recipe is not None:
                        index = recipe
                        recipes.append((len(blocks), f))
                fields[f], pad_next = index, after
            values = {fl.name: getattr(b, fl.name) for fl in dataclasses.fields(b)}
            blocks.append(local_cls(**{**values, **fields, "global_key": key}))
    for i, f in recipes:  # PAD's final length in its parts' shape (the local space's)
        pos = getattr(blocks[i], f)
        sized = pos.with_shape(first, (pad_next - first,))
        blocks[i] = dataclasses.replace(blocks[i], **{f: sized})
    return blocks, pad_next - first


def _agree(shards: Any, failure: tuple[str, str] | None) -> None:
    """Raise on every rank the first rank's failure to lay its blocks out, if any rank failed.

    A row split across ranks is seen by the ranks holding a part of it; the others would go on
    to the ascent's first collective and wait there.
    """
    for rank, found in enumerate(shards.exchange(failure)):
        if found is not None:
            kind, msg = found
            where = "" if found == failure else f" (found on rank {rank})"
            cls = NotImplementedError if kind == "NotImplementedError" else ValueError
            raise cls(msg + where)


def _rows(
    block: SymmetryBlock, field: str, space: ParameterSpace, layouts: list[_Layout]
) -> tuple[Tensor, Tensor]:
    """The rank's rows of one factor: ``(positions (B, k_max, h), rows held per head (B,))``.

    Each head's rows held here come first, in order; the rest of its ``k_max`` rows are ``-1``
    (to be padded).
    """
    pos = as_tensor(getattr(block, field))
    held, local = localize_positions(pos, space, layouts)
    whole, some = held.all(-1), held.any(-1)
    if not torch.equal(whole, some):
        b, i = (int(x) for x in torch.nonzero(some & ~whole)[0])
        name, _ = space.locate(int(pos[b, i, 0]))
        raise ValueError(
            f"the rows of block {block.name!r} ({field}, head {b}) are split across ranks: "
            f"{name!r} is sharded along a dimension that cuts a head's row. Shard it with "
            "fully_shard(..., shard_placement_fn=geosharp.shard_placement(model)) (FSDP2 "
            "splits its dimension 1 only if the world size divides it), and use a world size "
            "that divides the number of heads when the block has a bias row"
        )
    count = whole.sum(-1)  # rows held per head
    k = int(count.max()) if count.numel() else 0
    out = torch.full((pos.shape[0], k, pos.shape[-1]), -1, dtype=torch.long)
    for b in range(pos.shape[0]):
        out[b, : int(count[b])] = local[b][whole[b]]
    return out, count


def _local_recipe(
    pos: Any,
    space: ParameterSpace,
    layouts: list[_Layout],
    mine: Tensor,
    bound: int,
) -> Positions | None:
    """The rank's positions of one factor as a recipe of its local shards, if they are one.

    A factor whose every part is sliced along an axis the parameter is not sharded along (the
    heads' axis of ``W_q`` with ``W_q`` split along its rows, dimension 1) has on the rank the
    same slices of the local shards: a :class:`~geosharp.symmetry.positions.Positions` recipe
    over the local shapes and offsets, which holds no position tensor, and whose layout the
    perturbation's assembly writes through views of the parameters (no gather index either).
    Checked against the rank's positions ``mine`` (every one held here, none padding);
    ``None`` (a position tensor is kept) when the recipe puts any position elsewhere.
    ``bound``: more than the rank's coordinates, padding included (int32 below ``2³¹``).
    """
    if not isinstance(pos, Positions):
        return None
    parts, heads, head_dim = pos.recipe
    starts = {int(off): j for j, off in enumerate(space.offsets) if space.shapes[j]}
    local = []
    for shape, piece, offset in parts:
        j = starts.get(int(offset))
        if j is None:
            return None
        lay = layouts[j]
        lshape = list(shape)
        if lshape:
            lshape[lay.dim] = lay.length
        local.append((tuple(lshape), piece, lay.local_offset))
    try:
        if len(local) == 1 and local[0][1] is None:
            shape, _, offset = local[0]
            recipe = Positions.arange(offset, shape, bound)
        else:
            recipe = Positions.slices(local, heads, head_dim, bound)
        built = recipe.tensor()
    except (ValueError, RuntimeError):  # the slice does not fit the local shape
        return None
    if built.shape != mine.shape or not torch.equal(built.long(), mine.long()):
        return None
    return recipe


def _held_recipe(
    mine: Tensor, space: ParameterSpace, layouts: list[_Layout], bound: int
) -> Positions | None:
    """A key-bias translation's share ``mine`` ``(1, 1, m)`` here, as a recipe.

    A slice of a 1-D local shard (``b_k`` sharded along its heads); ``None`` if it is not one.
    """
    flat = mine.reshape(-1).long()
    m = flat.numel()
    if not m or not torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + m)):
        return None
    j = max((i for i, x in enumerate(layouts) if x.local_offset <= int(flat[0])), default=None)
    if j is None or len(layouts[j].shape) != 1:
        return None
    lay, a = layouts[j], int(flat[0]) - layouts[j].local_offset
    if a + m > lay.length:
        return None
    piece = ParamSlice(space.param_names[j], 0, a, a + m)
    recipe = Positions.slices([((lay.length,), piece, lay.local_offset)], 1, m, bound)
    return recipe if torch.equal(recipe.tensor().long(), flat.view(mine.shape)) else None


def _padded_recipe(
    pos: Any,
    space: ParameterSpace,
    layouts: list[_Layout],
    want: Tensor,
    pad_next: int,
    first: int,
) -> Positions | None:
    """A padded factor's positions ``want`` (:func:`_padded`'s) as a recipe, if they are one.

    Its parts held for every head (``W_q``'s rows, split along dimension 1) are slices of the
    local shards, as in :func:`_local_recipe`; a part sharded along its heads' axis (``b_q``,
    split along dimension 0) holds here the rows of heads ``[lo, hi)``: a slice of its local
    shard, and for the heads before and after, slices of the :data:`PAD` vector (at ``first``
    in the rank's space), numbered head by head from ``pad_next`` as :func:`_padded` numbers
    them (so it must be the factor's last part). ``None`` (the position tensor is kept) when
    the recipe puts any position elsewhere. PAD's parts are shaped by the PAD made so far
    (:meth:`Positions.with_shape` gives them its whole length afterwards).
    """
    if not isinstance(pos, Positions) or any(r != (0, pos.recipe[1]) for r in pos.head_ranges):
        return None
    parts, heads, head_dim = pos.recipe
    starts = {int(off): j for j, off in enumerate(space.offsets) if space.shapes[j]}
    local: list[tuple[tuple[int, ...], ParamSlice, int]] = []
    ranges: list[tuple[int, int] | None] = []
    pad = pad_next - first  # PAD's next coordinate

    def padding(lo: int, hi: int, per_head: int) -> None:
        nonlocal pad
        end = pad + (hi - lo) * per_head
        local.append(((end,), ParamSlice(PAD, 0, pad, end), first))
        ranges.append((lo, hi))
        pad = end

    for shape, piece, offset in parts:
        j = starts.get(int(offset))
        if j is None or piece is None or not shape:
            return None
        lay, lshape = layouts[j], list(shape)
        lshape[lay.dim] = lay.length
        axis = piece.axis % len(shape)
        if lay.dim != axis or lay.length == shape[axis]:  # every head's rows here
            local.append((tuple(lshape), piece, lay.local_offset))
            ranges.append(None)
            continue
        start = 0 if piece.start is None else piece.start
        width = ((shape[axis] if piece.stop is None else piece.stop) - start) // heads
        if piece.parts != 1 or piece.part != 0 or width <= 0:
            return None
        lo = min(max(-(-(lay.start - start) // width), 0), heads)  # the heads held here
        hi = max(min((lay.start + lay.length - start) // width, heads), lo)
        per_head = math.prod(shape) // shape[axis] * width  # one head's coordinates
        if lo:
            padding(0, lo, per_head)
        if hi > lo:
            a, b = start + lo * width - lay.start, start + hi * width - lay.start
            local.append(
                (tuple(lshape), dataclasses.replace(piece, start=a, stop=b), lay.local_offset)
            )
            ranges.append((lo, hi))
        if hi < heads:
            padding(hi, heads, per_head)
    try:
        recipe = Positions.slices(local, heads, head_dim, first + pad, ranges)
        built = recipe.tensor()
    except (ValueError, RuntimeError):  # a slice that does not fit, ranges out of order
        return None
    if built.shape != want.shape or not torch.equal(built.long(), want.long()):
        return None
    return recipe


def _padded(mine: Tensor, count: Tensor, n: int, pad_next: int) -> tuple[Tensor, int]:
    """``mine`` widened to ``n`` rows per head, the missing rows given fresh PAD positions."""
    heads, k, h = mine.shape
    # int32 where the rank's positions fit (the blocks hold them for the whole call)
    kind = torch.int32 if pad_next + heads * n * h < 2**31 else torch.long
    out = torch.empty((heads, n, h), dtype=kind)
    out[:, :k] = mine
    rows = torch.arange(n).unsqueeze(0) >= count.unsqueeze(1)  # (heads, n): padding rows
    missing = int(rows.sum()) * h
    out[rows] = torch.arange(pad_next, pad_next + missing, dtype=kind).view(-1, h)
    return out, pad_next + missing
