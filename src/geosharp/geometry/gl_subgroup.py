r"""GL(h) metrics on the quotient by a *subgroup* of GL(h) (SPEC §8).

When only a subgroup ``K ⊂ GL(h)`` leaves the network unchanged — rotary position embeddings
keep just the matrices that commute with every rotation — the inv and mix metrics of
:mod:`geosharp.geometry.gl` are still invariant (they are invariant under all of GL(h)), the
Christoffel forms and the order-2 endpoint are unchanged, and only the vertical space shrinks to
``V(Ω) = (−GΩ, HΩᵀ)``, ``Ω ∈ 𝔨``. The horizontal projection removes the metric least-squares
vertical part: ``ξ_h = ξ − V(Ω*)`` with

.. code-block:: text

    Π_𝔨 L(Ω*) = Π_𝔨 C(ξ),   Ω* ∈ 𝔨,   L(Ω) = C(V(Ω)) = P₁ Ω Q₁ + P₂ Ω Q₂,
    inv:  C(ξ) = M_H⁻¹ ξ_Hᵀ H − Gᵀ ξ_G M_G⁻¹,   P₁ = M_H⁻¹, Q₁ = HᵀH, P₂ = GᵀG, Q₂ = M_G⁻¹
    mix:  C(ξ) = M_G ξ_Hᵀ H − Gᵀ ξ_G M_H,       P₁ = M_G,   Q₁ = HᵀH, P₂ = GᵀG, Q₂ = M_H

(``⟨ξ, V(Ω)⟩ = ⟨C(ξ), Ω⟩_F``; ``L`` is Frobenius-self-adjoint and positive definite). The
algebras used here are block diagonal, :class:`BlockDiagonalAlgebra`: a scaled rotation
``a I₂ + b J₂`` on each of a set of planes, and all of ``gl(P)`` on a set ``P`` of free features.
On ``gl(P)`` the normal equation ``a Ω b + c Ω d = F`` has a closed form (one eigendecomposition
pair per head, at the base point); the planes are eliminated by a Schur complement ``K c = r``
of size ``2·#planes``, also factorized once. Each projection then costs two ``gl(P)`` solves, a
few ``h × h`` products and one small triangular solve per head. With no planes and ``P`` all
features this is exactly the projection of :class:`~geosharp.geometry.gl.GLGeometry` (at
``ε = 0``; at ``ε > 0`` this one stays the exact metric projection).

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> G = torch.randn(3, 7, 6, dtype=torch.float64, generator=g)
    >>> H = torch.randn(3, 8, 6, dtype=torch.float64, generator=g)
    >>> alg = BlockDiagonalAlgebra(6, planes=((0, 2), (1, 3)), free=(4, 5))  # rotary 4 of 6
    >>> geom = GLSubgroupGeometry(G, H, alg, metric="inv")
    >>> xi = geom.project((torch.randn_like(G), torch.randn_like(H)))
    >>> float(geom.horizontal_residual(xi).abs().max()) < 1e-10
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry.gl import DEFAULT_EPS, GLGeometry
from geosharp.geometry.gl_execution import GLExecution
from geosharp.geometry.gl_factors import GLFactors, RankCheck
from geosharp.geometry.gl_rows import RowSum, contract

__all__ = [
    "BlockDiagonalAlgebra",
    "GLSubgroupGeometry",
    "SubgroupFactors",
    "moment",
    "subgroup_factors",
    "subgroup_lam",
]

_R2 = 1.0 / math.sqrt(2.0)


@dataclass(frozen=True)
class BlockDiagonalAlgebra:
    """A Lie subalgebra ``𝔨 ⊂ gl(h)``: scaled rotations on planes ⊕ ``gl(P)`` on free features.

    ``Ω ∈ 𝔨`` iff ``Ω`` is zero outside the plane blocks and the ``P × P`` block, each plane
    block ``(a, b)`` is ``x I₂ + y J₂`` (``J₂ = [[0, −1], [1, 0]]``), and the ``P × P`` block is
    arbitrary. Features in neither set are fixed (``Ω`` is zero on their rows and columns).

    Attributes:
        h: Group dimension.
        planes: Disjoint feature pairs ``(a, b)``.
        free: Features with the full ``gl`` (the non-rotated features of partial rotary).

    Example:
        >>> BlockDiagonalAlgebra(4, planes=((0, 2), (1, 3))).dim
        4
    """

    h: int
    planes: tuple[tuple[int, int], ...] = ()
    free: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        used = [i for p in self.planes for i in p] + list(self.free)
        if len(set(used)) != len(used) or any(not 0 <= i < self.h for i in used):
            raise ValueError(
                f"planes {self.planes} and free features {self.free} must be disjoint indices "
                f"in [0, {self.h})"
            )

    @property
    def dim(self) -> int:
        """``dim 𝔨 = 2·#planes + |P|²``."""
        return 2 * len(self.planes) + len(self.free) ** 2

    def basis_entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """Row, column and value of the two nonzero entries of each plane basis element.

        The plane basis ``{I_p/√2, J_p/√2}`` is Frobenius-orthonormal.

        Returns:
            ``rows, cols, vals`` of shape ``(2·#planes, 2)``.
        """
        rows, cols, vals = [], [], []
        for a, b in self.planes:
            rows += [(a, b), (b, a)]
            cols += [(a, b), (a, b)]
            vals += [(_R2, _R2), (_R2, -_R2)]
        if not rows:
            empty = torch.zeros(0, 2, dtype=torch.long)
            return empty, empty, torch.zeros(0, 2, dtype=torch.float64)
        return (
            torch.tensor(rows, dtype=torch.long),
            torch.tensor(cols, dtype=torch.long),
            torch.tensor(vals, dtype=torch.float64),
        )

    def random_element(
        self, batch: Sequence[int], generator: torch.Generator | None = None
    ) -> Tensor:
        """A random element of the group ``exp(𝔨)``-component: ``(…, h, h)`` float64 matrices.

        Plane blocks ``x I₂ + y J₂`` with ``x, y ~ N(0, 1)``, the ``P × P`` block ``N(0, 1)``,
        the identity on fixed features.

        Args:
            batch: Leading dimensions.
            generator: CPU random generator.

        Returns:
            The matrices (almost surely invertible).
        """
        A = torch.eye(self.h, dtype=torch.float64).expand(*batch, self.h, self.h).clone()
        for a, b in self.planes:
            x, y = torch.randn(2, *batch, generator=generator, dtype=torch.float64)
            A[..., a, a], A[..., b, b], A[..., b, a], A[..., a, b] = x, x, y, -y
        if self.free:
            f = torch.tensor(self.free, dtype=torch.long)
            block = torch.randn(*batch, len(f), len(f), generator=generator, dtype=torch.float64)
            A[..., f.unsqueeze(-1), f] = block
        return A

    def project(self, X: Tensor) -> Tensor:
        """Frobenius-orthogonal projection of ``(…, h, h)`` matrices onto ``𝔨``."""
        out = torch.zeros_like(X)
        for a, b in self.planes:
            x = 0.5 * (X[..., a, a] + X[..., b, b])
            y = 0.5 * (X[..., b, a] - X[..., a, b])
            out[..., a, a], out[..., b, b], out[..., b, a], out[..., a, b] = x, x, y, -y
        if self.free:
            f = torch.tensor(self.free, dtype=torch.long, device=X.device)
            out[..., f.unsqueeze(-1), f] = X[..., f.unsqueeze(-1), f]
        return out


