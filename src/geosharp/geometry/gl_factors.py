r"""Base-point factorizations of a GL(h) block (SPEC §4): what a geometry computes once.

At the base point ``(G, H)`` the two GL(h)-invariant metrics need the damped Gram matrices
``M_G = GᵀG + εI``, ``M_H = HᵀH + εI`` and their inverses; the inv metric's horizontal
projection solves the Sylvester equation ``AΛ + ΛA = B`` with ``A = M_H M_G``, through the
eigendecomposition of ``C = M_H^{1/2} M_G M_H^{1/2} = Q D Qᵀ``: with ``S = M_H^{1/2} Q``,
``A = S D S⁻¹`` and ``Λ = S Y S⁻¹``, ``Y_ij = (S⁻¹ B S)_ij / (d_i + d_j)``. All of it is
batched over the leading (head) dimensions, in the dtype of its inputs (a geometry's
``execution.factor_dtype``), and kept in a :class:`GLFactors` that the execution policy casts
and slices by heads. (The factors of random draws: :mod:`~geosharp.geometry.gl_sampling`.)

At ``ε = 0`` a (numerically) singular Gram matrix makes the metric undefined;
:func:`check_rank` names the heads and suggests the damping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from geosharp.geometry._validate import singular_threshold
from geosharp.geometry.gl_endpoint import _eye_like
from geosharp.geometry.gl_rows import RowSum, contract

__all__ = ["GLFactors", "check_rank", "factorize"]

#: ``check(which, eigenvalues)``: raises if the Gram matrix ``whichᵀ which`` is unusable.
RankCheck = Callable[[str, Tensor], None]


def _gram(X: Tensor, eps: float, row_sum: RowSum | None = None) -> Tensor:
    """Damped Gram matrix ``XᵀX + εI`` (batched; ``XᵀX`` summed over ranks by ``row_sum``)."""
    (M,) = contract((X, X), row_sum=row_sum)
    return _damped(M, eps)


def _damped(M: Tensor, eps: float) -> Tensor:
    """``M + εI`` (``M`` itself at ``ε = 0``)."""
    return M + eps * _eye_like(M) if eps else M


def _spd_funcs(M: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition ``M = U diag(λ) Uᵀ`` of a batch of symmetric matrices."""
    lam, U = torch.linalg.eigh(M)
    return lam, U


def _apply_spectral(lam: Tensor, U: Tensor, f: Tensor) -> Tensor:
    """``U diag(f) Uᵀ`` where ``f`` is a function of the eigenvalues ``lam``."""
    return (U * f.unsqueeze(-2)) @ U.mT


@dataclass(frozen=True)
class GLFactors:
    """The per-head factors of a base point ``(G, H)`` (SPEC §4.1, §4.4), batched like it.

    Attributes:
        MG: ``M_G = GᵀG + εI``, ``(..., h, h)``.
        MH: ``M_H = HᵀH + εI``.
        MG_inv: ``M_G⁻¹``.
        MH_inv: ``M_H⁻¹``.
        S: inv metric only: ``S = M_H^{1/2} Q`` of the Sylvester solve (SPEC §4.4).
        S_inv: ``S⁻¹ = Qᵀ M_H^{−1/2}``.
        eig: The eigenvalues ``D`` of ``C = M_H^{1/2} M_G M_H^{1/2} = Q D Qᵀ``, ``(..., h)``.
        eig_sums: The Sylvester solve's denominators ``d_i + d_j``, ``(..., h, h)``, formed
            once in the dtype the factors are used in (:meth:`with_eig_sums`), or ``None``.
    """

    MG: Tensor
    MH: Tensor
    MG_inv: Tensor
    MH_inv: Tensor
    S: Tensor | None = None
    S_inv: Tensor | None = None
    eig: Tensor | None = None
    eig_sums: Tensor | None = None

    #: Fields that are not per head (shared by every head): cast, never sliced.
    SHARED: ClassVar[frozenset[str]] = frozenset()

    def cast(self, dtype: torch.dtype) -> GLFactors:
        """The same factors with every floating tensor in ``dtype`` (rounded once)."""
        return self._map(lambda t: t.to(dtype) if t.is_floating_point() else t, shared=True)

    def with_eig_sums(self) -> GLFactors:
        """The same factors with :attr:`eig_sums` formed from :attr:`eig` (in its dtype).

        The values every solve would form from ``eig`` again (``d_i + d_j``), made once.
        """
        if self.eig is None:
            return self
        return dataclasses.replace(self, eig_sums=self.eig.unsqueeze(-1) + self.eig.unsqueeze(-2))

    def per_head(self, fn: Callable[[Tensor], Tensor]) -> GLFactors:
        """The factors with ``fn`` (e.g. a slice of the flattened heads) on every per-head one."""
        return self._map(fn, shared=False)

    def _map(self, fn: Callable[[Tensor], Tensor], shared: bool) -> GLFactors:
        changes = {}
        for f in dataclasses.fields(self):
            if f.name in self.SHARED and not shared:
                continue
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = fn(v)
            elif isinstance(v, tuple) and v and all(isinstance(t, Tensor) for t in v):
                changes[f.name] = tuple(fn(t) for t in v)
        return dataclasses.replace(self, **changes)


