"""Running a model with other weights, and proving its symmetry claims on data (SPEC §3, §8).

Names and classes are hints: an adapter may recognise a module whose arithmetic it does not
fully know, so :func:`~geosharp.symmetry.find_symmetries` only claims blocks, and :func:`prove`
follows it. :func:`invariance_changes` applies random group elements to the blocks of a
:class:`~geosharp.symmetry.ParameterSpace` and measures how much the model's outputs move on a
batch, next to a random *non-symmetric* move of the same coordinates by the same distance (the
size of a real failure). A true symmetry moves the outputs by roundoff only
(:func:`is_symmetry`); :func:`prove` keeps the blocks that pass and drops the others. The model
is never copied: weights are passed to :func:`torch.func.functional_call`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from geosharp.symmetry import find_symmetries
    >>> mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    >>> x = torch.randn(2, 5, 8, dtype=torch.float64)
    >>> space = find_symmetries(mha)
    >>> changes, randoms = invariance_changes(mha, space, (x, x, x), scales=(10.0,))
    >>> changes[0] < 1e-12 < 1e-3 < randoms[0]
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from geosharp.symmetry.group import group_action, random_group_elements
from geosharp.symmetry.space import UNPROVEN_NOTE, ParameterSpace

__all__ = [
    "SYMMETRY_TO_RANDOM",
    "call_model",
    "eval_mode",
    "flatten_outputs",
    "invariance_changes",
    "is_symmetry",
    "prove",
    "to_device",
]

#: A claimed symmetry changes the outputs by at most this fraction of what a random,
#: non-symmetric move of the same size changes them: it is roundoff of the model's own
#: arithmetic (float32 softmaxes or norms inside a float64 model), not a broken symmetry.
SYMMETRY_TO_RANDOM = 1e-5


def to_device(obj: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return type(obj)({k: to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def model_arguments(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``model(inputs)``.

    A dict of inputs is passed as keyword arguments (Hugging Face style), a tuple as positional
    arguments, anything else as the single argument.
    """
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def call_model(model: nn.Module, params: Mapping[str, Tensor], inputs: Any) -> Any:
    """``model(inputs)`` with the given parameters (``functional_call``; no weights copied).

    The inputs are passed as :func:`model_arguments` says.
    """
    args, kwargs = model_arguments(inputs)
    return functional_call(model, dict(params), args, kwargs)


@contextmanager
def eval_mode(model: nn.Module):
    """Put ``model`` in eval mode and restore its previous mode afterwards, on any exit."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def flatten_outputs(out: Any) -> Tensor:
    """All floating tensors of a model output (tensor, tuple, dict, HF ModelOutput) as a vector."""
    if isinstance(out, Tensor):
        return out.reshape(-1) if out.is_floating_point() else out.new_zeros(0, dtype=torch.float)
    if isinstance(out, dict) or hasattr(out, "items"):
        parts = [flatten_outputs(v) for _, v in out.items()]
    elif isinstance(out, (list, tuple)):
        parts = [flatten_outputs(v) for v in out]
    else:
        return torch.zeros(0)
    parts = [p.double() for p in parts if p.numel()]
    return torch.cat(parts) if parts else torch.zeros(0)


def invariance_changes(
    model: nn.Module,
    space: ParameterSpace,
    inputs: Any,
    *,
    scales: Sequence[float] = (0.5, 1.0, 2.0),
    seed: int = 0,
) -> tuple[list[float], list[float]]:
    """Relative output changes under random group elements and under random moves.

    For every scale ``a``: the group element of
    :func:`~geosharp.symmetry.group.random_group_elements` (``generator`` seeded ``seed + i``)
    moves the outputs by ``‖f(g·w) − f(w)‖ / ‖f(w)‖``; a
    random direction with, block by block, the same length as ``g·w − w`` moves them by the
    second number.

    Args:
        model: The model (its weights are not written to).
        space: The symmetry blocks to check.
        inputs: One batch of inputs (tensor, tuple of positional or dict of keyword arguments).
        scales: Scales of the group elements.
        seed: Seed of the draws.

    Returns:
        ``(changes, random_changes)``, one value per scale each.
    """
    params = dict(model.named_parameters())
    param = next(iter(params.values()))
    inputs = to_device(inputs, param.device)
    with eval_mode(model), torch.no_grad():
        ref = flatten_outputs(call_model(model, params, inputs))

        def change(theta_new: Tensor) -> float:
            moved = space.unflatten(theta_new)
            out = flatten_outputs(call_model(model, {**params, **moved}, inputs))
            return float((out - ref).norm() / ref.norm().clamp_min(1e-300))

        theta = space.flatten(params)
        changes, randoms = [], []
        for i, a in enumerate(scales):
            gen = torch.Generator().manual_seed(seed + i)
            element = random_group_elements(
                space, generator=gen, scale=a, dtype=theta.dtype, device=theta.device
            )
            acted = group_action(space, theta, element)
            changes.append(change(acted))
            noise = torch.zeros_like(theta)
            for b in space.blocks:
                pos = b.positions().to(theta.device)
                step = acted[pos] - theta[pos]
                direction = torch.randn(step.shape, generator=gen, dtype=theta.dtype)
                direction = direction.to(theta.device)
                noise[pos] = direction * (step.norm() / direction.norm().clamp_min(1e-300))
            randoms.append(change(theta + noise))
    return changes, randoms


def is_symmetry(changes: Sequence[float], randoms: Sequence[float], tol: float) -> bool:
    """Whether every change is within ``tol``, or far below the random move's (roundoff)."""
    within = all(c <= tol for c in changes)
    pairs = zip(changes, randoms, strict=True)
    return within or all(c <= SYMMETRY_TO_RANDOM * r for c, r in pairs)


