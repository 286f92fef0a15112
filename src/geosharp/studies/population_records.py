"""What a population study records beside its store: ``OUT/manifest.json`` and ``OUT/models.json``.

* :func:`write_manifest_record` — ``manifest.json`` (:data:`~geosharp.studies.population_sections.
  MANIFEST_FILE`): the manifest, its gap rule, hyperparameters and skipped rows, the radius plan
  and, under ``--rho auto``, the ρ rule's pilot, how it was chosen and its grids (a resumed run
  reuses them: :meth:`~geosharp.studies.population.PopulationStudy.decide_radii`);
  :func:`recorded_pilot` reads the pilot back, so that writing the record again keeps it;
* :func:`write_models` — ``models.json`` (:data:`~geosharp.studies.population_sections.
  MODELS_FILE`): the architecture, blocks and batches of every model measured, and the batches
  as they were cut in the report's settings of ``study.sqlite``;
* :func:`read_json` — a record as a dict (empty when it is missing or not a JSON object).

:class:`~geosharp.studies.population.PopulationStudy` calls them on the process that writes the
folder (under ``--fsdp``, rank 0).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.studies.manifest import Manifest
from geosharp.studies.population_radii import RadiusPlan
from geosharp.studies.population_sections import MANIFEST_FILE, MODELS_FILE, batches_used

__all__ = ["read_json", "recorded_pilot", "write_manifest_record", "write_models"]


def write_manifest_record(
    out: Path,
    m: Manifest,
    rho: RadiusPlan,
    grids: Mapping[str, tuple[float, ...]],
    pilot: str | None = None,
    choice: dict[str, Any] | None = None,
) -> None:
    """Write ``OUT/manifest.json``: the manifest ``m``, the radius plan ``rho`` and its grids.

    Args:
        out: The study folder (made if missing).
        m: The manifest.
        rho: The radius plan.
        grids: Every measure's grid (recorded under ``--rho auto``).
        pilot: The ρ rule's pilot, if any.
        choice: How it was chosen (:meth:`~geosharp.studies.pilot.PilotChoice.record`).
    """
    record = {
        "manifest": str(m.path),
        "gap_rule": m.gap_rule.key,
        "gap": m.gap_line(),
        "hyperparameters": m.hparam_names,
        "skipped": [{"row": line, "model": label, "why": why} for line, label, why in m.skipped],
        "rho": rho.text(),
    }
    if rho.pilot is not None:
        record["rho_rule"] = {
            "plan": asdict(rho),
            "pilot": pilot,
            "grids": {k: list(v) for k, v in grids.items()},
        }
        if choice is not None:
            record["rho_rule"]["pilot_choice"] = choice
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MANIFEST_FILE, json.dumps(record, indent=1) + "\n")


def write_models(out: Path, models: Mapping[str, dict[str, Any]], options: Any) -> None:
    """``OUT/models.json``: the architecture, blocks and batches of every model measured.

    The report's settings then say the batches as they were cut (the samples the data
    held, the length each model accepts), not only as asked.

    Args:
        out: The study folder.
        models: Model id → what was recorded of it when it was loaded (added to the file's).
        options: The study's data options (:class:`~geosharp.measuring.pipeline.MeasureOptions`).
    """
    old = read_json(out / MODELS_FILE)
    old.update(models)
    atomic_write_text(out / MODELS_FILE, json.dumps(old, indent=1) + "\n")
    o = options
    used = batches_used(old, o.batch_size, o.samples, o.max_length)
    if used is not None and (out / "study.sqlite").is_file():
        from geosharp.studies.store import Store, report_info

        with Store(out / "study.sqlite", None, None) as store:
            info = report_info(store.meta())
            info.setdefault("settings", {})["batches"] = used
            with store.conn:
                store.conn.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('report', ?)",
                    (json.dumps(info, default=str),),
                )


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (empty when the file is missing, not JSON or not an object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def recorded_pilot(out: Path) -> tuple[str | None, dict[str, Any] | None]:
    """The recorded pilot and how it was chosen (kept when the record is written again)."""
    rule = read_json(out / MANIFEST_FILE).get("rho_rule", {})
    return rule.get("pilot"), rule.get("pilot_choice")
