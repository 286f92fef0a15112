"""The study pipeline shared by every study: population → sharpness → correlation → report.

A :class:`Study` says what its population is, how to train (or load) a model, on which batches
and with which loss sharpness is measured, and its measurement plan (measures × ρ). The
:func:`run_study` loop is the same for all studies and is resumable at the granularity of one
model (training) and one measurement row: the store records every finished row atomically, so a
killed run restarts where it stopped and never recomputes or loses a finished row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
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
from geosharp.studies.store import Store, StudyMismatchError
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


#: How ``--shard k/n`` splits a population: model ``M`` belongs to part ``shard_of(M, n)``, a
#: hash of its name (its id in the store), so adding, removing or reordering models never moves
#: another model to another part. Recorded in every shard's ``study.sqlite`` (meta ``shards``).
SHARD_RULE = "name-hash"
#: The rule of shard folders written before the rule was recorded: the models at positions
#: ``k−1, k−1+n, …`` of the population (a model added in the middle moves every later one).
POSITION_RULE = "position"
SHARD_RULES = {
    SHARD_RULE: "a hash of the model's name: part 1 + (SHA-256 of the name, first 8 bytes as a "
    "big-endian integer) mod n",
    POSITION_RULE: "position in the manifest: models k, k+n, k+2n, …",
}


def shard_of(model_id: str, n: int) -> int:
    """The part (1 to ``n``) that owns a model under :data:`SHARD_RULE`.

    ``1 + int.from_bytes(sha256(model_id.encode("utf-8")).digest()[:8], "big") % n``: the same
    on every machine, Python and platform, and independent of the other models.

    Example:
        >>> [shard_of(f"diag-{i:03d}", 2) for i in range(4)]
        [1, 2, 1, 2]
        >>> old = Shard(1, 2).take(["a", "b", "c", "d"])
        >>> set(old) <= set(Shard(1, 2).take(["a", "new", "b", "c", "d"]))  # grown: none moves
        True
    """
    digest = hashlib.sha256(model_id.encode("utf-8")).digest()
    return 1 + int.from_bytes(digest[:8], "big") % n


def _model_id(item: Any) -> str:
    return str(item[0] if isinstance(item, tuple | list) else item)


@dataclass
class Shard:
    """Part ``k`` of ``n`` (1-based) of a population.

    Attributes:
        k: The part.
        n: The number of parts.
        rule: :data:`SHARD_RULE` (the models whose :func:`shard_of` is ``k``: stable when the
            population grows, shrinks or is reordered) or :data:`POSITION_RULE` (the models at
            positions ``k−1, k−1+n, …``; what shard folders written before the rule was
            recorded keep, :func:`settle_shard`).
    """

    k: int
    n: int
    rule: str = SHARD_RULE

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Parse ``"k/n"``.

        Raises:
            ValueError: If the text is not ``k/n`` with ``1 ≤ k ≤ n``.
        """
        try:
            k, n = (int(x) for x in text.split("/"))
        except ValueError as err:
            raise ValueError(f"--shard must look like 2/4, got {text!r}") from err
        if not 1 <= k <= n:
            raise ValueError(f"--shard k/n needs 1 <= k <= n, got {text!r}")
        return cls(k, n)

    def owns(self, model_id: str) -> bool:
        """Whether this part holds the model (:data:`SHARD_RULE` only: it needs no position)."""
        if self.rule != SHARD_RULE:
            raise ValueError(f"shard rule {self.rule!r} needs the population's order: use take")
        return shard_of(model_id, self.n) == self.k

    def take(self, items: Sequence[Any], key: Callable[[Any], str] | None = None) -> list[Any]:
        """The items of this shard, in their order.

        Args:
            items: The population: ``(model_id, hyperparameters)`` pairs or model ids.
            key: The model id of an item (default: the item's first element, or the item).
        """
        if self.rule == POSITION_RULE:
            return list(items[self.k - 1 :: self.n])
        if self.rule != SHARD_RULE:
            raise ValueError(f"unknown shard rule {self.rule!r}")
        key = key or _model_id
        return [item for item in items if shard_of(key(item), self.n) == self.k]

    def text(self) -> str:
        """``"part 2/4 (name-hash)"``."""
        return f"part {self.k}/{self.n} ({self.rule})"


#: The ``meta`` key of a folder's shard record: ``{"rule": ..., "n": n or None, "parts": [k]}``.
SHARDS_META = "shards"


