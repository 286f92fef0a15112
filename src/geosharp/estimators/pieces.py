"""The pieces of a perturbation: parts of ``θ``, each with its geometry, and where they lie.

A :class:`~geosharp.estimators.perturbation.Perturbation` splits the flat parameters of a
:class:`~geosharp.symmetry.ParameterSpace` into :class:`Piece` objects: one per group of
symmetry blocks of one batch key on one device (all heads of equal shape of all layers there,
one batched geometry) and one for the coordinates in no block. This module holds the piece and
the helpers that lay the base point out as pieces; none stores a parameter-sized index
(positions are built when asked, from the blocks' recipes or the space's layout), and each
reads its parameters where they are: a model split across devices (``device_map="auto"``) has
its block pieces on their parameters' devices, with no concatenation of ``θ₀``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from geosharp.estimators.factor_plan import _Factor, _factor_plan, batched_shapes, read_parts
from geosharp.geometry import ElementwiseGeometry, EuclideanGeometry, FixedGeometry, Geometry
from geosharp.geometry.base import Tangent
from geosharp.geometry.gl_rows import RowSum
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.blocks import SymmetryBlock
from geosharp.symmetry.positions import Positions, as_tensor

__all__ = ["Built", "PerturbationOptions", "Piece", "RankSums", "Xi", "build_pieces"]

MEASURES = ("geodesic", "adaptive", "euclidean")
PERTURB = ("all", "blocks")
BLOCK_METRICS = ("inv", "mix", "adaptive")


@dataclass(frozen=True)
class PerturbationOptions:
    """What a :class:`~geosharp.estimators.perturbation.Perturbation` is made of, checked.

    The fields are :class:`~geosharp.estimators.perturbation.Perturbation`'s keyword arguments
    of the same names (see there).

    Raises:
        ValueError: On an unknown ``perturb``, ``measure`` or block ``metric``, or
            ``perturb="blocks"`` with a measure other than ``"geodesic"``.
    """

    measure: str = "geodesic"
    metric: str = "inv"
    order: int | str = 2
    eps: float = 0.0
    corrected_norm: bool = True
    exact_steps: int = 10
    perturb: str = "all"
    work_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.perturb not in PERTURB:
            raise ValueError(f"perturb must be one of {PERTURB}, got {self.perturb!r}")
        if self.perturb == "blocks" and self.measure != "geodesic":
            raise ValueError(
                "perturb='blocks' needs measure='geodesic' (metric='adaptive', order=1 is "
                "adaptive sharpness of the blocks)"
            )
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {self.measure!r}")
        if self.measure == "geodesic" and self.metric not in BLOCK_METRICS:
            raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {self.metric!r}")


@dataclass(frozen=True)
class RankSums:
    """What one rank of a sharded model gives its perturbation (every field ``None``: no ranks).

    Attributes:
        row_sum: Sums an ``h × h`` contraction of the rank's rows of the blocks' factors over
            the ranks (:attr:`GLExecution.row_sum <geosharp.geometry.GLExecution.row_sum>`).
        reduce: Sums a tensor of partial sums over the ranks (every norm and pairing).
        draws: Draws the rank's part of the unsharded noise (``random(pert, generator,
            scale)``, ``uniform(pert, generator)``).
    """

    row_sum: RowSum | None = None
    reduce: Callable[[Tensor], Tensor] | None = None
    draws: Any = None


#: A perturbation: one tangent tuple per piece.
Xi = list[Tangent]


class Piece:
    """One part of ``θ`` with its geometry.

    Attributes:
        name: Readable name (for summaries and errors).
        index: Global positions in ``θ``, one tensor per component of the point (built on
            each access from the blocks or the space: a piece stores no parameter-sized index).
        geometry: Geometry used for the horizontal projection and the geodesic.
        norm_geometry: Geometry of the ball and of the Riemannian gradient (differs from
            ``geometry`` only in the "no corrected norm" ablation).
        order: Geodesic order used for this piece.
    """

    def __init__(
        self,
        name: str,
        index: tuple[Tensor, ...] | Callable[[], tuple[Tensor, ...]],
        geometry: Geometry,
        norm_geometry: Geometry,
        order: int | str,
    ) -> None:
        self.name = name
        self._index = index
        self.geometry = geometry
        self.norm_geometry = norm_geometry
        self.order = order

    @property
    def index(self) -> tuple[Tensor, ...]:
        """Global positions in ``θ`` of every component (a new tensor per access)."""
        return self._index() if callable(self._index) else self._index

    def __repr__(self) -> str:
        return f"Piece({self.name!r}, {type(self.geometry).__name__}, order={self.order})"


def _base_params(space: ParameterSpace, theta0: Tensor | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The base point by name, detached: the given tensors, or views of a flat ``θ₀``."""
    if isinstance(theta0, Tensor):
        return {n: t.detach() for n, t in space.unflatten(theta0.detach()).items()}
    checked = space.checked(theta0, "the base point")
    return {n: t.detach() for n, t in zip(space.param_names, checked, strict=True)}


