r"""The Hessian of a perturbation's loss at ``ξ = 0`` as an operator, and its spectrum (SPEC §9).

With ``f(ξ) = L_S(e(ξ))`` and ``e`` the second-order endpoint of a
:class:`~geosharp.estimators.perturbation.Perturbation`, the Riemannian Hessian form of the loss
on a horizontal ``ξ`` is ``Q(ξ) = d²/dt² f(tξ)|₀ = ξᵀ ∇²f(0) ξ``, and the operator self-adjoint in
the metric ``g`` on the horizontal space is

.. code-block:: text

    𝓗 ξ = P g⁻¹ ∇²f(0) ξ          (P: horizontal projection, g⁻¹: the Riemannian gradient map),

with ``⟨η, 𝓗ξ⟩_g = ηᵀ ∇²f(0) ξ`` for horizontal ``η``. :class:`HessianOperator` gives its
products by double backward (never a dense Hessian); :func:`lanczos` estimates its extreme
eigenvalues in the metric inner product, :func:`hutchinson`, :func:`hutchpp` and
:func:`exact_trace` its trace. Vectors are flat (:class:`Flat`; one flat tensor per run of
devices on a model split across devices, :class:`SplitVector`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from geosharp.estimators.harness import Objective
from geosharp.estimators.perturbation import Perturbation, Xi


def math_sdpa() -> contextlib.AbstractContextManager:
    """The MATH kernel of scaled-dot-product attention: the fused ones lack double backward."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - torch < 2.3
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


class SplitVector:
    """A flat vector of a model split across devices: one flat tensor per run of devices.

    The leaves of a perturbation, in piece order, fall into runs of one device each; each run
    is a flat tensor on its device. Lanczos and the trace estimators use only these operations:
    products with a number and sums run by run, and a dot product that brings one scalar per
    run to the host. A model on one device never gets one (:class:`Flat` gives plain tensors).
    """

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = parts

    @property
    def dtype(self) -> torch.dtype:  # noqa: D102
        return self.parts[0].dtype

    def numel(self) -> int:  # noqa: D102
        return sum(p.numel() for p in self.parts)

    def __matmul__(self, other: SplitVector) -> Tensor:
        """The dot product, as a 0-dim float64 tensor on the host (one scalar per run moved)."""
        total = sum(float(a @ b) for a, b in zip(self.parts, other.parts, strict=True))
        return torch.tensor(total, dtype=torch.float64)

    def __mul__(self, c: float | Tensor) -> SplitVector:
        c = float(c)
        return SplitVector([p * c for p in self.parts])

    __rmul__ = __mul__

    def __truediv__(self, c: float | Tensor) -> SplitVector:
        c = float(c)
        return SplitVector([p / c for p in self.parts])

    def sub_(self, other: SplitVector) -> SplitVector:  # noqa: D102
        for a, b in zip(self.parts, other.parts, strict=True):
            a.sub_(b)
        return self

    def clone(self) -> SplitVector:  # noqa: D102
        return SplitVector([p.clone() for p in self.parts])

    def any(self) -> bool:  # noqa: D102
        return any(bool(p.any()) for p in self.parts)


