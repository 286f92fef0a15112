"""Base-point work done once per weights: the symmetry search and the factorized geometry.

Measuring several radii or measures of one model is the normal use, and every call of
:func:`geosharp.sharpness` would otherwise find the symmetry blocks and factorize the Gram
matrices of every head again. :class:`BasePointCache` keeps the result of the last call, keyed
by the model object and the identity *and version* of every parameter tensor (an in-place
update such as an optimizer step bumps ``Tensor._version``, so a changed weight is never served
stale), plus the settings the work depends on.

It holds what the perturbation holds between calls (the base point and the adaptive metric,
about two parameter-sized buffers): :func:`clear_cache` releases it, and ``cache=False`` in
:func:`geosharp.sharpness` bypasses it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import geosharp as gs
    >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> x = torch.randn(2, 5, 8)
    >>> a = gs.sharpness(layer, nn.functional.mse_loss, [(x, x)], rho=0.05, steps=2)
    >>> b = gs.sharpness(layer, nn.functional.mse_loss, [(x, x)], rho=0.1, steps=2)
    >>> b.settings["cached_base_point"]
    True
    >>> clear_cache()
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

__all__ = ["BasePointCache", "clear_cache"]


def weights_key(model: nn.Module) -> tuple:
    """Identity, version, shape and trainability of every parameter of ``model``."""
    return tuple(
        (name, p.data_ptr(), p._version, tuple(p.shape), p.dtype, str(p.device), p.requires_grad)
        for name, p in model.named_parameters()
    )


class BasePointCache:
    """One entry per kind of work (``"space"``, ``"perturbation"``): the last one computed.

    Args:
        kinds: Names of the kinds of work kept.
    """

    def __init__(self, kinds: tuple[str, ...] = ("space", "perturbation")) -> None:
        self._entries: dict[str, tuple[weakref.ref, Hashable, Any]] = {}
        self.kinds = kinds
        self.hits = 0
        self.misses = 0

    def get(self, kind: str, model: nn.Module, settings: Hashable, build: Callable[[], Any]):
        """The cached value for ``(model, its weights, settings)``, or ``build()`` (then kept).

        Returns:
            ``(value, hit)``.
        """
        key = (weights_key(model), settings)
        entry = self._entries.get(kind)
        if entry is not None and entry[0]() is model and entry[1] == key:
            self.hits += 1
            return entry[2], True
        self.misses += 1
        self._entries.pop(kind, None)  # release the old entry before building the new one
        value = build()
        self._entries[kind] = (weakref.ref(model), key, value)
        return value, False

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()


#: The cache used by :func:`geosharp.sharpness` (and :func:`geosharp.curvature`).
CACHE = BasePointCache()


def clear_cache() -> None:
    """Release the base-point work kept from the last :func:`geosharp.sharpness` call."""
    CACHE.clear()
