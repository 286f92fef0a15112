r"""Contractions over the rows of a GL(h) block's factors, summed over the ranks that hold them.

Every formula of a GL(h) block (SPEC §4) is a row-wise product of ``G``, ``H`` or a tangent
with an ``h × h`` matrix, or an ``h × h`` contraction over rows such as ``Gᵀ ξ_G``. When the
rows are split over ranks (a model sharded by FSDP2, SPEC §10), a row-wise product stays local
and a contraction is the sum over ranks of the local ones. :func:`contract` is the one place
that forms contractions: it computes those of one formula together and, given a ``row_sum``
(the geometry's :attr:`~geosharp.geometry.gl_execution.GLExecution.row_sum`), sums them over
the ranks in one collective. With ``row_sum=None`` (one process holds every row) it is the
plain products.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["RowSum", "contract", "sum_chunks"]

#: Sums a stack of ``h × h`` contractions (any leading dimensions) over the ranks holding the
#: other rows, differentiably (the adjoint of a sum over ranks is a sum over ranks).
RowSum = Callable[[Tensor], Tensor]


def contract(*pairs: tuple[Tensor, Tensor], row_sum: RowSum | None = None) -> list[Tensor]:
    """``[Aᵀ B for (A, B) in pairs]``, summed over the ranks in one ``row_sum`` if given.

    The products of one call have one shape (``(..., h, h)``); with ``row_sum`` they travel as
    one stacked tensor, so one formula costs one collective.
    """
    out = [a.mT @ b for a, b in pairs]
    if row_sum is None:
        return out
    return list(row_sum(torch.stack(out)).unbind(0))


def sum_chunks(parts: list[Tensor], row_sum: RowSum | None) -> list[Tensor]:
    """Chunks of heads' stacked contractions ``(k, heads, h, h)``, joined and summed over ranks.

    The chunks are the rank's own (its rows decide them), so a collective per chunk would not
    pair up across ranks: they are joined along the heads first, and every rank makes one
    collective of the same shape. ``parts`` (the caller's list) is emptied, letting its chunks
    go; the result is the ``k`` contractions over every head.
    """
    out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    parts.clear()
    return list((out if row_sum is None else row_sum(out)).unbind(0))
