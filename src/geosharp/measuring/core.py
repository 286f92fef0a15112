"""``gs.measure``: several sharpness measures of one trained model, with a self-check first.

This is the measuring half of ``geosharp measure``; it needs no files. Given a model and a list
of ``(inputs, targets)`` batches it

1. finds the symmetry blocks (:func:`geosharp.find_symmetries`) and explains which coordinates
   use the adaptive geometry and why;
2. runs a self-check a user can trust: the clean loss of every batch must be finite (and, for
   cross-entropy, every label one of the model's classes), and the model's outputs must be
   unchanged under a random re-parametrization of every block found
   (:func:`geosharp.check_invariance`: a wrong adapter is caught instead of being silently
   measured);
3. measures every requested measure at every ρ with :func:`geosharp.sharpness` (Auto-PGD for
   the worst case, SPEC §6), or once with :func:`geosharp.relative_flatness` or
   :func:`geosharp.curvature` (``curvature-inv-lmax``, ``curvature-euclidean-trace``, …: the
   Hessian on the quotient, SPEC §9, no ρ);

and returns a :class:`MeasureReport` that prints as a table and writes JSON, CSV and HTML.

The default plan is the paper's three measures — adaptive ℓ2, geodesic inv and geodesic mix,
worst case, second-order geodesics — at ``ρ ∈ {0.01, 0.1, 1}`` with 20 Auto-PGD steps
(SPEC §6). The paper reports no ρ, and the measures' values scale differently with ρ, so the
default is a grid one decade apart rather than a single radius. It spans the useful range on
the packaged MiniLM (8 sentences, fresh 2-label head, loss 0.69): at ρ = 0.01 the loss rises by
2e-4 (adaptive) to 2e-3 (geodesic), four orders above float32 rounding; at ρ = 1 by 0.03
(adaptive) to 0.5 (geodesic), a large but finite rise.

The checks before the first measurement are :mod:`geosharp.measuring.prepare`'s, the measuring
loop :mod:`geosharp.measuring.cells`'s.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from geosharp.estimators.apgd import BUFFER_BUDGET
from geosharp.estimators.materialized import check_materialized
from geosharp.estimators.sharded.check import is_sharded
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.measures import Measure
from geosharp.measuring.cells import _estimate, _measure_cells
from geosharp.measuring.errors import MeasureError, MeasureWarning
from geosharp.measuring.estimate import RunEstimate, batch_sizes
from geosharp.measuring.flags import reference_loss
from geosharp.measuring.prepare import (
    CheckedModel,
    adaptive_note,
    prepare_measurement,
)
from geosharp.measuring.radii import DEFAULT_RHOS, Radii, default_radii, grid_setting
from geosharp.measuring.results import MeasureReport
from geosharp.measuring.settings import (
    DEFAULT_CURVATURE_ITERS,
    DEFAULT_CURVATURE_PROBES,
    DEFAULT_MEASURES,
    DEFAULT_STEPS,
    MeasureSettings,
)
from geosharp.measuring.sharded import (
    SKIPPED,
    ShardedCheck,
    check_plan,
    check_sharded,
    sharded_reference_loss,
)
from geosharp.symmetry import ParameterSpace

__all__ = [
    "DEFAULT_CURVATURE_ITERS",
    "DEFAULT_CURVATURE_PROBES",
    "DEFAULT_MEASURES",
    "DEFAULT_RHOS",
    "DEFAULT_STEPS",
    "CheckedModel",
    "MeasureSettings",
    "adaptive_note",
    "measure",
    "prepare_measurement",
]


# --------------------------------------------------------------------------------------------
# the measuring function


def measure(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: str | Callable[[Any, Any], Tensor] | None = None,
    *,
    measures: Sequence[str | Measure] = DEFAULT_MEASURES,
    rhos: Sequence[float] | Mapping[str, Sequence[float]] | None = None,
    steps: int = DEFAULT_STEPS,
    eps: float = 0.0,
    seed: int = 0,
    iters: int = DEFAULT_CURVATURE_ITERS,
    probes: int = DEFAULT_CURVATURE_PROBES,
    trace_method: str = "hutchinson",
    check: bool = True,
    space: ParameterSpace | None = None,
    low_memory: bool = False,
    buffer_budget: float | None = BUFFER_BUDGET,
    exact_steps: int = DEFAULT_RK4_STEPS,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> MeasureReport:
    """Measure the sharpness of ``model`` under several measures and radii, self-check first.

    Steps: find the symmetry blocks; check that a random re-parametrization of them leaves the
    outputs unchanged and that the clean loss of every batch is finite (cross-entropy: labels
    within the model's classes); then every measure at every ρ, smallest first (relative
    flatness and the curvature measures once: :func:`geosharp.curvature` with one quantity
    each). A worst-case batch keeps the better point of a smaller ball (the balls are nested,
    so the values never fall as ρ grows), and every row carries its ``flags`` — ``rising``,
    ``unstable``, ``saturated`` — when its value cannot be trusted as it is
    (:mod:`geosharp.measuring.flags`; one warning line each). A
    measurement that fails (e.g. the loss becomes infinite inside a large ball) is recorded
    with its error and the others go on. The model's weights are not written to; if some
    weights are so small that ``1/w²`` overflows (:func:`unrepresentable_weights`), a copy with
    them set to 0 is measured and a warning says so.

    A model sharded by FSDP2 (every trainable parameter a sharded ``DTensor``; call it on every
    rank with the rank's rows of every batch) is measured with every sharpness measure
    (adaptive, Euclidean, geodesic and attention-only; worst and average case) and every
    curvature measure, every rank getting the same report; what a measure refuses sharded
    (relative flatness, the trace with ``trace_method="exact"``) is refused in one line before
    any work, and the proof of
    the symmetry blocks on data, the self-check and the time estimate are skipped, with the
    reason in ``settings["sharded"]["skipped"]`` (:mod:`geosharp.measuring.sharded`,
    ``docs/cluster.md``).

    Args:
        model: Any ``nn.Module``, on the device and in the dtype to measure in.
        batches: ``(inputs, targets)`` pairs (iterated once and kept: every measure uses the
            same batches); ``inputs`` may be a tensor, a tuple or a dict of keyword arguments.
        loss_fn: ``None``/``"auto"`` (:func:`default_loss`), ``"ce"``, ``"mse"`` or a callable
            ``loss_fn(outputs, targets)`` → scalar.
        measures: Measure objects, or texts :func:`geosharp.measures.parse_measure` reads
            (default: adaptive ℓ2, geodesic inv and geodesic mix, worst case, order 2).
        rhos: Radii: one grid for every measure, or measure → its grid (every measure with
            ρ named); ``None`` (default): ``0.01, 0.1, 1``, and for a measure whose ball is
            head-scaled (geodesic mix) that grid times the model's head scale, so that its
            heads move as far as inv's (:mod:`geosharp.measuring.radii`; the choice is said
            through ``log``). Every measure runs its radii smallest first.
        steps: Auto-PGD iterations per batch (worst case).
        eps: Damping ε of the Gram matrices ``GᵀG + εI`` of the GL(h) blocks (0: exactly
            invariant; raise it only if a block is reported singular).
        seed: Seed of the invariance check, of random starts / samples and of the curvature
            measures' Lanczos starts and trace probes.
        iters: Most Lanczos iterations per batch of a curvature λ measure.
        probes: Hutchinson probes per batch of a curvature trace.
        trace_method: ``"hutchinson"``, ``"hutch++"`` or ``"exact"`` (curvature trace).
        check: Run the invariance self-check and refuse to measure if it fails.
        space: Precomputed :func:`geosharp.find_symmetries` result.
        low_memory: Pass ``low_memory=True`` to :func:`geosharp.sharpness` (one
            parameter-sized buffer fewer, a few extra passes, float32 block geometry).
        buffer_budget: :func:`geosharp.sharpness`'s ``buffer_budget`` (``None``: the best
            iterate's direction kept always, the fewest passes).
        exact_steps: RK4 steps of the exact geodesic (``-exact`` measures); a head that moves
            ``κ`` times its size needs about ``2κ`` (a loss that becomes NaN says how many).
        progress: Progress bars (default: when stderr is a terminal).
        log: Called with each informational message (summary, check) as it happens.
        warn: Called with each warning (default: :func:`warnings.warn` with
            :class:`MeasureWarning`).

    Returns:
        A :class:`MeasureReport`.

    Raises:
        MeasureError: On no batches, a bad measure or ρ, a non-finite clean loss, labels outside
            the model's classes, a model or loss that fails on the data, a failed invariance
            check, or a measure a sharded model cannot be measured with (the message explains
            what to do).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import geosharp as gs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(2)]
        >>> rep = gs.measure(model, batches, measures=["adaptive", "euclidean"], rhos=[0.1],
        ...                  steps=5)
        >>> [r.measure for r in rep.rows], rep.row("adaptive", 0.1).value > 0
        (['adaptive worst l2', 'euclidean worst l2'], True)
    """
    t_start = time.perf_counter()
    sharded = isinstance(model, nn.Module) and is_sharded(model)
    say = log or (lambda _msg: None)
    notes: list[str] = []
    _warn = _warner(notes, warn)

    _check_model(model)
    cfg = MeasureSettings(
        measures=measures,
        rhos=rhos,
        steps=steps,
        eps=eps,
        seed=seed,
        iters=iters,
        probes=probes,
        trace_method=trace_method,
        check=check,
        low_memory=low_memory,
        buffer_budget=buffer_budget,
        exact_steps=exact_steps,
        progress=progress,
    )
    specs = cfg.specs
    if sharded:
        check_plan(specs, space, cfg.curvature)  # what a sharded model supports (the measures say)
    ready: CheckedModel | ShardedCheck
    if sharded:
        ready = check_sharded(model, batches, loss_fn, specs, say)
    else:
        ready = prepare_measurement(
            model, batches, loss_fn, space=space, check=check, seed=seed, say=say, warn=_warn
        )
    model, batches, loss_fn, space = ready.model, ready.batches, ready.loss_fn, ready.space
    grids, estimate = _radii_and_estimate(cfg, ready, say)
    reference = _reference_loss(ready)
    rows = _measure_cells(
        model, loss_fn, batches, cfg, grids, space=space, say=say, warn=_warn, reference=reference
    )
    settings = _recorded_settings(cfg, ready, grids, reference, estimate)
    return MeasureReport(
        rows=rows,
        symmetry_summary=ready.summary,
        adaptive_note=ready.adaptive_note,
        invariance=ready.invariance,
        clean_losses=ready.clean_losses,
        n_batches=len(batches),
        n_samples=ready.n_samples if isinstance(ready, ShardedCheck) else _n_samples(batches),
        settings=settings,
        warnings=notes,
        time_s=time.perf_counter() - t_start,
    )


# --------------------------------------------------------------------------------------------
# the steps of measure()


def _warner(notes: list[str], warn: Callable[[str], None] | None) -> Callable[..., None]:
    """What :func:`measure` warns through: noted in ``notes``, then ``warn`` or a warning.

    The warning's ``stacklevel`` counts from the returned function's frame (3: the caller of
    the function that warns).
    """

    def _warn(msg: str, stacklevel: int = 3) -> None:
        notes.append(msg)
        if warn is not None:
            warn(msg)
        else:
            warnings.warn(msg, MeasureWarning, stacklevel=stacklevel)

    return _warn


def _radii_and_estimate(
    cfg: MeasureSettings, ready: CheckedModel | ShardedCheck, say: Callable[[str], None]
) -> tuple[Radii, RunEstimate | None]:
    """Every measure's radii and the run's time estimate.

    The default radii are chosen on the checked model and said; a sharded model has no
    estimate (``None``, and why is said).
    """
    grids = cfg.grids
    if grids is None:
        grids, lines = default_radii(cfg.specs, ready.model, ready.space)
        for line in lines:
            say(line)
    estimate = None
    if isinstance(ready, ShardedCheck):
        say(f"time estimate: {SKIPPED['time_estimate']}")
    else:
        estimate = _estimate(
            ready.model, ready.loss_fn, ready.batches, cfg, grids, space=ready.space, say=say
        )
    return grids, estimate


def _reference_loss(ready: CheckedModel | ShardedCheck) -> float | None:
    """The loss the flags compare a rise with.

    :func:`~geosharp.measuring.flags.reference_loss`; a sharded model's over every rank.
    """
    if isinstance(ready, ShardedCheck):
        return sharded_reference_loss(ready.model, ready.loss_fn, ready.batches, ready.shards)
    return reference_loss(ready.model, ready.loss_fn, ready.batches)


def _recorded_settings(
    cfg: MeasureSettings,
    ready: CheckedModel | ShardedCheck,
    grids: Radii,
    reference: float | None,
    estimate: RunEstimate | None,
) -> dict[str, Any]:
    """The settings a report records, in their order: the call's, then the model's."""
    specs, batches = cfg.specs, ready.batches
    return {
        "measures": [s.name for s in specs],
        "rhos": grid_setting(grids),
        "steps": cfg.steps,
        "eps": cfg.eps,
        "seed": cfg.seed,
        "loss": ready.loss_name,
        "reference_loss": reference,
        "check": cfg.check,
        **({"low_memory": True} if cfg.low_memory else {}),
        **({"buffer_budget": cfg.buffer_budget} if cfg.buffer_budget != BUFFER_BUDGET else {}),
        **({"exact_steps": cfg.exact_steps} if any(s.exact_geodesic for s in specs) else {}),
        **({"curvature": cfg.curvature} if cfg.takes_curvature_settings else {}),
        **(batch_sizes(batches) if not isinstance(ready, ShardedCheck) else {}),
        **(
            {"estimated_time_s": estimate.seconds, "one_pass_s": estimate.pass_s}
            if estimate is not None
            else {}
        ),
        **(
            ready.settings()
            if isinstance(ready, ShardedCheck)
            else _model_settings(ready.model, ready.space)
        ),
    }


def _check_model(model: Any) -> None:
    """Raise unless ``model`` is a materialized ``nn.Module`` with parameters."""
    if not isinstance(model, nn.Module):
        raise MeasureError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise MeasureError("the model has no parameters: there is nothing to perturb")
    check_materialized(model, "gs.measure")


def _model_settings(model: nn.Module, space: ParameterSpace) -> dict[str, Any]:
    """The model's size, symmetry counts, device and dtype, as the report's settings hold them."""
    first = next(iter(model.parameters()))
    return {
        "n_params": space.numel(),
        "n_gl_heads": sum(b.heads for b in space.gl_blocks),
        "n_diagonal_pairs": len(space.diagonal_pairs),
        "n_symmetry_blocks": len(space.blocks),
        "n_group_factors": space.n_group_factors,
        "symmetry_groups": sorted({type(b).family for b in space.blocks}),
        "device": str(first.device),
        "dtype": str(first.dtype).replace("torch.", ""),
    }


def _n_samples(batches: Sequence[tuple[Any, Any]]) -> int | None:
    total = 0
    for _, targets in batches:
        if not isinstance(targets, Tensor) or targets.dim() == 0:
            return None
        total += targets.shape[0]
    return total
