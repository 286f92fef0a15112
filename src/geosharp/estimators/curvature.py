r"""``gs.curvature``: the invariant Hessian spectrum of a model on the quotient (SPEC §9).

On a horizontal tangent vector ``ξ`` the Riemannian Hessian form of the loss is

.. code-block:: text

    Q(ξ) = ξᵀ ∇²ℓ(w) ξ − ∇ℓ(w)ᵀ Γ_w(ξ, ξ),

the second derivative of ``ℓ`` along the geodesic with velocity ``ξ``. The second-order endpoint
``e(ξ) = w + ξ − ½Γ(ξ, ξ)`` that :class:`~geosharp.estimators.perturbation.Perturbation` builds
(``order=2``; the element-wise part follows straight lines, as the sharpness measures do) makes
this exact: ``Q(ξ) = d²/dt² ℓ(e(tξ))|₀``, so ``Q`` is the quadratic form of the Euclidean
Hessian of ``f(ξ) = ℓ(e(ξ))`` at ``ξ = 0``. Its products with vectors come from double backward
(never a dense Hessian): one backward of ``f`` at ``ξ = 0`` with ``create_graph=True``, then one
backward of ``⟨∇f, v⟩`` per product. The operator self-adjoint in the metric ``g`` on the
horizontal space is

.. code-block:: text

    𝓗 ξ = P g⁻¹ ∇²f(0) ξ          (P: horizontal projection, g⁻¹: the Riemannian gradient map),

and ``⟨η, 𝓗ξ⟩_g = ηᵀ ∇²f(0) ξ`` for horizontal ``η``. Estimated per batch:

- ``lambda_max`` (and the ``top_k`` largest eigenvalues, and ``lambda_min``) by Lanczos in the
  metric inner product with full reorthogonalization, from a random horizontal vector, until
  ``iters`` iterations or until the wanted Ritz pairs have relative residual ``≤ tol``;
- ``trace`` by Hutchinson, ``E[Q(z)]`` with ``z`` a metric-isotropic horizontal Gaussian (the
  average-case sharpness sampler, SPEC §6), with its standard error; or Hutch++; or exactly
  (one product per coordinate, for small models).

At a critical point worst-case sharpness is ``½ρ²λ_max + O(ρ³)`` and average-case sharpness
``½ρ²·trace + O(ρ³)`` (SPEC §9). ``measure="adaptive"`` gives the spectrum of
``diag|w| ∇²ℓ diag|w|``, ``measure="euclidean"`` that of ``∇²ℓ`` (PyHessian's numbers).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import geosharp as gs
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    >>> x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    >>> res = gs.curvature(model, nn.functional.mse_loss, [(x, y)], measure="euclidean",
    ...                    trace_method="exact")
    >>> params = dict(model.named_parameters())
    >>> names, shapes = list(params), [p.shape for p in params.values()]
    >>> def loss(theta):
    ...     chunks = torch.split(theta, [s.numel() for s in shapes])
    ...     p = {n: c.view(s) for n, c, s in zip(names, chunks, shapes)}
    ...     return nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)
    >>> theta = torch.cat([p.detach().reshape(-1) for p in params.values()])
    >>> dense = torch.func.hessian(loss)(theta)
    >>> abs(res.lambda_max - float(torch.linalg.eigvalsh(dense)[-1])) < 1e-10
    True
    >>> abs(res.trace - float(dense.trace())) < 1e-10
    True
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.distributed import batch_seed
from geosharp.estimators.perturbation import BLOCK_METRICS, Perturbation, Xi
from geosharp.estimators.sharpness import (
    MEASURES,
    LossFn,
    _check_float,
    _check_int,
    _Objective,
    _progress,
    _to_device,
    eval_mode,
)
from geosharp.symmetry import ParameterSpace, find_symmetries

QUANTITIES = ("lambda_max", "lambda_min", "trace")
TRACE_METHODS = ("hutchinson", "hutch++", "exact")

#: Added to the batch seed for the Lanczos start, so that the trace probes of batch ``b`` are
#: exactly the noise samples of ``gs.sharpness(kind="average")`` with the same seed (divided by
#: ``ρ``), whether or not the eigenvalues are computed too.
LANCZOS_SEED_OFFSET = 0x9E3779B97F4A7C15


@dataclass
class CurvatureResult:
    """The curvature of one model under one measure.

    Attributes:
        values: Every requested quantity (``"lambda_max"``, ``"lambda_min"``, ``"trace"``), the
            mean over batches of its per-batch values.
        per_batch: The per-batch values of every quantity.
        trace_stderr: Standard error of :attr:`values` ``["trace"]``, from the probes'
            sample variance (``0`` for ``trace_method="exact"``; ``nan`` with one probe;
            ``None`` when the trace was not asked for).
        per_batch_trace_stderr: Standard error of every batch's trace.
        eigenvalues: The ``top_k`` largest Ritz values of every batch, in decreasing order.
        lanczos_iters: Lanczos iterations (operator products) of every batch.
        grad_norms: Metric norm of the horizontal Riemannian gradient of every batch (``Q`` is
            the curvature of sharpness at a critical point; away from one the first-order term
            ``ρ‖grad‖`` dominates sharpness).
        clean_losses: ``L_S(w)`` of every batch.
        measure: Name of the measure, e.g. ``"geodesic-inv curvature"``.
        settings: Every setting of the call.
        time_s: Wall time in seconds.
        n_hvp: Hessian-vector products (double-backward passes).
        n_forward: Forward passes of the model.
        n_backward: First-order backward passes (with ``create_graph=True``).
        excluded: Parameters left out (name → reason).
    """

    values: dict[str, float]
    per_batch: dict[str, list[float]]
    trace_stderr: float | None
    per_batch_trace_stderr: list[float]
    eigenvalues: list[list[float]]
    lanczos_iters: list[int]
    grad_norms: list[float]
    clean_losses: list[float]
    measure: str
    settings: dict[str, Any]
    time_s: float
    n_hvp: int = 0
    n_forward: int = 0
    n_backward: int = 0
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def lambda_max(self) -> float | None:
        """Mean over batches of the largest eigenvalue (``None`` if not computed)."""
        return self.values.get("lambda_max")

    @property
    def lambda_min(self) -> float | None:
        """Mean over batches of the smallest eigenvalue (``None`` if not computed)."""
        return self.values.get("lambda_min")

    @property
    def trace(self) -> float | None:
        """Mean over batches of the trace (``None`` if not computed)."""
        return self.values.get("trace")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)

    def __str__(self) -> str:
        parts = []
        for q, v in self.values.items():
            err = f" ± {self.trace_stderr:.2g}" if q == "trace" and self.trace_stderr else ""
            parts.append(f"{q}={v:.6g}{err}")
        return (
            f"{self.measure}: {', '.join(parts)} over {len(self.clean_losses)} batch(es), "
            f"{self.n_hvp} HVPs, {self.time_s:.2f} s"
        )


def _math_sdpa() -> contextlib.AbstractContextManager:
    """The MATH kernel of scaled-dot-product attention: the fused ones lack double backward."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - torch < 2.3
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


