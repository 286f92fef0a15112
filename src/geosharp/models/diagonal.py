"""Diagonal linear networks ``y = xᵀ(u ⊙ v)`` (SPEC §3, §5)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DiagonalNet"]


class DiagonalNet(nn.Module):
    """A diagonal linear network ``y = x @ (u ⊙ v)`` with effective weights ``β = u ⊙ v``.

    The rescaling ``(u_i, v_i) ↦ (α u_i, v_i / α)`` leaves the function unchanged; the class
    attribute :attr:`symmetry_pairs` tells :func:`geosharp.symmetry.find_symmetries` so.

    Args:
        d: Input dimension.
        init_scale: ``u`` and ``v`` start at ``init_scale · 1`` (the usual α-initialization;
            small values give the sparse "rich" regime).

    Example:
        >>> import torch
        >>> net = DiagonalNet(3, init_scale=0.5)
        >>> net(torch.ones(2, 3))
        tensor([0.7500, 0.7500], grad_fn=<MvBackward0>)
    """

    #: ``(u, v)`` parameter names of the diagonal symmetry, read by the symmetry finder.
    symmetry_pairs = (("u", "v"),)

    def __init__(self, d: int, init_scale: float = 1.0) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.full((d,), float(init_scale)))
        self.v = nn.Parameter(torch.full((d,), float(init_scale)))

    @property
    def beta(self) -> Tensor:
        """Effective linear weights ``u ⊙ v``."""
        return self.u * self.v

    def forward(self, x: Tensor) -> Tensor:
        """Predict ``x @ (u ⊙ v)``.

        Args:
            x: Inputs ``(batch, d)``.

        Returns:
            Predictions ``(batch,)``.
        """
        return x @ (self.u * self.v)
