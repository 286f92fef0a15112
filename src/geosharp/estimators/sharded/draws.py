r"""The random draws of a sharded model: every rank's part of the unsharded draw (SPEC §10.6).

The average case and random starts draw noise from the batch's generator
(:meth:`~geosharp.estimators.perturbation.Perturbation.random`,
:meth:`~geosharp.estimators.perturbation.Perturbation.uniform_box`). One process draws, piece
by piece, one ``torch.randn`` (or ``torch.rand``) over the piece's coordinates in their order
(:func:`~geosharp.geometry.draws.draw_like`; a GL(h)-type block one over ``G``, one over ``H``,
then the ``Ω`` of its covariant factors over ``G`` and over ``H`` again, in its work dtype:
:meth:`~geosharp.geometry.Geometry.normal_draws`). A rank of a sharded model holds some of
those coordinates, so it replays the same stream from a generator in the same state, chunk by
chunk (:func:`stream`), and keeps the numbers at its own coordinates (:class:`ShardedDraws`):

- the element-wise pieces (adaptive, Euclidean, the coordinates outside the blocks) keep the
  numbers of the rank's slice of every parameter (a parameter's global positions and the
  rank's slice of them: :class:`~geosharp.estimators.sharded.space._Layout`);
- a block piece keeps the rows of its factors that the rank holds, in order, at the rows the
  rank's block gives them (:mod:`~geosharp.estimators.sharded.space`); its padding rows get
  zeros, so they stay zero through the covariant factors and the horizontal projection, and
  add nothing to the ``h × h`` contractions (``Ωᵀ X`` of the factors, those of the
  projection), which are summed over the ranks;
- then the piece's geometry turns the standard normals into its noise as one process does
  (:meth:`~geosharp.geometry.Geometry.tangent_from_normals`, :func:`from_normals`).

Each rank so holds its part of the very numbers one process draws: the values equal the
unsharded ones to rounding. The replay costs ``O(P)`` time per draw (every rank draws the whole
stream) and ``O(chunk)`` memory beside the rank's noise.

The stream is drawn on the CPU. CPU ``torch.randn`` fills 16 numbers at a time: a draw of ``n``
numbers equals consecutive draws of chunks that are multiples of 16, the last one of at least
16 numbers (checked by ``tests/estimators/test_sharded_draws.py``). With a generator on another
device (a model on GPUs: the batch's generator is a CUDA one) the stream is drawn on the CPU
from a generator seeded with that generator's seed, and moved: the noise is the one an
unsharded run of the model on the CPU draws with the same seed, not that of an unsharded run on
the GPU (CUDA's generator orders its numbers by the size of the draw).
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.geometry import Geometry
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.positions import as_tensor

__all__ = ["ShardedDraws", "from_normals", "normal_draws", "stream"]

#: Numbers drawn at a time by :func:`stream` (a multiple of 16).
CHUNK = 1 << 18


def stream(
    n: int,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    sampler: Callable = torch.randn,
    chunk: int = CHUNK,
) -> Iterator[tuple[int, Tensor]]:
    """The numbers of ``sampler(n, generator=generator, dtype=dtype)`` (CPU), chunk by chunk.

    Yields ``(start, numbers)``: every chunk but the last holds ``chunk`` numbers (a multiple
    of 16), the last at least 16 (or all ``n`` when ``n < 16``), which makes them the numbers of
    one draw of ``n`` and leaves the generator where that draw leaves it.
    """
    if chunk % 16 or chunk < 16:
        raise ValueError(f"chunk must be a positive multiple of 16, got {chunk}")
    start = 0
    while n - start > chunk and n - start - chunk >= 16:
        yield start, sampler(chunk, generator=generator, dtype=dtype)
        start += chunk
    if n > start:
        yield start, sampler(n - start, generator=generator, dtype=dtype)


class _Segment:
    """A run of a stream whose numbers land at some of the rank's coordinates."""

    length: int

    def place(self, k0: int, k1: int) -> tuple[Tensor, Tensor]:
        """For the run's numbers ``k0:k1``: which the rank keeps, and where (flat positions)."""
        raise NotImplementedError

    def scatter(self, out: Tensor, z: Tensor, k0: int) -> None:
        """Write the run's numbers ``k0:k0 + len(z)`` (``z``) that the rank keeps into ``out``."""
        if z.numel():
            keep, at = self.place(k0, k0 + z.numel())
            out[at] = z[keep]


