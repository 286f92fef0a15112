"""``geosharp study MANIFEST --twin-check``: every model's cells again, on one equivalent twin.

After a study's models are measured, :func:`run_twin_check` takes each model of the run (of its
shard) that ``twin_check.csv`` does not hold yet, loads it as the study did
(:meth:`~geosharp.studies.runner.Study.prepare`: the same batches, loss and symmetry blocks),
makes one random equivalent twin (:func:`geosharp.measuring.twin.make_twin`: a deep copy with a
random group element of scale 10 on every block, in the model's own dtype and on its device,
seeded by :func:`twin_seed` from the study's seed and the model's name) and measures the twin
with :func:`geosharp.measure` — the study's measures with a radius, at the study's radii, steps,
ε and seed. Each model's lines (the stored value and flags beside the twin's) are added to
``OUT/twin_check.csv`` at once (:func:`geosharp.studies.twin_section.add_rows`), so a killed
run resumes at the next model, and the report shows them as its "Twin check" section.

The cost: one more measurement of every cell with a radius (and ``gs.measure``'s own time
estimate, a few ascent steps on one batch per measure). Cells without a radius (curvature,
relative flatness) are not re-measured. A model sharded by FSDP2 cannot be copied: ``--fsdp``
with ``--twin-check`` is refused before any work
(:func:`geosharp.studies.population_fsdp.check_study_args`).
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from geosharp.errors import MeasureError
from geosharp.estimators.sharded.check import is_sharded
from geosharp.measuring.results import flags_text, rho_text
from geosharp.measuring.twin import TWIN_TOL, make_twin, output_change, promised, relative_change
from geosharp.studies.runner import Study, StudyMeasure
from geosharp.studies.shards import Shard
from geosharp.studies.store import Store
from geosharp.studies.twin_section import TWIN_FILE, add_rows, is_flagged, read_rows

__all__ = ["TWIN_SCALE", "run_twin_check", "twin_seed"]

#: Scale ``a`` of every twin's group element (``gs.reparametrize``'s; as in issue 40).
TWIN_SCALE = 10.0
#: The run settings of a study's measure that ``gs.measure`` takes as they are.
_MEASURE_SETTINGS = ("steps", "eps", "seed", "exact_steps", "low_memory", "buffer_budget")


def twin_seed(seed: int, model_id: str) -> int:
    """The seed of a model's twin: from the study's seed and the model's name (CRC-32).

    Example:
        >>> twin_seed(0, "a") == twin_seed(0, "a") != twin_seed(1, "a")
        True
    """
    return zlib.crc32(f"{seed}:{model_id}".encode())


def _groups(specs: Sequence[StudyMeasure]) -> list[tuple[list[StudyMeasure], list[float], dict]]:
    """The specs with a radius, grouped by grid and settings: one ``gs.measure`` call each."""
    groups: dict[str, tuple[list[StudyMeasure], list[float], dict]] = {}
    for spec in specs:
        m = spec.measure
        if not m.uses_rho:
            continue
        run = {k: v for k, v in spec.kwargs.items() if k not in m.kwargs()}
        other = sorted(set(run) - set(_MEASURE_SETTINGS))
        if other:
            raise MeasureError(
                f"--twin-check: the measure {m.name} runs with {', '.join(other)}, which "
                "gs.measure does not take; its twin cannot be measured the same way"
            )
        grid = sorted(float(r) for r in spec.rhos if r is not None)
        key = json.dumps([grid, run], sort_keys=True, default=str)
        groups.setdefault(key, ([], grid, run))[0].append(spec)
    return list(groups.values())


def _stored(rows: Sequence[Mapping[str, Any]], spec: StudyMeasure, rho: float) -> Any:
    """The store's row of a cell as the plan measures it (the last, if several)."""
    want = json.loads(json.dumps({**spec.kwargs, "rho": rho}, default=str))
    found = None
    for r in rows:
        if r["measure"] == spec.name and r["rho"] == rho and r["settings"] == want:
            found = r
    return found


