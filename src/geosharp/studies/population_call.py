"""``geosharp study MANIFEST`` in one Python call: :func:`study` (``gs.study``).

It writes the study folder as the command does (:func:`~geosharp.studies.population.
run_population`) and returns the τ table as rows (:class:`StudyTable`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.errors import MeasureError
from geosharp.studies.manifest import read_manifest
from geosharp.studies.population import (
    DEFAULT_POPULATION_MEASURES,
    PopulationSettings,
    run_population,
)
from geosharp.studies.population_radii import rho_plan

__all__ = ["StudyTable", "study"]


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
    twin_check: bool = False,
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
        twin_check: Then re-measure every model's cells on one random equivalent twin
            (``--twin-check``): ``OUT/twin_check.csv`` and the report's "Twin check" section.
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
        rho=rho_plan(rho),
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
        settings,
        out,
        force=force,
        progress=progress,
        log=log,
        expected=expected,
        twin_check=twin_check,
    )
    cells = json.loads((out / "summary.json").read_text(encoding="utf-8"))["cells"]
    rows = [{k: c.get(k) for k in _CELL_KEYS} for c in cells]
    report = summary.report.html if summary.report is not None else None
    return StudyTable(rows, out, report, read_manifest(manifest, gap=gap).gap_line())


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
