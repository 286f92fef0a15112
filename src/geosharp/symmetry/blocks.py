"""Symmetry blocks: one class per symmetry group, all behind one protocol (SPEC §3, §8).

A block knows

* **where its coordinates are**: :attr:`SymmetryBlock.indices`, global flat positions into
  ``θ``, one tensor per factor (``(G, H)``, ``(u, v)``, ``(b,)``), so gathering and scattering
  is one indexing operation whatever the architecture;
* **its group**: :meth:`~SymmetryBlock.random_element` draws an element, and
  :meth:`~SymmetryBlock.act` applies it to the block's factors (the network function is
  unchanged);
* **the geometry it builds**: :meth:`~SymmetryBlock.geometry` makes the
  :class:`~geosharp.geometry.Geometry` of a batch of blocks with equal :meth:`batch_key` (all
  heads of all layers in one set of batched matmuls), whose horizontal space is the quotient by
  the block's group.

:class:`~geosharp.symmetry.ParameterSpace`, :func:`~geosharp.symmetry.find_symmetries`,
:func:`~geosharp.symmetry.reparametrize`, the invariance checks and the perturbation of the
sharpness measures loop over blocks through this protocol and never ask their kind. A new
symmetry group is one block class here, one geometry in :mod:`geosharp.geometry`, and one
adapter (or spec) that says where its coordinates live.

The groups (block → group → geometry):

* :class:`GLBlock` → GL(h) per head (attention) → :class:`~geosharp.geometry.GLGeometry`
* :class:`RotaryBlock` → the rotary commutant ⊂ GL(h) →
  :class:`~geosharp.geometry.GLSubgroupGeometry`
* :class:`LoRABlock` → GL(r) of ``W + B A`` → :class:`~geosharp.geometry.GLGeometry`
* :class:`DiagonalPair` → GL(1) per coordinate → :class:`~geosharp.geometry.DiagonalGeometry`
* :class:`TranslationBlock` → translations of a key bias →
  :class:`~geosharp.geometry.FixedGeometry`
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry import DiagonalGeometry, FixedGeometry, Geometry, GLGeometry
from geosharp.geometry import gl as gl_math
from geosharp.geometry.gl_subgroup import BlockDiagonalAlgebra, GLSubgroupGeometry
from geosharp.symmetry.positions import as_tensor
from geosharp.symmetry.specs import RotarySpec

__all__ = [
    "DiagonalPair",
    "GLBlock",
    "LoRABlock",
    "RotaryBlock",
    "SymmetryBlock",
    "TranslationBlock",
]

#: Redraws of a random group element before giving up.
_MAX_TRIES = 100
#: Entries of a diagonal-pair ``α`` are resampled while ``|α| < _MIN_ALPHA · scale``.
_MIN_ALPHA = 0.1


def _on(index: Tensor, theta: Tensor) -> Tensor:
    """``index`` on the device of ``theta``."""
    return index if index.device == theta.device else index.to(theta.device)


class SymmetryBlock(ABC):
    """The protocol every symmetry block implements (see the module docstring).

    Subclasses are frozen dataclasses with ``name``, ``kind`` and ``module`` fields and one or
    more index tensors, listed by :attr:`index_fields`.
    """

    name: str
    kind: str
    module: str
    #: Names of the dataclass fields holding the index tensors, in factor order.
    index_fields: ClassVar[tuple[str, ...]] = ()
    #: Whether :meth:`batch` flattens each block's positions before concatenating them
    #: (instead of concatenating along the head axis).
    batch_flat: ClassVar[bool] = False

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
        """

    # -- presentation -----------------------------------------------------------------------
    @property
    def shape_label(self) -> str:
        """The factors' shapes for summaries, e.g. ``"G 33×8, H 32×8"``."""
        return " × ".join(str(tuple(s[1:])) for s in self.index_shapes)

    #: Label of this block class in the "parameters per geometry" table.
    family: ClassVar[str] = "symmetry blocks"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.group}, count={self.count})"


# -- GL(h) --------------------------------------------------------------------------------------
def _draw_gl(heads: int, h: int, generator: torch.Generator | None, max_cond: float) -> Tensor:
    """``(heads, h, h)`` standard normal matrices, each resampled until ``cond ≤ max_cond``."""
    A = torch.randn(heads, h, h, generator=generator, dtype=torch.float64)
    return _redraw(
        A, lambda n: torch.randn(n, h, h, generator=generator, dtype=torch.float64), max_cond
    )


