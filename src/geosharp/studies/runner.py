"""The study pipeline shared by every study: population → sharpness → correlation → report.

A :class:`Study` says what its population is, how to train (or load) a model, on which batches
and with which loss sharpness is measured, and its measurement plan (measures × ρ). The
:func:`run_study` loop is the same for all studies and is resumable at the granularity of one
model (training) and one measurement row: the store records every finished row atomically, so a
killed run restarts where it stopped and never recomputes or loses a finished row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp._version import __version__
from geosharp.estimators.sharded.check import is_sharded
from geosharp.measures import Measure, from_kwargs
from geosharp.measures.base import Outcome
from geosharp.measuring.cells import checked_row, this_rank_alone
from geosharp.measuring.checks import loss_eps
from geosharp.measuring.flags import reference_loss
from geosharp.measuring.results import MeasureRow
from geosharp.studies.report import ReportPaths
from geosharp.studies.shards import Shard, settle_shard
from geosharp.studies.store import Store, report_info
from geosharp.studies.study_report import make_report


@dataclass(frozen=True)
class StudyMeasure:
    """One measure of a plan, evaluated at every ρ of ``rhos``, with the study's settings.

    Attributes:
        kwargs: The measure's identifying keyword arguments (``{"measure": "adaptive"}``,
            ``{"measure": "curvature", "of": "geodesic", "quantity": "trace"}``,
            ``{"measure": "relative_flatness", "layer": ...}``; read by
            :func:`geosharp.measures.from_kwargs`) and the run's settings (steps, samples, ε,
            …), as the study's store records them.
        rhos: Radii (worst case) or standard deviations (average case); ``(None,)`` for
            measures without ρ.
    """

    kwargs: dict[str, Any]
    rhos: tuple[float | None, ...]

    @property
    def measure(self) -> Measure:
        """The :class:`~geosharp.measures.Measure` of :attr:`kwargs`."""
        return from_kwargs(self.kwargs)

    @property
    def name(self) -> str:
        """Canonical measure name, e.g. ``"geodesic-inv-o2 worst l2"``."""
        return self.measure.name


@dataclass
class Prepared:
    """A model ready to measure (:meth:`Study.prepare`).

    Attributes:
        model: The model.
        batches: The batches it is measured on.
        loss_fn: ``loss_fn(outputs, targets)``.
        settings: Further run settings of its measures (e.g. ``{"space": …}``), not recorded
            as part of a measurement's identity.
        clean_losses: The clean loss of every batch, where the check computed them.
        reference: The trivial predictor's loss on the batches
            (:func:`geosharp.measuring.flags.reference_loss`), where ``judged``.
        judged: Whether :attr:`reference` was computed (``None`` then means: no reference).
    """

    model: nn.Module
    batches: list[tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    settings: dict[str, Any] = field(default_factory=dict)
    clean_losses: list[float] | None = None
    reference: float | None = None
    judged: bool = False


class Study(ABC):
    """What a study is made of; see :func:`run_study` for what is done with it."""

    #: Short name (the CLI's ``geosharp study NAME``), recorded in the store.
    name: str = "study"
    #: Title of the report.
    title: str = "Study"
    #: Label of the generalization gap in the report.
    gap_label: str = "generalization gap"
    #: The paper's τ per measure family (SPEC §7), or ``None``.
    paper: dict[str, float] | None = None
    #: The sign of τ the user expects (``"positive"``: sharper models generalize worse, or
    #: ``"negative"``), stated before measuring; the paired verdict's direction when there is
    #: no paper τ (:func:`~geosharp.studies.analysis.paired_verdict`). ``None``: from the data.
    expected: str | None = None
    #: How geodesic measures treat attention key biases (``find_symmetries(key_bias=…)``).
    #: ``"keep"`` (key biases are rows of ``H_QK``) is the setting Studies 1–3 were measured
    #: with, so their committed results reproduce; a study that quotients them out says so
    #: here and records it in its :meth:`config`.
    key_bias: str = "keep"

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Everything that defines the study's results (recorded; a mismatch is refused)."""

    @abstractmethod
    def population(self) -> list[tuple[str, dict[str, Any]]]:
        """``(model_id, hyperparameters)`` of every model, in a fixed order."""

    @abstractmethod
    def train(
        self,
        todo: list[tuple[str, dict[str, Any]]],
        out_dir: Path,
        store: Store,
        progress: bool,
    ) -> None:
        """Train the models of ``todo`` and record each with :meth:`Store.put_model`."""

    @abstractmethod
    def load(self, row: dict[str, Any]) -> nn.Module:
        """The model of a store row, ready for measuring.

        ``row["checkpoint_path"]`` is the absolute path of the row's checkpoint.
        """

    @abstractmethod
    def batches(self) -> list[tuple[Any, Any]]:
        """The fixed training batches sharpness is measured on."""

    @abstractmethod
    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """The loss sharpness is measured with (a scalar)."""

    @abstractmethod
    def plan(self) -> list[StudyMeasure]:
        """Measures × ρ, fixed before looking at any τ."""

    def prepare(self, row: dict[str, Any], batches: list[tuple[Any, Any]]) -> Prepared:
        """The model of a store row, ready to measure, with its batches and loss.

        Default: :meth:`load` with the study's shared ``batches`` (:meth:`batches`) and
        :meth:`loss_fn`. A population whose models need batches of their own (a tokenizer per
        model) or settings of their own (a symmetry space proven on data) overrides it.
        """
        return Prepared(self.load(row), batches, self.loss_fn)

    def settings(self) -> dict[str, Any]:
        """Human-readable settings for the report (default: the config)."""
        return self.config()

    def notes(self) -> list[str]:
        """Remarks shown at the end of the report (recorded in the store with the settings)."""
        return []

    def train_line(self, todo: int, total: int) -> str:
        """What the log says before :meth:`train` records ``todo`` of ``total`` models."""
        return f"training {todo} of {total} models ({total - todo} reused)"

    def included(self, row: dict[str, Any]) -> bool:
        """Whether a trained model enters the correlation analysis (default: all)."""
        return True