def _flat_dtype(tensors: Iterable[Tensor]) -> torch.dtype:
    """The dtype of the tensors as one vector: what their concatenation would have."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def _rest_positions(
    space: ParameterSpace,
    layout: Sequence[tuple[int, Tensor | None]],
    devices: Sequence[torch.device],
) -> Callable[[], tuple[Tensor, ...]]:
    """Global positions of the rest components, built when asked (no index is stored).

    Each component's positions are made on the device of its parameter (``devices[j]``).
    """
    return lambda: tuple(space.layout_positions([(j, local)], devices[j])[0] for j, local in layout)


def _row_positions(piece: Piece, cut: Mapping[int, Tensor], full: Sequence[Tensor]) -> Callable:
    """Global positions of a rest piece some of whose components are cut to rows."""

    def positions() -> tuple[Tensor, ...]:
        out = list(piece.index)
        for c, r in cut.items():
            row = full[c][0].numel()
            per_row = out[c].reshape(full[c].shape[0], row)
            out[c] = per_row.index_select(0, r.to(per_row.device)).reshape(-1)
        return tuple(out)

    return positions


def _block_positions(cls: type, blocks: list, device: torch.device) -> Callable:
    """Global positions of a batched block piece, built when asked (the blocks hold them)."""
    return lambda: tuple(i.to(device) for i in cls.batch(blocks))


def _block_params(space: ParameterSpace, block: SymmetryBlock) -> list[int]:
    """The parameters (positions in the space) holding coordinates of ``block``, sorted.

    Read from the blocks' :class:`~geosharp.symmetry.positions.Positions` recipes (the offset
    of every sliced parameter) without building a position; a hand-made position tensor is
    located on the host.
    """
    shapes = zip(space.offsets, space.shapes, strict=True)
    owner = {int(off): j for j, (off, shape) in enumerate(shapes) if math.prod(shape)}
    found: set[int] = set()
    for field in block.index_fields:
        pos = getattr(block, field)
        if isinstance(pos, Positions):
            parts = [owner.get(int(off)) for _, _, off in pos.recipe[0]]
            if None not in parts:
                found.update(parts)  # type: ignore[arg-type]
                continue
        flat = as_tensor(pos).reshape(-1).to("cpu", torch.long)
        if flat.numel():
            found.update(torch.unique(space.owners(flat)).tolist())
    return sorted(found)


def _group_blocks(
    space: ParameterSpace, devices: Sequence[torch.device] | None = None
) -> list[tuple[torch.device | None, list]]:
    """Blocks grouped by (:meth:`~geosharp.symmetry.SymmetryBlock.batch_key`, device).

    Each group becomes one batched geometry (e.g. all QK heads of equal shape of all layers
    on one device), made on the device of its blocks' parameters: a batched geometry never
    mixes devices (a model split across devices, ``device_map="auto"``). Groups come in
    first-seen order, so on one device they are the groups of the batch keys alone.

    A block whose own parameters lie on two devices is refused: its factors meet in every
    product of its geometry (``GᵀG`` with ``HᵀH``, the pair's two sides), so splitting it
    would move a parameter slice, not a scalar or an ``h × h`` factor, between devices.

    Args:
        space: The parameter space.
        devices: The device of every parameter of the space (``None``: one device, the
            groups' device left ``None``).

    Raises:
        ValueError: If a block's parameters lie on more than one device.
    """
    groups: dict = {}
    for b in space.blocks:
        device = None
        if devices is not None:
            own = {devices[j] for j in _block_params(space, b)}
            if len(own) > 1:
                names = ", ".join(str(d) for d in sorted(own, key=str))
                raise ValueError(
                    f"symmetry block {b.name!r} has parameters on several devices ({names}): "
                    "keep each attention layer on one device (e.g. no_split_module_classes)"
                )
            device = own.pop() if own else devices[0] if devices else None
        groups.setdefault((b.batch_key(), device), (device, []))[1].append(b)
    return list(groups.values())


def _block_point(
    space: ParameterSpace,
    index: Sequence[Tensor],
    params: Sequence[Tensor],
    dtype: torch.dtype,
) -> tuple[Tensor, ...]:
    """The base point of one batched block piece: ``θ₀[i]`` for every component index ``i``.

    Read from the parameters holding the positions, each on its own device (the index's),
    with no concatenation of the parameters: per parameter, the positions in it are gathered
    from it (values converted to ``dtype``, the dtype ``θ₀`` would have as one vector).

    Args:
        space: The parameter space.
        index: Global positions of every component, on the device of the block's parameters.
        params: Every parameter of the space, in order.
        dtype: The dtype of the point.
    """
    out = []
    for i in index:
        values = torch.empty(i.shape, dtype=dtype, device=i.device)
        # in chunks of whole rows of dimension 0 (heads of consecutive layers): a chunk's
        # positions lie in a few parameters, so the per-parameter selection below costs
        # O(chunk × its parameters), not O(all positions × all the group's parameters)
        whole = i.dim() < 2 or not len(i)
        rows = max(1, len(i)) if whole else max(1, _GATHER_CHUNK // max(1, i[0].numel()))
        for start in range(0, len(i), rows):
            chunk = i[start : start + rows]
            if chunk.numel():
                values[start : start + rows] = _gather(
                    space, chunk.reshape(-1), params, dtype
                ).view(chunk.shape)
        out.append(values)
    return tuple(out)


#: positions gathered at once by :func:`_block_point` (whole rows of the index's dimension 0)
_GATHER_CHUNK = 1 << 22


def _gather(
    space: ParameterSpace, flat: Tensor, params: Sequence[Tensor], dtype: torch.dtype
) -> Tensor:
    """``θ₀[flat]`` read from the parameters holding the positions, converted to ``dtype``."""
    owner = space.owners(flat)  # the parameters the positions lie in
    counts = torch.bincount(owner, minlength=len(space.offsets))  # one per parameter
    js = torch.nonzero(counts).reshape(-1).tolist()
    if len(js) == 1:
        j = js[0]
        return params[j].reshape(-1)[flat - space.offsets[j]].to(dtype)
    values = torch.empty(flat.shape, dtype=dtype, device=flat.device)
    for j in js:
        sel = torch.nonzero(owner == j).reshape(-1)
        values[sel] = params[j].reshape(-1)[flat[sel] - space.offsets[j]].to(dtype)
    return values


def _block_pieces(
    space: ParameterSpace,
    params: Sequence[Tensor],
    groups: Sequence[tuple[torch.device | None, list]],
    options: PerturbationOptions,
    row_sum: RowSum | None = None,
) -> tuple[list[Piece], list[list[_Factor] | None]]:
    """One piece per group of symmetry blocks, its geometry made on the group's device.

    Returned with each piece's view plan (:func:`~geosharp.estimators.factor_plan._factor_plan`,
    ``None`` where its blocks' layout is no view of the parameters), which the assembly uses
    too. See :class:`~geosharp.estimators.perturbation.Perturbation` for the arguments.
    """
    split = {} if row_sum is None else {"row_sum": row_sum}  # rows split over ranks
    metric, eps, work_dtype = options.metric, options.eps, options.work_dtype
    pieces: list[Piece] = []
    plans: list[list[_Factor] | None] = []
    dtype = _flat_dtype(params)  # the dtype of θ₀ as one vector
    for device, blocks in groups:
        cls = type(blocks[0])
        at = device if device is not None else params[0].device
        plan = _factor_plan(space, blocks)
        plans.append(plan)
        if plan is not None:  # the blocks' slices are views of the parameters: no position
            shapes = batched_shapes(blocks)
            point = tuple(
                read_parts(f, params, shape, dtype, at)
                for f, shape in zip(plan, shapes, strict=True)
            )
        else:
            index = tuple(i.to(at) for i in cls.batch(blocks))
            point = _block_point(space, index, params, dtype)
            del index
        if metric == "adaptive":
            geom: Geometry = ElementwiseGeometry(point, name=cls.__name__)
            piece_order: int | str = 1
        else:
            geom = cls.geometry(
                blocks, point, metric=metric, eps=eps, work_dtype=work_dtype, **split
            )
            piece_order = options.order
        if options.corrected_norm or geom.is_trivial:
            norm_geom = geom
        else:  # the adaptive norm, on tangents kept in the block geometry's dtype
            wide = geom.tangent_dtype
            norm_geom = ElementwiseGeometry(tuple(p.to(wide) for p in point))
        name = blocks[0].name if len(blocks) == 1 else getattr(geom, "name", cls.__name__)
        pieces.append(Piece(name, _block_positions(cls, blocks, at), geom, norm_geom, piece_order))
    return pieces, plans


class Built(NamedTuple):
    """The pieces of a perturbation (:func:`build_pieces`)."""

    pieces: list[Piece]
    rest: int | None  #: the position of the piece of the coordinates in no block
    layout: list[tuple[int, Tensor | None]]  #: the rest piece's components (rest_layout)
    #: each block piece's view plan (None where its layout is no view; None: no blocks)
    plans: list[list[_Factor] | None] | None


def build_pieces(
    space: ParameterSpace,
    params: Mapping[str, Tensor],
    devices: Sequence[torch.device],
    options: PerturbationOptions,
    row_sum: RowSum | None = None,
) -> Built:
    """The pieces of a perturbation at the base point ``params`` (by name).

    ``measure="adaptive"`` / ``"euclidean"``: one element-wise piece over every parameter;
    ``"geodesic"``: one batched geometry per batch key and device (its base point read from its
    own parameters there, no concatenation of ``θ₀``), then the coordinates in no block (held
    fixed with ``perturb="blocks"``). See :class:`~geosharp.estimators.perturbation.
    Perturbation` for the arguments.

    Raises:
        ValueError: If the blocks and the rest do not cover the space.
    """
    names, measure = space.param_names, options.measure
    if measure in ("adaptive", "euclidean"):
        comps = tuple(params[n] for n in names)
        cls_ = ElementwiseGeometry if measure == "adaptive" else EuclideanGeometry
        g = cls_(comps, name="all parameters")
        layout: list[tuple[int, Tensor | None]] = [(j, None) for j in range(len(names))]
        index = _rest_positions(space, layout, devices)
        return Built([Piece(f"all parameters ({measure})", index, g, g, 1)], 0, layout, None)
    groups = _group_blocks(space, devices)
    pieces, plans = _block_pieces(space, [params[n] for n in names], groups, options, row_sum)
    layout = space.rest_layout()
    rest = None
    if layout:
        comps = tuple(
            params[names[j]]
            if local is None
            else params[names[j]].reshape(-1)[local.to(devices[j])]
            for j, local in layout
        )
        index = _rest_positions(space, layout, devices)
        if options.perturb == "blocks":  # attention-only: everything outside the blocks held fixed
            label = "other parameters (held fixed)"
            geom: Geometry = FixedGeometry(comps, name=label)
        else:
            label = "other parameters (adaptive)"
            geom = ElementwiseGeometry(comps, name="other parameters")
        rest = len(pieces)
        pieces.append(Piece(label, index, geom, geom, 1))
    covered = space.block_numel + space.adaptive_numel
    if covered != space.numel():
        raise ValueError(
            f"the symmetry blocks and the rest cover {covered} coordinates of "
            f"{space.numel()}: the ParameterSpace is inconsistent"
        )
    return Built(pieces, rest, layout, plans)