def _redraw(A: Tensor, draw, max_cond: float) -> Tensor:
    for _ in range(_MAX_TRIES):
        bad = torch.linalg.cond(A) > max_cond
        if not bad.any():
            return A
        A[bad] = draw(int(bad.sum()))
    raise RuntimeError(
        f"could not draw {tuple(A.shape[1:])} group matrices with condition number ≤ "
        f"{max_cond:g} in {_MAX_TRIES} tries; pass a larger max_cond"
    )


@dataclass(frozen=True, eq=False, repr=False)
class GLBlock(SymmetryBlock):
    """A batch of GL(h) symmetry blocks ``(G_b, H_b)``, ``b = 1..B`` (SPEC §3).

    The network depends on ``θ[g_index]`` and ``θ[h_index]`` only through the batched product
    ``G Hᵀ``; GL(h) acts per head by ``(G_b, H_b) ↦ (G_b A_b⁻¹, H_b A_bᵀ)``. For attention head
    ``i`` with PyTorch's ``y = x Wᵀ + b`` convention:
    ``G_QK = [W_q[r_i, :], b_q[r_i]]ᵀ``, ``H_QK = W_k[r_i, :]ᵀ`` (the key bias is a
    :class:`TranslationBlock`), ``G_VO = [W_v[r_i, :], b_v[r_i]]ᵀ``, ``H_VO = W_o[:, r_i]``
    with ``r_i = i·h : (i+1)·h``.

    Attributes:
        name: Unique readable name, e.g. ``"encoder.layer.3.attention[QK]"``.
        kind: ``"QK"``, ``"VO"``, ``"LoRA"`` or ``"custom"``.
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

    index_fields: ClassVar[tuple[str, ...]] = ("g_index", "h_index")
    family: ClassVar[str] = "GL(h) blocks"

    @property
    def n(self) -> int:
        """Number of rows ``n`` of each ``G_b``."""
        return int(self.g_index.shape[1])

    @property
    def m(self) -> int:
        """Number of rows ``m`` of each ``H_b``."""
        return int(self.h_index.shape[1])

    @property
    def count(self) -> int:
        """Number of heads ``B``."""
        return self.heads

    @property
    def group(self) -> str:
        """``GL(h)``."""
        return f"GL({self.head_dim})"

    @property
    def shape_label(self) -> str:
        """``G n×h, H m×h``."""
        return f"G {self.n}×{self.head_dim}, H {self.m}×{self.head_dim}"

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """``A = scale·N(0, 1)^{h×h}`` per head, redrawn while ``cond(A) > max_cond``."""
        return scale * _draw_gl(self.heads, self.head_dim, generator, max_cond)

    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """``(G, H) ↦ (G A⁻¹, H Aᵀ)`` (``A⁻¹`` by a solve)."""
        G, H = parts
        return gl_math.act(G, H, element.to(dtype=G.dtype, device=G.device))

    def _random_lie(self, like: Tensor, generator: torch.Generator | None) -> Tensor:
        """A random element ``Ω`` of the group's Lie algebra, ``(B, h, h)``."""
        h = self.head_dim
        return torch.randn(
            self.heads, h, h, generator=generator, dtype=like.dtype, device=like.device
        )

    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """``(−GΩ, HΩᵀ)``: the velocity of ``(G e^{−tΩ}, H e^{tΩᵀ})`` at ``t = 0``."""
        G, H = parts
        omega = self._random_lie(G, generator)
        return -G @ omega, H @ omega.mT

    def batch_key(self) -> Hashable:
        """GL blocks of equal ``(n, m, h)`` share one batched geometry."""
        return ("GL", self.n, self.m, self.head_dim)

    @classmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
    ) -> Geometry:
        """A batched :class:`~geosharp.geometry.GLGeometry` over every head of ``blocks``."""
        G, H = point
        b0 = blocks[0]
        name = f"{len(blocks)} GL({b0.head_dim}) block(s) n={b0.n}, m={b0.m}"
        heads = [f"{b.name} head {i}" for b in blocks for i in range(b.heads)]
        return GLGeometry(
            G, H, metric=metric, eps=eps, name=name, head_names=heads, work_dtype=work_dtype
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, heads={self.heads}, h={self.head_dim}, "
            f"n={self.n}, m={self.m})"
        )


