"""The numbers of a perturbation summed over its pieces, only scalars brought together.

The pieces of a :class:`~geosharp.estimators.perturbation.Perturbation` of a model split across
devices (``device_map="auto"``) live on the devices of their parameters: each piece reduces its
own tensors where they are, and only the resulting scalars meet, on the first piece's device.
On one device every ``.to`` here is the tensor itself: the sums are those of ``sum()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from geosharp.estimators.pieces import Piece, Xi
from geosharp.geometry.base import euclidean_pairing
from geosharp.geometry.flat import flatten

__all__ = ["ascent_sums", "scalar_sum"]


def scalar_sum(values: Iterable[Tensor]) -> Tensor | int:
    """``sum(values)`` of per-piece scalars, each brought to the first one's device."""
    values = list(values)
    device = values[0].device if values else None
    return sum(v.to(device) for v in values)


def ascent_sums(
    pieces: Sequence[Piece], egrad: Xi, pairs: Sequence[Xi | None], inplace: bool
) -> tuple[Xi, list[Tensor | None]]:
    """The ascent direction ``d`` of every piece, with ``‖d‖²`` and every ``⟨ξ_j, d⟩``.

    See :meth:`~geosharp.estimators.perturbation.Perturbation.ascent_direction`.

    Returns:
        ``d`` and the float64 sums ``[‖d‖², ⟨ξ_0, d⟩, …]`` as scalars on the first piece's
        device (``None`` for a sum no piece added to).
    """
    out: Xi = []
    # the numbers stay tensors until every piece is done: one wait for the device, not one
    # per piece and number; summed at the end (_piece_sums)
    terms: list[list[Tensor]] = [[] for _ in range(1 + len(pairs))]  # ‖d‖², then ⟨ξ_j, d⟩

    def add(i: int, v: Tensor) -> None:
        terms[i].append(v.to(torch.float64))

    for k, (p, e) in enumerate(zip(pieces, egrad, strict=True)):
        g = p.norm_geometry
        exact = g.orthogonal_projection
        xs = [(j, x[k]) for j, x in enumerate(pairs) if x is not None]
        if inplace and p.geometry is g and g.orthogonal_projection:
            # one buffer (one copy of the gradient): every pass below, and the ascent's
            # combinations of d with the iterates made from it, are one launch each
            e = flatten(e)
        if exact:  # before an in-place direction overwrites e
            for j, x in xs:
                add(1 + j, euclidean_pairing(e, x))
        if inplace and p.geometry is g:
            d, n = g.ascent_direction_(tuple(e))
        else:
            d, n = g.ascent_direction(e)
        if not exact:
            for j, x in xs:
                add(1 + j, g.inner(x, d).sum())
        out.append(tuple(d))
        add(0, n)
    return out, _piece_sums(terms)


def _piece_sums(terms: list[list[Tensor]]) -> list[Tensor | None]:
    """Each list of float64 scalars summed in order (``None`` for an empty one).

    Where every list has the same number of scalars on one device, all of them in one stack and
    one sum (two launches, not one per term); else term by term, each brought to the first
    one's device (a model split across devices).
    """
    full = [v for vs in terms for v in vs]
    k = len(terms[0])
    if k > 1 and all(len(vs) == k for vs in terms) and len({v.device for v in full}) == 1:
        return list(torch.stack(full).view(len(terms), k).sum(1).unbind(0))
    sums: list[Tensor | None] = []
    for vs in terms:
        total = None
        for v in vs:
            total = v if total is None else total + v.to(total.device)
        sums.append(total)
    return sums