@dataclass(frozen=True)
class SubgroupFactors(GLFactors):
    """:class:`~geosharp.geometry.gl_factors.GLFactors` and the factors of the 𝔨 solve.

    Attributes:
        PQ: ``(P₁, Q₁, P₂, Q₂)`` of ``L(Ω) = P₁ Ω Q₁ + P₂ Ω Q₂`` (see the module).
        Lx: ``a^{−1/2} U_x`` of the ``gl(P)`` solve ``a Ω b + c Ω d = F`` (``None``: no free
            features).
        Rx: ``U_xᵀ a^{−1/2}``.
        Ly: ``d^{−1/2} U_y``.
        Ry: ``U_yᵀ d^{−1/2}``.
        den: The denominators ``x_i + y_j`` of the ``gl(P)`` solve.
        omega_l: The free-block response ``S(Π_P L(E_l))`` to each plane basis element
            (``None``: no planes or no free features).
        chol: Cholesky factor of the planes' Schur complement ``K`` (``None``: no planes).
        rows: Rows of the plane basis entries (shared by every head), ``(2·#planes, 2)``.
        cols: Their columns.
        vals: Their values (``±1/√2``).
        free: The free features, a long tensor.
    """

    PQ: tuple[Tensor, ...] = ()
    Lx: Tensor | None = None
    Rx: Tensor | None = None
    Ly: Tensor | None = None
    Ry: Tensor | None = None
    den: Tensor | None = None
    omega_l: Tensor | None = None
    chol: Tensor | None = None
    rows: Tensor | None = None
    cols: Tensor | None = None
    vals: Tensor | None = None
    free: Tensor | None = None

    SHARED: ClassVar[frozenset[str]] = frozenset({"rows", "cols", "vals", "free"})


