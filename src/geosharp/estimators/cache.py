"""Base-point work done once per weights: the symmetry search and the factorized geometry.

Measuring several radii or measures of one model is the normal use, and every call of
:func:`geosharp.sharpness` would otherwise find the symmetry blocks and factorize the Gram
matrices of every head again. :class:`BasePointCache` keeps the results of the last calls,
keyed by the model object and the identity *and version* of every parameter tensor (an in-place
update such as an optimizer step bumps ``Tensor._version``, so a changed weight is never served
stale), plus the settings the work depends on.

Measures alternate (adaptive, geodesic inv and mix at several radii: Study 3 measures them in
turn on every model), so each kind of work keeps up to :attr:`BasePointCache.max_entries`
(default 4) results, least recently used first out; the average and worst cases of one
geodesic measure share one. An entry of a model whose weights changed, or of a model that no
longer exists, is dropped at the next look-up. Memory: a geodesic ``Perturbation`` holds the
block coordinates of the base point twice (the model's dtype and float64) and an int32 index
of the parameters that hold them — about ``P_b·(d + 12)`` bytes for ``P_b`` block coordinates
of itemsize ``d`` — plus a few ``h × h`` float64 factors per head: 65–69 MB, 1.5–1.6
parameter-sized buffers, on MiniLM-L6 (3.5 M block coordinates, 144 heads; measured). An
adaptive or Euclidean one holds no parameter-sized buffer (only the frozen coordinates of
the parameters that have some). The search result (``"space"``) holds the int32 block
positions, ``P_b·4`` bytes. :func:`clear_cache` releases everything, ``max_entries = 1`` keeps
only the last result of each kind, and ``cache=False`` in :func:`geosharp.sharpness` bypasses
the cache.

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
    >>> c = gs.sharpness(layer, nn.functional.mse_loss, [(x, x)], measure="adaptive", steps=2)
    >>> d = gs.sharpness(layer, nn.functional.mse_loss, [(x, x)], rho=0.2, steps=2)
    >>> d.settings["cached_base_point"]  # kept beside the adaptive measure's entry
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
    """Per kind of work (``"space"``, ``"perturbation"``, ...), the last results computed.

    Args:
        kinds: Names of the kinds of work kept (informative: any kind may be asked for).
        max_entries: Results kept per kind, least recently used first out (``>= 1``).
    """

    def __init__(
        self, kinds: tuple[str, ...] = ("space", "perturbation"), max_entries: int = 4
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        #: kind → list of (model, (weights key, settings), value), most recently used last
        self._entries: dict[str, list[tuple[weakref.ref, tuple, Any]]] = {}
        self.kinds = kinds
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0

    def get(self, kind: str, model: nn.Module, settings: Hashable, build: Callable[[], Any]):
        """The cached value for ``(model, its weights, settings)``, or ``build()`` (then kept).

        Returns:
            ``(value, hit)``.
        """
        weights = weights_key(model)
        key = (weights, settings)
        entries = self._entries.setdefault(kind, [])
        # entries of dead models, or of this model at other weights, can never hit again
        entries[:] = [e for e in entries if _alive(e, model, weights)]
        for i, entry in enumerate(entries):
            if entry[0]() is model and entry[1] == key:
                self.hits += 1
                entries.append(entries.pop(i))  # most recently used
                return entry[2], True
        self.misses += 1
        # make room before building, so that the evicted value is released first
        del entries[: max(0, len(entries) - self.max_entries + 1)]
        value = build()
        entries.append((weakref.ref(model), key, value))
        return value, False

    def __len__(self) -> int:
        """Entries kept, over all kinds."""
        return sum(len(e) for e in self._entries.values())

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()


def _alive(entry: tuple, model: nn.Module, weights: tuple) -> bool:
    """Whether ``entry`` can be served: its model exists (with ``weights`` if it is ``model``).

    (The settings of a ``"perturbation"`` entry name its space by ``id``; the entry's value
    holds that space, so the id cannot be reused by another space while the entry lives.)
    """
    owner = entry[0]()
    return owner is not None and (owner is not model or entry[1][0] == weights)


#: The cache used by :func:`geosharp.sharpness` (and :func:`geosharp.curvature`).
CACHE = BasePointCache()


def clear_cache() -> None:
    """Release the base-point work kept from the last :func:`geosharp.sharpness` calls."""
    CACHE.clear()
