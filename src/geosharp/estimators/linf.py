"""The ℓ∞ perturbation set of adaptive and Euclidean sharpness: the box and its sign steps.

``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ`` (Euclidean), the ℓ∞ counterpart of the metric
ball (SPEC §2): the operations Auto-PGD's ``norm="linf"`` needs, as functions of a
perturbation's pieces (each piece's geometry gives its box scale ``|w|``, or ``None`` for the
Euclidean box): the sign direction, the projection onto the box and a uniform sample of it.
"""

from __future__ import annotations

import torch

from geosharp.estimators.pieces import Piece, Xi
from geosharp.geometry.draws import draw_like

__all__ = ["box", "box_from_uniform", "sign_direction", "uniform_box"]


def sign_direction(pieces: list[Piece], egrad: Xi) -> Xi:
    """``sign(e) ⊙ |w|`` (adaptive) or ``sign(e)`` (euclidean): the ℓ∞ ascent direction.

    Multi-tensor ops over each piece's components (one dispatch per op, not per component).
    """
    out = []
    for p, e in zip(pieces, egrad, strict=True):
        if not e:
            out.append(tuple(e))
            continue
        scale = p.geometry.box_scale()
        signs = torch._foreach_sign(list(e))
        if scale is not None:
            torch._foreach_mul_(signs, list(scale))
        out.append(tuple(signs))
    return out


def box(pieces: list[Piece], xi: Xi, rho: float) -> Xi:
    """Projection onto the box ``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ``.

    ``max(min(ξ, b), −b)`` with ``b = ρ|w|`` by multi-tensor ops over each piece's components.
    """
    out = []
    for p, x in zip(pieces, xi, strict=True):
        if not x:
            out.append(tuple(x))
            continue
        scale = p.geometry.box_scale()
        if scale is None:
            bounds = [torch.full_like(t, rho) for t in x]
        else:
            bounds = torch._foreach_mul(list(scale), rho)
        del scale
        low = torch._foreach_neg(bounds)
        clipped = torch._foreach_minimum(list(x), bounds)
        del bounds
        torch._foreach_maximum_(clipped, low)
        out.append(tuple(clipped))
    return out


def uniform_box(pieces: list[Piece], generator: torch.Generator | None, rho: float) -> Xi:
    """Uniform sample of the box ``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ``.

    One draw over all components of a piece, then split (the numbers do not depend on how
    the piece is cut into components).
    """
    return box_from_uniform(
        pieces, [draw_like(p.geometry.point, generator, torch.rand) for p in pieces], rho
    )


def box_from_uniform(pieces: list[Piece], uniform: list, rho: float) -> Xi:
    """:func:`uniform_box` from its uniform numbers in ``[0, 1)``, one list per piece."""
    out = []
    for p, u in zip(pieces, uniform, strict=True):
        scale = p.geometry.box_scale()
        out.append(
            tuple(
                (2 * uk - 1) * rho * (scale[k] if scale is not None else 1)
                for k, uk in enumerate(u)
            )
        )
    return out
