r"""``gs.measure`` of a model sharded by FSDP2: the sharpness and curvature measures, by shard.

A model whose trainable parameters are ``DTensor``\ s sharded by
``torch.distributed.fsdp.fully_shard`` is measured by the sharded paths of
:func:`geosharp.sharpness` and :func:`geosharp.curvature` (:mod:`geosharp.estimators.sharded`):
every rank passes its own rows of every batch, and every rank gets the same values. Every
sharpness measure is measured: the element-wise ones (adaptive, Euclidean; ℓ2 or ℓ∞),
geodesic sharpness (metric inv or mix, order 1, 2 or exact) and the attention-only measures
(``-blocks``), whose symmetry blocks are laid out on each rank's rows and whose ``h × h``
contractions are summed over the ranks (SPEC §10.6; the rows of a block must not be split
across ranks: :func:`geosharp.shard_placement`), worst case and average case (every rank
draws its part of the noise one process would draw); so is every curvature
measure (λ_max, λ_min and the trace by Hutchinson or Hutch++ of the geodesic, adaptive and
Euclidean geometries; the exact trace is refused). Each measure says whether it runs sharded
(:meth:`~geosharp.measures.Measure.shard_refusal`) and whether it uses the symmetry blocks
(:attr:`~geosharp.measures.Measure.uses_blocks`: then they are laid out on the ranks' rows
before any measurement); whether the model is sharded is the model's own state
(:func:`~geosharp.estimators.sharded.check.is_sharded`). What
:func:`~geosharp.measuring.core.measure` does around the measurements runs here without
gathering the weights whole:

- **refused before any work** (:func:`check_plan`), one line each: what a measure refuses
  (relative flatness; the curvature trace with ``trace_method="exact"``);
- **checked, collectively**: every trainable parameter is a sharded ``DTensor`` on one mesh
  (:class:`~geosharp.estimators.sharded.params.ShardedParams`), no weight's ``1/w²`` overflows
  (counted on the shards and summed over the ranks: a sharded model is not copied, so it is
  refused rather than flushed), every rank holds as many batches and, batch by batch, as many
  rows (the batch's loss is the mean of the ranks' losses), and the clean loss of every batch —
  a plain forward of the model (FSDP gathers one layer at a time), the mean over ranks — is
  finite with valid labels. A rank whose batch fails tells the others, so that every rank
  raises the same error instead of waiting for it;
- **skipped, with the reason in the result** (:data:`SKIPPED`, the report's
  ``settings["sharded"]["skipped"]``): the proof of the symmetry blocks on the data, the
  invariance self-check and the time estimate. Each re-runs the model with substituted weights
  (:func:`torch.func.functional_call`), which FSDP's own gathers of the shards would bypass. The
  geodesic and attention-only measures still find their blocks
  (:func:`~geosharp.symmetry.find_symmetries`, inside :func:`geosharp.sharpness` and
  :func:`geosharp.curvature`): those are the architecture adapters' structural claims for the
  model, not re-proven on its data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geosharp.estimators.sharded.params import ShardedParams
from geosharp.estimators.sharded.space import local_space
from geosharp.measures import Measure
from geosharp.measures.base import accepted
from geosharp.measuring.checks import batch_loss, check_finite_loss, count_unrepresentable
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.estimate import _rows, batch_sizes
from geosharp.symmetry import ParameterSpace
from geosharp.symmetry.verify import eval_mode, model_arguments

__all__ = [
    "SKIPPED",
    "ShardedCheck",
    "check_plan",
    "check_sharded",
    "prepare_sharded",
    "refusal",
]

#: What ``gs.measure`` does not run on a sharded model, and why (recorded in the result).
SKIPPED = {
    "symmetry_search": "not proven on a sharded model: the geodesic and attention-only measures "
    "find the symmetry blocks inside gs.sharpness and gs.curvature (find_symmetries: the "
    "architecture adapters' "
    "structural claims for this model), but proving them on the data "
    "(geosharp.symmetry.prove) re-runs the model with substituted weights "
    "(torch.func.functional_call), which FSDP's gathers of the shards bypass: the blocks used "
    "are the finder's claims for the architecture, not re-proven on this model's data (the "
    "element-wise measures use no blocks)",
    "self_check": "not run on a sharded model: it re-parametrizes the symmetry blocks by a "
    "random group element and re-runs the model with the substituted weights "
    "(torch.func.functional_call), which FSDP's gathers of the shards bypass",
    "time_estimate": "not made for a sharded model: its timing passes substitute weights "
    "(torch.func.functional_call), which FSDP's gathers of the shards bypass",
}

#: The measures a sharded model is measured with, as ``geosharp measure --measures`` reads them.
SUPPORTED = (
    "every sharpness measure (adaptive, euclidean, geodesic inv|mix at order 1, 2 or exact, "
    "the attention-only -blocks measures; worst and average case) and every curvature measure "
    "(lmax, lmin, the trace by hutchinson or hutch++)"
)


def refusal(spec: Measure, settings: Mapping[str, Any] | None = None) -> str | None:
    """Why ``spec`` cannot be measured on a sharded model yet, in one line (``None``: it can).

    The measure says (:meth:`~geosharp.measures.Measure.shard_refusal`), given those of the
    run's ``settings`` that its ``shard_refusal`` takes as keywords (a curvature measure's
    ``trace_method``).
    """
    why = spec.shard_refusal(**accepted(spec.shard_refusal, settings or {}))
    if why is None:
        return None
    return (
        f"{spec.name} on a sharded (FSDP2) model: {why}; a sharded model is measured with "
        f"{SUPPORTED} (docs/cluster.md)"
    )


def check_plan(
    specs: Sequence[Measure],
    space: ParameterSpace | None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, in one line before any work, what ``gs.measure`` cannot measure sharded.

    ``settings``: the run's (e.g. ``MeasureSettings.curvature``), for :func:`refusal`.

    Raises:
        MeasureError: For the first measure :func:`refusal` refuses, or a ``space`` given.
    """
    for spec in specs:
        why = refusal(spec, settings)
        if why is not None:
            raise MeasureError(why)
    if space is not None:
        raise MeasureError(
            "space: a sharded model's parameter space is its ranks' shards, which every "
            "measure lays out itself (the symmetry blocks on the rank's rows); pass space=None"
        )


