r"""What the estimators of a model share over its batches (SPEC §2, §6, §9).

Every estimator of :mod:`geosharp.estimators` measures, per batch ``S``, a quantity of the
function of a perturbation

.. code-block:: text

    f_S(ξ) = L_S(θ′(ξ)),

the loss of the model at the endpoint ``θ′(ξ)`` of a
:class:`~geosharp.estimators.perturbation.Perturbation` (``θ′(0) = w``), and averages it over
batches. This module holds what does not depend on the quantity:

- the argument checks (:func:`check_float`, :func:`check_int`);
- the objective ``f_S`` with its pass counts (:class:`Objective`), and its value at ``ξ = 0``
  with the embedding rows the clean forward reaches (:func:`clean_start`);
- the perturbation of a call, with the symmetry search and the factorized geometry reused from
  the cache (:func:`perturbation_of`);
- the batch loop (:func:`objectives`: one objective and one generator seeded by
  ``(seed, batch index)`` per batch) and the progress bars (:func:`batch_progress`,
  :class:`PassBar`).

The per-batch quantities are small functions of an :class:`Objective` and a generator:
:class:`~geosharp.estimators.worst.WorstCase` (``max_{‖ξ‖ ≤ ρ} f_S(ξ) − f_S(0)``),
:class:`~geosharp.estimators.average.AverageCase` (``E_ξ f_S(ξ) − f_S(0)``) and the Hessian
spectrum of ``f_S`` at ``0`` in :mod:`geosharp.estimators.curvature`.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from geosharp.estimators.cache import CACHE
from geosharp.estimators.distributed import batch_seed
from geosharp.estimators.perturbation import Perturbation, PerturbationOptions, RankSums, Xi
from geosharp.estimators.rows import BatchRows
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.verify import call_model, to_device

#: ``loss_fn(model(inputs), targets)`` → scalar tensor.
LossFn = Callable[[Any, Any], Tensor]


def check_float(name: str, value: Any, positive: bool = True) -> float:
    """``value`` as a finite float (``> 0`` when ``positive``).

    Raises:
        TypeError: If ``value`` is not a number (bools are not).
        ValueError: If it is not finite, or not ``> 0`` when ``positive``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value``, an int ``>= minimum`` (bools are not ints here).

    Raises:
        ValueError: Otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _show(enabled: bool | None) -> bool:
    return sys.stderr.isatty() if enabled is None else enabled


def batch_progress(iterable: Iterable, enabled: bool | None, desc: str) -> Iterable:
    """``iterable`` with a progress bar over its items (``None``: when stderr is a terminal)."""
    if not _show(enabled):
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a light optional dependency
        return iterable
    return tqdm(iterable, desc=desc, leave=False)


class PassBar:
    """A progress bar over the model's forward passes, with their total and an ETA.

    Args:
        enabled: Show it (``None``: when stderr is a terminal).
        desc: Its label.
        total: The forward passes expected; a restart that recomputes the best iterate's
            gradient adds one.
    """

    def __init__(self, enabled: bool | None, desc: str, total: int) -> None:
        self.bar = None
        if _show(enabled):
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover
                return
            self.bar = tqdm(total=total, desc=desc, unit="pass", leave=False)

    def update(self) -> None:
        """One forward pass done."""
        if self.bar is not None:
            if self.bar.total is not None and self.bar.n >= self.bar.total:
                self.bar.total += 1  # a restart that recomputes the best iterate's gradient
            self.bar.update(1)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()