class Flat:
    """Flat vectors ↔ perturbations (lists of tangent tuples) with the shapes of ``template``.

    On one device a flat vector is one tensor. On a model split across devices it is a
    :class:`SplitVector`: the leaves are cut into runs of one device, each run concatenated on
    its device, so that no vector is ever brought whole to one device.
    """

    def __init__(self, template: Xi, dtype: torch.dtype) -> None:
        self.structure = [len(x) for x in template]
        leaves = [t for x in template for t in x]
        self.shapes = [t.shape for t in leaves]
        self.dtypes = [t.dtype for t in leaves]
        self.sizes = [t.numel() for t in leaves]
        self.dtype = dtype
        self.device = leaves[0].device if leaves else torch.device("cpu")
        self.numel = sum(self.sizes)
        #: ``(device, number of leaves)`` of each run of one device, in leaf order.
        self.runs: list[tuple[torch.device, int]] = []
        for t in leaves:
            if self.runs and self.runs[-1][0] == t.device:
                self.runs[-1] = (t.device, self.runs[-1][1] + 1)
            else:
                self.runs.append((t.device, 1))

    @property
    def split(self) -> bool:
        """Whether a flat vector is a :class:`SplitVector` (the leaves on several devices)."""
        return len(self.runs) > 1

    def _bounds(self) -> list[tuple[torch.device, int, int]]:
        """``(device, first leaf, end leaf)`` of every run."""
        out, lo = [], 0
        for device, n in self.runs:
            out.append((device, lo, lo + n))
            lo += n
        return out

    def join(self, leaves: Sequence[Tensor]) -> Tensor | SplitVector:
        """One flat vector of ``dtype`` from per-leaf tensors (in leaf order)."""
        parts = [t.reshape(-1).to(self.dtype) for t in leaves]
        if not self.split:
            if not parts:
                return torch.zeros(0, dtype=self.dtype, device=self.device)
            return torch.cat(parts)
        return SplitVector([torch.cat(parts[lo:hi]) for _, lo, hi in self._bounds()])

    def flatten(self, xi: Xi) -> Tensor | SplitVector:
        """One flat vector of ``dtype`` (the tangents concatenated in piece order)."""
        return self.join([t for x in xi for t in x])

    def leaves(self, v: Tensor | SplitVector) -> list[Tensor]:
        """The per-leaf views of a flat vector (its dtype, flat)."""
        if not isinstance(v, SplitVector):
            return list(torch.split(v, self.sizes))
        bounds = zip(v.parts, self._bounds(), strict=True)
        return [c for part, (_, lo, hi) in bounds for c in torch.split(part, self.sizes[lo:hi])]

    def unflatten(self, v: Tensor | SplitVector) -> Xi:
        """The perturbation of a flat vector, each tangent in its own shape and dtype."""
        chunks = iter(
            c.view(s).to(d)
            for c, s, d in zip(self.leaves(v), self.shapes, self.dtypes, strict=True)
        )
        return [tuple(next(chunks) for _ in range(k)) for k in self.structure]

    def zeros(self) -> Tensor | SplitVector:
        """The zero vector."""
        if not self.split:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return SplitVector(
            [
                torch.zeros(sum(self.sizes[lo:hi]), dtype=self.dtype, device=device)
                for device, lo, hi in self._bounds()
            ]
        )

    def unit(self, i: int) -> Tensor | SplitVector:
        """The ``i``-th coordinate vector."""
        e = self.zeros()
        self._entry(e, i)[...] = 1.0
        return e

    def entry(self, v: Tensor | SplitVector, i: int) -> float:
        """Coordinate ``i`` of ``v``."""
        return float(self._entry(v, i))

    def _entry(self, v: Tensor | SplitVector, i: int) -> Tensor:
        if not isinstance(v, SplitVector):
            return v[i]
        for part in v.parts:
            if i < part.numel():
                return part[i]
            i -= part.numel()
        raise IndexError("coordinate out of range")


