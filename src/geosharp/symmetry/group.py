"""The symmetry group of a parameter space: random elements and their action (SPEC §3, §7).

Every symmetry block draws a random element of its group and applies it
(:mod:`geosharp.symmetry.blocks`): GL(h) by ``(G, H) ↦ (G A⁻¹, H Aᵀ)`` (one ``A`` per head),
the rotary commutant likewise, a diagonal pair by ``(u, v) ↦ (α u, v / α)``, a key bias by a
translation; the network function is unchanged. :func:`random_group_elements` draws one element
of every block's group (SPEC §7: ``A = a·N(0, 1)^{h×h}``) and :func:`group_action` applies it
to flat weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.symmetry.space import ParameterSpace

__all__ = ["GroupElement", "group_action", "random_group_elements"]


@dataclass
class GroupElement:
    """One element of the symmetry group of a :class:`ParameterSpace`.

    Attributes:
        parts: One element per block of :attr:`ParameterSpace.blocks`, in that order (e.g. a
            ``(B, h, h)`` tensor of invertible matrices for a GL block, ``α`` for a diagonal
            pair, a translation vector for a key bias).
    """

    parts: list[Tensor]


def random_group_elements(
    space: ParameterSpace,
    *,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    max_cond: float = 1e3,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> GroupElement:
    """Draw a random symmetry: one random element of every block's group.

    GL blocks get ``A = scale·N(0,1)^{h×h}`` per head, rotary blocks a scaled rotation per
    plane (and ``N(0, 1)`` on the non-rotated features), diagonal pairs ``α = scale·N(0,1)``,
    key biases a translation ``scale·N(0, 1)``. Matrices with condition number above
    ``max_cond`` are redrawn, and ``α`` entries with ``|α| < 0.1·scale`` too, so the
    transformation is numerically harmless.

    Args:
        space: The parameter space whose blocks to transform.
        generator: CPU random generator (draws happen in float64 on the CPU).
        scale: Overall scale ``a`` of the group element.
        max_cond: Largest accepted condition number of each matrix.
        dtype: Dtype of the returned tensors.
        device: Device of the returned tensors.

    Returns:
        The :class:`GroupElement`.

    Raises:
        ValueError: If ``scale`` is not positive.

    Example:
        >>> from torch import nn
        >>> from geosharp.symmetry import find_symmetries
        >>> space = find_symmetries(nn.MultiheadAttention(8, num_heads=2))
        >>> el = random_group_elements(space, generator=torch.Generator().manual_seed(0))
        >>> [(b.kind, tuple(A.shape)) for b, A in zip(space.blocks, el.parts)]
        [('QK', (2, 4, 4)), ('b_k', (2, 1, 4)), ('VO', (2, 4, 4))]
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return GroupElement(
        parts=[
            b.random_element(generator, scale, max_cond).to(dtype=dtype, device=device)
            for b in space.blocks
        ]
    )


def group_action(space: ParameterSpace, theta: Tensor, element: GroupElement) -> Tensor:
    """Apply a group element to a flat parameter vector (differentiable).

    Each block applies its own action (``G ↦ G A⁻¹``, ``H ↦ H Aᵀ`` by a solve; ``u ↦ α u``,
    ``v ↦ v / α``; ``b ↦ b + t``); coordinates in :attr:`ParameterSpace.rest_index` are
    untouched.

    Args:
        space: The parameter space ``θ`` belongs to.
        theta: Flat parameter vector.
        element: The group element, e.g. from :func:`random_group_elements`.

    Returns:
        The transformed flat vector (``theta`` is not modified).

    Raises:
        ValueError: If ``element`` does not match the blocks of ``space``.
    """
    if len(element.parts) != len(space.blocks):
        raise ValueError(
            f"group element has {len(element.parts)} parts but the space has "
            f"{len(space.blocks)} symmetry blocks"
        )
    # Every block is read from θ and all new values are written back in one index_put (one
    # copy of θ, not two per block: 24 copies of 22.7 M floats for MiniLM-L6).
    index: list[Tensor] = []
    values: list[Tensor] = []
    for block, part in zip(space.blocks, element.parts, strict=True):
        moved = block.act(block.gather(theta), part)
        index += [i.reshape(-1) for i in block.indices]
        values += [m.reshape(-1) for m in moved]
    if not index:
        return theta.clone()
    return theta.index_put((torch.cat(index).to(theta.device),), torch.cat(values))
