"""Input validation shared by the geometry modules (private).

Every public geometry function validates its arguments here so that a wrong call fails with a
message naming the argument and saying what to do, instead of a shape error deep inside a matmul.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

METRICS = ("inv", "mix")
ORDERS = (1, 2, "exact")


def check_tensor(name: str, t: Any) -> Tensor:
    """Require a floating-point tensor.

    Raises:
        TypeError: If ``t`` is not a tensor or not of a floating dtype.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float32/float64), got {t.dtype}; "
            f"convert it with {name}.double() or {name}.float()"
        )
    return t


def check_like(name: str, t: Any, ref_name: str, ref: Tensor, dtype: bool = True) -> Tensor:
    """Require a floating tensor with the same shape, dtype and device as ``ref``.

    With ``dtype=False`` the dtype is not compared (the caller checks it).

    Raises:
        TypeError: If ``t`` is not a floating tensor or its dtype differs from ``ref``'s.
        ValueError: If the shapes or devices differ.
    """
    check_tensor(name, t)
    if t.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name}, {tuple(ref.shape)}, got {tuple(t.shape)}"
        )
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    return t


def check_metric(metric: Any) -> str:
    """Require ``metric`` to be ``"inv"`` or ``"mix"``.

    Raises:
        ValueError: Otherwise.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    return metric


def check_order(order: Any) -> int | str:
    """Require a geodesic order in ``{1, 2, "exact"}``.

    Raises:
        ValueError: Otherwise.
    """
    if isinstance(order, bool) or order not in ORDERS:
        raise ValueError(f"order must be one of 1, 2, 'exact', got {order!r}")
    return order


def check_eps(eps: Any) -> float:
    """Require a finite damping ``eps >= 0``.

    Raises:
        TypeError: If ``eps`` is not a real number.
        ValueError: If ``eps`` is negative or not finite.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float >= 0, got {type(eps).__name__}")
    eps = float(eps)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    return eps


def check_steps(steps: Any) -> int:
    """Require a positive integer number of integration steps.

    Raises:
        ValueError: Otherwise.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    return steps


def singular_threshold(dtype: torch.dtype, size: int) -> float:
    """Relative eigenvalue threshold ``λ_min/λ_max`` below which a Gram matrix ``XᵀX`` is singular.

    ``X`` (of ``dtype``) is numerically rank-deficient when ``σ_min/σ_max ≤ size·eps`` (the
    usual matrix-rank tolerance); the Gram matrix, factorized in float64, cannot resolve ratios
    below ``10·size·eps₆₄`` either.
    """
    tol = size * torch.finfo(dtype).eps
    return max(tol * tol, 10.0 * size * torch.finfo(torch.float64).eps)
