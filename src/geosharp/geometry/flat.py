"""Tangent components as slices of one flat buffer: one launch per operation (issue 43).

A tangent of a piece with many components (the rest piece of a model: one tensor per
parameter) costs one kernel launch per component and per operation when it is handled tensor
by tensor. Where its components are consecutive slices of one 1-D buffer (:func:`flatten`),
an element-wise operation or a dot product runs once over the buffer (:func:`flat_of`); where
they are not, ``torch._foreach_*`` ops take the component lists (:func:`lists`), one dispatch
each. Element-wise results are bit for bit those of the per-tensor loops; a dot product over
the buffer sums in another order than the per-component dots it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "COMBINE_CHUNK",
    "COMBINE_DEVICES",
    "FLAT_DTYPES",
    "axpy",
    "clone",
    "combine_into_",
    "flat_exact",
    "flat_of",
    "flatten",
    "lists",
    "outside_transforms",
    "pair_buffer",
    "scale_",
    "untracked",
    "views",
    "widen_pair",
]


def flat_of(ts: Sequence[Tensor]) -> Tensor | None:
    """The 1-D tensor whose consecutive slices ``ts`` are, in order, or ``None``.

    One component: its flat view when contiguous. Several: when they share one storage,
    dtype and device, each contiguous and starting where the previous ends (checked from the
    tensors' metadata, no kernel).
    """
    if not ts:
        return None
    t0 = ts[0]
    if len(ts) == 1:
        return t0.view(-1) if t0.is_contiguous() else None
    ptr = t0.untyped_storage().data_ptr()
    start = n = t0.storage_offset()
    for t in ts:
        if (
            t.dtype != t0.dtype
            or t.device != t0.device
            or t.storage_offset() != n
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
        n += t.numel()
    return t0.as_strided((n - start,), (1,), start)


#: Dtypes in which an op runs over a whole flat buffer. In bfloat16 and float16 it does not: a
#: dot returns its dtype, so one rounding over every component would replace the per-component
#: dots' (summed in float64), and ``torch.add(x, v, alpha=c)`` rounds some elements differently
#: over a flat buffer than component by component (the vectorized loop and its tail compute
#: ``x + c·v`` apart): their per-component values are kept (issue 43).
FLAT_DTYPES = (torch.float32, torch.float64)


def flat_exact(ts: Sequence[Tensor]) -> Tensor | None:
    """:func:`flat_of` ``ts`` where ops over it give per-component values (:data:`FLAT_DTYPES`)."""
    f = flat_of(ts)
    return f if f is not None and f.dtype in FLAT_DTYPES else None


def flatten(ts: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``ts`` copied into one fresh flat buffer (one ``cat``), as views of it in their shapes.

    Returned as they are when already flat (:func:`flat_of`), when there is one component,
    when the components' dtypes or devices differ (a model split across devices), or in a dtype
    outside :data:`FLAT_DTYPES` (whose ops keep their per-component values).
    """
    ts = tuple(ts)
    if len(ts) < 2 or flat_of(ts) is not None:
        return ts
    t0 = ts[0]
    if t0.dtype not in FLAT_DTYPES or any(t.dtype != t0.dtype or t.device != t0.device for t in ts):
        return ts
    return views(torch.cat([t.reshape(-1) for t in ts]), ts)


def lists(*tangents: Sequence[Tensor]) -> list[list[Tensor]]:
    """The operands of one ``torch._foreach_*`` op over several tangents of one piece.

    ``[[flat] for each]`` when every tangent is flat (:func:`flat_exact`) with the same number of
    elements (one tensor each: the op runs once over the buffers), else their component lists.
    """
    flats = [flat_exact(t) for t in tangents]
    if all(f is not None for f in flats) and len({f.numel() for f in flats}) == 1:  # type: ignore[union-attr]
        return [[f] for f in flats]  # type: ignore[list-item]
    return [list(t) for t in tangents]


def views(flat: Tensor, like: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``flat`` cut into consecutive views shaped like the components ``like``."""
    parts = flat.split([t.numel() for t in like]) if len(like) > 1 else (flat,)
    return tuple(v.view(t.shape) for v, t in zip(parts, like, strict=True))


def clone(ts: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """A copy of the components: one copy of their flat buffer where they lie in one."""
    f = flat_of(ts)
    if f is not None and len(ts) > 1:
        return views(f.clone(), ts)
    return tuple(t.clone() for t in ts)


def axpy(x: Sequence[Tensor], v: Sequence[Tensor], c: float, reuse: bool) -> tuple[Tensor, ...]:
    """``x + c·v`` per component (the values of ``torch.add(x, v, alpha=c)``).

    Written into ``v`` when ``reuse``; one op over the flat buffers where both lie in one
    (:func:`flat_exact`), else one multi-tensor op (one per component when writing into ``v``).
    """
    fx, fv = flat_exact(x), flat_exact(v)
    if fx is not None and fv is not None and len(x) == len(v) and fx.numel() == fv.numel():
        out = torch.add(fx, fv, alpha=c, out=fv if reuse else None)
        return tuple(v) if reuse else views(out, x)
    if reuse:
        return tuple(torch.add(a, b, alpha=c, out=b) for a, b in zip(x, v, strict=True))
    return tuple(torch._foreach_add(list(x), list(v), alpha=c))


#: Elements per chunk of :func:`combine_into_` (a chunk's temporary stays in cache).
COMBINE_CHUNK = 1 << 18

#: Device types on which :func:`combine_into_` writes over the retired buffer chunk by chunk:
#: the CPU, where a new parameter-sized buffer is fresh pages at every step. Elsewhere (a GPU,
#: whose caching allocator hands back freed memory) the caller's three passes, a fixed number of
#: launches. :func:`~geosharp.geometry.gl_execution.chunked_on` sets it for a while, with the GL
#: products' chunking (``chunked_on(())``: a GPU's path and launches on the CPU).
COMBINE_DEVICES: tuple[str, ...] = ("cpu",)


def combine_into_(
    x: Sequence[Tensor], v: Sequence[Tensor], c1: float, p: Sequence[Tensor], c2: float, k: float
) -> tuple[Tensor, ...] | None:
    """``(x + c1·v + c2·p)·k`` written into ``p``'s flat buffer, on a CPU; else None.

    The values of ``t = axpy(x, v, c1, False)``, then ``t += c2·p`` and ``t *= k`` (skipped
    when ``k`` is 1) bit for bit: the same three ops on every element, a chunk of
    :data:`COMBINE_CHUNK` elements at a time, the chunk's ``x + c1·v`` in one small temporary.
    So the combination needs no new parameter-sized buffer. On a CPU a new buffer that size is
    fresh pages at every step (glibc maps it anew), and their faults cost more than the
    arithmetic; a GPU's caching allocator has no such cost, so ``None`` is returned there (on a
    device type outside :data:`COMBINE_DEVICES`). ``None`` also where ``x``, ``v`` and ``p``
    are not each one flat buffer of one size and dtype (:func:`flat_exact`); the caller then
    forms ``t`` as before. ``p`` is overwritten:
    the caller must hold it alone.
    """
    fx, fv, fp = flat_exact(x), flat_exact(v), flat_exact(p)
    if fx is None or fv is None or fp is None or fp.device.type not in COMBINE_DEVICES:
        return None
    if not len(x) == len(v) == len(p) or not fx.numel() == fv.numel() == fp.numel():
        return None
    if not fx.dtype == fv.dtype == fp.dtype or not fx.device == fv.device == fp.device:
        return None
    n = fp.numel()
    tmp = torch.empty(min(n, COMBINE_CHUNK), dtype=fp.dtype, device=fp.device)
    for i in range(0, n, COMBINE_CHUNK):
        j = min(i + COMBINE_CHUNK, n)
        t = torch.add(fx[i:j], fv[i:j], alpha=c1, out=tmp[: j - i])
        out = torch.add(t, fp[i:j], alpha=c2, out=fp[i:j])  # t + c2·p, as t.add_(p, alpha=c2)
        if k != 1.0:
            out.mul_(k)
    return tuple(p)


def scale_(ts: Sequence[Tensor], c: float) -> None:
    """``t.mul_(c)`` for every component: one op (over the flat buffer, or multi-tensor).

    In bfloat16 and float16 one ``mul_`` per component: the multi-tensor ``mul_`` by a scalar
    rounds differently there.
    """
    ts = list(ts)
    if not ts:
        return
    if ts[0].dtype in FLAT_DTYPES and all(t.dtype == ts[0].dtype for t in ts):
        torch._foreach_mul_(lists(ts)[0], c)
        return
    for t in ts:
        t.mul_(c)


def outside_transforms(inputs: Sequence[Tensor]) -> bool:
    """Whether no ``torch.func`` transform and no forward-mode dual tensor sees ``inputs``.

    Then plain autograd (or none) is all that differentiates them: a hand-written
    ``autograd.Function``, which has no ``jvp`` or ``vmap`` rule, may serve them.
    """
    if torch._C._are_functorch_transforms_active():
        return False
    unpack = torch.autograd.forward_ad.unpack_dual
    return all(unpack(t).tangent is None for t in inputs)


def untracked(inputs: Sequence[Tensor]) -> bool:
    """Whether no autograd graph, ``torch.func`` transform or dual tensor sees ``inputs``.

    Then their values may be written into buffers made here (``out=``, ``copy_``, multi-tensor
    ops) instead of by differentiable out-of-place ops.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return False
    return outside_transforms(inputs)


def pair_buffer(
    like_a: Tensor, like_b: Tensor, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Two uninitialized tensors shaped like ``like_a`` and ``like_b``, slices of one buffer.

    In ``dtype`` (default ``like_a``'s) on ``like_a``'s device: :func:`flat_of` sees the pair,
    so a pairing or a combination of it is one op over the buffer. Two tensors where the
    devices differ.
    """
    dtype = dtype or like_a.dtype
    if like_b.device != like_a.device:
        return (
            torch.empty(like_a.shape, dtype=dtype, device=like_a.device),
            torch.empty(like_b.shape, dtype=dtype, device=like_b.device),
        )
    n = like_a.numel()
    buf = torch.empty(n + like_b.numel(), dtype=dtype, device=like_a.device)
    return buf[:n].view(like_a.shape), buf[n:].view(like_b.shape)


def widen_pair(a: Tensor, b: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(a.to(dtype), b.to(dtype))``, the two slices of one buffer where nothing tracks them.

    The tensors themselves when already in ``dtype``; one cast of their flat buffer when they
    are one already (:func:`flat_of`); else, untracked (:func:`untracked`), two casting copies
    into a :func:`pair_buffer`; tracked, two casts. The values of ``.to(dtype)`` every time.
    """
    if a.dtype == dtype and b.dtype == dtype:
        return a, b
    if a.device == b.device and a.dtype == b.dtype:
        f = flat_of((a, b))
        if f is not None:
            return views(f.to(dtype), (a, b))  # type: ignore[return-value]
    if untracked((a, b)):
        wa, wb = pair_buffer(a, b, dtype)
        torch._foreach_copy_([wa, wb], [a, b])
        return wa, wb
    return a.to(dtype), b.to(dtype)
