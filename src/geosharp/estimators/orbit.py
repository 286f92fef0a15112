r"""The position of a GL(h) block ``(G, H)`` on its orbit (SPEC §3.1, §4.1).

Gradient flow on a loss that sees only ``G Hᵀ`` conserves ``D = GᵀG − HᵀH``
(``d/dt GᵀG = d/dt HᵀH = −(Gᵀ E H + Hᵀ Eᵀ G)`` with ``E = ∂L/∂(G Hᵀ)``); an L2 penalty
``λ/2 (‖G‖² + ‖H‖²)`` adds ``−2λ D``, shrinking it towards the *balanced* point
``GᵀG = HᵀH``. Initialization and weight decay therefore set the orbit position that training
returns. Per head:

* :func:`imbalance` ``= ‖GᵀG − HᵀH‖_F / ‖GᵀG + HᵀH‖_F`` ∈ [0, 1] (0: balanced; → 1 when one
  factor dominates);
* :func:`log_scale` ``= ½ log(‖G‖_F / ‖H‖_F)``, signed: ``log s`` more after ``(sG, H/s)``;
* :func:`orbit_min_norm_sq` — the smallest squared norm on the orbit,
  ``min_{A ∈ GL(h)} ‖G A⁻¹‖²_F + ‖H Aᵀ‖²_F``, and :func:`norm_excess`, the relative excess
  ``(‖G‖² + ‖H‖²) / min − 1 ≥ 0`` of the current representative.

*Derivation of the minimum.* With ``M_G = GᵀG``, ``M_H = HᵀH`` and ``X = AᵀA`` (SPD),
``‖G A⁻¹‖² = tr(A⁻ᵀ M_G A⁻¹) = tr(M_G X⁻¹)`` and ``‖H Aᵀ‖² = tr(A M_H Aᵀ) = tr(M_H X)``, so the
problem is ``min_{X ≻ 0} f(X) = tr(M_G X⁻¹) + tr(M_H X)``, a convex function of X
(``X ↦ tr(M X⁻¹)`` is convex on SPD matrices for ``M ⪰ 0``). Its gradient vanishes where
``−X⁻¹ M_G X⁻¹ + M_H = 0``, i.e. ``X M_H X = M_G``, solved (for full-rank blocks) by the
geometric mean ``X* = M_H^{−1/2} (M_H^{1/2} M_G M_H^{1/2})^{1/2} M_H^{−1/2}``. There
``M_G X*⁻¹ = X* M_H``, so both terms are equal and

.. code-block:: text

    min = 2 tr(M_H X*) = 2 tr((M_H^{1/2} M_G M_H^{1/2})^{1/2})
        = 2 tr((M_G^{1/2} M_H M_G^{1/2})^{1/2}) = 2 Σ_i √λ_i,
    λ_i = eigenvalues of (GᵀG)(HᵀH)  (= σ_i(G Hᵀ)²).

(The two symmetric matrices are similar to ``M_G M_H`` and ``M_H M_G``, which have the same
eigenvalues, the squared singular values of ``G Hᵀ``: the minimum is twice the nuclear norm of
the product, the classic variational form of ``‖·‖_*``.) At the minimizer
``A* = X*^{1/2}``, ``(G A*⁻¹)ᵀ(G A*⁻¹) = A*⁻¹ M_G A*⁻¹ = A* M_H A* = (H A*)ᵀ(H A*)``: the
minimum-norm point is the balanced one (:func:`balanced_point`), and ``‖G‖² + ‖H‖² ≥ 2 Σ√λ_i``
is an AM–GM inequality, with equality iff balanced. The infimum formula holds for rank-deficient
blocks too (then it may not be attained).

:func:`geosharp.estimators.diagnostics.balance` applies them to every head of a model.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "balanced_point",
    "imbalance",
    "log_scale",
    "norm_excess",
    "orbit_min_norm_sq",
]


def _check_pair(G: Tensor, H: Tensor) -> None:
    if G.dim() < 2 or H.dim() < 2 or G.shape[:-2] != H.shape[:-2] or G.shape[-1] != H.shape[-1]:
        raise ValueError(
            f"G (..., n, h) and H (..., m, h) must share leading dims and h; got shapes "
            f"{tuple(G.shape)} and {tuple(H.shape)}"
        )


def _wide(*ts: Tensor) -> tuple[Tensor, ...]:
    dtype = torch.promote_types(ts[0].dtype, torch.float64)
    return tuple(t.to(dtype) for t in ts)


def imbalance(G: Tensor, H: Tensor) -> Tensor:
    """``‖GᵀG − HᵀH‖_F / ‖GᵀG + HᵀH‖_F`` per block (float64).

    Args:
        G: ``(..., n, h)``.
        H: ``(..., m, h)``, same leading dimensions and ``h``.

    Returns:
        One value in ``[0, 1]`` per leading index (0 at a balanced point; NaN if both are 0).

    Example:
        >>> G = torch.eye(3, 2, dtype=torch.float64)
        >>> float(imbalance(G, G)), round(float(imbalance(2 * G, G / 2)), 4)  # (4 − 1/4)/(4 + 1/4)
        (0.0, 0.8824)
    """
    _check_pair(G, H)
    G, H = _wide(G, H)
    MG, MH = G.mT @ G, H.mT @ H
    return torch.linalg.matrix_norm(MG - MH) / torch.linalg.matrix_norm(MG + MH)


def log_scale(G: Tensor, H: Tensor) -> Tensor:
    """``½ log(‖G‖_F / ‖H‖_F)`` per block (float64), signed.

    ``(sG, H/s)`` adds ``log s``: a pair with ``‖G‖ = ‖H‖`` rescaled by s has ``log_scale = log s``.

    Example:
        >>> import math
        >>> G = torch.eye(3, 2, dtype=torch.float64)
        >>> round(float(log_scale(4 * G, G / 4)), 6) == round(math.log(4), 6)
        True
    """
    _check_pair(G, H)
    G, H = _wide(G, H)
    return 0.25 * torch.log(G.square().sum((-2, -1)) / H.square().sum((-2, -1)))


def _psd_sqrt(M: Tensor) -> Tensor:
    lam, U = torch.linalg.eigh(M)
    return (U * lam.clamp_min(0).sqrt().unsqueeze(-2)) @ U.mT


def _product_eigenvalues(G: Tensor, H: Tensor) -> Tensor:
    """Eigenvalues ``λ_i ≥ 0`` of ``(GᵀG)(HᵀH)``, from the similar ``M_G^{1/2} M_H M_G^{1/2}``."""
    G, H = _wide(G, H)
    R = _psd_sqrt(G.mT @ G)
    return torch.linalg.eigvalsh(R @ (H.mT @ H) @ R).clamp_min(0)


def orbit_min_norm_sq(G: Tensor, H: Tensor) -> Tensor:
    """``min_{A ∈ GL(h)} ‖G A⁻¹‖²_F + ‖H Aᵀ‖²_F = 2 Σ_i √λ_i((GᵀG)(HᵀH))`` (float64).

    The closed form is derived in the module docstring; it equals ``2 ‖G Hᵀ‖_*``.

    Args:
        G: ``(..., n, h)``.
        H: ``(..., m, h)``.

    Returns:
        One value per leading index.
    """
    _check_pair(G, H)
    return 2.0 * _product_eigenvalues(G, H).sqrt().sum(-1)


def norm_excess(G: Tensor, H: Tensor) -> Tensor:
    """Relative norm excess over the orbit's minimum, ``(‖G‖² + ‖H‖²) / min − 1 ≥ 0``.

    0 exactly at the balanced (minimum-norm) point of the orbit; ``(s² + s⁻²)/2 − 1`` after
    ``(sG, H/s)`` of a balanced pair.

    Example:
        >>> G = torch.eye(3, 2, dtype=torch.float64)
        >>> float(norm_excess(G, G)), float(norm_excess(2 * G, G / 2))  # (4 + 1/4)/2 − 1
        (0.0, 1.125)
    """
    _check_pair(G, H)
    Gw, Hw = _wide(G, H)
    total = Gw.square().sum((-2, -1)) + Hw.square().sum((-2, -1))
    return total / orbit_min_norm_sq(G, H) - 1.0


def balanced_point(G: Tensor, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The minimum-norm point ``(G A⁻¹, H Aᵀ)`` of the orbit of a full-rank block, and ``A``.

    ``A = X^{1/2}`` with ``X = M_H^{−1/2} (M_H^{1/2} M_G M_H^{1/2})^{1/2} M_H^{−1/2}`` (module
    docstring); the result is balanced, ``(GA⁻¹)ᵀ(GA⁻¹) = (HAᵀ)ᵀ(HAᵀ)``, with the same product
    ``G Hᵀ``. Computed in float64.

    Returns:
        ``(G*, H*, A)``.
    """
    _check_pair(G, H)
    G, H = _wide(G, H)
    MG, MH = G.mT @ G, H.mT @ H
    lam, U = torch.linalg.eigh(MH)
    s = lam.sqrt().unsqueeze(-2)
    MH_half, MH_ihalf = (U * s) @ U.mT, (U / s) @ U.mT
    X = MH_ihalf @ _psd_sqrt(MH_half @ MG @ MH_half) @ MH_ihalf
    A = _psd_sqrt(0.5 * (X + X.mT))
    return torch.linalg.solve(A, G, left=False), H @ A.mT, A