class _Rows(_Segment):
    """Rows of ``width`` numbers, row ``r`` kept at row ``dest[r]`` of the rank (``-1``: not).

    The rank's rows are ``rows`` rows of ``width`` numbers from ``offset`` in its buffer.
    """

    def __init__(self, dest: Tensor, width: int, offset: int, rows: int) -> None:
        self.dest, self.width, self.offset, self.rows = dest, width, offset, rows
        self.length = dest.numel() * width

    def place(self, k0: int, k1: int) -> tuple[Tensor, Tensor]:
        k = torch.arange(k0, k1)
        row = self.dest[k // self.width]
        keep = row >= 0
        return keep, (row * self.width + k % self.width + self.offset)[keep]

    def scatter(self, out: Tensor, z: Tensor, k0: int) -> None:
        """Whole rows row by row (one index per row); the ends' partial rows as :meth:`place`."""
        w, k1 = self.width, k0 + z.numel()
        fa, fb = -(-k0 // w), k1 // w  # the rows entirely in k0:k1
        if fb <= fa:
            return super().scatter(out, z, k0)
        super().scatter(out, z[: fa * w - k0], k0)
        super().scatter(out, z[fb * w - k0 :], fb * w)
        rows = self.dest[fa:fb]
        keep = rows >= 0
        mine = out[self.offset : self.offset + self.rows * w].view(self.rows, w)
        mine[rows[keep]] = z[fa * w - k0 : fb * w - k0].view(-1, w)[keep]


class _Slice(_Segment):
    """A parameter's coordinates (all, or ``positions`` inside it) and the rank's slice of them.

    ``mine``: where the rank's coordinates of the parameter lie in its buffer: ``(offset,
    None)`` for all of its shard, ``(offset, local)`` for its shard's flat positions ``local``
    (sorted), ``None`` when the rank holds none of them.
    """

    def __init__(self, layout: Any, numel: int, positions: Tensor | None, mine: Any) -> None:
        self.layout, self.positions, self.mine = layout, positions, mine
        self.length = numel if positions is None else positions.numel()
        shape = layout.shape
        #: the parameter as ``(outer, size, inner)``, of which the rank holds
        #: ``[:, start:start + length, :]``: one run of ``length·inner`` numbers per outer index
        self.inner = math.prod(shape[layout.dim + 1 :])
        self.size = shape[layout.dim] if shape else 1
        #: every number of the rank's slice lands in its buffer, in order (the common case)
        self.whole = positions is None and mine is not None and mine[1] is None

    def scatter(self, out: Tensor, z: Tensor, k0: int) -> None:
        """The rank's runs as slices (whole parameters), else as :meth:`place`."""
        if not self.whole:
            return super().scatter(out, z, k0)
        L, inner, size = self.layout, self.inner, self.size
        R, first, run = size * inner, L.start * inner, L.length * inner
        if not run:
            return
        base, k1 = self.mine[0], k0 + z.numel()
        fa, fb = -(-k0 // R), k1 // R  # the outer indices entirely in k0:k1
        if fb > fa:
            rows = z[fa * R - k0 : fb * R - k0].view(fb - fa, size, inner)
            out[base + fa * run : base + fb * run] = rows[:, L.start : L.start + L.length].reshape(
                -1
            )
        for o in {k0 // R, (k1 - 1) // R}:  # the outer indices cut by the chunk's ends
            if fa <= o < fb:
                continue
            lo, hi = max(k0, o * R + first), min(k1, o * R + first + run)
            if hi > lo:
                at = base + o * run + lo - o * R - first
                out[at : at + hi - lo] = z[lo - k0 : hi - k0]

    def place(self, k0: int, k1: int) -> tuple[Tensor, Tensor]:
        q = torch.arange(k0, k1) if self.positions is None else self.positions[k0:k1]
        held, p = self.layout.local(q + self.layout.offset)
        p = p[held] - self.layout.local_offset
        if self.mine is None:
            if p.numel():
                raise RuntimeError(_MISMATCH)
            return held, p
        offset, local = self.mine
        if local is not None:
            at = torch.searchsorted(local, p)
            if p.numel() and not torch.equal(local[at.clamp(max=local.numel() - 1)], p):
                raise RuntimeError(_MISMATCH)
            p = at
        return held, p + offset


_MISMATCH = (
    "the rank's coordinates of a piece differ from the unsharded piece's: the sharded draw "
    "cannot be laid out (please report this)"
)


class _Draw:
    """One draw of a stream over ``segments`` into the rank's buffer of ``size`` numbers."""

    def __init__(self, segments: Sequence[_Segment], size: int) -> None:
        self.segments = [s for s in segments if s.length]
        self.size = size
        self.ends: list[int] = []
        total = 0
        for s in self.segments:
            total += s.length
            self.ends.append(total)

    def replay(
        self,
        generator: torch.Generator | None,
        dtype: torch.dtype,
        sampler: Callable,
        chunk: int = CHUNK,
    ) -> Tensor:
        """The rank's numbers of the draw (zeros where the rank's coordinates get none)."""
        out = torch.zeros(self.size, dtype=dtype)
        n = self.ends[-1] if self.ends else 0
        for s0, z in stream(n, generator, dtype, sampler, chunk):
            s1 = s0 + z.numel()
            i = bisect.bisect_right(self.ends, s0)
            while i < len(self.segments):
                seg, end = self.segments[i], self.ends[i]
                begin = end - seg.length
                if begin >= s1:
                    break
                a, b = max(s0, begin), min(s1, end)
                seg.scatter(out, z[a - s0 : b - s0], a - begin)
                i += 1
        return out


# -- the geometries' noise from standard normals ------------------------------------------------
def normal_draws(geometry: Geometry) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
    """The draws of ``geometry.random_tangent``: per draw, the shapes it covers and its dtype.

    :meth:`~geosharp.geometry.Geometry.normal_draws`: an element-wise or Euclidean geometry
    draws once over all its components (:func:`~geosharp.geometry.draws.draw_like`), a
    GL(h)-type one four times in its work dtype — the normals over ``G``, over ``H``, then the
    ``Ω`` of its covariant factors over ``G``, over ``H`` — a fixed one never.

    Raises:
        NotImplementedError: For another geometry (diagonal pairs: never on a sharded model).
    """
    try:
        return geometry.normal_draws()
    except NotImplementedError:
        raise NotImplementedError(
            f"random draws of a {type(geometry).__name__} on a sharded model"
        ) from None


def from_normals(geometry: Geometry, z: Sequence[Tensor], scale: float) -> tuple[Tensor, ...]:
    """``geometry.random_tangent(generator, scale)`` from the standard normals it would draw.

    ``z``: one tensor per shape of :func:`normal_draws`, in order
    (:meth:`~geosharp.geometry.Geometry.tangent_from_normals`). A GL(h)-type geometry sums its
    ``h × h`` contractions ``Ωᵀ X`` over the ranks, as its projection does.
    """
    return tuple(geometry.tangent_from_normals(z, scale))


# -- the rank's part of every piece's draw --------------------------------------------------------
class ShardedDraws:
    """Draws a sharded model's noise: each rank its part of the unsharded draw.

    Set as :attr:`Perturbation.draws <geosharp.estimators.perturbation.Perturbation.draws>` of
    the rank's perturbation (:func:`~geosharp.estimators.harness.perturbation_of`); the layout
    of the draws is made at the first draw (the average case and random starts only).

    Args:
        model: The sharded model.
        shards: Its :class:`~geosharp.estimators.sharded.params.ShardedParams`.
        key_bias: As :func:`~geosharp.symmetry.find_symmetries`, when the measure lays out the
            symmetry blocks (``None``: the element-wise measures, one piece of every parameter).
    """

    def __init__(self, model: nn.Module, shards: Any, key_bias: str | None) -> None:
        self.model, self.shards, self.key_bias = model, shards, key_bias
        #: plans by perturbation, each with a weak reference to its perturbation (which holds
        #: this object: a strong one would keep it, its pieces and factors, in a cycle)
        self._plans: dict[int, tuple[weakref.ref, list]] = {}
        self._cpu: dict[int, tuple[torch.Generator, torch.Generator]] = {}

    def random(self, pert: Any, generator: torch.Generator | None, scale: float) -> list:
        """:meth:`Perturbation.random` of the rank: its part of the unsharded noise."""
        gen = self._generator(generator)
        out = []
        for p, draws in zip(pert.pieces, self._plan(pert), strict=True):
            g = p.norm_geometry
            z: list[Tensor] = []
            for (shapes, dtype), draw in zip(normal_draws(g), draws, strict=True):
                z += _split(draw.replay(gen, dtype, torch.randn), shapes)
            device = g.point[0].device if g.point else torch.device("cpu")
            xi = from_normals(g, [t.to(device) for t in z], scale)
            out.append(tuple(t.to(p.geometry.tangent_dtype) for t in xi))
        return out

    def uniform(self, pert: Any, generator: torch.Generator | None) -> list[list[Tensor]]:
        """Every piece's ``draw_like(point, generator, torch.rand)`` of the rank (ℓ∞ starts)."""
        gen = self._generator(generator)
        out = []
        for p, draws in zip(pert.pieces, self._plan(pert), strict=True):
            point = p.geometry.point
            if not p.geometry.draws_over_point:
                raise NotImplementedError("uniform draws of a block piece on a sharded model")
            if not point:
                out.append([])
                continue
            flat = draws[0].replay(gen, point[0].dtype, torch.rand)
            shapes = tuple(t.shape for t in point)
            out.append([t.to(point[0].device) for t in _split(flat, shapes)])
        return out

    def _generator(self, generator: torch.Generator | None) -> torch.Generator:
        """The CPU generator the stream is drawn from (see the module's note on devices)."""
        if generator is None:
            return torch.default_generator
        if generator.device.type == "cpu":
            return generator
        held = self._cpu.get(id(generator))
        if held is None or held[0] is not generator:
            held = (generator, torch.Generator().manual_seed(generator.initial_seed()))
            self._cpu[id(generator)] = held
        return held[1]

    def _plan(self, pert: Any) -> list[list[_Draw]]:
        """Every piece's draws on this rank (made once per perturbation)."""
        held = self._plans.get(id(pert))
        if held is None or held[0]() is not pert:
            held = (weakref.ref(pert), _plan(self.model, self.shards, self.key_bias, pert))
            self._plans[id(pert)] = held
        return held[1]


def _split(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    sizes = [s.numel() for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]


def _plan(model: nn.Module, shards: Any, key_bias: str | None, pert: Any) -> list[list[_Draw]]:
    """The draws of every piece of the rank's perturbation ``pert``, from the global layout."""
    from geosharp.estimators.sharded.space import param_layouts
    from geosharp.symmetry import find_symmetries

    if key_bias is None:  # the element-wise measures: the parameters, no blocks
        space = _params_space(shards)
        rest_global: list = [(j, None) for j in range(len(shards.names))]
        rest_rank: list = [(j, None) for j in range(len(shards.names))]
    else:
        space = find_symmetries(model, key_bias=key_bias)
        rest_global, rest_rank = _rest_layout(space), pert.space.rest_layout()
    layouts = param_layouts(space, shards)
    groups: dict = {}
    for b in space.blocks:
        groups.setdefault(b.batch_key(), []).append(b)
    k = pert.rest_index
    block_pieces = [p for i, p in enumerate(pert.pieces) if i != k]
    if len(block_pieces) != len(groups):
        raise RuntimeError(_MISMATCH)
    plans: list[list[_Draw]] = []
    it = iter(groups.values())
    for i, p in enumerate(pert.pieces):
        g = p.norm_geometry
        draws = normal_draws(g)
        if i == k:
            plans.append(
                [_rest_draw(space, layouts, rest_global, rest_rank, shards)] if draws else []
            )
            continue
        blocks = next(it)
        if not draws:  # held fixed: nothing drawn
            plans.append([])
            continue
        shapes = [s for sh, _ in draws for s in sh]
        one = len(draws) == 1  # one stream over every field, or one per field
        nf = len(type(blocks[0]).index_fields)  # a GL-type geometry: its fields, twice (Z, Ω)
        if not one and (len(shapes) % nf or shapes != shapes[:nf] * (len(shapes) // nf)):
            raise RuntimeError(_MISMATCH)
        fields = _block_fields(blocks, shapes if one else shapes[:nf], space, layouts, one)
        if one:
            plans.append([_Draw([s for f in fields for s in f], sum(s.numel() for s in shapes))])
        else:  # draw k over field k mod nf
            plans.append([_Draw(fields[k % nf], s.numel()) for k, s in enumerate(shapes)])
    return plans


def _params_space(shards: Any) -> ParameterSpace:
    """The whole model's parameters as a space (global shapes, no blocks)."""
    shapes = tuple(p.shape for p in shards.params)
    offsets, start = [], 0
    for s in shapes:
        offsets.append(start)
        start += s.numel()
    return ParameterSpace(shards.names, shapes, tuple(offsets))


def _rest_layout(space: ParameterSpace) -> list[tuple[int, Tensor | None]]:
    """:meth:`ParameterSpace.rest_layout` of the whole model, with no mask of a whole parameter.

    The same list; but ``rest_layout`` marks every parameter a block touches in a mask of its
    (global) size, all at once, while here the block coordinates are counted per parameter first
    and only the parameters partly in blocks (rare: e.g. a fused projection with a head left
    out) get a mask.
    """
    sizes = [math.prod(s) for s in space.shapes]
    counts = torch.zeros(len(sizes), dtype=torch.long)
    for b in space.blocks:
        pos = b.positions().reshape(-1).cpu()
        if pos.numel():
            counts += torch.bincount(space.owners(pos).long(), minlength=len(sizes))
    partial = {j for j, (c, n) in enumerate(zip(counts.tolist(), sizes, strict=True)) if 0 < c < n}
    touched = {j: torch.zeros(sizes[j], dtype=torch.bool) for j in partial}
    for b in space.blocks if partial else ():
        pos = b.positions().reshape(-1).cpu().long()
        owner = space.owners(pos)
        for j in set(torch.unique(owner).tolist()) & partial:
            touched[j][pos[owner == j] - space.offsets[j]] = True
    out: list[tuple[int, Tensor | None]] = []
    for j, (c, n) in enumerate(zip(counts.tolist(), sizes, strict=True)):
        if n and not c:
            out.append((j, None))
        elif j in partial:
            out.append((j, torch.nonzero(~touched.pop(j)).reshape(-1)))
    return out


def _rest_draw(
    space: ParameterSpace, layouts: list, rest_global: list, rest_rank: list, shards: Any
) -> _Draw:
    """The draw of the coordinates outside the blocks (or of every parameter)."""
    mine, at = {}, 0
    for j, local in rest_rank:
        if j >= len(shards.names):  # the rank's padding rows: never outside the blocks
            raise RuntimeError(_MISMATCH)
        mine[j] = (at, local)
        at += shards.locals[j].numel() if local is None else local.numel()
    segments = [
        _Slice(layouts[j], space.shapes[j].numel(), local, mine.get(j)) for j, local in rest_global
    ]
    return _Draw(segments, at)


def _block_fields(
    blocks: list,
    shapes: Sequence[torch.Size],
    space: ParameterSpace,
    layouts: list,
    concatenated: bool,
) -> list[list[_Segment]]:
    """Per field of a group of blocks: its stream's segments (one per block) on this rank.

    ``shapes``: the rank's batched fields, ``(heads, rows here, h)`` (GL-type; the rows held
    first, in order, then padding rows) or ``(positions here,)`` (key-bias translations).
    ``concatenated``: the fields' numbers lie one after the other in one buffer (else each
    field in its own).
    """
    from geosharp.estimators.sharded.space import localize_positions

    cls = type(blocks[0])
    if len(shapes) != len(cls.index_fields):
        raise RuntimeError(_MISMATCH)
    out, offset = [], 0
    for f, shape in zip(cls.index_fields, shapes, strict=True):
        segments: list[_Segment] = []
        head = 0
        for b in blocks:
            pos = as_tensor(getattr(b, f))
            if cls.shard_layout == "coordinates":
                held = localize_positions(pos.reshape(-1), space, layouts)[0]
                dest = torch.where(held, torch.cumsum(held, 0) - 1, -1)
                count = int(held.sum())
                segments.append(_Rows(dest, 1, offset + head, count))
                head += count
                if head > shape.numel():
                    raise RuntimeError(_MISMATCH)
                continue
            if cls.shard_layout != "rows" or pos.dim() != 3 or len(shape) != 3:
                raise NotImplementedError(f"random draws of {cls.__name__} blocks when sharded")
            heads, rows, width = shape[0], shape[1], shape[2]
            first = pos[..., 0].contiguous()
            held = localize_positions(first, space, layouts)[0]  # rows whole or none
            r = torch.cumsum(held, 1) - 1
            if held.numel() and int(held.sum(1).max()) > rows:
                raise RuntimeError(_MISMATCH)
            first = torch.arange(head, head + pos.shape[0]).unsqueeze(1) * rows
            dest = torch.where(held, first + r, -1).reshape(-1)
            segments.append(_Rows(dest, width, offset, heads * rows))
            head += pos.shape[0]
            if head > heads or width != pos.shape[-1]:
                raise RuntimeError(_MISMATCH)
        offset += shape.numel() if concatenated else 0
        out.append(segments)
    return out
