"""A table cut to the rows a batch reaches, perturbed in place: no copy of the table (issue 43).

An ascent restricted to the embedding rows a batch reaches (:mod:`geosharp.estimators.rows`)
perturbs a table ``w`` as ``w`` with those rows replaced by ``θ′[rows]``. Made out of place
(``w.index_put``), that is one copy of the whole table per forward, kept by the backward: on
MiniLM-L6 11.7 M of its 22.7 M weights, written at every step. Here the rows are written into
``w`` itself for one loss and its gradient, and put back afterwards:

- :class:`RowsWritten` records what was overwritten (the rows of ``w`` before, ``rows ×
  width``), and :meth:`RowsWritten.restore` writes them back, bit for bit;
- :func:`rows_into` is the differentiable write: its output is ``w`` (an alias), its adjoint
  the gradient's rows ``g[rows]``, as ``index_put``'s.

Only :meth:`Perturbation.applied <geosharp.estimators.perturbation.Perturbation.applied>` opens
such a record, around one forward and its backward, and restores it on the way out (an error or
an interrupt included); everywhere else the table is copied as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RowsWritten", "rows_into"]


class RowsWritten:
    """The rows of tables overwritten in place, to be put back (:meth:`restore`)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Tensor, Tensor, Tensor]] = []

    def write(self, table: Tensor, rows: Tensor, value: Tensor) -> None:
        """``table[rows] = value`` in place, the rows' earlier values kept."""
        with torch.no_grad():
            self._saved.append((table, rows, table.index_select(0, rows)))
            table.index_copy_(0, rows, value.to(table.dtype))

    def restore(self) -> None:
        """Every table as it was before the writes (the last write undone first)."""
        with torch.no_grad():
            while self._saved:
                table, rows, before = self._saved.pop()
                table.index_copy_(0, rows, before)


class _RowsInto(torch.autograd.Function):
    """``table`` with ``table[rows] = value`` written in place; the adjoint is ``g[rows]``."""

    @staticmethod
    def forward(ctx, value, rows, where):
        table, log = where
        log.write(table, rows, value)
        ctx.save_for_backward(rows)
        return table.detach()  # an alias: the table itself, carrying this node's graph

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None


def rows_into(table: Tensor, rows: Tensor, value: Tensor, log: RowsWritten) -> Tensor:
    """``table`` with its ``rows`` replaced by ``value``, written into ``table`` itself.

    The values of ``table.index_put((rows,), value)`` and its gradient in ``value`` (reverse
    mode), with no copy of the table; ``log`` puts the rows back (:meth:`RowsWritten.restore`)
    once the loss and its backward are done. ``rows`` must not repeat.
    """
    return _RowsInto.apply(value, rows, (table, log))
