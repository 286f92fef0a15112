r"""Where on its orbit a trained model sits, and where sharpness spends its budget (issue 14).

Two kinds of diagnostics, both cheap next to a sharpness measurement:

**Orbit position of a GL(h) block** ``(G, H)`` (SPEC §3.1, §4.1). Gradient flow on a loss that
sees only ``G Hᵀ`` conserves ``D = GᵀG − HᵀH`` (``d/dt GᵀG = d/dt HᵀH = −(Gᵀ E H + Hᵀ Eᵀ G)``
with ``E = ∂L/∂(G Hᵀ)``); an L2 penalty ``λ/2 (‖G‖² + ‖H‖²)`` adds ``−2λ D``, shrinking it
towards the *balanced* point ``GᵀG = HᵀH``. Initialization and weight decay therefore set the
orbit position that training returns. Per head:

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

:func:`balance` applies these to every head of every GL-type block of a model (QK, VO, LoRA;
rotary blocks get the imbalance only: their orbit is that of a subgroup, over which the GL(h)
minimum is only a lower bound).

**Where the worst-case perturbation goes** (SPEC §5.3, §6). The ball ``‖ξ‖ ≤ ρ`` is one budget
shared by all pieces of a :class:`~geosharp.estimators.perturbation.Perturbation`.
:func:`ascent_diagnostics` re-runs the Auto-PGD ascent of :func:`geosharp.sharpness` exactly
(same start, schedule and arithmetic: its value is the same number) and, at the optimum ``ξ*``
of every batch, reports :func:`budget_split` — the share of ``‖ξ*‖²`` in each kind of block
(``"QK"``, ``"VO"``, ``"rotary"``, ``"LoRA"``, ``"b_k"``, ``"pair"``) and in the adaptive rest
(``"rest"``) — and :func:`order2_displacement`, how far the order-2 endpoint moves from the
straight line, ``‖½Γ(ξ*, ξ*)‖ / ‖ξ*‖`` in the ball's metric (``‖e₂(ξ) − e₁(ξ)‖``, SPEC §4.6).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.apgd import autopgd, best_direction_rule
from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.estimators.rows import BatchRows
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.blocks import GLBlock, RotaryBlock
from geosharp.symmetry.verify import call_model, eval_mode
from geosharp.symmetry.verify import to_device as _to_device

__all__ = [
    "AscentDiagnostics",
    "Balance",
    "HeadBalance",
    "ascent_diagnostics",
    "balance",
    "balanced_point",
    "budget_split",
    "imbalance",
    "log_scale",
    "norm_excess",
    "orbit_min_norm_sq",
    "order2_displacement",
    "summary_row",
]


# ---------------------------------------------------------------------------------------------
# one block (G, H), batched over leading dimensions
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# every head of a model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadBalance:
    """The orbit position of one head of one GL-type block.

    Attributes:
        block: Block name, e.g. ``"blocks.0.attn[QK]"``.
        category: :attr:`~geosharp.symmetry.SymmetryBlock.category` of the block.
        head: Head index within the block.
        imbalance: :func:`imbalance`.
        log_scale: :func:`log_scale`.
        norm_sq: ``‖G‖² + ‖H‖²``.
        min_norm_sq: :func:`orbit_min_norm_sq` (NaN for rotary blocks).
        excess: :func:`norm_excess` (NaN for rotary blocks).
        diff_sq: ``‖GᵀG − HᵀH‖²_F``.
        sum_sq: ``‖GᵀG + HᵀH‖²_F``.
    """

    block: str
    category: str
    head: int
    imbalance: float
    log_scale: float
    norm_sq: float
    min_norm_sq: float
    excess: float
    diff_sq: float
    sum_sq: float


@dataclass
class Balance:
    """:func:`balance` of a model: every head, and aggregates per category."""

    heads: list[HeadBalance] = field(default_factory=list)

    def categories(self) -> list[str]:
        """The block categories present, in first-seen order."""
        return list(dict.fromkeys(h.category for h in self.heads))

    def aggregate(self, category: str | None = None) -> dict[str, float]:
        """Model-level values over the heads of ``category`` (``None``: all heads).

        Returns:
            ``imbalance`` = ``√(Σ‖GᵀG − HᵀH‖²) / √(Σ‖GᵀG + HᵀH‖²)`` over heads, ``excess`` =
            ``Σ(‖G‖² + ‖H‖²) / Σ min − 1`` (the excess of the whole set of blocks over its
            orbit minimum, heads with a defined minimum only), ``log_scale`` and
            ``median_imbalance`` over heads, ``heads``.
        """
        hs = [h for h in self.heads if category is None or h.category == category]
        if not hs:
            return {
                "imbalance": math.nan,
                "excess": math.nan,
                "log_scale": math.nan,
                "median_imbalance": math.nan,
                "heads": 0,
            }
        with_min = [h for h in hs if math.isfinite(h.min_norm_sq)]
        excess = (
            sum(h.norm_sq for h in with_min) / sum(h.min_norm_sq for h in with_min) - 1.0
            if with_min
            else math.nan
        )
        imb = sorted(h.imbalance for h in hs)
        k = len(imb)
        median = imb[k // 2] if k % 2 else 0.5 * (imb[k // 2 - 1] + imb[k // 2])
        return {
            "imbalance": math.sqrt(sum(h.diff_sq for h in hs) / sum(h.sum_sq for h in hs)),
            "excess": excess,
            "log_scale": sum(h.log_scale for h in hs) / len(hs),
            "median_imbalance": median,
            "heads": len(hs),
        }


def balance(
    model: nn.Module | None = None,
    *,
    space: ParameterSpace | None = None,
    theta: Tensor | None = None,
    key_bias: str = "quotient",
) -> Balance:
    """The orbit position of every head of every GL-type block of a model.

    Args:
        model: The model (its trainable parameters are read, never written).
        space: A precomputed :func:`geosharp.find_symmetries` result (default: found here with
            ``key_bias``).
        theta: The flat parameters of ``space`` (default: read from ``model``).
        key_bias: ``"quotient"`` (the key bias is not part of ``H_QK``) or ``"keep"`` (it is).

    Returns:
        A :class:`Balance`.

    Raises:
        ValueError: If neither a model nor ``space`` and ``theta`` are given.
    """
    if space is None:
        if model is None:
            raise ValueError("pass a model, or space and theta")
        space = find_symmetries(model, key_bias=key_bias)
    if theta is None:
        if model is None:
            raise ValueError("theta is needed when no model is given")
        theta = space.flatten_module(model)
    theta = theta.detach()
    out = Balance()
    for block in space.blocks:
        if not isinstance(block, GLBlock):
            continue
        G, H = (t.to(torch.float64) for t in block.gather(theta))
        MG, MH = G.mT @ G, H.mT @ H
        diff = torch.linalg.matrix_norm(MG - MH).square()
        tot = torch.linalg.matrix_norm(MG + MH).square()
        nsq = G.square().sum((-2, -1)) + H.square().sum((-2, -1))
        ratio = log_scale(G, H)
        if isinstance(block, RotaryBlock):
            mins = torch.full_like(nsq, math.nan)
        else:
            mins = orbit_min_norm_sq(G, H)
        for i in range(G.shape[0]):
            out.heads.append(
                HeadBalance(
                    block=block.name,
                    category=block.category,
                    head=i,
                    imbalance=float((diff[i] / tot[i]).sqrt()),
                    log_scale=float(ratio[i]),
                    norm_sq=float(nsq[i]),
                    min_norm_sq=float(mins[i]),
                    excess=float(nsq[i] / mins[i] - 1.0),
                    diff_sq=float(diff[i]),
                    sum_sq=float(tot[i]),
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# the ascent optimum
# ---------------------------------------------------------------------------------------------
def _labels(space: ParameterSpace, device: torch.device) -> tuple[Tensor, list[str]]:
    """A category id per coordinate of ``θ`` and the category names (``"rest"`` last)."""
    names: list[str] = []
    labels = torch.full((space.numel(),), -1, dtype=torch.long, device=device)
    for block in space.blocks:
        cat = block.category
        if cat not in names:
            names.append(cat)
        labels[block.positions().to(device)] = names.index(cat)
    names.append("rest")
    labels[labels < 0] = len(names) - 1
    return labels, names


def budget_split(pert: Perturbation, xi: Xi) -> dict[str, float]:
    """``‖ξ‖²`` by block category, in the metric of the ball (SPEC §5.3).

    Element-wise pieces are split by coordinate (``ξ_i²/w_i²``), block geometries by head
    (their ``norm_sq`` per batch element), the key-bias point contributes 0.

    Args:
        pert: The perturbation set.
        xi: A perturbation (e.g. the Auto-PGD optimum).

    Returns:
        Category (:attr:`~geosharp.symmetry.SymmetryBlock.category` of the blocks, ``"rest"``
        for the coordinates in no block) → its part of ``‖ξ‖²``; the values sum to
        ``pert.norm_sq(xi)``.
    """
    device = pert.pieces[0].geometry.point[0].device
    labels, names = _labels(pert.space, device)
    total = torch.zeros(len(names), dtype=torch.float64, device=device)
    for piece, x in zip(pert.pieces, xi, strict=True):
        geom = piece.norm_geometry
        if geom.is_trivial:
            continue
        index = piece.index
        contrib = geom.coordinate_norm_sq(x)
        if contrib is not None:
            for c, idx in zip(contrib, index, strict=True):
                total.index_add_(0, labels[idx.reshape(-1)], c.reshape(-1).to(torch.float64))
            continue
        v = geom.norm_sq(x).to(torch.float64)
        first = index[0]
        if v.dim() > 0 and tuple(v.shape) == tuple(first.shape[: v.dim()]):
            heads = first.reshape(*v.shape, -1)[..., 0].reshape(-1)  # one position per head
            total.index_add_(0, labels[heads], v.reshape(-1))
        else:  # one value for the whole piece: it belongs to the category of its coordinates
            total[labels[first.reshape(-1)[0]]] += v.sum()
    return {name: float(total[i]) for i, name in enumerate(names)}


def order2_displacement(pert: Perturbation, xi: Xi) -> dict[str, float]:
    """How far the geodesic endpoint is from the straight line ``w + ξ`` (SPEC §4.6).

    Per piece, ``d = e(ξ) − (w + ξ)``: ``−½Γ(ξ, ξ)`` at order 2 (computed directly, in the
    tangent dtype), 0 at order 1, the RK4 endpoint minus the line for ``"exact"``; its norm is
    taken in the ball's metric.

    Returns:
        ``displacement`` = ``‖d‖``, ``norm`` = ``‖ξ‖``, ``norm_blocks`` = ``‖ξ‖`` restricted to
        the pieces that follow geodesics (order ≠ 1), ``relative`` = ``‖d‖/‖ξ‖`` and
        ``relative_blocks`` = ``‖d‖/‖ξ_blocks‖`` (NaN where a norm is 0).
    """
    disp_sq, blocks_sq = 0.0, 0.0
    for piece, x in zip(pert.pieces, xi, strict=True):
        if piece.order == 1 or piece.norm_geometry.is_trivial:
            continue
        if piece.order == 2:
            d = tuple(-0.5 * g for g in piece.geometry.christoffel(x))
        else:
            moved = piece.geometry.iterate_endpoint(x, order=piece.order, steps=pert.exact_steps)
            d = tuple(
                m.to(t.dtype) - p.to(t.dtype) - t
                for m, p, t in zip(moved, piece.geometry.point, x, strict=True)
            )
        disp_sq += float(piece.norm_geometry.norm_sq(d).sum())
        blocks_sq += float(piece.norm_geometry.norm_sq(x).sum())
    norm = pert.norm(xi)
    disp, nb = math.sqrt(max(disp_sq, 0.0)), math.sqrt(max(blocks_sq, 0.0))
    return {
        "displacement": disp,
        "norm": norm,
        "norm_blocks": nb,
        "relative": disp / norm if norm > 0 else math.nan,
        "relative_blocks": disp / nb if nb > 0 else math.nan,
    }


@dataclass
class AscentDiagnostics:
    """What :func:`ascent_diagnostics` found at the Auto-PGD optimum of every batch.

    Attributes:
        value: Mean over batches of ``ℓ_max − L_S(w)`` (the value of :func:`geosharp.sharpness`
            with the same settings).
        rho: The radius.
        budget: Category → share of ``‖ξ*‖²``, averaged over the batches whose optimum is not 0.
        radius_used: Mean ``‖ξ*‖ / ρ``.
        order2: Mean over batches of ``‖½Γ(ξ*, ξ*)‖ / ‖ξ*‖`` (whole perturbation).
        order2_blocks: The same relative to the block part ``‖ξ*_blocks‖`` only.
        per_batch: The per-batch values (budget squared norms, displacement, value).
    """

    value: float
    rho: float
    budget: dict[str, float]
    radius_used: float
    order2: float
    order2_blocks: float
    per_batch: list[dict[str, Any]] = field(default_factory=list)


def _objective(model: nn.Module, loss_fn: Any, pert: Perturbation, inputs: Any, targets: Any):
    """``ξ ↦ L_S(θ′(ξ))`` with its Euclidean gradient, as :func:`geosharp.sharpness` computes it."""

    def evaluate(params: Mapping[str, Tensor]) -> Tensor:
        return loss_fn(call_model(model, params, inputs), targets).reshape(())

    def f(xi: Xi, need_grad: bool | Callable[[float], bool]) -> tuple[float, Xi | None]:
        loss, grad = pert.loss_and_grad(evaluate, xi, need_grad)
        return float(loss), grad

    return f


def ascent_diagnostics(
    model: nn.Module,
    loss_fn: Any,
    batches: Iterable[tuple[Any, Any]],
    *,
    measure: str = "geodesic",
    metric: str = "inv",
    order: int | str = 2,
    rho: float = 0.1,
    steps: int = 20,
    eps: float = 0.0,
    corrected_norm: bool = True,
    exact_steps: int = 10,
    key_bias: str = "quotient",
    perturb: str = "all",
    space: ParameterSpace | None = None,
) -> AscentDiagnostics:
    """Re-run the worst-case ℓ2 ascent of :func:`geosharp.sharpness` and inspect its optimum.

    The ascent is the one of ``gs.sharpness(..., kind="worst", norm="l2")`` with the default
    start (ξ = 0, one run): the same :class:`~geosharp.estimators.perturbation.Perturbation`,
    :func:`~geosharp.estimators.apgd.autopgd` and objective, so ``value`` is the same number.

    Args:
        model: The model (eval mode during the ascent; parameters never written).
        loss_fn: ``loss_fn(outputs, targets)`` → scalar.
        batches: ``(inputs, targets)`` pairs.
        measure: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
        metric: Block metric of geodesic measures.
        order: Geodesic order of geodesic measures.
        rho: Radius.
        steps: Auto-PGD iterations.
        eps: Gram damping.
        corrected_norm: ``False``: the "no corrected norm" ablation.
        exact_steps: RK4 steps of ``order="exact"``.
        key_bias: ``"quotient"`` or ``"keep"`` (when ``space`` is not given).
        perturb: ``"all"`` or ``"blocks"`` (attention-only measures).
        space: A precomputed :func:`geosharp.find_symmetries` result.

    Returns:
        An :class:`AscentDiagnostics`.

    Raises:
        ValueError: On ``perturb="blocks"`` with the Euclidean measure, or without blocks.
    """
    space = space if space is not None else find_symmetries(model, key_bias=key_bias)
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    device = theta0.device
    if perturb == "blocks":
        if measure == "euclidean" or not space.blocks:
            raise ValueError(
                "perturb='blocks' needs symmetry blocks and a geodesic/adaptive measure"
            )
        pert_kw: dict[str, Any] = (
            {"measure": "geodesic", "metric": "adaptive", "order": 1}
            if measure == "adaptive"
            else {"measure": measure, "metric": metric, "order": order}
        )
    else:
        pert_kw = {"measure": measure, "metric": metric, "order": order}
    pert = Perturbation(
        space,
        theta0,
        eps=eps,
        corrected_norm=corrected_norm,
        exact_steps=exact_steps,
        perturb=perturb,
        **pert_kw,
    )
    rows: list[dict[str, Any]] = []
    with eval_mode(model):
        for batch in batches:
            inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
            f = _objective(model, loss_fn, pert, inputs, targets)
            with BatchRows(model, pert) as reached:  # as gs.sharpness: the rows reached
                clean, grad = f(pert.zeros(), True)
            cut, grad = reached.restrict(grad)
            fc = f if cut is pert else _objective(model, loss_fn, cut, inputs, targets)
            start, grad = [clean, grad], None  # emptied by autopgd: no reference held here
            res = autopgd(cut, fc, rho, steps, None, "l2", start, best_direction_rule(cut))
            best = max(res.best_loss, clean)
            xi = res.best_xi if res.best_loss > clean else cut.zeros()
            split = budget_split(cut, xi)
            disp = order2_displacement(cut, xi)
            rows.append({"value": best - clean, "budget": split, **disp})
            res = xi = None  # not alive through the next batch's ascent
    if not rows:
        raise ValueError("batches is empty")
    cats = list(rows[0]["budget"])
    moved = [r for r in rows if sum(r["budget"].values()) > 0]
    share = {
        c: (
            sum(r["budget"][c] / sum(r["budget"].values()) for r in moved) / len(moved)
            if moved
            else math.nan
        )
        for c in cats
    }

    def mean(key: str) -> float:
        vals = [r[key] for r in rows if math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else math.nan

    return AscentDiagnostics(
        value=sum(r["value"] for r in rows) / len(rows),
        rho=rho,
        budget=share,
        radius_used=sum(r["norm"] for r in rows) / len(rows) / rho,
        order2=mean("relative"),
        order2_blocks=mean("relative_blocks"),
        per_batch=rows,
    )


def summary_row(
    bal: Balance, ascents: Mapping[str, AscentDiagnostics] | None = None
) -> dict[str, float]:
    """One flat row of diagnostics for a model (for CSV files and report sections).

    Keys: ``imbalance_<cat>``, ``excess_<cat>``, ``log_ratio_<cat>`` per category of
    ``bal`` (and ``_all`` over every head), then for each named ascent ``<name>_share_<cat>``,
    ``<name>_radius_used``, ``<name>_order2``, ``<name>_order2_blocks``, ``<name>_value``.
    """
    row: dict[str, float] = {}
    for cat in [*bal.categories(), None]:
        agg = bal.aggregate(cat)
        key = cat or "all"
        row[f"imbalance_{key}"] = agg["imbalance"]
        row[f"excess_{key}"] = agg["excess"]
        row[f"log_ratio_{key}"] = agg["log_scale"]
    for name, a in (ascents or {}).items():
        for cat, v in a.budget.items():
            row[f"{name}_share_{cat}"] = v
        row[f"{name}_radius_used"] = a.radius_used
        row[f"{name}_order2"] = a.order2
        row[f"{name}_order2_blocks"] = a.order2_blocks
        row[f"{name}_value"] = a.value
    return row