@dataclass
class ShardedCheck:
    """A sharded model checked and ready to measure (:func:`prepare_sharded`).

    The fields :func:`~geosharp.measuring.core.measure` reads of a ``CheckedModel``, and what
    the report records of the sharding.

    Attributes:
        model: The model.
        batches: The rank's rows of every batch, on the shards' device.
        loss_fn: The loss.
        loss_name: Its name.
        space: ``None`` (the measures build the space of the shards themselves).
        summary: The symmetry summary: the blocks are not proven on the data, and why.
        adaptive_note: Which coordinates use the adaptive geometry (every one for the
            element-wise measures; those outside the blocks for the geodesic ones).
        clean_losses: The loss of every batch (the mean over ranks), all finite.
        invariance: ``None`` (the self-check was not run: :data:`SKIPPED`).
        shards: The checked shards.
        rows: The rows of every batch, summed over the ranks.
        longest_input: The widest batch of token ids over the ranks (``None``: not token ids).
    """

    model: nn.Module
    batches: list
    loss_fn: Callable
    loss_name: str
    space: None
    summary: str
    adaptive_note: str
    clean_losses: list[float]
    invariance: None
    shards: ShardedParams
    rows: list[int | None]
    longest_input: int | None

    @property
    def n_samples(self) -> int | None:
        """Samples in all batches over all ranks, if the batches say."""
        if any(r is None for r in self.rows):
            return None
        return sum(r for r in self.rows if r is not None)

    def settings(self) -> dict[str, Any]:
        """What the report records of the model, the batches and the sharding."""
        first = self.shards.locals[0]
        sizes: dict[str, Any] = {}
        if self.rows and all(r is not None for r in self.rows):
            sizes["largest_batch"] = max(r for r in self.rows if r is not None)
        if self.longest_input is not None:
            sizes["longest_input"] = self.longest_input
        return {
            **sizes,
            "n_params": self.shards.numel,
            "device": str(first.device),
            "dtype": str(first.dtype).replace("torch.", ""),
            "sharded": {
                "world": self.shards.world,
                "shard_dims": sorted({p.placements[0].dim for p in self.shards.params}),
                "skipped": dict(SKIPPED),
            },
        }


