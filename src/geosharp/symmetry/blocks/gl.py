"""GL(h) and its subgroups: attention heads, LoRA adapters, rotary Q/K heads (SPEC §3, §8).

A :class:`GLBlock` is a batch of ``B`` factor pairs ``(G_b, H_b)`` on which the network depends
only through ``G_b H_bᵀ``; ``A ∈ GL(h)`` acts per head by ``(G, H) ↦ (G A⁻¹, H Aᵀ)``, and the
quotient geometry is :class:`~geosharp.geometry.GLGeometry`. :class:`LoRABlock` is the same
group on a LoRA pair (``h = r``); :class:`RotaryBlock` restricts it to the commutant of the
rotary rotations, with :class:`~geosharp.geometry.GLSubgroupGeometry`. All three are built from
a :class:`~geosharp.symmetry.specs.BlockSpec`: a rotary spec makes a rotary block, a spec of
kind ``"LoRA"`` a LoRA block, any other a GL block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry import Geometry, GLGeometry
from geosharp.geometry.gl_action import act as gl_act
from geosharp.geometry.gl_execution import GLExecution
from geosharp.geometry.gl_rows import RowSum
from geosharp.geometry.gl_subgroup import BlockDiagonalAlgebra, GLSubgroupGeometry
from geosharp.symmetry.blocks.base import MAX_TRIES, Coordinates, SymmetryBlock
from geosharp.symmetry.positions import Positions
from geosharp.symmetry.specs import BlockSpec, RotarySpec

__all__ = ["GLBlock", "LoRABlock", "RotaryBlock"]


# -- GL(h) --------------------------------------------------------------------------------------
def _draw_gl(heads: int, h: int, generator: torch.Generator | None, max_cond: float) -> Tensor:
    """``(heads, h, h)`` standard normal matrices, each resampled until ``cond ≤ max_cond``."""
    A = torch.randn(heads, h, h, generator=generator, dtype=torch.float64)
    return _redraw(
        A, lambda n: torch.randn(n, h, h, generator=generator, dtype=torch.float64), max_cond
    )


def _redraw(A: Tensor, draw, max_cond: float) -> Tensor:
    for _ in range(MAX_TRIES):
        bad = torch.linalg.cond(A) > max_cond
        if not bad.any():
            return A
        A[bad] = draw(int(bad.sum()))
    raise RuntimeError(
        f"could not draw {tuple(A.shape[1:])} group matrices with condition number ≤ "
        f"{max_cond:g} in {MAX_TRIES} tries; pass a larger max_cond"
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
    spec_type: ClassVar[type | None] = BlockSpec
    gl_pairs: ClassVar[bool] = True
    whole_gl: ClassVar[bool] = True
    shard_layout: ClassVar[str | None] = "rows"

    @classmethod
    def builds(cls, spec: BlockSpec) -> bool:
        """Every block spec (narrowed by :class:`LoRABlock` and :class:`RotaryBlock`)."""
        return True

    @staticmethod
    def _factors(spec: BlockSpec, coords: Coordinates) -> tuple[Positions, Positions]:
        """The positions of ``G`` and ``H``: ``(heads, n, h)`` and ``(heads, m, h)``."""
        owner = f"block {spec.name!r}"
        g = coords.slices(spec.g, spec.heads, spec.head_dim, owner)
        h = coords.slices(spec.h, spec.heads, spec.head_dim, owner)
        return g, h

    @classmethod
    def from_spec(cls, spec: BlockSpec, coords: Coordinates) -> GLBlock:
        """The block of ``spec``'s slices: ``G`` from ``spec.g``, ``H`` from ``spec.h``."""
        g, h = cls._factors(spec, coords)
        return cls(spec.name, spec.kind, spec.module, spec.heads, spec.head_dim, g, h)

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
        return gl_act(G, H, element.to(dtype=G.dtype, device=G.device))

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
        row_sum: RowSum | None = None,
    ) -> Geometry:
        """A batched :class:`~geosharp.geometry.GLGeometry` over every head of ``blocks``."""
        G, H = point
        b0 = blocks[0]
        name = f"{len(blocks)} GL({b0.head_dim}) block(s) n={b0.n}, m={b0.m}"
        heads = [f"{b.name} head {i}" for b in blocks for i in range(b.heads)]
        return GLGeometry(
            G,
            H,
            metric=metric,
            eps=eps,
            name=name,
            head_names=heads,
            execution=GLExecution(row_sum=row_sum),
            work_dtype=work_dtype,
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

    @classmethod
    def builds(cls, spec: BlockSpec) -> bool:
        """Specs of kind ``"LoRA"`` (without rotary embeddings)."""
        return spec.kind == "LoRA" and spec.rotary is None

    @property
    def category(self) -> str:
        """``"LoRA"``."""
        return "LoRA"


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
    whole_gl: ClassVar[bool] = False  # the rotary commutant

    @classmethod
    def builds(cls, spec: BlockSpec) -> bool:
        """Specs with rotary embeddings (``spec.rotary``)."""
        return spec.rotary is not None

    @classmethod
    def from_spec(cls, spec: BlockSpec, coords: Coordinates) -> RotaryBlock:
        """The block of ``spec``'s slices, with its rotary layout."""
        g, h = cls._factors(spec, coords)
        args = (spec.name, spec.kind, spec.module, spec.heads, spec.head_dim, g, h)
        return cls(*args, rotary=spec.rotary)

    @property
    def category(self) -> str:
        """``"rotary"``."""
        return "rotary"

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
        row_sum: RowSum | None = None,
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
            execution=GLExecution(row_sum=row_sum),
            work_dtype=work_dtype,
        )
