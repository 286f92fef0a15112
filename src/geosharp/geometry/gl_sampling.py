r"""Random draws of a GL(h) block that follow the group sample by sample (SPEC §6.4).

An isotropic Gaussian in the metric is ``η_G = s Z_G F_G``, ``η_H = s Z_H F_H`` with ``Z``
standard normal and factors whose Gram matrices are the metric's inverse: inv
``(R(G), R(H))``, mix ``(R(H)^{−T}, R(G)^{−T})`` with ``R(X)ᵀ R(X) = M_X = XᵀX + εI``. The
symmetric square root ``M^{1/2}`` would do for the distribution, but not for the sample: at an
equivalent point ``(G A⁻¹, H Aᵀ)`` it is ``Q M^{1/2} A⁻¹`` with an orthogonal ``Q ≠ I``, so the
same seed would draw a rotated tangent. The **covariant factor**

.. code-block:: text

    K = Ωᵀ X,    R(X) = (K M⁻¹ Kᵀ)^{−1/2} K      (Ω standard normal shaped like X)

has ``RᵀR = M`` and ``R(XB) = R(X) B`` (``K M⁻¹ Kᵀ`` is invariant), so the same normals
``Z_G``, ``Z_H``, ``Ω_G``, ``Ω_H`` draw ``(η_G A⁻¹, η_H Aᵀ)`` there, exactly at ``ε = 0``, and
``R = U M^{1/2}`` with ``U`` orthogonal and independent of ``Z``: the distribution is the old
one. :func:`covariant_factor` and :func:`sampling_factors` are the formulas;
:class:`GLSampling` is the sampling half of :class:`~geosharp.geometry.gl.GLGeometry` (its
``random_tangent``, ``normal_draws`` and ``tangent_from_normals``), which sums ``Ωᵀ X`` over
the ranks that hold the rows as it sums its Gram matrices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.geometry.base import Tangent
from geosharp.geometry.gl_endpoint import _eye_like
from geosharp.geometry.gl_factors import _apply_spectral, _damped, _spd_funcs
from geosharp.geometry.gl_rows import contract, sum_chunks

__all__ = ["GLSampling", "covariant_factor", "gram_spectra", "sampling_factors"]


def gram_spectra(
    grams: tuple[Tensor, Tensor], eps: float
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The eigendecompositions ``(λ, U)`` of ``M_G`` and ``M_H`` from ``grams`` ``(GᵀG, HᵀH)``.

    The Gram matrices summed over every row; the same operations as
    :func:`~geosharp.geometry.gl_factors.factorize` on the same Gram matrices, so the same
    spectra. What :func:`sampling_factors` needs of the point.
    """
    return _spd_funcs(_damped(grams[0], eps)), _spd_funcs(_damped(grams[1], eps))


def covariant_factor(
    K: Tensor, spectrum: tuple[Tensor, Tensor], eps: float, inverse: bool = False
) -> Tensor:
    """The covariant factor ``R = (K M⁻¹ Kᵀ)^{−1/2} K`` of a sampled matrix ``X`` (SPEC §6.4).

    ``M = XᵀX + εI = U diag(λ) Uᵀ`` (``spectrum = (λ, U)``) and ``K = ΩᵀX`` with ``Ω`` standard
    normal shaped like ``X`` (summed over every row), all ``(..., h, h)``. ``RᵀR = M`` for any
    invertible ``K``, and ``X ↦ XB`` maps ``K ↦ KB``, ``K M⁻¹ Kᵀ ↦ K M⁻¹ Kᵀ``, so ``R ↦ RB``
    (exactly at ``ε = 0``). At ``ε > 0``, ``K + √ε I`` is used (``Ω`` continued by ``I`` over the
    rows ``√ε I`` whose Gram matrix is the damping): invertible even where ``X`` is not of full
    rank. ``inverse``: ``R^{−T} = R M⁻¹`` instead (``R^{−T} ↦ R^{−T} B^{−T}``, Gram ``M⁻¹``).
    """
    lam, U = spectrum
    if eps:
        K = K + math.sqrt(eps) * _eye_like(K)
    W = (K @ U) * lam.rsqrt().unsqueeze(-2)  # K M^{-1/2} U, so that K M⁻¹ Kᵀ = W Wᵀ
    nu, V = torch.linalg.eigh(W @ W.mT)
    n_isqrt = _apply_spectral(nu, V, nu.rsqrt())  # (K M⁻¹ Kᵀ)^{−1/2}
    if not inverse:
        return n_isqrt @ K
    return n_isqrt @ ((W * lam.rsqrt().unsqueeze(-2)) @ U.mT)  # … K M⁻¹