# -- the math of the 𝔨 solve: pure functions of the factors ---------------------------------------
def subgroup_factors(
    G: Tensor,
    H: Tensor,
    F: GLFactors,
    algebra: BlockDiagonalAlgebra,
    metric: str,
    row_sum: RowSum | None = None,
    grams: tuple[Tensor, Tensor] | None = None,
) -> SubgroupFactors:
    """The factors of the vertical-space solve for ``𝔨`` at ``(G, H)``, in ``F``'s dtype (SPEC §8).

    ``(P₁, Q₁, P₂, Q₂)`` of ``L``; on the free block the eigendecompositions of
    ``a Ω b + c Ω d = F``; on the planes the Schur complement ``K c = r`` (with the free
    block eliminated), Cholesky-factored.
    """
    dev = G.device
    if grams is not None:  # GᵀG and HᵀH made already (gram_matrices)
        GG, HH = grams
    else:
        HH, GG = contract((H, H), (G, G), row_sum=row_sum)
    if metric == "inv":
        P1, Q1, P2, Q2 = F.MH_inv, HH, GG, F.MG_inv
    else:
        P1, Q1, P2, Q2 = F.MG, HH, GG, F.MH
    PQ = (P1, Q1, P2, Q2)
    rows, cols, vals = (t.to(dev) for t in algebra.basis_entries())
    vals = vals.to(F.MG.dtype)
    free = torch.tensor(algebra.free, dtype=torch.long, device=dev)
    base = {f.name: getattr(F, f.name) for f in dataclasses.fields(GLFactors)}
    out = SubgroupFactors(**base, PQ=PQ, rows=rows, cols=cols, vals=vals, free=free)
    k = rows.shape[0]
    if len(free):
        out = dataclasses.replace(out, **_free_solver(PQ, free))
    if k:
        K = _pair_gram(PQ, rows, cols, vals)
        if len(free):
            # Ω_l = S(Π_P L(E_l)): the free-block response to each plane basis element.
            resp = 0
            for P, Q in ((P1, Q1), (P2, Q2)):
                Pg = P[..., free.unsqueeze(-1), rows.reshape(-1)].unflatten(-1, (k, 2))
                Qg = Q[..., cols.reshape(-1, 1), free].unflatten(-2, (k, 2))  # (..., k, 2, p)
                resp = resp + torch.einsum("...pls,ls,...lsq->...lpq", Pg, vals, Qg)
            omega_l = _solve_free(out, resp)  # (..., k, p, p)
            out = dataclasses.replace(out, omega_l=omega_l)
            K = K - _free_to_pairs(out, omega_l).mT
        out = dataclasses.replace(out, chol=torch.linalg.cholesky(0.5 * (K + K.mT)))
    return out


def moment(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    F: GLFactors,
    metric: str,
    row_sum: RowSum | None = None,
) -> Tensor:
    """``C(ξ)`` with ``⟨ξ, V(Ω)⟩ = ⟨C(ξ), Ω⟩_F`` for all ``Ω ∈ gl(h)``, ``(..., h, h)`` (SPEC §8).

    inv: ``C(ξ) = M_H⁻¹ ξ_Hᵀ H − Gᵀ ξ_G M_G⁻¹``; mix: ``C(ξ) = M_G ξ_Hᵀ H − Gᵀ ξ_G M_H``.
    """
    XH, GX = contract((xH, H), (G, xG), row_sum=row_sum)
    return moment_from(XH, GX, F, metric)


def moment_from(XH: Tensor, GX: Tensor, F: GLFactors, metric: str) -> Tensor:
    """:func:`moment` from its two contractions ``ξ_Hᵀ H`` and ``Gᵀ ξ_G``."""
    if metric == "inv":
        return F.MH_inv @ XH - GX @ F.MG_inv
    return F.MG @ XH - GX @ F.MH


def subgroup_lam(
    G: Tensor,
    H: Tensor,
    xG: Tensor,
    xH: Tensor,
    F: SubgroupFactors,
    metric: str,
    row_sum: RowSum | None = None,
) -> Tensor:
    """``Ω* ∈ 𝔨`` of the horizontal projection ``ξ − V(Ω*)``: ``Π_𝔨 L(Ω*) = Π_𝔨 C(ξ)`` (SPEC §8).

    The free block by the closed-form ``gl(P)`` solve, the plane coefficients by the Schur
    complement's Cholesky factor, then the free block corrected by their response.
    """
    return lam_in_algebra(moment(G, H, xG, xH, F, metric=metric, row_sum=row_sum), F)