def check_sharded(
    model: nn.Module,
    batches: Any,
    loss_fn: Any,
    specs: Sequence[Measure],
    say: Callable[[str], None],
) -> ShardedCheck:
    """What ``gs.measure`` does to a sharded model before measuring it with ``specs``.

    The loss resolved, the rank's rows as a list on the shards' device, then
    :func:`prepare_sharded`, which lays the symmetry blocks out on the ranks' rows first when a
    measure of ``specs`` uses them (:attr:`~geosharp.measures.Measure.uses_blocks`: geodesic
    sharpness or curvature, the attention-only measures).
    ``geosharp study MANIFEST --fsdp`` runs it for every model. Every rank must call it
    (collective).
    """
    from geosharp.measuring.losses import resolve_loss
    from geosharp.measuring.prepare import _prepare_batches

    loss_fn, loss_name = resolve_loss(loss_fn)
    batches, loss_name = _prepare_batches(model, batches, loss_fn, loss_name)
    blocks = any(m.uses_blocks for m in specs)  # each measure says (Measure.uses_blocks)
    return prepare_sharded(model, batches, loss_fn, loss_name, say, blocks=blocks)


def prepare_sharded(
    model: nn.Module,
    batches: list,
    loss_fn: Callable,
    loss_name: str,
    say: Callable[[str], None],
    blocks: bool = False,
) -> ShardedCheck:
    """Check a sharded model and the rank's rows of the batches, collectively (module docs).

    Every rank must call it with its own rows of the same batches.

    Args:
        model: The model, every trainable parameter a sharded ``DTensor``.
        batches: The rank's rows of every batch, as a list on the shards' device.
        loss_fn: The loss (resolved).
        loss_name: Its name.
        say: Called with what was checked or skipped.
        blocks: Some measure uses the symmetry blocks: lay them out on the ranks' rows now
            (:func:`~geosharp.estimators.sharded.space.local_space`), so that a row split
            across ranks is refused before any measurement.

    Returns:
        A :class:`ShardedCheck`.

    Raises:
        MeasureError: On every rank alike: a parameter not sharded on one mesh, weights whose
            ``1/w²`` overflows, the ranks holding different batches or rows, or a clean loss
            that fails or is not finite.
    """
    try:
        shards = ShardedParams(model, in_place=True)  # checks only: nothing is copied or moved
    except ValueError as err:
        raise MeasureError(str(err)) from err
    _check_representable(shards)
    if blocks:
        try:
            space, _ = local_space(model, shards, "quotient")  # the rank's rows
        except (ValueError, NotImplementedError) as err:  # on every rank alike
            raise MeasureError(str(err)) from err
        n = sum(b.count for b in space.blocks)
        say(f"symmetry blocks: {len(space.blocks)} ({n} heads or factors) on every rank's rows")
    rows, widest = _check_rows(shards, batches)
    say(f"symmetry blocks: {SKIPPED['symmetry_search']}")
    say(f"self-check: {SKIPPED['self_check']}")
    clean = _clean_pass(model, loss_fn, batches, shards)
    say(
        f"clean loss: {sum(clean) / len(clean):.6g} (mean over {len(clean)} batch(es), all "
        f"finite; each the mean of the {shards.world} ranks' losses on their rows)"
    )
    summary = f"symmetry blocks: {SKIPPED['symmetry_search']}"
    note = (
        f"adaptive geometry: every trainable coordinate ({shards.numel:,}) in the element-wise "
        "measures (or the Euclidean geometry); the geodesic and attention-only measures give "
        "the symmetry blocks that find_symmetries claims for the architecture their own "
        "geometry, on each rank's rows, and every other coordinate the adaptive one"
    )
    return ShardedCheck(
        model=model,
        batches=batches,
        loss_fn=loss_fn,
        loss_name=loss_name,
        space=None,
        summary=summary,
        adaptive_note=note,
        clean_losses=clean,
        invariance=None,
        shards=shards,
        rows=rows,
        longest_input=widest,
    )


def _check_representable(shards: ShardedParams) -> None:
    """Refuse weights whose ``1/w²`` overflows, counted on the shards and summed over ranks."""
    n = sum(count_unrepresentable(t.detach()) for t in shards.locals if t.is_floating_point())
    total = int(shards.sum(torch.tensor(float(n))))
    if total:
        raise MeasureError(
            f"{total} weight(s) of the sharded model are so small that 1/w² overflows "
            f"{shards.locals[0].dtype} (the adaptive metric cannot be evaluated there); a sharded "
            "model is not copied, so set them to 0 before fully_shard "
            "(geosharp.measuring.checks.flush_unrepresentable; geosharp measure --fsdp does)"
        )


