"""Counts the kernel-launching aten ops a piece of code dispatches (issue 43).

Shared by ``tests/test_launch_counts.py`` and ``benchmarks/launches.py`` (which imports it as
``tests.launch_counter``, as ``benchmarks/gpu_cli_check.py`` imports from ``tests``).

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op below autograd:
the forward, the backward (the autograd engine carries the mode into the backward) and the
geometry alike, after composite ops have been decomposed (``linear`` arrives as ``t`` and
``addmm``). What counts as a *launch*, deterministically, from the op alone:

- **left out** (no kernel: metadata or aliasing only): every op whose schema returns an alias
  of an input (``OpOverload.is_view``: view, expand, t, transpose, permute, select, slice,
  as_strided, detach, alias, unsqueeze, squeeze, split, unbind, diagonal, ...), the in-place
  views (tag ``inplace_view``: ``unsqueeze_``, ``t_``, ``as_strided_``, ...), and the few
  metadata ops whose schema does not say so (``_unsafe_view``, ``set_``, ``resize_``, ...);
- **allocations** (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ...): memory
  but no kernel; counted apart (:attr:`Count.allocs`), not as launches;
- **launches**: everything else, each call one launch. ``_local_scalar_dense`` (``.item()``,
  ``float(t)``) counts as a launch (a device-to-host copy on a GPU, and a sync) and is also
  counted apart (:attr:`Count.host_reads`). A CPU kernel that a GPU would split in several
  launches (or fuse) still counts once: the figure is dispatched ops, the launches' floor.

With every launch the elements its outputs hold are summed (:attr:`Count.elements`: what it
writes; an in-place op writes its whole output, but an indexed one, ``index_copy_``,
``index_fill_``, ``index_put_``, the rows it writes; a multi-tensor in-place op,
``_foreach_add_``, which returns nothing, every tensor it writes), and the dtype casts are counted
(:attr:`Count.casts`: ``_to_copy`` to another dtype, or ``copy_`` between dtypes).

The count depends only on the ops dispatched, never on time, so it is the same from one run
to the next (checked by ``tests/test_launch_counts.py``) and a test may bound it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten

#: Metadata or aliasing ops whose schema does not mark them as views.
METADATA = frozenset(
    {
        "_unsafe_view",
        "set_",
        "resize_",
        "resize_as_",
        "_resize_output_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_contiguous",
        "is_same_size",
        "_has_same_storage_numel",
        "_nested_tensor_size",
        "_version",
        "record_stream",
        "_conj",  # a lazy flag (a view); conj_physical writes
        "_neg_view",
    }
)

#: Allocations without a kernel: counted apart, not as launches.
ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)

#: Host reads (``.item()``): launches, also counted apart.
HOST_READS = frozenset({"_local_scalar_dense"})


def kind_of(func: torch._ops.OpOverload) -> str:
    """``"view"``, ``"alloc"`` or ``"launch"``: how :class:`LaunchCounter` counts ``func``."""
    name = func.overloadpacket.__name__
    if name in METADATA or func.is_view or torch.Tag.inplace_view in func.tags:
        return "view"
    if name in ALLOCATIONS:
        return "alloc"
    return "launch"


@dataclass
class Count:
    """What a piece of code dispatched: launches, elements written, casts, per op."""

    #: op name (the overload packet: ``add_``, ``mm``) → launches
    ops: Counter = field(default_factory=Counter)
    #: op name → elements its outputs held, summed over its launches
    op_elements: Counter = field(default_factory=Counter)
    allocs: int = 0
    views: int = 0
    casts: int = 0
    host_reads: int = 0

    @property
    def launches(self) -> int:
        return sum(self.ops.values())

    @property
    def elements(self) -> int:
        return sum(self.op_elements.values())

    def __sub__(self, other: Count) -> Count:
        """The difference, op by op (zero and negative entries kept out of ``most_common``)."""
        return Count(
            ops=Counter({k: self.ops[k] - other.ops[k] for k in self.ops | other.ops}),
            op_elements=Counter(
                {
                    k: self.op_elements[k] - other.op_elements[k]
                    for k in self.op_elements | other.op_elements
                }
            ),
            allocs=self.allocs - other.allocs,
            views=self.views - other.views,
            casts=self.casts - other.casts,
            host_reads=self.host_reads - other.host_reads,
        )

    def summary(self) -> dict:
        """The totals as a dict (JSON)."""
        return {
            "launches": self.launches,
            "elements": self.elements,
            "casts": self.casts,
            "host_reads": self.host_reads,
            "allocs": self.allocs,
            "views": self.views,
        }

    def top(self, n: int = 10) -> list[tuple[str, int, int]]:
        """The ``n`` ops with the most launches: ``(name, launches, elements)``."""
        ranked = sorted(((c, k) for k, c in self.ops.items() if c > 0), key=lambda t: (-t[0], t[1]))
        return [(k, c, self.op_elements[k]) for c, k in ranked[:n]]


def _index_copy(args: tuple, kwargs: dict) -> int:  # (self, dim, index, source)
    return _arg(args, kwargs, 3, "source").numel()


def _index_fill(args: tuple, kwargs: dict) -> int:  # (self, dim, index, value)
    t, dim, index = args[0], _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "index")
    return index.numel() * (t.numel() // max(t.shape[dim] if t.dim() else 1, 1))


def _index_put(args: tuple, kwargs: dict) -> int:  # (self, indices, values, accumulate)
    t, indices = args[0], list(_arg(args, kwargs, 1, "indices"))
    if not indices or any(i is None for i in indices):  # slices among the indices: say all
        return t.numel()
    if len(indices) == 1 and indices[0].dtype == torch.bool:
        mask = indices[0]
        return int(mask.sum()) * (t.numel() // max(mask.numel(), 1))
    picked = torch.broadcast_shapes(*(i.shape for i in indices)).numel()
    return picked * (t.numel() // max(math.prod(t.shape[: len(indices)]), 1))


def _arg(args: tuple, kwargs: dict, i: int, name: str):
    return args[i] if i < len(args) else kwargs[name]


#: In-place ops that write some rows of their output only: name → the elements they write.
PARTIAL_WRITES = {"index_copy_": _index_copy, "index_fill_": _index_fill, "index_put_": _index_put}


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """Elements an op writes: its outputs', or, for an in-place op that returns nothing (the
    multi-tensor ``_foreach_*_`` ops), those of the arguments its schema marks as written; an
    in-place indexed write (:data:`PARTIAL_WRITES`) counts the rows it writes, not its
    whole output."""
    partial = PARTIAL_WRITES.get(func.overloadpacket.__name__)
    if partial is not None:
        return partial(args, kwargs)
    n = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    if n or func._schema.returns:
        return n
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            n += sum(t.numel() for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return n


def _is_cast(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str) -> bool:
    if name == "_to_copy":
        dtype = kwargs.get("dtype")
        return dtype is not None and isinstance(args[0], torch.Tensor) and dtype != args[0].dtype
    if name == "copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.dtype != dst.dtype
    return False


class LaunchCounter(TorchDispatchMode):
    """Counts, while active, the ops dispatched (see the module docstring); :attr:`count`."""

    def __init__(self) -> None:
        super().__init__()
        self.count = Count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = kind_of(func)
        c = self.count
        if kind == "view":
            c.views += 1
            return out
        if kind == "alloc":
            c.allocs += 1
            return out
        name = func.overloadpacket.__name__
        c.ops[name] += 1
        c.op_elements[name] += _written(func, args, kwargs, out)
        if name in HOST_READS:
            c.host_reads += 1
        elif _is_cast(func, args, kwargs, name):
            c.casts += 1
        return out


def count(fn, *args, **kwargs) -> tuple[Count, object]:
    """``fn(*args, **kwargs)`` under a :class:`LaunchCounter`: its count and its result."""
    with LaunchCounter() as counter:
        result = fn(*args, **kwargs)
    return counter.count, result


def per_step(low: Count, high: Count, n_low: int, n_high: int) -> dict:
    """Per step from two calls at ``n_low < n_high`` steps: ``(high − low) / (n_high − n_low)``.

    Returns the totals (``launches``, ``elements``, ``casts``, ``host_reads``, ``allocs``) per
    step as floats and ``"diff"``, the op-by-op :class:`Count` difference (not divided).
    """
    d = high - low
    k = n_high - n_low
    out = {key: v / k for key, v in d.summary().items() if key != "views"}
    out["diff"] = d
    return out
