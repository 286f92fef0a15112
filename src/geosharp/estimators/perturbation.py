"""The perturbation set of a sharpness measure at a base point (SPEC §2, §5, §6).

A :class:`Perturbation` splits the flat parameter vector ``θ`` of a
:class:`~geosharp.symmetry.ParameterSpace` into *pieces*, each with its own
:class:`~geosharp.geometry.Geometry`:

* ``measure="geodesic"``: every group of symmetry blocks with one batch key becomes one
  batched geometry built by the block class (all heads of all layers in one set of batched
  matmuls: GL(h), rotary, LoRA, diagonal pairs, key biases held fixed), and the remaining
  coordinates the adaptive :class:`~geosharp.geometry.ElementwiseGeometry` (followed along
  straight lines, as adaptive sharpness does);
* ``measure="adaptive"``: one element-wise piece over all of ``θ``;
* ``measure="euclidean"``: one Euclidean piece over all of ``θ``.

A perturbation ``ξ`` is a list with one tangent tuple per piece; its squared norm is the sum of
the pieces' squared norms (one global ball, SPEC §5). The perturbed parameters
``θ′ = endpoint(ξ)`` are a differentiable function of ``ξ``, so one forward and one backward of
the loss at ``θ′`` give the Euclidean gradient with respect to ``ξ`` (SPEC §6, step 2). All
base-point work (Gram matrices and their factorizations) happens once, in the constructor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.geometry import ElementwiseGeometry, EuclideanGeometry, FixedGeometry, Geometry
from geosharp.geometry.base import Tangent
from geosharp.symmetry import ParameterSpace

MEASURES = ("geodesic", "adaptive", "euclidean")
PERTURB = ("all", "blocks")
BLOCK_METRICS = ("inv", "mix", "adaptive")

Xi = list[Tangent]


class _ProductElementwise(Geometry):
    """Element-wise (adaptive) metric on a tuple of tensors, e.g. ``(G, H)`` of a GL block.

    Used for the paper's "no corrected norm" ablation and for ``metric="adaptive"``: the block's
    coordinates then carry the adaptive metric while still being gathered and scattered as a block.
    """

    def __init__(self, point: Sequence[Tensor]) -> None:
        self.parts = [ElementwiseGeometry(p) for p in point]
        self.point = tuple(point)

    def inner(self, a: Tangent, b: Tangent) -> Tensor:
        return sum(g.inner((x,), (y,)) for g, x, y in zip(self.parts, a, b, strict=True))

    def project(self, xi: Tangent) -> Tangent:
        return tuple(g.project((x,))[0] for g, x in zip(self.parts, xi, strict=True))

    def riemannian_grad(self, egrad: Tangent) -> Tangent:
        return tuple(g.riemannian_grad((e,))[0] for g, e in zip(self.parts, egrad, strict=True))

    def christoffel_at(self, point: Tangent, xi: Tangent) -> Tangent:
        return tuple(torch.zeros_like(x) for x in xi)

    def geodesic(self, xi: Tangent, order: int | str = 1, steps: int = 10) -> Tangent:
        return tuple(p + x for p, x in zip(self.point, xi, strict=True))

    def random_tangent(
        self, generator: torch.Generator | None = None, scale: float = 1.0, horizontal: bool = True
    ) -> Tangent:
        return tuple(g.random_tangent(generator, scale)[0] for g in self.parts)


@dataclass
class Piece:
    """One part of ``θ`` with its geometry.

    Attributes:
        name: Readable name (for summaries and errors).
        index: Global positions in ``θ``, one tensor per component of the point (``None``: all
            of ``θ``, a single component).
        geometry: Geometry used for the horizontal projection and the geodesic.
        norm_geometry: Geometry of the ball and of the Riemannian gradient (differs from
            ``geometry`` only in the "no corrected norm" ablation).
        order: Geodesic order used for this piece.
    """

    name: str
    index: tuple[Tensor, ...] | None
    geometry: Geometry
    norm_geometry: Geometry
    order: int | str


class Perturbation:
    """Geometry of the perturbation set of one sharpness measure at the base point ``θ₀``.

    Args:
        space: The model's parameter space (from :func:`geosharp.find_symmetries`).
        theta0: Base point, the flat trainable parameters (detached).
        measure: ``"geodesic"``, ``"adaptive"`` or ``"euclidean"``.
        metric: Block metric for ``measure="geodesic"``: ``"inv"``, ``"mix"`` or ``"adaptive"``
            (blocks keep the element-wise metric: with ``order=1`` this reproduces adaptive
            sharpness through the block machinery, SPEC §5).
        order: Geodesic order for symmetry blocks and diagonal pairs: ``1``, ``2`` or
            ``"exact"``.
        eps: Gram-matrix damping of the GL(h) blocks.
        corrected_norm: ``False`` is the paper's "no corrected norm" ablation: blocks are still
            followed along the geodesic of their invariant metric, but the ball, the Riemannian
            gradient and the projection (only of frozen coordinates: the adaptive metric has no
            quotient) use the adaptive element-wise metric. Projecting horizontally in the
            block metric instead would not be orthogonal in the ball's metric and can inflate
            the adaptive norm of a useful direction many-fold.
        exact_steps: RK4 steps for ``order="exact"``.
        perturb: ``"all"`` (default) or ``"blocks"``: only the symmetry blocks move, every other
            coordinate is held fixed (the attention-only measures, where the effect of the
            quotient is not diluted by MLP and embedding coordinates).
    """

    def __init__(
        self,
        space: ParameterSpace,
        theta0: Tensor,
        *,
        measure: str = "geodesic",
        metric: str = "inv",
        order: int | str = 2,
        eps: float = 0.0,
        corrected_norm: bool = True,
        exact_steps: int = 10,
        perturb: str = "all",
    ) -> None:
        if perturb not in PERTURB:
            raise ValueError(f"perturb must be one of {PERTURB}, got {perturb!r}")
        if perturb == "blocks" and measure != "geodesic":
            raise ValueError(
                "perturb='blocks' needs measure='geodesic' (metric='adaptive', order=1 is "
                "adaptive sharpness of the blocks)"
            )
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
        if measure == "geodesic" and metric not in BLOCK_METRICS:
            raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {metric!r}")
        self.space = space
        # θ₀ itself is not kept: every piece holds its own part of it (one copy of the weights
        # in all, and none for measure="adaptive", whose piece is θ₀).
        theta0 = theta0.detach()
        self.measure = measure
        self.metric = metric
        self.order = order
        self.exact_steps = exact_steps
        device = theta0.device
        self.pieces: list[Piece] = []
        if measure == "adaptive":
            g = ElementwiseGeometry(theta0, name="all parameters")
            self.pieces.append(Piece("all parameters (adaptive)", None, g, g, 1))
            return
        if measure == "euclidean":
            g = EuclideanGeometry(theta0, name="all parameters")
            self.pieces.append(Piece("all parameters (euclidean)", None, g, g, 1))
            return
        for blocks in _group_blocks(space):
            cls = type(blocks[0])
            index = tuple(i.to(device) for i in cls.batch(blocks))
            point = tuple(theta0[i] for i in index)
            if metric == "adaptive":
                geom: Geometry = _ProductElementwise(point)
                piece_order: int | str = 1
            else:
                geom = cls.geometry(blocks, point, metric=metric, eps=eps)
                piece_order = order
            if corrected_norm or geom.is_trivial:
                norm_geom = geom
            else:  # the adaptive norm, on tangents kept in the block geometry's dtype
                wide = geom.tangent_dtype
                norm_geom = _ProductElementwise(tuple(p.to(wide) for p in point))
            name = blocks[0].name if len(blocks) == 1 else getattr(geom, "name", cls.__name__)
            self.pieces.append(Piece(name, index, geom, norm_geom, piece_order))
        rest = space.rest_index.to(device)
        self._rest_piece: int | None = None
        if rest.numel():
            if perturb == "blocks":  # attention-only: everything outside the blocks held fixed
                g = FixedGeometry((theta0[rest],), name="other parameters (held fixed)")
                label = "other parameters (held fixed)"
            else:
                g = ElementwiseGeometry(theta0[rest], name="other parameters")
                label = "other parameters (adaptive)"
            self._rest_piece = len(self.pieces)
            self.pieces.append(Piece(label, (rest,), g, g, 1))
        # θ′ is assembled by one gather: the pieces' values, concatenated, put back in θ order.
        # (Pieces cover every coordinate exactly once; the symmetry finder guarantees it.)
        covered = sum(i.numel() for p in self.pieces for i in p.index)
        if covered != theta0.numel():
            raise ValueError(
                f"the symmetry blocks and the rest cover {covered} coordinates of "
                f"{theta0.numel()}: the ParameterSpace is inconsistent"
            )
        self._inverse: Tensor | None = None  # of endpoint(), built on first use
        self._assembly = _Assembly(space, self.pieces, self._rest_piece, device)

    # -- tangent-vector arithmetic -------------------------------------------------------------
    def zeros(self) -> Xi:
        """The zero perturbation."""
        return [p.geometry.zeros() for p in self.pieces]

    @staticmethod
    def combine(a: Xi, b: Xi, alpha: float = 1.0, beta: float = 1.0) -> Xi:
        """``alpha·a + beta·b`` piece by piece."""
        return [
            tuple(alpha * x + beta * y for x, y in zip(ta, tb, strict=True))
            for ta, tb in zip(a, b, strict=True)
        ]

    def norm_sq(self, xi: Xi) -> Tensor:
        """Squared norm of the whole perturbation: the sum over pieces (one global ball)."""
        return sum(p.norm_geometry.norm_sq(x).sum() for p, x in zip(self.pieces, xi, strict=True))

    def norm(self, xi: Xi) -> float:
        """Norm ``‖ξ‖`` as a float."""
        return float(self.norm_sq(xi).clamp_min(0).sqrt())

    def project(self, xi: Xi) -> Xi:
        """Horizontal projection of every piece, in the ball's metric (frozen ones zeroed)."""
        return [p.norm_geometry.project(x) for p, x in zip(self.pieces, xi, strict=True)]

    def riemannian_grad(self, egrad: Xi, inplace: bool = False) -> Xi:
        """Riemannian gradient in the ball's metric, projected horizontally (SPEC §6, step 3).

        With ``inplace=True`` the element-wise pieces of ``egrad`` are overwritten (``e ⊙ w²``
        is already zero on frozen coordinates, so it needs no projection).
        """
        out = []
        for p, e in zip(self.pieces, egrad, strict=True):
            g = p.norm_geometry
            if inplace and isinstance(g, ElementwiseGeometry) and p.geometry is g:
                out.append((g.riemannian_grad_(e[0]),))
            elif isinstance(g, EuclideanGeometry):
                out.append(tuple(e))
            else:
                out.append(g.project(g.riemannian_grad(e)))
        return out

    def ball(self, xi: Xi, rho: float, inplace: bool = False, project: bool = True) -> Xi:
        """``P_S``: horizontal projection, then radial rescale into ``‖ξ‖ ≤ ρ`` (SPEC §6 step 4).

        Args:
            xi: The perturbation.
            rho: Radius.
            inplace: Let the rescale overwrite the (projected) tensors of ``xi``.
            project: ``False`` when ``xi`` is known to be horizontal already (a linear
                combination of horizontal vectors), where the projection is the identity.
        """
        if project:
            xi = self.project(xi)
        n = self.norm(xi)
        if n > rho:
            if inplace:
                for x in xi:
                    for t in x:
                        t.mul_(rho / n)
            else:
                xi = [tuple(t * (rho / n) for t in x) for x in xi]
        return xi

    def random(self, generator: torch.Generator | None, scale: float) -> Xi:
        """Isotropic Gaussian in the metric of every piece, projected horizontally (SPEC §6)."""
        out = []
        for p in self.pieces:
            xi = p.norm_geometry.random_tangent(generator, scale)
            dtype = p.geometry.tangent_dtype
            out.append(tuple(t.to(dtype) for t in xi))
        return out

    # -- ℓ∞ (adaptive or plain box) -----------------------------------------------------------
    def sign_direction(self, egrad: Xi) -> Xi:
        """``sign(e) ⊙ |w|`` (adaptive) or ``sign(e)`` (euclidean): the ℓ∞ ascent direction."""
        out = []
        for p, e in zip(self.pieces, egrad, strict=True):
            scale = p.geometry.abs_w if isinstance(p.geometry, ElementwiseGeometry) else 1.0
            out.append(tuple(torch.sign(t) * scale for t in e))
        return out

    def box(self, xi: Xi, rho: float) -> Xi:
        """Projection onto the box ``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ``."""
        out = []
        for p, x in zip(self.pieces, xi, strict=True):
            if isinstance(p.geometry, ElementwiseGeometry):
                bound = rho * p.geometry.abs_w
            else:
                bound = torch.full_like(x[0], rho)
            out.append(tuple(torch.maximum(torch.minimum(t, bound), -bound) for t in x))
        return out

    def uniform_box(self, generator: torch.Generator | None, rho: float) -> Xi:
        """Uniform sample of the box ``|ξ_i| ≤ ρ|w_i|`` (adaptive) or ``|ξ_i| ≤ ρ``."""
        out = []
        for p in self.pieces:
            x = []
            for t in p.geometry.point:
                u = 2 * torch.rand(t.shape, generator=generator, dtype=t.dtype, device=t.device) - 1
                x.append(u * rho * (t.abs() if isinstance(p.geometry, ElementwiseGeometry) else 1))
            out.append(tuple(x))
        return out

    # -- the perturbed parameters -------------------------------------------------------------
    def _moved(self, xi: Xi) -> list[tuple[Tensor, ...]]:
        """Every piece moved along its geodesic (or straight line) from the base point."""
        out = []
        for p, x in zip(self.pieces, xi, strict=True):
            out.append(p.geometry.iterate_endpoint(x, order=p.order, steps=self.exact_steps))
        return out

    def endpoint(self, xi: Xi) -> Tensor:
        """Flat perturbed parameters ``θ′``, each piece moved along its geodesic."""
        moved = self._moved(xi)
        if self.pieces[0].index is None:
            return moved[0][0]
        if self._inverse is None:
            order = torch.cat([i.reshape(-1) for p in self.pieces for i in p.index])
            self._inverse = torch.empty_like(order)
            self._inverse[order] = torch.arange(order.numel(), device=order.device)
        return torch.cat([v.reshape(-1) for new in moved for v in new])[self._inverse]

    def endpoint_params(self, xi: Xi) -> dict[str, Tensor]:
        """The perturbed parameters by name: ``space.unflatten(endpoint(ξ))``, built cheaply.

        Bit-identical to :meth:`endpoint` followed by
        :meth:`~geosharp.symmetry.ParameterSpace.unflatten`, but without a pass over all of
        ``θ``: parameters with no coordinate in a symmetry block are views of the adaptive
        piece, and only the coordinates of symmetry blocks are gathered (see
        :class:`_Assembly`). Ready for :func:`torch.func.functional_call`; differentiable in
        ``ξ``.
        """
        moved = self._moved(xi)
        if self.pieces[0].index is None:
            return self.space.unflatten(moved[0][0])
        return self._assembly(moved)