def run_twin_check(
    study: Study,
    out_dir: str | Path,
    *,
    shard: Shard | None = None,
    check: bool = True,
    progress: bool | None = None,
    scale: float = TWIN_SCALE,
    log: Callable[[str], None] | None = None,
) -> int:
    """Re-measure the cells of every model of the run on one random equivalent twin.

    Args:
        study: The study whose folder it is (its plan gives the measures and radii).
        out_dir: The study folder (``study.sqlite``; ``twin_check.csv`` is written there).
        shard: Only the models of this part (the ones this run measured).
        check: Run ``gs.measure``'s self-check on each twin.
        progress: Progress bars of the twin's measurement.
        scale: Scale of the group elements.
        log: Where the one-line status messages go (default: the study's).

    Returns:
        The number of models re-measured by this call (the others were in the file).

    Raises:
        MeasureError: A model sharded by FSDP2 (a twin is a deep copy), or a measure whose run
            settings ``gs.measure`` does not take.
    """
    from geosharp.measuring.core import measure
    from geosharp.symmetry import find_symmetries

    out = Path(out_dir)
    say = log or getattr(study, "say", None) or (lambda _msg: None)
    groups = _groups(study.plan())
    done = {r["model_id"] for r in read_rows(out / TWIN_FILE)}
    with Store(out / "study.sqlite", None, None) as store:
        models = {m["model_id"]: m for m in store.models()}
        stored = store.measurements()
    ids = [mid for mid, _ in study.population()]
    mine = shard.take(ids) if shard else ids
    todo = [m for m in mine if m in models and m not in done and study.included(models[m])]
    if not groups:
        say("twin check: no measure of the plan has a radius; nothing to re-measure")
        return 0
    say(
        f"twin check: {len(todo)} model(s) to re-measure on a random equivalent twin "
        f"(scale {scale:g}; {len(mine) - len(todo)} done before or not measured)"
    )
    for mid in todo:
        row = dict(models[mid])
        if row.get("checkpoint"):
            row["checkpoint_path"] = str(out / row["checkpoint"])
        with _quiet(study):  # its loading and blocks were said when it was measured
            ready = study.prepare(row, study.batches())
        if is_sharded(ready.model):
            raise MeasureError(
                "--twin-check: a model sharded by FSDP2 cannot be copied into a twin; run the "
                "twin check without --fsdp"
            )
        space = ready.settings.get("space") or find_symmetries(ready.model, key_bias=study.key_bias)
        mine_stored = [r for r in stored if r["model_id"] == mid]
        seed = twin_seed(int(getattr(getattr(study, "cfg", None), "seed", 0)), mid)
        first = next(iter(ready.model.parameters()))
        base = {"model_id": mid, "scale": scale, "seed": seed,
                "dtype": str(first.dtype).replace("torch.", "")}  # fmt: skip
        if not space.blocks:
            say(f"twin check {mid}: no symmetry blocks, so no twin but itself: nothing to check")
            add_rows(out, [{**base, "error": "no symmetry blocks: no twin to compare"}])
            continue
        twin = make_twin(ready.model, space, seed, scale)
        base["output_change"] = output_change(ready.model, twin, ready.batches[0][0])
        lines = []
        for specs, grid, run in groups:
            try:
                rep = measure(
                    twin, ready.batches, ready.loss_fn, measures=[s.measure for s in specs],
                    rhos=grid, space=space, check=check, progress=progress,
                    warn=lambda _msg: None, **run,
                )  # fmt: skip
                twins = {(r.measure, r.rho): r for r in rep.rows}
                failed = None
            except MeasureError as err:
                twins, failed = {}, f"twin: {err}"
            for spec in specs:
                for rho in grid:
                    lines.append(_line(base, spec.name, rho, _stored(mine_stored, spec, rho),
                                       twins.get((spec.name, rho)), failed))  # fmt: skip
        add_rows(out, lines)
        say(_summary_line(mid, lines))
    return len(todo)


@contextlib.contextmanager
def _quiet(study: Study) -> Iterator[None]:
    """The study's ``say`` silenced (a population's loading lines, said once already)."""
    said = getattr(study, "say", None)
    if said is None:
        yield
        return
    study.say = lambda _msg: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        study.say = said  # type: ignore[attr-defined]


def _line(
    base: Mapping[str, Any], name: str, rho: float, mine: Any, theirs: Any, failed: str | None
) -> dict[str, Any]:
    """One line of ``twin_check.csv``: the stored cell beside the twin's."""
    value = mine["value"] if mine is not None and mine.get("error") is None else None
    twin_value = theirs.value if theirs is not None else None
    errors = [
        "model: " + (mine.get("error") or "") if mine is not None and mine.get("error") else "",
        "model: not in the store" if mine is None else "",
        f"twin: {theirs.error}" if theirs is not None and theirs.error else "",
        failed or "",
    ]
    change = relative_change(value, twin_value)
    return {
        **base,
        "measure": name,
        "rho": rho_text(rho),
        "value": value,
        "twin_value": twin_value,
        "relative_change": change,
        "flags": flags_text(mine.get("flags") if mine is not None else ()),
        "twin_flags": " ".join(theirs.flags) if theirs is not None else "",
        "error": "; ".join(e for e in errors if e) or None,
    }


def _summary_line(mid: str, lines: Sequence[Mapping[str, Any]]) -> str:
    """What the log says of one model's twin: its geodesic cells' worst change and moves."""
    geo = [r for r in lines if promised(r["measure"]) and r["relative_change"] is not None]
    moved = [r for r in geo if r["relative_change"] > TWIN_TOL]
    silent = [r for r in moved if not is_flagged(r)]
    worst = max((r["relative_change"] for r in geo), default=math.nan)
    return (
        f"twin check {mid}: {len(lines)} cells, the geodesic ones moved by at most "
        f"{worst:.1e} relative; {len(moved)} moved by more than {TWIN_TOL:g} "
        f"({len(moved) - len(silent)} flagged, {len(silent)} silent)"
    )
