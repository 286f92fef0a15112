"""A random equivalent model: same function, other weights (SPEC §3, §7).

:func:`reparametrize` applies a random element of the symmetry group
(:mod:`geosharp.symmetry.group`) to a copy of a model, which is how the paper shows that
adaptive sharpness changes under re-parametrization while geodesic sharpness does not.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from geosharp.symmetry.find import find_symmetries
from geosharp.symmetry.group import group_action, random_group_elements
from geosharp.symmetry.space import ParameterSpace

__all__ = ["reparametrize"]


def reparametrize(
    model: nn.Module,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    space: ParameterSpace | None = None,
) -> nn.Module:
    """A copy of ``model`` with a random symmetry applied: same function, other weights.

    Every block gets a random element of its group (well-conditioned, see
    :func:`random_group_elements`). The input model is not
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