def default_tol(model: nn.Module) -> float:
    """Relative tolerance of an invariance check: ``1e-9`` in float64, ``1e-4`` otherwise."""
    param = next(iter(model.parameters()))
    return 1e-9 if param.dtype == torch.float64 else 1e-4


#: The scales of the group elements :func:`prove` draws.
_PROOF_SCALES = (0.5, 2.0)


def prove(
    space: ParameterSpace, model: nn.Module, inputs: Any, *, tol: float | None = None
) -> ParameterSpace:
    """The blocks of ``space`` that are symmetries of ``model`` on a batch; the others dropped.

    A block holds if random elements of its group (scales 0.5 and 2) move the outputs by at
    most ``tol`` relatively, or by at most :data:`SYMMETRY_TO_RANDOM` of a random move of the
    same size (roundoff of a model computing below float64) — :func:`is_symmetry` of
    :func:`invariance_changes`. All blocks are tried at once first; if that fails, each alone.
    The finder's note that the claims are unproven is replaced by what was proven, and each
    dropped block gets a note; its coordinates are adaptive again.

    Args:
        space: The claims, e.g. from :func:`~geosharp.symmetry.find_symmetries`.
        model: The model (its weights are not written to).
        inputs: One batch of inputs (as for :func:`geosharp.sharpness`).
        tol: Relative tolerance (default :func:`default_tol`: ``1e-9`` in float64, ``1e-4``
            otherwise).

    Returns:
        ``space`` itself (with a note) if every block holds, else a new space of the blocks
        that do. A space without blocks is returned as it is.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from geosharp.symmetry import find_symmetries
        >>> mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
        >>> x = torch.randn(2, 5, 8, dtype=torch.float64)
        >>> space = prove(find_symmetries(mha), mha, (x, x, x))
        >>> space.notes[-1].startswith("symmetry claims verified on the example batch: 3 blocks")
        True
    """
    if not space.blocks:
        return space
    tol = default_tol(model) if tol is None else tol
    notes = [n for n in space.notes if n != UNPROVEN_NOTE]
    changes, randoms = invariance_changes(model, space, inputs, scales=_PROOF_SCALES)
    if is_symmetry(changes, randoms, tol):
        space.notes[:] = notes
        space.notes.append(
            f"symmetry claims verified on the example batch: {len(space.blocks)} blocks, "
            f"outputs moved by ≤ {max(changes):.1e} under random group elements"
        )
        return space
    kept, dropped = [], []
    for b in space.blocks:
        single = replace(space, blocks=[b], notes=[])
        c, r = invariance_changes(model, single, inputs, scales=_PROOF_SCALES)
        (kept if is_symmetry(c, r, tol) else dropped).append((b, max(c), max(r)))
    for b, c, r in dropped:
        notes.append(
            f"block {b.name!r} ({type(b).__name__}) dropped: a random element of its group "
            f"moved the outputs by {c:.1e} (a random move of the same size: {r:.1e}), so it is "
            "not a symmetry of this model; its coordinates stay adaptive"
        )
    notes.append(
        f"symmetry claims verified on the example batch: {len(kept)} of {len(space.blocks)} "
        "blocks hold"
    )
    return replace(
        space, blocks=[b for b, _, _ in kept], notes=notes, excluded=dict(space.excluded)
    )
