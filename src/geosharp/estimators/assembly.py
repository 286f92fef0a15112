"""How the perturbed parameters are built from the moved pieces, and its adjoint at ξ = 0.

:class:`_Assembly` is the map from the pieces of a
:class:`~geosharp.estimators.perturbation.Perturbation` (one tuple of components per piece) to
the perturbed parameters by name, ready for :func:`torch.func.functional_call`; its
:meth:`~_Assembly.pull_back` lays a parameter gradient out as the pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.symmetry import ParameterSpace

__all__: list[str] = []


class _Assembly:
    """Builds the perturbed parameters by name from the moved pieces.

    A parameter with no coordinate in a symmetry block is one component of the rest piece, in
    its own shape: its moved value *is* the perturbed parameter (no copy; its gradient flows
    back unchanged). The parameters with block coordinates (the Q, K, V, O projections) are
    gathered by one index from a *source* vector: the symmetry pieces' values followed by the
    rest coordinates of such parameters. Nothing here is parameter-sized but that index, over
    the gathered parameters only (on MiniLM-L6 3.5 M of 22.7 M coordinates).
    """

    def __init__(
        self,
        space: ParameterSpace,
        pieces: Sequence,  # of Piece
        rest_piece: int | None,
        layout: Sequence[tuple[int, Tensor | None]],
        device: torch.device,
    ) -> None:
        self.names, self.shapes = list(space.param_names), list(space.shapes)
        sizes = [math.prod(s) for s in self.shapes]
        self.rest_piece = rest_piece
        #: rest component → (rows kept, the whole table at the base point): see on_rows
        self.rows: dict[int, tuple[Tensor, Tensor]] = {}
        self.sym_pieces = [i for i in range(len(pieces)) if i != rest_piece]
        #: rest component k → (parameter j, whole?) ; whole parameters are used as they are
        self.layout = [(j, local is None) for j, local in layout]
        whole = {j for j, w in self.layout if w}
        #: Parameters with symmetry coordinates, gathered from the source.
        self.gathered = [j for j in range(len(sizes)) if j not in whole and sizes[j]]
        #: Rest components (positions in the rest piece) appended to the source.
        self.mixed = [k for k, (j, w) in enumerate(self.layout) if not w]
        self.gathered_sizes = [sizes[j] for j in self.gathered]
        n_gathered = sum(self.gathered_sizes)
        self.index = torch.full((n_gathered,), -1, dtype=torch.long, device=device)
        if not self.gathered:
            return
        # global position → position in the concatenated gathered parameters
        shift = torch.zeros(len(sizes), dtype=torch.long, device=device)
        start = 0
        for j in self.gathered:
            shift[j] = start - space.offsets[j]
            start += sizes[j]
        starts = torch.tensor(space.offsets, dtype=torch.long, device=device)
        n_src = 0
        for k in self.sym_pieces:
            for comp in pieces[k].index:
                glob = comp.reshape(-1).to(device)
                owner = torch.searchsorted(starts, glob, right=True) - 1
                self.index[glob + shift[owner]] = torch.arange(
                    n_src, n_src + glob.numel(), device=device
                )
                n_src += glob.numel()
                del glob, owner
        for j, local in layout:
            if local is None:
                continue
            pos = local.to(device) + (shift[j] + space.offsets[j])
            self.index[pos] = torch.arange(n_src, n_src + pos.numel(), device=device)
            n_src += pos.numel()
        if n_gathered and int(self.index.min()) < 0:
            raise ValueError("the symmetry blocks and the rest do not cover every parameter")
        if n_src < 2**31:  # int32 positions: half the memory of the one index kept per call
            self.index = self.index.to(torch.int32)

    def __call__(self, moved: Sequence[tuple[Tensor, ...]]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        rest = moved[self.rest_piece] if self.rest_piece is not None else ()
        for c, ((j, whole), value) in enumerate(zip(self.layout, rest, strict=True)):
            if whole:
                if c in self.rows:  # a table cut to the rows a batch reaches: w, those replaced
                    r, table = self.rows[c]
                    value = table.index_put((r,), value)
                out[self.names[j]] = value.view(self.shapes[j])
        if self.gathered:
            parts = [v.reshape(-1) for k in self.sym_pieces for v in moved[k]]
            parts += [rest[k].reshape(-1) for k in self.mixed]
            source = torch.cat(parts) if len(parts) > 1 else parts[0]
            for j, value in zip(
                self.gathered,
                torch.split(torch.index_select(source, 0, self.index), self.gathered_sizes),
                strict=True,
            ):
                out[self.names[j]] = value.view(self.shapes[j])
        return {name: out[name] for name in self.names}

    def pull_back(self, pieces: Sequence, grads: Sequence[Tensor]) -> list[list[Tensor]]:
        """The adjoint of :meth:`__call__` for moved pieces equal to their input (``ξ = 0``).

        Args:
            pieces: The pieces the assembly was built for.
            grads: ``∂L/∂θ′``, one tensor per parameter of the space.

        Returns:
            Per piece, per component, the gradient laid out as that component: a whole
            parameter of the rest piece gets its gradient itself (its reached rows, if cut);
            the parameters holding symmetry coordinates are concatenated and scattered back by
            the gather index (a bijection between them and the source vector), then split.
        """
        out: list[list] = [[None] * len(p.geometry.point) for p in pieces]
        if self.gathered:
            gathered = torch.cat([grads[j].reshape(-1) for j in self.gathered])
            source = torch.empty_like(gathered)
            source[self.index] = gathered
            del gathered
            slots = [(k, c) for k in self.sym_pieces for c in range(len(pieces[k].geometry.point))]
            slots += [(self.rest_piece, c) for c in self.mixed]
            sizes = [pieces[k].geometry.point[c].numel() for k, c in slots]
            for (k, c), part in zip(slots, torch.split(source, sizes), strict=True):
                out[k][c] = part.view(pieces[k].geometry.point[c].shape)
        if self.rest_piece is not None:
            for c, (j, whole) in enumerate(self.layout):
                if whole:
                    g = grads[j]
                    if c in self.rows:
                        g = g.index_select(0, self.rows[c][0])
                    out[self.rest_piece][c] = g
        return out