@dataclass(frozen=True, eq=False, repr=False)
class LoRABlock(GLBlock):
    """The GL(r) symmetry of a LoRA adapter ``W + s·B A``: ``G = B``, ``H = Aᵀ`` (SPEC §8).

    ``(B, A) ↦ (B M⁻¹, M A)`` leaves ``B A`` unchanged for every ``M ∈ GL(r)``; the geometry is
    that of a GL block with ``h = r`` (and it is batched with GL blocks of the same shape).
    """

    family: ClassVar[str] = "LoRA GL(r) blocks"


@dataclass(frozen=True, eq=False, repr=False)
class RotaryBlock(GLBlock):
    """A Q/K block under rotary position embeddings: the group is the rotary commutant (SPEC §8).

    ``A`` must commute with every rotation ``R(δ)``: a scaled rotation ``a I₂ + b J₂`` on each
    rotation plane and any invertible matrix on the features that are not rotated. The metric
    and the geodesics are those of the GL block; only the vertical space is smaller.

    Attributes:
        rotary: Where the rotation planes are (:class:`~geosharp.symmetry.RotarySpec`).
    """

    rotary: RotarySpec = field(default_factory=lambda: RotarySpec(2))
    family: ClassVar[str] = "rotary Q/K blocks"

    @property
    def algebra(self) -> BlockDiagonalAlgebra:
        """The Lie algebra of the group (planes ⊕ gl of the non-rotated features)."""
        planes = tuple(self.rotary.planes())
        return BlockDiagonalAlgebra(
            self.head_dim, planes, tuple(range(self.rotary.dims, self.head_dim))
        )

    @property
    def group(self) -> str:
        """E.g. ``(ℂ*)^4`` or ``(ℂ*)^2 × GL(4)``."""
        rest = self.head_dim - self.rotary.dims
        return f"(ℂ*)^{self.rotary.dims // 2}" + (f" × GL({rest})" if rest else "")

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """``x I₂ + y J₂`` (``x, y ~ N(0, 1)``) per rotation plane, ``N(0, 1)`` elsewhere."""
        alg = self.algebra
        A = alg.random_element((self.heads,), generator)
        return scale * _redraw(A, lambda n: alg.random_element((n,), generator), max_cond)

    def _random_lie(self, like: Tensor, generator: torch.Generator | None) -> Tensor:
        """A random element of the rotary algebra (planes ⊕ gl of the rest)."""
        return self.algebra.project(super()._random_lie(like, generator))

    def batch_key(self) -> Hashable:
        """Rotary blocks of equal shape and rotary layout share one batched geometry."""
        return ("rotary", self.n, self.m, self.head_dim, self.rotary)

    @classmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
    ) -> Geometry:
        """A batched :class:`~geosharp.geometry.GLSubgroupGeometry` with the rotary algebra."""
        G, H = point
        b0 = blocks[0]
        name = f"{len(blocks)} rotary block(s) {b0.rotary.label(b0.head_dim)} n={b0.n}, m={b0.m}"
        heads = [f"{b.name} head {i}" for b in blocks for i in range(b.heads)]
        return GLSubgroupGeometry(
            G,
            H,
            b0.algebra,
            metric=metric,
            eps=eps,
            name=name,
            head_names=heads,
            work_dtype=work_dtype,
        )


