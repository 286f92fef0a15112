r"""``geosharp study MANIFEST --fsdp``: a population study of models sharded by FSDP2.

::

    torchrun --standalone --nproc-per-node N -m geosharp study runs.csv --data DATA --fsdp ...

Every rank runs the same command. :func:`check_study_args` refuses, in one line and before
the manifest is read, what a sharded study cannot run (the refusals of ``geosharp measure
--fsdp``, :func:`geosharp.measuring.fsdp.check_args`, and ``--twin-check``,
``symmetry-test``). ``--curvature`` adds the curvature plan's rows (λ_max and the Hutchinson
trace of four geometries), which each rank measures as ``gs.measure`` does a sharded model's
curvature measures (:func:`geosharp.curvature` on its rows).
Then :class:`ShardedPopulation` is the :class:`~geosharp.studies.population.PopulationStudy`
of the manifest whose models are loaded, sharded and checked as ``geosharp measure --fsdp``
does (:meth:`geosharp.measuring.fsdp.FsdpRun.load`,
:func:`geosharp.measuring.sharded.check_sharded`): every rank loads each model into CPU memory,
``fully_shard`` puts its shard on the rank's device, the rank measures its rows of every
batch, and every rank gets the same values.

**Rank 0 decides, the others follow.** Rank 0 alone writes the study's folder
(``study.sqlite``, ``manifest.json``, ``models.json``, ``results.csv``, the report). What is
left to measure is decided from the store: rank 0 opens it (refusing a folder of another
configuration, on every rank alike) and sends every rank a consistent copy
(:meth:`~geosharp.studies.store.Store.backup`), which each of the others resumes from a
temporary folder of its own. The runner's loop (:func:`~geosharp.studies.runner.run_study`)
then takes the same decisions on every rank, model by model and row by row, so the ranks
enter the same collectives in the same order; a row's value is the same on every rank. The
ρ rule's record (``--rho auto``) is rank 0's, and so is each of its pilot's values.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from geosharp.errors import MeasureError
from geosharp.measuring.fsdp import FsdpRun, check_args
from geosharp.studies.manifest import ManifestRow
from geosharp.studies.population import PopulationSettings, PopulationStudy, curvature_rows
from geosharp.studies.runner import Prepared, RunSummary, run_study
from geosharp.studies.shards import Shard
from geosharp.studies.store import Store

__all__ = ["ShardedPopulation", "check_study_args"]

#: The command, as the refusal of a launch outside ``torchrun`` names it.
COMMAND = "study MANIFEST --data DATA"


def check_study_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> FsdpRun:
    """Refuse, in one line before the manifest is read, what a sharded study cannot run.

    Args:
        args: The parsed ``geosharp study MANIFEST`` (or ``symmetry-test``) arguments.
        env: The environment (default: ``os.environ``).

    Returns:
        The rank's :class:`~geosharp.measuring.fsdp.FsdpRun` (the process group not started).

    Raises:
        MeasureError: ``symmetry-test`` or ``--twin-check`` with ``--fsdp``, a measure of the
            ``--curvature`` plan that refuses a sharded model (none does: its trace is
            Hutchinson's), or what :func:`~geosharp.measuring.fsdp.check_args` refuses (not
            under ``torchrun``, a measure a sharded model cannot be measured with,
            ``--device cuda:N``, rows the ranks cannot split evenly).
    """
    if getattr(args, "command", "study") == "symmetry-test":
        raise MeasureError(
            "--fsdp: geosharp symmetry-test re-parametrizes every model by a random group "
            "element, which is not implemented for a sharded model yet; run it without --fsdp "
            "(docs/cluster.md)"
        )
    if getattr(args, "twin_check", False):
        raise MeasureError(
            "--fsdp with --twin-check: a twin is a deep copy of the model, which a model "
            "sharded by FSDP2 cannot be; run the twin check without --fsdp (docs/cluster.md)"
        )
    if args.curvature:
        from geosharp.measuring.sharded import refusal

        for spec in curvature_rows(args.iters, args.probes, args.seed):
            why = refusal(spec.measure, spec.kwargs)  # the measure says (its shard_refusal)
            if why is not None:
                raise MeasureError(f"--fsdp with --curvature: {why}")
    return check_args(args, env, command=COMMAND)


def _quiet(_msg: str) -> None:
    """What a rank other than 0 says: nothing (rank 0 says it)."""


class ShardedPopulation(PopulationStudy):
    """A population whose every model is sharded over the ranks (see the module docstring).

    Args:
        settings: The study's :class:`~geosharp.studies.population.PopulationSettings` (the
            same configuration as without ``--fsdp``: a study can be resumed either way).
        run: This rank's :class:`~geosharp.measuring.fsdp.FsdpRun` (:func:`check_study_args`).
        log: Where rank 0's progress lines go (the other ranks say nothing).
    """

    def __init__(
        self,
        settings: PopulationSettings,
        run: FsdpRun,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.run = run
        self.writes = run.rank == 0
        self.warn = log if self.writes and log is not None else _quiet
        super().__init__(settings, log=log if self.writes else _quiet)

    def agree(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return self.run.agree(obj)

    def prepare_row(self, row: ManifestRow) -> Prepared:
        """Load, shard and check one manifest row on every rank (``geosharp measure --fsdp``)."""
        from geosharp.measuring.pipeline import ModelSource
        from geosharp.measuring.sharded import check_sharded

        self.say(f"{row.model_id}: loading {row.model}")
        source = ModelSource(row.model, weights=row.weights, base=row.base)
        ready, model, batches, loss = self.run.load(source, self.options, self.say, self.warn)
        # the plan's measures (--curvature's geodesic rows use the blocks too)
        checked = check_sharded(model, batches, loss, self.planned_measures(), self.say)
        self._models[row.model_id] = {
            "model": ready.loaded.name,
            "kind": ready.loaded.kind,
            "task": ready.task,
            "blocks": "the architecture's, as find_symmetries claims them, on each rank's rows "
            "(not proven on the data: --fsdp)",
            "clean_loss": sum(checked.clean_losses) / len(checked.clean_losses),
        }
        from geosharp.measuring.sharded import sharded_reference_loss

        reference = sharded_reference_loss(model, checked.loss_fn, checked.batches, checked.shards)
        return Prepared(
            checked.model, checked.batches, checked.loss_fn, clean_losses=checked.clean_losses,
            reference=reference, judged=True,
        )  # fmt: skip

    def settings(self) -> dict[str, Any]:  # noqa: D102
        r = self.run
        return {
            **super().settings(),
            "sharded": f"FSDP2 over {r.world} ranks ({r.backend}, {r.device.type}): every "
            "transformer layer and the root, the rows of every batch split evenly",
        }

    def notes(self) -> list[str]:  # noqa: D102
        from geosharp.measuring.sharded import SKIPPED

        return [
            *super().notes(),
            f"--fsdp: the symmetry blocks are {SKIPPED['symmetry_search']}",
            f"--fsdp: the self-check was {SKIPPED['self_check']}",
        ]

    def measure_all(
        self, out: Path, *, force: bool, progress: bool | None, shard: Shard | None
    ) -> RunSummary:
        """The runner's loop on every rank, from rank 0's store (see the module docstring)."""
        made: bytes | BaseException | None = None
        if self.writes:
            try:
                made = _snapshot(out / "study.sqlite", self.name, self.config(), force)
            except (ValueError, OSError, sqlite3.Error) as err:  # a folder of another study
                made = err
        made = self.agree(made)
        if isinstance(made, BaseException):
            raise made
        if self.writes:
            return run_study(
                self, out, force=force, progress=progress, shard=shard, report=False, log=self.say
            )
        with tempfile.TemporaryDirectory(prefix="geosharp-fsdp-rank") as tmp:
            (Path(tmp) / "study.sqlite").write_bytes(made)
            return run_study(
                self, tmp, force=force, progress=False, shard=shard, report=False, log=_quiet
            )


def _snapshot(db: Path, name: str, config: dict[str, Any], force: bool) -> bytes:
    """The bytes of a consistent copy of the store at ``db``, opened as the runner opens it."""
    with Store(db, name, config, force=force) as store, tempfile.TemporaryDirectory() as tmp:
        return store.backup(Path(tmp) / "study.sqlite").read_bytes()
