"""How the perturbed parameters are built from the moved pieces, and its adjoint at ξ = 0.

:class:`_Assembly` is the map from the pieces of a
:class:`~geosharp.estimators.perturbation.Perturbation` (one tuple of components per piece) to
the perturbed parameters by name, ready for :func:`torch.func.functional_call`; its
:meth:`~_Assembly.pull_back` lays a parameter gradient out as the pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.geometry.gl_endpoint import _reverse_mode_only
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.blocks import SymmetryBlock
from geosharp.symmetry.positions import Positions
from geosharp.symmetry.specs import ParamSlice, slice_view

__all__: list[str] = []


@dataclass(frozen=True)
class _Part:
    """One parameter slice of a block factor: rows of the block's ``(heads, n, h)`` tensor."""

    param: int  # the parameter's position in the space
    piece: ParamSlice | None  # None: the whole parameter, in its own shape
    heads: int
    head_dim: int

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

    def split(self, t: Tensor) -> list[tuple[Tensor, _Part]]:
        """The part tensors of ``t`` (views), each with its part."""
        out = []
        blocks = torch.split(t, self.sizes, dim=0) if len(self.sizes) > 1 else (t,)
        if self.flat is not None:
            blocks = tuple(b.view(s) for b, s in zip(blocks, self.flat, strict=True))
        for blk, rows, parts in zip(blocks, self.rows, self.parts, strict=True):
            if parts[0].piece is None:
                out.append((blk, parts[0]))
                continue
            pieces = torch.split(blk, rows, dim=1) if len(rows) > 1 else (blk,)
            out.extend(zip(pieces, parts, strict=True))
        return out


