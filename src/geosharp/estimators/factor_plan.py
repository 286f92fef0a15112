"""Where a batched symmetry piece's components lie in the parameters, and reading them there.

A piece of a :class:`~geosharp.estimators.perturbation.Perturbation` batches the blocks of one
shape of every layer: each component is the blocks' ``(heads, n, h)`` tensors concatenated, each
block's rows a few slices of its parameters (the Q, K, V, O projections). :func:`_factor_plan`
finds, from the blocks' :class:`~geosharp.symmetry.positions.Positions` recipes, where every
part lies as a view of its parameter (:class:`_Factor`, :class:`_Part`; no position tensor);
:func:`read_parts` and :func:`read_heads` read a component (or some of its heads) through those
views, and :class:`~geosharp.estimators.assembly.Assembly` writes the perturbed parameters
through them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.blocks import SymmetryBlock
from geosharp.symmetry.positions import Positions, slots
from geosharp.symmetry.specs import ParamSlice, slice_view

__all__ = ["batched_shapes", "read_heads", "read_parts"]


@dataclass(frozen=True)
class _Part:
    """One parameter slice of a block factor: rows of the block's ``(heads, n, h)`` tensor."""

    param: int  # the parameter's position in the space
    piece: ParamSlice | None  # None: the whole parameter, in its own shape
    heads: int  # the blocks it is cut into: those of its head range
    head_dim: int
    #: None: the part is rows of every head; else its heads ``(lo, hi)`` of a set of rows
    #: that the next parts fill up to the last head (a rank's bias rows, then padding)
    span: tuple[int, int] | None = None

    def view(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the parameter) arranged as this part's rows (a view of ``t``)."""
        if self.piece is None:
            return t
        v = slice_view(t, self.piece, self.heads, self.head_dim)
        assert v is not None
        return v


@dataclass(frozen=True)
class _Factor:
    """How one component of a batched symmetry piece lies in the parameters.

    The component is the blocks' tensors concatenated along dimension 0 (``sizes``), each
    block's the rows of its parts stacked along dimension 1 (``rows``; a whole parameter is
    one part in its own shape).
    """

    sizes: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    parts: tuple[tuple[_Part, ...], ...]
    #: Each block's shape when the component is the blocks' positions flattened and
    #: concatenated (:attr:`SymmetryBlock.batch_flat`; ``sizes`` are then their numbers).
    flat: tuple[torch.Size, ...] | None = None

    def _walk(self) -> Iterator[tuple[int, slice, slice | None, _Part]]:
        """``(block, heads, rows, part)`` of every part, in order: where its view lies.

        ``heads`` along dimension 0 of the block's tensor, ``rows`` along dimension 1 (``None``
        for a whole parameter: the block itself).
        """
        heads_of = [s[0] for s in self.flat] if self.flat is not None else self.sizes
        for b, (size, rows, parts) in enumerate(zip(heads_of, self.rows, self.parts, strict=True)):
            if parts[0].piece is None:
                yield b, slice(None), None, parts[0]
                continue
            it = iter(parts)
            row = 0
            for n in rows:
                part = next(it)
                if part.span is None:
                    yield b, slice(None), slice(row, row + n), part
                else:
                    while True:  # the heads of a set of rows, range by range
                        lo, hi = part.span
                        yield b, slice(lo, hi), slice(row, row + n), part
                        if hi == size:
                            break
                        part = next(it)
                row += n

    def ranges(self) -> list[tuple[slice, slice | None, _Part]]:
        """Where :meth:`split`'s views lie in the component: ``(heads, rows, part)`` each.

        The heads along dimension 0 of the component and the rows along dimension 1 (``None``:
        all of them), in the order of :meth:`split` (not for :attr:`flat` components, whose
        views are reshaped).
        """
        if self.flat is not None:
            raise ValueError("a flat component's parts are no ranges of heads and rows")
        starts = [sum(self.sizes[:b]) for b in range(len(self.sizes))]
        out = []
        for b, h, r, part in self._walk():
            lo = starts[b] + (h.start or 0)
            hi = starts[b] + (self.sizes[b] if h.stop is None else h.stop)
            out.append((slice(lo, hi), r, part))
        return out

    def split(self, t: Tensor) -> list[tuple[Tensor, _Part]]:
        """The part tensors of ``t`` (views), each with its part."""
        blocks = torch.split(t, self.sizes, dim=0) if len(self.sizes) > 1 else (t,)
        if self.flat is not None:
            blocks = tuple(b.view(s) for b, s in zip(blocks, self.flat, strict=True))
        return [
            (blocks[b] if r is None else blocks[b][h, r], part) for b, h, r, part in self._walk()
        ]


