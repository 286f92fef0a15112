r"""Sharpness of a model sharded by FSDP2 (SPEC §10): everything that measures one, in one package.

``gs.sharpness`` on a sharded model makes one call here, :func:`~geosharp.estimators.sharded.
run.prepare`, which returns a complete :class:`~geosharp.estimators.sharded.run.ShardedRun`
(see :mod:`~geosharp.estimators.sharded.params` for how a loss is taken on the rank's shards);
``gs.curvature`` makes one too, :func:`~geosharp.estimators.sharded.run.prepare_curvature`, and
takes its Hessian-vector products through FSDP (:mod:`~geosharp.estimators.sharded.hessian`).

============================  ===================================================================
module                        what it holds
============================  ===================================================================
:mod:`.check`                 whether a model is sharded; the one-line refusal of an entry point
:mod:`.run`                   :func:`prepare` and the :class:`ShardedRun` it builds once
:mod:`.params`                the rank's shards: writes, exact in-place shifts, sums over ranks
:mod:`.space`                 the symmetry blocks laid out on the rank's rows (zero padding)
:mod:`.draws`                 every rank's part of the unsharded random draw
:mod:`.objective`             the objective of one batch on the rank's shards
:mod:`.gather`                the blocks' order-2 ``θ′`` made where FSDP gathers each layer
:mod:`.placement`             ``gs.shard_placement``: FSDP2 placements that keep block rows whole
:mod:`.hessian`               ``gs.curvature``'s Hessian-vector products on the rank's shards
:mod:`.fsdp2`                 the FSDP2 boundary: every read of torch's private FSDP internals
============================  ===================================================================

The package speaks to the rest of geosharp through public members only (``docs/extending.md``,
"Sharded models"): of a :class:`~geosharp.estimators.perturbation.Perturbation`, ``reduce`` and
``draws`` (constructor arguments), ``rest_index``, ``layout``, ``assembly``, ``straight_rest``,
``applied``, ``assembled_into``; of a geometry, ``normal_draws``, ``tangent_from_normals``,
``draws_over_point``, ``row_endpoint`` and, where that holds, ``order2_factors``,
``order2_adjoint``, ``point_rows``, ``head_slices`` and ``read_point_from``; of a symmetry
block, ``shard_layout``, ``index_fields`` and ``batch_key``.
"""

from geosharp.estimators.sharded.check import check_unsharded, is_sharded

__all__ = ["check_unsharded", "is_sharded"]
