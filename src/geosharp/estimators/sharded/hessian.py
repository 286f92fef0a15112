r"""Hessian-vector products of a model sharded by FSDP2: ``gs.curvature`` on the rank's shards.

``gs.curvature`` probes ``∇²f(0)`` of ``f(ξ) = L_S(e(ξ))`` (:mod:`geosharp.estimators.hessian`).
On a sharded model ``ξ`` is the rank's shard of the perturbation (its rows of the symmetry
blocks, its slice of every other parameter, :class:`~geosharp.estimators.sharded.params.
ShardedParams`), and ``∇²f(0) v`` is put together from the chain rule at ``ξ = 0``, where
``e(0) = w`` is what the shards hold (nothing is ever written to them):

.. code-block:: text

    ∇²f(0) v = Jᵀ ∇²L(w) J v + ∇²⟨∇L(w), e⟩(0) v          (J = ∂e/∂ξ at 0)

- ``∇²L(w) u`` by double backward through FSDP: the model's forward on the rank's rows with
  every layer kept gathered (:func:`~geosharp.estimators.sharded.fsdp2.kept_gathered`), its
  gradient with respect to the gathered parameters with ``create_graph=True`` once per batch,
  then one backward of ``⟨∇L_r, u⟩`` per product with ``u`` gathered whole
  (:meth:`ShardedParams.gather_whole <geosharp.estimators.sharded.params.ShardedParams.
  gather_whole>`); the mean over the ranks of the ranks' products, the rank's shard of it
  (:meth:`ShardedParams.mean_shard <geosharp.estimators.sharded.params.ShardedParams.
  mean_shard>`), is the product of the loss of the whole batch;
- ``J v``, ``Jᵀ`` and the endpoint's second-order term by autograd through the rank's endpoint
  (:meth:`Perturbation.endpoint_params <geosharp.estimators.perturbation.Perturbation.
  endpoint_params>`), whose ``h × h`` contractions are summed over the ranks, differentiably
  twice (:meth:`ShardedParams.row_sum <geosharp.estimators.sharded.params.ShardedParams.
  row_sum>`).

Vectors are the rank's coordinates (:class:`RankVector`); their dot products are summed over the
ranks, so every rank runs Lanczos and the trace estimators on the same numbers. The products
hold the model gathered on every rank (FSDP's ``reshard_after_forward=False`` for the call):
curvature measures a sharded model whose gathered weights fit one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from geosharp.estimators.hessian import Flat, HessianOperator, math_sdpa
from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.estimators.sharded.check import dtensor_type

__all__ = ["RankFlat", "RankVector", "ShardedHessian"]


class RankVector:
    """A flat vector of one rank's coordinates; its dot product is summed over the ranks.

    The operations Lanczos and the trace estimators use (:mod:`geosharp.estimators.hessian`):
    products with a number, differences, copies, and the dot product, one scalar all-reduce.
    """

    def __init__(self, local: Tensor, reduce: Callable[[Tensor], Tensor]) -> None:
        self.local, self.reduce = local, reduce

    @property
    def dtype(self) -> torch.dtype:  # noqa: D102
        return self.local.dtype

    def numel(self) -> int:
        """The rank's coordinates."""
        return self.local.numel()

    def __matmul__(self, other: RankVector) -> Tensor:
        """The dot product over every rank's coordinates, a 0-dim float64 tensor."""
        return self.reduce((self.local @ other.local).reshape(1)).reshape(())

    def __mul__(self, c: float | Tensor) -> RankVector:
        return RankVector(self.local * float(c), self.reduce)

    __rmul__ = __mul__

    def __truediv__(self, c: float | Tensor) -> RankVector:
        return RankVector(self.local / float(c), self.reduce)

    def sub_(self, other: RankVector) -> RankVector:  # noqa: D102
        self.local.sub_(other.local)
        return self

    def clone(self) -> RankVector:  # noqa: D102
        return RankVector(self.local.clone(), self.reduce)

    def any(self) -> bool:
        """Whether some rank's coordinate is not zero."""
        return bool(self.reduce(self.local.ne(0).any().reshape(1).double()) > 0)


class RankFlat(Flat):
    """:class:`~geosharp.estimators.hessian.Flat` of the rank's coordinates: :class:`RankVector`.

    ``reduce``: the perturbation's sum over the ranks
    (:attr:`~geosharp.estimators.perturbation.Perturbation.reduce`).
    """

    def __init__(self, template: Xi, dtype: torch.dtype, reduce: Callable[[Tensor], Tensor]):
        super().__init__(template, dtype)
        self.reduce = reduce

    def join(self, leaves: Sequence[Tensor]) -> RankVector:  # noqa: D102
        return RankVector(super().join(leaves), self.reduce)

    def leaves(self, v: RankVector) -> list[Tensor]:  # noqa: D102
        return super().leaves(v.local)

    def zeros(self) -> RankVector:  # noqa: D102
        return RankVector(super().zeros(), self.reduce)


