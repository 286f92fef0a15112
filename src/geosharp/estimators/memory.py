"""What a perturbation holds beside its iterates: the bytes an ascent's memory budget counts.

The sizes :func:`geosharp.estimators.apgd.best_direction_rule` weighs against its budget of
parameter-sized buffers (``benchmarks/PROTOCOL.md`` lists every buffer of an ascent), as
functions of what a :class:`~geosharp.estimators.perturbation.Perturbation` is made of (its
:meth:`~geosharp.estimators.perturbation.Perturbation.buffer_bytes` calls them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geosharp.estimators.assembly import _Assembly
    from geosharp.estimators.pieces import Piece

__all__ = ["held_bytes", "param_bytes", "tangent_bytes"]


def tangent_bytes(pieces: Sequence[Piece]) -> int:
    """The bytes of one perturbation ``ξ`` of these pieces (in their tangent dtypes)."""
    return sum(
        t.numel() * p.geometry.tangent_dtype.itemsize for p in pieces for t in p.geometry.point
    )


def held_bytes(
    pieces: Sequence[Piece], assembly: _Assembly, own: set[int], itemsize: Sequence[int]
) -> int:
    """The bytes a perturbation holds whatever its iterates.

    The symmetry pieces' copies of their base point and their factorizations (every storage a
    geometry holds, :meth:`~geosharp.geometry.Geometry.held_tensors`, once; not those in
    ``own``, the model's), the rows kept by a row cut, and the perturbed parameters made for
    each forward and kept by the backward (those with block coordinates, gathered, and the
    rows of the tables cut to rows that a forward overwrites). ``itemsize`` is the bytes per
    element of every parameter.
    """
    seen = set(own)
    held = 0
    for p in pieces:
        for geometry in (p.geometry, p.norm_geometry):
            for t in geometry.held_tensors():
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    held += st.nbytes()
    sizes = zip(assembly.gathered, assembly.gathered_sizes, strict=True)
    held += sum(n * itemsize[j] for j, n in sizes)
    # a table cut to rows is perturbed in place for each forward, its rows kept to be put back
    # (estimators/table_rows.py): rows × width, not a copy of the table
    held += sum(
        r.numel() * (full.numel() // max(full.shape[0], 1)) * full.element_size()
        for r, full in assembly.rows.values()
    )
    return held


def param_bytes(shapes: Sequence[Sequence[int]], itemsize: Sequence[int]) -> int:
    """The bytes of parameters of these shapes and element sizes (one parameter-sized buffer)."""
    return sum(math.prod(s) * size for s, size in zip(shapes, itemsize, strict=True))
