"""The protocol every symmetry block implements, and the registry that builds blocks from specs.

A block knows

* **where its coordinates are**: :attr:`SymmetryBlock.indices`, global flat positions into
  ``θ``, one tensor per factor (``(G, H)``, ``(u, v)``, ``(b,)``), so gathering and scattering
  is one indexing operation whatever the architecture;
* **how it is built from its spec**: a block class names the spec type it builds
  (:attr:`SymmetryBlock.spec_type`) and builds itself from one with
  :meth:`~SymmetryBlock.from_spec`, reading positions from a :class:`Coordinates`;
  :func:`block_from_spec` finds the class of a spec in the registry those classes fill;
* **its group**: :meth:`~SymmetryBlock.random_element` draws an element, and
  :meth:`~SymmetryBlock.act` applies it to the block's factors (the network function is
  unchanged);
* **the geometry it builds**: :meth:`~SymmetryBlock.geometry` makes the
  :class:`~geosharp.geometry.Geometry` of a batch of blocks with equal :meth:`batch_key` (all
  heads of all layers in one set of batched matmuls), whose horizontal space is the quotient by
  the block's group;
* **what callers outside the symmetry layer may ask of it**: :attr:`~SymmetryBlock.gl_pairs`,
  :attr:`~SymmetryBlock.whole_gl` (the balance diagnostics) and
  :attr:`~SymmetryBlock.shard_layout` and :meth:`~SymmetryBlock.sharded_layout` (how its
  coordinates are split over the ranks of a model sharded by FSDP2, or the one-line refusal),
  so no caller asks for a block's class;
* **how it is reported**: :attr:`~SymmetryBlock.category` (summaries, budget splits,
  diagnostics), :attr:`~SymmetryBlock.family` (the "parameters per geometry" table) and
  :attr:`~SymmetryBlock.space_note` (a remark of every space holding such a block).

:class:`~geosharp.symmetry.ParameterSpace`, :func:`~geosharp.symmetry.find_symmetries`,
:func:`~geosharp.symmetry.reparametrize`, the invariance proof and the perturbation of the
sharpness measures loop over blocks through this protocol and never ask their kind.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from geosharp.geometry import Geometry
from geosharp.geometry.gl_rows import RowSum
from geosharp.symmetry.positions import Positions, as_tensor
from geosharp.symmetry.specs import ParamSlice

__all__ = ["Coordinates", "SymmetryBlock", "block_from_spec", "spec_types"]

#: Redraws of a random group element before giving up.
MAX_TRIES = 100


def _on(index: Tensor, theta: Tensor) -> Tensor:
    """``index`` on the device of ``theta``."""
    return index if index.device == theta.device else index.to(theta.device)


class Coordinates(Protocol):
    """Where the parameters of a model sit in ``θ``: what :meth:`SymmetryBlock.from_spec` reads.

    Implemented by the finder over the trainable parameters of one model. ``owner`` is the
    phrase naming the spec in error messages (e.g. ``"block 'attn[QK]'"``).
    """

    def name(self, alias: str, owner: str) -> str:
        """The canonical name of parameter ``alias`` (a tied weight's first name).

        Raises:
            ValueError: If ``alias`` is no parameter of the model, or it is frozen (then the
                finder leaves the spec out: a frozen parameter is not in ``θ``).
        """
        ...

    def shape(self, name: str) -> torch.Size:
        """The shape of the parameter with canonical ``name``."""
        ...

    def whole(self, name: str) -> Positions:
        """The positions of every coordinate of parameter ``name``, shaped like it."""
        ...

    def slices(
        self, pieces: Sequence[ParamSlice], heads: int, head_dim: int, owner: str
    ) -> Positions:
        """The positions of ``pieces``, cut into heads and stacked row-wise.

        Each piece is cut into ``heads`` blocks of ``head_dim`` features (see
        :mod:`~geosharp.symmetry.specs`); the result is shaped ``(heads, rows, head_dim)``.

        Raises:
            ValueError: As :meth:`name`, or if a slice does not fit its heads.
        """
        ...


#: spec type → the block classes building it, in the order they were defined.
_BUILDERS: dict[type, list[type[SymmetryBlock]]] = {}


class SymmetryBlock(ABC):
    """The protocol every symmetry block implements (see the module docstring).

    Subclasses are frozen dataclasses with ``name``, ``kind`` and ``module`` fields and one or
    more index tensors, listed by :attr:`index_fields`. A concrete subclass with a
    :attr:`spec_type` (its own or inherited) is registered as a builder of that spec type when
    it is defined: the finder then turns every spec of that type into such a block, with no
    list of block kinds anywhere else.
    """

    name: str
    kind: str
    module: str
    #: The spec type this class builds blocks from (``None``: built by hand only).
    spec_type: ClassVar[type | None] = None
    #: A remark added to the notes of every space holding a block of this class.
    space_note: ClassVar[str | None] = None
    #: Names of the dataclass fields holding the index tensors, in factor order.
    index_fields: ClassVar[tuple[str, ...]] = ()
    #: Whether :meth:`batch` flattens each block's positions before concatenating them
    #: (instead of concatenating along the head axis).
    batch_flat: ClassVar[bool] = False
    #: Whether the block is a batch of pairs ``(G_b, H_b)`` on which the network depends through
    #: ``G_b H_bᵀ``, with GL(h) or a subgroup acting by ``(G A⁻¹, H Aᵀ)``: the balance of
    #: ``GᵀG`` against ``HᵀH`` per head is defined (:attr:`indices` are ``(G, H)``).
    gl_pairs: ClassVar[bool] = False
    #: Whether the group is the whole of GL(h) on such pairs, not a subgroup: the least norm on
    #: an orbit is then GL(h)'s closed form.
    whole_gl: ClassVar[bool] = False
    #: How the coordinates lie on the ranks of a model sharded by FSDP2: ``"rows"`` (every
    #: factor's rows of ``h`` coordinates, each row whole on one rank, the heads' rows spread
    #: over the ranks), ``"coordinates"`` (each coordinate where its parameter's shard puts it)
    #: or ``None`` (not supported on a sharded model: a sharded run refuses it, naming the
    #: class).
    shard_layout: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.spec_type is not None:
            _BUILDERS.setdefault(cls.spec_type, []).append(cls)

    # -- from a spec --------------------------------------------------------------------------
    @classmethod
    def builds(cls, spec: Any) -> bool:
        """Whether this class builds ``spec`` (of its :attr:`spec_type`); default: every one.

        A subclass narrowing its parent's group accepts the specs that call for it (e.g. a
        rotary spec); of the classes accepting a spec, the most derived one builds it.
        """
        return True

    @classmethod
    def from_spec(cls, spec: Any, coords: Coordinates) -> SymmetryBlock:
        """The block ``spec`` describes, with its positions in ``θ`` read from ``coords``.

        Raises:
            ValueError: If the spec names a missing or frozen parameter, or does not fit it.
        """
        raise NotImplementedError(f"{cls.__name__} is not built from a spec")

    # -- coordinates ------------------------------------------------------------------------
    @property
    def indices(self) -> tuple[Tensor, ...]:
        """Global flat positions into ``θ``, one tensor per factor.

        A field may hold a :class:`~geosharp.symmetry.positions.Positions` (what
        :func:`~geosharp.symmetry.find_symmetries` stores: no tensor held between uses); the
        tensors returned here are then built for the caller.
        """
        return tuple(as_tensor(getattr(self, f)) for f in self.index_fields)

    @property
    def index_shapes(self) -> tuple[torch.Size, ...]:
        """The shapes of :attr:`indices`, without building them."""
        return tuple(torch.Size(getattr(self, f).shape) for f in self.index_fields)

    @property
    def numel(self) -> int:
        """Number of coordinates of ``θ`` in this block."""
        return sum(math.prod(s) for s in self.index_shapes)

    def positions(self) -> Tensor:
        """All positions of the block, flattened."""
        return torch.cat([i.reshape(-1) for i in self.indices])

    def gather(self, theta: Tensor) -> tuple[Tensor, ...]:
        """Read the factors out of a flat parameter vector (differentiable).

        Args:
            theta: Flat vector ``θ`` of the owning :class:`~geosharp.symmetry.ParameterSpace`.

        Returns:
            One tensor per factor, shaped like its index.
        """
        return tuple(theta[_on(i, theta)] for i in self.indices)

    def scatter(self, theta: Tensor, *parts: Tensor) -> Tensor:
        """Return a copy of ``θ`` with the block's factors replaced by ``parts`` (differentiable).

        Args:
            theta: Flat vector ``θ`` (not modified).
            *parts: New factors, shaped like the indices.

        Returns:
            The updated flat vector.
        """
        for i, p in zip(self.indices, parts, strict=True):
            theta = theta.index_put((_on(i, theta),), p)
        return theta

    def to(self, device: torch.device | str) -> SymmetryBlock:
        """A copy with the index tensors on ``device``.

        Args:
            device: Target device.

        Returns:
            The moved block.
        """
        return replace(self, **{f: getattr(self, f).to(device) for f in self.index_fields})

    def sharded_layout(self) -> str:
        """:attr:`shard_layout`, checked: how a sharded run lays this block out on its ranks.

        Raises:
            NotImplementedError: In one line naming the block, its class and its group, if the
                class has no layout on a sharded model (``shard_layout = None``: its
                coordinates lie on different ranks).
        """
        if self.shard_layout is None:
            raise NotImplementedError(
                f"{type(self).__name__} blocks ({self.name!r}, {self.group}) on a sharded model "
                "are not implemented (their coordinates lie on different ranks)"
            )
        return self.shard_layout

    # -- the group ------------------------------------------------------------------------------
    @property
    @abstractmethod
    def count(self) -> int:
        """Number of independent group factors (heads, coordinates of a pair, biases)."""

    @property
    @abstractmethod
    def group(self) -> str:
        """Short name of the group for summaries, e.g. ``"GL(8)"``."""

    @abstractmethod
    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """A random group element (float64, on the CPU), well conditioned.

        Args:
            generator: CPU random generator.
            scale: Overall scale ``a`` of the element (the paper sweeps 1e-2 … 1e2).
            max_cond: Largest accepted condition number of a matrix factor.
        """

    @abstractmethod
    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """Apply a group element to the block's factors (differentiable; function unchanged)."""

    @abstractmethod
    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """A random vertical vector at ``parts``: the velocity of a curve in the orbit.

        Args:
            parts: The block's factors (a point).
            generator: Random generator on the device of ``parts``.

        Returns:
            A tangent vector shaped like ``parts`` along which the network does not change.
        """

    # -- the geometry -----------------------------------------------------------------------
    def batch_key(self) -> Hashable:
        """Blocks with equal keys are batched into one geometry (see :meth:`batch`)."""
        return (type(self).__name__, *(tuple(s[1:]) for s in self.index_shapes))

    @classmethod
    def batch(cls, blocks: Sequence[SymmetryBlock]) -> tuple[Tensor, ...]:
        """The indices of equally keyed blocks, concatenated along the head axis."""
        return tuple(torch.cat(parts) for parts in zip(*(b.indices for b in blocks), strict=True))

    @classmethod
    @abstractmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
        row_sum: RowSum | None = None,
    ) -> Geometry:
        """The quotient geometry of a batch of blocks at the base point ``point``.

        Args:
            blocks: Blocks with one :meth:`batch_key`, in the order of :meth:`batch`.
            point: Their factors at the base point, ``θ₀[i]`` for ``i`` in :meth:`batch`.
            metric: ``"inv"`` or ``"mix"``.
            eps: Damping of Gram matrices.
            work_dtype: Dtype of the per-step products, where the geometry offers one
                (GL-type blocks; ``None``: its float64 default). Tangents are kept in the
                point's dtype either way.
            row_sum: The point holds this rank's rows of the factors only (a model sharded
                by FSDP2, SPEC §10); ``row_sum`` sums an ``h × h`` contraction over the ranks
                (:mod:`~geosharp.geometry.gl_rows`). ``None``: every row is here. A geometry
                that cannot run on split rows raises ``NotImplementedError``.
        """

    # -- presentation -----------------------------------------------------------------------
    @property
    def category(self) -> str:
        """The block's category in summaries, budget splits and diagnostics (e.g. ``"QK"``)."""
        return str(self.kind)

    @property
    def shape_label(self) -> str:
        """The factors' shapes for summaries, e.g. ``"G 33×8, H 32×8"``."""
        return " × ".join(str(tuple(s[1:])) for s in self.index_shapes)

    #: Label of this block class in the "parameters per geometry" table.
    family: ClassVar[str] = "symmetry blocks"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.group}, count={self.count})"


