"""Declarative descriptions of symmetry blocks: *where* ``G`` and ``H`` live (SPEC §3).

An adapter (or a user) describes a GL(h) block by naming parameter slices, never by writing
gathering code. A :class:`ParamSlice` ``(param, axis, start, stop)`` takes
``param.narrow(axis, start, stop - start)``; the sliced axis, of length ``L``, runs over the
heads and is cut into ``B`` groups of ``k = L / (B·h)`` consecutive heads of ``h`` features
each; the remaining axes are flattened into rows. The ``k`` heads of a group are stacked
row-wise, which is exactly what grouped-query attention needs (the query heads sharing one K/V
head form one ``G``). A 1-D bias contributes one row per head. The pieces of ``G`` (and of
``H``) are concatenated row-wise in the order given.

Examples for an ``nn.Linear`` ``W`` of shape ``(out, in)`` (``y = x Wᵀ + b``) with heads on the
output features: ``ParamSlice("q.weight", axis=0)`` gives ``W[r_i, :]ᵀ`` (``in`` rows), and
``ParamSlice("q.bias", axis=0)`` the bias row. For an output projection the heads sit on the
input features: ``ParamSlice("o.weight", axis=1)`` gives ``W_o[:, r_i]`` (``out`` rows).

Head-interleaved fused projections (BLOOM's ``query_key_value`` stores, per head, its Q, K and V
features one after the other; Falcon's stores, per K/V group, ``g`` query heads, then K, then V)
are described with ``parts``/``part``: the sliced range is viewed as units of ``parts × h``
features and only the parts ``part`` (an index or a range ``(p0, p1)``) of every unit are taken.
``ParamSlice("qkv.weight", 0, parts=3, part=1)`` are BLOOM's keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = [
    "BlockSpec",
    "Claim",
    "PairSpec",
    "ParamSlice",
    "RotarySpec",
    "TranslationSpec",
    "declare_block",
    "slice_positions",
    "slice_view",
]


@dataclass(frozen=True)
class ParamSlice:
    """A slice of one parameter whose sliced axis runs over attention heads.

    Attributes:
        param: Dotted parameter name in the model (as in ``model.named_parameters()``).
        axis: The axis that carries the heads (negative values count from the end).
        start: First index along ``axis`` (default 0).
        stop: One past the last index along ``axis`` (default: the axis length).

    Example:
        >>> ParamSlice("attn.in_proj_weight", 0, 16, 32)
        ParamSlice(param='attn.in_proj_weight', axis=0, start=16, stop=32, parts=1, part=0)
    """

    param: str
    axis: int = 0
    start: int | None = None
    stop: int | None = None
    parts: int = 1
    part: int | tuple[int, int] = 0

    @property
    def part_range(self) -> tuple[int, int]:
        """The selected parts as a half-open range ``[p0, p1)``."""
        if isinstance(self.part, int):
            return self.part, self.part + 1
        return int(self.part[0]), int(self.part[1])


@dataclass(frozen=True)
class RotarySpec:
    """Rotary position embeddings acting on the first ``dims`` features of every Q/K head.

    The Q/K symmetry of such a head is the commutant of the rotations (SPEC §8): on each
    rotation plane a scaled rotation ``a I₂ + b J₂``, and the full GL on the ``h − dims``
    features that are not rotated.

    Attributes:
        dims: Number of rotated features per head (``dims ≤ h``, even). HF's ``rotary_ndims``
            / ``rotary_dim`` / ``partial_rotary_factor·h``.
        layout: ``"half"`` (HF ``rotate_half``: planes ``(i, i + dims/2)``) or
            ``"interleaved"`` (GPT-J ``rotate_every_two``: planes ``(2i, 2i + 1)``).

    Example:
        >>> RotarySpec(4, "half").planes()
        [(0, 2), (1, 3)]
        >>> RotarySpec(4, "interleaved").planes()
        [(0, 1), (2, 3)]
    """

    dims: int
    layout: str = "half"

    def __post_init__(self) -> None:
        if self.layout not in ("half", "interleaved"):
            raise ValueError(f"rotary layout must be 'half' or 'interleaved', got {self.layout!r}")
        if self.dims < 2 or self.dims % 2:
            raise ValueError(f"rotary dims must be a positive even number, got {self.dims}")

    def planes(self) -> list[tuple[int, int]]:
        """The rotation planes ``(a, b)`` (feature indices within a head)."""
        half = self.dims // 2
        if self.layout == "half":
            return [(i, i + half) for i in range(half)]
        return [(2 * i, 2 * i + 1) for i in range(half)]

    def label(self, head_dim: int) -> str:
        """Short description for summaries, e.g. ``"rotary 16/64 half"``."""
        return f"rotary {self.dims}/{head_dim} {self.layout}"


@dataclass(frozen=True)
class BlockSpec:
    """A GL(h) block described by parameter slices: built into a GL, rotary or LoRA block.

    Attributes:
        name: Unique readable name, e.g. ``"encoder.layer.0.attention[QK]"``.
        kind: ``"QK"``, ``"VO"`` or ``"custom"``.
        module: Dotted path of the owning module.
        heads: Number ``B`` of blocks in the batch.
        head_dim: Group dimension ``h``.
        g: Slices stacked row-wise into ``G`` (``B × n × h``).
        h: Slices stacked row-wise into ``H`` (``B × m × h``).
        rotary: Rotary embeddings acting on the heads (only for ``kind="QK"``): the group is
            then the rotary commutant, not all of GL(h) (SPEC §8).
    """

    name: str
    kind: str
    module: str
    heads: int
    head_dim: int
    g: tuple[ParamSlice, ...]
    h: tuple[ParamSlice, ...]
    rotary: RotarySpec | None = None

    def __post_init__(self) -> None:
        if self.rotary is not None and self.rotary.dims > self.head_dim:
            raise ValueError(
                f"block {self.name!r}: rotary dims {self.rotary.dims} exceed head_dim "
                f"{self.head_dim}"
            )


@dataclass(frozen=True)
class TranslationSpec:
    """Biases the loss does not depend on at all: the key bias of softmax attention (SPEC §8).

    ``q·b_k`` is the same for every key, so the softmax ignores ``b_k``: translations of these
    coordinates are a symmetry, and the quotient forgets them (geodesic measures hold them
    fixed). With ``find_symmetries(..., key_bias="keep")`` the pieces are appended to the rows
    of ``H`` of the block named ``fold_into`` instead (the layout before the quotient).

    Attributes:
        name: Readable name, e.g. ``"encoder.layer.0.attention[b_k]"``.
        module: Dotted path of the owning module.
        heads: Number ``B`` of groups the pieces are cut into (as for :class:`BlockSpec`).
        head_dim: Features per head ``h``.
        pieces: Slices of the bias (each gives ``B × k × h`` positions).
        fold_into: Name of the QK block whose ``H`` takes the pieces when not quotiented.
    """

    name: str
    module: str
    heads: int
    head_dim: int
    pieces: tuple[ParamSlice, ...]
    fold_into: str | None = None


@dataclass(frozen=True)
class PairSpec:
    """Two equally shaped parameters ``u``, ``v`` entering only through ``u ⊙ v``.

    Attributes:
        name: Readable name, e.g. ``"net[u*v]"``.
        u: Dotted name of ``u``.
        v: Dotted name of ``v``.
        module: Dotted path of the owning module.
    """

    name: str
    u: str
    v: str
    module: str = ""


@dataclass
class Claim:
    """What an adapter found in one module; the finder does not descend into that module.

    Attributes:
        blocks: Block specs of the module: :class:`BlockSpec` (full GL, rotary commutant or
            LoRA), or the spec type of any other registered block class.
        pairs: Diagonal pairs of the module.
        notes: Remarks for :attr:`ParameterSpace.notes` (the finder appends the module path).
        translations: Biases that are pure symmetry directions (key biases).
    """

    blocks: list[BlockSpec] = field(default_factory=list)
    pairs: list[PairSpec] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    translations: list[TranslationSpec] = field(default_factory=list)


def _checked_slice(
    shape: tuple[int, ...], piece: ParamSlice, heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """``(axis, start, stop, length selected)`` of a slice, checked as :func:`slice_positions`.

    Raises:
        ValueError: As :func:`slice_positions`.
    """
    if not shape:
        raise ValueError(f"parameter {piece.param!r} is a scalar; it cannot carry heads")
    ndim = len(shape)
    if not -ndim <= piece.axis < ndim:
        raise ValueError(
            f"axis {piece.axis} is out of range for parameter {piece.param!r} of shape {shape}"
        )
    axis = piece.axis % ndim
    start = 0 if piece.start is None else piece.start
    stop = shape[axis] if piece.stop is None else piece.stop
    if not 0 <= start < stop <= shape[axis]:
        raise ValueError(
            f"slice [{start}:{stop}] along axis {axis} is out of range for parameter "
            f"{piece.param!r} of shape {shape}"
        )
    length = stop - start
    if piece.parts != 1 or piece.part != 0:
        p0, p1 = piece.part_range
        unit = piece.parts * head_dim
        if piece.parts < 1 or not 0 <= p0 < p1 <= piece.parts or (stop - start) % unit:
            raise ValueError(
                f"slice [{start}:{stop}] along axis {axis} of parameter {piece.param!r} cannot "
                f"be viewed as units of parts={piece.parts} × head_dim={head_dim} with parts "
                f"[{p0}:{p1}] selected"
            )
        length = (stop - start) // unit * (p1 - p0) * head_dim
    if heads < 1 or head_dim < 1 or length % (heads * head_dim):
        raise ValueError(
            f"slice [{start}:{stop}] (length {length} selected) along axis {axis} of parameter "
            f"{piece.param!r} cannot be cut into heads={heads} blocks of head_dim={head_dim}: "
            f"the length must be a multiple of heads·head_dim = {heads * head_dim}"
        )
    return axis, start, stop, length


def slice_shape(
    shape: Sequence[int], piece: ParamSlice, heads: int, head_dim: int
) -> tuple[int, int, int]:
    """The shape of :func:`slice_positions` (its checks, no tensor made)."""
    shape = tuple(int(s) for s in shape)
    axis, _, _, length = _checked_slice(shape, piece, heads, head_dim)
    rows = math.prod(shape) // shape[axis]
    return heads, length // (heads * head_dim) * rows, head_dim


def slice_positions(
    shape: Sequence[int],
    piece: ParamSlice,
    heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Local flat positions (into ``param.reshape(-1)``) of one slice, arranged per head.

    Args:
        shape: Shape of the parameter.
        piece: The slice.
        heads: Number ``B`` of blocks.
        head_dim: Group dimension ``h``.
        device: Where the positions are built (named, never PyTorch's default device).

    Returns:
        ``LongTensor (B, k·R, h)``: ``R`` rows (product of the non-sliced axes), ``k`` heads per
        block stacked row-wise.

    Raises:
        ValueError: If the slice is out of range or its length is not a multiple of ``B·h``.

    Example:
        >>> slice_positions((4, 3), ParamSlice("w", axis=0), heads=2, head_dim=2)[0]
        tensor([[0, 3],
                [1, 4],
                [2, 5]])
    """
    shape = tuple(int(s) for s in shape)
    axis, start, stop, length = _checked_slice(shape, piece, heads, head_dim)
    along = torch.arange(start, stop, device=device)
    if piece.parts != 1 or piece.part != 0:
        p0, p1 = piece.part_range
        along = along.view(-1, piece.parts, head_dim)[:, p0:p1].reshape(-1)
    k = length // (heads * head_dim)
    local = torch.arange(math.prod(shape), dtype=torch.long, device=device).view(shape)
    sliced = local.index_select(axis, along).movedim(axis, -1).reshape(-1, length)
    rows = sliced.shape[0]
    return sliced.reshape(rows, heads, k, head_dim).permute(1, 2, 0, 3).reshape(heads, -1, head_dim)