# -- GL(1) per coordinate -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False, repr=False)
class DiagonalPair(SymmetryBlock):
    """The factors ``(u, v)`` of a diagonal linear network ``y = xᵀ(u ⊙ v)`` (SPEC §3).

    One GL(1) per coordinate acts by ``(u_i, v_i) ↦ (α_i u_i, v_i / α_i)``.

    Attributes:
        name: Readable name, e.g. ``"net[u*v]"``.
        module: Dotted path of the owning module.
        u_index: ``LongTensor`` of global flat positions of ``u`` into ``θ``.
        v_index: ``LongTensor`` of the same shape: positions of the matching ``v``.
        kind: ``"pair"``.

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
    kind: str = "pair"

    index_fields: ClassVar[tuple[str, ...]] = ("u_index", "v_index")
    family: ClassVar[str] = "diagonal pairs"

    @property
    def count(self) -> int:
        """Number of coordinates (one GL(1) each)."""
        return int(self.u_index.numel())

    @property
    def group(self) -> str:
        """``GL(1)^size``."""
        return f"GL(1)^{self.count}"

    @property
    def shape_label(self) -> str:
        """``u, v: size``."""
        return f"u, v: {self.count:,}"

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """``α = scale·N(0, 1)`` per coordinate, redrawn while ``|α| < 0.1``."""
        a = torch.randn(self.u_index.shape, generator=generator, dtype=torch.float64)
        for _ in range(_MAX_TRIES):
            small = a.abs() < _MIN_ALPHA
            if not small.any():
                break
            a[small] = torch.randn(int(small.sum()), generator=generator, dtype=torch.float64)
        return scale * a

    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """``(u, v) ↦ (α u, v / α)``."""
        u, v = parts
        alpha = element.to(dtype=u.dtype, device=u.device)
        return u * alpha, v / alpha

    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """``(u ω, −v ω)``: the velocity of ``(u e^{tω}, v e^{−tω})`` at ``t = 0``."""
        u, v = parts
        w = torch.randn(u.shape, generator=generator, dtype=u.dtype, device=u.device)
        return u * w, -v * w

    def batch_key(self) -> Hashable:
        """Each pair is its own piece (as the closed-form studies expect)."""
        return ("pair", self.name)

    @classmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
    ) -> Geometry:
        """A :class:`~geosharp.geometry.DiagonalGeometry` of ``(u, v)``."""
        u, v = point
        return DiagonalGeometry(u, v, metric=metric, eps=eps)


# -- translations of a bias the loss ignores ------------------------------------------------------
@dataclass(frozen=True, eq=False, repr=False)
class TranslationBlock(SymmetryBlock):
    """Biases the loss does not depend on: the key bias of softmax attention (SPEC §8).

    Every translation ``b ↦ b + t`` is a symmetry, so the quotient is a point and geodesic
    measures hold these coordinates fixed (:class:`~geosharp.geometry.FixedGeometry`).

    Attributes:
        name: Readable name, e.g. ``"encoder.layer.0.attention[b_k]"``.
        module: Dotted path of the owning module.
        heads: Number of heads (rows of :attr:`index`).
        head_dim: Features per head.
        index: ``LongTensor (B, k, h)`` of global flat positions into ``θ``.
        kind: ``"b_k"``.
    """

    name: str
    module: str
    heads: int
    head_dim: int
    index: Tensor
    kind: str = "b_k"

    index_fields: ClassVar[tuple[str, ...]] = ("index",)
    family: ClassVar[str] = "key-bias translations (held fixed)"
    batch_flat: ClassVar[bool] = True

    @property
    def count(self) -> int:
        """Number of heads."""
        return self.heads

    @property
    def group(self) -> str:
        """``ℝ^n`` (translations)."""
        return f"ℝ^{self.numel} (translations)"

    @property
    def shape_label(self) -> str:
        """``b: numel``."""
        return f"b: {self.numel:,}"

    def random_element(
        self, generator: torch.Generator | None, scale: float, max_cond: float
    ) -> Tensor:
        """A translation ``t = scale·N(0, 1)`` of every coordinate."""
        return scale * torch.randn(self.index.shape, generator=generator, dtype=torch.float64)

    def act(self, parts: tuple[Tensor, ...], element: Tensor) -> tuple[Tensor, ...]:
        """``b ↦ b + t``."""
        (b,) = parts
        return (b + element.to(dtype=b.dtype, device=b.device),)

    def random_vertical(
        self, parts: tuple[Tensor, ...], generator: torch.Generator | None = None
    ) -> tuple[Tensor, ...]:
        """Any direction: every translation is a symmetry."""
        (b,) = parts
        return (torch.randn(b.shape, generator=generator, dtype=b.dtype, device=b.device),)

    def batch_key(self) -> Hashable:
        """All translations form one piece."""
        return ("translation",)

    @classmethod
    def batch(cls, blocks: Sequence[SymmetryBlock]) -> tuple[Tensor, ...]:
        """All positions of the batch, flattened into one vector."""
        return (torch.cat([b.index.reshape(-1) for b in blocks]),)

    @classmethod
    def geometry(
        cls,
        blocks: Sequence[SymmetryBlock],
        point: tuple[Tensor, ...],
        *,
        metric: str,
        eps: float,
        work_dtype: torch.dtype | None = None,
    ) -> Geometry:
        """:class:`~geosharp.geometry.FixedGeometry`: the quotient by translations is a point."""
        return FixedGeometry(point, name=f"{len(blocks)} key bias(es)")
