"""The embedding rows a batch reaches: an ascent from ``ξ = 0`` moves no other row.

A row of an embedding table that no input of a batch looks up gets no gradient at any
perturbation. Auto-PGD from ``ξ = 0`` therefore keeps it at exactly zero through every step
(its direction, momentum and rescales are all zero there), and its part of every pass over
``ξ`` is work with a known result. On MiniLM-L6 with its embeddings perturbed, the word
embeddings are 11.7 M of 22.7 M coordinates and a batch of 32 sentences reaches a few
thousand of their 30 522 rows.

:class:`BatchRows` watches the clean forward of a batch: a forward pre-hook on every
:class:`torch.nn.Embedding` whose table is a whole component of the straight-line rest piece
records the indices it looks up. :meth:`BatchRows.restrict` then cuts those tables to the rows
reached (:meth:`~geosharp.estimators.perturbation.Perturbation.on_rows`), provided the clean
gradient of the table vanishes on every other row: a table used elsewhere as well (tied to an
output layer, as in most language-model heads) has gradients there and is left whole. Tables
of which most rows are reached are left whole too (the cut saves little there, and each
forward writes its rows into the table and puts them back:
:mod:`~geosharp.estimators.table_rows`).

The restricted ascent is the same ascent: its iterates equal the full ones on the rows kept and
are zero elsewhere, and only the order of the terms in the norms' sums changes (float
rounding). It applies to ascents that start at ``ξ = 0`` (the default first start); random
starts and the average case perturb every row and are not restricted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from geosharp.estimators.pieces import Piece, Xi, _row_positions

if TYPE_CHECKING:  # rows.py is imported by perturbation.py
    from geosharp.estimators.assembly import Assembly
    from geosharp.estimators.perturbation import Perturbation

__all__ = ["MAX_ROW_SHARE", "BatchRows", "cut_to_rows", "row_tables", "table_modules"]

#: A table is cut only if the batch reaches at most this share of its rows.
MAX_ROW_SHARE = 0.75


def row_tables(pieces: list[Piece], rest_piece: int | None, assembly: Assembly) -> dict[str, int]:
    """The parameters a perturbation can cut to rows: name → component of its rest piece.

    Whole 2-D (or higher) parameters of a straight-line rest piece (``rest_piece``, ``None``
    when there is none or it is not followed along straight lines), e.g. embedding tables, not
    already cut.
    """
    if rest_piece is None:
        return {}
    point = pieces[rest_piece].geometry.point
    return {
        assembly.names[j]: c
        for c, (j, whole) in enumerate(assembly.layout)
        if whole and point[c].dim() >= 2 and c not in assembly.rows
    }


def cut_to_rows(
    piece: Piece | None, tables: Mapping[str, int], rows: Mapping[str, Tensor]
) -> tuple[Piece, dict[int, tuple[Tensor, Tensor]]]:
    """The rest piece restricted to the rows a batch reaches, and the assembly's row entries.

    An embedding table's rows that no input of a batch looks up get no gradient at any
    perturbation, so an ascent that starts at ``ξ = 0`` never moves them: they stay exactly
    ``w``. The restricted piece holds, for each table, only the rows given (its component is
    ``w[rows]``); the perturbed table is ``w`` with those rows replaced (the entries
    ``component → (rows, w)`` tell the assembly so). Its norms equal the full ones wherever
    the other rows of ``ξ`` are zero.

    Args:
        piece: The straight-line rest piece (``None`` if there is none: every name fails).
        tables: :func:`row_tables` of the perturbation.
        rows: Parameter name (one of ``tables``) → the rows kept (indices along dimension 0).

    Raises:
        ValueError: If a name is not one of ``tables``.
    """
    for name in rows:
        if name not in tables:
            raise ValueError(
                f"{name!r} is not a whole table of the straight-line rest piece; "
                f"the tables are {sorted(tables)}"
            )
    assert piece is not None  # tables come from a rest piece
    cut: dict[int, Tensor] = {}
    for name, r in rows.items():
        c = tables[name]
        cut[c] = r.to(device=piece.geometry.point[c].device, dtype=torch.long)
    full = piece.geometry.point
    new_g = piece.geometry.with_rows(cut)
    new = Piece(piece.name, _row_positions(piece, cut, full), new_g, new_g, piece.order)
    return new, {c: (r, full[c]) for c, r in cut.items()}


def table_modules(model: nn.Module, pert: Perturbation) -> dict[str, nn.Embedding]:
    """The embedding modules whose table ``pert`` can cut: parameter name → module.

    A module qualifies if its weight is a whole component of the straight-line rest piece
    (:meth:`~geosharp.estimators.perturbation.Perturbation.row_tables`), the weight is
    registered once in the model (not shared with another module), and the lookup neither
    renormalizes rows (``max_norm``) nor makes sparse gradients.
    """
    tables = pert.row_tables()
    if not tables:
        return {}
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    out: dict[str, nn.Embedding] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Embedding):
            continue
        name = f"{prefix}.weight" if prefix else "weight"
        if (
            name in tables
            and owners[id(module.weight)] == 1
            and module.max_norm is None
            and not module.sparse
        ):
            out[name] = module
    return out


class BatchRows:
    """Records the rows of the embedding tables that a forward looks up (a context manager).

    Args:
        model: The model.
        pert: The perturbation of the call.
        enabled: ``False`` records nothing (``restrict`` then returns its input).
    """

    def __init__(self, model: nn.Module, pert: Perturbation, enabled: bool = True) -> None:
        self.pert = pert
        self.modules = table_modules(model, pert) if enabled else {}
        self._seen: dict[str, list[Tensor]] = {name: [] for name in self.modules}
        self._unknown: set[str] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> BatchRows:
        for name, module in self.modules.items():
            self._handles.append(
                module.register_forward_pre_hook(self._recorder(name), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _recorder(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            ids = args[0] if args else kwargs.get("input")
            if isinstance(ids, Tensor) and not ids.is_floating_point():
                self._seen[name].append(torch.unique(ids.detach()))
            else:  # looked up in a way not followed here: the table stays whole
                self._unknown.add(name)

        return hook

    def rows(self) -> dict[str, Tensor]:
        """Table name → the sorted rows looked up (tables looked up at least once)."""
        out = {}
        for name, parts in self._seen.items():
            if parts and name not in self._unknown:
                out[name] = torch.unique(torch.cat(parts)).to(torch.long)
        return out

    def restrict(self, egrad: Xi) -> tuple[Perturbation, Xi]:
        """The perturbation cut to the rows reached, and the clean gradient cut alike.

        Args:
            egrad: The Euclidean gradient at ``ξ = 0`` of the recorded forward (one tuple per
                piece of :attr:`pert`).

        Returns:
            ``(perturbation, gradient)``: the restricted pair, or ``(pert, egrad)`` when no
            table is cut.
        """
        tables = self.pert.row_tables()
        k = self.pert.rest_index
        keep: dict[str, Tensor] = {}
        for name, r in self.rows().items():
            g = egrad[k][tables[name]]
            if r.numel() > MAX_ROW_SHARE * g.shape[0]:
                continue
            r = r.to(g.device)
            # every nonzero of the clean gradient must lie in the rows reached
            if int(torch.count_nonzero(g)) != int(torch.count_nonzero(g.index_select(0, r))):
                continue
            keep[name] = r
        if not keep:
            return self.pert, egrad
        cut = self.pert.on_rows(keep)
        comps = list(egrad[k])
        for name, r in keep.items():
            c = tables[name]
            comps[c] = comps[c].index_select(0, r)
        grad = list(egrad)
        grad[k] = tuple(comps)
        return cut, grad
