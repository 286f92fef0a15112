"""A sharded call, built once and complete: :func:`prepare` and the :class:`ShardedRun` it returns.

``gs.sharpness`` on a model sharded by FSDP2 makes one call here: :func:`prepare` checks the
call's arguments, takes the rank's shards (:class:`~geosharp.estimators.sharded.params.
ShardedParams`, the symmetry blocks laid out on the rank's rows), makes the rank's draws
(:class:`~geosharp.estimators.sharded.draws.ShardedDraws`), the perturbation of the rank's
space with its sums over the ranks, and, where it serves, the blocks' order-2 endpoint made
where FSDP gathers (:class:`~geosharp.estimators.sharded.gather.GatheredEndpoint`), in that
order, each from the ones before. Nothing is set on any of them afterwards: the
:class:`ShardedRun` holds them, makes the objective of every batch
(:meth:`ShardedRun.objective`) and puts the model's shards back (:meth:`ShardedRun.restored`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from geosharp.estimators.harness import LossFn, PassBar, PerturbationSettings, Setup
from geosharp.estimators.perturbation import Perturbation, RankSums
from geosharp.estimators.sharded import fsdp2
from geosharp.estimators.sharded.draws import ShardedDraws
from geosharp.estimators.sharded.gather import GatheredEndpoint
from geosharp.estimators.sharded.objective import ShardedObjective
from geosharp.estimators.sharded.params import ShardedParams, in_place_ok
from geosharp.symmetry import ParameterSpace

__all__ = ["ShardedRun", "prepare", "prepare_curvature"]


@dataclass(frozen=True)
class ShardedRun:
    """Everything one rank's sharded call measures with, made by :func:`prepare`.

    Attributes:
        shards: The rank's shards of the model's trainable parameters.
        setup: The rank's space, its base point and its perturbation (whose norms and draws
            span the ranks); never cached (the call writes the model's shards).
        gather: The blocks' order-2 endpoint made where FSDP gathers each layer, or ``None``
            (``θ′`` written over the shards).
    """

    shards: ShardedParams
    setup: Setup
    gather: GatheredEndpoint | None

    @property
    def pert(self) -> Perturbation:
        """The rank's perturbation."""
        return self.setup.pert

    def base_point(self, targets: dict[int, Tensor]) -> dict[str, Tensor]:
        """The base point of the parameters holding block coordinates, assembled into ``targets``.

        From the perturbation's pieces (:meth:`~geosharp.estimators.perturbation.Perturbation.
        base_params`): with :attr:`ShardedParams.in_place` ``"rest"`` those shards are not
        copied, and this writes them back.
        """
        with self.pert.assembled_into(targets):
            return self.pert.base_params()

    def to_base(self) -> None:
        """Put the base point in the model's shards (before a clean loss)."""
        self.shards.to_base(self.base_point, written=self.gather is None)

    def objective(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        pert: Perturbation,
        inputs: Any,
        targets: Any,
        *,
        batch: int = 0,
        counter: dict[str, int] | None = None,
        bar: PassBar | None = None,
    ) -> ShardedObjective:
        """One batch's objective (``make`` of :func:`~geosharp.estimators.harness.objectives`)."""
        return ShardedObjective(
            model, loss_fn, pert, inputs, targets, run=self, batch=batch, counter=counter, bar=bar
        )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Within: the call; on any exit the model's shards hold their values again, bit for bit.

        Then the gradients are dropped and the shards' copies released
        (:meth:`ShardedParams.release`).
        """
        try:
            yield
        finally:
            self.shards.restore(self.base_point, written=self.gather is None)
            self.shards.zero_grad()
            self.shards.release()

    @contextlib.contextmanager
    def kept_gathered(self) -> Iterator[None]:
        """Within: FSDP keeps every layer gathered after its forward and backward (curvature).

        :func:`~geosharp.estimators.sharded.fsdp2.kept_gathered`: the Hessian-vector products
        differentiate twice through the gathered parameters; on exit FSDP's own settings are
        back and every layer is resharded.
        """
        with fsdp2.kept_gathered(self.shards.modules):
            yield

    def describe(self) -> dict[str, Any]:
        """What a result records of the sharding (:meth:`ShardedParams.describe`)."""
        return self.shards.describe(gathered=self.gather is not None)


def prepare_curvature(
    model: nn.Module, settings: PerturbationSettings, *, space: ParameterSpace | None = None
) -> ShardedRun:
    """The :class:`ShardedRun` of one rank's call of ``gs.curvature`` on a sharded model.

    Curvature is taken at ``ξ = 0``, where ``θ′`` is what the shards hold: nothing is written
    to them. Their base point is the shards themselves (no copy), checked bit for bit when the
    call ends (:meth:`ShardedRun.restored`); the perturbation is the order-2 one of
    ``settings`` on the rank's space (its blocks on the rank's rows), with the ranks' sums and
    draws, as :func:`prepare` makes it; no endpoint is made where FSDP gathers.

    Raises:
        ValueError: On ``space``; as :class:`ShardedParams`.
    """
    if space is not None:
        raise ValueError("space: a sharded model's space is its ranks' shards; pass None")
    key_bias = settings.key_bias if settings.blocks_needed else None
    shards = ShardedParams(model, in_place=True, key_bias=key_bias)
    rank_space = shards.rank_space
    base = {**shards.base, **shards.padding}
    draws = ShardedDraws(model, shards, key_bias)
    ranks = RankSums(row_sum=shards.row_sum, reduce=shards.sum, draws=draws)
    pert = settings.perturbation(rank_space, base, ranks)
    return ShardedRun(shards, Setup(rank_space, base, pert, False), None)


def prepare(
    model: nn.Module,
    settings: PerturbationSettings,
    *,
    kind: str,
    rho: float,
    space: ParameterSpace | None = None,
    distributed: bool | None = None,
) -> ShardedRun:
    """The :class:`ShardedRun` of one rank's call of ``gs.sharpness`` on a sharded model.

    Every rank measures every batch, on its own rows of it (no data-parallel split).

    Args:
        model: The model, sharded by FSDP2 (:func:`~geosharp.estimators.sharded.check.is_sharded`).
        settings: The perturbation's settings.
        kind: ``"worst"`` or ``"average"`` (the average case copies the shards).
        rho: The radius (the adaptive ball keeps ``θ′`` in the shards up to
            :data:`~geosharp.estimators.sharded.params.IN_PLACE_RHO`).
        space: Must be ``None``: a sharded model's space is its ranks' shards.
        distributed: Must not be ``True`` (every rank measures every batch).

    Raises:
        ValueError: On ``space`` or ``distributed=True``; as :class:`ShardedParams` (a
            parameter not sharded on one 1-D mesh, a block row split across ranks); with
            ``perturb="blocks"`` and no symmetry blocks.
    """
    if space is not None:
        raise ValueError("space: a sharded model's space is its ranks' shards; pass None")
    if distributed:
        raise ValueError(
            "distributed=True splits whole batches across ranks, each holding the whole "
            "model; a sharded model measures every batch on every rank, on the rank's rows "
            "of it: leave distributed unset"
        )
    in_place = in_place_ok(settings.measure, rho, settings.perturb, kind)
    key_bias = settings.key_bias if settings.blocks_needed else None
    shards = ShardedParams(model, in_place=in_place, key_bias=key_bias)
    rank_space = shards.rank_space
    base = {**shards.base, **shards.padding}  # a rank's shards may be empty
    settings.check_blocks(rank_space)
    # random draws: each rank its part of the unsharded draw
    draws = ShardedDraws(model, shards, key_bias)
    ranks = RankSums(row_sum=shards.row_sum, reduce=shards.sum, draws=draws)
    pert = settings.perturbation(rank_space, base, ranks)
    gather = GatheredEndpoint.build(shards, pert) if in_place == "rest" else None
    return ShardedRun(shards, Setup(rank_space, base, pert, False), gather)
