r"""The frozen coordinates of an element-wise geometry, and its weights with them zeroed.

A coordinate of :class:`~geosharp.geometry.elementwise.ElementwiseGeometry`'s point is frozen
where ``w = 0`` or ``1/w²`` is not finite: its adaptive ball has radius 0, and every tangent,
gradient and sample is zero there. :func:`_frozen_of` finds them a chunk of coordinates at a
time, kept per component as flat positions when few or as a boolean mask, ``None`` where there
are none. :class:`ElementwiseFrozen` sets them to zero in a component's tensors (one multi-tensor
op for the components frozen throughout) and makes the per-component temporaries ``w²``,
``|w|`` and ``x / |w|`` with them zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ElementwiseFrozen"]


#: Coordinates examined at once by :func:`_frozen_of` (its temporaries: a few MB, not the tensor's
#: size).
_FROZEN_CHUNK = 1 << 20


def _frozen_of(t: Tensor, scratch: dict | None = None) -> Tensor | None:
    """Where ``t`` is frozen (``w = 0`` or ``1/w²`` not finite).

    ``None`` if nowhere; else the flat positions when at most one coordinate in 16 is frozen
    (an embedding's padding row), or a boolean mask. Read in chunks of :data:`_FROZEN_CHUNK`
    coordinates: no temporary the size of ``t`` (a word-embedding table's ``1/w²`` was half of
    a MiniLM's parameters). Each chunk's ``|w|`` is written in one buffer per dtype and device,
    kept in ``scratch`` for the next tensor (a fresh one per chunk could be fresh pages each time);
    the chunks' smallest ``|w|`` are read back at once.
    """
    flat = t.detach().reshape(-1)  # read only (an ``out=`` takes no tensor that needs grad)
    numel = flat.numel()
    found: list[Tensor] = []
    n = 0
    mask: Tensor | None = None
    # a chunk whose smallest |w| is twice the smallest with a finite 1/w² has nothing frozen
    # (NaN compares false): two passes over it instead of six
    clear = 2.0 * torch.finfo(t.dtype).max ** -0.5 if t.is_floating_point() else None
    scratch = {} if scratch is None else scratch
    key = (t.dtype, t.device)
    if clear is not None and min(numel, _FROZEN_CHUNK) > scratch.get(key, flat[:0]).numel():
        scratch[key] = torch.empty(min(numel, _FROZEN_CHUNK), dtype=t.dtype, device=t.device)
    starts: Sequence[int] = range(0, numel, _FROZEN_CHUNK)
    if clear is not None and numel:
        # every chunk's smallest |w|, read back once (not a device sync per chunk)
        least = torch.empty(len(starts), dtype=t.dtype, device=t.device)
        for i, start in enumerate(starts):
            c = flat[start : start + _FROZEN_CHUNK]
            least[i] = torch.abs(c, out=scratch[key][: c.numel()]).amin()
        starts = [starts[i] for i in torch.nonzero(~(least > clear)).reshape(-1).tolist()]
    for start in starts:
        c = flat[start : start + _FROZEN_CHUNK]
        if clear is None:
            frozen = (c == 0) | ~torch.isfinite(c.reciprocal().square_())
            idx = frozen.nonzero().reshape(-1)
        else:  # the exact test on the coordinates not clear of the threshold (NaN too) only
            near = (torch.abs(c, out=scratch[key][: c.numel()]) > clear).logical_not_()
            idx = near.nonzero().reshape(-1)
            v = c[idx]
            idx = idx[(v == 0) | ~torch.isfinite(v.reciprocal().square_())]
        if mask is not None:  # zeros from here on: only the frozen are set
            mask[idx + start] = True
            continue
        if idx.numel():
            found.append(idx.add_(start))
            n += idx.numel()
            if 16 * n > numel:  # too many for positions: a mask from here on
                mask = torch.zeros(numel, dtype=torch.bool, device=t.device)
                for positions in found:
                    mask[positions] = True
                found = []
    if mask is not None:
        return mask.view(t.shape)
    if n == 0:
        return None
    return torch.cat(found) if len(found) > 1 else found[0]


class ElementwiseFrozen:
    """The frozen coordinates of :class:`~geosharp.geometry.elementwise.ElementwiseGeometry`.

    A mixin of it: reads the geometry's ``point``, its frozen coordinates per component
    (``_frozen``: ``None``, flat positions or a boolean mask, as :func:`_frozen_of` finds them)
    and ``has_frozen``, and keeps which components are frozen throughout in ``_whole``.
    """

    def _zero_frozen_(self, t: Tensor, k: int, value: float | bool = 0.0) -> Tensor:
        """``t`` (shaped like component ``k``) with its frozen coordinates set to ``value``."""
        f = self._frozen[k]
        if f is None:
            return t
        if f.dtype == torch.bool:
            return t.masked_fill_(f, value)
        if t.is_contiguous():
            t.view(-1).index_fill_(0, f, value)
            return t
        mask = torch.zeros(t.numel(), dtype=torch.bool, device=t.device)
        mask[f] = True
        return t.masked_fill_(mask.view(t.shape), value)

    def _whole_frozen(self) -> list[bool]:
        """Per component, whether every coordinate is frozen (read once, then kept)."""
        whole = getattr(self, "_whole", None)
        if whole is None:
            whole = [
                f is not None and f.dtype == torch.bool and bool(f.all()) for f in self._frozen
            ]
            self._whole = whole
        return whole

    def _zero_frozen_all_(self, ts: Sequence[Tensor]) -> None:
        """:meth:`_zero_frozen_` of every component ``ts[k]``, in place.

        The components frozen throughout (a zero-initialized bias) are zeroed by one
        multi-tensor op; the others with frozen coordinates one at a time.
        """
        if not self.has_frozen:
            return
        whole = self._whole_frozen()
        zs = [t for t, w in zip(ts, whole, strict=True) if w]
        if zs:
            torch._foreach_zero_(zs)
        for k, (t, f) in enumerate(zip(ts, self._frozen, strict=True)):
            if f is not None and not whole[k]:
                self._zero_frozen_(t, k)

    def _w2(self, k: int) -> Tensor:
        """``w²`` of component ``k``, 0 on frozen coordinates (a temporary of its size)."""
        return self._zero_frozen_(self.point[k].square(), k)

    def _abs(self, k: int) -> Tensor:
        """``|w|`` of component ``k``, 0 on frozen coordinates (a temporary of its size)."""
        return self._zero_frozen_(self.point[k].abs(), k)

    def _scaled(self, x: Tensor, k: int) -> Tensor:
        """``x / |w|`` of component ``k`` (0 on frozen coordinates), a new tensor."""
        if self._frozen[k] is None:
            return x / self.point[k]
        # a product with 1/w (0 where frozen): differentiable everywhere, no 0/0 in a backward
        return x * self._zero_frozen_(self.point[k].reciprocal(), k)
