"""The measuring loop of :func:`geosharp.measure`: every (measure, ρ) cell of a checked model.

* :func:`_measure_one` — one cell: ``spec.run`` at one ρ (or none), a failure kept as the
  row's error;
* :func:`_measure_cells` — every measure at every ρ, smallest ρ first, with the row warnings, a
  log line per cell and a progress bar; a worst-case cell keeps the better points of the
  smaller balls (:func:`~geosharp.measuring.flags.nest`) and every cell gets its flags
  (:func:`~geosharp.measuring.flags.cell_flags`);
* :func:`_estimate` — the run's estimated time, from one cell on one batch per measure
  (:func:`geosharp.measuring.estimate.estimate_run`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from geosharp.estimators.sharded.check import is_sharded
from geosharp.estimators.worst import ExactStepsWarning
from geosharp.measures import Measure
from geosharp.measuring.checks import loss_eps, row_warnings
from geosharp.measuring.estimate import RunEstimate, estimate_run
from geosharp.measuring.flags import cell_flags, nest
from geosharp.measuring.results import MeasureRow, _g, _time
from geosharp.measuring.settings import MeasureSettings
from geosharp.symmetry import ParameterSpace

__all__: list[str] = []


def _estimate(
    model: nn.Module,
    loss_fn: Callable,
    batches: list,
    cfg: MeasureSettings,
    rhos: Mapping[str, list[float]],
    *,
    space: ParameterSpace | None,
    say: Callable[[str], None],
) -> RunEstimate | None:
    """Say the run's estimated time, and on a long CPU run what each option would cut it to.

    Returns:
        The :class:`~geosharp.measuring.estimate.RunEstimate`; ``None`` if the pass failed.
    """

    def probe(spec: Measure, k: int) -> float:
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # the real cells will say what the ascent has to say
            warnings.simplefilter("ignore")
            _measure_one(
                model=model,
                loss_fn=loss_fn,
                batches=batches[:1],
                spec=spec,
                rho=rhos[spec.name][0] if spec.uses_rho else None,
                run=cfg.run_kwargs(space, steps=k, progress=False),
            )
        return time.perf_counter() - t0

    try:
        est = estimate_run(
            model,
            loss_fn,
            batches,
            specs=cfg.specs,
            rhos=rhos,
            steps=cfg.steps,
            curv=cfg.curvature,
            probe=probe,
        )
    except Exception as err:  # the measures will say what fails; an estimate is no reason to stop
        say(f"time estimate: not available ({type(err).__name__}: {err})")
        return None
    say(est.line())
    for line in est.advice():
        say(line)
    return est


def _measure_cells(
    model: nn.Module,
    loss_fn: Callable,
    batches: list,
    cfg: MeasureSettings,
    rhos: Mapping[str, list[float]],
    *,
    space: ParameterSpace | None,
    say: Callable[[str], None],
    warn: Callable[..., None],
    reference: float | None = None,
) -> list[MeasureRow]:
    """Every measure at every ρ (once without ρ), warning and logging as it goes.

    ``cfg``: the run's settings. ``rhos``: measure name → its radii. The radii of a measure run
    smallest first, so that a worst-case cell can keep the better point of a smaller ball
    (:func:`checked_row`). ``reference``: the trivial predictor's loss on the batches
    (:func:`~geosharp.measuring.flags.reference_loss`), for the ``saturated`` flag.
    """
    specs, steps = cfg.specs, cfg.steps
    run = cfg.run_kwargs(space)
    n_cells = sum(len(rhos[s.name]) if s.uses_rho else 1 for s in specs)
    say(f"measuring {n_cells} (measure, rho) cell(s) on {len(batches)} batch(es) ...")
    rows: list[MeasureRow] = []
    eps_loss = loss_eps(model)
    bar = _progress(n_cells, bool(cfg.progress), "measures")
    try:
        for spec in specs:
            smaller: list[float] | None = None  # the nested per-batch values of the last ρ
            for rho in sorted(rhos[spec.name]) if spec.uses_rho else [None]:
                if bar is not None:
                    bar.set_postfix_str(f"{spec.name} rho={_g(rho)}")
                row = _measure_one(
                    model=model, loss_fn=loss_fn, batches=batches, spec=spec, rho=rho, run=run
                )
                row = checked_row(row, spec, smaller, eps_loss, reference)
                if spec.nested_in_rho and row.error is None:
                    smaller = row.per_batch
                rows.append(row)
                for msg in row_warnings(row, spec, steps, eps_loss, cfg.exact_steps):
                    warn(msg, stacklevel=4)
                done = len(rows)
                left = sum(r.time_s for r in rows) / done * (n_cells - done)
                say(
                    f"  [{done}/{n_cells}] {row.measure}, rho={_g(row.rho)}: "
                    + ("failed" if row.value is None else f"{row.value:.5g}")
                    + (f" [{' '.join(row.flags)}]" if row.flags else "")
                    + f" in {_time(row.time_s)}"
                    + (f"; ≈ {_time(left)} left" if done < n_cells else "")
                )
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _measure_one(
    model: nn.Module,
    loss_fn: Callable,
    batches: list,
    spec: Measure,
    rho: float | None,
    run: Mapping[str, Any],
) -> MeasureRow:
    """One cell: ``spec.run`` at ``rho``, a failure kept as the row's error.

    ``run``: the settings it runs with (:meth:`MeasureSettings.run_kwargs`). A failure that
    may be this rank's alone (:func:`this_rank_alone`) is raised instead.
    """
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # row_warnings says it, through the report's warn
            warnings.simplefilter("ignore", ExactStepsWarning)
            res = spec.run(model, loss_fn, batches, rho=rho if spec.uses_rho else None, **run)
    except (ValueError, FloatingPointError, RuntimeError, torch.linalg.LinAlgError) as err:
        if this_rank_alone(err, model):
            raise
        return MeasureRow(
            measure=spec.name, rho=rho, value=None, time_s=time.perf_counter() - t0, error=str(err)
        )
    return MeasureRow.of(spec, res, rho)


def checked_row(
    row: MeasureRow,
    spec: Measure,
    smaller: Sequence[float] | None,
    eps: float,
    reference: float | None,
) -> MeasureRow:
    """``row`` nested over the smaller balls (a worst-case measure) and flagged.

    Args:
        row: The cell as measured.
        spec: Its measure.
        smaller: The nested per-batch values of the same measure at the next smaller ρ on the
            same batches (``None``: none).
        eps: Machine epsilon of the loss's dtype.
        reference: The trivial predictor's loss (``None``: not known).
    """
    if row.error is not None:
        return row
    carried = 0
    if spec.nested_in_rho and smaller is not None:
        per_batch, carried = nest(smaller, row.per_batch, eps)
        if per_batch != row.per_batch:
            perturbed = [c + v for c, v in zip(row.clean_losses, per_batch, strict=True)]
            row = dataclasses.replace(
                row,
                per_batch=per_batch,
                value=sum(per_batch) / len(per_batch),
                perturbed_losses=perturbed if row.perturbed_losses else [],
            )
    check = cell_flags(
        row.traces,
        row.clean_losses,
        row.perturbed_losses if spec.uses_rho else [],
        loss_eps=eps,
        reference=reference,
        carried=carried,
    )
    return dataclasses.replace(
        row, flags=check.flags, instability=check.instability, carried=check.carried
    )


def this_rank_alone(err: Exception, model: nn.Module) -> bool:
    """Whether a sharded model's failed cell may have failed on this rank alone.

    Then it cannot be kept as a failed row: the other ranks may be waiting inside one of the
    cell's collectives, and this rank's next cell would pair its collectives with theirs. Out
    of memory, and errors of the collectives themselves, are such (``RuntimeError``s); a bad
    argument (``ValueError``), a loss that is not finite (the mean over the ranks) and a
    factorization of the ``h × h`` matrices summed over the ranks (``LinAlgError``) happen on
    every rank alike. The error then ends the run on this rank, whose exit ends the
    collectives the others wait in.
    """
    if not isinstance(err, RuntimeError) or isinstance(err, torch.linalg.LinAlgError):
        return False
    return is_sharded(model)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, leave=False)
