"""How the perturbed parameters are built from the moved pieces, and its adjoint at ξ = 0.

:class:`Assembly` is the map from the pieces of a
:class:`~geosharp.estimators.perturbation.Perturbation` (one tuple of components per piece) to
the perturbed parameters by name, ready for :func:`torch.func.functional_call`; its
:meth:`~Assembly.pull_back` lays a parameter gradient out as the pieces.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.estimators.table_rows import RowsWritten, rows_into
from geosharp.geometry.flat import untracked
from geosharp.geometry.gl_endpoint import _reverse_mode_only
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.blocks import SymmetryBlock
from geosharp.symmetry.positions import Positions, slots
from geosharp.symmetry.specs import ParamSlice, slice_view

__all__ = ["Assembly", "read_heads", "read_parts"]

#: Positions placed at a time while the gather index is filled (bounds its transients).
_CHUNK = 1 << 20
#: Gathered coordinates (every device's together) up to which the assembly's view plan is
#: compared with a gather index built from the blocks' positions; past it, its cover only.
_CHECK_LIMIT = 1 << 24


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


class Assembly:
    """Builds the perturbed parameters by name from the moved pieces.

    A parameter with no coordinate in a symmetry block is one component of the rest piece, in
    its own shape: its moved value *is* the perturbed parameter (no copy; its gradient flows
    back unchanged). The parameters with block coordinates (the Q, K, V, O projections) are
    written part by part through views of them (:func:`~geosharp.symmetry.specs.slice_view`,
    known from the blocks' :class:`~geosharp.symmetry.positions.Positions` recipes): nothing
    parameter-sized is held. Blocks whose layout is no view (hand-made position tensors, a
    slice of several parts of a parameter per unit) fall back to one gather index per device
    over the gathered parameters there, from a *source* vector: the symmetry pieces' values on
    that device followed by the rest coordinates of its such parameters (on MiniLM-L6 3.5 M
    of 22.7 M coordinates, int32).

    Every perturbed parameter, index and buffer is made on the device of the parameter it
    serves (``devices``: a model split across devices); a symmetry piece lies on the device of
    its blocks' parameters (:func:`~geosharp.estimators.pieces._group_blocks`).
    """

    def __init__(
        self,
        space: ParameterSpace,
        pieces: Sequence,  # of Piece
        rest_piece: int | None,
        layout: Sequence[tuple[int, Tensor | None]],
        devices: torch.device | Sequence[torch.device],
        plans: Sequence[list[_Factor] | None] | None = None,
    ) -> None:
        self.names, self.shapes = list(space.param_names), list(space.shapes)
        sizes = [math.prod(s) for s in self.shapes]
        if isinstance(devices, (torch.device, str)):
            devices = [torch.device(devices)] * len(sizes)
        #: The device of every parameter: its perturbed value is made there.
        self.devices = list(devices)
        self.rest_piece = rest_piece
        #: rest component → (rows kept, the whole table at the base point): see on_rows
        self.rows: dict[int, tuple[Tensor, Tensor]] = {}
        self.sym_pieces = [i for i in range(len(pieces)) if i != rest_piece]
        #: rest component k → (parameter j, whole?) ; whole parameters are used as they are
        self.layout = [(j, local is None) for j, local in layout]
        whole = {j for j, w in self.layout if w}
        #: Parameters with symmetry coordinates, gathered from the source.
        self.gathered = [j for j in range(len(sizes)) if j not in whole and sizes[j]]
        #: Rest components (positions in the rest piece) appended to the source.
        self.mixed = [k for k, (j, w) in enumerate(self.layout) if not w]
        self.gathered_sizes = [sizes[j] for j in self.gathered]
        #: the rest components of gathered parameters: (parameter, local positions) (held by
        #: the perturbation's layout already)
        self.mixed_local = [(j, local) for j, local in layout if local is not None]
        #: Per device: the symmetry pieces there, the mixed rest components (positions in
        #: :attr:`mixed`) of its parameters and its gathered parameters (positions in
        #: :attr:`gathered`), each in order: the source of the gather index there.
        self.sources: dict[torch.device, tuple[list[int], list[int], list[int]]] = {}
        for k in self.sym_pieces:
            point = pieces[k].geometry.point
            if point:
                self.sources.setdefault(point[0].device, ([], [], []))[0].append(k)
        for m, (j, _) in enumerate(self.mixed_local):
            self.sources.setdefault(self.devices[j], ([], [], []))[1].append(m)
        for g, j in enumerate(self.gathered):
            self.sources.setdefault(self.devices[j], ([], [], []))[2].append(g)
        #: The gather index per device (source position of every gathered coordinate there),
        #: kept only when some block's layout is not a view of its parameters (:attr:`plan`
        #: is None).
        self.index: dict[torch.device, Tensor] | None = None
        #: Per symmetry piece, per component: where it lies in the parameters (no index).
        self.plan: list[list[_Factor]] | None = None
        #: Tensors to write the gathered parameters into instead of fresh ones, by parameter
        #: position (a sharded model's own shards, :meth:`~geosharp.estimators.perturbation.
        #: Perturbation.assembled_into`); used where their shape and dtype fit and a plan holds
        self.targets: dict[int, Tensor] | None = None
        if not self.gathered:
            return
        on = [
            sum(self.gathered_sizes[g] for g in gathered) for *_, gathered in self.sources.values()
        ]
        # each symmetry piece's view plan, made with its base point (pieces._block_pieces)
        plan = None if plans is None or None in plans else list(plans)
        if plan is not None and sum(on) > _CHECK_LIMIT:
            # past the limit the plan is not compared with a gather index (a 1.1 B Llama's
            # index and its comparison took 28 s and 2 int32 per block coordinate); the same
            # recipes make both, compared in full on every model below it
            self._check_cover(plan, pieces)
            self.plan = plan
            return
        # int32 positions where they fit: half the memory (of the check, or kept per call)
        kind = torch.int32 if max(on) < 2**31 else torch.long
        index = {d: self._index_on(d, space, pieces, kind) for d in self.sources}
        if plan is not None and self._same_as(plan, pieces, index):
            self.plan = plan  # the index is not kept: the layouts are views
            return
        self.index = index

    def _check_cover(self, plan: list[list[_Factor]], pieces: Sequence) -> None:
        """Check that ``plan`` and the mixed rest write every gathered coordinate once.

        Counted a parameter at a time, through the plan's views of one ``uint8`` table per
        device, reused for every parameter there (sized for the largest; a table per gathered
        parameter was 0.2 GB of fresh pages on a 1.1 B Llama), each checked by its smallest and
        largest count (no mask).

        Raises:
            ValueError: If a coordinate is written twice or never (naming its parameter).
        """
        parts: dict[int, list[_Part]] = {j: [] for j in self.gathered}
        for k, factors in zip(self.sym_pieces, plan, strict=True):
            for factor, point in zip(factors, pieces[k].geometry.point, strict=True):
                for _, part in factor.split(torch.empty(point.shape, device="meta")):
                    parts[part.param].append(part)
        mixed: dict[int, list[Tensor]] = {}
        for j, local in self.mixed_local:
            mixed.setdefault(j, []).append(local)
        most: dict[torch.device, int] = {}
        for j in self.gathered:
            d = self.devices[j]
            most[d] = max(most.get(d, 0), math.prod(self.shapes[j]))
        scratch = {d: torch.empty(n, dtype=torch.uint8, device=d) for d, n in most.items()}
        for j in self.gathered:
            size = math.prod(self.shapes[j])
            counts = scratch[self.devices[j]][:size].zero_()
            table = counts.view(self.shapes[j])
            for part in parts[j]:
                part.view(table).add_(1)
            for local in mixed.get(j, ()):
                one = torch.ones((), dtype=counts.dtype, device=counts.device).expand(len(local))
                counts.index_put_((local.to(counts.device),), one, True)
            low, high = torch.aminmax(counts)
            if int(low) != 1 or int(high) != 1:
                raise ValueError(
                    f"the symmetry blocks and the rest do not cover parameter "
                    f"{self.names[j]!r} once (please report this)"
                )

    def _index_on(
        self, device: torch.device, space: ParameterSpace, pieces: Sequence, dtype: torch.dtype
    ) -> Tensor:
        """The gather index of the parameters gathered on ``device``, made there.

        Filled a chunk of positions at a time: its transients are a few chunks, not several
        copies of the pieces' positions in int64.
        """
        syms, mixed, gathered = self.sources[device]
        sizes = [self.gathered_sizes[g] for g in gathered]
        index = torch.full((sum(sizes),), -1, dtype=dtype, device=device)
        # global position → position in the concatenated gathered parameters
        shift = torch.zeros(len(self.shapes), dtype=torch.long, device=device)
        start = 0
        for g, size in zip(gathered, sizes, strict=True):
            j = self.gathered[g]
            shift[j] = start - space.offsets[j]
            start += size
        n_src = 0
        for k in syms:
            for comp in pieces[k].index:
                positions = comp.reshape(-1)
                for lo in range(0, positions.numel(), _CHUNK):
                    glob = positions[lo : lo + _CHUNK].to(device, torch.long)
                    owner = space.owners(glob)
                    index[glob + shift[owner]] = torch.arange(
                        n_src, n_src + glob.numel(), dtype=dtype, device=device
                    )
                    n_src += glob.numel()
                    del glob, owner
                del positions
        for m in mixed:
            j, local = self.mixed_local[m]
            pos = local.to(device) + (shift[j] + space.offsets[j])
            index[pos] = torch.arange(n_src, n_src + pos.numel(), dtype=dtype, device=device)
            n_src += pos.numel()
        if index.numel() and int(index.min()) < 0:
            raise ValueError("the symmetry blocks and the rest do not cover every parameter")
        return index

    def _same_as(
        self, plan: list[list[_Factor]], pieces: Sequence, index: dict[torch.device, Tensor]
    ) -> bool:
        """Whether ``plan`` puts every source coordinate where ``index`` does (checked once)."""
        moved: list[tuple[Tensor, ...]] = [() for _ in pieces]
        dtype = next(iter(index.values())).dtype
        rest: list[Tensor | None] = [None] * len(self.layout)
        for device, (syms, mixed, _) in self.sources.items():
            kind = {"dtype": dtype, "device": device}
            n = 0
            for k in syms:
                comps = []
                for p in pieces[k].geometry.point:
                    comps.append(torch.arange(n, n + p.numel(), **kind).view(p.shape))
                    n += p.numel()
                moved[k] = tuple(comps)
            for m in mixed:
                local = self.mixed_local[m][1]
                rest[self.mixed[m]] = torch.arange(n, n + local.numel(), **kind)
                n += local.numel()
        if self.rest_piece is not None:
            moved[self.rest_piece] = tuple(rest)  # type: ignore[arg-type]
        saved, self.plan = self.plan, plan
        try:
            out = self._gathered(moved, dtype)
        finally:
            self.plan = saved
        return all(
            torch.equal(
                torch.cat([out[self.gathered[g]].reshape(-1) for g in gathered]), index[device]
            )
            for device, (_, _, gathered) in self.sources.items()
            if gathered
        )

    def __call__(
        self, moved: Sequence[tuple[Tensor, ...]], rows_log: RowsWritten | None = None
    ) -> dict[str, Tensor]:
        """The perturbed parameters by name from the moved pieces (one tuple per piece).

        ``rows_log``: a table cut to rows (:attr:`rows`) is written in place, its rows put
        back by the log (:mod:`~geosharp.estimators.table_rows`), where only a reverse-mode
        gradient (or none) is taken; without it, a copy of the table with the rows replaced.
        """
        out: dict[str, Tensor] = {}
        rest = moved[self.rest_piece] if self.rest_piece is not None else ()
        for c, ((j, whole), value) in enumerate(zip(self.layout, rest, strict=True)):
            if whole:
                if c in self.rows:  # a table cut to the rows a batch reaches: w, those replaced
                    r, table = self.rows[c]
                    if rows_log is not None and (untracked([value]) or _reverse_mode_only([value])):
                        value = rows_into(table, r, value, rows_log)
                    else:
                        value = table.index_put((r,), value)
                out[self.names[j]] = value.view(self.shapes[j])
        if self.gathered:
            ref = moved[self.sym_pieces[0]][0] if self.sym_pieces else rest[self.mixed[0]]
            for j, value in self._gathered(moved, ref.dtype).items():
                out[self.names[j]] = value
        if len(out) < len(self.names):  # empty parameters (a rank's empty shard): no coordinate
            like = next(t for comps in moved for t in comps)
            for j, name in enumerate(self.names):
                if name not in out:
                    out[name] = like.new_zeros(self.shapes[j], device=self.devices[j])
        return {name: out[name] for name in self.names}

    def _gathered(
        self, moved: Sequence[tuple[Tensor, ...]], dtype: torch.dtype
    ) -> dict[int, Tensor]:
        """The parameters holding symmetry coordinates, built from the moved pieces.

        With a :attr:`plan`, each is a fresh tensor on its parameter's device whose parts are
        written through views (:func:`~geosharp.symmetry.specs.slice_view`: differentiable, no
        position tensor); else, on each device, one gather by its :attr:`index` from the
        values of the pieces there, concatenated.
        """
        rest = moved[self.rest_piece] if self.rest_piece is not None else ()
        if self.plan is None:
            out = {}
            for device, (syms, mixed, gathered) in self.sources.items():
                if not gathered:
                    continue
                parts = [v.reshape(-1) for k in syms for v in moved[k]]
                parts += [rest[self.mixed[m]].reshape(-1) for m in mixed]
                source = torch.cat(parts) if len(parts) > 1 else parts[0]
                sizes = [self.gathered_sizes[g] for g in gathered]
                values = torch.split(torch.index_select(source, 0, self.index[device]), sizes)
                for g, v in zip(gathered, values, strict=True):
                    j = self.gathered[g]
                    out[j] = v.view(self.shapes[j])
            return out
        inputs = [v for k in self.sym_pieces for v in moved[k]] + [rest[c] for c in self.mixed]
        if _reverse_mode_only(inputs):  # else the views' own autograd (torch.func, duals)
            out = _WriteParts.apply(self, dtype, *inputs)
            return dict(zip(self.gathered, out, strict=True))
        return self._write(inputs, dtype, batched=untracked(inputs))

    def _write(self, inputs: Sequence[Tensor], dtype: torch.dtype, batched: bool = False) -> dict:
        """The gathered parameters, written part by part through views of the :attr:`plan`.

        ``inputs``: the block components in piece order, then the mixed rest components. Each
        parameter is made on its own device (:attr:`devices`). ``batched``: the parts in one
        multi-tensor copy (where no autograd or functional transform sees the copies).
        """
        bufs = {j: self._buffer(j, dtype) for j in self.gathered}
        it = iter(inputs)
        dests, srcs = [], []
        for factors in self.plan:
            for factor in factors:
                for t, part in factor.split(next(it)):
                    dest = part.view(bufs[part.param])
                    if batched:
                        dests.append(dest)
                        srcs.append(t.view(dest.shape))
                    else:  # each view made right before its copy (autograd records them)
                        dest.copy_(t.view(dest.shape))
        if dests:  # one multi-tensor copy (no graph recorded: inside _WriteParts)
            _copy_all(dests, srcs)
        for j, local in self.mixed_local:
            bufs[j].view(-1).index_put_((local.to(self.devices[j]),), next(it).reshape(-1))
        return bufs

    def _buffer(self, j: int, dtype: torch.dtype) -> Tensor:
        """Where parameter ``j`` is written: its :attr:`targets` tensor if it fits, else anew."""
        t = None if self.targets is None else self.targets.get(j)
        if t is not None and t.dtype == dtype and tuple(t.shape) == tuple(self.shapes[j]):
            return t
        return torch.empty(self.shapes[j], dtype=dtype, device=self.devices[j])

    def _read(
        self, factor: _Factor, grads: Sequence[Tensor], shape: torch.Size, device: torch.device
    ) -> Tensor:
        """One block component read part by part from the parameters' ``grads``.

        The adjoint of :meth:`_write` for that component: a fresh tensor of ``shape``.
        """
        return read_parts(factor, grads, shape, grads[factor.parts[0][0].param].dtype, device)

    def pull_back(self, pieces: Sequence, grads: Sequence[Tensor]) -> list[list[Tensor]]:
        """The adjoint of :meth:`__call__` for moved pieces equal to their input (``ξ = 0``).

        Args:
            pieces: The pieces the assembly was built for.
            grads: ``∂L/∂θ′``, one tensor per parameter of the space.

        Returns:
            Per piece, per component, the gradient laid out as that component: a whole
            parameter of the rest piece gets its gradient itself (its reached rows, if cut);
            the symmetry pieces read their parts of the parameters' gradients through the same
            views as :meth:`__call__` (or the gather index, scattered back), then split.
        """
        out: list[list] = [[None] * len(p.geometry.point) for p in pieces]
        if self.gathered and self.plan is not None:
            for k, factors in zip(self.sym_pieces, self.plan, strict=True):
                for c, factor in enumerate(factors):
                    ref = pieces[k].geometry.point[c]
                    out[k][c] = self._read(factor, grads, ref.shape, ref.device)
            for c, (j, local) in zip(self.mixed, self.mixed_local, strict=True):
                out[self.rest_piece][c] = grads[j].reshape(-1)[local.to(grads[j].device)]
        elif self.gathered:
            for device, (syms, mixed, on) in self.sources.items():
                if not on:
                    continue
                gathered = torch.cat([grads[self.gathered[g]].reshape(-1) for g in on])
                source = torch.empty_like(gathered)
                source[self.index[device]] = gathered
                del gathered
                slots = [(k, c) for k in syms for c in range(len(pieces[k].geometry.point))]
                slots += [(self.rest_piece, self.mixed[m]) for m in mixed]
                sizes = [pieces[k].geometry.point[c].numel() for k, c in slots]
                for (k, c), part in zip(slots, torch.split(source, sizes), strict=True):
                    out[k][c] = part.view(pieces[k].geometry.point[c].shape)
        if self.rest_piece is not None:
            for c, (j, whole) in enumerate(self.layout):
                if whole:
                    g = grads[j]
                    if c in self.rows:
                        g = g.index_select(0, self.rows[c][0])
                    out[self.rest_piece][c] = g
        return out


class _WriteParts(torch.autograd.Function):
    """:meth:`Assembly._write` with its adjoint written out: each part read back once.

    Through autograd, every part copied into a view of a fresh parameter records a
    ``CopySlices`` (a clone of the whole parameter's gradient in the backward), and the
    splits of a block component into parts gather their gradients with zero-filled
    concatenations (two full copies of the component per level). The adjoint of a write
    through views is a read through the same views: one copy per part
    (:meth:`Assembly._read`). A backward with ``create_graph=True`` (curvature) takes the
    views' own adjoint instead, as a differentiable vector-Jacobian product of the (linear)
    write.
    """

    @staticmethod
    def forward(ctx, assembly, dtype, *inputs):
        ctx.assembly = assembly
        ctx.likes = [(t.shape, t.dtype, t.device) for t in inputs]
        ctx.out_dtype = dtype
        bufs = assembly._write(inputs, dtype, batched=True)
        # a target (a tensor of the caller's, written in place) leaves as a view of it: the
        # output carries the graph, the caller's tensor stays a plain one
        targets = assembly.targets or {}
        return tuple(
            bufs[j].view_as(bufs[j]) if bufs[j] is targets.get(j) else bufs[j]
            for j in assembly.gathered
        )

    @staticmethod
    def backward(ctx, *grads_out):
        a = ctx.assembly
        if torch.is_grad_enabled():  # create_graph: the adjoint of the views, differentiable
            leaves = [
                torch.zeros(s, dtype=d, device=v, requires_grad=True) for s, d, v in ctx.likes
            ]
            bufs = a._write(leaves, ctx.out_dtype)
            outs = [bufs[j] for j in a.gathered]
            back = torch.autograd.grad(
                outs, leaves, grads_out, create_graph=True, allow_unused=True
            )
            return (None, None, *back)
        grads: list[Tensor | None] = [None] * len(a.shapes)
        for j, g in zip(a.gathered, grads_out, strict=True):
            grads[j] = g
        out: list[Tensor | None] = []
        needs = iter(ctx.needs_input_grad[2:])
        likes = iter(ctx.likes)
        for factors in a.plan:
            for factor in factors:
                shape, _, device = next(likes)
                out.append(a._read(factor, grads, shape, device) if next(needs) else None)
        for j, local in a.mixed_local:
            next(likes)
            out.append(grads[j].reshape(-1)[local.to(grads[j].device)] if next(needs) else None)
        return (None, None, *out)


#: The former private name (tests and type hints outside this package still use it).
_Assembly = Assembly