def lam_in_algebra(C: Tensor, F: SubgroupFactors) -> Tensor:
    """:func:`subgroup_lam` from the moment ``C(ξ)``."""
    has_free, has_pairs = len(F.free) > 0, F.rows.shape[0] > 0
    f = F.free
    omega_free = _solve_free(F, C[..., f.unsqueeze(-1), f]) if has_free else None
    c = None
    if has_pairs:
        r = _coef(F, C)
        if has_free:
            r = r - _free_to_pairs(F, omega_free)
        c = torch.cholesky_solve(r.unsqueeze(-1), F.chol).squeeze(-1)
        if has_free:
            omega_free = omega_free - torch.einsum("...l,...lpq->...pq", c, F.omega_l)
    return _embed(F, C, c, omega_free)


def _free_solver(PQ: tuple[Tensor, ...], free: Tensor) -> dict[str, Tensor]:
    """Factor ``a Ω b + c Ω d = F`` on the free block (``a, d`` SPD, ``b, c`` PSD)."""
    a, b, c, d = (X[..., free.unsqueeze(-1), free] for X in PQ)

    def isqrt(M: Tensor) -> Tensor:
        lam, U = torch.linalg.eigh(M)
        return (U * lam.rsqrt().unsqueeze(-2)) @ U.mT

    ai, di = isqrt(a), isqrt(d)
    dx, Ux = torch.linalg.eigh(ai @ c @ ai)
    dy, Uy = torch.linalg.eigh(di @ b @ di)
    return dict(
        Lx=ai @ Ux,
        Rx=Ux.mT @ ai,
        Ly=di @ Uy,
        Ry=Uy.mT @ di,
        den=dx.unsqueeze(-1) + dy.unsqueeze(-2),
    )


def _solve_free(F: SubgroupFactors, X: Tensor) -> Tensor:
    """``Ω`` with ``a Ω b + c Ω d = X`` (batched; ``X`` may have one extra dim before p×p)."""
    extra = X.dim() - F.den.dim()
    Lx, Rx, Ly, Ry, den = (
        t.reshape(*t.shape[:-2], *([1] * extra), *t.shape[-2:])
        for t in (F.Lx, F.Rx, F.Ly, F.Ry, F.den)
    )
    return Lx @ ((Rx @ X @ Ly) / den) @ Ry


def _pair_gram(PQ: tuple[Tensor, ...], rows: Tensor, cols: Tensor, vals: Tensor) -> Tensor:
    """``K_jl = ⟨L(E_l), E_j⟩`` over the plane basis, ``(..., k, k)``."""
    k = rows.shape[0]
    K = 0
    for P, Q in (PQ[0:2], PQ[2:4]):
        # (P E_l Q)[x, y] = Σ_s v_ls P[x, r_ls] Q[c_ls, y] at (x, y) = (r_jt, c_jt).
        Pg = P[..., rows.reshape(k, 2, 1, 1), rows.reshape(1, 1, k, 2)]
        Qg = Q[..., cols.reshape(1, 1, k, 2), cols.reshape(k, 2, 1, 1)]
        K = K + torch.einsum("...jtls,jt,ls->...jl", Pg * Qg, vals, vals)
    return K


def _coef(F: SubgroupFactors, X: Tensor) -> Tensor:
    """``⟨X, E_l⟩_F`` for every plane basis element, ``(..., k)``."""
    return (X[..., F.rows, F.cols] * F.vals).sum(-1)


def _free_to_pairs(F: SubgroupFactors, omega: Tensor) -> Tensor:
    """``⟨L(emb_P Ω), E_j⟩`` for free-block ``Ω`` ``(..., [l,] p, p)``, as ``(..., [l,] k)``.

    ``(P emb(Ω) Q)[x, y] = P[x, P] Ω Q[P, y]``, read at the plane entries ``(r_jt, c_jt)``.
    """
    f, rows, cols = F.free, F.rows, F.cols
    out = 0
    extra = omega.dim() - F.PQ[0].dim()
    for P, Q in (F.PQ[0:2], F.PQ[2:4]):
        Pg = P[..., rows, :][..., f]  # (..., k, 2, p)
        Qg = Q[..., f, :][..., cols]  # (..., p, k, 2)
        if extra:
            Pg, Qg = Pg.unsqueeze(-4), Qg.unsqueeze(-4)
        out = out + torch.einsum("...jtp,...pq,...qjt,jt->...j", Pg, omega, Qg, F.vals)
    return out


