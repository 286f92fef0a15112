r"""Sharpness of a model sharded by FSDP2, shard by shard (SPEC §10).

A model whose trainable parameters are ``DTensor``\ s sharded by
``torch.distributed.fsdp.fully_shard`` holds, on every rank, one shard of every parameter.
Here the perturbation lives the same way: the base point, ``ξ``, the ascent's iterates and the
gradient are the rank's shards (each ``1/world`` of a parameter-sized buffer), and the weights
are never gathered whole by geosharp (FSDP's own forward gathers one layer at a time, as in
training).

A loss at ``θ′(ξ)`` is one forward and one backward of the model itself, not a
:func:`torch.func.functional_call` (FSDP gathers its own shards before every layer, so
substituted tensors would be bypassed):

1. the rank's shard of ``θ′(ξ)`` is written into the parameters' local shards (in place);
2. the model runs its forward on the rank's rows of the batch, and its backward, in which FSDP
   reduce-scatters the gradient: every rank gets its shard of the gradient of the mean of the
   ranks' losses;
3. that gradient is pulled back through the rank's shard of the endpoint map (autograd,
   locally) to ``ξ``'s shard

(the objective of :mod:`~geosharp.estimators.sharded.objective`).

The value of a batch is the mean over ranks of the ranks' losses (one scalar all-reduce); the
norms and pairings of Auto-PGD are sums over ranks of local sums (one scalar all-reduce per
ascent step, :attr:`~geosharp.estimators.perturbation.Perturbation.reduce`), so every rank
takes the same step decisions and gets the same result. When the call ends the model's shards
hold their values again, bit for bit: subtracted exactly (:meth:`ShardedParams.shift`, adaptive
sharpness at ``ρ ≤ 0.4``), never written (the attention projections of an order-2 geodesic,
whose ``θ′`` is made where FSDP gathers each layer,
:mod:`~geosharp.estimators.sharded.gather`), or written back from a copy of the base point.

Every sharpness measure is measured so: the element-wise ones (adaptive and Euclidean, ℓ2 or
ℓ∞ balls), geodesic sharpness and the attention-only measures at order 1, 2 or exact (their
symmetry blocks laid out on the rank's rows, :mod:`~geosharp.estimators.sharded.space`, SPEC
§10.6, their geometry summing its ``h × h`` contractions over the ranks,
:meth:`ShardedParams.row_sum`, differentiably for the exact geodesic's integrator), worst case
from ``ξ = 0`` or random starts and average case (every rank draws its part of the noise one
process would draw, :mod:`~geosharp.estimators.sharded.draws`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.sharded.check import dtensor_type, fsdp_modules
from geosharp.estimators.sharded.fsdp2 import local_shape_and_offset, local_shard
from geosharp.symmetry import ParameterSpace

#: ``source(targets)``: the base point of the parameters holding block coordinates, by name,
#: assembled into ``targets`` (:meth:`ShardedParams.writable`) where it can.
BaseSource = Callable[[dict[int, Tensor]], dict[str, Tensor]]


class ShardedParams:
    """The rank's shards of a sharded model's trainable parameters.

    Args:
        model: A model whose every trainable parameter is a ``DTensor`` on one 1-D device mesh,
            sharded along one dimension (``fully_shard`` of the layers and of the root).
        in_place: How the base point is kept (:attr:`in_place`, :func:`in_place_ok`).
        key_bias: Lay the model's symmetry blocks out on the rank's rows (as
            :func:`~geosharp.symmetry.find_symmetries`'s ``key_bias``) into
            :attr:`rank_space`; ``None``: no blocks (the element-wise measures).

    Raises:
        ValueError: If some trainable parameter is not a ``DTensor`` (a module left out of
            ``fully_shard``), or a placement is not one ``Shard`` on a 1-D mesh (HSDP's
            replicated dimension, tensor parallelism), or the parameters live on several
            meshes, or none is trainable.
    """

    def __init__(
        self, model: nn.Module, in_place: bool | str = False, key_bias: str | None = None
    ) -> None:
        #: FSDP's modules, resharded before every write (see :meth:`reshard`)
        self.modules = fsdp_modules(model)
        self.reshard()
        dt = dtensor_type()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        plain = [n for n, p in trainable if dt is None or not isinstance(p, dt)]
        if plain:
            more = f" and {len(plain) - 1} more" if len(plain) > 1 else ""
            raise ValueError(
                f"the model is sharded, but its parameter {plain[0]!r}{more} is not: apply "
                "fully_shard to the root module too, so that every trainable parameter is a "
                "sharded DTensor"
            )
        from torch.distributed.tensor import Shard

        mesh = trainable[0][1].device_mesh
        for n, p in trainable:
            if p.device_mesh != mesh:
                raise ValueError(
                    f"the parameters {trainable[0][0]!r} and {n!r} live on different device "
                    "meshes: geosharp measures a model sharded on one mesh"
                )
            if mesh.ndim != 1 or len(p.placements) != 1 or not isinstance(p.placements[0], Shard):
                raise ValueError(
                    f"the parameter {n!r} is placed as {tuple(p.placements)} on a "
                    f"{mesh.ndim}-D mesh: geosharp measures parameters sharded along one "
                    "dimension of a 1-D mesh (FSDP2's fully_shard), not replicated ones (HSDP) "
                    "or tensor parallelism"
                )
        #: frozen parameters, left out as in an unsharded space
        self.excluded = {
            n: "requires_grad=False (frozen)"
            for n, p in model.named_parameters()
            if not p.requires_grad
        }
        #: parameters in the whole (unsharded) model
        self.numel = sum(p.numel() for _, p in trainable)
        self.names = tuple(n for n, _ in trainable)
        self.params = [p for _, p in trainable]
        self.group = mesh.get_group()
        self.world = mesh.size()
        #: the local shards themselves (views of FSDP's storage: a write is what it gathers)
        self.locals = [local_shard(p) for p in self.params]
        #: ``True``: θ′ = w + ξ is added into the shards and subtracted again, exactly
        #: (:meth:`shift`); ``"rest"``: so for the parameters with no symmetry-block coordinate,
        #: while those with one are copied (:meth:`_block_space`) and θ′ is written over them;
        #: ``False``: the base point is a copy of the shards and θ′ is written over them
        self.in_place = in_place
        #: the parameters θ′ is written over (not added into): their base point is a copy (one
        #: 1/world parameter-sized buffer for all of them) or, ``"rest"``, the perturbation's
        #: pieces (:meth:`to_base`'s ``source``); the others' base point is the shards themselves
        self.copied = set() if in_place else set(self.names)
        self.base = {
            n: t.detach().clone() if n in self.copied else t.detach()
            for n, t in zip(self.names, self.locals, strict=True)
        }
        #: (ξ′, parameter position) of a pending :meth:`shift`
        self._shifted: list[tuple[Tensor, int]] | None = None
        self._bits = _bits(self.locals) if in_place else None
        #: the positions of every shard's negative zeros (in place): ``w + ξ − ξ`` turns ``−0``
        #: into ``+0`` (``−0 + 0 = +0``), so :meth:`unshift` writes them back
        self._negative_zeros = [_negative_zeros(t) for t in self.locals] if in_place else []
        #: the zero rows padding the rank's block heads (:meth:`_block_space`), by name
        self.padding: dict[str, Tensor] = {}
        #: the rank's parameter space: the shards' parameters with the model's symmetry
        #: blocks on the rank's rows (``key_bias`` given), else with no blocks (:meth:`space`)
        self.rank_space = self.space() if key_bias is None else self._block_space(model, key_bias)

    def _block_space(self, model: nn.Module, key_bias: str) -> ParameterSpace:
        """The rank's space with the model's symmetry blocks on the rank's rows (SPEC §10.1).

        See :func:`~geosharp.estimators.sharded.space.local_space`; its zero padding rows
        become :attr:`padding` (a part of the base point, never written to the model). With
        :attr:`in_place` ``"rest"`` the parameters holding block coordinates join
        :attr:`copied`: their base point is the perturbation's pieces.
        """
        from geosharp.estimators.sharded.space import local_space

        space, self.padding = local_space(model, self, key_bias)
        if self.in_place == "rest":  # θ′ is written over the parameters holding block coordinates
            whole = {j for j, local in space.rest_layout() if local is None}
            for j, n in enumerate(self.names):
                if j not in whole and self.locals[j].numel():
                    # no copy: the perturbation's pieces gather their values (the base point
                    # restored from them, :meth:`to_base`'s ``source``)
                    self.copied.add(n)
        return space

    def row_sum(self, t: Tensor) -> Tensor:
        """``t`` (``h × h`` contractions of the rank's rows) summed over the ranks (SPEC §10.2).

        Differentiable (the adjoint of a sum over ranks is a sum over ranks of the adjoints);
        half precision is summed in float32.
        """
        import torch.distributed as dist

        wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        if wide.requires_grad:
            return _RankSum.apply(wide, self.group).to(t.dtype)
        out = wide.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out.to(t.dtype)

    def describe(self, gathered: bool = False) -> dict[str, Any]:
        """What a result records of the sharding.

        The world size, the sharded dimensions, and whether the base point was a copy of the
        shards (``"copy"``) or the shards themselves (``"in place"``, :meth:`shift`;
        ``gathered``: the blocks' ``θ′`` was made where FSDP gathers them).
        """
        dims = sorted({p.placements[0].dim for p in self.params})
        base = {True: "in place", "rest": "in place outside the blocks"}.get(self.in_place, "copy")
        if gathered:  # the blocks' θ′ is made where FSDP gathers: w stays put
            base = "in place (blocks gathered)"
        return {"world": self.world, "shard_dims": dims, "base_point": base}

    def space(self) -> ParameterSpace:
        """The parameter space of the rank's shards (local shapes, no symmetry blocks)."""
        shapes = tuple(t.shape for t in self.locals)
        offsets, start = [], 0
        for s in shapes:
            offsets.append(start)
            start += math.prod(s)
        return ParameterSpace(self.names, shapes, tuple(offsets), excluded=dict(self.excluded))

    def reshard(self) -> None:
        """Free every gathered parameter, so that the next forward gathers the shards again.

        FSDP keeps the root module's parameters gathered after a forward until its backward:
        after a forward with no backward, a forward would run on them, not on newly written
        shards.
        """
        for m in self.modules:
            m.reshard()

    def writable(self) -> dict[int, Tensor]:
        """The shards that θ′ is written over, by position, ready to be written into.

        Every gathered parameter is freed first (:meth:`reshard`), so that the next forward
        gathers what is written (the perturbation's assembly writes into these directly,
        :meth:`~geosharp.estimators.perturbation.Perturbation.assembled_into`).
        """
        self.reshard()
        pairs = enumerate(zip(self.names, self.locals, strict=True))
        return {j: t for j, (n, t) in pairs if n in self.copied}

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy the rank's shard of every parameter whose base point is a copy into the model.

        The others (in place, :meth:`shift`) are left as they are, and so are the tensors that
        are the shards' own memory already (written there by the assembly).
        """
        self.reshard()
        with torch.no_grad():
            for n, local in zip(self.names, self.locals, strict=True):
                if n in self.copied and not _same_memory(tensors[n], local):
                    local.copy_(tensors[n])

    def shift(self, xi: Sequence[Tensor], which: Sequence[int] | None = None) -> None:
        """Add ``ξ`` into the shards, which then hold ``θ′ = w + ξ`` (:attr:`in_place` only).

        Every component of ``ξ`` is first rounded in place to ``ξ′ = fl(fl(w + ξ) − w)``, the
        displacement that ``fl(w + ξ)`` really is (what an unsharded call's ``ξ`` becomes too,
        :meth:`~geosharp.estimators.perturbation.Perturbation.applied`). Wherever
        ``|ξ_i| ≤ |w_i| / 2`` (or ``w_i = 0``) the subtraction is exact (Sterbenz), so
        ``w + ξ′`` is a float: the shards hold ``fl(w + ξ)`` and :meth:`unshift` gives ``w``
        back bit for bit (a negative zero ``w_i = −0`` becomes ``+0`` in ``w + ξ′``; its position
        is kept and :meth:`unshift` writes it back). The adaptive ball of radius ``ρ ≤ 0.4``
        guarantees the condition
        (``|ξ_i| ≤ ρ |w_i|``); the call checks the bits at its end (:meth:`restore`).

        ``which``: the positions of the parameters ``xi`` moves (default: every one, in order).
        """
        which = range(len(self.locals)) if which is None else which
        self.reshard()
        with torch.no_grad():
            for x, j in zip(xi, which, strict=True):
                w = self.locals[j]
                x.add_(w).sub_(w)
                w.add_(x)
        self._shifted = list(zip(xi, which, strict=True))

    def unshift(self) -> None:
        """Subtract the ``ξ′`` of :meth:`shift`: the shards hold ``w`` again (nothing if none)."""
        if self._shifted is None:
            return
        with torch.no_grad():
            for x, j in self._shifted:
                w, where = self.locals[j], self._negative_zeros[j]
                w.sub_(x)
                if where.numel():
                    w[torch.unravel_index(where, w.shape)] = -0.0
        self._shifted = None

    def to_base(self, source: BaseSource | None = None, *, written: bool = True) -> None:
        """Put the base point in the shards: subtract a pending shift, or write it back.

        ``written``: whether ``θ′`` was written over the shards :attr:`copied` (``False``: the
        blocks' ``θ′`` was made where FSDP gathers them; the shards held ``w`` throughout).

        ``source(targets)``: with :attr:`in_place` ``"rest"``, the base point of the parameters
        holding block coordinates, by name, assembled from the perturbation's pieces into
        ``targets`` (:meth:`writable`) where it can
        (:meth:`~geosharp.estimators.sharded.run.ShardedRun.base_point`): their block base
        points and rest values are copies already, so these shards are not copied.
        """
        self.unshift()
        if not self.copied or not written:
            self.reshard()
            return
        if self.in_place == "rest":
            if source is None:
                raise RuntimeError(
                    "the base point of the parameters holding block coordinates is not known: "
                    "the perturbation was not built (please report this)"
                )
            with torch.no_grad():
                self.write(source(self.writable()))
        else:
            self.write(self.base)

    def restore(self, source: BaseSource | None = None, *, written: bool = True) -> None:
        """Put the base point back: the shards bit-identical to before the call.

        ``source``, ``written``: as :meth:`to_base`.

        Raises:
            RuntimeError: If in place and the shards' bits differ from the call's start (never
                expected: :meth:`shift` is exact under its condition).
        """
        self.to_base(source, written=written)
        if self._bits is not None and _bits(self.locals) != self._bits:
            raise RuntimeError(
                "the model's shards differ from their values before the call: a perturbation "
                "was not subtracted exactly (please report this)"
            )

    def release(self) -> None:
        """Drop the base point's copy and the padding when the call is over.

        Whatever still holds this object (a perturbation's draws, an objective kept by the
        caller) then holds no copy of the shards (a parameter-sized buffer per world) under the
        next call's peak.
        """
        self.base, self.padding, self._negative_zeros = {}, {}, []

    def zero_grad(self) -> None:
        """Drop the parameters' gradients (FSDP accumulates into them)."""
        for p in self.params:
            p.grad = None

    def grads(self) -> dict[str, Tensor]:
        """The rank's shard of every parameter's gradient (zeros where none flowed)."""
        out = {}
        for n, p, local in zip(self.names, self.params, self.locals, strict=True):
            g = p.grad
            out[n] = torch.zeros_like(local) if g is None else g.to_local()
        return out

    def backward(self, loss: Tensor) -> dict[str, Tensor]:
        """The rank's shard of the gradient of the mean of the ranks' losses, by name.

        FSDP's backward reduce-scatters it into the parameters' gradients, which are taken and
        dropped (nothing accumulates from one loss to the next).

        FSDP's gradients are views of one buffer per layer. The gradient of a parameter that
        θ′ is written over (:attr:`copied`: the attention projections) is pulled back into
        ``ξ``'s layout and dropped, while the others' becomes the ascent direction in place:
        those sharing a buffer with a copied parameter's are cloned, so that the buffer, and
        the copied parameters' part of it, is freed (one block-sized buffer less under the
        next backward, for a copy of the rest of those layers' gradient per step).
        """
        self.zero_grad()
        loss.backward()
        g = self.grads()
        self.zero_grad()
        if self.copied and len(self.copied) < len(self.names):
            shared = {_storage(g[n]) for n in self.copied if g[n].numel()}
            for n, t in g.items():
                if n not in self.copied and t.numel() and _storage(t) in shared:
                    g[n] = t.clone()
        g.update((n, torch.zeros_like(t)) for n, t in self.padding.items())  # never in the loss
        return g

    def sum(self, t: Tensor) -> Tensor:
        """``t`` (small, e.g. a few scalars) summed over the ranks, in float64."""
        import torch.distributed as dist

        out = t.detach().to(device=self.locals[0].device, dtype=torch.float64).clone()
        dist.all_reduce(out, group=self.group)
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the shards' group, in rank order (a picklable object)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_whole(self, shards: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """Whole parameters from every rank's shard of them: ``{position: the rank's shard}``.

        For the Hessian-vector products of ``gs.curvature``, made on the parameters that FSDP
        holds gathered (:mod:`~geosharp.estimators.sharded.hessian`). One all-reduce for them
        all: each rank writes its shard where FSDP's placement puts it in a zero tensor of the
        parameter's shape, and the sum over the ranks is exact (every position is one rank's
        value plus zeros). Every rank passes the same positions.
        """
        fulls = {}
        for j, t in shards.items():
            p = self.params[j]
            full = torch.zeros(p.shape, dtype=t.dtype, device=t.device)
            self._slice(j, full).copy_(t.view(self._slice(j, full).shape))
            fulls[j] = full
        return self._all_reduce(fulls, mean=False)

    def mean_shard(self, wholes: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """The rank's shard of the mean over the ranks of every rank's whole parameters.

        ``wholes``: ``{position: this rank's tensor of the parameter's shape}`` (the same
        positions on every rank). One all-reduce for them all, then the rank's slice of each
        (where FSDP's placement puts the rank's shard): what FSDP's reduce-scatter of a
        gradient makes.
        """
        summed = self._all_reduce({j: t.detach() for j, t in wholes.items()}, mean=True)
        return {j: self._slice(j, t).contiguous() for j, t in summed.items()}

    def _slice(self, j: int, whole: Tensor) -> Tensor:
        """The rank's shard of parameter ``j`` in a tensor ``whole`` of its shape (a view)."""
        p = self.params[j]
        if not p.dim():
            return whole
        shape, offset = local_shape_and_offset(p)
        dim = p.placements[0].dim
        return whole.narrow(dim, int(offset[dim]), int(shape[dim]))

    def _all_reduce(self, tensors: Mapping[int, Tensor], mean: bool) -> dict[int, Tensor]:
        """The sum (``mean``: the mean) over the ranks of every tensor, in one all-reduce."""
        import torch.distributed as dist

        if not tensors:
            return {}
        items = list(tensors.items())
        flat = torch.cat([t.reshape(-1) for _, t in items])
        if self.world > 1:
            dist.all_reduce(flat, group=self.group)
            if mean:
                flat /= self.world
        parts = flat.split([t.numel() for _, t in items])
        return {j: c.view(t.shape).to(t.dtype) for (j, t), c in zip(items, parts, strict=True)}

    def mean_loss(self, loss: Tensor) -> float:
        """The mean over ranks of the ranks' losses."""
        return float(self.sum(loss.reshape(1)) / self.world)


def _bits(tensors: Sequence[Tensor]) -> list[int]:
    """A fingerprint of the tensors' bits: the integer sum of each one's raw words.

    Any change of a single value changes it (no rounding: integer sums); two compensating
    changes in one tensor would be needed to hide one.
    """
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    out = []
    with torch.no_grad():
        for t in tensors:
            words = t.detach().reshape(-1).view(ints[t.element_size()])
            # chunk by chunk: a sum in int64 widens its input, so a whole-tensor sum would
            # make an int64 copy of the largest shard (twice a float32 one)
            out.append(sum(int(c.sum(dtype=torch.int64)) for c in words.split(_CHUNK)))
    return out


#: Elements read at a time by the shard-wide checks (bounds their temporaries).
_CHUNK = 1 << 20


def _negative_zeros(t: Tensor) -> Tensor:
    """The flat positions of ``t``'s negative zeros (``-0.0``), read chunk by chunk."""
    flat = t.detach().reshape(-1)
    found = []
    for lo in range(0, flat.numel(), _CHUNK):
        c = flat[lo : lo + _CHUNK]
        found.append(torch.nonzero((c == 0) & torch.signbit(c)).reshape(-1) + lo)
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.long, device=t.device)


#: The largest adaptive radius whose ball keeps ``|ξ_i| ≤ |w_i| / 2`` with a margin for the
#: projection's rounding: the shards then hold ``θ′`` in place (:meth:`ShardedParams.shift`).
IN_PLACE_RHO = 0.4


def in_place_ok(measure: str, rho: float, perturb: str = "all", kind: str = "worst") -> bool | str:
    """Whether ``θ′`` can be added into the shards and subtracted exactly, with no copy.

    ``True`` for adaptive sharpness at ``ρ ≤ 0.4``; ``"rest"`` for geodesic sharpness there
    (its coordinates outside the blocks move in the adaptive ball: in place; the parameters
    holding block coordinates are written over) and for the attention-only measures at any
    radius (the coordinates outside the blocks do not move); else ``False`` (a copy of the
    shards), also for the average case of a measure that moves the coordinates outside the
    blocks (Gaussian noise has no bound ``|ξ_i| ≤ ρ|w_i|``).
    """
    if perturb == "blocks":
        return "rest"
    if rho > IN_PLACE_RHO or kind == "average":
        return False
    return {"adaptive": True, "geodesic": "rest"}.get(measure, False)


class _RankSum(torch.autograd.Function):
    """``Σ_r t_r`` over the ranks of ``group``, differentiable: its adjoint is the same sum.

    Every rank's output is the sum of every rank's input, so the gradient of a rank's input
    is the sum over the ranks of the gradients of their outputs (one all-reduce each way; the
    exact geodesic's integrator differentiates through it). Under ``create_graph`` the
    backward's sum is itself recorded, so that second derivatives (``gs.curvature``'s
    Hessian-vector products through the endpoint) see it.
    """

    @staticmethod
    def forward(ctx, t: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = t.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        if torch.is_grad_enabled() and grad.requires_grad:  # create_graph: the sum, recorded
            return _RankSum.apply(grad.contiguous(), ctx.group), None
        out = grad.detach().contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b``'s memory itself (e.g. a view of it in its own shape)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _storage(t: Tensor) -> int:
    """The address of ``t``'s storage (views of one buffer share it)."""
    return t.untyped_storage().data_ptr()
