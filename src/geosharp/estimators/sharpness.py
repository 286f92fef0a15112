"""``gs.sharpness``: adaptive, Euclidean and geodesic sharpness of a model (SPEC §2, §6).

The value of a batch is :class:`~geosharp.estimators.worst.WorstCase` or
:class:`~geosharp.estimators.average.AverageCase` of its objective ``ξ ↦ L_S(θ′(ξ))``;
:mod:`geosharp.estimators.harness` builds the perturbation and the objectives, one per batch
(split across ranks by :class:`~geosharp.estimators.distributed.BatchSplit`), and counts the
passes. The result is the mean over batches. The call's settings are checked once, named and
recorded by :class:`~geosharp.estimators.sharpness_settings.SharpnessSettings`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import geosharp as gs
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
    >>> x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 8)
    >>> res = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], measure="geodesic", rho=0.05)
    >>> res.value > 0, len(res.traces[0])   # the loss at the start and after each of 20 steps
    (True, 21)
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from geosharp.estimators.apgd import BUFFER_BUDGET
from geosharp.estimators.distributed import BatchSplit
from geosharp.estimators.harness import LossFn, PassBar, objectives, perturbation_of
from geosharp.estimators.materialized import check_materialized
from geosharp.estimators.sharded.check import is_sharded
from geosharp.estimators.sharded.run import ShardedRun, prepare
from geosharp.estimators.sharpness_settings import KINDS as KINDS
from geosharp.estimators.sharpness_settings import NORMS as NORMS
from geosharp.estimators.sharpness_settings import SharpnessSettings
from geosharp.estimators.sharpness_settings import measure_name as measure_name
from geosharp.estimators.worst import ExactStepsWarning, exact_steps_warning
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.verify import eval_mode


@dataclass
class SharpnessResult:
    """The sharpness of one model under one measure.

    Attributes:
        value: Mean over batches of the per-batch sharpness.
        per_batch: ``max_ξ L_S(w′) − L_S(w)`` (worst case) or the mean loss rise (average case)
            of every batch.
        clean_losses: ``L_S(w)`` of every batch.
        perturbed_losses: ``L_S(w′)`` of every batch (best found, or mean over samples).
        measure: Name of the measure, e.g. ``"geodesic-inv-o2 worst l2"``.
        settings: Every setting of the call (ρ, steps, metric, order, ε, seed, ...), and
            ``max_relative_speed``: with ``order="exact"`` the largest relative speed ``κ`` of
            a GL(h) head at the reported perturbation of any batch (worst case) or over the
            noise samples (average case; RK4 needs about ``2κ`` ``exact_steps``), else
            ``None``.
        time_s: Wall time in seconds.
        n_forward: Forward passes of the model (clean losses included).
        n_backward: Backward passes of the model.
        excluded: Parameters left out (name → reason), e.g. ``requires_grad=False``.
        traces: For the worst case, the loss at every ascent iterate of every batch.
    """

    value: float
    per_batch: list[float]
    clean_losses: list[float]
    perturbed_losses: list[float]
    measure: str
    settings: dict[str, Any]
    time_s: float
    n_forward: int = 0
    n_backward: int = 0
    excluded: dict[str, str] = field(default_factory=dict)
    traces: list[list[float]] = field(default_factory=list)

    @property
    def std(self) -> float:
        """Standard deviation of the per-batch values."""
        n = len(self.per_batch)
        if n < 2:
            return 0.0
        m = self.value
        return math.sqrt(sum((v - m) ** 2 for v in self.per_batch) / (n - 1))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.measure} (rho={self.settings.get('rho')}): {self.value:.6g} "
            f"± {self.std:.2g} over {len(self.per_batch)} batch(es), {self.time_s:.2f} s"
        )


def sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[tuple[Any, Any]],
    *,
    measure: str = "geodesic",
    metric: str = "inv",
    order: int | str = 2,
    kind: str = "worst",
    rho: float = 0.1,
    steps: int = 20,
    norm: str = "l2",
    eps: float = 0.0,
    seed: int = 0,
    samples: int = 10,
    restarts: int = 1,
    random_init: bool = False,
    corrected_norm: bool = True,
    exact_steps: int = 10,
    space: ParameterSpace | None = None,
    key_bias: str = "quotient",
    perturb: str = "all",
    cache: bool = True,
    low_memory: bool = False,
    buffer_budget: float | None = BUFFER_BUDGET,
    progress: bool | None = None,
    distributed: bool | None = None,
) -> SharpnessResult:
    r"""Sharpness of ``model`` on ``batches`` (SPEC §2, §6).

    Worst case: ``E_S[max_{‖ξ‖ ≤ ρ} L_S(γ_ξ(1)) − L_S(w)]``, maximized per batch by Auto-PGD
    (one forward + one backward per step). Average case: ``E_S E_ξ[L_S(γ_ξ(1)) − L_S(w)]``
    with ``ξ`` an isotropic Gaussian of standard deviation ``ρ`` in the metric (projected
    horizontally for geodesic sharpness). The model runs in eval mode through
    :func:`torch.func.functional_call`: its parameters are never written to, so they are
    bit-identical afterwards whatever happens, and its train/eval mode is restored. Data are
    moved to the device of the model's parameters.

    Args:
        model: Any ``nn.Module``; every parameter with ``requires_grad=True`` is perturbed.
        loss_fn: ``loss_fn(model(inputs), targets)`` → scalar tensor (mean over the batch).
        batches: Iterable of ``(inputs, targets)``; ``inputs`` may be a tensor, a tuple
            (positional arguments) or a dict (keyword arguments).
        measure: ``"geodesic"`` (symmetry blocks on their quotient manifold, the rest adaptive),
            ``"adaptive"`` (element-wise, Kwon et al. / Andriushchenko et al.) or
            ``"euclidean"``.
        metric: Block metric of geodesic sharpness: ``"inv"``, ``"mix"``, or ``"adaptive"``
            (block coordinates with the element-wise metric; with ``order=1`` this equals
            adaptive sharpness, SPEC §5).
        order: Geodesic order for symmetry blocks: ``1``, ``2`` (paper Eq. 5) or ``"exact"``.
        kind: ``"worst"`` or ``"average"``.
        rho: Radius of the ball (worst case) or standard deviation (average case).
        steps: Auto-PGD iterations (worst case).
        norm: ``"l2"``, or ``"linf"`` for the adaptive/Euclidean box ``|δ_i| ≤ ρ|w_i|``.
        eps: Gram-matrix damping of GL(h) blocks (``0``: exactly invariant).
        seed: Seed of the random start / samples.
        samples: Noise samples per batch (average case).
        restarts: Auto-PGD runs per batch; restarts after the first start at random points.
        random_init: Start the first run at a random point of the sphere as well.
        corrected_norm: ``False``: the paper's "no corrected norm" ablation.
        exact_steps: RK4 steps for ``order="exact"``. A head that the reported (worst-case)
            perturbation moves ``κ`` times its size needs about ``2κ``: fewer give a
            :class:`~geosharp.estimators.worst.ExactStepsWarning` (a
            :class:`~geosharp.errors.MeasureWarning`: the value may be inaccurate; ``κ`` is
            ``settings["max_relative_speed"]``).
        space: A precomputed :func:`geosharp.find_symmetries` result (default: found here).
        key_bias: How the symmetry finder treats attention key biases when ``space`` is not
            given: ``"quotient"`` (default) holds them fixed in geodesic measures (the softmax
            ignores them, SPEC §8); ``"keep"`` makes them rows of ``H_QK`` (the setting of
            Studies 1–3). Adaptive and Euclidean sharpness perturb them either way.
        perturb: ``"all"`` (default) or ``"blocks"``: the attention-only measures — only the
            symmetry blocks move, everything else is held fixed. With ``measure="adaptive"``
            the blocks' coordinates get the element-wise ball (adaptive sharpness of the
            blocks); with ``"geodesic"`` their quotient geometry.
        cache: Reuse the symmetry search and the factorized geometry of the previous call on
            the same model with unchanged weights (:mod:`geosharp.estimators.cache`): several
            radii or measures of one model pay the set-up once. ``False``: build afresh.
        low_memory: Trade time and precision for memory. (1) Auto-PGD keeps the best
            iterate's direction for restarts only while that costs no buffer (the best
            iterate is the current one, the previous one or ξ = 0) and recomputes it at a
            restart from an older one (one extra forward and backward each time; the same
            iterates): three ξ-sized buffers at most. By default it is kept always when four
            ξ-sized buffers and what the perturbation holds beside them (block base points,
            factorizations) fit in four parameter-sized buffers, and only while free
            otherwise (:func:`geosharp.estimators.apgd.best_direction_rule`). (2) The
            symmetry blocks' geometry runs its per-step products in the model's dtype instead
            of float64 (the factorizations stay float64; tangents are kept in the model's
            dtype either way): no float64 temporaries, with the model dtype's roundoff in the
            projection (the same values as the default for a float64 model). See
            ``benchmarks/README.md``.
        buffer_budget: Parameter-sized buffers a worst-case ascent may hold above a plain
            forward and backward for the rule of ``low_memory`` (1): the best iterate's
            direction is kept always where four ξ-sized buffers and what the perturbation
            holds beside them fit in this many. ``None``: no bound, always kept (the fewest
            passes: no recomputation at a restart, one buffer more). The iterates and the
            value do not depend on it. Ignored with ``low_memory=True``.
        progress: Show a progress bar over batches (default: when stderr is a terminal).
        distributed: Split the batches across the ranks of ``torch.distributed`` (data
            parallel, :mod:`geosharp.estimators.distributed`): ``None`` when a process group
            of more than one rank is initialized, ``True`` always, ``False`` never. Every rank
            passes the same model and batches and gets the same result, with the per-batch
            values of a single-process run (each batch's random numbers come from
            ``(seed, batch index)``); ``time_s`` and the pass counts are summed over ranks.

    Returns:
        A :class:`SharpnessResult`.

    Raises:
        ValueError: On an unknown measure, kind, norm or metric, ``rho <= 0``, no batches, or
            a non-finite clean loss.
        TypeError: If ``loss_fn`` does not return a scalar tensor.
        FloatingPointError: If the loss becomes non-finite inside the ball.
    """
    t0 = time.perf_counter()
    cfg = SharpnessSettings.checked(
        measure=measure,
        metric=metric,
        order=order,
        kind=kind,
        rho=rho,
        steps=steps,
        norm=norm,
        eps=eps,
        seed=seed,
        samples=samples,
        restarts=restarts,
        random_init=random_init,
        corrected_norm=corrected_norm,
        exact_steps=exact_steps,
        key_bias=key_bias,
        perturb=perturb,
        cache=cache,
        low_memory=low_memory,
        buffer_budget=buffer_budget,
        progress=progress,
        distributed=distributed,
    )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_materialized(model, "gs.sharpness")
    return _sharpness(model, loss_fn, batches, space, cfg, t0)


def _sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[tuple[Any, Any]],
    space: ParameterSpace | None,
    cfg: SharpnessSettings,
    t0: float,
) -> SharpnessResult:
    """:func:`sharpness` with its settings checked (``t0``: when the call began)."""
    run: ShardedRun | None = None
    distributed = cfg.distributed
    if is_sharded(model):  # every rank measures every batch, on its own rows of it
        run = prepare(
            model,
            cfg.perturbation,
            kind=cfg.kind,
            rho=cfg.rho,
            space=space,
            distributed=distributed,
        )
        setup, distributed = run.setup, False
    else:
        setup = perturbation_of(model, space, cfg.perturbation, cache=cfg.cache)
    space = setup.space
    theta = [setup.base[n] for n in space.param_names]
    device, dtype = theta[0].device, theta[0].dtype
    case = cfg.case()
    name = cfg.name
    split = BatchSplit(batches, distributed, t0=t0, theta=theta)
    local = list(split.local())
    bar = PassBar(cfg.progress, name, len(local) * case.passes)
    if cfg.geodesic and not space.blocks:
        warnings.warn(
            "the model has no symmetry blocks, so geodesic sharpness is adaptive sharpness "
            "here (every coordinate uses the adaptive geometry); see space.summary()",
            stacklevel=3,
        )
    make = None if run is None else run.objective
    restored = contextlib.nullcontext() if run is None else run.restored()
    with eval_mode(model), split, restored:
        fs = objectives(
            model, loss_fn, setup.pert, local, seed=cfg.seed, device=device, bar=bar, make=make
        )
        values = [case(f, gen) for f, gen in fs]
        counter = {k: sum(v.passes[k] for v in values) for k in ("forward", "backward")}
        per_batch, clean, perturbed, traces = split.gather(
            [v.value for v in values],
            [v.clean for v in values],
            [v.perturbed for v in values],
            [v.trace for v in values if v.trace is not None],
            counter,
        )
        speeds = [k for v in values if (k := getattr(v, "relative_speed", None)) is not None]
        kappa = split.largest(max(speeds) if speeds else None)
    bar.close()
    if not per_batch:
        raise ValueError("batches is empty: pass at least one (inputs, targets) batch")
    settings = cfg.recorded(space)
    settings.update(
        cached_base_point=setup.cached,
        max_relative_speed=kappa,
        n_params=space.numel() if run is None else run.shards.numel,
        dtype=str(dtype),
        device=str(device),
        sharded=None if run is None else run.describe(),
    )
    trouble = exact_steps_warning(f"{name} at rho={cfg.rho:g}", kappa, cfg.exact_steps)
    if trouble is not None:
        warnings.warn(trouble, ExactStepsWarning, stacklevel=3)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        clean_losses=clean,
        perturbed_losses=perturbed,
        measure=name,
        settings=settings,
        time_s=split.elapsed(),
        n_forward=counter["forward"],
        n_backward=counter["backward"],
        excluded=dict(space.excluded),
        traces=traces,
    )
