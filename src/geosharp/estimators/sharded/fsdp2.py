r"""The FSDP2 boundary: every read of torch's private FSDP2 and ``DTensor`` internals.

geosharp speaks to its own objects through their public members only. FSDP2 has no public
API for what a sharded measurement needs beyond :meth:`FSDPModule.set_custom_all_gather
<torch.distributed.fsdp.FSDPModule.set_custom_all_gather>` and ``reshard``: the local shard of
a ``DTensor`` that *is* FSDP's storage (a write is what it gathers), a module's parameter
groups, each parameter's all-gather input, and the class of an all-gather. Every such read is
here, so that a change of FSDP2's internals is met in one module (the callers treat an
``AttributeError`` from it as "not supported": :class:`~geosharp.estimators.sharded.gather.
GatheredEndpoint` then writes ``θ′`` over the shards).

Imported only once a model is known to be sharded (FSDP2 loaded): nothing here is imported by
:mod:`~geosharp.estimators.sharded.check`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "all_gather_comm",
    "endpoint_all_gather",
    "kept_gathered",
    "local_shape_and_offset",
    "local_shard",
    "param_groups",
    "sharded_param_data",
    "theta_inputs",
    "theta_param_class",
    "unsupported_param",
]


def local_shard(param: Any) -> Tensor:
    """The rank's shard of a ``DTensor`` parameter: FSDP's own storage (a view, no copy)."""
    return param._local_tensor


def local_shape_and_offset(param: Any) -> tuple[Sequence[int], Sequence[int]]:
    """The local shape of ``param``'s shard on this rank and its offset in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


def param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of an FSDP2 module (one per ``fully_shard`` call)."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def all_gather_comm(module: Any) -> Any:
    """The all-gather of ``module``'s one parameter group (what a custom one wraps)."""
    (group,) = param_groups(module)
    return group._all_gather_comm


def sharded_param_data(fsdp_param: Any) -> Tensor:
    """A parameter's all-gather input on this rank: its padded shard, flat."""
    return fsdp_param._sharded_param_data


def unsupported_param(fsdp_param: Any) -> bool:
    """Whether a parameter's all-gather input is not its shard: offloaded, or an extension."""
    extension = hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
    return bool(fsdp_param.offload_to_cpu or extension)


@contextlib.contextmanager
def kept_gathered(modules: Sequence[Any]) -> Iterator[None]:
    """Within: FSDP keeps every module's parameters gathered after its forward and backward.

    For Hessian-vector products (:mod:`~geosharp.estimators.sharded.hessian`): the graph of a
    gradient taken with ``create_graph=True`` holds the gathered parameters, which FSDP would
    free after the forward (and after each backward). Set with FSDP's public
    ``set_reshard_after_forward`` and ``set_reshard_after_backward``; on exit every module's
    own settings are put back as they were (read from its state: FSDP has no getter) and its
    parameters resharded.
    """
    saved = []
    for m in modules:
        state = m._get_fsdp_state()
        groups = [
            (g, g.post_forward_mesh_info, g.reshard_after_backward)
            for g in state._fsdp_param_groups
        ]
        saved.append((m, state, state._auto_reshard_after_forward, groups))
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        yield
    finally:
        for _module, state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for g, after_forward, after_backward in groups:
                g.post_forward_mesh_info = after_forward
                g.reshard_after_backward = after_backward
        for m in modules:
            m.reshard()


# -- an all-gather that writes θ′ into its input first --------------------------------------------
def _comm_init(self: Any, inner: Any, fill: Callable[[Tensor], None]) -> None:
    self.inner, self.fill = inner, fill


def _comm_allocate(self: Any, size: Sequence[int], *, dtype: torch.dtype, device: Any) -> Tensor:
    return self.inner.allocate(size, dtype=dtype, device=device)


def _comm_call(self: Any, output_tensor, input_tensor, group, async_op=False):
    self.fill(input_tensor)
    return self.inner(
        output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op
    )


_COMM: list[type] = []


def endpoint_all_gather(inner: Any, fill: Callable[[Tensor], None]) -> Any:
    """FSDP's all-gather ``inner`` of one module, ``fill(input)`` called on its input first.

    For :meth:`FSDPModule.set_custom_all_gather`. The class subclasses FSDP2's ``AllGather``
    (imported from its private module on first use, made once).
    """
    if not _COMM:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

        ns = {"__init__": _comm_init, "allocate": _comm_allocate, "__call__": _comm_call}
        _COMM.append(type("EndpointAllGather", (AllGather,), ns))
    return _COMM[0](inner, fill)


# -- one rank: FSDP copies the shard, no collective ------------------------------------------------
#: The attribute of a parameter record that holds its ``θ′`` writer while a loss runs.
THETA = "_geosharp_theta"

_THETA_CLASSES: dict[type, type] = {}


def _theta_inputs(base: type) -> property:
    def all_gather_inputs(self: Any) -> list[Tensor]:
        out = base.all_gather_inputs.fget(self)  # type: ignore[attr-defined]
        writer = getattr(self, THETA)
        if not writer.active:
            return out
        data = out[0]
        own = _ptr(data) == _ptr(sharded_param_data(self))
        buf = data.clone() if own else data
        writer(buf)
        return [buf]

    return property(all_gather_inputs)


def theta_param_class(base: type) -> type:
    """FSDP's parameter class ``base`` whose all-gather input is ``θ′`` (a world of one rank).

    With one rank FSDP gathers nothing: it copies ``all_gather_inputs`` (the shard) into the
    unsharded parameter. This subclass (made once per ``base``), given to the parameters
    holding block rows while the loss runs (:func:`theta_inputs`), returns a copy of the shard
    with the rank's rows of ``θ′`` written into it.
    """
    if base not in _THETA_CLASSES:
        ns = {"all_gather_inputs": _theta_inputs(base)}
        _THETA_CLASSES[base] = type("ThetaParam", (base,), ns)
    return _THETA_CLASSES[base]


@contextlib.contextmanager
def theta_inputs(fsdp_params: Sequence[tuple[Any, Any]]) -> Iterator[None]:
    """Within: each ``(fsdp_param, writer)``'s all-gather input is a copy ``writer`` fills.

    ``writer.active``: whether to write (else the shard as it is); ``writer(buffer)`` writes
    the rank's rows of ``θ′`` into the copy of the flat padded shard. Every parameter gets its
    class back on exit.
    """
    swapped: list[tuple[Any, type]] = []
    try:
        for fp, writer in fsdp_params:
            swapped.append((fp, type(fp)))
            fp.__class__ = theta_param_class(type(fp))
            setattr(fp, THETA, writer)
        yield
    finally:
        for fp, cls in swapped:
            fp.__class__ = cls
            delattr(fp, THETA)


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()
