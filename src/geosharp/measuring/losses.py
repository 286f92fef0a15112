"""The losses of ``gs.measure``: the default loss and the named ones a user may pass.

:func:`default_loss` is cross-entropy for integer targets (per sequence or per token, ignoring
:data:`IGNORE_INDEX`) and mean squared error for floating targets, on the predictions found in
any usual model output (a tensor, ``.logits``, ``["logits"]`` or ``[0]``).
:func:`resolve_loss` turns ``None``, ``"auto"``, ``"ce"``, ``"mse"`` or a callable into a loss
function and the name the report records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from geosharp.measuring.errors import MeasureError

__all__ = ["IGNORE_INDEX", "default_loss", "resolve_loss"]

#: Cross-entropy ignores targets equal to this (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100


def _logits(outputs: Any) -> Tensor:
    """The predictions in a model output: ``.logits``, ``["logits"]``, ``[0]`` or itself."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise MeasureError(
        f"cannot find the predictions in a model output of type {type(outputs).__name__}: "
        "the default loss reads a tensor, .logits, output['logits'] or output[0]; pass loss_fn"
    )


def _cross_entropy(outputs: Any, targets: Tensor) -> Tensor:
    logits = _logits(outputs)
    if logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )
    raise MeasureError(
        f"cross-entropy needs predictions of shape (*, classes) and integer targets of shape (*);"
        f" got predictions {tuple(logits.shape)} and targets {tuple(targets.shape)}"
    )


def _mse(outputs: Any, targets: Tensor) -> Tensor:
    pred = _logits(outputs)
    if pred.shape != targets.shape and pred.shape[-1:] == (1,) and pred.shape[:-1] == targets.shape:
        pred = pred.squeeze(-1)
    if pred.shape != targets.shape:
        raise MeasureError(
            f"the squared error needs predictions shaped like the targets; got predictions "
            f"{tuple(pred.shape)} and targets {tuple(targets.shape)}"
        )
    return nn.functional.mse_loss(pred, targets.to(pred.dtype))


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Cross-entropy for integer targets, mean squared error for floating targets.

    The predictions are ``outputs.logits`` (Hugging Face), ``outputs["logits"]``,
    ``outputs[0]`` or ``outputs`` itself. Cross-entropy takes logits ``(*, C)`` and targets
    ``(*)`` (per sequence or per token) and ignores targets equal to ``-100``.

    Args:
        outputs: The model output.
        targets: Integer class indices, or floating regression targets.

    Returns:
        The mean loss (a scalar tensor).

    Raises:
        MeasureError: If the shapes do not fit.

    Example:
        >>> import torch
        >>> round(float(default_loss(torch.zeros(4, 2), torch.tensor([0, 1, 1, 0]))), 4)  # log 2
        0.6931
    """
    if not isinstance(targets, Tensor):
        raise MeasureError(f"the default loss needs tensor targets, got {type(targets).__name__}")
    if targets.is_floating_point():
        return _mse(outputs, targets)
    return _cross_entropy(outputs, targets)


_NAMED_LOSSES: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "auto": default_loss,
    "ce": _cross_entropy,
    "cross_entropy": _cross_entropy,
    "cross-entropy": _cross_entropy,
    "mse": _mse,
}


def resolve_loss(loss: str | Callable | None) -> tuple[Callable[[Any, Any], Tensor], str]:
    """A loss function and its name from ``None``, ``"auto"``, ``"ce"``, ``"mse"`` or a callable.

    Args:
        loss: The loss, or ``None`` for ``"auto"`` (:func:`default_loss`).

    Returns:
        ``(loss_fn, name)``.

    Raises:
        MeasureError: On an unknown name.
    """
    if loss is None:
        return default_loss, "auto"
    if callable(loss):
        return loss, getattr(loss, "__name__", type(loss).__name__)
    key = str(loss).strip().lower()
    if key not in _NAMED_LOSSES:
        raise MeasureError(
            f"unknown loss {loss!r}: use auto (cross-entropy for integer targets, squared error "
            "for float targets), ce, mse, or a callable loss_fn(outputs, targets)"
        )
    return _NAMED_LOSSES[key], {"cross_entropy": "ce", "cross-entropy": "ce"}.get(key, key)


def uses_cross_entropy(loss_fn: Callable, targets: Any) -> bool:
    """Whether ``loss_fn`` is cross-entropy on these targets (so labels must be class ids)."""
    loss_fn = getattr(loss_fn, "__wrapped__", loss_fn)  # e.g. geosharp measure --fsdp's weighing
    if loss_fn is _cross_entropy:
        return True
    return (
        loss_fn is default_loss and isinstance(targets, Tensor) and not targets.is_floating_point()
    )
