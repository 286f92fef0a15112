"""``gs.sharpness``: adaptive, Euclidean and geodesic sharpness of a model (SPEC §2, §6).

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

import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.apgd import BUFFER_BUDGET, autopgd, best_direction_rule
from geosharp.estimators.cache import CACHE
from geosharp.estimators.distributed import BatchSplit, batch_seed
from geosharp.estimators.perturbation import BLOCK_METRICS, Perturbation, Xi
from geosharp.estimators.rows import BatchRows
from geosharp.symmetry import ParameterSpace, find_symmetries
from geosharp.symmetry.verify import call_model, eval_mode
from geosharp.symmetry.verify import to_device as _to_device

MEASURES = ("geodesic", "adaptive", "euclidean")
KINDS = ("worst", "average")
NORMS = ("l2", "linf")

LossFn = Callable[[Any, Any], Tensor]


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
        settings: Every setting of the call (ρ, steps, metric, order, ε, seed, ...).
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


def measure_name(
    measure: str,
    metric: str,
    order: int | str,
    kind: str,
    norm: str,
    corrected_norm: bool = True,
    perturb: str = "all",
) -> str:
    """Canonical name of a measure, e.g. ``"geodesic-inv-o2 worst l2"``.

    Attention-only measures (``perturb="blocks"``) carry ``-blocks``:
    ``"geodesic-inv-o2-blocks worst l2"``, ``"adaptive-blocks worst l2"``.
    """
    blocks = "-blocks" if perturb == "blocks" else ""
    if measure == "geodesic":
        base = f"geodesic-{metric}-o{order}" + ("" if corrected_norm else "-adaptivenorm")
    else:
        base = measure
    return f"{base}{blocks} {kind} {norm}"


def _check_float(name: str, value: Any, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _progress(iterable: Iterable, enabled: bool | None, desc: str) -> Iterable:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a light optional dependency
        return iterable
    return tqdm(iterable, desc=desc, leave=False)


class _PassBar:
    """A progress bar over the model's forward passes, with their total and an ETA."""

    def __init__(self, enabled: bool | None, desc: str, total: int) -> None:
        self.bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover
                return
            self.bar = tqdm(total=total, desc=desc, unit="pass", leave=False)

    def update(self) -> None:
        if self.bar is not None:
            if self.bar.total is not None and self.bar.n >= self.bar.total:
                self.bar.total += 1  # a restart that recomputes the best iterate's gradient
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Objective:
    """``ξ ↦ L_S(θ′(ξ))`` on one batch, counting forward and backward passes."""

    def __init__(self, model, loss_fn, space, pert, inputs, targets, counter, bar=None):
        self.model, self.loss_fn, self.space, self.pert = model, loss_fn, space, pert
        self.inputs, self.targets, self.counter = inputs, targets, counter
        self.bar = bar

    def evaluate(self, params: Mapping[str, Tensor]) -> Tensor:
        out = call_model(self.model, params, self.inputs)
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

    def on(self, pert: Perturbation) -> _Objective:
        """The same objective for another perturbation of the same parameters (e.g. cut rows)."""
        return _Objective(
            self.model,
            self.loss_fn,
            self.space,
            pert,
            self.inputs,
            self.targets,
            self.counter,
            self.bar,
        )

    def __call__(
        self, xi: Xi, need_grad: bool | Callable[[float], bool], check: bool = True
    ) -> tuple[float, Xi | None]:
        loss, grad = self.pert.loss_and_grad(self.evaluate, xi, need_grad)
        if grad is not None:
            self.counter["backward"] += 1
        value = float(loss)
        if check:
            self._check(value, xi)
        return value, grad

    def _check(self, value: float, xi: Xi) -> None:
        if not math.isfinite(value):
            raise FloatingPointError(
                f"the loss became {value} at a perturbation of norm {self.pert.norm(xi):.3g}: "
                "the model or its geometry is numerically unstable there; try a smaller rho, "
                "or eps > 0 for near-singular symmetry blocks"
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
        exact_steps: RK4 steps for ``order="exact"``.
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
            of float64 (the
            factorizations stay float64; tangents are kept in the model's dtype either way):
            no float64 temporaries, with float32 roundoff in the projection (values agree with
            the default to about 1e-5 relative in float32; exactly in float64). See
            ``benchmarks/README.md``.
        buffer_budget: Parameter-sized buffers a worst-case ascent may hold above a plain
            forward and backward for the rule of ``low_memory`` (1): the best iterate's
            direction is kept always where four ξ-sized buffers and what the perturbation
            holds beside them fit in this many. ``None``: no bound, always kept (the fewest
            passes: geodesic inv on Study 3's MiniLM set-up, 2 batches × 20 steps, runs 42
            forward and 30 backward passes instead of 49 and 37, holding one buffer more).
            The iterates and the value do not depend on it. Ignored with
            ``low_memory=True``.
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
    if measure not in MEASURES:
        raise ValueError(
            f"measure must be one of {MEASURES}, got {measure!r} "
            "(relative flatness: geosharp.relative_flatness)"
        )
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm == "linf" and measure == "geodesic":
        raise ValueError("norm='linf' is defined for measure='adaptive' or 'euclidean' only")
    if perturb not in ("all", "blocks"):
        raise ValueError(f"perturb must be 'all' or 'blocks', got {perturb!r}")
    if perturb == "blocks" and (measure == "euclidean" or norm == "linf"):
        raise ValueError(
            "perturb='blocks' (attention-only) is defined for the geodesic and adaptive ℓ2 measures"
        )
    if measure == "geodesic" and metric not in BLOCK_METRICS:
        raise ValueError(f"metric must be one of {BLOCK_METRICS}, got {metric!r}")
    if isinstance(order, bool) or order not in (1, 2, "exact"):
        raise ValueError(f"order must be one of 1, 2, 'exact', got {order!r}")
    rho = _check_float("rho", rho)
    steps = _check_int("steps", steps)
    samples = _check_int("samples", samples)
    restarts = _check_int("restarts", restarts)
    if buffer_budget is not None:
        buffer_budget = _check_float("buffer_budget", buffer_budget)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")

    hit_pert = False
    if space is None:
        # Adaptive and Euclidean sharpness of the whole model never look at the blocks: their
        # space is the parameters alone (no search, no block positions held).
        blocks_needed = measure == "geodesic" or perturb == "blocks"

        def find() -> ParameterSpace:
            if blocks_needed:
                return find_symmetries(model, key_bias=key_bias)
            return find_symmetries(model, adapters=[], key_bias=key_bias)

        if cache:
            entry = "space" if blocks_needed else "space-plain"  # both kept: measures alternate
            space, _ = CACHE.get(entry, model, ("find", key_bias), find)
        else:
            space = find()
    if space.numel() == 0:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    # The base point is the model's own parameters (detached views): no flat copy of θ₀.
    named = dict(model.named_parameters())
    base = {n: named[n].detach() for n in space.param_names}
    first = base[space.param_names[0]]
    device, dtype = first.device, first.dtype
    if perturb == "blocks":
        if not space.blocks:
            raise ValueError(
                "perturb='blocks' but the model has no symmetry blocks: nothing would move"
            )
        # adaptive sharpness of the blocks alone: their coordinates, element-wise, straight
        pert_kw = (
            {"measure": "geodesic", "metric": "adaptive", "order": 1}
            if measure == "adaptive"
            else {"measure": measure, "metric": metric, "order": order}
        )
    else:
        pert_kw = {"measure": measure, "metric": metric, "order": order}

    def build() -> Perturbation:
        return Perturbation(
            space,
            base,
            work_dtype=dtype if low_memory else None,
            eps=eps,
            corrected_norm=corrected_norm,
            exact_steps=exact_steps,
            perturb=perturb,
            **pert_kw,
        )

    if cache:
        settings_key = (
            id(space),
            eps,
            corrected_norm,
            exact_steps,
            perturb,
            low_memory,
            *pert_kw.items(),
        )
        pert, hit_pert = CACHE.get("perturbation", model, settings_key, build)
    else:
        pert = build()
    counter = {"forward": 0, "backward": 0}
    per_batch, clean, perturbed, traces = [], [], [], []
    name = measure_name(measure, metric, order, kind, norm, corrected_norm, perturb)
    split = BatchSplit(batches, distributed, t0=t0, theta=[base[n] for n in space.param_names])
    local = list(split.local())
    per_batch_passes = (1 + samples) if kind == "average" else (1 + steps * restarts)
    bar = _PassBar(progress, name, len(local) * per_batch_passes)
    if measure == "geodesic" and not space.blocks:
        warnings.warn(
            "the model has no symmetry blocks, so geodesic sharpness is adaptive sharpness "
            "here (every coordinate uses the adaptive geometry); see space.summary()",
            stacklevel=2,
        )
    with eval_mode(model), split:
        for b, batch in local:
            gen = torch.Generator(device=device).manual_seed(batch_seed(seed, b))
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(f"batch {b} must be a pair (inputs, targets)")
            inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
            f = _Objective(model, loss_fn, space, pert, inputs, targets, counter, bar)
            need_grad = kind == "worst" and not random_init
            # the embedding rows the clean forward reaches: the ascent from ξ = 0 moves no other
            rows = BatchRows(model, pert, enabled=need_grad)
            with rows:
                if need_grad and not pert.pulls_back:
                    clean_loss, clean_grad = f(pert.zeros(), True, False)
                else:
                    clean_loss, clean_grad = _clean(f, need_grad)
            if not math.isfinite(clean_loss):
                raise ValueError(
                    f"the clean loss of batch {b} is {clean_loss}: sharpness is undefined; "
                    "check the model, the data and loss_fn"
                )
            if kind == "average":
                rises = []
                for _ in range(samples):
                    value, _ = f(pert.random(gen, rho), False)
                    rises.append(value)
                best = sum(rises) / len(rises)
            else:
                best, trace = -math.inf, []
                for r in range(restarts):
                    if r == 0 and not random_init:
                        # a list, which autopgd empties: no reference to the clean gradient
                        # is held here while it is overwritten by the ascent direction
                        cut, grad0 = rows.restrict(clean_grad)
                        start, clean_grad, grad0 = [clean_loss, grad0], None, None
                        fc = f if cut is pert else f.on(cut)
                        keep = best_direction_rule(cut, low_memory, buffer_budget)
                        res = autopgd(cut, fc, rho, steps, None, norm, start, keep)
                        del cut, fc
                    else:
                        res = autopgd(
                            pert,
                            f,
                            rho,
                            steps,
                            _random_start(pert, gen, rho, norm),
                            norm,
                            keep_best_direction=best_direction_rule(
                                pert, low_memory, buffer_budget
                            ),
                        )
                    if res.best_loss > best:
                        best, trace = res.best_loss, res.trace
                    res = None  # its best iterate would live on through the next ascent
                best = max(best, clean_loss)
                traces.append(trace)
            clean.append(clean_loss)
            perturbed.append(best)
            per_batch.append(best - clean_loss)
        per_batch, clean, perturbed, traces = split.gather(
            per_batch, clean, perturbed, traces, counter
        )
    bar.close()
    if not per_batch:
        raise ValueError("batches is empty: pass at least one (inputs, targets) batch")
    settings = {
        "measure": measure,
        "metric": metric if measure == "geodesic" else None,
        "order": order if measure == "geodesic" else 1,
        "kind": kind,
        "rho": rho,
        "steps": steps if kind == "worst" else None,
        "norm": norm,
        "eps": eps,
        "seed": seed,
        "samples": samples if kind == "average" else None,
        "restarts": restarts if kind == "worst" else None,
        "random_init": random_init,
        "corrected_norm": corrected_norm,
        "perturb": perturb,
        "low_memory": low_memory,
        "buffer_budget": buffer_budget,
        "cached_base_point": hit_pert,
        "exact_steps": exact_steps if order == "exact" else None,
        "n_params": space.numel(),
        "n_gl_blocks": sum(b.heads for b in space.gl_blocks) if measure == "geodesic" else 0,
        "n_key_biases_fixed": sum(b.kind == "b_k" for b in space.blocks)
        if measure == "geodesic" and metric != "adaptive"
        else 0,
        "dtype": str(dtype),
        "device": str(device),
    }
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


def _clean(f: _Objective, need_grad: bool = False) -> tuple[float, Xi | None]:
    """The loss at ``ξ = 0`` and, with ``need_grad``, its Euclidean gradient w.r.t. ``ξ``.

    Evaluated at the model's own parameters: one plain forward (and backward), with no endpoint
    built at ``ξ = 0`` and none of its backward. The gradient w.r.t. ``ξ`` is the parameters'
    gradient laid out as the pieces (:meth:`Perturbation.grad_at_zero`); the same numbers as
    the gradient through the endpoint at ``ξ = 0`` when :attr:`Perturbation.pulls_back` holds.
    """
    named = dict(f.model.named_parameters())
    if not need_grad:
        with torch.no_grad():
            return float(f.evaluate(named)), None
    names = f.pert.space.param_names
    leaves = [named[n].detach().requires_grad_(True) for n in names]
    with torch.enable_grad():
        loss = f.evaluate(dict(zip(names, leaves, strict=True)))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    f.counter["backward"] += 1
    value = float(loss.detach())
    del loss, leaves
    pairs = zip(grads, names, strict=True)
    grads = [g if g is not None else torch.zeros_like(named[n]) for g, n in pairs]
    return value, f.pert.grad_at_zero(grads)


def _random_start(pert: Perturbation, gen: torch.Generator, rho: float, norm: str) -> Xi:
    """A random start: on the sphere of radius ρ (ℓ2, horizontal) or uniform in the box (ℓ∞)."""
    if norm == "linf":
        return pert.uniform_box(gen, rho)
    xi = pert.project(pert.random(gen, 1.0))
    n = pert.norm(xi)
    return [tuple(t * (rho / n) for t in x) for x in xi] if n > 0 else xi
