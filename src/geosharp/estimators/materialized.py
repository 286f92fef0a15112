"""The one line of every entry point for a model whose trainable weights hold no data.

A parameter on PyTorch's ``meta`` device has a shape and no values: a model built under
``torch.device("meta")`` and not yet loaded, or the modules that accelerate *offloads*
(``dispatch_model`` / ``from_pretrained(device_map=...)`` with a GPU as the main device puts the
modules mapped to ``"cpu"`` or ``"disk"`` on ``meta`` and copies their weights to the GPU at each
forward). geosharp reads and perturbs the weights where they live, so it cannot measure them;
:func:`check_materialized` says so before any work, instead of an error deep in the geometry.
"""

from __future__ import annotations

from torch import nn

from geosharp.errors import MeasureError

__all__ = ["check_materialized"]


def check_materialized(model: nn.Module, entry: str) -> None:
    """Refuse, in one line, a model with a trainable parameter on the ``meta`` device.

    Args:
        model: The model.
        entry: The entry point named in the message (``"gs.sharpness"``).

    Raises:
        MeasureError: (a ``ValueError``) If a trainable parameter is a meta tensor.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise MeasureError(
            f"{entry}: the model's trainable parameter {names[0]!r}{more} is on the meta device "
            "(no values: offloaded by accelerate, whose device_map with a GPU as the main device "
            "offloads the modules mapped to 'cpu' or 'disk', or built under "
            "torch.device('meta') and never loaded); geosharp perturbs the weights where they "
            "live: map every module to a device (accelerate.dispatch_model(..., "
            "main_device='cpu') runs the 'cpu' modules on the CPU) or load the weights"
        )
