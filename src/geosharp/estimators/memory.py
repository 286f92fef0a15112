"""What a perturbation holds beside its iterates: the bytes an ascent's memory budget counts.

:class:`BufferAccounting` gives a :class:`~geosharp.estimators.perturbation.Perturbation` the
sizes that :func:`geosharp.estimators.apgd.best_direction_rule` weighs against its budget of
parameter-sized buffers (``benchmarks/PROTOCOL.md`` lists every buffer of an ascent).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geosharp.estimators.assembly import _Assembly
    from geosharp.estimators.pieces import Piece
    from geosharp.symmetry import ParameterSpace

__all__ = ["BufferAccounting"]


class BufferAccounting:
    """Buffer sizes of a perturbation (a mixin: it reads the pieces, the assembly, the space)."""

    pieces: list[Piece]
    space: ParameterSpace
    _assembly: _Assembly
    #: Storages of the base point's own tensors (the model's: not held by the pieces).
    _own: set[int]
    #: Bytes per element of every parameter of the space.
    _itemsize: list[int]

    def buffer_bytes(self) -> tuple[int, int]:
        """The bytes of one perturbation ``ξ``, and those this perturbation holds beside it.

        The second figure is what an ascent holds whatever its iterates: the symmetry pieces'
        copies of their base point and their factorizations, the rows kept by
        :meth:`on_rows`, and the perturbed parameters made for each forward and kept by the
        backward (those with block coordinates, gathered, and the tables cut to rows, whole).
        The model's own tensors are not counted (a plain forward and backward holds them too).
        """
        xi = sum(
            t.numel() * p.geometry.tangent_dtype.itemsize
            for p in self.pieces
            for t in p.geometry.point
        )
        seen = set(self._own)
        held = 0
        for p in self.pieces:
            for geometry in (p.geometry, p.norm_geometry):
                for t in geometry.held_tensors():
                    st = t.untyped_storage()
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        held += st.nbytes()
        a = self._assembly
        sizes = zip(a.gathered, a.gathered_sizes, strict=True)
        held += sum(n * self._itemsize[j] for j, n in sizes)
        # a table cut to rows is perturbed as a whole copy for each forward (w, rows replaced)
        held += sum(full.numel() * full.element_size() for _, full in a.rows.values())
        return xi, held

    @property
    def param_bytes(self) -> int:
        """The bytes of the parameters the perturbation covers (one parameter-sized buffer)."""
        shapes = self.space.shapes
        return sum(math.prod(s) * size for s, size in zip(shapes, self._itemsize, strict=True))
