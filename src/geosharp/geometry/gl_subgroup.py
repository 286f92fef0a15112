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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from geosharp.geometry.gl import DEFAULT_EPS, GLGeometry

__all__ = ["BlockDiagonalAlgebra", "GLSubgroupGeometry"]

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


class GLSubgroupGeometry(GLGeometry):
    """The GL(h) metric of :class:`~geosharp.geometry.gl.GLGeometry` on the quotient by ``exp 𝔨``.

    Only the vertical space differs from the GL(h) block: :meth:`lam` returns the ``Ω* ∈ 𝔨`` of
    the metric projection, and :meth:`project`, :meth:`random_tangent` (horizontal) and the
    Riemannian-gradient projection of the ascent use it through the base class.

    Args:
        G: Left factor, ``(..., n, h)``.
        H: Right factor, ``(..., m, h)``.
        algebra: The Lie algebra ``𝔨`` of the symmetry subgroup.
        metric: ``"inv"`` or ``"mix"``.
        eps: Damping of the Gram matrices (the projection stays exactly metric-orthogonal).
        name: Block name for error messages.
        compute_dtype: Internal dtype (default float64).
        head_names: Readable name per head for error messages.
        work_dtype: Dtype of the per-step products and tangents (see
            :class:`~geosharp.geometry.gl.GLGeometry`).
        tangent_dtype: Dtype tangents are kept in (default: the dtype of ``G``; see
            :class:`~geosharp.geometry.gl.GLGeometry`).
        hold_wide_point: Keep the base point in ``compute_dtype`` (see
            :class:`~geosharp.geometry.gl.GLGeometry`).

    Raises:
        ValueError: As :class:`GLGeometry`, or if ``algebra.h`` differs from ``h``.
    """

    _PER_HEAD = (
        *GLGeometry._PER_HEAD,
        "_PQ",
        "_Lx",
        "_Rx",
        "_Ly",
        "_Ry",
        "_den",
        "_omega_l",
        "_chol",
    )

    def __init__(
        self,
        G: Tensor,
        H: Tensor,
        algebra: BlockDiagonalAlgebra,
        metric: str = "inv",
        eps: float = DEFAULT_EPS,
        name: str = "GL subgroup block",
        compute_dtype: torch.dtype | None = None,
        head_names: Sequence[str] | None = None,
        work_dtype: torch.dtype | None = None,
        tangent_dtype: torch.dtype | None = None,
        hold_wide_point: bool | None = None,
    ) -> None:
        super().__init__(
            G,
            H,
            metric,
            eps,
            name,
            compute_dtype,
            head_names,
            tangent_dtype=tangent_dtype,
            hold_wide_point=hold_wide_point,
        )
        if algebra.h != G.shape[-1]:
            raise ValueError(f"the algebra acts on h={algebra.h} but the block has h={G.shape[-1]}")
        self.algebra = algebra
        dev = self._G.device
        G64, H64 = self._G, self._H
        if self.metric == "inv":
            P1, Q1, P2, Q2 = self.MH_inv, H64.mT @ H64, G64.mT @ G64, self.MG_inv
        else:
            P1, Q1, P2, Q2 = self.MG, H64.mT @ H64, G64.mT @ G64, self.MH
        self._PQ = (P1, Q1, P2, Q2)
        rows, cols, vals = (t.to(dev) for t in algebra.basis_entries())
        self._rows, self._cols = rows, cols
        self._vals = vals.to(self.compute_dtype)
        self._free = torch.tensor(algebra.free, dtype=torch.long, device=dev)
        k = rows.shape[0]
        if len(self._free):
            self._setup_free()
        if k:
            K = self._pair_gram(rows, cols, self._vals)
            if len(self._free):
                # Ω_l = S(Π_P L(E_l)): the free-block response to each plane basis element.
                f = self._free
                resp = 0
                for P, Q in ((P1, Q1), (P2, Q2)):
                    Pg = P[..., f.unsqueeze(-1), rows.reshape(-1)].unflatten(-1, (k, 2))
                    Qg = Q[..., cols.reshape(-1, 1), f].unflatten(-2, (k, 2))  # (..., k, 2, p)
                    resp = resp + torch.einsum("...pls,ls,...lsq->...lpq", Pg, self._vals, Qg)
                self._omega_l = self._solve_free(resp)  # (..., k, p, p)
                K = K - self._free_to_pairs(self._omega_l).mT
            self._chol = torch.linalg.cholesky(0.5 * (K + K.mT))
        self._use_work_dtype(work_dtype)

    # -- the gl(P) solver ---------------------------------------------------------------------
    def _setup_free(self) -> None:
        """Factor ``a Ω b + c Ω d = F`` on the free block (``a, d`` SPD, ``b, c`` PSD)."""
        f = self._free
        P1, Q1, P2, Q2 = (X[..., f.unsqueeze(-1), f] for X in self._PQ)
        a, b, c, d = P1, Q1, P2, Q2

        def isqrt(M: Tensor) -> Tensor:
            lam, U = torch.linalg.eigh(M)
            return (U * lam.rsqrt().unsqueeze(-2)) @ U.mT

        ai, di = isqrt(a), isqrt(d)
        dx, Ux = torch.linalg.eigh(ai @ c @ ai)
        dy, Uy = torch.linalg.eigh(di @ b @ di)
        self._Lx, self._Rx = ai @ Ux, Ux.mT @ ai
        self._Ly, self._Ry = di @ Uy, Uy.mT @ di
        self._den = dx.unsqueeze(-1) + dy.unsqueeze(-2)

    def _solve_free(self, F: Tensor) -> Tensor:
        """``Ω`` with ``a Ω b + c Ω d = F`` (batched; ``F`` may have one extra dim before p×p)."""
        extra = F.dim() - self._den.dim()
        Lx, Rx, Ly, Ry, den = (
            t.reshape(*t.shape[:-2], *([1] * extra), *t.shape[-2:])
            for t in (self._Lx, self._Rx, self._Ly, self._Ry, self._den)
        )
        return Lx @ ((Rx @ F @ Ly) / den) @ Ry

    # -- plane terms --------------------------------------------------------------------------
    def _pair_gram(self, rows: Tensor, cols: Tensor, vals: Tensor) -> Tensor:
        """``K_jl = ⟨L(E_l), E_j⟩`` over the plane basis, ``(..., k, k)``."""
        k = rows.shape[0]
        K = 0
        for P, Q in (self._PQ[0:2], self._PQ[2:4]):
            # (P E_l Q)[x, y] = Σ_s v_ls P[x, r_ls] Q[c_ls, y] at (x, y) = (r_jt, c_jt).
            Pg = P[..., rows.reshape(k, 2, 1, 1), rows.reshape(1, 1, k, 2)]
            Qg = Q[..., cols.reshape(1, 1, k, 2), cols.reshape(k, 2, 1, 1)]
            K = K + torch.einsum("...jtls,jt,ls->...jl", Pg * Qg, vals, vals)
        return K

    def _coef(self, X: Tensor) -> Tensor:
        """``⟨X, E_l⟩_F`` for every plane basis element, ``(..., k)``."""
        return (X[..., self._rows, self._cols] * self._vals).sum(-1)

    def _free_to_pairs(self, omega: Tensor) -> Tensor:
        """``⟨L(emb_P Ω), E_j⟩`` for free-block ``Ω`` ``(..., [l,] p, p)``, as ``(..., [l,] k)``.

        ``(P emb(Ω) Q)[x, y] = P[x, P] Ω Q[P, y]``, read at the plane entries ``(r_jt, c_jt)``.
        """
        f, rows, cols = self._free, self._rows, self._cols
        out = 0
        extra = omega.dim() - self._PQ[0].dim()
        for P, Q in (self._PQ[0:2], self._PQ[2:4]):
            Pg = P[..., rows, :][..., f]  # (..., k, 2, p)
            Qg = Q[..., f, :][..., cols]  # (..., p, k, 2)
            if extra:
                Pg, Qg = Pg.unsqueeze(-4), Qg.unsqueeze(-4)
            out = out + torch.einsum("...jtp,...pq,...qjt,jt->...j", Pg, omega, Qg, self._vals)
        return out

    def _embed(self, c: Tensor | None, omega_free: Tensor | None) -> Tensor:
        """``Σ_l c_l E_l + emb_P(Ω_P)`` as dense ``(..., h, h)`` matrices."""
        h = self.algebra.h
        batch = self.G.shape[:-2]
        out = torch.zeros(*batch, h, h, dtype=self.compute_dtype, device=self.G.device)
        if c is not None:
            flat = (self._rows * h + self._cols).reshape(-1)
            vals = (c.unsqueeze(-1) * self._vals).reshape(*batch, -1)
            out = out.reshape(*batch, h * h).index_add(-1, flat, vals).reshape(*batch, h, h)
        if omega_free is not None:
            f = self._free
            out[..., f.unsqueeze(-1), f] = omega_free
        return out

    # -- the quotient structure ---------------------------------------------------------------
    def moment(self, xi: tuple[Tensor, Tensor]) -> Tensor:
        """``C(ξ)`` with ``⟨ξ, V(Ω)⟩ = ⟨C(ξ), Ω⟩_F`` for all ``Ω ∈ gl(h)``, ``(..., h, h)``."""
        xG, xH = self._check_tangent(xi)
        if self.metric == "inv":
            return self.MH_inv @ (xH.mT @ self._H) - (self._G.mT @ xG) @ self.MG_inv
        return self.MG @ (xH.mT @ self._H) - (self._G.mT @ xG) @ self.MH

    def lam(self, xi: tuple[Tensor, Tensor]) -> Tensor:
        """``Ω* ∈ 𝔨`` of the horizontal projection ``ξ − V(Ω*) = (ξ_G + GΩ*, ξ_H − HΩ*ᵀ)``."""
        C = self.moment(xi)
        has_free, has_pairs = len(self._free) > 0, self._rows.shape[0] > 0
        f = self._free
        omega_free = self._solve_free(C[..., f.unsqueeze(-1), f]) if has_free else None
        c = None
        if has_pairs:
            r = self._coef(C)
            if has_free:
                r = r - self._free_to_pairs(omega_free)
            c = torch.cholesky_solve(r.unsqueeze(-1), self._chol).squeeze(-1)
            if has_free:
                omega_free = omega_free - torch.einsum("...l,...lpq->...pq", c, self._omega_l)
        return self._embed(c, omega_free)

    def horizontal_residual(self, xi: tuple[Tensor, Tensor]) -> Tensor:
        """``Π_𝔨 C(ξ)``: zero iff ``ξ`` is metric-orthogonal to every vertical vector."""
        return self.algebra.project(self.moment(xi)).to(xi[0].dtype)