class Objective:
    """``f_S(ξ) = L_S(θ′(ξ))`` on one batch ``S``, counting forward and backward passes.

    Called as ``f(ξ, need_grad)``, it is the loss function of
    :func:`~geosharp.estimators.apgd.autopgd`: ``(f_S(ξ), ∇_ξ f_S(ξ) or None)``, with
    ``need_grad`` a bool or a function of the value deciding after the forward.

    Args:
        model: The model (called through :func:`torch.func.functional_call`, never written).
        loss_fn: ``loss_fn(outputs, targets)`` → scalar tensor.
        pert: The perturbation ``ξ ↦ θ′(ξ)``.
        inputs: The batch's inputs, on the model's device.
        targets: The batch's targets, on the model's device.
        batch: Index of the batch (named in errors).
        counter: ``{"forward": n, "backward": m}``, counted up in place (default: a new one,
            the passes of this batch alone).
        bar: A :class:`PassBar` advanced at every forward.
    """

    #: Whether :func:`clean_start` may cut the perturbation to the embedding rows reached.
    row_cut = True

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        pert: Perturbation,
        inputs: Any,
        targets: Any,
        *,
        batch: int = 0,
        counter: dict[str, int] | None = None,
        bar: PassBar | None = None,
    ) -> None:
        self.model, self.loss_fn, self.pert = model, loss_fn, pert
        self.inputs, self.targets, self.batch = inputs, targets, batch
        self.counter = counter if counter is not None else {"forward": 0, "backward": 0}
        self.bar = bar

    def evaluate(self, params: Mapping[str, Tensor]) -> Tensor:
        """``L_S`` at the parameters ``params`` (one forward pass), a 0-dim tensor.

        Raises:
            TypeError: If ``loss_fn`` does not return a scalar tensor.
        """
        return self.counted_loss(call_model(self.model, params, self.inputs))

    def counted_loss(self, out: Any) -> Tensor:
        """``loss_fn(out, targets)`` of one forward's outputs, counted as a forward pass.

        Raises:
            TypeError: If ``loss_fn`` does not return a scalar tensor.
        """
        loss = self.loss_fn(out, self.targets)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                "loss_fn(outputs, targets) must return a scalar tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}"
            )
        self.counter["forward"] += 1
        if self.bar is not None:
            self.bar.update()
        return loss.reshape(())

    def on(self, pert: Perturbation) -> Objective:
        """The same objective for another perturbation of the same parameters.

        The batch, the counter and the bar are shared (e.g. with the perturbation cut to the
        embedding rows reached).
        """
        other = copy.copy(self)
        other.pert = pert
        return other

    def __call__(
        self, xi: Xi, need_grad: bool | Callable[[float], bool], check: bool = True
    ) -> tuple[float, Xi | None]:
        """``(f_S(ξ), its Euclidean gradient w.r.t. ξ or None)``.

        Raises:
            FloatingPointError: With ``check``, if the loss is not finite.
        """
        loss, grad = self.pert.loss_and_grad(self.evaluate, xi, need_grad)
        if grad is not None:
            self.counter["backward"] += 1
        value = float(loss)
        if check and not math.isfinite(value):
            raise nonfinite_loss(self.pert, xi, value)
        return value, grad

    def clean(self, need_grad: bool = False) -> tuple[float, Xi | None]:
        """``f_S(0) = L_S(w)`` and, with ``need_grad``, its Euclidean gradient w.r.t. ``ξ``.

        Evaluated at the model's own parameters: one plain forward (and backward), with no
        endpoint built at ``ξ = 0`` and none of its backward. The gradient w.r.t. ``ξ`` is the
        parameters' gradient laid out as the pieces
        (:meth:`~geosharp.estimators.perturbation.Perturbation.grad_at_zero`); the same numbers
        as the gradient through the endpoint at ``ξ = 0`` when ``pert.pulls_back`` holds.
        """
        named = dict(self.model.named_parameters())
        if not need_grad:
            with torch.no_grad():
                return float(self.evaluate(named)), None
        names = self.pert.space.param_names
        leaves = [named[n].detach().requires_grad_(True) for n in names]
        with torch.enable_grad():
            loss = self.evaluate(dict(zip(names, leaves, strict=True)))
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        self.counter["backward"] += 1
        value = float(loss.detach())
        del loss, leaves
        pairs = zip(grads, names, strict=True)
        grads = [g if g is not None else torch.zeros_like(named[n]) for g, n in pairs]
        return value, self.pert.grad_at_zero(grads)


def clean_start(f: Objective, need_grad: bool) -> tuple[float, Xi | None, BatchRows]:
    """``f_S(0)``, with ``need_grad`` its gradient, and the embedding rows its forward reached.

    The gradient comes from the model's own parameters (:meth:`Objective.clean`) when the
    perturbation pulls it back exactly, through the endpoint at ``ξ = 0`` otherwise. The rows
    are recorded only with ``need_grad`` (an ascent from ``ξ = 0`` moves no other row,
    :class:`~geosharp.estimators.rows.BatchRows`).

    Returns:
        ``(loss, gradient or None, rows)``.

    Raises:
        ValueError: If the clean loss is not finite.
    """
    rows = BatchRows(f.model, f.pert, enabled=need_grad and f.row_cut)
    with rows:
        if need_grad and not f.pert.pulls_back:
            loss, grad = f(f.pert.zeros(), True, False)
        else:
            loss, grad = f.clean(need_grad)
    if not math.isfinite(loss):
        raise ValueError(
            f"the clean loss of batch {f.batch} is {loss}: sharpness is undefined; "
            "check the model, the data and loss_fn"
        )
    return loss, grad, rows


