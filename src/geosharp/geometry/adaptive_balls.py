"""The adaptive balls of the element-wise baselines: ``‖ξ ⊘ |w|‖₂ ≤ ρ`` and ``|ξ_i| ≤ ρ|w_i|``.

Adaptive ℓ2 and ℓ∞ sharpness (Kwon et al. 2021; Andriushchenko et al. 2023) measure ξ relative to
each weight; coordinates with ``w_i = 0`` are frozen (radius 0). The metric itself is
:class:`~geosharp.geometry.elementwise.ElementwiseGeometry`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geosharp.geometry._validate import check_like, check_tensor

__all__ = ["adaptive_norm", "linf_norm", "project_l2_ball", "project_linf_ball"]


def adaptive_norm(w: Tensor, xi: Tensor, p: float = 2.0) -> Tensor:
    """``‖ξ ⊘ |w|‖_p`` over the non-frozen coordinates (``w_i ≠ 0``).

    Args:
        w: Weights.
        xi: Perturbation, shaped like ``w``.
        p: ``2`` or ``float("inf")``.

    Returns:
        A 0-dim tensor.

    Raises:
        ValueError: If ``p`` is not 2 or inf.
    """
    check_tensor("w", w)
    check_like("xi", xi, "w", w)
    mask = w != 0
    r = torch.where(mask, xi / torch.where(mask, w, torch.ones_like(w)), torch.zeros_like(xi))
    if p == 2:
        return r.square().sum().sqrt()
    if p == float("inf"):
        return r.abs().max() if r.numel() else r.sum()
    raise ValueError(f"p must be 2 or inf, got {p!r}")


def linf_norm(w: Tensor, xi: Tensor) -> Tensor:
    """Adaptive ℓ∞ norm ``max_i |ξ_i| / |w_i|`` over non-frozen coordinates."""
    return adaptive_norm(w, xi, float("inf"))


def project_linf_ball(w: Tensor, xi: Tensor, rho: float) -> Tensor:
    """Euclidean projection onto the adaptive box ``|ξ_i| ≤ ρ |w_i|`` (a clamp; zeros frozen).

    Example:
        >>> import torch
        >>> w = torch.tensor([1.0, -2.0, 0.0])
        >>> project_linf_ball(w, torch.tensor([0.5, 0.5, 0.5]), rho=0.1).tolist()
        [0.10000000149011612, 0.20000000298023224, 0.0]
    """
    bound = rho * w.abs()
    return torch.maximum(torch.minimum(xi, bound), -bound)


def project_l2_ball(w: Tensor, xi: Tensor, rho: float) -> Tensor:
    """Metric projection onto the adaptive ball ``‖ξ ⊘ |w|‖₂ ≤ ρ`` (a radial rescale)."""
    xi = torch.where(w != 0, xi, torch.zeros_like(xi))
    n = adaptive_norm(w, xi, 2.0)
    return xi * torch.clamp(rho / n.clamp_min(torch.finfo(xi.dtype).tiny), max=1.0)
