"""The fused order-2 GL(h) endpoint and its hand-written backward (SPEC §4.6).

The per-step work of a geodesic ascent through a GL(h) block is the endpoint
``(G, H) + ξ − ½Γ(ξ, ξ)`` in the forward and its adjoint in the backward. Both are written here
through ``h × h`` factors (:func:`_order2_forward`, :class:`_Order2Endpoint`), so that the
``n × h`` work is a few fused multiply-adds; :func:`geosharp.geometry.gl_math.order2_endpoint`
is the entry point, :func:`geosharp.geometry.gl_math.christoffel` the plain form the tests
compare it with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from geosharp.geometry.flat import outside_transforms
from geosharp.geometry.gl_rows import RowSum, contract, sum_chunks

__all__: list[str] = []


#: The identities of :func:`_eye_like`, one per ``(h, dtype, device)``: made once, never written.
_EYES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _eye_like(M: Tensor) -> Tensor:
    """The ``h × h`` identity in ``M``'s dtype and device, made once (no launch per step).

    Shared and never written in place (every use here is out of place). Made outside
    inference mode, so that a graph recorded later may use it.
    """
    key = (M.shape[-1], M.dtype, M.device)
    eye = _EYES.get(key)
    if eye is None:
        with torch.inference_mode(False):
            eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        if type(eye) is torch.Tensor:  # not a fake or traced one (torch.compile, a meta mode)
            _EYES[key] = eye
    return eye


def eye_plus_mm(A: Tensor, B: Tensor, alpha: float) -> Tensor:
    """``I + α·A @ B`` (batched ``h × h``): :func:`scaled_mm` and one ``add``.

    The values of ``I + α·(A @ B)`` (a ``baddbmm`` onto ``I`` would round differently).
    """
    return scaled_mm(A, B, alpha) + _eye_like(A)


def scaled_mm(A: Tensor, B: Tensor, alpha: float) -> Tensor:
    """``α·A @ B`` (batched), one ``baddbmm`` with ``β = 0`` for 3-D operands.

    The values of ``α·(A @ B)``; for ``α`` a power of two also those of ``A @ (α·B)``.
    """
    if A.dim() == 3 and B.dim() == 3 and A.shape[0] == B.shape[0]:
        return torch.baddbmm(_eye_like(A), A, B, beta=0.0, alpha=alpha)
    return alpha * (A @ B)


def add_mm(X: Tensor, A: Tensor, B: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """``X + α·A @ B`` in one batched pass (``baddbmm``) over any leading dimensions.

    ``inplace=True`` accumulates into ``X`` (a temporary of the caller's): an out-of-place
    ``baddbmm`` first copies ``X`` into its result, one pass over an ``n × h`` tensor.
    """
    batch = torch.broadcast_shapes(X.shape[:-2], A.shape[:-2], B.shape[:-2])
    if len(batch) == 1 and X.shape[:-2] == A.shape[:-2] == B.shape[:-2]:
        if inplace:
            return X.baddbmm_(A, B, alpha=alpha)
        return torch.baddbmm(X, A, B, alpha=alpha)
    if inplace:
        return X.add_(A @ B, alpha=alpha)
    return X + alpha * (A @ B)


def _order2_matrices(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
    row_sum: RowSum | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """The ``h × h`` factors ``(C_G, B_G, C_H, B_H, s)`` of ``G′ = G + ξ_G C_G + s·G B_G``.

    ``G′ = G + ξ_G C_G + s·G B_G`` is :func:`geosharp.geometry.gl_math.order2_endpoint`. Its
    four contractions ``ξ_Gᵀ G``, ``ξ_Hᵀ H``, ``ξ_Gᵀ ξ_G``, ``ξ_Hᵀ ξ_H`` are summed over the
    ranks in one ``row_sum`` (rows split over ranks, SPEC §10.2).
    """
    XG, XH, KG, KH = contract((xG, G), (xH, H), (xG, xG), (xH, xH), row_sum=row_sum)
    return _order2_from(XG, XH, KG, KH, MG_inv, MH_inv, metric=metric)


def _order2_from(
    XG: Tensor, XH: Tensor, KG: Tensor, KH: Tensor, MG_inv: Tensor, MH_inv: Tensor, metric: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """:func:`_order2_matrices` from its contractions.

    ``XG = ξ_Gᵀ G``, ``XH = ξ_Hᵀ H``, ``KG = ξ_Gᵀ ξ_G``, ``KH = ξ_Hᵀ ξ_H``, summed over every row.
    """
    if metric == "inv":
        cG = eye_plus_mm(MG_inv, XG + XG.mT, 0.5)
        cH = eye_plus_mm(MH_inv, XH + XH.mT, 0.5)
        return cG, MG_inv @ KG, cH, MH_inv @ KH, -0.5
    cG = eye_plus_mm(XH + XH.mT, MH_inv, -0.5)
    cH = eye_plus_mm(XG + XG.mT, MG_inv, -0.5)
    return cG, KH @ MH_inv, cH, KG @ MG_inv, 0.5


def _order2_forward(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
    inplace: bool = False,
    row_sum: RowSum | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """``(G′, H′, C_G, C_H, s)``: the endpoint and the factors its backward needs.

    ``G′ = G (I + s B_G) + ξ_G C_G``: two products, the second accumulated into the first
    (``inplace``, outside autograd; otherwise one ``baddbmm``), with no pass that copies ``G``.
    """
    cG, bG, cH, bH, s = _order2_matrices(
        G, H, xG, xH, MG_inv, MH_inv, metric=metric, row_sum=row_sum
    )
    Gp = add_mm(G @ add_eye(bG, s), xG, cG, inplace=inplace)
    Hp = add_mm(H @ add_eye(bH, s), xH, cH, inplace=inplace)
    return Gp, Hp, cG, cH, s


def add_eye(B: Tensor, s: float) -> Tensor:
    """``I + s·B`` (batched ``h × h``)."""
    return torch.add(_eye_like(B), B, alpha=s)


def _hand_backward(xG: Tensor, xH: Tensor) -> bool:
    """Whether :class:`_Order2Endpoint` may serve: a reverse-mode gradient in ``ξ``."""
    return _reverse_mode_only((xG, xH))


def _reverse_mode_only(inputs: Sequence[Tensor]) -> bool:
    """Whether a hand-written ``autograd.Function`` backward may serve these inputs.

    Only a reverse-mode gradient of some input: not under a ``torch.func`` transform, nor with
    forward-mode dual tensors (such a Function has no ``jvp`` or ``vmap`` rule, and plain
    autograd serves those), and not without a gradient to take.
    """
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return False
    return outside_transforms(inputs)


def _sym(X: Tensor) -> Tensor:
    return X + X.mT


class _Order2Endpoint(torch.autograd.Function):
    """The order-2 endpoint (:func:`~geosharp.geometry.gl_math.order2_endpoint`), backward by hand.

    With ``G′ = G + ξ_G C_G + s·G B_G`` and ``g_G = ∂L/∂G′``: ``∂C_G = ξ_Gᵀ g_G``,
    ``∂B_G = s·Gᵀ g_G``; ``C`` depends on ``ξ`` through ``ξ_Xᵀ X`` and ``B`` through ``ξ_Xᵀ ξ_X``
    (inv: ``X`` the same factor; mix: the other one), so

    .. code-block:: text

        ∂ξ_G = g_G C_Gᵀ + G·sym(∂S_G) + ξ_G·sym(∂T_G),   sym(A) = A + Aᵀ,
        inv:  ∂S_G = ½ M_G⁻ᵀ ∂C_G,      ∂T_G = M_G⁻ᵀ ∂B_G
        mix:  ∂S_G = −½ ∂C_H M_G⁻ᵀ,     ∂T_G = ∂B_H M_G⁻ᵀ

    (and ``G ↔ H``). The backward is made of differentiable operations on the inputs (``C`` is
    recomputed from ``ξ`` when a graph of the backward is asked for), so Hessian-vector
    products through the endpoint (:func:`geosharp.curvature`) are exact.

    With the rows split over ranks (``row_sum``, SPEC §10.2) the forward sums its four
    contractions over the ranks, and the backward the four of its adjoint (``ξ_Gᵀ g_G``,
    ``Gᵀ g_G`` and the same for H): ``C`` and ``B`` are shared by every rank's rows, so their
    adjoints are the sums of the ranks' parts. One collective each way.
    """

    @staticmethod
    def forward(ctx, xG, xH, G, H, MG_inv, MH_inv, metric, row_sum=None):
        Gp, Hp, cG, cH, s = _order2_forward(
            G, H, xG, xH, MG_inv, MH_inv, metric=metric, inplace=True, row_sum=row_sum
        )
        ctx.save_for_backward(xG, xH, G, H, MG_inv, MH_inv, cG, cH)
        ctx.metric, ctx.s, ctx.row_sum = metric, s, row_sum
        return Gp, Hp

    @staticmethod
    def backward(ctx, gG, gH):
        xG, xH, G, H, MG_inv, MH_inv, cG, cH = ctx.saved_tensors
        metric, s, row_sum = ctx.metric, ctx.s, ctx.row_sum
        if torch.is_grad_enabled():  # create_graph: C as a function of ξ, not a constant
            cG, _, cH, _, _ = _order2_matrices(
                G, H, xG, xH, MG_inv, MH_inv, metric=metric, row_sum=row_sum
            )
        gG = torch.zeros_like(G) if gG is None else gG
        gH = torch.zeros_like(H) if gH is None else gH
        dxG, dxH = order2_adjoint(
            (xG, xH, G, H, MG_inv, MH_inv), (cG, cH, s), metric, [gG, gH], row_sum
        )
        return dxG, dxH, None, None, None, None, None, None


def order2_adjoint(
    inputs: tuple[Tensor, ...],
    factors: tuple[Tensor, Tensor, float],
    metric: str,
    g: list[Tensor],
    row_sum: RowSum | None = None,
) -> tuple[Tensor, Tensor]:
    """``(∂L/∂ξ_G, ∂L/∂ξ_H)`` from ``g = [∂L/∂G′, ∂L/∂H′]`` (:class:`_Order2Endpoint`'s backward).

    ``inputs``: ``(ξ_G, ξ_H, G, H, M_G⁻¹, M_H⁻¹)`` of the forward; ``factors``: its ``C_G``,
    ``C_H`` and ``s``. Four contractions summed over the ranks in one ``row_sum``; the rest is
    row-wise. ``g`` is emptied and ``∂L/∂G′`` let go once ``∂L/∂ξ_G`` is made: where the
    caller holds no other reference, its memory serves ``∂L/∂ξ_H``.
    """
    xG, xH, G, H, MG_inv, MH_inv = inputs
    cG, cH, s = factors
    gG, gH = g
    g.clear()
    dCG, dBG, dCH, dBH = contract((xG, gG), (G, gG), (xH, gH), (H, gH), row_sum=row_sum)
    SG, TG, SH, TH = _adjoint_from(
        dCG, dBG, dCH, dBH, s, MG_inv=MG_inv, MH_inv=MH_inv, metric=metric
    )
    dxG = _adjoint_rows(gG, cG, G, SG, xG, TG)
    del gG
    dxH = _adjoint_rows(gH, cH, H, SH, xH, TH)
    return dxG, dxH


def _adjoint_rows(g: Tensor, c: Tensor, X: Tensor, S: Tensor, x: Tensor, T: Tensor) -> Tensor:
    """``∂ξ_X = g Cᵀ + X·S + ξ_X·T``, accumulated into the fresh ``g Cᵀ`` (no copy of ``g``)."""
    return add_mm(add_mm(g @ c.mT, X, S, inplace=True), x, T, inplace=True)


def _adjoint_from(
    dCG: Tensor,
    dBG: Tensor,
    dCH: Tensor,
    dBH: Tensor,
    s: float,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(sym ∂S_G, sym ∂T_G, sym ∂S_H, sym ∂T_H)`` of :class:`_Order2Endpoint`'s backward.

    From its contractions ``ξ_Gᵀ g_G``, ``Gᵀ g_G``, ``ξ_Hᵀ g_H``, ``Hᵀ g_H`` (summed over every
    row): ``∂ξ_G = g_G C_Gᵀ + G·sym ∂S_G + ξ_G·sym ∂T_G``, the same for H.
    """
    # s = ±½ and ½ are powers of two: s·(M @ dB) is M @ (s·dB), one baddbmm each
    if metric == "inv":
        dSG, dTG = scaled_mm(MG_inv.mT, dCG, 0.5), scaled_mm(MG_inv.mT, dBG, s)
        dSH, dTH = scaled_mm(MH_inv.mT, dCH, 0.5), scaled_mm(MH_inv.mT, dBH, s)
    else:
        dSG, dTG = scaled_mm(dCH, MG_inv.mT, -0.5), scaled_mm(dBH, MG_inv.mT, s)
        dSH, dTH = scaled_mm(dCG, MH_inv.mT, -0.5), scaled_mm(dBG, MH_inv.mT, s)
    return _sym(dSG), _sym(dTG), _sym(dSH), _sym(dTH)


def order2_factors_by_chunks(
    point_rows: Callable[[slice, torch.dtype], tuple[Tensor, Tensor]],
    chunks: Sequence[slice],
    xG: Tensor,
    xH: Tensor,
    MG_inv: Tensor,
    MH_inv: Tensor,
    metric: str,
    row_sum: RowSum | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """:func:`_order2_matrices` with ``G``, ``H`` read a chunk of heads at a time.

    ``point_rows(heads, dtype)``: ``(G, H)`` of the flattened heads ``heads``; ``ξ`` has its
    heads flattened (``(heads, n, h)``) and the dtype they are read in. No ``n × h`` tensor of
    the point is held whole; one ``row_sum`` for the four contractions.
    """
    parts = []
    for sl in chunks:
        G, H = point_rows(sl, xG.dtype)
        pairs = (xG[sl], G), (xH[sl], H), (xG[sl], xG[sl]), (xH[sl], xH[sl])
        parts.append(torch.stack(contract(*pairs)))
        del G, H, pairs
    return _order2_from(*sum_chunks(parts, row_sum), MG_inv, MH_inv, metric)


def order2_adjoint_by_chunks(
    point_rows: Callable[[slice, torch.dtype], tuple[Tensor, Tensor]],
    chunks: Sequence[slice],
    inputs: tuple[Tensor, ...],
    factors: tuple[Tensor, Tensor, float],
    metric: str,
    g: tuple[Tensor, Tensor],
    row_sum: RowSum | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`order2_adjoint` with ``G``, ``H`` read a chunk of heads at a time, in place.

    ``inputs``: ``(ξ_G, ξ_H, M_G⁻¹, M_H⁻¹)`` (heads flattened); ``g = (∂L/∂G′, ∂L/∂H′)`` in
    ``ξ``'s dtype, overwritten chunk by chunk with ``(∂L/∂ξ_G, ∂L/∂ξ_H)`` and returned: no
    ``n × h`` tensor but ``g`` and ``ξ`` is held whole. With every row here (``row_sum``
    ``None``) each chunk is done on its own, the point read once; with rows on other ranks,
    two passes (every chunk's four contractions, one ``row_sum``; then the row-wise products).
    """
    xG, xH, MG_inv, MH_inv = inputs
    cG, cH, s = factors
    gG, gH = g
    dt = xG.dtype

    def contractions(sl: slice, G: Tensor, H: Tensor) -> Tensor:
        return torch.stack(contract((xG[sl], gG[sl]), (G, gG[sl]), (xH[sl], gH[sl]), (H, gH[sl])))

    def rows(sl: slice, G: Tensor, H: Tensor, SG: Tensor, TG: Tensor, SH: Tensor, TH: Tensor):
        gG[sl] = _adjoint_rows(gG[sl], cG[sl], G, SG, xG[sl], TG)
        gH[sl] = _adjoint_rows(gH[sl], cH[sl], H, SH, xH[sl], TH)

    if row_sum is None:
        for sl in chunks:
            G, H = point_rows(sl, dt)
            d = contractions(sl, G, H).unbind(0)
            rows(sl, G, H, *_adjoint_from(*d, s, MG_inv[sl], MH_inv[sl], metric))
        return gG, gH
    parts = [contractions(sl, *point_rows(sl, dt)) for sl in chunks]
    S = _adjoint_from(*sum_chunks(parts, row_sum), s, MG_inv, MH_inv, metric)
    for sl in chunks:
        rows(sl, *point_rows(sl, dt), *(t[sl] for t in S))
    return gG, gH
