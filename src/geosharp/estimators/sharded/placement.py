"""Where FSDP2 shards a model's parameters so that no symmetry block's row is split (SPEC §10.3).

:func:`shard_placement` is the ``shard_placement_fn`` of ``fully_shard`` that
:mod:`~geosharp.estimators.sharded.space` needs: every rank holds whole rows of every head
(``geosharp.shard_placement``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from geosharp.symmetry import ParameterSpace, find_symmetries

__all__ = ["shard_placement"]


def shard_placement(
    model: nn.Module, key_bias: str = "quotient", world: int | None = None
) -> Callable[[Any], Any]:
    """A ``shard_placement_fn`` for FSDP2 that keeps every row of every symmetry block whole.

    ``fully_shard`` splits a parameter along dimension 0 by default. A projection whose block
    rows run along dimension 1 (``W_q``, ``W_k``, ``W_v``: a row of ``G_QK`` is an input
    feature, SPEC §10.3; LoRA's ``A``) is split along dimension 1 instead, so that each rank
    holds whole rows of every head (an even share of each: no padding). Every other
    parameter keeps FSDP's default. Build it on the model before sharding it::

        place = geosharp.shard_placement(model)
        for layer in model.layers:
            fully_shard(layer, shard_placement_fn=place)
        fully_shard(model, shard_placement_fn=place)

    A bias row (``b_q`` of ``G_QK``, one row of ``h`` numbers per head) lies whole on a rank
    when the world size divides the number of heads. FSDP2 splits a dimension other than 0
    only evenly: given ``world``, a parameter whose dimension 1 the world size does not divide
    keeps FSDP's default (its rows are then whole on a rank only if the world size divides the
    number of heads).

    Args:
        model: The model, before (or after) ``fully_shard``.
        key_bias: As :func:`~geosharp.symmetry.find_symmetries`.
        world: The number of ranks (``None``: every such parameter along dimension 1).

    Returns:
        ``fn(parameter) -> Shard(1) | None``, for ``fully_shard(shard_placement_fn=fn)``; its
        ``parameters`` are the names placed along dimension 1, its ``kept`` those left on
        dimension 0 because ``world`` does not divide their dimension 1.
    """
    from torch.distributed.tensor import Shard

    space = find_symmetries(model, key_bias=key_bias)
    named = dict(model.named_parameters())
    along_1 = {n for n in _rows_along_dim_1(space) if n in named}
    kept = {n for n in along_1 if world and named[n].shape[1] % world}
    ids = {id(named[n]) for n in along_1 - kept}

    def placement(param: Any) -> Any:
        return Shard(1) if id(param) in ids else None

    placement.parameters = tuple(sorted(along_1 - kept))  # type: ignore[attr-defined]
    placement.kept = tuple(sorted(kept))  # type: ignore[attr-defined]
    return placement


def _rows_along_dim_1(space: ParameterSpace) -> set[str]:
    """2-D parameters whose block rows a split along dimension 0 cuts and one along 1 does not."""
    out: set[str] = set()
    for b in space.blocks:
        if b.shard_layout != "rows":
            continue
        for pos in b.indices:
            pos = pos.reshape(-1, pos.shape[-1]).cpu()  # one row per line
            owner = space.owners(pos[:, 0].contiguous())
            for j in torch.unique(owner).tolist():
                shape = tuple(space.shapes[j])
                if len(shape) != 2:
                    continue
                q = pos[owner == j] - space.offsets[j]
                r, c = q // shape[1], q % shape[1]
                cut_by_0 = bool((r.amax(-1) != r.amin(-1)).any())
                cut_by_1 = bool((c.amax(-1) != c.amin(-1)).any())
                if cut_by_0 and not cut_by_1:
                    out.add(space.param_names[j])
    return out