@dataclass
class BatchValue:
    """What a per-batch estimator returns for one batch.

    Attributes:
        clean: ``L_S(w)``.
        perturbed: ``L_S(w′)``: the best loss found (worst case), or the mean over samples.
        trace: The loss at every ascent iterate (worst case), or ``None``.
        passes: ``{"forward": n, "backward": m}`` of this batch.
        relative_speed: The largest relative speed ``κ`` of a head whose geodesic is exact
            RK4, at the best perturbation (worst case) or over the samples (average case)
            (:func:`~geosharp.estimators.worst.exact_relative_speed`); ``None`` without such
            heads.
    """

    clean: float
    perturbed: float
    trace: list[float] | None = None
    passes: dict[str, int] = field(default_factory=dict)
    relative_speed: float | None = None

    @property
    def value(self) -> float:
        """The batch's sharpness, ``perturbed − clean``."""
        return self.perturbed - self.clean


def objectives(
    model: nn.Module,
    loss_fn: LossFn,
    pert: Perturbation,
    indexed: Iterable[tuple[int, Any]],
    *,
    seed: int,
    device: torch.device,
    counter: dict[str, int] | None = None,
    bar: PassBar | None = None,
    make: Callable[..., Objective] | None = None,
) -> Iterator[tuple[Objective, torch.Generator]]:
    """The objective of every batch, with a generator seeded by ``(seed, batch index)``.

    Args:
        model: The model.
        loss_fn: ``loss_fn(outputs, targets)`` → scalar tensor.
        pert: The perturbation.
        indexed: ``(batch index, (inputs, targets))`` pairs, e.g. ``enumerate(batches)`` or
            :meth:`~geosharp.estimators.distributed.BatchSplit.local`.
        seed: The seed; batch ``b`` gets
            :func:`~geosharp.estimators.distributed.batch_seed` ``(seed, b)``, whichever
            process measures it.
        device: Where the data are moved (the model's parameters' device).
        counter: Shared by every objective (default: a new counter per batch).
        bar: A :class:`PassBar` advanced at every forward.
        make: Makes the objective, called as :class:`Objective` is (default
            :class:`Objective`; a sharded model's is
            :meth:`ShardedRun.objective <geosharp.estimators.sharded.run.ShardedRun.objective>`).

    Yields:
        ``(objective, generator)``, one per batch, in order.

    Raises:
        TypeError: If a batch is not an ``(inputs, targets)`` pair.
    """
    for b, batch in indexed:
        gen = torch.Generator(device=device).manual_seed(batch_seed(seed, b))
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"batch {b} must be a pair (inputs, targets)")
        inputs, targets = to_device(batch[0], device), to_device(batch[1], device)
        cls = make or Objective
        f = cls(model, loss_fn, pert, inputs, targets, batch=b, counter=counter, bar=bar)
        yield f, gen


def perturbation_kwargs(measure: str, metric: str, order: int | str, perturb: str) -> dict:
    """The ``measure``, ``metric`` and ``order`` of the :class:`Perturbation` of a measure.

    The attention-only adaptive measure (``perturb="blocks"``) is the blocks' coordinates with
    the element-wise metric along straight lines: ``metric="adaptive"``, ``order=1``.
    """
    if perturb == "blocks" and measure == "adaptive":
        return {"measure": "geodesic", "metric": "adaptive", "order": 1}
    return {"measure": measure, "metric": metric, "order": order}


def nonfinite_loss(pert: Perturbation, xi: Xi, value: float) -> FloatingPointError:
    """The error of a loss that became ``value`` (not finite) at ``ξ``, in one line.

    A block whose endpoint is at fault says why (:meth:`~geosharp.geometry.Geometry.
    endpoint_trouble`: too few RK4 steps of the exact geodesic for how fast it moves, or a
    geodesic that leaves the region where its metric is defined); else the generic advice.
    """
    where = f"the loss became {value} at a perturbation of norm {pert.norm(xi):.3g}"
    for p, x in zip(pert.pieces, xi, strict=True):
        why = p.geometry.endpoint_trouble(x, p.order, pert.exact_steps)
        if why is not None:
            return FloatingPointError(f"{where}: {why}")
    return FloatingPointError(
        f"{where}: the model or its geometry is numerically unstable there; try a smaller rho, "
        "or eps > 0 for near-singular symmetry blocks"
    )


class Setup(NamedTuple):
    """The perturbation of a call (:func:`perturbation_of`)."""

    space: ParameterSpace
    base: dict[str, Tensor]
    pert: Perturbation
    cached: bool  #: the perturbation came from the cache


