"""Random symmetry transformations: same function, different weights (SPEC §3, §7).

GL(h) acts on a block by ``(G, H) ↦ (G A⁻¹, H Aᵀ)`` (one ``A`` per head) and on a diagonal
pair by ``(u, v) ↦ (α u, v / α)``; the network function is unchanged. :func:`reparametrize`
applies a random group element to a copy of a model, which is how the paper shows that
adaptive sharpness changes under re-parametrization while geodesic sharpness does not
(SPEC §7: ``A = a·N(0, 1)^{h×h}``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from geosharp.symmetry.find import find_symmetries
from geosharp.symmetry.space import ParameterSpace

__all__ = ["GroupElement", "group_action", "random_group_elements", "reparametrize"]

#: Entries of the diagonal-pair ``α`` are resampled while ``|α| < _MIN_ALPHA · scale``.
_MIN_ALPHA = 0.1
_MAX_TRIES = 100


@dataclass
class GroupElement:
    """One element of the symmetry group of a :class:`ParameterSpace`.

    Attributes:
        gl: One ``(B, h, h)`` tensor of invertible matrices ``A`` per GL block (same order as
            :attr:`ParameterSpace.gl_blocks`).
        alpha: One nonzero tensor per diagonal pair, shaped like its ``u_index``.
    """

    gl: list[Tensor]
    alpha: list[Tensor]


def _draw_gl(heads: int, h: int, generator: torch.Generator | None, max_cond: float) -> Tensor:
    """``(heads, h, h)`` standard normal matrices, each resampled until ``cond ≤ max_cond``."""
    A = torch.randn(heads, h, h, generator=generator, dtype=torch.float64)
    for _ in range(_MAX_TRIES):
        bad = torch.linalg.cond(A) > max_cond
        if not bad.any():
            return A
        A[bad] = torch.randn(int(bad.sum()), h, h, generator=generator, dtype=torch.float64)
    raise RuntimeError(
        f"could not draw {h}×{h} Gaussian matrices with condition number ≤ {max_cond:g} in "
        f"{_MAX_TRIES} tries; pass a larger max_cond"
    )


def random_group_elements(
    space: ParameterSpace,
    *,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    max_cond: float = 1e3,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> GroupElement:
    """Draw a random symmetry: ``A = scale·N(0,1)^{h×h}`` per head, ``α = scale·N(0,1)``.

    Matrices with condition number above ``max_cond`` are redrawn, and ``α`` entries with
    ``|α| < 0.1·scale`` too, so the transformation is numerically harmless.

    Args:
        space: The parameter space whose blocks to transform.
        generator: CPU random generator (draws happen in float64 on the CPU).
        scale: Overall scale ``a`` of the group element.
        max_cond: Largest accepted condition number of each ``A``.
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
        >>> [tuple(A.shape) for A in el.gl]
        [(2, 4, 4), (2, 4, 4)]
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    gl = [
        (scale * _draw_gl(b.heads, b.head_dim, generator, max_cond)).to(dtype=dtype, device=device)
        for b in space.gl_blocks
    ]
    alpha = []
    for pair in space.diagonal_pairs:
        a = torch.randn(pair.u_index.shape, generator=generator, dtype=torch.float64)
        for _ in range(_MAX_TRIES):
            small = a.abs() < _MIN_ALPHA
            if not small.any():
                break
            a[small] = torch.randn(int(small.sum()), generator=generator, dtype=torch.float64)
        alpha.append((scale * a).to(dtype=dtype, device=device))
    return GroupElement(gl=gl, alpha=alpha)


def group_action(space: ParameterSpace, theta: Tensor, element: GroupElement) -> Tensor:
    """Apply a group element to a flat parameter vector (differentiable).

    ``G ↦ G A⁻¹`` (by a linear solve, never an explicit inverse), ``H ↦ H Aᵀ``,
    ``u ↦ α u``, ``v ↦ v / α``; coordinates in :attr:`ParameterSpace.rest_index` are untouched.

    Args:
        space: The parameter space ``θ`` belongs to.
        theta: Flat parameter vector.
        element: The group element, e.g. from :func:`random_group_elements`.

    Returns:
        The transformed flat vector (``theta`` is not modified).

    Raises:
        ValueError: If ``element`` does not match the blocks of ``space``.
    """
    if len(element.gl) != len(space.gl_blocks) or len(element.alpha) != len(space.diagonal_pairs):
        raise ValueError(
            f"group element has {len(element.gl)} GL and {len(element.alpha)} diagonal parts "
            f"but the space has {len(space.gl_blocks)} GL blocks and "
            f"{len(space.diagonal_pairs)} diagonal pairs"
        )
    # Every block is read from θ and all new values are written back in one index_put (one
    # copy of θ, not two per block: 24 copies of 22.7 M floats for MiniLM-L6).
    index: list[Tensor] = []
    values: list[Tensor] = []
    for block, A in zip(space.gl_blocks, element.gl, strict=True):
        G, H = block.gather(theta)
        A = A.to(dtype=theta.dtype, device=theta.device)
        index += [block.g_index.reshape(-1), block.h_index.reshape(-1)]
        values += [torch.linalg.solve(A, G, left=False).reshape(-1), (H @ A.mT).reshape(-1)]
    for pair, alpha in zip(space.diagonal_pairs, element.alpha, strict=True):
        u, v = pair.gather(theta)
        alpha = alpha.to(dtype=theta.dtype, device=theta.device)
        index += [pair.u_index.reshape(-1), pair.v_index.reshape(-1)]
        values += [(u * alpha).reshape(-1), (v / alpha).reshape(-1)]
    if not index:
        return theta.clone()
    return theta.index_put((torch.cat(index).to(theta.device),), torch.cat(values))


def reparametrize(
    model: nn.Module,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    space: ParameterSpace | None = None,
) -> nn.Module:
    """A copy of ``model`` with a random symmetry applied: same function, other weights.

    Every GL block gets a random ``A = scale·N(0,1)^{h×h}`` per head (well-conditioned, see
    :func:`random_group_elements`), every diagonal pair a random ``α``. The input model is not
    modified.

    Args:
        model: The model.
        generator: CPU random generator for reproducibility.
        scale: Scale ``a`` of the group element (the paper sweeps ``a ∈ [1e-2, 1e2]``).
        space: Its :class:`ParameterSpace` (default: ``find_symmetries(model)``).

    Returns:
        A deep copy of ``model`` with transformed parameters.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> mha = nn.MultiheadAttention(8, num_heads=2, batch_first=True).double().eval()
        >>> x = torch.randn(1, 5, 8, dtype=torch.float64)
        >>> twin = reparametrize(mha, scale=10.0)
        >>> torch.allclose(mha(x, x, x)[0], twin(x, x, x)[0], atol=1e-10)
        True
        >>> torch.allclose(mha.in_proj_weight, twin.in_proj_weight)
        False
    """
    if space is None:
        space = find_symmetries(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        theta = space.flatten_module(twin)
        element = random_group_elements(
            space, generator=generator, scale=scale, dtype=theta.dtype, device=theta.device
        )
        space.write_to(twin, group_action(space, theta, element))
    return twin