def _group_blocks(space: ParameterSpace) -> list[list]:
    """Blocks grouped by :meth:`~geosharp.symmetry.SymmetryBlock.batch_key`, in first-seen order.

    Each group becomes one batched geometry (e.g. all QK heads of equal shape of all layers).
    """
    groups: dict = {}
    for b in space.blocks:
        groups.setdefault(b.batch_key(), []).append(b)
    return list(groups.values())


class _Assembly:
    """Builds the perturbed parameters from the moved pieces with few full-size passes.

    The pieces hold the coordinates of ``θ`` in their own order: the symmetry pieces (blocks,
    pairs) a permutation of their coordinates, the adaptive piece ("rest") the remaining ones in
    ``θ`` order (:attr:`~geosharp.symmetry.ParameterSpace.rest_index` is sorted). A parameter
    entirely in the rest is therefore a contiguous run of the rest piece: one ``split`` gives
    it as a view, and its gradient flows back through one ``cat``. Parameters with coordinates
    in a symmetry piece (the Q, K, V, O projections) are gathered from a *source* vector, the
    symmetry pieces' values followed by the rest coordinates of such parameters, by one index.
    On MiniLM-L6 that gathers 3.5 M values instead of permuting all 22.7 M (and, backwards,
    scattering them into a θ-sized zero vector).
    """

    def __init__(
        self,
        space: ParameterSpace,
        pieces: Sequence[Piece],
        rest_piece: int | None,
        device: torch.device,
    ) -> None:
        self.names, self.shapes = list(space.param_names), list(space.shapes)
        sizes = [math.prod(s) for s in self.shapes]
        self.rest_piece = rest_piece
        self.sym_pieces = [i for i in range(len(pieces)) if i != rest_piece]
        sym_order = [i.reshape(-1) for k in self.sym_pieces for i in pieces[k].index]
        n = space.numel()
        position = torch.full((n,), -1, dtype=torch.long, device=device)
        n_src = 0
        if sym_order:
            order = torch.cat(sym_order)
            position[order] = torch.arange(order.numel(), device=device)
            n_src = order.numel()
        rest = space.rest_index.to(device)
        starts = torch.tensor(space.offsets, dtype=torch.long, device=device)
        ends = starts + torch.tensor(sizes, dtype=torch.long, device=device)
        lo = torch.searchsorted(rest, starts).tolist()
        hi = torch.searchsorted(rest, ends).tolist()
        #: Rest coordinates per parameter (the rest piece is split by these).
        self.rest_sizes = [b - a for a, b in zip(lo, hi, strict=True)]
        #: Parameters with symmetry coordinates, gathered from the source.
        self.gathered = [j for j, s in enumerate(sizes) if self.rest_sizes[j] < s]
        #: Rest runs appended to the source (parameters that are partly rest).
        self.mixed = [j for j in self.gathered if self.rest_sizes[j] > 0]
        for j in self.mixed:
            position[rest[lo[j] : hi[j]]] = torch.arange(
                n_src, n_src + self.rest_sizes[j], device=device
            )
            n_src += self.rest_sizes[j]
        self.gathered_sizes = [sizes[j] for j in self.gathered]
        runs = [position[space.offsets[j] : space.offsets[j] + sizes[j]] for j in self.gathered]
        self.index = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long, device=device)
        if self.index.numel() and int(self.index.min()) < 0:
            raise ValueError("the symmetry blocks and the rest do not cover every parameter")

    def __call__(self, moved: Sequence[tuple[Tensor, ...]]) -> dict[str, Tensor]:
        chunks: Sequence[Tensor] = ()
        if self.rest_piece is not None:
            chunks = torch.split(moved[self.rest_piece][0], self.rest_sizes)
        out: dict[str, Tensor] = {}
        if self.gathered:
            parts = [v.reshape(-1) for k in self.sym_pieces for v in moved[k]]
            parts += [chunks[j] for j in self.mixed]
            source = torch.cat(parts) if len(parts) > 1 else parts[0]
            for j, value in zip(
                self.gathered, torch.split(source[self.index], self.gathered_sizes), strict=True
            ):
                out[self.names[j]] = value.view(self.shapes[j])
        for j, (name, shape) in enumerate(zip(self.names, self.shapes, strict=True)):
            if name not in out:
                out[name] = chunks[j].view(shape)
        return {name: out[name] for name in self.names}