def _embed(F: SubgroupFactors, C: Tensor, c: Tensor | None, omega_free: Tensor | None) -> Tensor:
    """``Σ_l c_l E_l + emb_P(Ω_P)`` as dense matrices shaped (and typed) like ``C``."""
    h = C.shape[-1]
    batch = C.shape[:-2]
    out = torch.zeros(*batch, h, h, dtype=C.dtype, device=C.device)
    if c is not None:
        flat = (F.rows * h + F.cols).reshape(-1)
        vals = (c.unsqueeze(-1) * F.vals).reshape(*batch, -1)
        out = out.reshape(*batch, h * h).index_add(-1, flat, vals).reshape(*batch, h, h)
    if omega_free is not None:
        f = F.free
        out[..., f.unsqueeze(-1), f] = omega_free
    return out


class GLSubgroupGeometry(GLGeometry):
    """The GL(h) metric of :class:`~geosharp.geometry.gl.GLGeometry` on the quotient by ``exp 𝔨``.

    Only the vertical space differs from the GL(h) block: the factors of its solve
    (:func:`subgroup_factors`) and the solve itself (:func:`subgroup_lam`, the ``Ω* ∈ 𝔨`` of
    the metric projection) replace the base class's; :meth:`project`, :meth:`random_tangent`
    (horizontal) and the Riemannian-gradient projection of the ascent use them through it.

    Args:
        G: Left factor, ``(..., n, h)``.
        H: Right factor, ``(..., m, h)``.
        algebra: The Lie algebra ``𝔨`` of the symmetry subgroup.
        metric: ``"inv"`` or ``"mix"``.
        eps: Damping of the Gram matrices (the projection stays exactly metric-orthogonal).
        name: Block name for error messages.
        head_names: Readable name per head for error messages.
        execution: The execution policy (see :class:`~geosharp.geometry.gl.GLGeometry`).
        work_dtype: Sets ``execution.work_dtype`` (see :class:`~geosharp.geometry.gl.GLGeometry`).

    Raises:
        ValueError: As :class:`GLGeometry`, or if ``algebra.h`` differs from ``h``.
    """

    def __init__(
        self,
        G: Tensor,
        H: Tensor,
        algebra: BlockDiagonalAlgebra,
        metric: str = "inv",
        eps: float = DEFAULT_EPS,
        name: str = "GL subgroup block",
        head_names: Sequence[str] | None = None,
        *,
        execution: GLExecution | None = None,
        work_dtype: torch.dtype | None = None,
    ) -> None:
        self.algebra = algebra
        super().__init__(
            G, H, metric, eps, name, head_names, execution=execution, work_dtype=work_dtype
        )

    def _factorize(
        self, G: Tensor, H: Tensor, check: RankCheck, grams: tuple[Tensor, Tensor] | None = None
    ) -> SubgroupFactors:
        """The GL(h) factors and those of the 𝔨 solve (:func:`subgroup_factors`)."""
        if self.algebra.h != G.shape[-1]:
            raise ValueError(
                f"the algebra acts on h={self.algebra.h} but the block has h={G.shape[-1]}"
            )
        base = super()._factorize(G, H, check, grams=grams)
        ex = self.execution
        return subgroup_factors(G, H, base, self.algebra, self.metric, ex.row_sum, grams=grams)

    def _lam(self, F: GLFactors, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor) -> Tensor:
        """The vertical-space solve in ``𝔨``: :func:`subgroup_lam`."""
        return subgroup_lam(G, H, xG, xH, F, metric=self.metric, row_sum=self.execution.row_sum)

    def _lam_from(self, F: GLFactors, XH: Tensor, GX: Tensor) -> Tensor:
        """:meth:`_lam` from the summed contractions ``ξ_Hᵀ H``, ``Gᵀ ξ_G``."""
        return lam_in_algebra(moment_from(XH, GX, F, self.metric), F)

    def moment(self, xi: tuple[Tensor, Tensor]) -> Tensor:
        """``C(ξ)`` of :func:`moment` at the base point, in the work dtype."""
        xG, xH = self._check_tangent(xi)
        G, H = self._point()
        return moment(
            G, H, xG, xH, self.factors, metric=self.metric, row_sum=self.execution.row_sum
        )

    def horizontal_residual(self, xi: tuple[Tensor, Tensor]) -> Tensor:
        """``Π_𝔨 C(ξ)``: zero iff ``ξ`` is metric-orthogonal to every vertical vector."""
        return self.algebra.project(self.moment(xi)).to(xi[0].dtype)
