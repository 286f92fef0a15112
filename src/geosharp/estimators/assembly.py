"""How the perturbed parameters are built from the moved pieces, and its adjoint at ξ = 0.

:class:`Assembly` is the map from the pieces of a
:class:`~geosharp.estimators.perturbation.Perturbation` (one tuple of components per piece) to
the perturbed parameters by name, ready for :func:`torch.func.functional_call`; its
:meth:`~Assembly.pull_back` lays a parameter gradient out as the pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.estimators.factor_plan import _copy_all, _Factor, _Part, read_parts
from geosharp.estimators.table_rows import RowsWritten, rows_into
from geosharp.geometry.flat import outside_transforms, untracked
from geosharp.geometry.gl_endpoint import _reverse_mode_only
from geosharp.symmetry import ParameterSpace

__all__ = ["Assembly"]

#: Positions placed at a time while the gather index is filled (bounds its transients).
_CHUNK = 1 << 20
#: Gathered coordinates (every device's together) up to which the assembly's view plan is
#: compared with a gather index built from the blocks' positions; past it, its cover only.
_CHECK_LIMIT = 1 << 24


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
                    if rows_log is not None and outside_transforms([value]):
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