def _check_rows(shards: ShardedParams, batches: list) -> tuple[list[int | None], int | None]:
    """The rows of every batch summed over the ranks, and the widest input over the ranks.

    Raises:
        MeasureError: If the ranks hold different numbers of batches, or of rows of a batch.
    """
    local = [
        _rows(b[0], b[1]) if isinstance(b, (tuple, list)) and len(b) == 2 else None for b in batches
    ]
    everyone = shards.exchange((local, batch_sizes(batches).get("longest_input")))
    counts = [len(rows) for rows, _ in everyone]
    if any(c != counts[0] for c in counts):
        raise MeasureError(
            f"the ranks hold different numbers of batches ({', '.join(map(str, counts))} on "
            "ranks 0, 1, ...): every rank passes its own rows of the same batches"
        )
    total: list[int | None] = []
    for b in range(counts[0]):
        per_rank = [rows[b] for rows, _ in everyone]
        if any(r is None for r in per_rank):
            total.append(None)
            continue
        if any(r != per_rank[0] for r in per_rank):
            raise MeasureError(
                f"batch {b}: the ranks hold {', '.join(map(str, per_rank))} rows; a sharded "
                "model's batch loss is the mean of the ranks' losses, which is the batch's loss "
                "only when every rank holds as many rows: split every batch evenly"
            )
        total.append(sum(r for r in per_rank if r is not None))
    widths = [w for _, w in everyone if w is not None]
    return total, max(widths) if len(widths) == len(everyone) else None


def _clean_pass(
    model: nn.Module, loss_fn: Callable, batches: Sequence[Any], shards: ShardedParams
) -> list[float]:
    """The clean loss of every batch, the mean over ranks; every rank raises the same error."""
    device = shards.locals[0].device

    def run(inputs: Any) -> Any:
        args, kwargs = model_arguments(inputs)
        return model(*args, **kwargs)

    losses = []
    with eval_mode(model), torch.no_grad():
        try:
            for b, batch in enumerate(batches):
                try:
                    value, error = batch_loss(b, batch, run, loss_fn, device), None
                except MeasureError as err:
                    value, error = float("nan"), str(err)
                failed = [(r, e) for r, e in enumerate(shards.exchange(error)) if e is not None]
                if failed:
                    r, e = failed[0]
                    raise MeasureError(e if shards.world == 1 else f"{e} (on rank {r})")
                value = shards.mean_loss(torch.tensor(value, dtype=torch.float64))
                losses.append(check_finite_loss(b, value))
        finally:
            shards.reshard()  # a forward without backward leaves the root's weights gathered
    return losses


def sharded_reference_loss(
    model: nn.Module, loss_fn: Callable, batches: Sequence[Any], shards: ShardedParams
) -> float | None:
    """The trivial predictor's loss on a sharded model's batches, the mean over ranks.

    :func:`geosharp.measuring.flags.reference_loss` for a model sharded by FSDP2: one forward
    per batch on every rank (collective), the loss of all-zero predictions of its shape on the
    rank's rows, averaged over the ranks; ``None`` on every rank if the loss does not take a
    tensor of predictions on any of them.
    """
    from geosharp.measuring.losses import _logits

    device = shards.locals[0].device
    total = 0.0
    with eval_mode(model), torch.no_grad():
        try:
            for inputs, targets in batches:
                value, error = float("nan"), None
                try:
                    args, kwargs = model_arguments(inputs)
                    zeros = torch.zeros_like(_logits(model(*args, **kwargs)))
                    loss = loss_fn(zeros, targets.to(device) if hasattr(targets, "to") else targets)
                    value = float(loss)
                except Exception as err:  # the loss needs the model's own output type
                    error = f"{type(err).__name__}: {err}"
                if any(e is not None for e in shards.exchange(error)):
                    return None
                total += shards.mean_loss(torch.tensor(value, dtype=torch.float64))
        finally:
            shards.reshard()  # a forward without backward leaves the root's weights gathered
    return total / max(len(batches), 1)