def shard_record(meta: dict[str, str]) -> dict[str, Any] | None:
    """The shard record of a store's meta table (``None``: none recorded)."""
    text = meta.get(SHARDS_META)
    if not text:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def settle_shard(
    store: Store,
    shard: Shard | None,
    *,
    force: bool = False,
    say: Callable[[str], None] = lambda _msg: None,
) -> Shard | None:
    """The part this run measures in the folder of ``store``, checked against its record.

    Every folder records how it was split (meta ``shards``: the rule, ``n`` and the parts
    measured into it), so that a resumed shard never silently owns other models than it did:

    * a new folder, or one recorded with the same ``n``: :data:`SHARD_RULE`, the part added to
      the record (several parts may share one folder);
    * a folder recorded with another ``n``: refused (:class:`StudyMismatchError`), unless
      ``force`` (then it is split anew; its rows are kept);
    * a folder with models but no record (written before the rule was recorded, when shards were
      taken by position): it keeps :data:`POSITION_RULE`, and says so; ``force`` switches it to
      :data:`SHARD_RULE`.

    The record is read and written in one transaction (shards starting together on one folder).

    Raises:
        StudyMismatchError: If the folder was split into another number of parts.
    """
    conn = store.conn
    conn.execute("BEGIN IMMEDIATE")
    try:
        rec = shard_record(dict(conn.execute("SELECT key, value FROM meta").fetchall()))
        has_models = conn.execute("SELECT 1 FROM models LIMIT 1").fetchone() is not None
        if shard is None:
            if rec is None and not has_models:  # a new unsharded folder: the rule, no parts
                rec = {"rule": SHARD_RULE, "n": None, "parts": []}
                _write_shard_record(conn, rec)
            conn.execute("COMMIT")
            return None
        folder = store.path.parent
        rule = SHARD_RULE
        parts: list[int] = []
        if rec is None and has_models:
            if force:
                say(
                    f"{folder} holds models measured before geosharp recorded how shards are "
                    f"split (then by {SHARD_RULES[POSITION_RULE]}); --force: it is now part "
                    f"{shard.k}/{shard.n} by {SHARD_RULES[SHARD_RULE]} (its rows are kept; "
                    "geosharp merge names any model no shard measured)"
                )
            else:
                rule = POSITION_RULE
                say(
                    f"{folder} was started before geosharp recorded how shards are split: it "
                    f"keeps the rule it was measured with, by {SHARD_RULES[POSITION_RULE]}. If "
                    "the manifest grew or was reordered since, that moves models between parts: "
                    "rerun every part, or pass --force to split this folder by the stable rule "
                    f"({SHARD_RULES[SHARD_RULE]})"
                )
        elif rec is not None and rec.get("n") is not None:
            rule = rec.get("rule", SHARD_RULE)
            if rec["n"] != shard.n or rule not in SHARD_RULES:
                was = ", ".join(f"{k}/{rec['n']}" for k in rec.get("parts", []))
                if not force:
                    raise StudyMismatchError(
                        f"{folder} holds part {was} (split by {rule}), but this run asks for "
                        f"part {shard.k}/{shard.n}: parts of another split own other models than "
                        f"their sibling folders; give --shard k/{rec['n']}, another --out, or "
                        "--force to split this folder anew (its rows are kept)"
                    )
                say(f"{folder} held part {was} ({rule}); --force: it is now split anew")
                rule = SHARD_RULE
            else:
                parts = [int(k) for k in rec.get("parts", [])]
                if shard.k not in parts and parts:
                    shown = ", ".join(str(k) for k in sorted({*parts, shard.k}))
                    say(f"{folder} holds parts {shown} of {shard.n} (one folder shared by parts)")
        rec = {"rule": rule, "n": shard.n, "parts": sorted({*parts, shard.k})}
        _write_shard_record(conn, rec)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return Shard(shard.k, shard.n, rule)


def _write_shard_record(conn: Any, rec: dict[str, Any]) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        (SHARDS_META, json.dumps(rec, sort_keys=True)),
    )


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
    old = json.loads(store.meta().get("report", "{}"))
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
        "recorded": time.time(),  # when this population was read (geosharp merge: the newest)
    }
    with store.conn:
        store.conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('report', ?)",
            (json.dumps(info, default=str),),
        )
