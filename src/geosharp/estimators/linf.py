"""The ℓ∞ perturbation set of adaptive and Euclidean sharpness: the box and its sign steps.

``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ`` (Euclidean), the ℓ∞ counterpart of the metric
ball (SPEC §2): the operations Auto-PGD's ``norm="linf"`` needs, over a perturbation's
pieces (each piece's geometry gives its box scale ``|w|``, or ``None`` for the Euclidean box):
one step's sign step and projections (:class:`StepBox`) and a uniform sample of the box.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geosharp.estimators.pieces import Piece, Xi
from geosharp.geometry.draws import draw_like

__all__ = ["StepBox", "box_from_uniform", "uniform_box"]


class StepBox:
    """The box of one ascent step: ``|w|`` and the bounds ``±ρ|w|`` formed once per step.

    Auto-PGD's ℓ∞ step reads the box three times: the sign step ``ξ + η sign(e) ⊙ |w|``, the
    projection of that point and the projection of the momentum's point. ``|w|``, ``ρ|w|`` and
    ``−ρ|w|`` are formed once for the three, and the projections clip in place
    (``max(min(ξ, ρ|w|), −ρ|w|)``). The bounds live for the step only (two perturbation-sized
    buffers while it combines, none during the loss); ``|w|`` is dropped once the bounds are
    made. The Euclidean box clips to the scalar ``±ρ`` (no bound tensors).

    Args:
        pieces: The perturbation's pieces.
        rho: The box's radius ``ρ``.
    """

    def __init__(self, pieces: list[Piece], rho: float) -> None:
        self.pieces, self.rho = pieces, rho
        self._scale: list[tuple[Tensor, ...] | None] = [None] * len(pieces)
        self._bounds: list[tuple[list[Tensor], list[Tensor]] | None] = [None] * len(pieces)

    def _abs_w(self, k: int) -> tuple[Tensor, ...] | None:
        if self._scale[k] is None:
            self._scale[k] = self.pieces[k].geometry.box_scale()
        return self._scale[k]

    def sign_step(self, xi: Xi, egrad: Xi, eta: float) -> Xi:
        """``ξ + η · sign(e) ⊙ |w|`` (adaptive; ``sign(e)`` Euclidean): new tensors, 3 passes."""
        out = []
        for k, (x, e) in enumerate(zip(xi, egrad, strict=True)):
            if not e:
                out.append(tuple(e))
                continue
            step = torch._foreach_sign(list(e))
            scale = self._abs_w(k)
            if scale is not None:
                torch._foreach_mul_(step, list(scale))
            torch._foreach_mul_(step, eta)
            torch._foreach_add_(step, list(x))  # η·s + ξ: the sum ξ + η·s, commuted
            out.append(tuple(step))
        return out

    def _bounds_of(self, k: int) -> tuple[list[Tensor], list[Tensor]] | None:
        if self._bounds[k] is None:
            scale = self._abs_w(k)
            if scale is None:
                return None
            high = torch._foreach_mul(list(scale), self.rho)
            self._scale[k] = None  # |w| is not needed once the bounds are made
            self._bounds[k] = (high, torch._foreach_neg(high))
        return self._bounds[k]

    def project_(self, xi: Xi) -> Xi:
        """``max(min(ξ, ρ|w|), −ρ|w|)`` in place (``ξ``'s own tensors), returned."""
        for k, x in enumerate(xi):
            if not x:
                continue
            bounds = self._bounds_of(k)
            if bounds is None:
                torch._foreach_clamp_max_(list(x), self.rho)
                torch._foreach_clamp_min_(list(x), -self.rho)
            else:
                torch._foreach_minimum_(list(x), bounds[0])
                torch._foreach_maximum_(list(x), bounds[1])
        return xi


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