#: Elements of ``G`` (or ``H``) widened at a time by :func:`gram_matrices` (32 MB in float64).
GRAM_CHUNK = 1 << 22


def gram_matrices(
    G: Tensor, H: Tensor, dtype: torch.dtype, row_sum: RowSum | None = None
) -> tuple[Tensor, Tensor]:
    """``(GᵀG, HᵀH)`` per head in ``dtype``, widened a chunk of heads at a time.

    The same products as ``contract((G, G), (H, H))`` on ``G`` and ``H`` cast to ``dtype``
    (each head's product is its own), with no widened copy of the factors: on a 1.1 B Llama
    that copy was 1.7 GB of float64. Every chunk is widened into one buffer, made once for
    both factors (a fresh 32 MB buffer per chunk was fresh pages each time: 0.4 M page faults
    on that Llama). Summed over the ranks in one ``row_sum`` if given.
    """
    flats = [X.reshape(-1, *X.shape[-2:]) for X in (G, H)]
    pers = [max(1, GRAM_CHUNK // max(1, f.shape[-2] * f.shape[-1])) for f in flats]
    size = 0
    for p, f in zip(pers, flats, strict=True):
        if f.dtype != dtype:
            size = max(size, min(p, f.shape[0]) * f.shape[-2] * f.shape[-1])
    buf = torch.empty(size, dtype=dtype, device=G.device)
    out = []
    for X, flat, per in zip((G, H), flats, pers, strict=True):
        M = torch.empty((flat.shape[0], X.shape[-1], X.shape[-1]), dtype=dtype, device=X.device)
        for i in range(0, flat.shape[0], per):
            chunk = flat[i : i + per]
            if chunk.dtype != dtype and chunk.is_contiguous():  # chunk.to(dtype), in place
                chunk = buf[: chunk.numel()].view(chunk.shape).copy_(chunk)
            elif chunk.dtype != dtype:
                chunk = chunk.to(dtype)
            torch.matmul(chunk.mT, chunk, out=M[i : i + per])
        out.append(M.view(*X.shape[:-2], *M.shape[-2:]))
    if row_sum is None:
        return out[0], out[1]
    MG, MH = row_sum(torch.stack(out)).unbind(0)
    return MG, MH


def factorize(
    G: Tensor,
    H: Tensor,
    metric: str,
    eps: float,
    check: RankCheck,
    row_sum: RowSum | None = None,
    grams: tuple[Tensor, Tensor] | None = None,
) -> GLFactors:
    """The per-head factors of the base point ``(G, H)``, in the dtype of ``G`` and ``H``.

    ``M_G``, ``M_H`` and their inverses; for ``metric="inv"`` also the Sylvester factors
    ``S = M_H^{1/2} Q``, ``S⁻¹ = Qᵀ M_H^{−1/2}`` and the eigenvalues ``D`` of
    ``M_H^{1/2} M_G M_H^{1/2} = Q D Qᵀ`` (the denominators ``d_i + d_j`` are formed where they
    are used). ``check`` sees both spectra before anything is inverted. With ``row_sum`` (rows
    split over ranks) ``GᵀG`` and ``HᵀH`` are summed over the ranks in one collective; every
    factorization after it is of replicated ``h × h`` matrices, the same on every rank.
    ``grams``: ``(GᵀG, HᵀH)`` made already (:func:`gram_matrices`, summed over the ranks); the
    factors are then in their dtype.
    """
    MG, MH = grams if grams is not None else contract((G, G), (H, H), row_sum=row_sum)
    MG, MH = _damped(MG, eps), _damped(MH, eps)
    lg, Ug = _spd_funcs(MG)
    lh, Uh = _spd_funcs(MH)
    check("G", lg)
    check("H", lh)
    MG_inv = _apply_spectral(lg, Ug, 1.0 / lg)
    MH_inv = _apply_spectral(lh, Uh, 1.0 / lh)
    if metric != "inv":
        return GLFactors(MG, MH, MG_inv, MH_inv)
    MH_sqrt = _apply_spectral(lh, Uh, lh.sqrt())
    # Sylvester solve of SPEC §4.4 (corrected): A Λ + Λ A = B with A = M_H M_G, similar to
    # C = M_H^{1/2} M_G M_H^{1/2} = Q D Qᵀ via S = M_H^{1/2} Q.
    d, Q = torch.linalg.eigh(MH_sqrt @ MG @ MH_sqrt)
    S_inv = Q.mT @ _apply_spectral(lh, Uh, lh.rsqrt())
    return GLFactors(MG, MH, MG_inv, MH_inv, S=MH_sqrt @ Q, S_inv=S_inv, eig=d)


def check_rank(
    lam: Tensor,
    h: int,
    dtype: torch.dtype,
    eps: float,
    which: str,
    name: str,
    head_names: Sequence[str] | None = None,
) -> None:
    """Raise if the Gram matrix ``whichᵀ which`` with eigenvalues ``lam`` cannot be used.

    At ``eps = 0`` a smallest eigenvalue below :func:`singular_threshold` of the model's
    ``dtype`` (relative to the largest) is singular: the error names the heads (``head_names``
    of the flattened batch, else batch indices) and suggests ``eps > 0``. At any ``eps`` the
    damped matrix must be positive definite.

    Raises:
        ValueError: As above.
    """
    lam_max = lam[..., -1:].clamp_min(torch.finfo(lam.dtype).tiny)
    bad = lam[..., :1] <= singular_threshold(dtype, max(h, 2)) * lam_max
    if eps == 0.0 and bool(bad.any()):
        lam_min = lam[..., 0].abs().clamp_min(torch.finfo(lam.dtype).tiny)
        cond = float((lam[..., -1] / lam_min).max())
        if head_names is not None:
            flat_bad = bad.reshape(-1).nonzero().flatten().tolist()
            names = [head_names[i] for i in flat_bad]
            shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
            raise ValueError(
                f"eps=0 but the Gram matrix {which}ᵀ{which} of {len(names)} block(s) {shown} is "
                f"singular (cond {cond:.1e}); pass eps>0 (e.g. eps=1e-6 times the typical "
                f"squared weight norm) to damp it"
            )
        where = ""
        if lam.dim() > 1:
            idx = [tuple(i.tolist()) for i in bad.squeeze(-1).nonzero()][:5]
            where = f" at batch index {idx}"
        raise ValueError(
            f"eps=0 but the Gram matrix {which}ᵀ{which} of block '{name}'{where} is "
            f"singular (cond {cond:.1e}); pass eps>0 (e.g. eps=1e-6 times the typical squared "
            f"weight norm) to damp it"
        )
    if bool((lam[..., 0] <= 0).any()):
        raise ValueError(
            f"the damped Gram matrix {which}ᵀ{which} + eps·I of block '{name}' is not "
            f"positive definite (eps={eps}); increase eps"
        )
