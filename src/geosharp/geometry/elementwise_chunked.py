r"""The metric products of an element-wise geometry, run a chunk of components at a time.

:meth:`~geosharp.geometry.elementwise.ElementwiseGeometry.inner` and
:meth:`~geosharp.geometry.elementwise.ElementwiseGeometry.norm_sq` are the sum over the point's
components of ``(a_k / |w_k|)·(b_k / |w_k|)``. :class:`ElementwiseChunkedProducts` groups
consecutive components of one dtype and device into chunks of at most :data:`_CHUNK`
coordinates, writes each chunk's ``a / w`` (frozen coordinates zeroed) into one flat temporary
by multi-tensor ops and takes one dot product per chunk: a few launches per chunk, not per
component. With autograd on, one component at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.geometry.flat import FLAT_DTYPES, views

__all__ = ["ElementwiseChunkedProducts"]


#: Coordinates of the components whose metric products
#: :meth:`~geosharp.geometry.elementwise.ElementwiseGeometry.inner` and
#: :meth:`~geosharp.geometry.elementwise.ElementwiseGeometry.norm_sq` write at once (two flat
#: temporaries of at most this many, or of one larger component): a few launches per chunk, not
#: per component (issue 43).
_CHUNK = 1 << 22


class ElementwiseChunkedProducts:
    """The chunked metric products of :class:`~geosharp.geometry.elementwise.ElementwiseGeometry`.

    A mixin of it: reads the geometry's ``point``, its frozen coordinates (``_frozen``) and
    :class:`~geosharp.geometry.elementwise_frozen.ElementwiseFrozen`'s ``_scaled``,
    ``_zero_frozen_`` and ``_whole_frozen``.
    """

    def _scaled_dot(self, a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
        """``Σ_k (a_k / |w_k|)·(b_k / |w_k|)``, a chunk of components at a time.

        Each chunk (consecutive components of one dtype and device, :meth:`_chunks`) has its
        ``a / w`` and ``b / w`` written into one flat temporary each (the values of
        :meth:`_scaled`) by multi-tensor ops, then one dot product: a few launches per chunk,
        not per component. ``b is a``: one temporary. Differentiated (grad mode, an input
        requiring grad: a metric lowered by autograd), one component at a time.
        """
        total = None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*a, *b)):
            for k, (x, y) in enumerate(zip(a, b, strict=True)):
                v = torch.dot(self._scaled(x, k).reshape(-1), self._scaled(y, k).reshape(-1))
                total = v if total is None else total + v.to(total.device)  # scalars meet
            return total
        for ks in self._chunks(a, b):
            ra = self._scaled_flat(a, ks)
            rb = ra if b is a else self._scaled_flat(b, ks)
            v = torch.dot(ra, rb)
            total = v if total is None else total + v.to(total.device)  # scalars meet
            del ra, rb
        return total

    def _chunks(self, a: Sequence[Tensor], b: Sequence[Tensor]) -> list[list[int]]:
        """Consecutive components of one dtype and device (those of ``a``, ``b`` and ``w``).

        Each chunk holds at most :data:`_CHUNK` coordinates, or one component that holds more.
        """
        out: list[list[int]] = []
        n, key = 0, None
        for k, (x, y, w) in enumerate(zip(a, b, self.point, strict=True)):
            same = x.dtype == y.dtype == w.dtype and x.dtype in FLAT_DTYPES
            kk = (x.dtype, x.device) if same else (k,)  # else alone: one dot per component
            m = x.numel()
            if out and kk == key and n + m <= _CHUNK:
                out[-1].append(k)
                n += m
            else:
                out.append([k])
                n, key = m, kk
        return out

    def _scaled_flat(self, x: Sequence[Tensor], ks: list[int]) -> Tensor:
        """``x_k / |w_k|`` (:meth:`_scaled`) of the components ``ks``, in one flat tensor."""
        if len(ks) == 1:
            return self._scaled(x[ks[0]], ks[0]).reshape(-1)
        first = x[ks[0]]
        flat = torch.empty(sum(x[k].numel() for k in ks), dtype=first.dtype, device=first.device)
        dest = views(flat, [x[k] for k in ks])
        plain = [i for i, k in enumerate(ks) if self._frozen[k] is None]
        if plain:  # x / w as a copy of x divided in place: the same values
            torch._foreach_copy_([dest[i] for i in plain], [x[ks[i]] for i in plain])
            torch._foreach_div_([dest[i] for i in plain], [self.point[ks[i]] for i in plain])
        whole = self._whole_frozen()
        zeros = [dest[i] for i, k in enumerate(ks) if whole[k]]
        if zeros:  # x · 0 on a component frozen throughout: zeros, one op for them all
            torch._foreach_zero_(zeros)
        for i, k in enumerate(ks):
            if self._frozen[k] is not None and not whole[k]:
                torch.mul(x[k], self._zero_frozen_(self.point[k].reciprocal(), k), out=dest[i])
        return flat