class ShardedHessian(HessianOperator):
    """``∇²f(0)`` of one batch on a sharded model, and ``𝓗 = P g⁻¹ ∇²f(0)`` (the rank's part).

    One forward of the model on the rank's rows and one backward with ``create_graph=True``
    (every layer kept gathered by the caller,
    :meth:`ShardedRun.kept_gathered <geosharp.estimators.sharded.run.ShardedRun.kept_gathered>`);
    every product is then one backward through that graph and three local ones through the
    endpoint.

    Args:
        objective: The batch's :class:`~geosharp.estimators.sharded.objective.ShardedObjective`.
        pert: The rank's perturbation.
        flat: A :class:`RankFlat` of its coordinates.
        counter: ``{"forward", "backward", "hvp"}``, counted up.

    Raises:
        RuntimeError: If FSDP resharded a parameter after the forward (the products need it
            gathered).
    """

    def __init__(self, objective: Any, pert: Perturbation, flat: RankFlat, counter) -> None:
        self.pert, self.flat, self.counter = pert, flat, counter
        shards = objective.shards
        self.shards = shards
        names = list(pert.space.param_names)
        self._names = names
        model_names = list(shards.names)
        leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in pert.zeros()]
        self.leaves = [t for x in leaves for t in x]
        with torch.enable_grad(), math_sdpa():
            loss = objective.rank_loss()
            named = dict(objective.model.named_parameters())
            whole = [named[n] for n in model_names]
            dt = dtensor_type()
            if dt is not None and any(isinstance(w, dt) for w in whole):
                raise RuntimeError(
                    "FSDP did not keep the model's parameters gathered after the forward: "
                    "gs.curvature needs them for its Hessian-vector products (please report this)"
                )
            grads = torch.autograd.grad(loss, whole, create_graph=True, allow_unused=True)
        counter["backward"] += 1
        self.loss = shards.mean_loss(loss.detach())
        #: the gathered parameters and the rank's gradient of its own loss (graph kept)
        self._live = [j for j, g in enumerate(grads) if g is not None and g.requires_grad]
        self._whole = [whole[j] for j in self._live]
        self._grads = [grads[j] for j in self._live]
        # ∇L(w) of the whole batch: the rank's shard of the mean over ranks
        g_mean = shards.mean_shard(
            {
                j: g.detach() if g is not None else torch.zeros_like(w)
                for j, (g, w) in enumerate(zip(grads, whole, strict=True))
            }
        )
        g_shard = {model_names[j]: g for j, g in g_mean.items()}
        del grads
        # the endpoint at ξ = 0, and its pullback of ∇L(w) as a function of ξ
        with torch.enable_grad(), math_sdpa():
            ends = pert.endpoint_params(leaves)
            outs = [ends[n] for n in names]
            self._ends = [(i, o) for i, o in enumerate(outs) if o.requires_grad]
            gl = [self._zero_or(g_shard.get(names[i]), o) for i, o in self._ends]
            pulled = torch.autograd.grad(
                [o for _, o in self._ends],
                self.leaves,
                grad_outputs=gl,
                create_graph=True,
                allow_unused=True,
            )
        #: ``∇f(0) = Jᵀ ∇L(w)`` (flat Euclidean covector)
        self.egrad = self._cat(tuple(p.detach() if p is not None else None for p in pulled))
        self._pulled = [(i, p) for i, p in enumerate(pulled) if p is not None and p.requires_grad]

    @staticmethod
    def _zero_or(t: Tensor | None, like: Tensor) -> Tensor:
        return torch.zeros_like(like) if t is None else t.to(like.dtype).view_as(like)

    def _push(self, parts: list[Tensor]) -> dict[int, Tensor]:
        """``J v`` of the endpoint at ``ξ = 0``, per output position (double vector-Jacobian)."""
        with torch.enable_grad(), math_sdpa():
            ys = [torch.zeros_like(o, requires_grad=True) for _, o in self._ends]
            jt = torch.autograd.grad(
                [o for _, o in self._ends],
                self.leaves,
                grad_outputs=ys,
                create_graph=True,
                allow_unused=True,
            )
            live = [(i, t) for i, t in enumerate(jt) if t is not None and t.requires_grad]
            if not live:
                return {}
            u = torch.autograd.grad(
                [t for _, t in live],
                ys,
                grad_outputs=[parts[i].view_as(t) for i, t in live],
                allow_unused=True,
            )
        return {i: d for (i, _), d in zip(self._ends, u, strict=True) if d is not None}

    def hvp(self, v: Any) -> RankVector:
        """``∇²f(0) v`` (a Euclidean covector, the rank's part)."""
        self.counter["hvp"] += 1
        shards, names = self.shards, self._names
        parts = [t.reshape(-1) for x in self.flat.unflatten(v) for t in x]
        u = self._push(parts)
        # ∇²L(w) J v on the gathered parameters: each rank its loss's, then their mean
        by_name = {names[i]: d for i, d in u.items()}
        local = {}
        for j, w in zip(self._live, self._whole, strict=True):
            d = by_name.get(shards.names[j])
            shape = shards.locals[j].shape
            zero = torch.zeros(shape, dtype=w.dtype, device=w.device)
            local[j] = zero if d is None else d.to(w.dtype)
        whole = shards.gather_whole(local)
        hu: dict[str, Tensor] = {}
        if self._grads:
            outputs = [whole[j].view_as(w) for j, w in zip(self._live, self._whole, strict=True)]
            with torch.enable_grad(), math_sdpa():
                prods = torch.autograd.grad(
                    self._grads, self._whole, outputs, retain_graph=True, allow_unused=True
                )
            pairs = zip(self._live, self._whole, prods, strict=True)
            mean = shards.mean_shard(
                {j: p if p is not None else torch.zeros_like(w) for j, w, p in pairs}
            )
            hu = {shards.names[j]: t for j, t in mean.items()}
        # Jᵀ (∇²L J v) + the endpoint's second-order term ∇²⟨∇L, e⟩ v
        targets = [o for _, o in self._ends] + [p for _, p in self._pulled]
        grads = [self._zero_or(hu.get(names[i]), o) for i, o in self._ends]
        grads += [parts[i].view_as(p) for i, p in self._pulled]
        with torch.enable_grad(), math_sdpa():
            out = torch.autograd.grad(
                targets, self.leaves, grad_outputs=grads, retain_graph=True, allow_unused=True
            )
        return self._cat(out)