def _factor_plan(space: ParameterSpace, blocks: Sequence[SymmetryBlock]) -> list[_Factor] | None:
    """The :class:`_Factor` of every component of one batched piece, or None if unknown.

    Known: blocks batched by the default :meth:`SymmetryBlock.batch` whose positions are
    :class:`~geosharp.symmetry.positions.Positions` recipes that :func:`slice_view` can view;
    a set of rows made of parts of head ranges (a sharded rank's bias rows, then ``PAD``'s
    slices) is split along the heads too (:attr:`_Part.span`).
    """
    cls = type(blocks[0])
    flat = cls.batch_flat
    if not flat and getattr(cls.batch, "__func__", None) is not SymmetryBlock.batch.__func__:
        return None
    owner = {}
    for j, (off, shape) in enumerate(zip(space.offsets, space.shapes, strict=True)):
        if math.prod(shape):
            owner[int(off)] = j
    plan = []
    for field in cls.index_fields:
        sizes, rows, parts = [], [], []
        for b in blocks:
            pos = getattr(b, field)
            if not isinstance(pos, Positions) or pos.dim() < 1:
                return None
            recipe, heads, head_dim = pos.recipe
            sizes.append(pos.numel() if flat else int(pos.shape[0]))
            blk_rows, blk_parts = [], []
            for slot in slots(pos.head_ranges, heads):
                slot_rows = set()
                for i in slot:
                    shape, piece, offset = recipe[i]
                    lo, hi = pos.head_ranges[i]
                    j = owner.get(int(offset))
                    if j is None or tuple(space.shapes[j]) != tuple(shape):
                        return None
                    span = None if len(slot) == 1 else (lo, hi)
                    blk_parts.append(_Part(j, piece, hi - lo, head_dim, span))
                    if piece is None:
                        if len(recipe) != 1:
                            return None
                        continue
                    meta = torch.empty(shape, device="meta")
                    v = slice_view(meta, piece, hi - lo, head_dim)
                    if v is None:
                        return None
                    slot_rows.add(v.numel() // ((hi - lo) * head_dim))
                if len(slot_rows) > 1:
                    return None
                blk_rows.extend(slot_rows)
            rows.append(tuple(blk_rows))
            parts.append(tuple(blk_parts))
        shapes = tuple(torch.Size(getattr(b, field).shape) for b in blocks) if flat else None
        plan.append(_Factor(tuple(sizes), tuple(rows), tuple(parts), shapes))
    return plan


def read_parts(
    factor: _Factor,
    tensors: Sequence[Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    out: Tensor | None = None,
) -> Tensor:
    """One block component read part by part, through views, from parameter-shaped ``tensors``.

    ``tensors``: one per parameter of the space (the parameters themselves: the blocks' base
    point, or their gradients); the result is a fresh tensor of ``shape`` and ``dtype`` on
    ``device`` (or ``out``, written in place), each part's values copied (and converted) from
    its view.
    """
    buf = torch.empty(shape, dtype=dtype, device=device) if out is None else out
    dests, srcs = [], []
    for t, part in factor.split(buf):
        src = part.view(tensors[part.param])
        dst = t.view(src.shape)
        if _transposed(dst, src):  # a Q/K/V part: a head at a time, ATen's blocked transpose
            for i in itertools.product(*map(range, src.shape[:-2])):
                dests.append(dst[i])
                srcs.append(src[i])
            continue
        dests.append(dst)
        srcs.append(src)
    _copy_all(dests, srcs)
    return buf


#: Coordinates of a 2-D slice from which ATen copies a transposed source by blocks (its
#: ``copy_transpose_valid``): smaller transposed parts are copied in one go.
_BLOCKED_MIN = 60 * 60
#: The tensor types whose strides :func:`_transposed` reads.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _transposed(dst: Tensor, src: Tensor) -> bool:
    """Whether ``src`` is, past its leading axes, the transpose of a contiguous matrix.

    Such a part (the rows of heads of a ``(out, in)`` weight, read as ``(heads, in, h)``) is
    copied a 2-D slice at a time on the CPU: each slice then takes ATen's blocked transpose
    (one ``copy_`` of the whole strided view ran at about half its speed); values are copied,
    not computed, so they are the same. Plain tensors only (no tensor subclass, no
    ``torch.func`` transform, whose batched tensors have no strides).
    """
    return (
        type(src) in _PLAIN
        and type(dst) in _PLAIN
        and not torch._C._are_functorch_transforms_active()
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and src.dim() > 2
        and dst.dtype == src.dtype
        and src.shape[-2] * src.shape[-1] >= _BLOCKED_MIN
        and src.stride(-2) == 1
        and src.stride(-1) == src.shape[-2]
        and dst.stride(-1) == 1
        and dst.stride(-2) == src.shape[-1]
    )


def _copy_all(dests: list[Tensor], srcs: list[Tensor]) -> None:
    """``d.copy_(s)`` for every pair: one multi-tensor copy when nothing records a graph."""
    if len(dests) > 1 and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (*dests, *srcs))
    ):
        torch._foreach_copy_(dests, srcs)
        return
    for d, t in zip(dests, srcs, strict=True):
        d.copy_(t)


def read_heads(
    factor: _Factor,
    tensors: Sequence[Tensor],
    heads: slice,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """The heads ``heads`` (a slice of dimension 0) of one block component, as :func:`read_parts`.

    ``shape`` is the whole component's; only the parts' views that hold those heads are read,
    each cut to them along its first dimension (its heads; the rows may span several).
    """
    lo, hi, _ = heads.indices(shape[0])
    out = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device)
    for span, rows, part in factor.ranges():
        a, b = max(span.start, lo), min(span.stop, hi)
        if a >= b:
            continue
        dst = out[a - lo : b - lo] if rows is None else out[a - lo : b - lo, rows]
        src = part.view(tensors[part.param])  # heads first, its rows maybe in several dims
        if src.dim() < 2 or src.shape[0] != span.stop - span.start:
            src = src.view(span.stop - span.start, *dst.shape[1:])
        src = src[a - span.start : b - span.start]
        dst.view(src.shape).copy_(src)
    return out


def batched_shapes(blocks: Sequence[SymmetryBlock]) -> tuple[torch.Size, ...]:
    """The shapes of :meth:`SymmetryBlock.batch` of ``blocks``, without building a position.

    Each field's positions concatenated along the head axis (or, :attr:`~SymmetryBlock.
    batch_flat`, flattened and concatenated).
    """
    cls = type(blocks[0])
    out = []
    for shapes in zip(*(b.index_shapes for b in blocks), strict=True):
        if cls.batch_flat:
            out.append(torch.Size([sum(math.prod(s) for s in shapes)]))
        else:
            out.append(torch.Size([sum(s[0] for s in shapes), *shapes[0][1:]]))
    return tuple(out)
