"""Everything :func:`geosharp.measure` does to one model before its first measurement.

* :func:`prepare_measurement` — the loss resolved, the batches on the model's device
  (:func:`_prepare_batches`), the weights whose ``1/w²`` overflows flushed (on a copy), the
  symmetry blocks found and proven on batch 0 (:func:`_symmetry_space`), the clean loss of
  every batch checked finite, and the self-check; the result is a :class:`CheckedModel`;
* :func:`adaptive_note` — which coordinates use the adaptive geometry, and why.

A population study (:mod:`geosharp.studies.population`) runs it for every model.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measuring.checks import (
    clean_pass,
    invariance_tol,
    self_check,
    without_unrepresentable,
)
from geosharp.measuring.errors import MeasureError, MeasureWarning
from geosharp.measuring.losses import default_loss, resolve_loss
from geosharp.symmetry import ParameterSpace, find_symmetries, prove
from geosharp.symmetry.verify import to_device as _to_device

__all__ = ["CheckedModel", "adaptive_note", "prepare_measurement"]


@dataclass
class CheckedModel:
    """A model checked and ready to measure (:func:`prepare_measurement`).

    Attributes:
        model: The model (a copy where weights whose ``1/w²`` overflows were set to 0).
        batches: The batches, on the model's device.
        loss_fn: The loss, resolved to a callable.
        loss_name: Its name (``"auto: cross-entropy"``, …).
        space: The symmetry blocks found and proven on batch 0 (or the space given).
        summary: ``space.summary()``.
        adaptive_note: Which coordinates use the adaptive geometry.
        clean_losses: The loss of every batch at the model's weights (all finite).
        invariance: The self-check's report (``None`` without ``check``).
    """

    model: nn.Module
    batches: list
    loss_fn: Callable
    loss_name: str
    space: ParameterSpace
    summary: str
    adaptive_note: str
    clean_losses: list[float]
    invariance: Any


def prepare_measurement(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable | str | None = default_loss,
    *,
    space: ParameterSpace | None = None,
    check: bool = True,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
    say_blocks: Callable[[str, str], None] | None = None,
) -> CheckedModel:
    """Everything :func:`measure` does before its first measurement, for one model.

    The loss resolved, the batches on the model's device, the weights whose ``1/w²`` overflows
    flushed (on a copy), the symmetry blocks found and proven on batch 0, the clean loss of
    every batch checked finite, and the self-check (a random re-parametrization of every
    block must leave the outputs unchanged). A population study runs it for every model.

    ``say_blocks(summary, adaptive_note)`` says the symmetry blocks found (default: ``say``
    each); a population study says them once for models that share them.

    ``check=False`` (``--no-check``) skips the self-check alone: the blocks are still proven
    on batch 0 (a claim that fails is dropped, as with ``check``), so the same blocks are
    measured and the values are those of a checked run.

    Raises:
        MeasureError: If the loss is unknown, there are no batches or trainable parameters, a
            clean loss is not finite, or the self-check fails.
    """
    say = say or (lambda _msg: None)
    loss_fn, loss_name = resolve_loss(loss_fn)
    batches, loss_name = _prepare_batches(model, batches, loss_fn, loss_name)
    model, tiny = without_unrepresentable(model)
    if tiny is not None:
        space = None  # the copy has other parameter objects
        if warn is not None:
            warn(tiny)
        else:
            warnings.warn(tiny, MeasureWarning, stacklevel=2)
    inputs0 = batches[0][0]
    # The proof runs with or without ``check``: it decides which blocks are measured (a block
    # that fails it is dropped, never refused), so ``check=False`` (--no-check) measures the
    # same blocks and values; ``check`` is the self-check alone (refuse when it fails).
    space = _symmetry_space(model, space, inputs0, say)
    summary, note = space.summary(), adaptive_note(space)
    if say_blocks is not None:
        say_blocks(summary, note)
    else:
        say(summary)
        say(note)
    if space.numel() == 0:
        raise MeasureError("the model has no trainable parameters (all have requires_grad=False)")
    clean = clean_pass(model, loss_fn, batches)
    say(f"clean loss: {sum(clean) / len(clean):.6g} (mean over {len(clean)} batch(es), all finite)")
    invariance = self_check(model, inputs0, space, seed, say) if check else None
    return CheckedModel(
        model=model,
        batches=batches,
        loss_fn=loss_fn,
        loss_name=loss_name,
        space=space,
        summary=summary,
        adaptive_note=note,
        clean_losses=clean,
        invariance=invariance,
    )


def _prepare_batches(
    model: nn.Module, batches: Iterable[tuple[Any, Any]], loss_fn: Callable, loss_name: str
) -> tuple[list, str]:
    """The batches as a list on the model's device, and the loss's name (``auto: ...``)."""
    batches = list(batches)
    if not batches:
        raise MeasureError("there are no batches: the data set is empty")
    for b, batch in enumerate(batches):  # before the symmetry search runs the model on one
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise MeasureError(
                f"batch {b} must be a pair (inputs, targets), got {type(batch).__name__}"
                + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
    device = next(iter(model.parameters())).device
    batches = [_to_device(b, device) for b in batches]
    unwrapped = getattr(loss_fn, "__wrapped__", loss_fn)  # geosharp measure --fsdp's weighing
    if unwrapped is default_loss:
        floating = isinstance(batches[0][1], Tensor) and batches[0][1].is_floating_point()
        loss_name = "auto: squared error" if floating else "auto: cross-entropy"
    return batches, loss_name


def _symmetry_space(
    model: nn.Module, space: ParameterSpace | None, inputs: Any, say: Callable[[str], None]
) -> ParameterSpace:
    """``space``, or the blocks :func:`geosharp.find_symmetries` finds (proved on ``inputs``)."""
    if space is not None:
        return space
    say("finding symmetry blocks (and proving each on batch 0) ...")
    try:
        return prove(find_symmetries(model), model, inputs, tol=invariance_tol(model))
    except Exception as err:
        raise MeasureError(
            f"the symmetry finder could not run the model on batch 0: {type(err).__name__}: {err}"
        ) from err


def adaptive_note(space: ParameterSpace, top: int = 8) -> str:
    """Which coordinates use the adaptive (element-wise) geometry, grouped by layer pattern.

    Args:
        space: The model's parameter space.
        top: How many parameter patterns to list (largest first).

    Returns:
        A few lines of text.
    """
    total = space.numel()
    n_rest = space.adaptive_numel
    if n_rest == 0:
        return "every trainable coordinate belongs to a symmetry block"
    rest = space.rest_index.cpu()
    counts: dict[str, int] = {}
    for name, shape, off in zip(space.param_names, space.shapes, space.offsets, strict=True):
        size = math.prod(shape)
        lo = int(torch.searchsorted(rest, off))
        hi = int(torch.searchsorted(rest, off + size))
        if hi > lo:
            pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
            counts[pattern] = counts.get(pattern, 0) + hi - lo
    why = (
        "no symmetry is known for them (SPEC §3), so geodesic sharpness gives them the "
        "adaptive (element-wise) metric of SPEC §5 and perturbs them along straight lines, as "
        "adaptive sharpness does"
        if space.blocks
        else "no symmetry block was found in this model, so every measure but the Euclidean one "
        "uses the adaptive (element-wise) geometry of SPEC §5: geodesic and adaptive sharpness "
        "coincide here"
    )
    lines = [f"adaptive geometry: {n_rest:,} of {total:,} coordinates — {why}:"]
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    width = max(len(k) for k, _ in items[:top])
    lines += [f"  {k.ljust(width)}  {v:>12,}" for k, v in items[:top]]
    if len(items) > top:
        rest_n = sum(v for _, v in items[top:])
        lines.append(f"  … {len(items) - top} more parameter patterns ({rest_n:,} coordinates)")
    return "\n".join(lines)
