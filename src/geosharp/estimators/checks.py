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


#: A claimed symmetry changes the outputs by at most this fraction of what a random,
#: non-symmetric move of the same size changes them: it is roundoff of the model's own
#: arithmetic (float32 softmaxes or norms inside a float64 model), not a broken symmetry.
_SYMMETRY_TO_RANDOM = 1e-5


@dataclass
class InvarianceReport:
    """Result of :func:`check_invariance`.

    Attributes:
        passed: Whether every relative output change stayed below the tolerance (or, for a
            model computing below float64 internally, far below a random move of the same
            size). ``False`` when there was nothing to check.
        rel_changes: ``‖f(g·w) − f(w)‖ / ‖f(w)‖`` for every scale.
        scales: The scales ``a`` of the random group elements.
        tol: The tolerance used.
        n_blocks: Number of symmetry blocks re-parametrized (as in ``space.summary()``).
        n_factors: Their independent group factors (heads, pair coordinates, biases).
        random_changes: The relative output change of a random, non-symmetric move of the same
            coordinates by the same distance, for every scale (the scale of a real failure).
        notes: Remarks, e.g. that the model computes internally below float64.
    """

    passed: bool
    rel_changes: list[float]
    scales: list[float]
    tol: float
    n_blocks: int
    notes: list[str] = field(default_factory=list)
    n_factors: int = 0
    random_changes: list[float] = field(default_factory=list)

    @property
    def nothing_to_check(self) -> bool:
        """``True`` when the space has no symmetry block (no claim was made)."""
        return self.n_blocks == 0

    def __str__(self) -> str:
        if self.nothing_to_check:
            return (
                "invariance check: nothing to check (no symmetry blocks were found, so no "
                "symmetry is claimed; every parameter uses the adaptive geometry)"
            )
        pairs = zip(self.scales, self.rel_changes, strict=True)
        changes = ", ".join(f"a={a:g}: {c:.1e}" for a, c in pairs)
        verdict = "PASSED" if self.passed else "FAILED"
        text = (
            f"invariance check {verdict} ({self.n_blocks} symmetry blocks, {self.n_factors} "
            f"group factors; tol {self.tol:g}): {changes}"
        )
        if self.random_changes:
            text += "; a random move of the same size: " + ", ".join(
                f"{c:.1e}" for c in self.random_changes
            )
        return text + "".join(f"\n  note: {n}" for n in self.notes)


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

    Each block gets a random element of its group (as :func:`geosharp.reparametrize` draws
    it). Beside the change of the outputs, the change under a random *non-symmetric* move of
    the same coordinates by the same distance is measured: a true symmetry changes the outputs
    by roundoff only, a false claim by a sizeable fraction of the random move. A model that
    computes internally below its parameters' precision (HF's float32 softmax or RMSNorm in a
    float64 model, GPT-Neo's float32 scores) may exceed the float64 tolerance by roundoff: it
    passes when its change stays below 1e-5 of the random one, with a note.

    Args:
        model: The model.
        inputs: One batch of inputs (tensor, tuple or dict, as for :func:`geosharp.sharpness`).
        space: Symmetry blocks (default: :func:`geosharp.find_symmetries`).
        scales: Scales ``a`` of the random group elements.
        tol: Relative tolerance (default ``1e-4`` in float32, ``1e-9`` in float64).
        seed: Seed of the group elements.

    Returns:
        An :class:`InvarianceReport`; ``passed`` is ``False`` if an adapter is wrong, and
        :attr:`InvarianceReport.nothing_to_check` is ``True`` without blocks.

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
    if not space.blocks:
        return InvarianceReport(False, [], list(scales), tol, 0, n_factors=0)
    params = dict(model.named_parameters())
    with eval_mode(model), torch.no_grad():
        ref = _flatten_outputs(call_model(model, params, inputs))

        def change(theta_new: Tensor) -> float:
            moved = space.unflatten(theta_new)
            out = _flatten_outputs(call_model(model, {**params, **moved}, inputs))
            return float((out - ref).norm() / ref.norm().clamp_min(1e-300))

        theta = space.flatten(params)
        changes, randoms = [], []
        for i, a in enumerate(scales):
            # The draws of reparametrize(model, generator, scale=a), applied functionally: the
            # transformed weights are passed to functional_call, the model is never copied.
            gen = torch.Generator().manual_seed(seed + i)
            element = random_group_elements(
                space, generator=gen, scale=a, dtype=theta.dtype, device=theta.device
            )
            acted = group_action(space, theta, element)
            changes.append(change(acted))
            # the same distance in a random direction, block by block
            noise = torch.zeros_like(theta)
            for b in space.blocks:
                pos = b.positions().to(theta.device)
                step = acted[pos] - theta[pos]
                direction = torch.randn(
                    step.shape, generator=gen, dtype=theta.dtype, device="cpu"
                ).to(theta.device)
                noise[pos] = direction * (step.norm() / direction.norm().clamp_min(1e-300))
            randoms.append(change(theta + noise))
    notes = []
    within = all(c <= tol for c in changes)
    roundoff = all(c <= _SYMMETRY_TO_RANDOM * r for c, r in zip(changes, randoms, strict=True))
    if not within and roundoff:
        notes.append(
            f"outputs changed by up to {max(changes):.1e} > tol {tol:g}, but by less than "
            f"{_SYMMETRY_TO_RANDOM:g} of a random move of the same size (≥ {min(randoms):.1e}): "
            "roundoff of a model computing internally below its parameters' precision"
        )
    return InvarianceReport(
        passed=within or roundoff,
        rel_changes=changes,
        scales=list(scales),
        tol=tol,
        n_blocks=len(space.blocks),
        notes=notes,
        n_factors=space.n_group_factors,
        random_changes=randoms,
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