def _progress(iterable: Any, enabled: bool, desc: str, total: int | None = None) -> Any:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total)


@dataclass
class RunSummary:
    """What :func:`run_study` did."""

    out_dir: Path
    trained: int = 0
    measured: int = 0
    reused: int = 0
    report: ReportPaths | None = None
    time_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    shard: Shard | None = None


def run_study(
    study: Study,
    out_dir: str | Path,
    *,
    force: bool = False,
    progress: bool | None = None,
    shard: Shard | None = None,
    report: bool = True,
    log: Callable[[str], None] | None = None,
) -> RunSummary:
    """Train (or reuse) the population, measure every model, analyse and report.

    Args:
        study: The study.
        out_dir: Output folder (holds ``study.sqlite``, checkpoints, ``results.csv`` and the
            report).
        force: Reuse a folder that records a different configuration.
        progress: Progress bars (default: when stderr is a terminal).
        shard: Only train and measure this shard of the population.
        report: Write ``results.csv`` and the report at the end.
        log: Where to print one-line status messages (default: stderr).

    Returns:
        A :class:`RunSummary`.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    progress = sys.stderr.isatty() if progress is None else progress
    say = log or (lambda msg: print(msg, file=sys.stderr))
    summary = RunSummary(out)
    with Store(out / "study.sqlite", study.name, study.config(), force=force) as store:
        _record_report_meta(store, study)
        population = study.population()
        shard = settle_shard(store, shard, force=force, say=say)
        summary.shard = shard
        mine = shard.take(population) if shard else population
        if shard is not None:
            say(f"shard {shard.text()}: {len(mine)} of the {len(population)} models")
        todo = [(mid, hp) for mid, hp in mine if store.get_model(mid) is None]
        if todo:
            say(study.train_line(len(todo), len(mine)))
            study.train(todo, out, store, progress)
            summary.trained = len(todo)
        batches = study.batches()
        jobs = []
        for mid, _ in mine:
            row = store.get_model(mid)
            if row is None or not study.included(row):
                continue
            if row.get("checkpoint"):
                row["checkpoint_path"] = str(out / row["checkpoint"])
            for spec in study.plan():
                for rho in sorted(spec.rhos, key=_rho_order):  # smallest ball first: nested
                    jobs.append((row, spec, rho))
        say(f"measuring {len(jobs)} (model, measure, rho) rows")
        loaded: dict[str, Prepared] = {}
        flagged: Counter[str] = Counter()  # flagged cells, and each flag
        for row, spec, rho in _progress(jobs, progress, "sharpness"):
            settings = {**spec.kwargs, "rho": rho}
            measure = spec.measure
            if _has_row(store, row["model_id"], measure.name, rho, settings):
                summary.reused += 1
                continue
            if row["model_id"] not in loaded:
                loaded.clear()
                loaded[row["model_id"]] = study.prepare(row, batches)
                judge = CellJudge.of(loaded[row["model_id"]])
                _record_orbit(store, study, row["model_id"], loaded[row["model_id"]], say)
            ready = loaded[row["model_id"]]
            run_settings = {"progress": False, "key_bias": study.key_bias, **ready.settings}
            try:
                result = measure.run(
                    ready.model,
                    ready.loss_fn,
                    ready.batches,
                    rho=rho,
                    **{**spec.kwargs, **run_settings},
                )
                smaller = store.nested_below(row["model_id"], measure.name, rho, settings)
                outcome, checks = judge(measure, result, rho, smaller)
                result = None
            except (FloatingPointError, ValueError, RuntimeError) as err:
                if this_rank_alone(err, ready.model):  # a sharded model: the others may wait
                    raise
                # Recorded as a failed row (value NULL, the error in its settings): the report
                # lists it, and a rerun does not repeat a deterministic failure.
                msg = f"{row['model_id']} {spec.name} rho={rho}: {type(err).__name__}: {err}"
                summary.failures.append(msg)
                say(f"measurement failed: {msg}")
                store.put_measurement(
                    row["model_id"],
                    spec.name,
                    rho,
                    settings,
                    float("nan"),
                    [],
                    error=f"{type(err).__name__}: {err}",
                )
                continue
            flagged.update(checks.get("flags", ()))
            flagged["cells"] += bool(checks.get("flags"))
            store.put_measurement(
                row["model_id"],
                spec.name,
                rho,
                {**settings, **outcome.stats, **checks},
                outcome.value,
                outcome.per_batch,
                clean_losses=outcome.clean_losses,
                time_s=outcome.time_s,
                seed=spec.kwargs.get("seed", 0),
            )
            summary.measured += 1
        if flagged["cells"]:  # one line, not one per cell: the report lists them
            kinds = ", ".join(f"{k} {n}" for k, n in flagged.items() if k != "cells")
            say(
                f"flagged: {flagged['cells']} of the {summary.measured} cells measured now "
                f"({kinds}): the report's Flagged cells table gives τ without them"
            )
        _record_missing_orbits(store, study, [r for r, _, _ in jobs], loaded, say)
        if report:
            store.export_csv(out / "results.csv")
            summary.report = make_report(out, store)
    summary.time_s = time.perf_counter() - t0
    return summary


def _record_orbit(
    store: Store, study: Study, model_id: str, ready: Prepared, say: Callable[[str], None]
) -> None:
    """Store the orbit position of every head of a loaded model, once (issue 44).

    A model sharded by FSDP2 is skipped (its weights are not all on this rank); a model the
    diagnostics cannot read is said and skipped: the spread is a report's extra, never a
    reason to stop measuring.
    """
    if model_id in _orbit_done(store) or is_sharded(ready.model):
        return
    from geosharp.studies.orbit_spread import head_rows

    try:
        rows = head_rows(
            ready.model,
            model_id=model_id,
            key_bias=study.key_bias,
            space=ready.settings.get("space"),
        )
    except (ValueError, RuntimeError, TypeError) as err:
        say(f"orbit position of {model_id} not recorded: {type(err).__name__}: {err}")
        return
    store.put_orbit(model_id, rows)


def _orbit_done(store: Store) -> set[str]:
    return set(store.orbit_rows())


def _record_missing_orbits(
    store: Store,
    study: Study,
    rows: list[dict[str, Any]],
    loaded: dict[str, Prepared],
    say: Callable[[str], None],
) -> None:
    """The orbit position of the models whose rows were all reused (a resumed study)."""
    done = _orbit_done(store)
    seen: set[str] = set()
    for row in rows:
        mid = row["model_id"]
        if mid in done or mid in seen:
            continue
        seen.add(mid)
        ready = loaded.get(mid)
        if ready is None:
            try:
                ready = Prepared(study.load(row), [], study.loss_fn)
            except (OSError, ValueError, RuntimeError, KeyError) as err:
                say(f"orbit position of {mid} not recorded: {type(err).__name__}: {err}")
                continue
        _record_orbit(store, study, mid, ready, say)


def _rho_order(rho: float | None) -> tuple[int, float]:
    return (0, 0.0) if rho is None else (1, float(rho))


@dataclass
class CellJudge:
    """Nests and flags a study's cells of one model as ``gs.measure`` does its rows.

    ``judge(measure, result, rho, smaller)`` gives the outcome to store (a worst-case value
    nested over the smaller balls: :func:`geosharp.measuring.flags.nest`) and the checks to
    record with it (``flags``, ``instability``, ``carried``:
    :func:`geosharp.measuring.cells.checked_row`).

    Attributes:
        eps: Machine epsilon of the model's loss.
        reference: The trivial predictor's loss on the model's batches (``None``: a model
            sharded by FSDP2, or a loss that does not take a tensor of predictions).
    """

    eps: float
    reference: float | None

    @classmethod
    def of(cls, ready: Prepared) -> CellJudge:
        """The judge of a loaded model: one forward per batch for the reference loss."""
        model = ready.model
        if ready.judged:
            return cls(loss_eps(model), ready.reference)
        sharded = is_sharded(model)
        ref = None if sharded else reference_loss(model, ready.loss_fn, ready.batches)
        return cls(loss_eps(model), ref)

    def __call__(
        self, measure: Measure, result: Any, rho: float | None, smaller: list[float] | None
    ) -> tuple[Outcome, dict[str, Any]]:
        """The outcome to store and the checks to record of one measured cell."""
        outcome = measure.outcome(result)
        row = checked_row(MeasureRow.of(measure, result, rho), measure, smaller, self.eps,
                          self.reference)  # fmt: skip
        if row.per_batch != outcome.per_batch and row.value is not None:
            outcome = dataclasses.replace(outcome, value=row.value, per_batch=row.per_batch)
        if not measure.uses_rho:  # no ball, no ascent: nothing to flag (a curvature row)
            return outcome, {}
        checks = {"flags": list(row.flags), "instability": row.instability, "carried": row.carried}
        return outcome, checks


#: Keys of a row's ``settings`` that are results of the measurement (the trace's standard
#: error), not settings: a resumed study matches a finished row on the other keys.
RESULT_STATS = ("trace_stderr", "per_batch_trace_stderr")


def _settings_identity(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in RESULT_STATS}


def _has_row(
    store: Store, model_id: str, measure: str, rho: float | None, settings: dict[str, Any]
) -> bool:
    """Whether a row of these settings is stored (the stats keys of its outcome aside)."""
    if store.has_measurement(model_id, measure, rho, settings):
        return True
    if rho is not None:  # rows with a radius carry no stats (Measure.outcome)
        return False
    cur = store.conn.execute(
        "SELECT settings FROM measurements WHERE model_id = ? AND measure = ? AND rho IS NULL",
        (model_id, measure),
    )
    want = json.dumps(settings, sort_keys=True, default=str)
    for (st,) in cur.fetchall():
        stored = json.loads(st)
        if "error" in stored:
            stored.pop("error")
        if json.dumps(_settings_identity(stored), sort_keys=True, default=str) == want:
            return True
    return False


def environment() -> dict[str, Any]:
    """What ran a study: versions, torch threads, CPU count, platform, device.

    Not part of a study's identity (a study may be resumed with more threads); recorded so
    that the report says what produced its numbers.
    """
    return {
        "geosharp": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _record_report_meta(store: Store, study: Study) -> None:
    included = [mid for mid, _ in study.population()]
    old = report_info(store.meta())
    environments = [e for e in old.get("environments", []) if e != environment()]
    info = {
        "title": study.title,
        "gap_label": study.gap_label,
        "paper": study.paper,
        "expected": study.expected,
        "settings": study.settings(),
        "population": included,
        "notes": study.notes(),
        "environments": [*environments, environment()],
    }
    with store.conn:
        store.conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('report', ?)",
            (json.dumps(info, default=str),),
        )
