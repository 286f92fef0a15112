"""Where a block factor's coordinates are in ``θ``, kept as a recipe instead of a tensor.

A :class:`~geosharp.symmetry.SymmetryBlock` names its coordinates by global flat positions into
``θ``, one integer tensor per factor. A :class:`~geosharp.symmetry.ParameterSpace` lives as long
as its model is measured (``gs.sharpness`` caches it across calls), but its positions are read
only while something is built from them: a perturbation's gather index, a reparametrized copy,
an invariance check. Held as tensors they would cost one int32 per block coordinate for the
whole session, alive through every ascent step: 0.33 parameter-sized buffers on MiniLM-L6 with
its embeddings frozen, where the attention projections hold a third of the perturbed weights.

:class:`Positions` holds how to make them instead: the parameter slices and their offsets
(:func:`~geosharp.symmetry.specs.slice_positions`), or a contiguous range. Each use builds the
tensor afresh (a few vectorized ``arange``/``reshape`` passes, far below the cost of the
factorizations it feeds) and drops it with the caller. It answers ``shape``, ``numel`` and
``to`` without building anything, and anything else (``reshape``, ``torch.equal``) on the
tensor it builds, so code written for position tensors keeps working; to index with it, build
it (:func:`as_tensor`, as :attr:`SymmetryBlock.indices` does).

A part may cover a range ``[lo, hi)`` of the heads only (:attr:`Positions.head_ranges`): the
parts that follow it, up to the one covering the last head, fill the other heads of the same
rows (a sharded model's bias row, held for the rank's heads and padded for the others).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from geosharp.symmetry.specs import ParamSlice, slice_positions, slice_shape, slice_view

__all__ = ["Positions", "as_tensor", "recipe_views", "slots"]


class Positions:
    """Global flat positions of one block factor, built each time they are asked for.

    Use :meth:`slices` or :meth:`arange`; :meth:`tensor` builds the positions.

    Attributes:
        shape: Shape of the position tensor, e.g. ``(heads, n, h)``.
        dtype: Its dtype: int32 when ``θ`` has fewer than 2³¹ coordinates, else int64.
        device: The device it is built on.
    """

    __slots__ = ("_head_dim", "_heads", "_parts", "_ranges", "device", "dtype", "shape")

    def __init__(
        self,
        parts: tuple[tuple[tuple[int, ...], ParamSlice | None, int], ...],
        heads: int,
        head_dim: int,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        ranges: tuple[tuple[int, int] | None, ...] | None = None,
    ) -> None:
        self._parts, self._heads, self._head_dim = parts, heads, head_dim
        self._ranges = ranges  # None: every part covers every head
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)

    @classmethod
    def slices(
        cls,
        parts: Sequence[tuple[Sequence[int], ParamSlice, int]],
        heads: int,
        head_dim: int,
        numel: int,
        ranges: Sequence[tuple[int, int] | None] | None = None,
    ) -> Positions:
        """Slices of parameters, each cut into ``heads`` blocks of ``head_dim``, row-stacked.

        Args:
            parts: ``(parameter shape, slice, offset of the parameter in θ)`` per slice.
            heads: Number of blocks ``B``.
            head_dim: Group dimension ``h``.
            numel: Number of coordinates of ``θ`` (chooses int32 or int64).
            ranges: Per part, the heads ``(lo, hi)`` it covers (its slice cut into ``hi - lo``
                blocks), or ``None`` for all of them; consecutive ranged parts stack along the
                heads, ``0`` to ``heads``, into one set of rows (:attr:`head_ranges`).

        Raises:
            ValueError: From :func:`~geosharp.symmetry.specs.slice_positions`, here and now
                (the positions are built once to check them and learn their shape).
        """
        frozen = tuple((tuple(int(s) for s in shape), p, int(off)) for shape, p, off in parts)
        dtype = torch.int32 if numel < 2**31 else torch.long
        spans = None
        if ranges is not None and any(r is not None for r in ranges):
            spans = tuple(None if r is None else (int(r[0]), int(r[1])) for r in ranges)
            if len(spans) != len(frozen):
                raise ValueError("one head range per part")
        out = cls(frozen, heads, head_dim, torch.Size(), dtype, torch.device("cpu"), spans)
        # the shape from the slices' arithmetic, with their checks: nothing built (building them
        # took 8 s on a 1.1 B Llama; building on the meta device made torchrun's gloo ranks
        # abort at exit in 1 of 8 to 3 of 8 runs)
        out.shape = out._shape()
        return out

    @classmethod
    def arange(cls, offset: int, shape: Sequence[int], numel: int) -> Positions:
        """The positions ``offset, offset + 1, …`` of a whole parameter, shaped like it."""
        dtype = torch.int32 if numel < 2**31 else torch.long
        shape = torch.Size(int(s) for s in shape)
        return cls(((tuple(shape), None, int(offset)),), 0, 0, shape, dtype, torch.device("cpu"))

    @property
    def recipe(self) -> tuple[tuple[tuple[tuple[int, ...], ParamSlice | None, int], ...], int, int]:
        """``(parts, heads, head_dim)``: per part ``(parameter shape, slice, offset in θ)``.

        A whole parameter (:meth:`arange`) is one part with slice ``None``; the parts of
        :meth:`slices` are stacked along dimension 1, in order.
        """
        return self._parts, self._heads, self._head_dim

    @property
    def head_ranges(self) -> tuple[tuple[int, int], ...]:
        """Per part of :attr:`recipe`, the heads ``(lo, hi)`` its rows belong to.

        ``(0, heads)`` for a part of every head. A part of some heads only is cut into
        ``hi - lo`` blocks; it and the parts after it up to the one ending at ``heads`` (in
        order of their heads, :func:`slots`) are one set of rows, stacked along the heads.
        """
        full = (0, self._heads)
        if self._ranges is None:
            return (full,) * len(self._parts)
        return tuple(full if r is None else r for r in self._ranges)

    def with_shape(self, offset: int, shape: Sequence[int]) -> Positions:
        """The same positions, the parameter at ``offset`` given ``shape`` in :attr:`recipe`.

        For a parameter whose final length is known only once its parts are all made (a
        sharded rank's padding vector); its slices must fit ``shape`` as they did before.
        """
        parts = tuple(
            (tuple(int(s) for s in shape), piece, off) if off == offset else (old, piece, off)
            for old, piece, off in self._parts
        )
        return Positions(
            parts,
            self._heads,
            self._head_dim,
            self.shape,
            self.dtype,
            device=self.device,
            ranges=self._ranges,
        )

    # -- building ---------------------------------------------------------------------------
    def _shape(self) -> torch.Size:
        """The shape :meth:`_build` gives, from the slices alone (checking them as it would).

        Raises:
            ValueError: As :func:`~geosharp.symmetry.specs.slice_positions` and :func:`slots`.
        """
        if len(self._parts) == 1 and self._parts[0][1] is None:  # a whole parameter
            return torch.Size(self._parts[0][0])
        shapes = [
            slice_shape(shape, piece, hi - lo, self._head_dim)
            for (shape, piece, _), (lo, hi) in zip(self._parts, self.head_ranges, strict=True)
        ]
        rows = 0  # the sets of rows stack along dimension 1, each set's parts tile the heads
        for slot in slots(self.head_ranges, self._heads):
            if len({shapes[i][1] for i in slot}) > 1:
                raise ValueError("the parts of one set of rows differ in their number of rows")
            rows += shapes[slot[0]][1]
        return torch.Size([self._heads, rows, self._head_dim])

    def _build(self) -> Tensor:
        """The positions, built on the host (on the device named, never the default one)."""
        host = torch.device("cpu")
        if len(self._parts) == 1 and self._parts[0][1] is None:  # a whole parameter
            shape, _, offset = self._parts[0]
            n = math.prod(shape)
            out = torch.arange(offset, offset + n, dtype=torch.long, device=host).view(shape)
        else:
            built = [
                slice_positions(shape, piece, hi - lo, self._head_dim, host) + offset
                for (shape, piece, offset), (lo, hi) in zip(
                    self._parts, self.head_ranges, strict=True
                )
            ]
            rows = [
                torch.cat([built[i] for i in slot]) if len(slot) > 1 else built[slot[0]]
                for slot in slots(self.head_ranges, self._heads)
            ]
            out = torch.cat(rows, dim=1)
        return out.to(self.dtype)

    def tensor(self) -> Tensor:
        """The positions, built now on :attr:`device` (the caller owns the tensor)."""
        out = self._build()
        return out if self.device.type == "cpu" else out.to(self.device)

    # -- what a position tensor answers without being built ---------------------------------
    def numel(self) -> int:
        """Number of positions."""
        return math.prod(self.shape)

    def dim(self) -> int:
        """Number of dimensions of the position tensor."""
        return len(self.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions of the position tensor."""
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """``tensor().size(dim)``, from the shape alone."""
        return self.shape if dim is None else self.shape[dim]

    def to(self, device: torch.device | str | None = None, *args: Any, **kwargs: Any) -> Any:
        """The same recipe building on ``device``; other conversions build the tensor."""
        if isinstance(device, (torch.device, str)) and not args and not kwargs:
            return Positions(
                self._parts,
                self._heads,
                self._head_dim,
                self.shape,
                self.dtype,
                device=device,
                ranges=self._ranges,
            )
        return self.tensor().to(device, *args, **kwargs)

    # -- anything else is asked of the built tensor -------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in Positions.__slots__:
            raise AttributeError(name)
        return getattr(self.tensor(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return func(*_built(args), **_built(kwargs))

    def __repr__(self) -> str:
        return f"Positions(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _built(x: Any) -> Any:
    if isinstance(x, Positions):
        return x.tensor()
    if isinstance(x, (list, tuple)):
        return type(x)(_built(v) for v in x)
    if isinstance(x, dict):
        return {k: _built(v) for k, v in x.items()}
    return x


def as_tensor(index: Tensor | Positions) -> Tensor:
    """A position tensor: ``index`` itself, or the one a :class:`Positions` builds."""
    return index.tensor() if isinstance(index, Positions) else index


def recipe_views(
    fields: Sequence[Tensor | Positions], table: Callable[[int], Tensor | None]
) -> list[Tensor] | None:
    """The coordinates of ``fields`` as views of per-parameter tables, with no position built.

    Args:
        fields: A block's index fields (:attr:`SymmetryBlock.index_fields` values).
        table: The table of the parameter at a global offset (a tensor shaped like it, e.g. a
            count or a mask), or ``None`` if there is none.

    Returns:
        One view per recipe part (:func:`~geosharp.symmetry.specs.slice_view` of its
        parameter's table; the table itself for a whole parameter): the coordinates of every
        field, each once, with no position tensor. ``None`` when some field is a hand-made
        position tensor or some part no view (the caller then builds the positions).
    """
    out = []
    for pos in fields:
        if not isinstance(pos, Positions):
            return None
        parts, _, head_dim = pos.recipe
        for (shape, piece, offset), (lo, hi) in zip(parts, pos.head_ranges, strict=True):
            t = table(offset)
            if t is None or tuple(t.shape) != tuple(shape):
                return None
            v = t if piece is None else slice_view(t, piece, hi - lo, head_dim)
            if v is None:
                return None
            out.append(v)
    return out


def slots(ranges: Sequence[tuple[int, int]], heads: int) -> list[list[int]]:
    """The parts (their positions) that make each set of rows, in order.

    A part of every head is one set; parts of head ranges ``(lo, hi)`` make one set from the
    part starting at head 0 to the one ending at ``heads``, each starting where the last ended.

    Raises:
        ValueError: If the ranges do not tile the heads so.
    """
    out: list[list[int]] = []
    at = 0  # the next head of the set being filled (0: none open)
    for i, (lo, hi) in enumerate(ranges):
        if (lo, hi) == (0, heads) and not at:  # every head (a whole parameter: no heads)
            out.append([i])
            continue
        if lo != at or not lo < hi <= heads:
            raise ValueError(f"head ranges {list(ranges)} do not tile {heads} heads in order")
        if lo == 0:
            out.append([])
        out[-1].append(i)
        at = 0 if hi == heads else hi
    if at:
        raise ValueError(f"head ranges {list(ranges)} do not tile {heads} heads in order")
    return out
