"""Whether a model is sharded by FSDP2, and the one line of an entry point that cannot measure one.

Looked up, never imported: :func:`is_sharded` and :func:`check_unsharded` read
``torch.distributed``'s modules from ``sys.modules`` only, so a call on an ordinary model loads
nothing of FSDP's. :mod:`geosharp.estimators.sharded` measures a sharded model.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["check_unsharded", "dtensor_type", "fsdp_modules", "is_sharded"]


def dtensor_type() -> type | None:
    """``DTensor``, if ``torch.distributed.tensor`` is imported (else no model can hold one).

    Looked up, never imported: a call on an ordinary model loads nothing of FSDP's.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` (``fully_shard``'s), none if FSDP2 is not imported."""
    module = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(module, "FSDPModule", None) if module is not None else None
    if cls is None:  # FSDP2 not imported: no module of the model can be one
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded: an FSDP2 module in it, or a trainable ``DTensor``."""
    if fsdp_modules(model):
        return True
    dt = dtensor_type()
    return dt is not None and any(p.requires_grad and isinstance(p, dt) for p in model.parameters())


def check_unsharded(model: nn.Module, entry: str) -> None:
    """Refuse, in one line, a sharded model at an entry point that does not measure one yet.

    ``gs.sharpness`` measures a model sharded by FSDP2 with every sharpness measure (this
    package), ``gs.measure`` through it (:mod:`geosharp.measuring.sharded`), and
    ``gs.curvature`` its spectrum (:mod:`~geosharp.estimators.sharded.hessian`); the other
    entry points do not yet, and say so before any work.

    Args:
        model: The model.
        entry: The entry point named in the message (``"gs.relative_flatness"``).

    Raises:
        NotImplementedError: If a trainable parameter is a ``DTensor``.
    """
    dt = dtensor_type()
    if dt is None:
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, dt)]
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise NotImplementedError(
            f"the model's parameters are sharded DTensors ({names[0]!r}{more}, e.g. from FSDP2's "
            f"fully_shard): {entry} does not measure sharded models yet; gs.sharpness and "
            "gs.measure do, with every sharpness measure, and gs.curvature (docs/cluster.md)"
        )
