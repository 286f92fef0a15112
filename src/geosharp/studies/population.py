"""Your own population: the paper's method on any set of checkpoints (``geosharp study MANIFEST``).

A manifest (:mod:`geosharp.studies.manifest`) lists the models, their generalization gaps and
their hyperparameters. :class:`PopulationStudy` is a :class:`~geosharp.studies.runner.Study`
whose "training" records the manifest's rows and whose models are loaded, tokenized and
self-checked by ``geosharp measure``'s own path
(:func:`geosharp.measuring.pipeline.load_for_measure` and
:func:`geosharp.measuring.prepare.prepare_measurement`), so a value of the study is ``gs.sharpness``
of that model with the same settings. Everything else is the runner's: the
resumable ``study.sqlite``, shards and ``geosharp merge``, ``results.csv``, ``tau_table.md``,
``summary.json``, the plots and ``report.html``, with two more sections when the manifest has
hyperparameters (granulated τ and the CMI score, :mod:`geosharp.studies.population_sections`).

The radii are decided before any model is measured and recorded in the study's configuration:
one grid for every measure (``--rho 0.01 0.1 1``), one per measure or family
(``--rho adaptive=0.1,0.316,1 geodesic=0.01,0.0316,0.1``), or the ρ rule of the built-in studies
on a pilot model (``--rho auto``: a typical model — the median gap, skipping models at chance,
:mod:`geosharp.studies.pilot` — or ``auto:NAME`` a named one), which looks at the pilot's
sharpness only — never at a τ.

:func:`geosharp.studies.population_call.study` is the same in one Python call; the radii
are :mod:`geosharp.studies.population_radii`'s; under ``torchrun`` with ``--fsdp`` every model is
sharded over the ranks (:mod:`geosharp.studies.population_fsdp`). What the study records beside
its store (``manifest.json``, ``models.json``) is :mod:`geosharp.studies.population_records`'.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geosharp.errors import MeasureError
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.measures import Measure, parse_measure
from geosharp.studies.manifest import Manifest, ManifestRow, read_manifest
from geosharp.studies.population_radii import RadiusPlan, parse_rho
from geosharp.studies.population_records import (
    read_json,
    recorded_pilot,
    write_manifest_record,
    write_models,
)
from geosharp.studies.population_sections import MANIFEST_FILE
from geosharp.studies.runner import (
    CellJudge,
    Prepared,
    RunSummary,
    Shard,
    Study,
    StudyMeasure,
    run_study,
)
from geosharp.studies.study_report import report_from_folder

__all__ = [
    "DEFAULT_POPULATION_MEASURES",
    "PopulationSettings",
    "PopulationStudy",
    "RadiusPlan",
    "curvature_rows",
    "parse_rho",
    "run_population",
]

#: The paper's three measures.
DEFAULT_POPULATION_MEASURES = ("adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2")


@dataclass
class PopulationSettings:
    """Everything a population study measures with (its configuration, recorded in the store).

    Attributes:
        manifest: The manifest file.
        options: The data options (``geosharp measure``'s; :class:`MeasureOptions` as a dict).
        measures: The measures (``geosharp measure``'s grammar).
        rho: The radius plan.
        steps: Auto-PGD steps.
        eps: Gram damping.
        seed: Seed of the self-check and of the ascent's starts.
        curvature: Also measure the curvature plan of the built-in studies (λ_max and trace of
            geodesic inv and mix, adaptive and Euclidean curvature).
        curvature_iters: Most Lanczos iterations per batch (λ).
        curvature_probes: Hutchinson probes per batch (trace).
        gap: The gap rule (``--gap``), or ``None``: the first that fits.
        base: Base model of PEFT adapters without a ``base`` cell.
        skip_bad: Set aside rows whose model does not load, instead of failing.
        check: Run the self-check on every model.
        exact_steps: RK4 steps of the exact geodesic (the ``-exact`` measures); recorded in
            the configuration only when not the default, so that a study measured before it
            existed resumes.
    """

    manifest: str
    options: dict[str, Any]
    measures: tuple[str, ...] = DEFAULT_POPULATION_MEASURES
    rho: RadiusPlan = field(default_factory=RadiusPlan)
    steps: int = 20
    eps: float = 0.0
    seed: int = 0
    curvature: bool = False
    curvature_iters: int = 50
    curvature_probes: int = 100
    gap: str | None = None
    base: str | None = None
    skip_bad: bool = False
    check: bool = True
    exact_steps: int = DEFAULT_RK4_STEPS


class PopulationStudy(Study):
    """A study of the models a manifest lists (see the module docstring).

    Args:
        settings: The :class:`PopulationSettings`.
        log: Where progress lines go (default: stderr).
    """

    name = "population"
    key_bias = "quotient"
    #: Whether this process writes the study's folder (under ``--fsdp``, rank 0 alone does).
    writes = True

    def __init__(self, settings: PopulationSettings, log: Callable[[str], None] | None = None):
        from geosharp.measuring.pipeline import MeasureOptions

        self.cfg = settings
        self.say = log or (lambda msg: print(msg, file=sys.stderr))
        self.options = MeasureOptions(**settings.options)
        self.measures = [parse_measure(m) for m in settings.measures]
        if not self.measures:
            raise MeasureError("no measures given: pass at least one (e.g. geodesic-inv-o2)")
        self.manifest: Manifest = read_manifest(
            settings.manifest,
            gap=settings.gap,
            base=settings.base,
            skip_bad=settings.skip_bad,
            check_model=self._check_model,
        )
        self.by_id = {r.model_id: r for r in self.manifest.rows}
        self.title = f"Population: {Path(settings.manifest).name}"
        self.gap_label = self.manifest.gap_line()
        self.grids: dict[str, tuple[float, ...]] = {}
        self._models: dict[str, dict[str, Any]] = {}
        #: ``(summary, adaptive note)`` → the first model whose blocks were said in full so.
        self._blocks_said: dict[tuple[str, str], str] = {}

    # -- checks before any work --------------------------------------------------------------
    def _check_model(self, row: ManifestRow) -> None:
        from geosharp.measuring.model_loading import check_model_spec

        check_model_spec(row.model)
        if row.base is not None:
            check_model_spec(row.base)

    def decide_radii(self, out: Path) -> None:
        """Fix every measure's grid before any τ: the given grids, or the ρ rule on the pilot.

        The rule's grids are kept in ``OUT/manifest.json``: a resumed run reuses them.
        """
        plan = self.cfg.rho
        with_rho = [m for m in self.measures if m.uses_rho]
        if plan.pilot is None:
            self.grids = {m.name: plan.grid_of(m) for m in with_rho}
            return
        record = self.agree(read_json(out / MANIFEST_FILE))
        if record.get("rho_rule", {}).get("plan") == json.loads(json.dumps(asdict(plan))):
            self.grids = {k: tuple(v) for k, v in record["rho_rule"]["grids"].items()}
            if set(self.grids) == {m.name for m in with_rho}:
                self.say(f"radii: the ρ rule's grids of {out / MANIFEST_FILE}")
                return
        from geosharp.studies.pilot import choose_pilot
        from geosharp.studies.rho_rule import ladder_grid

        named = self.by_id.get(plan.pilot) if plan.pilot else None
        if plan.pilot and named is None:
            raise MeasureError(f"--rho auto:{plan.pilot}: no model of that name in the manifest")
        choice = choose_pilot(
            self.manifest.rows, named, self.prepare_row, self.say, judge=self._pilot_judge
        )
        ready = choice.ready
        self.say(
            f"radii: the ρ rule on the pilot {choice.row.model_id}, {choice.why} "
            "(its sharpness only)"
        )
        judge = CellJudge.of(ready)
        flagged: dict[str, dict[float, tuple[str, ...]]] = {}
        for m in with_rho:

            def rise(rho: float, m: Measure = m) -> float:
                result = m.run(
                    ready.model,
                    ready.loss_fn,
                    ready.batches,
                    rho=rho,
                    **self._run_kwargs(m),
                    **ready.settings,
                    progress=False,
                )
                _, checks = judge(m, result, rho, None)
                flagged.setdefault(m.name, {})[rho] = tuple(checks.get("flags", ()))
                return self.agree(result.value)  # every rank walks the ladder as rank 0 does

            kind = m.kwargs().get("kind", "worst")
            self.grids[m.name] = grid = ladder_grid(rise, kind, m.name, log=self.say)
            centre = grid[len(grid) // 2]
            seen = flagged.get(m.name, {})
            flags = next((f for r, f in seen.items() if abs(r - centre) <= 1e-3 * centre), ())
            if flags:
                self.say(
                    f"warning: radii: the pilot's {m.name} cell at the grid's centre "
                    f"rho={centre:g} is flagged {' '.join(flags)}: its ascent does not settle "
                    "there, so the grid may not suit the population (see the Flagged cells "
                    "table of the report, or give the radii with --rho)"
                )
        self._write_record(out, pilot=choice.row.model_id, choice=choice.record())

    def _pilot_judge(self, ready: Prepared) -> str | None:
        """Why a candidate cannot be the pilot (:func:`~geosharp.studies.pilot.at_chance`)."""
        from geosharp.studies.pilot import at_chance

        return self.agree(at_chance(ready))  # every rank takes rank 0's decision

    def agree(self, obj: Any) -> Any:
        """What rank 0 decided, on every rank (one process: ``obj``)."""
        return obj

    def measure_all(
        self, out: Path, *, force: bool, progress: bool | None, shard: Shard | None
    ) -> RunSummary:
        """The runner's loop over the models (:func:`~geosharp.studies.runner.run_study`)."""
        return run_study(
            self, out, force=force, progress=progress, shard=shard, report=False, log=self.say
        )

    def _write_record(
        self, out: Path, pilot: str | None = None, choice: dict[str, Any] | None = None
    ) -> None:
        """Write ``OUT/manifest.json`` if this process writes (``write_manifest_record``)."""
        if not self.writes:
            return
        write_manifest_record(out, self.manifest, self.cfg.rho, self.grids, pilot, choice)

    # -- the Study interface ------------------------------------------------------------------
    def config(self) -> dict[str, Any]:  # noqa: D102
        cfg = asdict(self.cfg)
        if cfg["exact_steps"] == DEFAULT_RK4_STEPS:  # the identity of a study from before it
            del cfg["exact_steps"]
        cfg["rho"] = self.cfg.rho.text()
        cfg["grids"] = {k: list(v) for k, v in self.grids.items()}
        cfg["options"] = {k: str(v) for k, v in self.cfg.options.items()}
        return cfg

    def settings(self) -> dict[str, Any]:  # noqa: D102
        o = self.options
        return {
            "manifest": str(self.manifest.path),
            "models": len(self.manifest.rows),
            "gap": self.manifest.gap_line(),
            "hyperparameters": ", ".join(self.manifest.hparam_names) or "none",
            "data": o.data,
            "batches": f"{o.batch_size} per batch, {o.samples or 'all'} samples, "
            f"max length {o.max_length}",
            "measures": ", ".join(m.name for m in self.measures),
            "radii": self.cfg.rho.text()
            + "; "
            + "; ".join(f"{k}: " + ", ".join(f"{r:g}" for r in g) for k, g in self.grids.items()),
            "steps": self.cfg.steps,
            **(
                {"exact_steps": self.cfg.exact_steps}
                if any(m.exact_geodesic for m in self.measures)
                else {}
            ),
            "seed": self.cfg.seed,
            **({"frozen": ", ".join(o.freeze)} if o.freeze else {}),
        }

    def notes(self) -> list[str]:  # noqa: D102
        return [
            f"skipped manifest row {line} ({label}): {why}"
            for line, label, why in self.manifest.skipped
        ]

    def train_line(self, todo: int, total: int) -> str:
        """Nothing is trained: the manifest's models are recorded, then measured."""
        before = f"; {total - todo} recorded before" if todo < total else ""
        return f"measuring {total} models of the manifest (nothing is trained{before})"

    def population(self) -> list[tuple[str, dict[str, Any]]]:  # noqa: D102
        return [(r.model_id, dict(r.hparams)) for r in self.manifest.rows]

    def train(self, todo, out_dir, store, progress) -> None:
        """Record the manifest's rows: nothing is trained."""
        for mid, hp in todo:
            row = self.by_id[mid]
            store.put_model(
                mid,
                hparams=hp,
                metrics={"model": row.model, "base": row.base, "manifest_row": row.line},
                gap=row.gap,
            )

    def load(self, row: dict[str, Any]):  # noqa: D102
        return self.prepare_row(self.by_id[row["model_id"]]).model

    def batches(self) -> list[tuple[Any, Any]]:
        """None shared: every model gets its own batches from its tokenizer (:meth:`prepare`)."""
        return []

    def loss_fn(self, outputs: Any, targets: Any):
        """Unused: every model gets its own loss (:meth:`prepare`)."""
        raise NotImplementedError("a population's loss is per model: PopulationStudy.prepare")

    def plan(self) -> list[StudyMeasure]:
        """Every measure at its grid (:meth:`decide_radii`), then ``--curvature``'s rows."""
        return self._specs(lambda m: self.grids[m.name] if m.uses_rho else (None,))

    def planned_measures(self) -> list[Measure]:
        """The measures of :meth:`plan`, in its order: known before the radii are decided."""
        return [s.measure for s in self._specs(lambda m: (None,))]

    def _specs(self, rhos: Callable[[Measure], tuple[float | None, ...]]) -> list[StudyMeasure]:
        """The plan's rows, every measure at ``rhos(measure)`` (the curvature rows: no ρ)."""
        specs = [
            StudyMeasure({**m.kwargs(), **self._run_kwargs(m)}, rhos(m)) for m in self.measures
        ]
        if self.cfg.curvature:
            cfg = self.cfg
            specs += curvature_rows(cfg.curvature_iters, cfg.curvature_probes, cfg.seed)
        return specs

    def _run_kwargs(self, m: Measure) -> dict[str, Any]:
        kw = {"steps": self.cfg.steps, "eps": self.cfg.eps, "seed": self.cfg.seed}
        if self.cfg.exact_steps != DEFAULT_RK4_STEPS:
            kw["exact_steps"] = self.cfg.exact_steps
        return m.run_settings(kw)  # the settings the measure takes (Measure.settings)

    def prepare(self, row: dict[str, Any], batches: list[tuple[Any, Any]]) -> Prepared:
        """``geosharp measure``'s loading and self-check of one model (its own batches)."""
        return self.prepare_row(self.by_id[row["model_id"]])

    def prepare_row(self, row: ManifestRow) -> Prepared:
        """Load, tokenize and self-check one manifest row, and note its blocks."""
        from geosharp.demos.coverage_sweep import block_counts
        from geosharp.measuring.pipeline import ModelSource, load_for_measure
        from geosharp.measuring.prepare import prepare_measurement

        self.say(f"{row.model_id}: loading {row.model}")
        source = ModelSource(row.model, weights=row.weights, base=row.base)
        try:
            ready = load_for_measure(source, self.options, say=self.say, warn=self.say)
            checked = prepare_measurement(
                ready.model,
                ready.batches,
                ready.loss,
                check=self.cfg.check,
                seed=self.cfg.seed,
                say=self.say,
                say_blocks=lambda summary, note: self._say_blocks(row.model_id, summary, note),
            )
        except MeasureError as err:  # the row, as read_manifest names it
            raise MeasureError(
                f"{self.manifest.path.name} row {row.line} ({row.model_id}): {err}"
            ) from err
        self._models[row.model_id] = {
            "model": ready.loaded.name,
            "kind": ready.loaded.kind,
            "task": ready.task,
            "blocks": ", ".join(f"{n} {k}" for k, n in block_counts(checked.space).items())
            or "none (every coordinate adaptive)",
            "clean_loss": sum(checked.clean_losses) / len(checked.clean_losses),
            **{k: ready.settings()[k] for k in ("batch_size", "samples", "max_length")},
        }
        from geosharp.measuring.flags import reference_loss

        reference = reference_loss(checked.model, checked.loss_fn, checked.batches)
        return Prepared(
            checked.model, checked.batches, checked.loss_fn, {"space": checked.space},
            clean_losses=checked.clean_losses, reference=reference, judged=True,
        )  # fmt: skip

    def _say_blocks(self, model_id: str, summary: str, note: str) -> None:
        """The symmetry blocks in full once, then a line for each model that has the same.

        "The same": the same listing but for the deviation measured when the blocks were
        verified on the model's first batch, which the short line gives.
        """
        key = (_VERIFIED.sub(r"\1…", summary), note)
        if key in self._blocks_said:
            verified = [m.group(0).strip() for m in _VERIFIED.finditer(summary)]
            said = f"symmetry blocks: the same as {self._blocks_said[key]}'s (listed above)"
            self.say("; ".join([said, *verified]))
            return
        self._blocks_said[key] = model_id
        self.say(summary)
        self.say(note)

    def write_models(self, out: Path) -> None:
        """``OUT/models.json``: the architecture, blocks and batches of every model measured.

        The report's settings then say the batches as they were cut (the samples the data
        held, the length each model accepts), not only as asked.
        """
        if not self.writes:
            return
        write_models(out, self._models, self.options)


#: The line of a symmetry summary that differs between models of the same architecture.
_VERIFIED = re.compile(r"(symmetry claims verified on the example batch: .*?moved by ≤ )\S+")


def curvature_rows(iters: int, probes: int, seed: int) -> list[StudyMeasure]:
    """The rows ``--curvature`` adds to a population's plan (:meth:`PopulationStudy.plan`).

    The curvature plan of the built-in studies (λ_max and the Hutchinson trace of geodesic inv
    and mix, adaptive and Euclidean curvature; no ρ) with the study's Lanczos iterations per
    batch, Hutchinson probes per batch and seed. ``geosharp study --fsdp`` checks these rows
    before the manifest is read (:func:`geosharp.studies.population_fsdp.check_study_args`).
    """
    from geosharp.studies.curvature_plan import CurvaturePlan, curvature_specs

    return curvature_specs(CurvaturePlan(iters=iters, probes=probes, seed=seed))


def run_population(
    settings: PopulationSettings,
    out_dir: str | Path,
    *,
    force: bool = False,
    progress: bool | None = None,
    shard: Shard | None = None,
    log: Callable[[str], None] | None = None,
    expected: str | None = None,
    study: PopulationStudy | None = None,
    twin_check: bool = False,
) -> RunSummary:
    """Check the manifest, fix the radii, measure every model, write the report.

    Everything that can be wrong with the manifest or the options is found before any model
    is measured (:func:`~geosharp.studies.manifest.read_manifest`, the measures, the radii).

    Args:
        settings: What to measure.
        out_dir: The study folder (``study.sqlite``, ``results.csv``, the report).
        force: Reuse a folder that records a different configuration.
        progress: Progress bars (default: when stderr is a terminal).
        shard: Only this part ``k/n`` of the models (``geosharp merge`` joins the parts).
        log: Where one-line status messages go (default: stderr).
        expected: The sign of τ you expect, ``"positive"`` (sharper models generalize worse)
            or ``"negative"``, stated before measuring: the direction of the report's paired
            verdict (geodesic against adaptive). ``None``: the sign of τ_geo + τ_ada. A report
            setting, not part of the study's configuration.
        study: The study of ``settings`` to run (default: a :class:`PopulationStudy`; under
            ``--fsdp`` a :class:`~geosharp.studies.population_fsdp.ShardedPopulation`).
        twin_check: Then re-measure every model's cells on one random equivalent twin
            (``--twin-check``; :mod:`geosharp.studies.population_twin`): ``OUT/twin_check.csv``
            and the report's "Twin check" section. Not part of the configuration.

    Returns:
        The runner's :class:`~geosharp.studies.runner.RunSummary`.
    """
    from geosharp.studies.analysis import EXPECTED

    if expected is not None and expected not in EXPECTED:
        raise MeasureError(f"--expect must be one of {', '.join(EXPECTED)}, got {expected!r}")
    out = Path(out_dir)
    study = PopulationStudy(settings, log=log) if study is None else study
    study.expected = expected
    say = study.say
    m = study.manifest
    say(f"manifest: {len(m.rows)} models; {m.gap_line()}")
    if m.hparam_names:
        say(f"hyperparameters: {', '.join(m.hparam_names)}")
    for line, label, why in m.skipped:
        say(f"skipped row {line} ({label}): {why}")
    study.decide_radii(out)
    study._write_record(out, *recorded_pilot(out))
    for name, grid in study.grids.items():
        say(f"radii of {name}: " + ", ".join(f"{r:g}" for r in grid))
    summary = study.measure_all(out, force=force, progress=progress, shard=shard)
    study.write_models(out)
    if twin_check:
        from geosharp.studies.population_twin import run_twin_check

        part = summary.shard  # the part as the folder records it (its rule)
        run_twin_check(study, out, shard=part, check=settings.check, progress=progress)
    if shard is None and study.writes:
        summary.report = report_from_folder(out)
    return summary
