r"""Closed-form worst-case geodesic sharpness of a diagonal linear network (SPEC §5).

For the square loss ``L(β) = ‖Xβ − y‖²`` with ``XᵀX = I`` (so ``L = ‖β − β*‖² + const``,
``β* = Xᵀy``) and the diagonal net ``β = u ⊙ v``, the worst case over the geodesic ball of
radius ρ of :class:`~geosharp.geometry.diagonal.DiagonalGeometry` has closed forms. The mix
geodesic moves ``β`` to ``β + δ``, ``δ = 2b ⊙ β``, with ``‖δ‖ ≤ √2ρ``: the maximum is
``2√2ρ‖β − β*‖ + 2ρ²`` (:func:`closed_form_sharpness_mix`). The inv geodesic moves it to
``β ⊙ e^{2b}`` with ``2‖b‖² ≤ ρ²``: :func:`closed_form_sharpness_inv` solves the Lagrange
conditions coordinate by coordinate for each multiplier. :func:`two_regime_sharpness_inv` is the
paper's two-regime approximation of the inv value. They are the ground truth of the sharpness
estimators' tests; they take NumPy arrays or tensors and compute in float64 NumPy.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike
from torch import Tensor

__all__ = ["closed_form_sharpness_inv", "closed_form_sharpness_mix", "two_regime_sharpness_inv"]


def _as_vector(name: str, x: ArrayLike | Tensor) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (found inf or nan)")
    return arr


def _sharpness_args(
    beta: ArrayLike | Tensor, beta_star: ArrayLike | Tensor, rho: float
) -> tuple[np.ndarray, np.ndarray, float]:
    b = _as_vector("beta", beta)
    bs = _as_vector("beta_star", beta_star)
    if b.shape != bs.shape:
        raise ValueError(f"beta and beta_star must have the same shape, got {b.shape}, {bs.shape}")
    if isinstance(rho, bool) or not isinstance(rho, (int, float, np.floating, np.integer)):
        raise TypeError(f"rho must be a float >= 0, got {type(rho).__name__}")
    rho = float(rho)
    if not (rho >= 0.0 and math.isfinite(rho)):
        raise ValueError(f"rho must be a finite float >= 0, got {rho}")
    return b, bs, rho


def closed_form_sharpness_mix(
    beta: ArrayLike | Tensor, beta_star: ArrayLike | Tensor, rho: float
) -> float:
    r"""Exact mix geodesic sharpness of ``L(β) = ‖Xβ − y‖²`` with ``XᵀX = I`` (SPEC §5).

    With ``β* = Xᵀy`` the loss is ``‖β − β*‖² + const``. A horizontal ``ξ = (u b, v b)`` has
    ``‖ξ‖²_mix = 2 Σ b² β²`` and moves ``β`` to ``β + δ``, ``δ = 2 b ⊙ β`` along the exact mix
    geodesic, so the ball is ``‖δ‖₂ ≤ √2 ρ`` and

    .. code-block:: text

        max_{‖δ‖ ≤ √2ρ} ‖β + δ − β*‖² − ‖β − β*‖² = 2√2 ρ ‖β − β*‖₂ + 2ρ².

    Coordinates with ``β_i = 0`` cannot move (``δ_i = 2b_iβ_i = 0``) and are left out of the
    norm (at ``ε = 0`` the geometry is singular there anyway); if every ``β_i = 0`` the value is
    0. The maximiser ``δ = √2ρ (β − β*)/‖β − β*‖`` may need ``1 + 2b_i = 1 + δ_i/β_i ≤ 0``: the
    straight line in ``β`` then crosses ``β_i = 0``, which the mix geodesic does too (see
    :meth:`DiagonalGeometry.geodesic`), so the formula holds for every ``ρ``.

    Args:
        beta: Current ``β = u ⊙ v`` (numpy array, tensor or sequence; any shape).
        beta_star: Least-squares solution ``β* = Xᵀy``, same shape.
        rho: Radius ``ρ ≥ 0`` of the ball in the mix norm.

    Returns:
        The sharpness ``max_ξ L(γ_ξ(1)) − L(β)`` as a python float.

    Raises:
        TypeError: If ``rho`` is not a number.
        ValueError: On shape mismatch, non-finite input or ``rho < 0``.

    Example:
        >>> round(closed_form_sharpness_mix([1.0, 2.0, -1.0], [1.0, 2.0, -1.0], 0.1), 12)
        0.02
        >>> round(closed_form_sharpness_mix([3.0, 0.5], [0.0, 0.5], 0.1), 6)  # 2√2·0.1·3 + 0.02
        0.868528
    """
    beta, beta_star, rho = _sharpness_args(beta, beta_star, rho)
    moving = beta != 0
    if rho == 0.0 or not moving.any():
        return 0.0
    diff = np.where(moving, beta - beta_star, 0.0)
    dist = float(np.linalg.norm(diff))
    return 2.0 * math.sqrt(2.0) * rho * dist + 2.0 * rho * rho


def two_regime_sharpness_inv(
    beta: ArrayLike | Tensor, beta_star: ArrayLike | Tensor, rho: float
) -> float:
    r"""The paper's two-regime approximation of the inv sharpness (SPEC §5).

    ``S_inv ≈ 4ρ′‖r‖₂ + 4ρ′² max_i β_i²`` with ``ρ′ = ρ/√2`` and ``r = β ⊙ (β − β*)``. The exact
    value has the Taylor form ``max_{‖b‖ ≤ ρ′} 4bᵀr + 4bᵀDb + O(ρ′³)``,
    ``D = diag(β ⊙ (2β − β*))``. When ``r ≠ 0`` the first term is exact to first order
    (``S_inv = 4ρ′‖r‖ + O(ρ′²)``); at an interpolating minimum (``r = 0``, ``β = β*`` on the
    support, so ``D = diag(β²)``) the second term is exact to second order
    (``S_inv = 4ρ′² max β² + O(ρ′³)``). Elsewhere it is only a heuristic; use
    :func:`closed_form_sharpness_inv` for the exact value.

    Args:
        beta: Current ``β = u ⊙ v``.
        beta_star: ``β* = Xᵀy``, same shape.
        rho: Radius ``ρ ≥ 0`` of the ball in the inv norm.

    Returns:
        The approximation as a python float.

    Raises:
        TypeError: If ``rho`` is not a number.
        ValueError: On shape mismatch, non-finite input or ``rho < 0``.

    Example:
        >>> round(two_regime_sharpness_inv([1.0, 2.0], [1.0, 2.0], 0.1), 12)  # 4·0.005·4
        0.08
    """
    beta, beta_star, rho = _sharpness_args(beta, beta_star, rho)
    if beta.size == 0:
        return 0.0
    rho_p = rho / math.sqrt(2.0)
    r = beta * (beta - beta_star)
    return 4.0 * rho_p * float(np.linalg.norm(r)) + 4.0 * rho_p**2 * float(np.max(beta**2))


# -- exact inv sharpness -------------------------------------------------------------------------
# Per coordinate, with p = β², q = β β*, rr = β (β − β*) = p − q and m = e^{2b} − 1:
#   f(b)   = p (e^{4b} − 1) − 2q (e^{2b} − 1) = p m² + 2 rr m
#   f'(b)  = 4 e^{2b} (p m + rr)
#   f''(b) = 8 e^{2b} (p e^{2b} + p m + rr)
def _f(p: np.ndarray, rr: np.ndarray, b: np.ndarray) -> np.ndarray:
    m = np.expm1(2.0 * b)
    return p * m * m + 2.0 * rr * m


def _fp(p: np.ndarray, rr: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 4.0 * np.exp(2.0 * b) * (p * np.expm1(2.0 * b) + rr)


def _fpp(p: np.ndarray, rr: np.ndarray, b: np.ndarray) -> np.ndarray:
    y = np.exp(2.0 * b)
    return 8.0 * y * (p * y + p * np.expm1(2.0 * b) + rr)


def _left_branch(
    p: np.ndarray, rr: np.ndarray, q: np.ndarray, mu: np.ndarray, radius: float
) -> np.ndarray:
    """Left stationary point of ``g(b) = f(b) − μ b²`` inside ``[−radius, radius]`` (or NaN).

    ``g''(b) = 16 p y² − 8 q y − 2μ`` (``y = e^{2b}``) changes sign once, at ``y_infl``, so ``g'``
    is decreasing then increasing and ``g`` has at most one local maximum: the root of ``g'`` on
    ``(−∞, b_infl]``. It is found by safeguarded Newton on the bracket
    ``[−radius, min(b_infl, radius)]``; NaN where it lies outside the ball or does not exist.
    ``p``, ``rr``, ``q`` broadcast against ``mu`` (``μ > 0``).
    """
    p, rr, q, mu = np.broadcast_arrays(p, rr, q, mu)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.sqrt(q * q + 2.0 * p * mu)
        # Roots of 16py² − 8qy − 2μ: y = (q + s)/(4p), written without cancellation for q < 0.
        y_infl = np.where(q >= 0, (q + s) / (4.0 * p), mu / (2.0 * (s - q)))
        y_infl = np.where(p > 0, y_infl, np.inf)
        b_infl = 0.5 * np.log(y_infl)
    lo = np.full(p.shape, -radius)
    hi = np.minimum(b_infl, radius)

    def gp(b: np.ndarray) -> np.ndarray:
        return _fp(p, rr, b) - 2.0 * mu * b

    with np.errstate(over="ignore", invalid="ignore"):
        ok = (hi >= lo) & (gp(lo) >= 0) & (gp(hi) <= 0)
    lo = np.where(ok, lo, 0.0)
    hi = np.where(ok, hi, 0.0)
    x = 0.5 * (lo + hi)
    tiny = np.finfo(np.float64).tiny
    for _ in range(200):
        g1 = gp(x)
        g2 = _fpp(p, rr, x) - 2.0 * mu
        lo = np.where(g1 >= 0, x, lo)
        hi = np.where(g1 <= 0, x, hi)
        with np.errstate(divide="ignore", invalid="ignore"):
            newton = x - g1 / g2
        inside = (g2 < 0) & (newton > lo) & (newton < hi)
        x_new = np.where(inside, newton, 0.5 * (lo + hi))
        x_new = np.where(g1 == 0, x, x_new)
        step = np.abs(x_new - x)
        x = x_new
        if np.all((step <= 4.0 * np.finfo(np.float64).eps * np.abs(x) + tiny) | (hi - lo <= tiny)):
            break
    return np.where(ok, x, np.nan)


def _special_values(
    bl: np.ndarray, p: np.ndarray, rr: np.ndarray, radius: float
) -> tuple[np.ndarray, np.ndarray]:
    """``Φ_j,±`` for every row of ``bl`` (one ``μ`` each) and every special coordinate ``j``.

    All coordinates but ``j`` sit at their left branch ``bl`` (NaN: not allowed), coordinate
    ``j`` takes the remaining budget ``b_j = ±√(radius² − Σ_{i≠j} b_i²)``. Returns the values,
    shape ``(2, K, d)`` (``−inf`` where infeasible), and ``|b_j|``, shape ``(K, d)``.
    """
    ok = np.isfinite(bl)
    sq = np.where(ok, bl * bl, 0.0)
    fl = np.where(ok, _f(p, rr, np.where(ok, bl, 0.0)), 0.0)
    n_bad = np.sum(~ok, axis=-1, keepdims=True)
    others_sq = np.sum(sq, axis=-1, keepdims=True) - sq
    others_f = np.sum(fl, axis=-1, keepdims=True) - fl
    r2 = radius * radius
    valid = (n_bad - (~ok) == 0) & (others_sq <= r2 * (1.0 + 1e-12))
    bj = np.sqrt(np.clip(r2 - others_sq, 0.0, r2))
    vals = np.stack([others_f + _f(p, rr, bj), others_f + _f(p, rr, -bj)])
    return np.where(valid[None], vals, -np.inf), bj


def _assemble(bl_row: np.ndarray, j: int, bj: float) -> np.ndarray:
    b = np.where(np.isfinite(bl_row), bl_row, 0.0)
    b[j] = bj
    return b


def _solve_inv(beta: np.ndarray, beta_star: np.ndarray, radius: float) -> tuple[float, np.ndarray]:
    """Globally maximise ``Σ f_i(b_i)`` over ``‖b‖₂ ≤ radius`` (flat arrays, ``radius > 0``).

    KKT with a multiplier ``μ ≥ 0``: every ``b_i`` is a stationary point of
    ``g_i = f_i − μ b²``, and the second-order condition on the sphere allows at most one
    coordinate ``j`` with ``g_j'' > 0``. All others therefore sit at their unique left branch
    (the local maximum of ``g_i``, :func:`_left_branch`), and ``j`` takes the remaining budget.
    So the maximum is ``max_{j, ±, μ} Φ_j,±(μ)``, a family of 1-D problems in ``μ``. Every
    ``Φ_j,±(μ)`` is the value of a feasible point, so maximising it over a dense log-grid of
    ``μ`` followed by zooming in on the best peaks, together with the exact ``μ`` at which all
    coordinates on their left branch fill the ball (bisection; the common case, certified
    globally optimal by weak duality) and the ``μ → ∞`` limit (all budget on one coordinate),
    yields the global maximum.
    """
    d = beta.size
    p = beta * beta
    q = beta * beta_star
    rr = beta * (beta - beta_star)
    best_val, best_b = 0.0, np.zeros(d)

    def consider(b: np.ndarray) -> None:
        nonlocal best_val, best_b
        nrm = float(np.linalg.norm(b))
        if nrm > radius:  # rounding of the assembled budget: pull back onto the ball
            b = b * (radius / nrm)
        val = float(np.sum(_f(p, rr, b)))
        if val > best_val:
            best_val, best_b = val, b

    # μ → ∞: the whole budget on one coordinate.
    for sign in (1.0, -1.0):
        vals = _f(p, rr, np.full(d, sign * radius))
        j = int(np.argmax(vals))
        b = np.zeros(d)
        b[j] = sign * radius
        consider(b)

    mu_scale = float(np.max(np.abs(_fp(p, rr, radius)) + np.abs(_fp(p, rr, -radius)))) / radius
    if not (mu_scale > 0 and math.isfinite(mu_scale)):
        return best_val, best_b
    log_mu = math.log(mu_scale) + np.linspace(-18.0, 12.0, 241) * math.log(10.0)
    bl = _left_branch(p[None], rr[None], q[None], np.exp(log_mu)[:, None], radius)

    # (a) All coordinates on the left branch, filling the ball: Σ b_L(μ)² is decreasing in μ.
    ok_all = np.all(np.isfinite(bl), axis=1)
    tot = np.where(ok_all, np.sum(np.where(ok_all[:, None], bl, 0.0) ** 2, axis=1), np.inf)
    r2 = radius * radius
    ks = np.nonzero((tot[:-1] >= r2) & (tot[1:] <= r2) & np.isfinite(tot[1:]))[0]
    if ks.size:
        lo, hi = log_mu[ks].copy(), log_mu[ks + 1].copy()
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            row = _left_branch(p[None], rr[None], q[None], np.exp(mid)[:, None], radius)
            row_ok = np.all(np.isfinite(row), axis=1)
            big = ~row_ok | (np.sum(np.where(np.isfinite(row), row, 0.0) ** 2, axis=1) > r2)
            lo = np.where(big, mid, lo)
            hi = np.where(big, hi, mid)
            if np.all(hi - lo <= 4 * np.finfo(np.float64).eps * np.abs(hi)):
                break
        rows = _left_branch(p[None], rr[None], q[None], np.exp(hi)[:, None], radius)
        for row in rows:
            if np.all(np.isfinite(row)):
                consider(row)

    # (b) One special coordinate: grid over μ, then zoom in on the best peaks.
    phi, _ = _special_values(bl, p, rr, radius)
    peak = np.isfinite(phi)
    peak[:, 1:] &= phi[:, 1:] >= phi[:, :-1]
    peak[:, :-1] &= phi[:, :-1] >= phi[:, 1:]
    flat = np.where(peak, phi, -np.inf).ravel()
    n_top = min(8, int(np.sum(np.isfinite(flat))))
    if n_top == 0:
        return best_val, best_b
    top = np.argpartition(-flat, n_top - 1)[:n_top]
    s_idx, k_idx, j_idx = np.unravel_index(top, phi.shape)
    n_top, n_zoom = len(top), 17
    step = log_mu[1] - log_mu[0]
    lo = log_mu[k_idx] - step
    hi = log_mu[k_idx] + step
    cand = np.arange(n_top)
    for _ in range(12):
        grid = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, n_zoom)[None]
        rows = _left_branch(p[None], rr[None], q[None], np.exp(grid.ravel())[:, None], radius)
        vals, _ = _special_values(rows, p, rr, radius)
        vals = vals.reshape(2, n_top, n_zoom, d)[s_idx, cand, :, j_idx]  # (n_top, n_zoom)
        k_best = np.argmax(vals, axis=1)
        width = (hi - lo) / (n_zoom - 1)
        centre = grid[cand, k_best]
        lo, hi = centre - width, centre + width
    rows = _left_branch(p[None], rr[None], q[None], np.exp(centre)[:, None], radius)
    _, bj = _special_values(rows, p, rr, radius)
    for c in range(n_top):
        j = int(j_idx[c])
        sign = 1.0 if s_idx[c] == 0 else -1.0
        others_ok = np.all(np.isfinite(np.delete(rows[c], j)))
        if others_ok:
            consider(_assemble(rows[c], j, sign * float(bj[c, j])))
    return best_val, best_b


def closed_form_sharpness_inv(
    beta: ArrayLike | Tensor,
    beta_star: ArrayLike | Tensor,
    rho: float,
    return_b: bool = False,
) -> float | tuple[float, np.ndarray]:
    r"""Exact inv geodesic sharpness of ``L(β) = ‖Xβ − y‖²`` with ``XᵀX = I`` (SPEC §5).

    A horizontal ``ξ = (u b, v b)`` has ``‖ξ‖²_inv = 2‖b‖²`` and the exact inv geodesic moves
    ``β`` to ``β ⊙ e^{2b}``, so with ``ρ′ = ρ/√2``

    .. code-block:: text

        S_inv = max_{‖b‖₂ ≤ ρ′} Σ_i f_i(b_i),
        f_i(b) = β_i² (e^{4b} − 1) − 2 β*_i β_i (e^{2b} − 1) = β_i² m² + 2 r_i m,
        m = e^{2b} − 1,  r = β ⊙ (β − β*).

    The problem is separable with one quadratic constraint, but not concave, so plain Lagrangian
    bisection can leave a duality gap (e.g. two equal coordinates at an interpolating minimum,
    where the optimum puts the whole budget on one of them). It is solved exactly from the KKT
    conditions: for a multiplier ``μ ≥ 0`` each ``b_i`` is stationary for ``f_i(b) − μ b²``,
    a function with at most one local maximum, and the second-order condition on the sphere
    allows at most one coordinate elsewhere. The search runs over ``μ`` (a log-grid, zoom-in on
    the peaks, and bisection for the common case where every coordinate is at its local
    maximum — there the answer is certified by weak duality), vectorised over coordinates with
    numpy; ``d = 200`` takes a fraction of a second. Every candidate is a feasible point, so the
    result is a lower bound that is tight to near machine precision. Coordinates with
    ``β_i = 0`` cannot move (``f_i ≡ 0``).

    Args:
        beta: Current ``β = u ⊙ v`` (numpy array, tensor or sequence; any shape).
        beta_star: ``β* = Xᵀy``, same shape.
        rho: Radius ``ρ ≥ 0`` of the ball in the inv norm.
        return_b: Also return the maximiser ``b`` (shaped like ``beta``), i.e. the horizontal
            velocity ``ξ = (u ⊙ b, v ⊙ b)``.

    Returns:
        ``S_inv`` as a python float, or ``(S_inv, b)`` if ``return_b``.

    Raises:
        TypeError: If ``rho`` is not a number.
        ValueError: On shape mismatch, non-finite input, ``rho < 0`` or ``rho ≥ 247`` (overflow).

    Example:
        At an interpolating minimum the whole budget goes to the largest ``|β_i|``:

        >>> s, b = closed_form_sharpness_inv([1.0, 2.0], [1.0, 2.0], 0.1, return_b=True)
        >>> round(s, 12), round(4 * (math.exp(2 * 0.1 / math.sqrt(2)) - 1) ** 2, 12)
        (0.09230648323, 0.09230648323)
        >>> [round(float(x), 6) for x in b]  # b = (0, ρ/√2)
        [0.0, 0.070711]
    """
    beta_arr, beta_star_arr, rho = _sharpness_args(beta, beta_star, rho)
    shape = beta_arr.shape
    radius = rho / math.sqrt(2.0)
    if 4.0 * radius > 700.0:
        raise ValueError(
            f"rho={rho} is too large: β e^{{2b}} with |b| up to rho/√2 overflows float64 "
            f"(the loss rise exceeds 1e300); use rho < 247"
        )
    if radius == 0.0 or beta_arr.size == 0:
        value, b = 0.0, np.zeros(beta_arr.size)
    else:
        value, b = _solve_inv(beta_arr.ravel(), beta_star_arr.ravel(), radius)
    if return_b:
        return value, b.reshape(shape)
    return value
