"""The parameter space of a model, split into symmetry blocks (SPEC §3).

A :class:`ParameterSpace` fixes one flat coordinate system for the trainable parameters of a
model: ``θ = cat([p.reshape(-1) for p in params])`` in the order of
:attr:`ParameterSpace.param_names`. Every coordinate of ``θ`` belongs to exactly one of

* a symmetry block (:mod:`geosharp.symmetry.blocks`: GL(h) heads of attention, rotary Q/K
  heads, LoRA adapters, diagonal-net pairs, key-bias translations), in
  :attr:`ParameterSpace.blocks`,
* :attr:`ParameterSpace.rest_index` — everything else, treated with the adaptive
  (element-wise) geometry of SPEC §5.

Blocks store *global* flat positions into ``θ``, so gathering and scattering is one indexing
operation whatever the architecture. The architecture-specific knowledge of *where* the blocks
live is produced by the adapters of :mod:`geosharp.symmetry.adapters`; this module only holds
the result, and never asks a block its kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from geosharp.symmetry.blocks import DiagonalPair, GLBlock, SymmetryBlock
from geosharp.symmetry.positions import recipe_views

__all__ = ["UNPROVEN_NOTE", "ParameterSpace"]

#: The note of a space whose blocks are claims not yet proven on data: the finder adds it,
#: :func:`~geosharp.symmetry.verify.prove` replaces it by what the proof found.
UNPROVEN_NOTE = (
    "symmetry claims unverified: prove them on a batch with geosharp.symmetry.prove(space, "
    "model, inputs) (geosharp measure does) or gs.check_invariance"
)

#: At most this many excluded tensors are listed by name in :meth:`ParameterSpace.summary`.
_MAX_EXCLUDED_SHOWN = 8


@dataclass(eq=False)
class ParameterSpace:
    """Flat coordinates of a model's trainable parameters, split by geometry (SPEC §3, §5).

    Built by :func:`geosharp.symmetry.find_symmetries`; rarely constructed by hand.

    Attributes:
        param_names: Trainable parameter names in the order they are concatenated into ``θ``.
        shapes: Shape of each parameter.
        offsets: Start of each parameter in ``θ``.
        blocks: The symmetry blocks, with global indices into ``θ``.
        rest_index: (property) Sorted global positions of every coordinate in no block;
            these use the adaptive element-wise geometry. Derived from the blocks on demand:
            the space itself stores no parameter-sized index (:meth:`rest_layout` is the
            compact form the estimators use).
        excluded: Parameters left out of ``θ`` (name → reason), e.g. frozen ones.
        notes: Human-readable remarks of the finder (e.g. why a block was not used).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from geosharp.symmetry import find_symmetries
        >>> space = find_symmetries(nn.Linear(3, 2))
        >>> space.param_names, space.numel()
        (('weight', 'bias'), 8)
        >>> theta = space.flatten(dict(nn.Linear(3, 2).named_parameters()))
        >>> space.unflatten(theta)["weight"].shape
        torch.Size([2, 3])
    """

    param_names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    blocks: list[SymmetryBlock] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _layout: list | None = field(default=None, init=False, repr=False, compare=False)

    # -- the coordinates in no block ------------------------------------------------------------
    def rest_layout(self) -> list[tuple[int, Tensor | None]]:
        """The coordinates in no block, parameter by parameter (computed once, then cached).

        Returns:
            ``(j, local)`` for every parameter ``j`` (position in :attr:`param_names`) with at
            least one coordinate in no block, in parameter order: ``local = None`` when the
            whole parameter is outside every block (no index is stored), else the sorted flat
            positions inside the parameter that are in no block (a parameter shared with a
            block, e.g. a fused QKV projection of which one head was dropped).
        """
        if self._layout is None:
            self._layout = self._find_rest()
        return self._layout

    def _find_rest(self) -> list[tuple[int, Tensor | None]]:
        """:meth:`rest_layout`, computed: host bookkeeping on the CPU, one mask at a time.

        The blocks of parameter slices (their recipes) mark their coordinates through views of
        one parameter's mask, a parameter at a time, in one buffer reused for every parameter
        (a fresh mask per parameter was 0.2 GB of fresh pages on a 1.1 B Llama); a parameter
        they all cover is known by one reduction, with no position built. Other blocks mark
        their positions in a mask of each parameter they touch.
        """
        sizes = [math.prod(s) for s in self.shapes]
        starts = {int(off): j for j, off in enumerate(self.offsets) if sizes[j]}
        touched: dict[int, Tensor] = {}  # the masks of the parameters positions touch
        users: dict[int, list[SymmetryBlock]] = {}  # the recipe blocks of each parameter

        def seen(offset: int) -> Tensor | None:  # a shape to view, and who touches what
            j = starts.get(int(offset))
            if j is None:
                return None
            if not users.get(j) or users[j][-1] is not b:
                users.setdefault(j, []).append(b)
            return torch.empty(self.shapes[j], dtype=torch.bool, device="meta")

        for b in self.blocks:
            if recipe_views([getattr(b, f) for f in b.index_fields], seen) is not None:
                continue
            for j in users:  # no view after all: not this block's parameters
                if users[j] and users[j][-1] is b:
                    users[j].pop()
            # host bookkeeping, made on the CPU by name (never PyTorch's default device)
            pos = b.positions().reshape(-1).cpu()
            if not pos.numel():
                continue
            owner = self.owners(pos)
            for j in torch.unique(owner).tolist():
                sel = pos[owner == j] - self.offsets[j]
                if j not in touched:
                    touched[j] = torch.zeros(sizes[j], dtype=torch.bool, device="cpu")
                touched[j][sel] = True
        users = {j: bs for j, bs in users.items() if bs}
        most = max((sizes[j] for j in users if j not in touched), default=0)
        scratch = torch.empty(most, dtype=torch.bool, device="cpu")
        layout: list[tuple[int, Tensor | None]] = []
        for j, size in enumerate(sizes):
            if j not in touched and j not in users:
                if size:
                    layout.append((j, None))
                continue
            mask = touched[j] if j in touched else scratch[:size].zero_()
            shaped = mask.view(self.shapes[j])
            for b in users.get(j, ()):

                def table(offset: int, j: int = j, shaped: Tensor = shaped) -> Tensor | None:
                    k = starts.get(int(offset))
                    if k is None:
                        return None
                    if k == j:
                        return shaped
                    return torch.empty(self.shapes[k], dtype=torch.bool, device="meta")

                views = recipe_views([getattr(b, f) for f in b.index_fields], table)
                assert views is not None  # the same recipes as above
                for v in views:
                    v.fill_(True)  # a view of another parameter's meta tensor: nothing
            # all set: its bytes' smallest is 1 (a boolean ``all`` was 50 times slower on CPU)
            if not size or int(mask.view(torch.uint8).amin()) == 1:
                continue
            layout.append((j, torch.nonzero(~mask).reshape(-1)))
        return layout

    @property
    def rest_index(self) -> Tensor:
        """Sorted global positions of every coordinate in no block (built on each access)."""
        parts = self.layout_positions(self.rest_layout())
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def layout_positions(
        self, layout: Sequence[tuple[int, Tensor | None]], device: torch.device | str | None = None
    ) -> list[Tensor]:
        """Global positions in ``θ`` of each ``(j, local)`` part of a :meth:`rest_layout`.

        Args:
            layout: ``(parameter index, local positions or None for all of it)`` pairs.
            device: Device of the result (default: CPU).
        """
        device = device or "cpu"
        out = []
        for j, local in layout:
            off = self.offsets[j]
            if local is None:
                out.append(torch.arange(off, off + math.prod(self.shapes[j]), device=device))
            else:
                out.append(local.to(device) + off)
        return out

    # -- coordinates --------------------------------------------------------------------------
    def numel(self) -> int:
        """Total number of coordinates of ``θ``.

        Returns:
            ``sum(p.numel() for p in params)`` over the included parameters.
        """
        if not self.shapes:
            return 0
        return self.offsets[-1] + math.prod(self.shapes[-1])

    def flatten(self, params: Mapping[str, Tensor]) -> Tensor:
        """Concatenate parameters into the flat vector ``θ`` (differentiable).

        Args:
            params: Mapping that contains at least every name of :attr:`param_names`
                (extra entries, e.g. frozen parameters, are ignored), such as
                ``dict(model.named_parameters())``.

        Returns:
            ``θ`` of length :meth:`numel`.

        Raises:
            KeyError: If a parameter of :attr:`param_names` is missing.
            ValueError: If a parameter has the wrong shape.
        """
        parts = [p.reshape(-1) for p in self.checked(params, "the mapping passed to flatten()")]
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def checked(self, params: Mapping[str, Tensor], where: str) -> list[Tensor]:
        """The tensors of :attr:`param_names` in ``params``, in order, with their shapes checked.

        Args:
            params: Mapping that contains at least every name of :attr:`param_names`.
            where: What ``params`` is, for the error messages (e.g. ``"the base point"``).

        Raises:
            KeyError: If a parameter of :attr:`param_names` is missing.
            ValueError: If a parameter has the wrong shape.
        """
        out = []
        for name, shape in zip(self.param_names, self.shapes, strict=True):
            if name not in params:
                raise KeyError(
                    f"parameter {name!r} of the ParameterSpace is missing from {where}; pass "
                    "e.g. dict(model.named_parameters())"
                )
            p = params[name]
            if p.shape != shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(p.shape)} but the ParameterSpace was "
                    f"built for shape {tuple(shape)}"
                )
            out.append(p)
        return out

    def flatten_module(self, model: nn.Module) -> Tensor:
        """``θ`` of a model with the same parameter names (differentiable).

        Args:
            model: The model the space was built from, or a copy of it.

        Returns:
            ``self.flatten(dict(model.named_parameters()))``.
        """
        return self.flatten(dict(model.named_parameters()))

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """Split ``θ`` back into parameter-shaped views (differentiable).

        The result can be passed to :func:`torch.func.functional_call`.

        Args:
            theta: Flat vector of length :meth:`numel`.

        Returns:
            Dict name → tensor shaped like the parameter (views of ``θ``).

        Raises:
            ValueError: If ``θ`` has the wrong length.
        """
        if theta.dim() != 1 or theta.numel() != self.numel():
            raise ValueError(
                f"theta must be a vector of length {self.numel()}, got shape {tuple(theta.shape)}"
            )
        # One split (its backward is a single cat) rather than a slice per parameter, whose
        # backward would allocate a zero gradient the size of θ for every parameter.
        sizes = [math.prod(shape) for shape in self.shapes]
        parts = torch.split(theta, sizes)
        return {
            name: part.view(shape)
            for name, shape, part in zip(self.param_names, self.shapes, parts, strict=True)
        }

    @torch.no_grad()
    def write_to(self, model: nn.Module, theta: Tensor) -> None:
        """Copy ``θ`` into the parameters of ``model`` in place.

        Args:
            model: The model the space was built from, or a copy of it.
            theta: Flat vector of length :meth:`numel`.
        """
        params = dict(model.named_parameters())
        for name, value in self.unflatten(theta).items():
            params[name].copy_(value)

    def owners(self, positions: Tensor) -> Tensor:
        """The parameter holding every flat position of ``θ`` (its position in the space).

        Args:
            positions: Flat positions (``long`` or ``int32``), on any device.

        Returns:
            A tensor like ``positions`` (same shape, device and integer width) of parameter
            positions in :attr:`param_names`; a position is owned by the last parameter that
            starts at or before it (so never by an empty one).
        """
        starts = torch.tensor(self.offsets, dtype=positions.dtype, device=positions.device)
        int32 = positions.dtype == torch.int32
        return torch.searchsorted(starts, positions, right=True, out_int32=int32) - 1

    def locate(self, position: int) -> tuple[str, tuple[int, ...]]:
        """Parameter name and multi-index of one flat position of ``θ``.

        Args:
            position: Flat position in ``[0, numel())``.

        Returns:
            ``(name, index)`` with ``params[name][index]`` being ``θ[position]``.

        Raises:
            IndexError: If the position is out of range.
        """
        if not 0 <= position < self.numel():
            raise IndexError(f"position {position} out of range [0, {self.numel()})")
        for name, shape, off in zip(self.param_names, self.shapes, self.offsets, strict=True):
            size = math.prod(shape)
            if off <= position < off + size:
                rem, idx = position - off, []
                for dim in reversed(shape):
                    idx.append(rem % dim)
                    rem //= dim
                return name, tuple(reversed(idx))
        raise AssertionError("unreachable")  # pragma: no cover

    def to(self, device: torch.device | str) -> ParameterSpace:
        """A copy with every index tensor on ``device`` (parameters are not touched).

        Gathering with indices on the device of ``θ`` avoids a host-to-device copy per call.

        Args:
            device: Target device, e.g. ``"cuda"``.

        Returns:
            The moved space.
        """
        return replace(
            self,
            blocks=[b.to(device) for b in self.blocks],
            excluded=dict(self.excluded),
            notes=list(self.notes),
        )

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def gl_blocks(self) -> list[GLBlock]:
        """The blocks whose group is GL(h) or a subgroup of it (attention, rotary, LoRA)."""
        return [b for b in self.blocks if isinstance(b, GLBlock)]

    @property
    def diagonal_pairs(self) -> list[DiagonalPair]:
        """The diagonal-network pairs."""
        return [b for b in self.blocks if isinstance(b, DiagonalPair)]

    @property
    def block_numel(self) -> int:
        """Number of coordinates in symmetry blocks."""
        return sum(b.numel for b in self.blocks)

    @property
    def gl_numel(self) -> int:
        """Number of coordinates in GL(h)-type blocks (attention, rotary, LoRA)."""
        return sum(b.numel for b in self.gl_blocks)

    @property
    def diagonal_numel(self) -> int:
        """Number of coordinates in diagonal pairs."""
        return sum(p.numel for p in self.diagonal_pairs)

    @property
    def adaptive_numel(self) -> int:
        """Number of coordinates with the adaptive geometry (length of :attr:`rest_index`)."""
        return sum(
            math.prod(self.shapes[j]) if local is None else int(local.numel())
            for j, local in self.rest_layout()
        )

    @property
    def n_group_factors(self) -> int:
        """Independent group factors over all blocks (heads, pair coordinates, biases)."""
        return sum(b.count for b in self.blocks)

    def describe_blocks(self) -> str:
        """``"N symmetry blocks (K group factors)"``, the count used by every report."""
        return (
            f"{_plural(len(self.blocks), 'symmetry block')} "
            f"({_plural(self.n_group_factors, 'group factor')}: heads, pair coordinates, biases)"
        )

    def summary(self) -> str:
        """A readable table of the blocks, the parameter count per geometry and the notes.

        Returns:
            Multi-line string.

        Example:
            >>> from torch import nn
            >>> from geosharp.symmetry import find_symmetries
            >>> print(find_symmetries(nn.Linear(3, 2)).summary())  # doctest: +ELLIPSIS
            ParameterSpace: 2 parameter tensors, 8 coordinates
            no symmetry blocks found: all 8 parameters use the adaptive geometry
            ...
        """
        total = self.numel()
        lines = [
            f"ParameterSpace: {len(self.param_names)} parameter tensors, {total:,} coordinates"
        ]
        if not self.blocks:
            lines.append(
                f"no symmetry blocks found: all {total:,} parameters use the adaptive geometry"
            )
        else:
            header = ("kind", "group", "module", "heads", "factors", "params")
            rows = [
                (
                    b.kind,
                    b.group,
                    b.module or "<model>",
                    f"{b.count:,}",
                    b.shape_label,
                    f"{b.numel:,}",
                )
                for b in self.blocks
            ]
            lines.append(self.describe_blocks() + ":")
            lines.extend(_table(header, rows, right=(3, 5)))

        def share(k: int) -> str:
            return f"{100.0 * k / total:.1f}%" if total else "-"

        families: dict[str, int] = {}
        for b in self.blocks:
            families[b.family] = families.get(b.family, 0) + b.numel
        rows = [(family, f"{n:,}", share(n)) for family, n in families.items()]
        rows += [
            ("adaptive (element-wise)", f"{self.adaptive_numel:,}", share(self.adaptive_numel)),
            ("total", f"{total:,}", share(total)),
        ]
        lines.append("parameters per geometry:")
        lines.extend(_table(("geometry", "params", "share"), rows, right=(1, 2)))
        if self.excluded:
            lines.append(f"excluded ({len(self.excluded)} tensors, not perturbed):")
            shown = list(self.excluded.items())
            if len(shown) > _MAX_EXCLUDED_SHOWN:
                hidden = shown[_MAX_EXCLUDED_SHOWN - 1 :]
                shown = shown[: _MAX_EXCLUDED_SHOWN - 1]
                reasons = sorted({why for _, why in hidden})
                shown.append((f"… and {len(hidden)} more", "; ".join(reasons)))
            lines.extend(f"  - {name}: {why}" for name, why in shown)
        if self.notes:
            lines.append("notes:")
            lines.extend(f"  - {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ParameterSpace(numel={self.numel()}, blocks={len(self.blocks)}, "
            f"adaptive={self.adaptive_numel}, excluded={len(self.excluded)})"
        )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Format rows as an indented, aligned plain-text table."""
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if j in right else c.ljust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  " + "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]