class HessianOperator:
    """``∇²f(0)`` of ``f(ξ) = L_S(e(ξ))`` by double backward, and ``𝓗 = P g⁻¹ ∇²f(0)``.

    Builds the first-order graph once (one forward, one backward with ``create_graph=True``);
    every product is then one backward through it.
    """

    def __init__(self, objective: Objective, pert: Perturbation, flat: Flat, counter) -> None:
        self.pert, self.flat, self.counter = pert, flat, counter
        leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in pert.zeros()]
        self.leaves = [t for x in leaves for t in x]
        with torch.enable_grad(), math_sdpa():
            loss = objective.evaluate(pert.endpoint_params(leaves))
            grads = torch.autograd.grad(loss, self.leaves, create_graph=True, allow_unused=True)
        counter["backward"] += 1
        self.loss = float(loss.detach())
        #: ``∇f(0) = ∇ℓ(w)`` (flat Euclidean covector).
        self.egrad = self._cat(tuple(g.detach() if g is not None else None for g in grads))
        # Only the gradients that depend on ξ take part in the double backward.
        self._live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self._grads = [grads[i] for i in self._live]

    def hvp(self, v: Tensor) -> Tensor:
        """``∇²f(0) v`` (a Euclidean covector, flat)."""
        self.counter["hvp"] += 1
        if not self._live:
            return self.flat.zeros()
        parts = [t.reshape(-1) for x in self.flat.unflatten(v) for t in x]
        with torch.enable_grad(), math_sdpa():
            out = torch.autograd.grad(
                self._grads,
                self.leaves,
                grad_outputs=[parts[i].view_as(self._grads[k]) for k, i in enumerate(self._live)],
                retain_graph=True,
                allow_unused=True,
            )
        return self._cat(out)

    def _cat(self, parts: Sequence[Tensor | None]) -> Tensor | SplitVector:
        """Concatenate per-leaf tensors (``None``: zero) into a flat vector."""
        pairs = zip(parts, self.leaves, strict=True)
        return self.flat.join([p if p is not None else torch.zeros_like(t) for p, t in pairs])

    def raise_index(self, covector: Tensor) -> Tensor:
        """``P g⁻¹ e``: the horizontal vector of a covector (the Riemannian gradient map)."""
        return self.flat.flatten(self.pert.riemannian_grad(self.flat.unflatten(covector)))

    def project(self, v: Tensor) -> Tensor:
        """Horizontal projection ``P v``."""
        return self.flat.flatten(self.pert.project(self.flat.unflatten(v)))

    def lower(self, v: Tensor) -> Tensor:
        """Lower an index: ``g v``, so that ``⟨u, v⟩_g = u · (g v)`` (autodiff of the metric)."""
        if v.numel() == 0:
            return v
        a = [tuple(torch.zeros_like(t, requires_grad=True) for t in x) for x in self.pert.zeros()]
        b = self.flat.unflatten(v)
        with torch.enable_grad():
            s = sum(
                p.norm_geometry.inner(ai, bi).sum()
                for p, ai, bi in zip(self.pert.pieces, a, b, strict=True)
            )
            flat_a = [t for x in a for t in x]
            if not (isinstance(s, Tensor) and s.requires_grad):  # every piece held fixed
                return self.flat.zeros()
            g = torch.autograd.grad(s, flat_a, allow_unused=True)
        return self.flat.join(
            [gi if gi is not None else torch.zeros_like(t) for gi, t in zip(g, flat_a, strict=True)]
        )

    def norm(self, v: Tensor) -> float:
        """``‖v‖_g = √(vᵀ g v)``."""
        return math.sqrt(max(float(v @ self.lower(v)), 0.0))

    def random(self, gen: torch.Generator, scale: float = 1.0) -> Tensor:
        """A metric-isotropic horizontal Gaussian (``Perturbation.random``), flat."""
        return self.flat.flatten(self.pert.random(gen, scale))


def orthogonalize(op: HessianOperator, w: Tensor, basis: Sequence[Tensor]) -> Tensor:
    """``w`` minus its metric projection on a ``g``-orthonormal basis (Gram–Schmidt, twice).

    The basis is kept as a list (no stacked copy of it), so that Lanczos holds one vector per
    iteration and nothing more.
    """
    if not basis:
        return w
    w = w.clone()
    for _ in range(2):  # "twice is enough" (Kahan–Parlett)
        gw = op.lower(w)
        coefficients = [q @ gw for q in basis]
        for c, q in zip(coefficients, basis, strict=True):
            w.sub_(q * c)
    return w


