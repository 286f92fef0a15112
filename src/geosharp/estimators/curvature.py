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

The operator and these algorithms are :mod:`geosharp.estimators.hessian`; the objectives and the
loop over batches are :mod:`geosharp.estimators.harness`'s, shared with ``gs.sharpness``.

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
from torch import nn

from geosharp.estimators.distributed import batch_seed
from geosharp.estimators.harness import (
    LossFn,
    PerturbationSettings,
    batch_progress,
    check_float,
    check_int,
    objectives,
)
from geosharp.estimators.hessian import (
    Flat,
    HessianOperator,
    exact_trace,
    hutchinson,
    hutchpp,
    lanczos,
)
from geosharp.estimators.materialized import check_materialized
from geosharp.estimators.perturbation import BLOCK_METRICS, MEASURES, Perturbation
from geosharp.estimators.pieces import PerturbationOptions, _flat_dtype
from geosharp.estimators.sharded.check import is_sharded
from geosharp.estimators.sharded.hessian import RankFlat, ShardedHessian
from geosharp.estimators.sharded.run import ShardedRun, prepare_curvature
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.verify import eval_mode

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


@dataclass(frozen=True)
class CurvatureSettings:
    """What :func:`curvature` computes and how, checked when built.

    The fields are :func:`curvature`'s arguments of the same names; ``quantities`` is held as a
    tuple, ``tol`` and ``eps`` as floats.

    Raises:
        ValueError: On an unknown measure, metric, quantity or trace method, or bad counts
            (in the order of :func:`curvature`'s arguments).
        TypeError: If ``tol`` or ``eps`` is not a number.
    """

    measure: str = "geodesic"
    metric: str = "inv"
    quantities: Sequence[str] = ("lambda_max", "trace")
    iters: int = 50
    tol: float = 1e-5
    probes: int = 100
    trace_method: str = "hutchinson"
    top_k: int = 1
    seed: int = 0
    eps: float = 0.0
    key_bias: str = "quotient"

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {self.measure!r}")
        if self.measure == "geodesic" and self.metric not in BLOCK_METRICS:
            raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {self.metric!r}")
        quantities = self.quantities
        if isinstance(quantities, str):
            quantities = (quantities,)
        quantities = tuple(quantities)
        bad = [q for q in quantities if q not in QUANTITIES]
        if bad or not quantities:
            raise ValueError(f"quantities must be a non-empty subset of {QUANTITIES}, got {bad}")
        if self.trace_method not in TRACE_METHODS:
            raise ValueError(
                f"trace_method must be one of {TRACE_METHODS}, got {self.trace_method!r}"
            )
        check_int("iters", self.iters)
        check_int("probes", self.probes, 3 if self.trace_method == "hutch++" else 1)
        check_int("top_k", self.top_k)
        tol = check_float("tol", self.tol)
        eps = check_float("eps", self.eps, positive=False)
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        object.__setattr__(self, "quantities", quantities)
        object.__setattr__(self, "tol", tol)
        object.__setattr__(self, "eps", eps)

    @property
    def perturbation(self) -> PerturbationSettings:
        """The settings of the order-2 perturbation a sharded model's call is built from."""
        return PerturbationSettings(
            measure=self.measure,
            metric=self.metric,
            order=2,
            perturb="all",
            eps=self.eps,
            corrected_norm=True,
            exact_steps=PerturbationOptions.exact_steps,
            key_bias=self.key_bias,
            low_memory=False,
        )

    @property
    def wants_eigenvalues(self) -> bool:
        """Whether ``lambda_max`` or ``lambda_min`` is asked for (Lanczos runs)."""
        return "lambda_max" in self.quantities or "lambda_min" in self.quantities

    @property
    def wants_trace(self) -> bool:
        """Whether ``trace`` is asked for."""
        return "trace" in self.quantities

    @property
    def name(self) -> str:
        """The measure's name, e.g. ``"geodesic-inv curvature"``."""
        return (f"geodesic-{self.metric}" if self.measure == "geodesic" else self.measure) + (
            " curvature"
        )

    def recorded(self, space: ParameterSpace, space_given: bool) -> dict[str, Any]:
        """The settings a :class:`CurvatureResult` records (``None`` where one does not apply).

        The model's dtype and device follow them in the result.
        """
        geodesic, eig, trace = self.measure == "geodesic", self.wants_eigenvalues, self.wants_trace
        return {
            "measure": self.measure,
            "metric": self.metric if geodesic else None,
            "order": 2 if geodesic else 1,
            "quantities": list(self.quantities),
            "iters": self.iters if eig else None,
            "tol": self.tol if eig else None,
            "top_k": self.top_k if eig else None,
            "probes": self.probes if trace and self.trace_method != "exact" else None,
            "trace_method": self.trace_method if trace else None,
            "eps": self.eps,
            "seed": self.seed,
            "key_bias": None if space_given else self.key_bias,
            "n_params": space.numel(),
            "n_gl_blocks": sum(blk.heads for blk in space.gl_blocks) if geodesic else 0,
            "n_key_biases_fixed": sum(blk.kind == "b_k" for blk in space.blocks)
            if geodesic and self.metric != "adaptive"
            else 0,
        }


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

    A model sharded by FSDP2 (every layer and the root under ``fully_shard``, one 1-D mesh)
    is measured on every rank, each with its own rows of every batch, as
    :func:`geosharp.sharpness` measures it: every measure and quantity here, with the trace by
    ``"hutchinson"`` or ``"hutch++"`` (``"exact"`` is refused). The products are double
    backwards through FSDP's own forward with every layer kept gathered for the call (the
    gathered model must fit one device), the perturbation's on the rank's shards
    (:mod:`geosharp.estimators.sharded.hessian`); every rank gets the values one process gets
    on the whole batches (the same probes and Lanczos start, to rounding), and the shards are
    bit-identical afterwards. ``space`` must then be ``None``.

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
            batches, or a non-finite clean loss; on a sharded model, with ``space`` or
            ``trace_method="exact"``, or as :func:`geosharp.sharpness` refuses one.
        TypeError: If ``model`` is not an ``nn.Module`` or ``loss_fn`` does not return a
            scalar tensor.
    """
    t0 = time.perf_counter()
    cfg = CurvatureSettings(
        measure=measure,
        metric=metric,
        quantities=quantities,
        iters=iters,
        tol=tol,
        probes=probes,
        trace_method=trace_method,
        top_k=top_k,
        seed=seed,
        eps=eps,
        key_bias=key_bias,
    )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_materialized(model, "gs.curvature")
    run: ShardedRun | None = None
    if is_sharded(model):  # every rank measures every batch, on its own rows of it
        if cfg.trace_method == "exact" and "trace" in cfg.quantities:
            raise ValueError(
                "trace_method='exact' takes one product per coordinate of the whole model: "
                "on a sharded model use 'hutchinson' or 'hutch++'"
            )
        run = prepare_curvature(model, cfg.perturbation, space=space)

    space_given = space is not None
    if run is not None:
        space = run.setup.space
    elif not space_given:
        space = find_symmetries(model, key_bias=cfg.key_bias)
    if space.numel() == 0:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    # The base point is the model's own parameters by name (no flat copy of θ, each on its
    # device); flat vectors have the dtype a concatenation of them would have.
    if run is None:
        named = dict(model.named_parameters())
        base = {n: named[n].detach() for n in space.param_names}
    else:  # the rank's shards (and the zero rows padding its blocks' heads)
        base = run.setup.base
    device = base[space.param_names[0]].device
    dtype = _flat_dtype(base.values())
    if run is None:
        pert = Perturbation(
            space, base, measure=cfg.measure, metric=cfg.metric, order=2, eps=cfg.eps
        )
        flat = Flat(pert.zeros(), dtype)
    else:
        pert = run.pert
        flat = RankFlat(pert.zeros(), dtype, pert.reduce)
    quantities = cfg.quantities
    counter = {"forward": 0, "backward": 0, "hvp": 0}
    per_batch: dict[str, list[float]] = {q: [] for q in quantities}
    trace_se: list[float] = []
    eigenvalues: list[list[float]] = []
    lanczos_iters: list[int] = []
    grad_norms: list[float] = []
    clean: list[float] = []
    indexed = batch_progress(enumerate(batches), progress, cfg.name)
    make = None if run is None else run.objective
    sharded = contextlib.nullcontext() if run is None else run.restored()
    gathered = contextlib.nullcontext() if run is None else run.kept_gathered()
    with eval_mode(model), sharded, gathered:
        for f, gen in objectives(
            model, loss_fn, pert, indexed, seed=cfg.seed, device=device, counter=counter, make=make
        ):
            if run is None:
                op = HessianOperator(f, pert, flat, counter)
            else:
                op = ShardedHessian(f, pert, flat, counter)
            if not math.isfinite(op.loss):
                raise ValueError(
                    f"the clean loss of batch {f.batch} is {op.loss}: curvature is undefined; "
                    "check the model, the data and loss_fn"
                )
            clean.append(op.loss)
            grad_norms.append(op.norm(op.raise_index(op.egrad)))
            if cfg.wants_eigenvalues:
                start = torch.Generator(device=device)
                start.manual_seed((batch_seed(cfg.seed, f.batch) + LANCZOS_SEED_OFFSET) % 2**64)
                ritz, its = lanczos(
                    op, op.random(start), cfg.iters, cfg.tol, cfg.top_k, "lambda_min" in quantities
                )
                lanczos_iters.append(its)
                top = ritz.flip(0)[: cfg.top_k].tolist()
                eigenvalues.append(top)
                if "lambda_max" in quantities:
                    per_batch["lambda_max"].append(top[0] if top else 0.0)
                if "lambda_min" in quantities:
                    per_batch["lambda_min"].append(float(ritz[0]) if len(ritz) else 0.0)
            if cfg.wants_trace:  # the generator of the average-case samples of this batch
                if cfg.trace_method == "exact":
                    value, se = exact_trace(op), 0.0
                elif cfg.trace_method == "hutch++":
                    value, se = hutchpp(op, gen, cfg.probes)
                else:
                    value, se = hutchinson(op, gen, cfg.probes)
                per_batch["trace"].append(value)
                trace_se.append(se)
            del op
    if not clean:
        raise ValueError("batches is empty: pass at least one (inputs, targets) batch")
    n = len(clean)
    values = {q: sum(v) / n for q, v in per_batch.items()}
    stderr = math.sqrt(sum(s * s for s in trace_se)) / n if cfg.wants_trace else None
    settings = {
        **cfg.recorded(space, space_given),
        "dtype": str(dtype),
        "device": str(device),
        "sharded": None if run is None else run.describe(),
    }
    if run is not None:  # the whole model's, not the rank's shard
        settings["n_params"] = run.shards.numel
    return CurvatureResult(
        values=values,
        per_batch=per_batch,
        trace_stderr=stderr,
        per_batch_trace_stderr=trace_se,
        eigenvalues=eigenvalues,
        lanczos_iters=lanczos_iters,
        grad_norms=grad_norms,
        clean_losses=clean,
        measure=cfg.name,
        settings=settings,
        time_s=time.perf_counter() - t0,
        n_hvp=counter["hvp"],
        n_forward=counter["forward"],
        n_backward=counter["backward"],
        excluded=dict(space.excluded),
    )
