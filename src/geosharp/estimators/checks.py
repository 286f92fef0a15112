"""Numerical checkers a user can run on their own model (the pymanopt habit).

:func:`check_invariance` re-parametrizes every symmetry block that was found by a random group
element and compares the model's outputs: a wrong adapter (a block that is not a symmetry) is
caught here instead of being silently measured. :func:`check_geometry` verifies, at the model's
own weights, that the horizontal projection is idempotent and that the metric is invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.perturbation import Perturbation
from geosharp.estimators.sharpness import _to_device, call_model, eval_mode
from geosharp.symmetry import (
    ParameterSpace,
    find_symmetries,
    group_action,
    random_group_elements,
)


def _flatten_outputs(out: Any) -> Tensor:
    """All floating tensors of a model output (tensor, tuple, dict, HF ModelOutput) as a vector."""
    if isinstance(out, Tensor):
        return out.reshape(-1) if out.is_floating_point() else out.new_zeros(0, dtype=torch.float)
    if isinstance(out, dict) or hasattr(out, "items"):
        parts = [_flatten_outputs(v) for _, v in out.items()]
    elif isinstance(out, (list, tuple)):
        parts = [_flatten_outputs(v) for v in out]
    else:
        return torch.zeros(0)
    parts = [p.double() for p in parts if p.numel()]
    return torch.cat(parts) if parts else torch.zeros(0)


@dataclass
class InvarianceReport:
    """Result of :func:`check_invariance`.

    Attributes:
        passed: Whether every relative output change stayed below the tolerance.
        rel_changes: ``‖f(A·w) − f(w)‖ / ‖f(w)‖`` for every scale.
        scales: The scales ``a`` of the group elements ``A = a·N(0, 1)``.
        tol: The tolerance used.
        n_blocks: Number of GL(h) heads and diagonal pairs that were re-parametrized.
    """

    passed: bool
    rel_changes: list[float]
    scales: list[float]
    tol: float
    n_blocks: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        pairs = zip(self.scales, self.rel_changes, strict=True)
        changes = ", ".join(f"a={a:g}: {c:.1e}" for a, c in pairs)
        verdict = "PASSED" if self.passed else "FAILED"
        return f"invariance check {verdict} ({self.n_blocks} blocks; tol {self.tol:g}): {changes}"


def check_invariance(
    model: nn.Module,
    inputs: Any,
    *,
    space: ParameterSpace | None = None,
    scales: Sequence[float] = (0.5, 1.0, 2.0),
    tol: float | None = None,
    seed: int = 0,
) -> InvarianceReport:
    """Check that a random re-parametrization of every block found leaves the outputs unchanged.

    Args:
        model: The model.
        inputs: One batch of inputs (tensor, tuple or dict, as for :func:`geosharp.sharpness`).
        space: Symmetry blocks (default: :func:`geosharp.find_symmetries`).
        scales: Scales ``a`` of the random group elements ``A = a·(I + N(0,1)/√h)``-like draws of
            :func:`geosharp.reparametrize`.
        tol: Relative tolerance (default ``1e-4`` in float32, ``1e-9`` in float64).
        seed: Seed of the group elements.

    Returns:
        An :class:`InvarianceReport`; ``passed`` is ``False`` if an adapter is wrong.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        >>> check_invariance(layer, torch.randn(2, 5, 8)).passed
        True
    """
    space = space if space is not None else find_symmetries(model)
    param = next(iter(model.parameters()))
    inputs = _to_device(inputs, param.device)
    if tol is None:
        tol = 1e-9 if param.dtype == torch.float64 else 1e-4
    params = dict(model.named_parameters())
    with eval_mode(model), torch.no_grad():
        ref = _flatten_outputs(call_model(model, params, inputs))
        theta = space.flatten(params)
        changes = []
        for i, a in enumerate(scales):
            # The draws of reparametrize(model, generator, scale=a), applied functionally: the
            # transformed weights are passed to functional_call, the model is never copied.
            gen = torch.Generator().manual_seed(seed + i)
            element = random_group_elements(
                space, generator=gen, scale=a, dtype=theta.dtype, device=theta.device
            )
            moved = space.unflatten(group_action(space, theta, element))
            out = _flatten_outputs(call_model(model, {**params, **moved}, inputs))
            changes.append(float((out - ref).norm() / ref.norm().clamp_min(1e-300)))
    n_blocks = sum(b.heads for b in space.gl_blocks) + len(space.diagonal_pairs)
    return InvarianceReport(
        passed=all(c <= tol for c in changes),
        rel_changes=changes,
        scales=list(scales),
        tol=tol,
        n_blocks=n_blocks,
    )


@dataclass
class GeometryReport:
    """Result of :func:`check_geometry`: worst relative residuals over all blocks."""

    idempotence: float
    norm_decrease: float
    passed: bool

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return (
            f"geometry check {verdict}: ‖P(Pξ) − Pξ‖/‖Pξ‖ = {self.idempotence:.1e}, "
            f"‖Pξ‖ ≤ ‖ξ‖ violated by {self.norm_decrease:.1e}"
        )


def check_geometry(
    model: nn.Module,
    *,
    metric: str = "inv",
    eps: float = 0.0,
    space: ParameterSpace | None = None,
    seed: int = 0,
    tol: float = 1e-6,
) -> GeometryReport:
    """Check the horizontal projection at the model's own weights (idempotent, norm-reducing).

    Args:
        model: The model.
        metric: ``"inv"`` or ``"mix"``.
        eps: Gram damping (at ``eps > 0`` idempotence holds only approximately).
        space: Symmetry blocks (default: found here).
        seed: Seed of the random tangent vectors.
        tol: Tolerance on the relative residuals.

    Returns:
        A :class:`GeometryReport`.

    Example:
        >>> from torch import nn
        >>> check_geometry(nn.TransformerEncoderLayer(8, 2, 16)).passed
        True
    """
    space = space if space is not None else find_symmetries(model)
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    pert = Perturbation(space, theta0, measure="geodesic", metric=metric, eps=eps)
    gen = torch.Generator(device=theta0.device).manual_seed(seed)
    xi = [p.geometry.random_tangent(gen, 1.0, horizontal=False) for p in pert.pieces]
    p1 = pert.project(xi)
    p2 = pert.project(p1)
    diff = Perturbation.combine(p2, p1, 1.0, -1.0)
    idem = pert.norm(diff) / max(pert.norm(p1), 1e-300)
    decrease = max(0.0, pert.norm(p1) - pert.norm(xi)) / max(pert.norm(xi), 1e-300)
    return GeometryReport(idem, decrease, idem <= tol and decrease <= tol)
