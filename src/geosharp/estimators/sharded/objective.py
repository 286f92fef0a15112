r"""The objective of a model sharded by FSDP2: one loss at ``θ′(ξ)`` on the rank's shards.

The rank's shard of ``θ′`` is written into (or, in place, added into) the model's own local
shards, or, for the attention projections of an order-2 geodesic, made where FSDP gathers each
layer (:mod:`~geosharp.estimators.sharded.gather`); the model runs its forward on the rank's
rows of the batch and its backward (FSDP reduce-scatters the gradient), and the gradient is
pulled back to ``ξ``'s shard through the endpoint map (:mod:`geosharp.estimators.sharded` holds
the shards and the steps around this).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from geosharp.estimators.harness import LossFn, Objective, PassBar, nonfinite_loss
from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.symmetry.verify import model_arguments

if TYPE_CHECKING:
    from geosharp.estimators.sharded.run import ShardedRun

__all__ = ["ShardedObjective"]


class ShardedObjective(Objective):
    """``f_S(ξ)`` of a sharded model: the rank's rows of ``S``, the rank's shard of ``ξ``.

    The arguments but ``run`` are :class:`~geosharp.estimators.harness.Objective`'s
    (``inputs``, ``targets``: the rank's rows of the batch).

    Args:
        model: The sharded model.
        loss_fn: The loss of predictions and targets.
        pert: The call's perturbation.
        inputs: The rank's rows of the batch's inputs.
        targets: The rank's rows of the batch's targets.
        batch: The batch's index.
        counter: The call's count of forward and backward passes, or None.
        bar: The progress bar, or None.
        run: The call's :class:`~geosharp.estimators.sharded.run.ShardedRun` (its shards, and
            the blocks' endpoint made where FSDP gathers, if it serves).
    """

    #: the embedding-row cut works on whole tables; a sharded table is kept whole
    row_cut = False

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        pert: Perturbation,
        inputs: Any,
        targets: Any,
        *,
        run: ShardedRun,
        batch: int = 0,
        counter: dict[str, int] | None = None,
        bar: PassBar | None = None,
    ) -> None:
        super().__init__(
            model, loss_fn, pert, inputs, targets, batch=batch, counter=counter, bar=bar
        )
        self.run = run
        self.shards = run.shards

    def _loss(self) -> Tensor:
        args, kwargs = model_arguments(self.inputs)
        return self.counted_loss(self.model(*args, **kwargs))

    def rank_loss(self) -> Tensor:
        """The loss of the rank's rows at what the shards hold: one forward of the model itself.

        With its graph when grad is enabled (``gs.curvature`` differentiates it twice,
        :mod:`~geosharp.estimators.sharded.hessian`); a 0-dim tensor, this rank's alone.
        """
        return self._loss()

    def __call__(self, xi: Xi, need_grad: Any, check: bool = True) -> tuple[float, Xi | None]:
        """``(f_S(ξ), ∇_ξ f_S(ξ) or None)`` on the rank's shards (see :class:`Objective`)."""
        loss_at = self._in_place if self.shards.in_place is True else self._written
        if self.run.gather is not None:
            loss_at = self._gathered
        value, grad = loss_at(xi, need_grad)
        if grad is not None:
            self.counter["backward"] += 1
        if check and not math.isfinite(value):  # every rank alike (the mean over ranks)
            raise nonfinite_loss(self.pert, xi, value)
        return value, grad

    def _written(self, xi: Xi, need_grad: Any) -> tuple[float, Xi | None]:
        """The loss with ``θ′`` written over the shards, its gradient pulled back to ``ξ``."""
        pert, grad, shards = self.pert, None, self.shards
        with self._applied(xi) as moved:
            if need_grad is False:
                with torch.no_grad(), pert.assembled_into(shards.writable()):
                    shards.write(pert.endpoint_params(moved, applied=True))
                    return shards.mean_loss(self._loss()), None
            leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in moved]
            with torch.enable_grad():
                with pert.assembled_into(shards.writable()):  # θ′ written into the shards
                    ends = pert.endpoint_params(leaves, applied=True)
                shards.write(ends)
                loss = self._loss()
                value = shards.mean_loss(loss)
                if not callable(need_grad) or need_grad(value):
                    grad = self._pull_back(shards.backward(loss), ends, leaves)
                del loss, ends
        return value, grad

    def _gathered(self, xi: Xi, need_grad: Any) -> tuple[float, Xi | None]:
        """The loss with ``θ′`` of the blocks made where FSDP gathers (the shards hold ``w``).

        :class:`~geosharp.estimators.sharded.gather.GatheredEndpoint`: the step's factors
        before the forward, and the gradient pulled back through the endpoint after the
        backward.
        """
        gather, grad, g, shards = self.run.gather, None, None, self.shards
        with self._applied(xi) as moved:
            gather.step(moved)
            shards.reshard()  # nothing gathered before: every layer gathers θ′
            try:
                with gather.during_loss():
                    if need_grad is False:
                        with torch.no_grad():
                            value = shards.mean_loss(self._loss())
                    else:
                        with torch.enable_grad():
                            loss = self._loss()
                            value = shards.mean_loss(loss)
                            if not callable(need_grad) or need_grad(value):
                                g = shards.backward(loss)
                            del loss
            finally:
                gather.step(None)
                shards.reshard()  # nothing gathered after: a later forward gathers w
            if g is not None:
                grad = gather.pull_back(g, moved)
        return value, grad

    @contextlib.contextmanager
    def _applied(self, xi: Xi) -> Iterator[Xi]:
        """``ξ`` with its straight-line piece turned into ``θ′`` for one loss.

        As :meth:`Perturbation.applied <geosharp.estimators.perturbation.Perturbation.applied>`,
        except that with :attr:`ShardedParams.in_place` ``"rest"`` the parameters with no
        block coordinate hold ``θ′`` in the shards themselves (:meth:`ShardedParams.shift`:
        their base point is not copied), and those components of the result are the shards.
        On exit the shards hold ``w`` again and ``ξ`` is the displacement applied.
        """
        pert, shards = self.pert, self.shards
        k = pert.rest_index
        if shards.in_place != "rest" or k is None or not pert.straight_rest:
            with pert.applied(xi) as moved:
                yield moved
            return
        layout = pert.layout
        whole = [
            c
            for c, (j, local) in enumerate(layout)
            if local is None and shards.names[j] not in shards.copied
        ]
        shards.shift([xi[k][c] for c in whole], [layout[c][0] for c in whole])
        try:  # the rest coordinates inside copied parameters: θ′ in ξ, as in one process
            with pert.applied(xi, skip=set(whole)) as moved:
                rest = list(moved[k])
                for c in whole:
                    rest[c] = shards.locals[layout[c][0]]  # θ′, in the shard
                moved = list(moved)
                moved[k] = tuple(rest)
                yield moved
        finally:
            shards.unshift()

    def _in_place(self, xi: Xi, need_grad: Any) -> tuple[float, Xi | None]:
        """The loss with ``θ′`` added into the shards: ``∂L/∂ξ = ∂L/∂θ′`` (one piece)."""
        grad, shards = None, self.shards
        (rest,) = xi  # the element-wise measures: one piece, one component per parameter
        shards.shift(rest)
        try:
            if need_grad is False:
                with torch.no_grad():
                    return shards.mean_loss(self._loss()), None
            with torch.enable_grad():
                loss = self._loss()
                value = shards.mean_loss(loss)
                if not callable(need_grad) or need_grad(value):
                    g = shards.backward(loss)
                    grad = [tuple(g.pop(n) for n in shards.names)]
                del loss
        finally:
            shards.unshift()
        return value, grad

    def _pull_back(self, g: dict[str, Tensor], ends: Mapping[str, Tensor], leaves: list) -> Xi:
        """``∂L/∂ξ`` from the shards' gradient ``g`` through the endpoint ``ends(leaves)``."""
        flat = [t for x in leaves for t in x]
        outs = [(ends[n], g.pop(n)) for n in self.shards.names if ends[n].requires_grad]
        where = {id(t): i for i, t in enumerate(flat)}
        if all(id(o) in where for o, _ in outs):  # θ′ is ξ's own tensor: ∂L/∂ξ = ∂L/∂θ′
            grads: list = [None] * len(flat)
            for o, v in outs:
                grads[where[id(o)]] = v
        else:
            grads = torch.autograd.grad(
                [o for o, _ in outs],
                flat,
                grad_outputs=[v for _, v in outs],
                allow_unused=True,
            )
        del outs
        it = iter(
            gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, flat, strict=True)
        )
        return [tuple(next(it) for _ in x) for x in leaves]

    def clean(self, need_grad: bool = False) -> tuple[float, Xi | None]:
        """``f_S(0)`` (and its gradient) with the base point in the shards (one plain pass)."""
        shards = self.shards
        self.run.to_base()
        if not need_grad:
            with torch.no_grad():
                return shards.mean_loss(self._loss()), None
        with torch.enable_grad():
            loss = self._loss()
            value = shards.mean_loss(loss)
            g = shards.backward(loss)
        del loss
        self.counter["backward"] += 1
        return value, self.pert.grad_at_zero([g[n] for n in self.pert.space.param_names])
