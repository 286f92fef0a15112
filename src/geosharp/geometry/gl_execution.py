r"""How a GL(h) geometry runs its math: precision, chunking over heads, in-place accumulation.

The formulas of :mod:`~geosharp.geometry.gl_math` are pure functions of tensors; *in which
dtype* and *over which heads at a time* they are evaluated is decided here, by one
:class:`GLExecution` a :class:`~geosharp.geometry.gl.GLGeometry` holds. A test or a user sets
precision and chunking in this one place, e.g. ``GLGeometry(G, H,
execution=GLExecution(work_dtype=torch.float32))``.

The dtypes involved, for a model in ``dtype`` (the dtype of ``G`` and ``H``):

.. code-block:: text

    factor_dtype    the base-point factorizations (Gram matrices, inverses, eigendecompositions)
    work_dtype      the per-step products (metric, projection, Riemannian gradient, Christoffel)
    tangent_dtype   the tangents a geometry hands out and keeps between calls
    endpoint_dtype  the order-2 endpoint G + ξ − ½Γ(ξ, ξ) of the ascent's forward and backward

Example:
    >>> import torch
    >>> GLExecution().resolve(torch.float32).work_dtype   # float64 products by default
    torch.float64
    >>> lean = GLExecution(work_dtype=torch.float32).resolve(torch.float32)
    >>> lean.tangent_dtype, lean.hold_point                 # float32 tangents, the model's point
    (torch.float32, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.geometry import flat
from geosharp.geometry.gl_rows import RowSum

__all__ = [
    "CHUNK_DEVICES",
    "CHUNK_ELEMENTS",
    "DEVICE_CHUNK_ELEMENTS",
    "DEVICE_MAX_CHUNKS",
    "GLExecution",
    "chunked_on",
]

#: Default number of work-dtype elements in one chunk of heads of the per-step products on a
#: CPU: a chunk of widened heads of about 2 MB stays in cache between its products.
CHUNK_ELEMENTS = 2**18

#: Elsewhere (a GPU): work-dtype elements of one chunk (128 MB in float64), taken only where
#: the products would otherwise need more, and then in at most :data:`DEVICE_MAX_CHUNKS`
#: chunks. A whole-piece pass widens the piece's tangent, its Riemannian gradient and its point
#: to float64 at once: three float64 copies of every block weight (on a 335 M BERT, 0.3 of the
#: weights in blocks: 1.8 parameter-sized float32 buffers); four chunks make that a quarter, for
#: a few more launches per step.
DEVICE_CHUNK_ELEMENTS = 2**24
DEVICE_MAX_CHUNKS = 4


#: Device types on which a default :class:`GLExecution` runs its per-step products chunk by
#: chunk of heads of :data:`CHUNK_ELEMENTS` (:attr:`GLExecution.chunk_devices`): the CPU, where a
#: chunk of widened heads stays in cache and a launch costs little. Elsewhere (a GPU) one
#: batched pass per piece, or at most :data:`DEVICE_MAX_CHUNKS` on a large piece: a fixed number
#: of launches. Set for a while by :func:`chunked_on`.
CHUNK_DEVICES: tuple[str, ...] = ("cpu",)


@contextlib.contextmanager
def chunked_on(devices: tuple[str, ...]) -> Iterator[None]:
    """Within the block, geometries made with a default policy chunk on ``devices`` only.

    ``chunked_on(())`` runs the products as on a GPU on every device, the CPU included: one
    batched pass per piece (at most :data:`DEVICE_MAX_CHUNKS` on a large one), the path and the
    launches of a GPU (``benchmarks/launches.py --path device``). Auto-PGD's combination
    follows it (:data:`~geosharp.geometry.flat.COMBINE_DEVICES`): written over the retired
    iterate chunk by chunk on ``devices`` only, in three whole passes elsewhere.
    Each head's products are the same either way; sums over heads (a pairing, a norm) add the
    chunks' partial sums in another order.
    """
    global CHUNK_DEVICES
    saved = CHUNK_DEVICES, flat.COMBINE_DEVICES
    CHUNK_DEVICES = flat.COMBINE_DEVICES = tuple(devices)
    try:
        yield
    finally:
        CHUNK_DEVICES, flat.COMBINE_DEVICES = saved


@dataclass(frozen=True)
class GLExecution:
    """The execution policy of a GL(h) geometry; every field ``None`` is resolved per model.

    :meth:`resolve` fills the defaults from the model's dtype; a geometry holds the resolved
    policy as its ``execution`` and asks it for every cast and every chunk.

    Attributes:
        factor_dtype: Dtype of the base-point factorizations (default: the model's dtype
            promoted to float64: the horizontal projection of an ill-conditioned block loses
            ``cond(M_G)·cond(M_H)`` relative accuracy, SPEC §4.4).
        work_dtype: Dtype of the per-step products (default: ``factor_dtype``). Narrower than
            ``factor_dtype`` (the model's float32, ``gs.sharpness(low_memory=True)``), the
            factorizations are rounded once to it, the base point is the model's own tensors
            and tangents are kept in it: no float64 temporaries, at the cost of float32
            roundoff up to ``cond(M_G)·cond(M_H)·2⁻²⁴`` in the projection.
        tangent_dtype: Dtype tangents are kept in between calls (default: the model's; it is
            ``work_dtype`` when that is narrower than ``factor_dtype``). Each method widens
            its tangents to ``work_dtype`` and rounds its result back once.
        hold_point: Keep a copy of the base point in ``work_dtype`` (default: when tangents
            are kept in ``work_dtype``, or ``work_dtype`` is narrowed); otherwise each call
            widens ``G``, ``H`` afresh, chunk by chunk.
        endpoint_dtype: Dtype of the order-2 endpoint (default: the model's, at least
            float32). The term ``½Γ(ξ, ξ)`` is a correction of relative size ``‖ξ‖``, so its
            rounding error is ``O(‖ξ‖²)`` times the unit roundoff, while a wider dtype would
            widen the ascent's forward and backward through it. A bfloat16 model's endpoint
            runs in float32 (its ``h × h`` factors in bfloat16 moved geodesic-mix sharpness of
            a tiny BERT 1.8 % from the float32 value, 3.6 % sharded over 4 ranks; in float32
            under 1 % either way).
        chunk_elements: Work-dtype elements of one chunk of heads of the per-step products
            (the projection, the horizontal gradient and the metric).
        chunk_devices: Device types on which the per-step products run chunk by chunk of
            :attr:`chunk_elements` (default :data:`CHUNK_DEVICES`, when the policy is made).
        device_chunk_elements: Elsewhere, the elements of one chunk, in at most
            :attr:`device_max_chunks` chunks (one pass when the piece fits in one).
        device_max_chunks: The most chunks of a piece elsewhere (a GPU: launches per step).
        inplace: Accumulate the projection ``g + GΛ`` into the fresh Riemannian gradient
            ``g`` instead of copying it (the same values).
        row_sum: Sums the ``h × h`` contractions over rows across the ranks that hold the
            other rows of ``G`` and ``H`` (a model sharded by FSDP2, SPEC §10;
            :mod:`~geosharp.geometry.gl_rows`). ``None``: this process holds every row. With
            it a chunked projection sums every chunk's contractions in one collective (the
            chunks are the rank's own, and every rank must make the same collectives).
    """

    factor_dtype: torch.dtype | None = None
    work_dtype: torch.dtype | None = None
    tangent_dtype: torch.dtype | None = None
    hold_point: bool | None = None
    endpoint_dtype: torch.dtype | None = None
    chunk_elements: int = CHUNK_ELEMENTS
    chunk_devices: tuple[str, ...] = dataclasses.field(default_factory=lambda: CHUNK_DEVICES)
    device_chunk_elements: int = DEVICE_CHUNK_ELEMENTS
    device_max_chunks: int = DEVICE_MAX_CHUNKS
    inplace: bool = True
    row_sum: RowSum | None = None

    def resolve(self, dtype: torch.dtype) -> GLExecution:
        """This policy with every ``None`` replaced by its default for a model in ``dtype``."""
        factor = self.factor_dtype or torch.promote_types(dtype, torch.float64)
        work = self.work_dtype or factor
        if work != factor:  # narrowed products: tangents and the held point in work_dtype
            tangent, hold = work, True
        else:
            tangent = self.tangent_dtype or dtype
            hold = tangent == factor if self.hold_point is None else self.hold_point
        return dataclasses.replace(
            self,
            factor_dtype=factor,
            work_dtype=work,
            tangent_dtype=tangent,
            hold_point=hold,
            endpoint_dtype=self.endpoint_dtype or torch.promote_types(dtype, torch.float32),
        )

    # -- what a resolved policy answers ------------------------------------------------------
    def work_point(self, G: Tensor, G_factor: Tensor) -> Tensor:
        """``G`` in ``work_dtype``, with no second copy of it.

        The factorizations' copy ``G_factor`` when its dtype is ``work_dtype``, else ``G`` cast
        (``G`` itself when already in ``work_dtype``).
        """
        return G_factor if G_factor.dtype == self.work_dtype else G.to(self.work_dtype)

    def head_slices(self, G: Tensor, H: Tensor) -> list[slice]:
        """The chunks of the flattened heads the per-step products run over.

        On the :attr:`chunk_devices`, consecutive slices of ``chunk_elements // (max(n, m) · h)``
        heads; elsewhere of ``device_chunk_elements // (max(n, m) · h)`` heads, but at least
        ``1 / device_max_chunks`` of them. ``[slice(None)]`` (one pass) when they all fit in one.
        """
        n_heads = math.prod(G.shape[:-2])
        head = max(G.shape[-2], H.shape[-2]) * G.shape[-1]
        if G.device.type in self.chunk_devices:
            per = max(1, self.chunk_elements // max(head, 1))
        else:
            per = max(1, self.device_chunk_elements // max(head, 1))
            per = max(per, -(-n_heads // max(self.device_max_chunks, 1)))
        if per >= n_heads:
            return [slice(None)]
        return [slice(i, min(i + per, n_heads)) for i in range(0, n_heads, per)]

    def widen(self, *ts: Tensor) -> tuple[Tensor, ...]:
        """The tensors in ``work_dtype`` (no copy of those already in it)."""
        return tuple(t.to(self.work_dtype) for t in ts)


def by_head(batch_dims: int) -> Callable[[Tensor], Tensor]:
    """A function flattening the first ``batch_dims`` dimensions of a per-head tensor."""

    def flat(t: Tensor) -> Tensor:  # the head count named: a rank may hold no row (n = 0)
        return t.reshape(math.prod(t.shape[:batch_dims]), *t.shape[batch_dims:])

    return flat