def sampling_factors(
    K: tuple[Tensor, Tensor],
    spectra: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
    metric: str,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The factors an isotropic Gaussian in the metric is drawn with: ``(F_G, F_H)`` (SPEC §6.4).

    ``η_G = s Z_G F_G``, ``η_H = s Z_H F_H``. inv: ``(R(G), R(H))``, whose Gram matrices are
    ``M_G``, ``M_H``; mix: ``(R(H)^{−T}, R(G)^{−T})``, Gram ``M_H⁻¹``, ``M_G⁻¹``
    (:func:`covariant_factor`). ``K = (Ω_Gᵀ G, Ω_Hᵀ H)``, ``spectra`` :func:`gram_spectra`'s.
    Both transform as the tangent's factor does, ``F_G ↦ F_G A⁻¹``, ``F_H ↦ F_H Aᵀ``, under
    ``(G, H) ↦ (G A⁻¹, H Aᵀ)``: the same normals give the transformed draw.
    """
    (KG, KH), (sG, sH) = K, spectra
    if metric == "inv":
        return covariant_factor(KG, sG, eps), covariant_factor(KH, sH, eps)
    return covariant_factor(KH, sH, eps, inverse=True), covariant_factor(KG, sG, eps, inverse=True)


class GLSampling:
    """The random draws of :class:`~geosharp.geometry.gl.GLGeometry` (a mixin of it).

    Reads the geometry's ``G``, ``H``, ``dtype``, ``metric``, ``eps``, ``execution``, its chunks
    of heads (``_slices``, ``_flat``, ``point_rows``), ``_read_grams`` and ``project``.
    """

    def random_tangent(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        horizontal: bool = True,
        dtype: torch.dtype | None = None,
    ) -> Tangent:
        """Isotropic Gaussian in the metric (SPEC §6.4), optionally projected horizontally.

        Returned in ``dtype`` (default: the dtype of ``G``). Draws :meth:`normal_draws` from
        ``generator`` — ``Z_G``, ``Z_H``, ``Ω_G``, ``Ω_H`` — and makes the tangent from them
        (:meth:`tangent_from_normals`): ``η_G = s Z_G F_G``, ``η_H = s Z_H F_H`` with factors
        that move with the group (:func:`~geosharp.geometry.gl_factors.sampling_factors`), so
        the same generator at an equivalent point ``(G A⁻¹, H Aᵀ)`` draws
        ``(η_G A⁻¹, η_H Aᵀ)``.
        """
        dev = self.G.device
        z = [
            torch.randn(s, generator=generator, dtype=d, device=dev)
            for (s,), d in self.normal_draws()
        ]
        return self.tangent_from_normals(z, scale, horizontal, dtype)

    def normal_draws(self) -> list[tuple[tuple[torch.Size, ...], torch.dtype]]:
        """``Z_G``, ``Z_H``, ``Ω_G``, ``Ω_H``: one draw each, shaped as ``G``, ``H``, ``G``, ``H``.

        In the work dtype. ``Z`` are the Gaussian's normals, ``Ω`` mix the rows of the point
        into the covariant factors (:meth:`tangent_from_normals`).
        """
        wd = self.execution.work_dtype
        return [((self.G.shape,), wd), ((self.H.shape,), wd)] * 2

    def tangent_from_normals(
        self,
        z: Sequence[Tensor],
        scale: float = 1.0,
        horizontal: bool = True,
        dtype: torch.dtype | None = None,
    ) -> Tangent:
        """:meth:`random_tangent` from the normals ``z = (Z_G, Z_H, Ω_G, Ω_H)`` it would draw.

        ``K_G = Ω_Gᵀ G``, ``K_H = Ω_Hᵀ H`` (summed over every row: over the ranks that hold
        them, in one ``row_sum``) in the factor dtype, then ``(s Z_G F_G, s Z_H F_H)`` with the
        factors of :func:`~geosharp.geometry.gl_factors.sampling_factors` (inv: ``R(G)``,
        ``R(H)``; mix: ``R(H)^{−T}``, ``R(G)^{−T}``; ``R = (K M⁻¹ Kᵀ)^{−1/2} K``), projected
        horizontally if asked, in ``dtype`` (default: the dtype of ``G``).
        """
        if len(z) != 4:
            raise ValueError(f"expected the 4 normals (Z_G, Z_H, Ω_G, Ω_H), got {len(z)}")
        zG, zH, oG, oH = z
        fG, fH = self._sampling_factors(oG, oH)
        xi = (scale * zG @ fG, scale * zH @ fH)
        if horizontal:
            xi = self.project(xi)
        return tuple(t.to(dtype or self.dtype) for t in xi)

    def _sampling_factors(self, oG: Tensor, oH: Tensor) -> tuple[Tensor, Tensor]:
        """``(F_G, F_H)`` of the normals ``Ω_G``, ``Ω_H``, in the work dtype.

        ``Ωᵀ X`` is read a chunk of heads at a time in the factor dtype and summed over the
        ranks in one collective, like the Gram matrices.
        """
        ex = self.execution
        fd = ex.factor_dtype
        flat_G, flat_H = self._flat(oG), self._flat(oH)
        parts = []
        for sl in self._slices:
            G, H = self.point_rows(sl, fd)
            parts.append(torch.stack(contract((flat_G[sl].to(fd), G), (flat_H[sl].to(fd), H))))
        KG, KH = sum_chunks(parts, ex.row_sum)
        lead = self.G.shape[:-2]
        K = (KG.reshape(*lead, *KG.shape[-2:]), KH.reshape(*lead, *KH.shape[-2:]))
        pair = sampling_factors(K, self._gram_spectra(), self.metric, self.eps)
        return pair[0].to(ex.work_dtype), pair[1].to(ex.work_dtype)

    def _gram_spectra(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """The spectra of ``M_G``, ``M_H`` :meth:`random_tangent` uses, made on first use, kept.

        Computed from ``G``, ``H`` as the constructor computes its factorizations (same dtype,
        same operations: the same numbers), so that a worst-case ascent, which never samples,
        holds none of them.
        """
        held = self.__dict__.get("_sampling_spectra")
        if held is None:
            held = gram_spectra(self._read_grams(self.execution.factor_dtype), self.eps)
            self.__dict__["_sampling_spectra"] = held
        return held
