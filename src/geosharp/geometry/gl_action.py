"""The GL(h) group action on a block ``(G, H)`` and on its tangent vectors (SPEC §4).

``A ∈ GL(h)`` acts by ``(G, H) ↦ (G A⁻¹, H Aᵀ)``, which leaves ``G Hᵀ`` (and so the network)
unchanged; tangents are pushed forward by the same right multiplications. The invariance tests
of every GL geometry draw random ``A`` and compare both sides.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["act", "act_tangent"]


def act(G: Tensor, H: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Group action ``(G, H) ↦ (G A⁻¹, H Aᵀ)`` of ``A ∈ GL(h)`` (batched; ``A⁻¹`` by a solve).

    Args:
        G: Shape ``(..., n, h)``.
        H: Shape ``(..., m, h)``.
        A: Invertible matrices, shape ``(..., h, h)``.

    Returns:
        The transformed pair; ``G Hᵀ`` is unchanged.
    """
    return _right_solve(G, A), H @ A.mT


def act_tangent(xi_G: Tensor, xi_H: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Push-forward of a tangent vector by the group action: ``(ξ_G A⁻¹, ξ_H Aᵀ)``."""
    return _right_solve(xi_G, A), xi_H @ A.mT


def _right_solve(X: Tensor, A: Tensor) -> Tensor:
    """``X A⁻¹`` without forming the inverse."""
    return torch.linalg.solve(A.mT, X.mT).mT