class _Flat:
    """Flat vectors ↔ perturbations (lists of tangent tuples) with the shapes of ``template``."""

    def __init__(self, template: Xi, dtype: torch.dtype) -> None:
        self.structure = [len(x) for x in template]
        self.shapes = [t.shape for x in template for t in x]
        self.dtypes = [t.dtype for x in template for t in x]
        self.sizes = [t.numel() for x in template for t in x]
        self.dtype = dtype
        self.device = template[0][0].device if template and template[0] else torch.device("cpu")
        self.numel = sum(self.sizes)

    def flatten(self, xi: Xi) -> Tensor:
        parts = [t.reshape(-1).to(self.dtype) for x in xi for t in x]
        if not parts:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat(parts)

    def unflatten(self, v: Tensor) -> Xi:
        chunks = iter(
            c.view(s).to(d)
            for c, s, d in zip(torch.split(v, self.sizes), self.shapes, self.dtypes, strict=True)
        )
        return [tuple(next(chunks) for _ in range(k)) for k in self.structure]


class _Operator:
    """``∇²f(0)`` of ``f(ξ) = L_S(e(ξ))`` by double backward, and ``𝓗 = P g⁻¹ ∇²f(0)``.

    Builds the first-order graph once (one forward, one backward with ``create_graph=True``);
    every product is then one backward through it.
    """

    def __init__(self, objective: _Objective, pert: Perturbation, flat: _Flat, counter) -> None:
        self.pert, self.flat, self.counter = pert, flat, counter
        leaves = [tuple(t.detach().requires_grad_(True) for t in x) for x in pert.zeros()]
        self.leaves = [t for x in leaves for t in x]
        with torch.enable_grad(), _math_sdpa():
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
            return torch.zeros_like(v)
        parts = [t.reshape(-1) for x in self.flat.unflatten(v) for t in x]
        with torch.enable_grad(), _math_sdpa():
            out = torch.autograd.grad(
                self._grads,
                self.leaves,
                grad_outputs=[parts[i].view_as(self._grads[k]) for k, i in enumerate(self._live)],
                retain_graph=True,
                allow_unused=True,
            )
        return self._cat(out)

    def _cat(self, parts: Sequence[Tensor | None]) -> Tensor:
        """Concatenate per-leaf tensors (``None``: zero) into a flat vector."""
        if not self.leaves:
            return torch.zeros(0, dtype=self.flat.dtype, device=self.flat.device)
        return torch.cat(
            [
                (p if p is not None else torch.zeros_like(t)).reshape(-1).to(self.flat.dtype)
                for p, t in zip(parts, self.leaves, strict=True)
            ]
        )

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
                return torch.zeros_like(v)
            g = torch.autograd.grad(s, flat_a, allow_unused=True)
        return torch.cat(
            [
                (gi if gi is not None else torch.zeros_like(t)).reshape(-1).to(self.flat.dtype)
                for gi, t in zip(g, flat_a, strict=True)
            ]
        )

    def norm(self, v: Tensor) -> float:
        return math.sqrt(max(float(v @ self.lower(v)), 0.0))

    def random(self, gen: torch.Generator, scale: float = 1.0) -> Tensor:
        """A metric-isotropic horizontal Gaussian (``Perturbation.random``), flat."""
        return self.flat.flatten(self.pert.random(gen, scale))