def lanczos(
    op: HessianOperator,
    start: Tensor,
    iters: int,
    tol: float,
    top_k: int,
    want_min: bool,
) -> tuple[Tensor, int]:
    """Lanczos for ``𝓗`` in the metric inner product, with full reorthogonalization.

    Returns:
        The Ritz values (increasing) of the last tridiagonal matrix and the iterations done.
    """
    n0 = op.norm(start)
    if n0 == 0.0:
        return torch.zeros(0, dtype=torch.float64, device="cpu"), 0
    basis: list[Tensor] = [start / n0]
    alphas: list[float] = []
    betas: list[float] = []
    ritz = torch.zeros(0, dtype=torch.float64, device="cpu")  # the small problem: on the host
    tiny = torch.finfo(start.dtype)
    for j in range(iters):
        hv = op.hvp(basis[j])
        alphas.append(float(basis[j] @ hv))  # ⟨q, 𝓗q⟩_g = qᵀ ∇²f q on horizontal q
        # Full reorthogonalization subsumes the three-term recurrence w − αq_j − βq_{j−1}.
        w = orthogonalize(op, op.raise_index(hv), basis)
        beta = op.norm(w)
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64, device="cpu"))
        if j:
            off = torch.tensor(betas, dtype=torch.float64, device="cpu")
            T = T + torch.diag(off, 1) + torch.diag(off, -1)
        ritz, S = torch.linalg.eigh(T)
        scale = max(float(ritz.abs().max()), tiny.tiny)
        # Residual ‖𝓗y − θy‖_g of a Ritz pair (θ, y): β |last component of its eigenvector|.
        wanted = list(range(max(len(alphas) - top_k, 0), len(alphas)))
        if want_min:
            wanted.append(0)
        residual = max(beta * abs(float(S[-1, i])) for i in wanted)
        breakdown = beta <= 1e3 * tiny.eps * scale  # an invariant subspace: the spectrum is exact
        if breakdown or (residual <= tol * scale and len(alphas) >= top_k):
            return ritz, j + 1
        betas.append(beta)
        basis.append(w / beta)
    return ritz, iters


def hutchinson(op: HessianOperator, gen: torch.Generator, probes: int) -> tuple[float, float]:
    """Hutchinson's ``tr 𝓗 = E[Q(z)]``, ``z`` a metric-isotropic horizontal Gaussian.

    Returns:
        The mean of ``probes`` values ``Q(z) = zᵀ ∇²f(0) z`` and its standard error.
    """
    values = []
    for _ in range(probes):
        z = op.random(gen)
        values.append(float(z @ op.hvp(z)))
    return mean_se(values)


def hutchpp(op: HessianOperator, gen: torch.Generator, probes: int) -> tuple[float, float]:
    """Hutch++ (Meyer et al. 2021) in the metric: exact trace on a sketch, Hutchinson on the rest.

    ``probes // 3`` products sketch the range of ``𝓗``, as many give the exact trace on its
    metric-orthonormal basis ``Q``, and the remaining ones estimate the trace of ``𝓗`` compressed
    to the complement: ``z − QQᵀg z`` is an isotropic Gaussian there. The standard error is that
    of the second part (the first has none).
    """
    k = probes // 3
    basis: list[Tensor] = []
    for _ in range(k):
        y = op.raise_index(op.hvp(op.random(gen)))
        n_before = op.norm(y)
        y = orthogonalize(op, y, basis)
        n = op.norm(y)
        if n > 1e-8 * n_before and n > 0:  # drop what the sketch already spans
            basis.append(y / n)
    exact = sum(float(q @ op.hvp(q)) for q in basis)
    values = []
    for _ in range(probes - 2 * k):
        z = orthogonalize(op, op.random(gen), basis)
        values.append(float(z @ op.hvp(z)))
    mean, se = mean_se(values) if values else (0.0, 0.0)
    return exact + mean, se


def exact_trace(op: HessianOperator) -> float:
    """``tr(P g⁻¹ ∇²f P) = Σ_i (P g⁻¹ ∇²f P e_i)_i``: one product per coordinate."""
    total = 0.0
    for i in range(op.flat.numel):
        pe = op.project(op.flat.unit(i))
        if not bool(pe.any()):
            continue
        total += op.flat.entry(op.raise_index(op.hvp(pe)), i)
    return total


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (``nan`` for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