def slice_view(t: Tensor, piece: ParamSlice, heads: int, head_dim: int) -> Tensor | None:
    """The values of ``t`` arranged as :func:`slice_positions` arranges positions, as a view.

    ``slice_positions(shape, …)`` is the flat position of every entry of
    ``slice_view(arange(numel).view(shape), …).reshape(heads, -1, head_dim)``; the view is kept
    unflattened, ``(*heads, k, *rows, head_dim)`` (the heads as one axis, or as two when a
    unit of the parameter holds several of them; ``k`` heads per block; ``rows`` the other
    axes of ``t``), so that writing into it writes into ``t`` (a perturbation's assembly) and
    reading it reads ``t`` (a gradient laid out as blocks) with no position tensor at all.

    Args:
        t: A tensor shaped like the parameter.
        piece: The slice.
        heads: Number ``B`` of blocks.
        head_dim: Group dimension ``h``.

    Returns:
        The view, or ``None`` when the arrangement is not one (several selected parts of a
        unit that do not split into whole blocks): such a slice needs its positions.
    """
    ndim = t.dim()
    axis = piece.axis % ndim
    start = 0 if piece.start is None else piece.start
    stop = t.shape[axis] if piece.stop is None else piece.stop
    x = t.narrow(axis, start, stop - start)
    if piece.parts != 1 or piece.part != 0:
        p0, p1 = piece.part_range
        x = x.unflatten(axis, (-1, piece.parts, head_dim)).narrow(axis + 1, p0, p1 - p0)
        units, sel = x.shape[axis], p1 - p0
    else:
        x = x.unflatten(axis, (-1, 1, head_dim))
        units, sel = x.shape[axis], 1
    # the selected (unit, part) pairs, in order, are the heads × k of the blocks
    if (units * sel) % heads:
        return None
    k = units * sel // heads
    if sel == 1:
        x = x.squeeze(axis + 1).unflatten(axis, (heads, k))
        lead = 2
    elif sel % k == 0 and units * (sel // k) == heads:  # a unit holds several blocks
        x = x.unflatten(axis + 1, (sel // k, k))
        lead = 3
    elif k % sel == 0 and units == heads * (k // sel):  # a block spans several units
        x = x.unflatten(axis, (heads, k // sel))
        lead = 3
    else:
        return None
    return x.movedim(tuple(range(axis, axis + lead + 1)), (*range(lead), ndim + lead - 1))


def _as_slice(piece: ParamSlice | tuple) -> ParamSlice:
    if isinstance(piece, ParamSlice):
        return piece
    if isinstance(piece, str):
        return ParamSlice(piece)
    return ParamSlice(*piece)


def declare_block(
    model: nn.Module,
    *,
    name: str,
    g: Iterable[ParamSlice | tuple | str],
    h: Iterable[ParamSlice | tuple | str],
    head_dim: int,
    heads: int | None = None,
    kind: str = "custom",
    module: str = "",
) -> BlockSpec:
    """Declare a GL(h) block by hand, for architectures no adapter recognises.

    Pass the result to :func:`geosharp.symmetry.find_symmetries` via ``extra_blocks``. Each
    piece is a :class:`ParamSlice`, a tuple ``(param_name, axis, start, stop)`` (trailing
    entries optional) or just a parameter name (axis 0, whole axis).

    Args:
        model: The model; used to check that the parameters exist and the slices fit.
        name: Unique block name.
        g: Pieces stacked row-wise into ``G``.
        h: Pieces stacked row-wise into ``H``.
        head_dim: Group dimension ``h``.
        heads: Number ``B`` of blocks; by default the smallest sliced length over all pieces
            divided by ``head_dim`` (so a grouped-query ``G`` stacks the query heads of a group).
        kind: Block kind for the summary (``"QK"``, ``"VO"`` or ``"custom"``).
        module: Module path shown in the summary.

    Returns:
        The validated :class:`BlockSpec`.

    Raises:
        ValueError: If a parameter does not exist or a slice does not fit ``heads``/``head_dim``.

    Example:
        A two-head bilinear form ``s = (x W_aᵀ)(x W_bᵀ)ᵀ`` per head, declared by hand:

        >>> import torch
        >>> from torch import nn
        >>> from geosharp.symmetry import find_symmetries
        >>> model = nn.ModuleDict({"a": nn.Linear(5, 6, bias=False), "b": nn.Linear(5, 6)})
        >>> spec = declare_block(model, name="ab", g=[("a.weight", 0)],
        ...                      h=[("b.weight", 0), ("b.bias", 0)], head_dim=3)
        >>> space = find_symmetries(model, extra_blocks=[spec])
        >>> blk = space.gl_blocks[0]
        >>> blk.heads, blk.n, blk.m, blk.head_dim
        (2, 5, 6, 3)
    """
    g_pieces = tuple(_as_slice(p) for p in g)
    h_pieces = tuple(_as_slice(p) for p in h)
    if not g_pieces or not h_pieces:
        raise ValueError(f"block {name!r}: both g and h need at least one piece")
    params = dict(model.named_parameters(remove_duplicate=False))
    for piece in (*g_pieces, *h_pieces):
        if piece.param not in params:
            raise ValueError(
                f"block {name!r}: the model has no parameter {piece.param!r}; "
                "use the names of model.named_parameters()"
            )
    if heads is None:
        lengths = []
        for piece in (*g_pieces, *h_pieces):
            shape = params[piece.param].shape
            axis = piece.axis % max(len(shape), 1)
            start = piece.start or 0
            stop = shape[axis] if piece.stop is None else piece.stop
            lengths.append(stop - start)
        heads = max(min(lengths) // head_dim, 1)
    for piece in (*g_pieces, *h_pieces):
        slice_positions(params[piece.param].shape, piece, heads, head_dim)
    return BlockSpec(
        name=name, kind=kind, module=module, heads=heads, head_dim=head_dim, g=g_pieces, h=h_pieces
    )
