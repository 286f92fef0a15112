r"""θ′ of the attention projections made where FSDP gathers them, layer by layer (SPEC §10.7).

A geodesic loss on a sharded model needs ``θ′ = w + ξ − ½Γ(ξ, ξ)`` of the parameters holding
symmetry-block coordinates (the Q, K, V, O projections). Written into the shards, it would
leave ``w`` nowhere but in a copy (the blocks' base point, held through the forward and the
backward: the attention projections' share of a parameter-sized buffer per rank). Here the
shards keep ``w``: each FSDP module's all-gather (:meth:`FSDPModule.set_custom_all_gather
<torch.distributed.fsdp.FSDPModule.set_custom_all_gather>`, the public hook for a custom
collective) first overwrites the rank's slice of its input, FSDP's own copy of the layer's
shards, with the rank's rows of ``θ′``, then gathers as before. Every rank makes its rows of
``θ′`` from its shard of ``w``, its rows of ``ξ`` and the step's ``h × h`` factors of the
order-2 endpoint (``G′ = G (I + s B_G) + ξ_G C_G``, :mod:`~geosharp.geometry.gl_endpoint`,
summed over the ranks once per loss before the forward): a row-wise product, nothing gathered
but the layer FSDP gathers anyway. The forward and the backward (which gathers the layer again)
see ``θ′``; FSDP's reduce-scattered gradient is ``∂L/∂θ′``, pulled back to ``ξ`` after the
backward. The blocks' base point is held nowhere but in the shards: the GL geometry reads its
rows from them a chunk of heads at a time (:meth:`GLGeometry.read_point_from
<geosharp.geometry.GLGeometry.read_point_from>`) in the projection, the step's factors and the
pullback, which overwrites the rows of ``∂L/∂θ′`` with those of ``∂L/∂ξ``.

:class:`GatheredEndpoint` serves order-2 geodesics of GL-type blocks (GL(h), rotary, LoRA), with
blocks held fixed (key-bias translations) and the rest coordinates of the projections; anything
else (the exact geodesic, diagonal pairs, the ablation without the corrected norm, a module with
several parameter groups, parameters offloaded or with FSDP tensor extensions) keeps θ′ written
into the shards. With one rank FSDP gathers nothing (it copies each shard into the unsharded
parameter): the parameters holding block rows then hand it a copy of their shard with ``θ′``
written into it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from geosharp.estimators.factor_plan import read_heads, read_parts
from geosharp.estimators.sharded import fsdp2
from geosharp.geometry.gl_endpoint import add_eye, add_mm

__all__ = ["GatheredEndpoint"]


class _Slot(NamedTuple):
    """Where a parameter's rank shard lies in its FSDP module's all-gather input."""

    param: int  # position among the shards' parameters
    offset: int  # in elements of the input
    numel: int
    shape: torch.Size
    fsdp_param: Any  # FSDP's record of the parameter (its all-gather input, one rank)


class _Part(NamedTuple):
    """The rows of one GL piece component that lie in one parameter: ``θ′`` rows to write."""

    piece: int
    comp: int  # 0: G, 1: H
    heads: slice
    rows: slice
    part: Any  # the assembly's _Part (its view of the parameter)


class _ThetaWriter:
    """Writes the rank's rows of ``θ′`` of one slot into FSDP's copy of its shard (one rank)."""

    def __init__(self, owner: GatheredEndpoint, slot: _Slot) -> None:
        self.owner, self.slot = owner, slot

    @property
    def active(self) -> bool:
        """Whether a loss is running (else FSDP copies the shard, ``w``, as it is)."""
        return self.owner.active

    def __call__(self, buf: Tensor) -> None:
        slot = self.slot
        self.owner.write_theta(slot.param, buf.narrow(0, 0, slot.numel).view(slot.shape))


class GatheredEndpoint:
    """The order-2 endpoint of a sharded model's blocks, written into FSDP's all-gather inputs.

    Built by :meth:`build` (``None`` where unsupported); per loss: :meth:`step` with the moved
    pieces (the factors of ``θ′``), then the forward and backward inside :meth:`during_loss`.
    """

    def __init__(self, shards: Any, pert: Any, comms: list[tuple[Any, list[_Slot]]]) -> None:
        self.shards, self.pert = shards, pert
        names = pert.space.param_names
        merged = {**shards.base, **shards.padding}  # the shards (w) and the padding rows
        #: every parameter of the rank's space, by position: the shards hold ``w`` throughout
        self.tensors = [merged[n] for n in names]
        at = {n: j for j, n in enumerate(names)}
        asm = pert.assembly
        #: the GL pieces and their assembly plans (where their rows lie in the parameters)
        self.plans = {
            k: factors
            for k, factors in zip(asm.sym_pieces, asm.plan, strict=True)
            if pert.pieces[k].geometry.row_endpoint(pert.pieces[k].order)
        }
        #: per parameter position, the GL rows it holds
        self.parts: dict[int, list[_Part]] = {}
        for k, factors in self.plans.items():
            for c, factor in enumerate(factors):
                for heads, rows, part in factor.ranges():
                    rows = slice(None) if rows is None else rows
                    self.parts.setdefault(part.param, []).append(_Part(k, c, heads, rows, part))
        #: the rest coordinates inside those parameters: (parameter, local positions, rest comp)
        self.mixed = [(j, local, asm.mixed[m]) for m, (j, local) in enumerate(asm.mixed_local)]
        self._rest_moves = pert.rest_index is not None and pert.straight_rest
        #: the parameters whose shard is not ``θ′`` as it is
        self._writes = set(self.parts) | {j for j, _, _ in self.mixed}
        #: per FSDP module, the slots of those parameters, renumbered from the shards' order to
        #: the space's (modules with none left out: the root's embeddings, …)
        self._comms = []
        for module, slots in comms:
            mine = [s._replace(param=at[shards.names[s.param]]) for s in slots]
            mine = [s for s in mine if s.param in self._writes]
            if mine:
                self._comms.append((module, mine))
        #: per GL piece, the step's (E_G, C_G, E_H, C_H) and the moved pieces (None: inactive)
        self._factors: dict[int, tuple[Tensor, ...]] | None = None
        #: per GL piece, the step's (C_G, C_H, s), for :meth:`pull_back`
        self._adjoint: dict[int, tuple[Tensor, Tensor, float]] = {}
        self._moved: list | None = None
        self._read_from_shards()

    # -- whether it serves -------------------------------------------------------------------
    @classmethod
    def build(cls, shards: Any, pert: Any) -> GatheredEndpoint | None:
        """The endpoint of ``pert`` on ``shards``'s model, or ``None`` where it does not serve."""
        asm = pert.assembly
        if asm.plan is None or not asm.gathered or not shards.copied:
            return None
        for k in asm.sym_pieces:
            piece = pert.pieces[k]
            geom = piece.geometry
            if geom.is_trivial:  # held fixed: nothing written
                continue
            if not geom.row_endpoint(piece.order):
                return None
            if piece.norm_geometry is not geom:  # the ablation's norm reads the point
                return None
            if geom.G.dim() != 3 or geom.H.dim() != 3:
                return None
        rest = pert.rest_index
        if asm.mixed_local and rest is not None and not pert.straight_rest:
            if not pert.pieces[rest].geometry.is_trivial:
                return None
        try:
            comms = _slots(shards)
        except AttributeError:  # FSDP's internals moved: θ′ is written over the shards
            comms = None
        if comms is None:
            return None
        return cls(shards, pert, comms)

    # -- one loss ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, moved: list | None) -> None:
        """The factors of ``θ′`` at the moved pieces (one ``h × h`` sum over ranks per piece).

        ``moved``: the pieces as :meth:`~geosharp.estimators.sharded.objective` moves them (the
        block pieces still ``ξ``, the rest's components inside the projections ``θ′``);
        ``None`` deactivates.
        """
        if moved is None:  # the fill is off; the adjoint's factors stay for pull_back
            self._factors = self._moved = None
            return
        factors, self._adjoint = {}, {}
        for k in self.plans:
            geom = self.pert.pieces[k].geometry
            ex = geom.execution
            xG, xH = (t.to(ex.endpoint_dtype) for t in moved[k])
            cG, bG, cH, bH, s = geom.order2_factors(xG, xH, self._sum(ex))
            factors[k] = (add_eye(bG, s), cG, add_eye(bH, s), cH)
            self._adjoint[k] = (cG, cH, s)
        self._factors, self._moved = factors, moved

    @torch.no_grad()
    def _read_rows(self, grads: dict[str, Tensor]) -> dict[int, list[Tensor]]:
        """The GL pieces' rows of ``∂L/∂θ′``, read from the shards' gradient (by name).

        Through the assembly's views, in the endpoint's dtype; the projections' own gradients
        are then let go (FSDP's buffers of those layers with them: the rest of their gradients
        was cloned, :meth:`~geosharp.estimators.sharded.params.ShardedParams.backward`).
        """
        pert = self.pert
        names = pert.space.param_names
        g = [grads.get(n) for n in names]
        rows: dict[int, list[Tensor]] = {}
        for k in self._adjoint:  # the point's storage is given back, its shape is not
            geom = pert.pieces[k].geometry
            dt = geom.execution.endpoint_dtype
            rows[k] = [
                read_parts(self.plans[k][c], g, t.shape, dt, t.device)
                for c, t in enumerate(geom.point)
            ]
        del g
        mixed = {j for j, _, _ in self.mixed}
        for j, n in enumerate(names):
            if j in self.parts and j not in mixed:
                grads.pop(n, None)
        return rows

    @torch.no_grad()
    def pull_back(self, grads: dict[str, Tensor], moved: list) -> list:
        """``∂L/∂ξ`` from the shards' gradient ``∂L/∂θ′`` (by name).

        The endpoint's adjoint (:func:`~geosharp.geometry.gl_endpoint.order2_adjoint_by_chunks`)
        with the factors of :meth:`step` (no second forward of the endpoint) on the GL pieces'
        rows of ``∂L/∂θ′``, read once and overwritten with ``∂L/∂ξ``; the rest coordinates'
        gradient is their shards' (zero where held fixed), as are the fixed pieces'.
        """
        rows = self._read_rows(grads)
        pert = self.pert
        names = pert.space.param_names
        g = [grads.get(n) for n in names]
        out: list = []
        for k, (piece, x) in enumerate(zip(pert.pieces, moved, strict=True)):
            if k in self._adjoint:  # the rows of dL/dθ′ become those of dL/dξ (in place)
                geom = piece.geometry
                ex = geom.execution
                xG, xH = (t.to(ex.endpoint_dtype) for t in x)
                dx = geom.order2_adjoint(
                    (xG, xH), self._adjoint[k], tuple(rows.pop(k)), self._sum(ex)
                )
                out.append(tuple(d.to(t.dtype) for d, t in zip(dx, x, strict=True)))
            elif k == pert.rest_index and self._rest_moves:
                comps = []
                for (j, local), t in zip(pert.layout, x, strict=True):
                    gj = g[j]
                    comps.append(
                        gj.view(t.shape) if local is None else gj.reshape(-1)[local.to(gj.device)]
                    )
                out.append(tuple(comps))
            else:  # held fixed: the loss does not move with it
                out.append(tuple(torch.zeros_like(t) for t in x))
        self._adjoint = {}
        return out

    def _sum(self, execution: Any) -> Any:
        """The geometry's sum over ranks, ``None`` with one rank (every row is here)."""
        return execution.row_sum if self.shards.world > 1 else None

    @property
    def active(self) -> bool:
        """Whether a loss is running: :meth:`step` was given the moved pieces."""
        return self._factors is not None

    @contextlib.contextmanager
    def during_loss(self) -> Iterator[None]:
        """Within: FSDP gathers ``θ′`` (the shards keep ``w``).

        Several ranks: each module's all-gather is FSDP's own behind FSDP's public hook for a
        custom all-gather, which writes the rank's rows of ``θ′`` into its input first. One
        rank: FSDP copies each shard into its unsharded parameter, no collective; the shard it
        copies is made ``θ′`` first (a copy of it: the shard keeps ``w``).
        """
        installed: list[tuple[Any, Any]] = []
        try:
            if self.shards.world > 1:
                for module, slots in self._comms:
                    inner = fsdp2.all_gather_comm(module)
                    installed.append((module, inner))
                    fill = functools.partial(self._fill, slots)
                    module.set_custom_all_gather(fsdp2.endpoint_all_gather(inner, fill))
                yield
            else:
                writers = [
                    (s.fsdp_param, _ThetaWriter(self, s)) for _, ss in self._comms for s in ss
                ]
                with fsdp2.theta_inputs(writers):
                    yield
        finally:
            for module, inner in installed:
                module.set_custom_all_gather(inner)

    def _fill(self, slots: list[_Slot], inp: Tensor) -> None:
        """Write the rank's rows of ``θ′`` into the all-gather input ``inp`` (if active)."""
        if self._factors is None:
            return
        for slot in slots:
            self.write_theta(slot.param, inp.narrow(0, slot.offset, slot.numel).view(slot.shape))

    @torch.no_grad()
    def write_theta(self, j: int, dest: Tensor) -> None:
        """``θ′`` of parameter ``j``'s rank shard written into ``dest`` (which holds ``w``)."""
        w = self.tensors[j]
        moved, factors = self._moved, self._factors
        for p in self.parts.get(j, ()):
            geom = self.pert.pieces[p.piece].geometry
            dt = geom.execution.endpoint_dtype
            x = moved[p.piece][p.comp][p.heads, p.rows]
            rows = p.part.view(w).reshape(x.shape).to(dt)
            E, C = factors[p.piece][2 * p.comp], factors[p.piece][2 * p.comp + 1]
            out = add_mm(rows @ E[p.heads], x.to(dt), C[p.heads], inplace=True)  # as the forward
            view = p.part.view(dest)
            view.copy_(out.to(geom.dtype).view(view.shape))
        if self._rest_moves:
            rest = moved[self.pert.rest_index]
            for jj, local, c in self.mixed:
                if jj == j:
                    flat = dest.view(-1)
                    flat[local.to(flat.device)] = rest[c].reshape(-1).to(flat.dtype)

    # -- the blocks' base point: read from the shards, held nowhere ----------------------------
    def _read_from_shards(self) -> None:
        """The GL pieces read their base point from the shards; its tensors' memory is freed.

        Each piece's geometry reads a chunk of heads at a time through the assembly's views
        (:meth:`GLGeometry.read_point_from <geosharp.geometry.GLGeometry.read_point_from>`): the
        projection, the step's factors and the pullback hold one chunk of ``G``, ``H``. The
        point's tensors (copies read through the assembly's plan, ``_block_pieces``, never the
        shards themselves) and a widened copy the geometry holds keep their shapes and lose their
        storage: nothing of this call reads them again (the order-2 endpoint is
        :meth:`write_theta`).
        """
        seen: set[int] = set()
        for k, factors in self.plans.items():
            geom = self.pert.pieces[k].geometry
            for t in geom.read_point_from(self._reader(factors, geom.point)):
                if _ptr(t) not in seen:
                    seen.add(_ptr(t))
                    t.untyped_storage().resize_(0)

    def _reader(self, factors: Sequence[Any], point: Sequence[Tensor]) -> Any:
        """``point_rows(heads, dtype)`` of one piece: its components read from the shards."""
        tensors = self.tensors
        shapes = [(t.shape, t.device) for t in point]

        def read(heads: slice, dtype: torch.dtype) -> tuple[Tensor, ...]:
            return tuple(
                read_heads(f, tensors, heads, shape, dtype, device)
                for f, (shape, device) in zip(factors, shapes, strict=True)
            )

        return read


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _slots(shards: Any) -> list[tuple[Any, list[_Slot]]] | None:
    """Per FSDP module, where its trainable parameters' shards lie in its all-gather input.

    ``None`` where the input is not the shards themselves laid end to end in one dtype: a
    module with several parameter groups, a shard that is not the first elements of FSDP's
    padded flat shard, a parameter offloaded to the CPU, with an FSDP tensor extension, or
    of another all-gather dtype.
    """
    index = {id(p): j for j, p in enumerate(shards.params)}
    out = []
    for module in shards.modules:
        groups = fsdp2.param_groups(module)
        if len(groups) > 1:
            return None
        if not groups:
            continue
        slots, offset, dtypes = [], 0, set()
        cast = getattr(groups[0].mp_policy, "param_dtype", None)  # FSDP's mixed precision
        for fp in groups[0].fsdp_params:
            data = fsdp2.sharded_param_data(fp)  # the all-gather input: the padded shard, flat
            if fsdp2.unsupported_param(fp):
                return None
            dtypes.add(cast or fp.sharded_param.dtype)
            j = index.get(id(fp.sharded_param))
            if j is not None:
                t = shards.locals[j]
                # the shard is the input's first elements, in its own shape (any dimension)
                if t.numel() and (not t.is_contiguous() or t.data_ptr() != data.data_ptr()):
                    return None
                slots.append(_Slot(j, offset, t.numel(), t.shape, fp))
            offset += data.numel()
        if len(dtypes) > 1:
            return None
        out.append((module, slots))
    return out
