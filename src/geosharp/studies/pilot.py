"""The pilot of ``--rho auto``: a typical model of the manifest, never one at chance (issue 40).

The ρ rule (:mod:`geosharp.studies.rho_rule`) sets every measure's grid on one pilot model's
sharpness. A pilot that is not typical of the population sets the wrong grid for all of it: a
model stuck at chance (clean loss ≈ ln 2 on two classes) has no basin, its loss rises slowly
under any perturbation, and the rule then chose radii two decades above the ones a trained
pilot gives (3.16 / 10 / 31.6 instead of 0.0316 / 0.1 / 0.316), without a word.

So, unless the user names the pilot (``--rho auto:NAME``):

* the candidates are the manifest's models in order of how typical their generalization gap is
  (:func:`pilot_order`: the median gap first, then outwards) — the gap is the only number every
  manifest row has, and choosing by it looks at no sharpness and no τ;
* a candidate whose clean loss is at least :data:`~geosharp.measuring.flags.AT_CHANCE` of the
  trivial predictor's (all-zero outputs, :func:`~geosharp.measuring.flags.reference_loss`) is
  set aside with a line saying so, and the next is tried (:func:`at_chance`), up to
  :data:`MAX_CANDIDATES`; if all of those are at chance the study stops with one line;
* a named pilot at chance stops the study with one line (the user chose it: choose another).

After the ladder, a pilot cell at the chosen centre ρ that is flagged (``unstable``,
``saturated``, ``rising``: :mod:`geosharp.measuring.flags`) is said in a warning line, and
``manifest.json`` records the pilot, why it was chosen and the models set aside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from geosharp.estimators.sharded.check import is_sharded
from geosharp.measuring.checks import clean_pass
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.flags import AT_CHANCE, reference_loss
from geosharp.studies.manifest import ManifestRow
from geosharp.studies.runner import Prepared

__all__ = ["MAX_CANDIDATES", "PilotChoice", "at_chance", "choose_pilot", "pilot_order"]

#: Candidates tried, most typical first, before a study without a usable pilot stops.
MAX_CANDIDATES = 5


def pilot_order(rows: Sequence[ManifestRow]) -> list[ManifestRow]:
    """The rows, the most typical generalization gap first: the median, then outwards.

    Ties keep manifest order.

    Example:
        >>> from geosharp.studies.manifest import ManifestRow
        >>> rows = [ManifestRow(i + 1, f"m{i}", "x", None, None, g)
        ...         for i, g in enumerate([0.5, 0.1, 0.3, 0.2, 0.9])]
        >>> [r.model_id for r in pilot_order(rows)]
        ['m2', 'm0', 'm3', 'm1', 'm4']
    """
    ranked = sorted(range(len(rows)), key=lambda i: (rows[i].gap, i))
    mid = (len(rows) - 1) / 2
    position = {i: abs(r - mid) for r, i in enumerate(ranked)}
    return [rows[i] for i in sorted(range(len(rows)), key=lambda i: (position[i], i))]


def at_chance(ready: Prepared) -> str | None:
    """Why the model is at chance (clean loss near the trivial predictor's), or ``None``.

    The clean losses and the reference that loading the model computed (:class:`Prepared`,
    ``judged``), else one forward per batch for each; ``None`` too when the loss has no trivial
    predictor (a loss reading the model's own output type), and for a sharded model that was
    not judged when loaded.
    """
    if ready.judged:
        reference, losses = ready.reference, ready.clean_losses
    elif is_sharded(ready.model):
        return None
    else:
        reference = reference_loss(ready.model, ready.loss_fn, ready.batches)
        losses = None
    if reference is None:
        return None
    losses = losses or clean_pass(ready.model, ready.loss_fn, ready.batches)
    clean = sum(losses) / len(losses)
    if clean < AT_CHANCE * reference:
        return None
    return (
        f"at chance: its clean loss {clean:.4g} is {clean / reference:.0%} of the trivial "
        f"predictor's {reference:.4g} (a model with no basin sets radii far too large)"
    )


@dataclass
class PilotChoice:
    """The pilot and how it was chosen (recorded in ``manifest.json``).

    Attributes:
        row: The pilot's manifest row.
        ready: It, loaded and checked.
        why: Why this model.
        set_aside: ``{"model": id, "why": reason}`` of every candidate not taken.
    """

    row: ManifestRow
    ready: Prepared
    why: str
    set_aside: list[dict[str, str]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The JSON of the choice."""
        return {"pilot": self.row.model_id, "why": self.why, "set_aside": self.set_aside}


def choose_pilot(
    rows: Sequence[ManifestRow],
    named: ManifestRow | None,
    load: Callable[[ManifestRow], Prepared],
    say: Callable[[str], None],
    judge: Callable[[Prepared], str | None] = at_chance,
) -> PilotChoice:
    """The pilot: the named row, or the most typical row not at chance.

    Args:
        rows: The manifest's rows.
        named: The row ``--rho auto:NAME`` names, or ``None``.
        load: Loads and checks a row (``PopulationStudy.prepare_row``).
        say: Where each decision is said.
        judge: Why a loaded model cannot be the pilot, or ``None`` (default :func:`at_chance`).

    Raises:
        MeasureError: If the named pilot, or every candidate tried, is at chance.
    """
    if named is not None:
        ready = load(named)
        why = judge(ready)
        if why is not None:
            raise MeasureError(
                f"--rho auto:{named.model_id}: the pilot is {why}; name a trained model, or pass "
                "--rho auto to let geosharp choose a typical one"
            )
        return PilotChoice(named, ready, "named by --rho auto:NAME")
    order = pilot_order(rows)
    set_aside: list[dict[str, str]] = []
    for k, row in enumerate(order[:MAX_CANDIDATES]):
        ready = load(row)
        why = judge(ready)
        if why is None:
            rank = "the median" if k == 0 else f"the {_ordinal(k + 1)} closest to the median"
            text = f"a typical model: its generalization gap {row.gap:.4g} is {rank} of {len(rows)}"
            if set_aside:
                text += f" ({len(set_aside)} more typical model(s) set aside: at chance)"
            return PilotChoice(row, ready, text, set_aside)
        say(f"radii: {row.model_id} is not a usable pilot, {why}")
        set_aside.append({"model": row.model_id, "why": why})
    raise MeasureError(
        f"--rho auto: the {len(set_aside)} most typical models are at chance (e.g. "
        f"{set_aside[0]['model']}: {set_aside[0]['why']}); name a trained pilot with "
        "--rho auto:NAME or give the radii with --rho"
    )


def _ordinal(n: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(n, f"{n}th")