def _factor_plan(space: ParameterSpace, blocks: Sequence[SymmetryBlock]) -> list[_Factor] | None:
    """The :class:`_Factor` of every component of one batched piece, or None if unknown.

    Known: blocks batched by the default :meth:`SymmetryBlock.batch` whose positions are
    :class:`~geosharp.symmetry.positions.Positions` recipes that :func:`slice_view` can view.
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
            for shape, piece, offset in recipe:
                j = owner.get(int(offset))
                if j is None or tuple(space.shapes[j]) != tuple(shape):
                    return None
                part = _Part(j, piece, heads, head_dim)
                if piece is not None:
                    v = slice_view(torch.empty(shape, device="meta"), piece, heads, head_dim)
                    if v is None:
                        return None
                    blk_rows.append(v.numel() // (heads * head_dim))
                elif len(recipe) != 1:
                    return None
                blk_parts.append(part)
            rows.append(tuple(blk_rows))
            parts.append(tuple(blk_parts))
        shapes = tuple(torch.Size(getattr(b, field).shape) for b in blocks) if flat else None
        plan.append(_Factor(tuple(sizes), tuple(rows), tuple(parts), shapes))
    return plan


class _Assembly:
    """Builds the perturbed parameters by name from the moved pieces.

    A parameter with no coordinate in a symmetry block is one component of the rest piece, in
    its own shape: its moved value *is* the perturbed parameter (no copy; its gradient flows
    back unchanged). The parameters with block coordinates (the Q, K, V, O projections) are
    written part by part through views of them (:func:`~geosharp.symmetry.specs.slice_view`,
    known from the blocks' :class:`~geosharp.symmetry.positions.Positions` recipes): nothing
    parameter-sized is held. Blocks whose layout is no view (hand-made position tensors, a
    slice of several parts of a parameter per unit) fall back to one gather index over the
    gathered parameters, from a *source* vector: the symmetry pieces' values followed by the
    rest coordinates of such parameters (on MiniLM-L6 3.5 M of 22.7 M coordinates, int32).
    """

    def __init__(
        self,
        space: ParameterSpace,
        pieces: Sequence,  # of Piece
        rest_piece: int | None,
        layout: Sequence[tuple[int, Tensor | None]],
        device: torch.device,
        groups: Sequence[Sequence[SymmetryBlock]] | None = None,
    ) -> None:
        self.names, self.shapes = list(space.param_names), list(space.shapes)
        sizes = [math.prod(s) for s in self.shapes]
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
        n_gathered = sum(self.gathered_sizes)
        #: The gather index (source position of every gathered coordinate), kept only when
        #: some block's layout is not a view of its parameters (:attr:`plan` is None).
        self.index: Tensor | None = None
        #: Per symmetry piece, per component: where it lies in the parameters (no index).
        self.plan: list[list[_Factor]] | None = None
        if not self.gathered:
            return
        index = torch.full((n_gathered,), -1, dtype=torch.long, device=device)
        # global position → position in the concatenated gathered parameters
        shift = torch.zeros(len(sizes), dtype=torch.long, device=device)
        start = 0
        for j in self.gathered:
            shift[j] = start - space.offsets[j]
            start += sizes[j]
        starts = torch.tensor(space.offsets, dtype=torch.long, device=device)
        n_src = 0
        for k in self.sym_pieces:
            for comp in pieces[k].index:
                glob = comp.reshape(-1).to(device)
                owner = torch.searchsorted(starts, glob, right=True) - 1
                index[glob + shift[owner]] = torch.arange(
                    n_src, n_src + glob.numel(), device=device
                )
                n_src += glob.numel()
                del glob, owner
        for j, local in layout:
            if local is None:
                continue
            pos = local.to(device) + (shift[j] + space.offsets[j])
            index[pos] = torch.arange(n_src, n_src + pos.numel(), device=device)
            n_src += pos.numel()
        if n_gathered and int(index.min()) < 0:
            raise ValueError("the symmetry blocks and the rest do not cover every parameter")
        if n_src < 2**31:  # int32 positions: half the memory (of the check, or kept per call)
            index = index.to(torch.int32)
        if groups is not None:
            plan = [_factor_plan(space, blocks) for blocks in groups]
            if all(p is not None for p in plan) and self._same_as(plan, pieces, index):
                self.plan = plan  # the index is not kept: the layouts are views
                return
        self.index = index

    def _same_as(self, plan: list[list[_Factor]], pieces: Sequence, index: Tensor) -> bool:
        """Whether ``plan`` puts every source coordinate where ``index`` does (checked once)."""
        moved: list[tuple[Tensor, ...]] = [() for _ in pieces]
        kind = {"dtype": index.dtype, "device": index.device}
        n = 0
        for k in self.sym_pieces:
            comps = []
            for p in pieces[k].geometry.point:
                comps.append(torch.arange(n, n + p.numel(), **kind).view(p.shape))
                n += p.numel()
            moved[k] = tuple(comps)
        if self.rest_piece is not None:
            rest = [None] * len(self.layout)
            for c, (_, local) in zip(self.mixed, self.mixed_local, strict=True):
                rest[c] = torch.arange(n, n + local.numel(), **kind)
                n += local.numel()
            moved[self.rest_piece] = tuple(rest)
        saved, self.plan = self.plan, plan
        try:
            out = self._gathered(moved, index.dtype, index.device)
        finally:
            self.plan = saved
        return torch.equal(torch.cat([out[j].reshape(-1) for j in self.gathered]), index)

    def __call__(self, moved: Sequence[tuple[Tensor, ...]]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        rest = moved[self.rest_piece] if self.rest_piece is not None else ()
        for c, ((j, whole), value) in enumerate(zip(self.layout, rest, strict=True)):
            if whole:
                if c in self.rows:  # a table cut to the rows a batch reaches: w, those replaced
                    r, table = self.rows[c]
                    value = table.index_put((r,), value)
                out[self.names[j]] = value.view(self.shapes[j])
        if self.gathered:
            ref = moved[self.sym_pieces[0]][0] if self.sym_pieces else rest[self.mixed[0]]
            for j, value in self._gathered(moved, ref.dtype, ref.device).items():
                out[self.names[j]] = value
        return {name: out[name] for name in self.names}

    def _gathered(
        self, moved: Sequence[tuple[Tensor, ...]], dtype: torch.dtype, device: torch.device
    ) -> dict[int, Tensor]:
        """The parameters holding symmetry coordinates, built from the moved pieces.

        With a :attr:`plan`, each is a fresh tensor whose parts are written through views
        (:func:`~geosharp.symmetry.specs.slice_view`: differentiable, no position tensor);
        else one gather by :attr:`index` from the pieces' values, concatenated.
        """
        rest = moved[self.rest_piece] if self.rest_piece is not None else ()
        if self.plan is None:
            parts = [v.reshape(-1) for k in self.sym_pieces for v in moved[k]]
            parts += [rest[k].reshape(-1) for k in self.mixed]
            source = torch.cat(parts) if len(parts) > 1 else parts[0]
            values = torch.split(torch.index_select(source, 0, self.index), self.gathered_sizes)
            return {j: v.view(self.shapes[j]) for j, v in zip(self.gathered, values, strict=True)}
        inputs = [v for k in self.sym_pieces for v in moved[k]] + [rest[c] for c in self.mixed]
        if _reverse_mode_only(inputs):  # else the views' own autograd (torch.func, duals)
            out = _WriteParts.apply(self, dtype, device, *inputs)
            return dict(zip(self.gathered, out, strict=True))
        return self._write(inputs, dtype, device)

    def _write(self, inputs: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> dict:
        """The gathered parameters, written part by part through views of the :attr:`plan`.

        ``inputs``: the block components in piece order, then the mixed rest components.
        """
        bufs = {j: torch.empty(self.shapes[j], dtype=dtype, device=device) for j in self.gathered}
        it = iter(inputs)
        for factors in self.plan:
            for factor in factors:
                for t, part in factor.split(next(it)):
                    dest = part.view(bufs[part.param])
                    dest.copy_(t.view(dest.shape))
        for j, local in self.mixed_local:
            bufs[j].view(-1).index_put_((local.to(device),), next(it).reshape(-1))
        return bufs

    def _read(
        self, factor: _Factor, grads: Sequence[Tensor], shape: torch.Size, device: torch.device
    ) -> Tensor:
        """One block component read part by part from the parameters' ``grads``.

        The adjoint of :meth:`_write` for that component: a fresh tensor of ``shape``.
        """
        dtype = grads[factor.parts[0][0].param].dtype
        buf = torch.empty(shape, dtype=dtype, device=device)
        for t, part in factor.split(buf):
            src = part.view(grads[part.param])
            t.view(src.shape).copy_(src)
        return buf

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
            gathered = torch.cat([grads[j].reshape(-1) for j in self.gathered])
            source = torch.empty_like(gathered)
            source[self.index] = gathered
            del gathered
            slots = [(k, c) for k in self.sym_pieces for c in range(len(pieces[k].geometry.point))]
            slots += [(self.rest_piece, c) for c in self.mixed]
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
    """:meth:`_Assembly._write` with its adjoint written out: each part read back once.

    Through autograd, every part copied into a view of a fresh parameter records a
    ``CopySlices`` (a clone of the whole parameter's gradient in the backward), and the
    splits of a block component into parts gather their gradients with zero-filled
    concatenations (two full copies of the component per level). The adjoint of a write
    through views is a read through the same views: one copy per part
    (:meth:`_Assembly._read`). A backward with ``create_graph=True`` (curvature) takes the
    views' own adjoint instead, as a differentiable vector-Jacobian product of the (linear)
    write.
    """

    @staticmethod
    def forward(ctx, assembly, dtype, device, *inputs):
        ctx.assembly = assembly
        ctx.likes = [(t.shape, t.dtype, t.device) for t in inputs]
        ctx.out_kind = (dtype, device)
        bufs = assembly._write(inputs, dtype, device)
        return tuple(bufs[j] for j in assembly.gathered)

    @staticmethod
    def backward(ctx, *grads_out):
        a = ctx.assembly
        if torch.is_grad_enabled():  # create_graph: the adjoint of the views, differentiable
            leaves = [
                torch.zeros(s, dtype=d, device=v, requires_grad=True) for s, d, v in ctx.likes
            ]
            bufs = a._write(leaves, *ctx.out_kind)
            outs = [bufs[j] for j in a.gathered]
            back = torch.autograd.grad(
                outs, leaves, grads_out, create_graph=True, allow_unused=True
            )
            return (None, None, None, *back)
        grads: list[Tensor | None] = [None] * len(a.shapes)
        for j, g in zip(a.gathered, grads_out, strict=True):
            grads[j] = g
        out: list[Tensor | None] = []
        needs = iter(ctx.needs_input_grad[3:])
        likes = iter(ctx.likes)
        for factors in a.plan:
            for factor in factors:
                shape, _, device = next(likes)
                out.append(a._read(factor, grads, shape, device) if next(needs) else None)
        for j, local in a.mixed_local:
            next(likes)
            out.append(grads[j].reshape(-1)[local.to(grads[j].device)] if next(needs) else None)
        return (None, None, None, *out)
