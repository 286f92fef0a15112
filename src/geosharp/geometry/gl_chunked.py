r"""The per-step products of a GL(h) geometry, run a chunk of heads at a time.

A :class:`~geosharp.geometry.gl.GLGeometry` evaluates the formulas of
:mod:`~geosharp.geometry.gl_math` over the chunks of its flattened heads that its
:class:`~geosharp.geometry.gl_execution.GLExecution` decides (all heads in one by default): each
chunk's rows are read (:meth:`~geosharp.geometry.gl.GLGeometry.point_rows`), its tangent widened
once to the work dtype, its products formed and the result written back in the tangent's dtype,
the same products as one pass, head by head. :class:`GLChunkedProducts` holds those loops: the
horizontal projection and the horizontal gradient (with the ascent's pairing ``e·d``), the
metric's pair form behind ``inner`` and ``norm_sq``, and the Gram matrices read a chunk at a time.
When the rows are split over ranks, the contractions of every chunk are summed in one
``row_sum`` (:func:`~geosharp.geometry.gl_rows.sum_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from geosharp.geometry import gl_math
from geosharp.geometry.base import Tangent
from geosharp.geometry.flat import flat_of, pair_buffer, untracked, widen_pair
from geosharp.geometry.gl_rows import contract, sum_chunks

__all__ = ["GLChunkedProducts"]


def _store(oG: Tensor, oH: Tensor, heads: slice, pG: Tensor, pH: Tensor) -> None:
    """``oG[heads], oH[heads] = pG, pH``: one copy where both pairs are one buffer each."""
    if heads == slice(None):
        fo, fp = flat_of((oG, oH)), flat_of((pG, pH))
        if fo is not None and fp is not None and untracked((pG, pH)):
            fo.copy_(fp)
            return
    oG[heads], oH[heads] = pG, pH


class GLChunkedProducts:
    """The chunked per-step products of :class:`~geosharp.geometry.gl.GLGeometry` (a mixin of it).

    Reads the geometry's ``G``, ``metric``, ``execution``, its chunks of heads (``_slices``,
    ``_chunk_factors``, ``_flat``, ``point_rows``) and its vertical-space solve (``_lam``,
    ``_lam_from``).
    """

    def _read_grams(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(GᵀG, HᵀH)`` in ``dtype``, read a chunk of heads at a time, summed over the ranks."""
        parts = [
            torch.stack(contract(*((X, X) for X in self.point_rows(sl, dtype))))
            for sl in self._slices
        ]
        lead = self.G.shape[:-2]
        MG, MH = sum_chunks(parts, self.execution.row_sum)
        return MG.reshape(*lead, *MG.shape[-2:]), MH.reshape(*lead, *MH.shape[-2:])

    def _pair_form(self, a: Tangent, b: Tangent | None) -> Tensor:
        """``⟨a, b⟩`` (``b = None``: ``⟨a, a⟩``) per head, widened chunk by chunk of heads."""
        ex = self.execution
        rows = [self._flat(t) for t in (*a, *(a if b is None else b))]
        out = torch.empty(rows[0].shape[0], dtype=ex.work_dtype, device=rows[0].device)
        for sl, F in zip(self._slices, self._chunk_factors, strict=True):
            aG, aH = widen_pair(rows[0][sl], rows[1][sl], ex.work_dtype)
            bG, bH = (aG, aH) if b is None else widen_pair(rows[2][sl], rows[3][sl], ex.work_dtype)
            out[sl] = gl_math.inner(aG, aH, bG, bH, F, self.metric)
        return out.reshape(self.G.shape[:-2]).to(a[0].dtype)

    def _project_chunks(
        self, xi: Tangent, grad: bool, pairing: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`project` (or, with ``grad``, :meth:`horizontal_grad`) chunk by chunk of heads.

        Each chunk (all heads in one, per :attr:`execution`) is widened, projected in the work
        dtype and written into the result in the tangent's dtype: the same products as one
        pass, head by head. The result's two components are consecutive slices of one buffer
        (:func:`~geosharp.geometry.flat.pair_buffer`), so the ascent's pairings and combinations
        of it are one op each. ``pairing`` (a 0-dim tensor) accumulates ``xi·result`` of the
        unrounded chunks.
        """
        ex = self.execution
        xG, xH = self._flat(xi[0]), self._flat(xi[1])
        outG, outH = pair_buffer(xi[0], xi[1])
        oG, oH = self._flat(outG), self._flat(outH)
        split = ex.row_sum is not None and len(self._slices) > 1
        lams = self._split_lams(xG, xH, grad) if split else None
        for c, (sl, F, eG, eH, g, h, G, H) in enumerate(self._chunks(xG, xH, grad)):
            L = self._lam(F, G, H, g, h) if lams is None else lams[c]
            # the Riemannian gradient is a fresh temporary: P may accumulate into it
            pG, pH = gl_math.horizontal_projection(G, H, g, h, L, inplace=grad and ex.inplace)
            if pairing is not None:
                fe, fp = flat_of((eG, eH)), flat_of((pG, pH))
                if fe is not None and fp is not None:  # the pairs in one buffer each: one dot
                    pairing += torch.dot(fe, fp)
                else:
                    pairing += torch.dot(eG.reshape(-1), pG.reshape(-1))
                    pairing += torch.dot(eH.reshape(-1), pH.reshape(-1))
            _store(oG, oH, sl, pG, pH)
        return outG, outH

    def _chunks(self, xG: Tensor, xH: Tensor, grad: bool) -> Iterator[tuple]:
        """The chunks of heads, each widened once: ``(slice, factors, e_G, e_H, g, h, G, H)``.

        ``(g, h)`` is ``e`` itself, or with ``grad`` its Riemannian gradient.
        """
        wd = self.execution.work_dtype
        for sl, F in zip(self._slices, self._chunk_factors, strict=True):
            eG, eH = widen_pair(xG[sl], xH[sl], wd)  # one buffer: one dot, one copy after
            if not grad:
                g, h = eG, eH
            elif untracked((eG, eH)):  # into one buffer too: the projection accumulates in it
                g, h = gl_math.riemannian_grad(eG, eH, F, self.metric, out=pair_buffer(eG, eH))
            else:
                g, h = gl_math.riemannian_grad(eG, eH, F, self.metric)
            yield (sl, F, eG, eH, g, h, *self.point_rows(sl))

    def _split_lams(self, xG: Tensor, xH: Tensor, grad: bool) -> list[Tensor]:
        """Every chunk's ``Λ`` when the rows are split over ranks, with one collective.

        The chunks of heads are this rank's (its rows decide them), so a collective per chunk
        would not pair up across ranks: the contractions of every chunk are formed first, summed
        over the ranks in one ``row_sum``, and each chunk's ``Λ`` solved from them; the caller
        then widens each chunk again for its row-wise products.
        """
        parts = [
            torch.stack(contract((h, H), (G, g))) for *_, g, h, G, H in self._chunks(xG, xH, grad)
        ]
        XH, GX = sum_chunks(parts, self.execution.row_sum)  # one sum
        return [
            self._lam_from(F, XH[sl], GX[sl])
            for sl, F in zip(self._slices, self._chunk_factors, strict=True)
        ]