def spec_types() -> tuple[type, ...]:
    """The spec types some registered block class builds, in the order they were registered."""
    return tuple(_BUILDERS)


def block_from_spec(spec: Any, coords: Coordinates) -> SymmetryBlock:
    """The block a spec describes: built by the most derived registered class accepting it.

    Args:
        spec: A spec (:class:`~geosharp.symmetry.specs.BlockSpec`, ``PairSpec``,
            ``TranslationSpec``, or the spec type of any other block class).
        coords: Where the model's parameters sit in ``θ``.

    Raises:
        TypeError: If no block class builds specs of this type, or two unrelated classes both
            accept this one.
        ValueError: From :meth:`SymmetryBlock.from_spec`.
    """
    takers = [c for c in _BUILDERS.get(type(spec), ()) if c.builds(spec)]
    best = [c for c in takers if not any(o is not c and issubclass(o, c) for o in takers)]
    if not best:
        known = ", ".join(t.__name__ for t in _BUILDERS)
        raise TypeError(
            f"no symmetry block class builds a {type(spec).__name__} (spec types: {known}); "
            "a block class names the spec type it builds in its spec_type"
        )
    if len(best) > 1:
        names = ", ".join(c.__name__ for c in best)
        raise TypeError(f"{type(spec).__name__} {spec.name!r} is claimed by {names}: ambiguous")
    return best[0].from_spec(spec, coords)