@dataclass(frozen=True)
class PerturbationSettings:
    """What a call's perturbation is made of, checked by the caller (:func:`perturbation_of`).

    The arguments of :class:`~geosharp.estimators.perturbation.Perturbation` that a call's
    settings give, and ``key_bias`` of the symmetry search.
    """

    measure: str
    metric: str
    order: int | str
    perturb: str
    eps: float
    corrected_norm: bool
    exact_steps: int
    key_bias: str
    low_memory: bool

    @property
    def blocks_needed(self) -> bool:
        """Whether the perturbation moves symmetry blocks (geodesic, or attention-only)."""
        return self.measure == "geodesic" or self.perturb == "blocks"

    def check_blocks(self, space: ParameterSpace) -> None:
        """Refuse ``perturb="blocks"`` on a space with no symmetry blocks (nothing would move)."""
        if self.perturb == "blocks" and not space.blocks:
            raise ValueError(
                "perturb='blocks' but the model has no symmetry blocks: nothing would move"
            )

    def options(self, dtype: torch.dtype) -> PerturbationOptions:
        """The :class:`PerturbationOptions` of a model in ``dtype`` (checked)."""
        return PerturbationOptions(
            eps=self.eps,
            corrected_norm=self.corrected_norm,
            exact_steps=self.exact_steps,
            perturb=self.perturb,
            work_dtype=dtype if self.low_memory else None,
            **perturbation_kwargs(self.measure, self.metric, self.order, self.perturb),
        )

    def perturbation(
        self, space: ParameterSpace, base: Mapping[str, Tensor], ranks: RankSums | None = None
    ) -> Perturbation:
        """The :class:`Perturbation` of ``space`` at ``base``.

        ``ranks``: what one rank of a sharded model gives it
        (:func:`geosharp.estimators.sharded.run.prepare`).
        """
        dtype = base[space.param_names[0]].dtype
        return Perturbation(space, base, self.options(dtype), ranks=ranks)

    def cache_key(self, space: ParameterSpace) -> tuple:
        """The key of this perturbation of ``space`` in :data:`~geosharp.estimators.cache.CACHE`."""
        pert_kw = perturbation_kwargs(self.measure, self.metric, self.order, self.perturb)
        common = (self.eps, self.corrected_norm, self.exact_steps, self.perturb, self.low_memory)
        return (id(space), *common, *pert_kw.items())


def perturbation_of(
    model: nn.Module,
    space: ParameterSpace | None,
    settings: PerturbationSettings | None = None,
    *,
    cache: bool,
    **keywords: Any,
) -> Setup:
    """The parameter space and the perturbation of ``model``, at its own parameters.

    The base point is the model's parameters themselves (detached views, no flat copy of
    ``θ``). With ``cache``, the symmetry search and the perturbation (its block base points and
    factorizations) of an earlier call on the same model with unchanged weights are reused
    (:mod:`geosharp.estimators.cache`). Adaptive and Euclidean measures of the whole model never
    look at the blocks: their space is the parameters alone. A sharded model's perturbation is
    :func:`geosharp.estimators.sharded.run.prepare`'s.

    Args:
        model: The model.
        space: Its parameter space (``None``: found here).
        settings: The perturbation's settings; or pass its fields as ``keywords``.
        cache: Reuse the symmetry search and the perturbation.
        **keywords: The fields of :class:`PerturbationSettings` (``measure=…, metric=…, …``),
            without ``settings``.

    Raises:
        ValueError: If the model has no trainable parameters, or ``perturb="blocks"`` and it
            has no symmetry blocks.
    """
    if settings is None:
        settings = PerturbationSettings(**keywords)
    elif keywords:
        raise TypeError(f"perturbation_of: settings given, and keywords {sorted(keywords)}")
    key_bias = settings.key_bias
    if space is None:

        def find() -> ParameterSpace:
            if settings.blocks_needed:
                return find_symmetries(model, key_bias=key_bias)
            return find_symmetries(model, adapters=[], key_bias=key_bias)

        if cache:
            # both kept: measures alternate
            entry = "space" if settings.blocks_needed else "space-plain"
            space, _ = CACHE.get(entry, model, ("find", key_bias), find)
        else:
            space = find()
    if space.numel() == 0:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    named = dict(model.named_parameters())
    base = {n: named[n].detach() for n in space.param_names}
    settings.check_blocks(space)

    def build() -> Perturbation:
        return settings.perturbation(space, base)

    if not cache:
        return Setup(space, base, build(), False)
    pert, hit = CACHE.get("perturbation", model, settings.cache_key(space), build)
    return Setup(space, base, pert, hit)
