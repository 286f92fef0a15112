"""The parameter space of a model, split into symmetry blocks (SPEC §3).

A :class:`ParameterSpace` fixes one flat coordinate system for the trainable parameters of a
model: ``θ = cat([p.reshape(-1) for p in params])`` in the order of
:attr:`ParameterSpace.param_names`. Every coordinate of ``θ`` belongs to exactly one of

* a :class:`GLBlock` — a batch of ``B`` pairs ``(G_b, H_b)`` on which the network depends only
  through ``G_b H_bᵀ`` (SPEC §3, acted on by GL(h): ``(G, H) ↦ (G A⁻¹, H Aᵀ)``),
* a :class:`DiagonalPair` — the two factors of a diagonal linear network ``β = u ⊙ v``,
* :attr:`ParameterSpace.rest_index` — everything else, treated with the adaptive
  (element-wise) geometry of SPEC §5.

Blocks store *global* flat positions into ``θ``, so gathering and scattering is one indexing
operation whatever the architecture: ``G = θ[block.g_index]`` and
``θ.index_put((block.g_index,), G_new)``. The architecture-specific knowledge of *where* the
blocks live is produced by the adapters of :mod:`geosharp.symmetry.adapters`; this module only
holds the result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

__all__ = ["DiagonalPair", "GLBlock", "ParameterSpace"]


@dataclass(frozen=True, eq=False)
class GLBlock:
    """A batch of GL(h) symmetry blocks ``(G_b, H_b)``, ``b = 1..B`` (SPEC §3).

    The network depends on ``θ[g_index]`` and ``θ[h_index]`` only through the batched product
    ``G Hᵀ``; GL(h) acts per head by ``(G_b, H_b) ↦ (G_b A_b⁻¹, H_b A_bᵀ)``. For attention head
    ``i`` with PyTorch's ``y = x Wᵀ + b`` convention:
    ``G_QK = [W_q[r_i, :], b_q[r_i]]ᵀ``, ``H_QK = [W_k[r_i, :], b_k[r_i]]ᵀ``,
    ``G_VO = [W_v[r_i, :], b_v[r_i]]ᵀ``, ``H_VO = W_o[:, r_i]`` with ``r_i = i·h : (i+1)·h``.

    Attributes:
        name: Unique readable name, e.g. ``"encoder.layer.3.attention[QK]"``.
        kind: ``"QK"``, ``"VO"`` or ``"custom"``.
        module: Dotted path of the module the block lives in (``""`` for the root).
        heads: Number ``B`` of independent blocks (heads, or K/V heads under grouped-query
            attention).
        head_dim: Group dimension ``h``.
        g_index: ``LongTensor (B, n, h)`` of global flat positions into ``θ``.
        h_index: ``LongTensor (B, m, h)`` of global flat positions into ``θ``.

    Example:
        >>> import torch
        >>> blk = GLBlock("toy[custom]", "custom", "toy", 1, 2,
        ...               torch.arange(6).view(1, 3, 2), torch.arange(6, 10).view(1, 2, 2))
        >>> G, H = blk.gather(torch.arange(10.0))
        >>> tuple(G.shape), tuple(H.shape), blk.numel
        ((1, 3, 2), (1, 2, 2), 10)
    """

    name: str
    kind: str
    module: str
    heads: int
    head_dim: int
    g_index: Tensor
    h_index: Tensor

    @property
    def n(self) -> int:
        """Number of rows ``n`` of each ``G_b``."""
        return int(self.g_index.shape[1])

    @property
    def m(self) -> int:
        """Number of rows ``m`` of each ``H_b``."""
        return int(self.h_index.shape[1])

    @property
    def numel(self) -> int:
        """Number of coordinates of ``θ`` in this block, ``B·(n + m)·h``."""
        return int(self.g_index.numel() + self.h_index.numel())

    def gather(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        """Read ``(G, H)`` out of a flat parameter vector (differentiable).

        Args:
            theta: Flat vector ``θ`` of the owning :class:`ParameterSpace`.

        Returns:
            ``G`` of shape ``(B, n, h)`` and ``H`` of shape ``(B, m, h)``.
        """
        return theta[_on(self.g_index, theta)], theta[_on(self.h_index, theta)]

    def scatter(self, theta: Tensor, G: Tensor, H: Tensor) -> Tensor:
        """Return a copy of ``θ`` with this block replaced by ``(G, H)`` (differentiable).

        Args:
            theta: Flat vector ``θ``.
            G: New ``G`` of shape ``(B, n, h)``.
            H: New ``H`` of shape ``(B, m, h)``.

        Returns:
            The updated flat vector (``θ`` itself is not modified).
        """
        g, h = _on(self.g_index, theta), _on(self.h_index, theta)
        return theta.index_put((g,), G).index_put((h,), H)

    def to(self, device: torch.device | str) -> GLBlock:
        """A copy with the index tensors on ``device`` (avoids a copy per gather on GPUs).

        Args:
            device: Target device.

        Returns:
            The moved block.
        """
        return replace(self, g_index=self.g_index.to(device), h_index=self.h_index.to(device))

    def __repr__(self) -> str:
        return (
            f"GLBlock({self.name!r}, heads={self.heads}, h={self.head_dim}, n={self.n}, m={self.m})"
        )


@dataclass(frozen=True, eq=False)
class DiagonalPair:
    """The factors ``(u, v)`` of a diagonal linear network ``y = xᵀ(u ⊙ v)`` (SPEC §3).

    One GL(1) per coordinate acts by ``(u_i, v_i) ↦ (α_i u_i, v_i / α_i)``.

    Attributes:
        name: Readable name, e.g. ``"net[u*v]"``.
        module: Dotted path of the owning module.
        u_index: ``LongTensor`` of global flat positions of ``u`` into ``θ``.
        v_index: ``LongTensor`` of the same shape: positions of the matching ``v``.

    Example:
        >>> import torch
        >>> pair = DiagonalPair("net[u*v]", "net", torch.arange(3), torch.arange(3, 6))
        >>> u, v = pair.gather(torch.arange(6.0))
        >>> (u * v).tolist()
        [0.0, 4.0, 10.0]
    """

    name: str
    module: str
    u_index: Tensor
    v_index: Tensor

    @property
    def numel(self) -> int:
        """Number of coordinates of ``θ`` in this pair (``2·len(u)``)."""
        return int(self.u_index.numel() + self.v_index.numel())

    def gather(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        """Read ``(u, v)`` out of a flat parameter vector (differentiable).

        Args:
            theta: Flat vector ``θ``.

        Returns:
            ``u`` and ``v``, both shaped like :attr:`u_index`.
        """
        return theta[_on(self.u_index, theta)], theta[_on(self.v_index, theta)]

    def scatter(self, theta: Tensor, u: Tensor, v: Tensor) -> Tensor:
        """Return a copy of ``θ`` with this pair replaced by ``(u, v)`` (differentiable).

        Args:
            theta: Flat vector ``θ``.
            u: New ``u``, shaped like :attr:`u_index`.
            v: New ``v``, shaped like :attr:`v_index`.

        Returns:
            The updated flat vector.
        """
        ui, vi = _on(self.u_index, theta), _on(self.v_index, theta)
        return theta.index_put((ui,), u).index_put((vi,), v)

    def to(self, device: torch.device | str) -> DiagonalPair:
        """A copy with the index tensors on ``device``.

        Args:
            device: Target device.

        Returns:
            The moved pair.
        """
        return replace(self, u_index=self.u_index.to(device), v_index=self.v_index.to(device))

    def __repr__(self) -> str:
        return f"DiagonalPair({self.name!r}, size={self.u_index.numel()})"


@dataclass(eq=False)
class ParameterSpace:
    """Flat coordinates of a model's trainable parameters, split by geometry (SPEC §3, §5).

    Built by :func:`geosharp.symmetry.find_symmetries`; rarely constructed by hand.

    Attributes:
        param_names: Trainable parameter names in the order they are concatenated into ``θ``.
        shapes: Shape of each parameter.
        offsets: Start of each parameter in ``θ``.
        gl_blocks: GL(h) blocks, with global indices into ``θ``.
        diagonal_pairs: Diagonal-network pairs, with global indices into ``θ``.
        rest_index: Sorted global positions of every coordinate in no block or pair; these use
            the adaptive element-wise geometry.
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
    gl_blocks: list[GLBlock] = field(default_factory=list)
    diagonal_pairs: list[DiagonalPair] = field(default_factory=list)
    rest_index: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    excluded: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

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
        parts = []
        for name, shape in zip(self.param_names, self.shapes, strict=True):
            if name not in params:
                raise KeyError(
                    f"parameter {name!r} of the ParameterSpace is missing from the mapping "
                    "passed to flatten(); pass e.g. dict(model.named_parameters())"
                )
            p = params[name]
            if p.shape != shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(p.shape)} but the ParameterSpace was "
                    f"built for shape {tuple(shape)}"
                )
            parts.append(p.reshape(-1))
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

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
            gl_blocks=[b.to(device) for b in self.gl_blocks],
            diagonal_pairs=[p.to(device) for p in self.diagonal_pairs],
            rest_index=self.rest_index.to(device),
            excluded=dict(self.excluded),
            notes=list(self.notes),
        )

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def gl_numel(self) -> int:
        """Number of coordinates in GL(h) blocks."""
        return sum(b.numel for b in self.gl_blocks)

    @property
    def diagonal_numel(self) -> int:
        """Number of coordinates in diagonal pairs."""
        return sum(p.numel for p in self.diagonal_pairs)

    @property
    def adaptive_numel(self) -> int:
        """Number of coordinates with the adaptive geometry (length of :attr:`rest_index`)."""
        return int(self.rest_index.numel())

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
        if not self.gl_blocks and not self.diagonal_pairs:
            lines.append(
                f"no symmetry blocks found: all {total:,} parameters use the adaptive geometry"
            )
        if self.gl_blocks:
            header = ("kind", "module", "heads", "h", "G (n×h)", "H (m×h)", "params")
            rows = [
                (
                    b.kind,
                    b.module or "<model>",
                    str(b.heads),
                    str(b.head_dim),
                    f"{b.n}×{b.head_dim}",
                    f"{b.m}×{b.head_dim}",
                    f"{b.numel:,}",
                )
                for b in self.gl_blocks
            ]
            lines.append(_plural(len(self.gl_blocks), "GL(h) block") + ":")
            lines.extend(_table(header, rows, right=(2, 3, 4, 5, 6)))
        if self.diagonal_pairs:
            header = ("pair", "size", "params")
            rows = [(p.name, f"{p.u_index.numel():,}", f"{p.numel:,}") for p in self.diagonal_pairs]
            lines.append(_plural(len(self.diagonal_pairs), "diagonal pair") + ":")
            lines.extend(_table(header, rows, right=(1, 2)))

        def share(k: int) -> str:
            return f"{100.0 * k / total:.1f}%" if total else "-"

        rows = [
            ("GL(h) blocks", f"{self.gl_numel:,}", share(self.gl_numel)),
            ("diagonal pairs", f"{self.diagonal_numel:,}", share(self.diagonal_numel)),
            ("adaptive (element-wise)", f"{self.adaptive_numel:,}", share(self.adaptive_numel)),
            ("total", f"{total:,}", share(total)),
        ]
        lines.append("parameters per geometry:")
        lines.extend(_table(("geometry", "params", "share"), rows, right=(1, 2)))
        if self.excluded:
            lines.append(f"excluded ({len(self.excluded)} tensors, not perturbed):")
            lines.extend(f"  - {name}: {why}" for name, why in self.excluded.items())
        if self.notes:
            lines.append("notes:")
            lines.extend(f"  - {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ParameterSpace(numel={self.numel()}, gl_blocks={len(self.gl_blocks)}, "
            f"diagonal_pairs={len(self.diagonal_pairs)}, adaptive={self.adaptive_numel}, "
            f"excluded={len(self.excluded)})"
        )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _on(index: Tensor, theta: Tensor) -> Tensor:
    """``index`` on the device of ``theta``."""
    return index if index.device == theta.device else index.to(theta.device)


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