def _orthogonalize(op: _Operator, w: Tensor, basis: Sequence[Tensor]) -> Tensor:
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


def _lanczos(
    op: _Operator,
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
        return torch.zeros(0, dtype=torch.float64), 0
    basis: list[Tensor] = [start / n0]
    alphas: list[float] = []
    betas: list[float] = []
    ritz = torch.zeros(0, dtype=torch.float64)
    tiny = torch.finfo(start.dtype)
    for j in range(iters):
        hv = op.hvp(basis[j])
        alphas.append(float(basis[j] @ hv))  # ⟨q, 𝓗q⟩_g = qᵀ ∇²f q on horizontal q
        # Full reorthogonalization subsumes the three-term recurrence w − αq_j − βq_{j−1}.
        w = _orthogonalize(op, op.raise_index(hv), basis)
        beta = op.norm(w)
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if j:
            off = torch.tensor(betas, dtype=torch.float64)
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


def _hutchinson(op: _Operator, gen: torch.Generator, probes: int) -> tuple[float, float]:
    values = []
    for _ in range(probes):
        z = op.random(gen)
        values.append(float(z @ op.hvp(z)))
    return _mean_se(values)


def _hutchpp(op: _Operator, gen: torch.Generator, probes: int) -> tuple[float, float]:
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
        y = _orthogonalize(op, y, basis)
        n = op.norm(y)
        if n > 1e-8 * n_before and n > 0:  # drop what the sketch already spans
            basis.append(y / n)
    exact = sum(float(q @ op.hvp(q)) for q in basis)
    values = []
    for _ in range(probes - 2 * k):
        z = _orthogonalize(op, op.random(gen), basis)
        values.append(float(z @ op.hvp(z)))
    mean, se = _mean_se(values) if values else (0.0, 0.0)
    return exact + mean, se


def _exact_trace(op: _Operator) -> float:
    """``tr(P g⁻¹ ∇²f P) = Σ_i (P g⁻¹ ∇²f P e_i)_i``: one product per coordinate."""
    total = 0.0
    n = op.flat.numel
    for i in range(n):
        e = torch.zeros(n, dtype=op.flat.dtype, device=op.flat.device)
        e[i] = 1.0
        pe = op.project(e)
        if not bool(pe.any()):
            continue
        total += float(op.raise_index(op.hvp(pe))[i])
    return total


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def curvature(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[tuple[Any, Any]],
    *,
    measure: str = "geodesic",
    metric: str = "inv",
    quantities: Sequence[str] = ("lambda_max", "trace"),
    iters: int = 50,
    tol: float = 1e-5,
    probes: int = 100,
    trace_method: str = "hutchinson",
    top_k: int = 1,
    seed: int = 0,
    eps: float = 0.0,
    space: ParameterSpace | None = None,
    key_bias: str = "quotient",
    progress: bool | None = None,
) -> CurvatureResult:
    r"""Curvature of ``model`` on ``batches``: the Hessian spectrum on the quotient (SPEC §9).

    Per batch, the operator ``𝓗ξ = P g⁻¹ ∇²f(0) ξ`` with ``f(ξ) = L_S(e(ξ))`` and ``e`` the
    second-order geodesic endpoint (see the module docstring) is probed by Hessian-vector
    products (double backward, no dense Hessian); every quantity is averaged over batches. The
    model runs in eval mode through :func:`torch.func.functional_call`; its parameters are never
    written to. Data are moved to the device of the model's parameters.

    Args:
        model: Any ``nn.Module``; every parameter with ``requires_grad=True`` is included.
        loss_fn: ``loss_fn(model(inputs), targets)`` → scalar tensor.
        batches: Iterable of ``(inputs, targets)`` as for :func:`geosharp.sharpness`.
        measure: ``"geodesic"`` (symmetry blocks on their quotient, the rest element-wise),
            ``"adaptive"`` (spectrum of ``diag|w| ∇²ℓ diag|w|``) or ``"euclidean"``
            (``∇²ℓ``).
        metric: Block metric of the geodesic measure: ``"inv"``, ``"mix"`` or ``"adaptive"``.
        quantities: Any of ``"lambda_max"`` and ``"lambda_min"`` (the largest and smallest
            eigenvalues, signed) and ``"trace"``. Each batch's value is that of its own loss
            ``L_S``; the result is their mean (like m-sharpness; not the spectrum of the loss
            summed over batches).
        iters: Maximum Lanczos iterations (one product each).
        tol: Lanczos stops once the ``top_k`` largest Ritz pairs (and the smallest, for
            ``lambda_min``) have residual ``≤ tol·max|θ|``; eigenvalue errors are then of order
            ``tol²`` relative to the spectral gap.
        probes: Trace probes (products) per batch, for ``"hutchinson"`` and ``"hutch++"``.
        trace_method: ``"hutchinson"`` (``E[Q(z)]``, ``z`` a metric-isotropic horizontal
            Gaussian, reported with its standard error; with the same ``seed`` the probes are
            the noise samples of ``gs.sharpness(kind="average")`` divided by ``ρ``),
            ``"hutch++"`` (at least 3 probes) or ``"exact"`` (one product per coordinate: small
            models only).
        top_k: Number of largest eigenvalues kept per batch in ``eigenvalues``.
        seed: Seed of the Lanczos start and the probes (batch ``b`` uses
            :func:`~geosharp.estimators.distributed.batch_seed` ``(seed, b)``).
        eps: Gram-matrix damping of GL(h) blocks (``0``: exactly invariant).
        space: A precomputed :func:`geosharp.find_symmetries` result (default: found here).
        key_bias: How the symmetry finder treats attention key biases when ``space`` is not
            given, as in :func:`geosharp.sharpness`: ``"quotient"`` holds them fixed in the
            geodesic measure (the softmax ignores them), ``"keep"`` makes them rows of ``H_QK``.
        progress: Show a progress bar over batches (default: when stderr is a terminal).

    Returns:
        A :class:`CurvatureResult`.

    Raises:
        ValueError: On an unknown measure, metric, quantity or trace method, bad counts, no
            batches, or a non-finite clean loss.
        TypeError: If ``model`` is not an ``nn.Module`` or ``loss_fn`` does not return a
            scalar tensor.
    """
    t0 = time.perf_counter()
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if measure == "geodesic" and metric not in BLOCK_METRICS:
        raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {metric!r}")
    if isinstance(quantities, str):
        quantities = (quantities,)
    quantities = tuple(quantities)
    bad = [q for q in quantities if q not in QUANTITIES]
    if bad or not quantities:
        raise ValueError(f"quantities must be a non-empty subset of {QUANTITIES}, got {bad}")
    if trace_method not in TRACE_METHODS:
        raise ValueError(f"trace_method must be one of {TRACE_METHODS}, got {trace_method!r}")
    iters = _check_int("iters", iters)
    probes = _check_int("probes", probes, 3 if trace_method == "hutch++" else 1)
    top_k = _check_int("top_k", top_k)
    tol = _check_float("tol", tol)
    eps = _check_float("eps", eps, positive=False)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")

    space_given = space is not None
    space = space if space_given else find_symmetries(model, key_bias=key_bias)
    if space.numel() == 0:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    theta0 = space.flatten(dict(model.named_parameters())).detach()
    device = theta0.device
    pert = Perturbation(space, theta0, measure=measure, metric=metric, order=2, eps=eps)
    flat = _Flat(pert.zeros(), theta0.dtype)
    want_eig = "lambda_max" in quantities or "lambda_min" in quantities
    want_trace = "trace" in quantities
    name = (f"geodesic-{metric}" if measure == "geodesic" else measure) + " curvature"
    counter = {"forward": 0, "backward": 0, "hvp": 0}
    per_batch: dict[str, list[float]] = {q: [] for q in quantities}
    trace_se: list[float] = []
    eigenvalues: list[list[float]] = []
    lanczos_iters: list[int] = []
    grad_norms: list[float] = []
    clean: list[float] = []
    with eval_mode(model):
        for b, batch in _progress(enumerate(batches), progress, name):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(f"batch {b} must be a pair (inputs, targets)")
            inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
            f = _Objective(model, loss_fn, space, pert, inputs, targets, counter)
            op = _Operator(f, pert, flat, counter)
            if not math.isfinite(op.loss):
                raise ValueError(
                    f"the clean loss of batch {b} is {op.loss}: curvature is undefined; "
                    "check the model, the data and loss_fn"
                )
            clean.append(op.loss)
            grad_norms.append(op.norm(op.raise_index(op.egrad)))
            if want_eig:
                gen = torch.Generator(device=device)
                gen.manual_seed((batch_seed(seed, b) + LANCZOS_SEED_OFFSET) % 2**64)
                ritz, its = _lanczos(
                    op, op.random(gen), iters, tol, top_k, "lambda_min" in quantities
                )
                lanczos_iters.append(its)
                top = ritz.flip(0)[:top_k].tolist()
                eigenvalues.append(top)
                if "lambda_max" in quantities:
                    per_batch["lambda_max"].append(top[0] if top else 0.0)
                if "lambda_min" in quantities:
                    per_batch["lambda_min"].append(float(ritz[0]) if len(ritz) else 0.0)
            if want_trace:
                gen = torch.Generator(device=device).manual_seed(batch_seed(seed, b))
                if trace_method == "exact":
                    value, se = _exact_trace(op), 0.0
                elif trace_method == "hutch++":
                    value, se = _hutchpp(op, gen, probes)
                else:
                    value, se = _hutchinson(op, gen, probes)
                per_batch["trace"].append(value)
                trace_se.append(se)
            del op
    if not clean:
        raise ValueError("batches is empty: pass at least one (inputs, targets) batch")
    n = len(clean)
    values = {q: sum(v) / n for q, v in per_batch.items()}
    stderr = math.sqrt(sum(s * s for s in trace_se)) / n if want_trace else None
    settings = {
        "measure": measure,
        "metric": metric if measure == "geodesic" else None,
        "order": 2 if measure == "geodesic" else 1,
        "quantities": list(quantities),
        "iters": iters if want_eig else None,
        "tol": tol if want_eig else None,
        "top_k": top_k if want_eig else None,
        "probes": probes if want_trace and trace_method != "exact" else None,
        "trace_method": trace_method if want_trace else None,
        "eps": eps,
        "seed": seed,
        "key_bias": None if space_given else key_bias,
        "n_params": space.numel(),
        "n_gl_blocks": sum(blk.heads for blk in space.gl_blocks) if measure == "geodesic" else 0,
        "n_key_biases_fixed": sum(blk.kind == "b_k" for blk in space.blocks)
        if measure == "geodesic" and metric != "adaptive"
        else 0,
        "dtype": str(theta0.dtype),
        "device": str(device),
    }
    return CurvatureResult(
        values=values,
        per_batch=per_batch,
        trace_stderr=stderr,
        per_batch_trace_stderr=trace_se,
        eigenvalues=eigenvalues,
        lanczos_iters=lanczos_iters,
        grad_norms=grad_norms,
        clean_losses=clean,
        measure=name,
        settings=settings,
        time_s=time.perf_counter() - t0,
        n_hvp=counter["hvp"],
        n_forward=counter["forward"],
        n_backward=counter["backward"],
        excluded=dict(space.excluded),
    )
