r"""Where on its orbit a trained model sits, and where sharpness spends its budget.

Two kinds of diagnostics, both cheap next to a sharpness measurement:

**Orbit position of the GL-type blocks** (SPEC §3.1, §4.1). :func:`balance` applies the
measures of one block ``(G, H)`` of :mod:`geosharp.estimators.orbit` (imbalance, log-scale,
excess of the norm over the orbit's minimum) to every head of every GL-type block of a model
(QK, VO, LoRA; rotary blocks get the imbalance only: their orbit is that of a subgroup, over
which the GL(h) minimum is only a lower bound).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.harness import clean_start, objectives, perturbation_kwargs
from geosharp.estimators.orbit import log_scale, orbit_min_norm_sq
from geosharp.estimators.perturbation import Perturbation, Xi
from geosharp.estimators.sharded.check import check_unsharded
from geosharp.estimators.worst import ascent_from_zero
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.verify import eval_mode

__all__ = [
    "AscentDiagnostics",
    "AscentSettings",
    "Balance",
    "HeadBalance",
    "ascent_diagnostics",
    "balance",
    "budget_split",
    "order2_displacement",
    "summary_row",
]


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
        imbalance: :func:`~geosharp.estimators.orbit.imbalance`.
        log_scale: :func:`~geosharp.estimators.orbit.log_scale`.
        norm_sq: ``‖G‖² + ‖H‖²``.
        min_norm_sq: :func:`~geosharp.estimators.orbit.orbit_min_norm_sq` (NaN for rotary blocks).
        excess: :func:`~geosharp.estimators.orbit.norm_excess` (NaN for rotary blocks).
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
    if model is not None:
        check_unsharded(model, "geosharp.estimators.diagnostics.balance")
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
        if not block.gl_pairs:
            continue
        G, H = (t.to(torch.float64) for t in block.gather(theta))
        MG, MH = G.mT @ G, H.mT @ H
        diff = torch.linalg.matrix_norm(MG - MH).square()
        tot = torch.linalg.matrix_norm(MG + MH).square()
        nsq = G.square().sum((-2, -1)) + H.square().sum((-2, -1))
        ratio = log_scale(G, H)
        if block.whole_gl:
            mins = orbit_min_norm_sq(G, H)
        else:  # a subgroup's orbit: GL(h)'s least norm is not its own
            mins = torch.full_like(nsq, math.nan)
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
    """A category id per coordinate of ``θ`` and the category names (``"rest"`` last).

    One byte per coordinate (``int8``: a model has a handful of block categories), not the eight
    of an index tensor; the ids read for a piece are widened to ``long`` there.
    """
    names: list[str] = []
    labels = torch.full((space.numel(),), -1, dtype=torch.int8, device=device)
    for block in space.blocks:
        cat = block.category
        if cat not in names:
            if len(names) == 126:  # with "rest", 127 ids: the most an int8 holds
                raise ValueError("more than 126 block categories: the labels hold int8 ids")
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
                total.index_add_(0, labels[idx.reshape(-1)].long(), c.reshape(-1).to(torch.float64))
            continue
        v = geom.norm_sq(x).to(torch.float64)
        first = index[0]
        if v.dim() > 0 and tuple(v.shape) == tuple(first.shape[: v.dim()]):
            heads = first.reshape(*v.shape, -1)[..., 0].reshape(-1)  # one position per head
            total.index_add_(0, labels[heads].long(), v.reshape(-1))
        else:  # one value for the whole piece: it belongs to the category of its coordinates
            total[int(labels[first.reshape(-1)[0]])] += v.sum()
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


@dataclass(frozen=True)
class AscentSettings:
    """The ascent :func:`ascent_diagnostics` re-runs: its arguments of the same names.

    The perturbation's settings (``measure``, ``metric``, ``order``, ``eps``,
    ``corrected_norm``, ``exact_steps``, ``perturb``; ``key_bias`` when the symmetry blocks are
    found here) and the ascent's (``rho``, ``steps``).
    """

    measure: str = "geodesic"
    metric: str = "inv"
    order: int | str = 2
    rho: float = 0.1
    steps: int = 20
    eps: float = 0.0
    corrected_norm: bool = True
    exact_steps: int = 10
    key_bias: str = "quotient"
    perturb: str = "all"

    def perturbation(self, space: ParameterSpace, theta0: Tensor) -> Perturbation:
        """The :class:`Perturbation` of the ascent at ``theta0``, as ``gs.sharpness`` builds it.

        Raises:
            ValueError: On ``perturb="blocks"`` with the Euclidean measure, or without blocks.
        """
        if self.perturb == "blocks" and (self.measure == "euclidean" or not space.blocks):
            raise ValueError(
                "perturb='blocks' needs symmetry blocks and a geodesic/adaptive measure"
            )
        pert_kw = perturbation_kwargs(self.measure, self.metric, self.order, self.perturb)
        return Perturbation(
            space,
            theta0,
            eps=self.eps,
            corrected_norm=self.corrected_norm,
            exact_steps=self.exact_steps,
            perturb=self.perturb,
            **pert_kw,
        )


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
    check_unsharded(model, "geosharp.estimators.diagnostics.ascent_diagnostics")
    cfg = AscentSettings(
        measure=measure,
        metric=metric,
        order=order,
        rho=rho,
        steps=steps,
        eps=eps,
        corrected_norm=corrected_norm,
        exact_steps=exact_steps,
        key_bias=key_bias,
        perturb=perturb,
    )
    space = space if space is not None else find_symmetries(model, key_bias=cfg.key_bias)
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    device = theta0.device
    pert = cfg.perturbation(space, theta0)
    rows: list[dict[str, Any]] = []
    with eval_mode(model):
        for f, _ in objectives(model, loss_fn, pert, enumerate(batches), seed=0, device=device):
            # the first run of gs.sharpness: from ξ = 0, on the embedding rows reached
            clean, grad, reached = clean_start(f, True)
            start, grad = [clean, grad], None  # emptied by the ascent: no reference held here
            cut, res = ascent_from_zero(f, reached, start, cfg.rho, cfg.steps)
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
        rho=cfg.rho,
        budget=share,
        radius_used=sum(r["norm"] for r in rows) / len(rows) / cfg.rho,
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
