"""Your own population: the paper's method on any set of checkpoints (``geosharp study MANIFEST``).

A manifest (:mod:`geosharp.studies.manifest`) lists the models, their generalization gaps and
their hyperparameters. :class:`PopulationStudy` is a :class:`~geosharp.studies.runner.Study`
whose "training" records the manifest's rows and whose models are loaded, tokenized and
self-checked by ``geosharp measure``'s own path
(:func:`geosharp.measuring.pipeline.load_for_measure` and
:func:`geosharp.measuring.core.prepare_measurement`), so a value of the study is ``gs.sharpness``
of that model with the same settings. Everything else is the runner's: the
resumable ``study.sqlite``, shards and ``geosharp merge``, ``results.csv``, ``tau_table.md``,
``summary.json``, the plots and ``report.html``, with two more sections when the manifest has
hyperparameters (granulated τ and the CMI score, :mod:`geosharp.studies.population_sections`).

The radii are decided before any model is measured and recorded in the study's configuration:
one grid for every measure (``--rho 0.01 0.1 1``), one per measure or family
(``--rho adaptive=0.1,0.316,1 geodesic=0.01,0.0316,0.1``), or the ρ rule of the built-in studies
on a pilot model (``--rho auto``: the manifest's first model, ``auto:NAME`` another), which looks
at the pilot's sharpness only — never at a gap or a τ.

:func:`study` is the same in one Python call.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.errors import MeasureError
from geosharp.measures import Measure, parse_measure
from geosharp.studies.manifest import Manifest, ManifestRow, read_manifest
from geosharp.studies.population_sections import MANIFEST_FILE, MODELS_FILE
from geosharp.studies.runner import (
    Prepared,
    RunSummary,
    Shard,
    Study,
    StudyMeasure,
    report_from_folder,
    run_study,
)

__all__ = [
    "DEFAULT_POPULATION_MEASURES",
    "PopulationSettings",
    "PopulationStudy",
    "RadiusPlan",
    "StudyTable",
    "parse_rho",
    "run_population",
    "study",
]

#: The paper's three measures.
DEFAULT_POPULATION_MEASURES = ("adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2")


@dataclass(frozen=True)
class RadiusPlan:
    """How the radii of a population are chosen (``--rho``).

    Attributes:
        grid: One grid for every measure that takes ρ, or ``None``.
        per_key: Grids per measure name or family (``"adaptive"``, ``"geodesic"``, …).
        pilot: ``None``, or the model whose sharpness sets every measure's grid by the ρ rule
            (``""``: the manifest's first model).
    """

    grid: tuple[float, ...] | None = None
    per_key: tuple[tuple[str, tuple[float, ...]], ...] = ()
    pilot: str | None = None

    def text(self) -> str:
        """As the log and the report say it."""
        if self.pilot is not None:
            return f"ρ rule on the pilot {self.pilot or '(first model)'}"
        if self.grid is not None:
            return "one grid: " + ", ".join(f"{r:g}" for r in self.grid)
        return "; ".join(f"{k} " + ", ".join(f"{r:g}" for r in g) for k, g in self.per_key)

    def grid_of(self, measure: Measure) -> tuple[float, ...]:
        """The grid of one measure (by its name, then its family's key).

        Raises:
            MeasureError: If the plan has no grid for it.
        """
        if self.grid is not None:
            return self.grid
        keys = dict(self.per_key)
        if measure.name in keys:
            return keys[measure.name]
        family = measure.kwargs().get("measure", "")
        if family in keys:
            return keys[family]
        raise MeasureError(
            f"--rho gives no radii for {measure.name}: add {family}=R1,R2,... (or one grid for "
            "all measures)"
        )


def _radii(text: str, where: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise MeasureError(f"--rho {where}: {text!r} is not a list of numbers") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise MeasureError(f"--rho {where}: radii must be finite numbers > 0, got {text!r}")
    return values


def parse_rho(values: Sequence[str] | None) -> RadiusPlan:
    """Read ``--rho``: numbers (one grid), ``KEY=R1,R2,...`` clauses, or ``auto[:MODEL]``.

    Example:
        >>> parse_rho(["0.01", "0.1"]).grid
        (0.01, 0.1)
        >>> parse_rho(["adaptive=0.1,1", "geodesic=0.01"]).per_key
        (('adaptive', (0.1, 1.0)), ('geodesic', (0.01,)))
        >>> parse_rho(["auto:run-3"]).pilot
        'run-3'
    """
    if not values:
        return RadiusPlan(pilot="")
    if len(values) == 1 and values[0].split(":")[0].strip().lower() == "auto":
        pilot = values[0].partition(":")[2]
        return RadiusPlan(pilot=pilot.strip())
    if all("=" in v for v in values):
        clauses = []
        for v in values:
            key, _, grid = v.partition("=")
            key = key.strip()
            if key in {"geodesic", "adaptive", "euclidean"}:
                name = key
            else:
                name = parse_measure(key).name
            clauses.append((name, _radii(grid, key)))
        return RadiusPlan(per_key=tuple(clauses))
    if any("=" in v for v in values):
        raise MeasureError(
            "--rho: give one grid (numbers), or KEY=R1,R2,... for every measure or family, "
            "or auto[:MODEL]; not both"
        )
    return RadiusPlan(grid=_radii(" ".join(values), "grid"))


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


class PopulationStudy(Study):
    """A study of the models a manifest lists (see the module docstring).

    Args:
        settings: The :class:`PopulationSettings`.
        log: Where progress lines go (default: stderr).
    """

    name = "population"
    key_bias = "quotient"

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
        record = _read_json(out / MANIFEST_FILE)
        if record.get("rho_rule", {}).get("plan") == json.loads(json.dumps(asdict(plan))):
            self.grids = {k: tuple(v) for k, v in record["rho_rule"]["grids"].items()}
            if set(self.grids) == {m.name for m in with_rho}:
                self.say(f"radii: the ρ rule's grids of {out / MANIFEST_FILE}")
                return
        from geosharp.studies.classifier import ladder_grid

        pilot = self.by_id.get(plan.pilot) if plan.pilot else self.manifest.rows[0]
        if pilot is None:
            raise MeasureError(f"--rho auto:{plan.pilot}: no model of that name in the manifest")
        self.say(f"radii: the ρ rule on the pilot {pilot.model_id} (its sharpness only)")
        ready = self.prepare_row(pilot)
        for m in with_rho:

            def rise(rho: float, m: Measure = m) -> float:
                return m.run(
                    ready.model,
                    ready.loss_fn,
                    ready.batches,
                    rho=rho,
                    **self._run_kwargs(m),
                    **ready.settings,
                    progress=False,
                ).value

            kind = m.kwargs().get("kind", "worst")
            self.grids[m.name] = ladder_grid(rise, kind, m.name, log=self.say)
        self._write_record(out, pilot=pilot.model_id)

    def _write_record(self, out: Path, pilot: str | None = None) -> None:
        m = self.manifest
        record = {
            "manifest": str(m.path),
            "gap_rule": m.gap_rule.key,
            "gap": m.gap_line(),
            "hyperparameters": m.hparam_names,
            "skipped": [
                {"row": line, "model": label, "why": why} for line, label, why in m.skipped
            ],
            "rho": self.cfg.rho.text(),
        }
        if self.cfg.rho.pilot is not None:
            record["rho_rule"] = {
                "plan": asdict(self.cfg.rho),
                "pilot": pilot,
                "grids": {k: list(v) for k, v in self.grids.items()},
            }
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / MANIFEST_FILE, json.dumps(record, indent=1) + "\n")

    # -- the Study interface ------------------------------------------------------------------
    def config(self) -> dict[str, Any]:  # noqa: D102
        cfg = asdict(self.cfg)
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
            "seed": self.cfg.seed,
            **({"frozen": ", ".join(o.freeze)} if o.freeze else {}),
        }

    def notes(self) -> list[str]:  # noqa: D102
        return [
            f"skipped manifest row {line} ({label}): {why}"
            for line, label, why in self.manifest.skipped
        ]

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

    def plan(self) -> list[StudyMeasure]:  # noqa: D102
        specs = []
        for m in self.measures:
            rhos: tuple[float | None, ...] = self.grids[m.name] if m.uses_rho else (None,)
            specs.append(StudyMeasure({**m.kwargs(), **self._run_kwargs(m)}, rhos))
        if self.cfg.curvature:
            from geosharp.studies.classifier import CurvaturePlan, curvature_specs

            plan = CurvaturePlan(
                iters=self.cfg.curvature_iters,
                probes=self.cfg.curvature_probes,
                seed=self.cfg.seed,
            )
            specs += curvature_specs(plan)
        return specs

    def _run_kwargs(self, m: Measure) -> dict[str, Any]:
        if m.family != "sharpness":
            return {"seed": self.cfg.seed}
        return {"steps": self.cfg.steps, "eps": self.cfg.eps, "seed": self.cfg.seed}

    def prepare(self, row: dict[str, Any], batches: list[tuple[Any, Any]]) -> Prepared:
        """``geosharp measure``'s loading and self-check of one model (its own batches)."""
        return self.prepare_row(self.by_id[row["model_id"]])

    def prepare_row(self, row: ManifestRow) -> Prepared:
        """Load, tokenize and self-check one manifest row, and note its blocks."""
        from geosharp.demos.coverage import block_counts
        from geosharp.measuring.core import prepare_measurement
        from geosharp.measuring.pipeline import ModelSource, load_for_measure

        self.say(f"{row.model_id}: loading {row.model}")
        source = ModelSource(row.model, weights=row.weights, base=row.base)
        ready = load_for_measure(source, self.options, say=self.say, warn=self.say)
        checked = prepare_measurement(
            ready.model,
            ready.batches,
            ready.loss,
            check=self.cfg.check,
            seed=self.cfg.seed,
            say=self.say,
        )
        self._models[row.model_id] = {
            "model": ready.loaded.name,
            "kind": ready.loaded.kind,
            "task": ready.task,
            "blocks": ", ".join(f"{n} {k}" for k, n in block_counts(checked.space).items())
            or "none (every coordinate adaptive)",
            "clean_loss": sum(checked.clean_losses) / len(checked.clean_losses),
        }
        return Prepared(checked.model, checked.batches, checked.loss_fn, {"space": checked.space})

    def write_models(self, out: Path) -> None:
        """``OUT/models.json``: the architecture and blocks of every model measured this run."""
        old = _read_json(out / MODELS_FILE)
        old.update(self._models)
        atomic_write_text(out / MODELS_FILE, json.dumps(old, indent=1) + "\n")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def run_population(
    settings: PopulationSettings,
    out_dir: str | Path,
    *,
    force: bool = False,
    progress: bool | None = None,
    shard: Shard | None = None,
    log: Callable[[str], None] | None = None,
    expected: str | None = None,
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

    Returns:
        The runner's :class:`~geosharp.studies.runner.RunSummary`.
    """
    from geosharp.studies.analysis import EXPECTED

    if expected is not None and expected not in EXPECTED:
        raise MeasureError(f"--expect must be one of {', '.join(EXPECTED)}, got {expected!r}")
    out = Path(out_dir)
    study = PopulationStudy(settings, log=log)
    study.expected = expected
    say = study.say
    m = study.manifest
    say(f"manifest: {len(m.rows)} models; {m.gap_line()}")
    if m.hparam_names:
        say(f"hyperparameters: {', '.join(m.hparam_names)}")
    for line, label, why in m.skipped:
        say(f"skipped row {line} ({label}): {why}")
    study.decide_radii(out)
    study._write_record(out, pilot=_pilot_of(out))
    for name, grid in study.grids.items():
        say(f"radii of {name}: " + ", ".join(f"{r:g}" for r in grid))
    summary = run_study(
        study, out, force=force, progress=progress, shard=shard, report=False, log=say
    )
    study.write_models(out)
    if shard is None:
        summary.report = report_from_folder(out)
    return summary


def _pilot_of(out: Path) -> str | None:
    return _read_json(out / MANIFEST_FILE).get("rho_rule", {}).get("pilot")


@dataclass
class StudyTable:
    """What :func:`study` returns: the τ table as rows, and where everything was written.

    Attributes:
        rows: One dict per (measure, ρ): ``measure``, ``rho``, ``tau_a``, ``tau_b``,
            ``ci_low``, ``ci_high``, ``p_value``, ``n_models``, ``note``.
        out_dir: The study folder.
        report: ``report.html``.
        gap: How the gap was read.
    """

    rows: list[dict[str, Any]]
    out_dir: Path
    report: Path | None
    gap: str

    def dataframe(self) -> Any:
        """The rows as a pandas ``DataFrame`` (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def __str__(self) -> str:
        lines = [f"{'measure':<32} {'rho':>8} {'tau':>6}  CI", "-" * 60]
        for r in self.rows:
            rho = "–" if r["rho"] is None else f"{r['rho']:g}"
            lines.append(
                f"{r['measure']:<32} {rho:>8} {r['tau_a']:+.2f}  "
                f"[{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]"
            )
        return "\n".join(lines)


_CELL_KEYS = (
    "measure",
    "rho",
    "tau_a",
    "tau_b",
    "ci_low",
    "ci_high",
    "p_value",
    "n_models",
    "note",
)


def study(
    manifest: str | Path | Sequence[Mapping[str, Any]],
    *,
    data: str,
    out: str | Path,
    measures: Sequence[str] = DEFAULT_POPULATION_MEASURES,
    rho: Sequence[float] | Mapping[str, Sequence[float]] | str | None = None,
    steps: int = 20,
    eps: float = 0.0,
    seed: int = 0,
    curvature: bool = False,
    gap: str | None = None,
    base: str | None = None,
    skip_bad: bool = False,
    check: bool = True,
    force: bool = False,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    expected: str | None = None,
    **data_options: Any,
) -> StudyTable:
    """``geosharp study MANIFEST`` in one call: does sharpness predict *your* models' gaps?

    Args:
        manifest: A ``.csv``/``.jsonl``/``.parquet`` manifest, or its rows as dicts (then
            written to ``OUT/manifest.jsonl``, relative paths read from the current folder).
        data: The data every model is measured on (as ``geosharp measure`` takes it).
        out: The study folder.
        measures: Measures in ``geosharp measure``'s grammar (default: the paper's three).
        rho: One grid (numbers), grids per measure or family (a dict), ``"auto"`` or
            ``"auto:NAME"`` (the ρ rule on a pilot; the default).
        steps: Auto-PGD steps.
        eps: Gram damping.
        seed: Seed of the self-check and the ascent.
        curvature: Also measure the curvature plan of the built-in studies (λ_max and trace of
            geodesic inv and mix, adaptive and Euclidean curvature).
        curvature_iters: Most Lanczos iterations per batch (λ).
        curvature_probes: Hutchinson probes per batch (trace).
        gap: The gap rule when several fit (``"gap"``, ``"error"``, ``"accuracy"``, ``"loss"``).
        base: Base model of PEFT adapters without a ``base`` column.
        skip_bad: Measure the rest when a row's model does not load (listed in the report).
        check: Run the invariance self-check on every model.
        force: Reuse a folder that records a different configuration.
        progress: Progress bars (default: when stderr is a terminal).
        log: Where progress lines go (default: stderr).
        expected: ``"positive"`` or ``"negative"``: the sign of τ you expect, the direction
            of the paired verdict (default: the sign of τ_geo + τ_ada).
        **data_options: ``geosharp measure``'s data options by their Python names:
            ``task``, ``tokenizer``, ``text_col``, ``label_col``, ``source_col``,
            ``target_col``, ``txt_mode``, ``split``, ``batch_size``, ``samples``,
            ``max_length``, ``num_labels``, ``loss``, ``device``, ``dtype``.

    Returns:
        The :class:`StudyTable` (``.dataframe()`` with pandas).

    Raises:
        MeasureError: On a bad manifest or option, before any model is measured.
    """
    from geosharp.measuring.pipeline import MeasureOptions
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    out = Path(out)
    if not isinstance(manifest, (str, Path)):
        manifest = _write_rows(manifest, out)
    known = set(MeasureOptions.__dataclass_fields__) - {"data", "seed"}
    unknown = sorted(set(data_options) - known)
    if unknown:
        raise MeasureError(f"unknown data options {unknown}; known: {', '.join(sorted(known))}")
    opts = dict(data_options)
    opts["device"] = resolve_device(str(opts.get("device", "auto")))
    opts["dtype"] = resolve_dtype(opts.get("dtype", "float32"))
    settings = PopulationSettings(
        manifest=str(manifest),
        options={"data": data, "seed": seed, **opts},
        measures=tuple(measures),
        rho=_rho_plan(rho),
        steps=steps,
        eps=eps,
        seed=seed,
        curvature=curvature,
        gap=gap,
        base=base,
        skip_bad=skip_bad,
        check=check,
    )
    summary = run_population(
        settings, out, force=force, progress=progress, log=log, expected=expected
    )
    cells = json.loads((out / "summary.json").read_text(encoding="utf-8"))["cells"]
    rows = [{k: c.get(k) for k in _CELL_KEYS} for c in cells]
    report = summary.report.html if summary.report is not None else None
    return StudyTable(rows, out, report, read_manifest(manifest, gap=gap).gap_line())


def _rho_plan(rho: Any) -> RadiusPlan:
    if rho is None or isinstance(rho, str):
        return parse_rho(None if rho is None else [rho])
    if isinstance(rho, Mapping):
        return parse_rho([f"{k}=" + ",".join(str(float(r)) for r in v) for k, v in rho.items()])
    return parse_rho([str(float(r)) for r in rho])


def _write_rows(rows: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Rows given in Python as ``OUT/manifest.jsonl`` (paths made absolute from here)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for r in rows:
        r = dict(r)
        for key in ("model", "base", "weights"):
            value = r.get(key)
            if isinstance(value, (str, Path)) and Path(value).exists():
                r[key] = str(Path(value).resolve())
        lines.append(json.dumps(r, default=str))
    path = out / "manifest.jsonl"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
