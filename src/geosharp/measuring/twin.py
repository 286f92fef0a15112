"""``gs.twin_check``: the same number for the same function, checked on your own model.

geosharp's promise is that an equivalent re-parametrization of the weights — one that leaves
the model's function unchanged — does not change geodesic sharpness. :func:`twin_check` shows
it on a model: it measures the model and one random equivalent *twin*
(:func:`geosharp.reparametrize`: a random element of every symmetry block's group, scale
``a = 10`` by default, in the model's own dtype and on its device) with :func:`geosharp.measure`,
on the same batches and with the same settings, and returns per (measure, ρ) the two values, the
relative change ``|v − v'| / |v|`` and the flags of each side (:class:`TwinCheck`).

How to read it (:meth:`TwinCheck.table`):

* a **geodesic** cell is expected to be within :data:`TWIN_TOL` (1e-3) relative of its twin:
  ``held``;
* a geodesic cell that moved while either side is **flagged** (``rising``, ``unstable``,
  ``saturated``: :mod:`geosharp.measuring.flags`) is no broken promise: its ascent is chaotic,
  still rising or its ball leaves the basin, and the flag already says its value cannot be
  trusted as it is;
* a geodesic cell that moved with no flag on either side is the promise failing **silently**;
* **adaptive** (and Euclidean) sharpness is not expected to be invariant: it is reported for
  contrast (the paper's point is that it moves).

A study does the same for every model with ``geosharp study MANIFEST --twin-check``
(:mod:`geosharp.studies.population_twin`).
"""

from __future__ import annotations

import math
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.sharded.check import is_sharded
from geosharp.measures import Measure, parse_measure
from geosharp.measures.curvature import Curvature
from geosharp.measures.sharpness import Sharpness
from geosharp.measuring.core import DEFAULT_MEASURES, DEFAULT_STEPS, measure
from geosharp.measuring.errors import MeasureError, MeasureWarning
from geosharp.measuring.prepare import prepare_measurement
from geosharp.measuring.results import MeasureReport, _g, flags_text, rho_text
from geosharp.symmetry import ParameterSpace, reparametrize
from geosharp.symmetry.verify import call_model, eval_mode, flatten_outputs

__all__ = [
    "TWIN_TOL",
    "TwinCheck",
    "TwinRow",
    "make_twin",
    "promised",
    "relative_change",
    "twin_check",
]

#: A geodesic cell within this relative change of its twin kept the promise.
TWIN_TOL = 1e-3

#: What the table says of the promise (one paragraph, also in ``to_dict()["reading"]``).
READING = (
    "Geodesic measures promise the same value for the same function: 'held' = within {tol:g} "
    "relative of the twin. A flagged cell that moved is no broken promise: its ascent is chaotic "
    "(unstable), still rising, or its ball leaves the basin (saturated), and the flag already "
    "says so. 'MOVED' = a geodesic cell that moved with no flag on either side: the promise "
    "failing silently. Adaptive and Euclidean sharpness are not invariant under the symmetry and "
    "are shown for contrast ('not invariant')."
)


def promised(measure_name: str) -> bool:
    """Whether a measure promises the same value on an equivalent model (a geodesic one).

    Geodesic sharpness (any metric, order and kind; the ``adaptivenorm`` ablation aside) and
    geodesic curvature are; adaptive and Euclidean sharpness, relative flatness and a name
    that is not a measure are not.

    Example:
        >>> [promised(n) for n in ("geodesic-mix-o2 worst l2", "adaptive worst l2",
        ...                        "geodesic-inv curvature trace", "geodesic-adaptivenorm")]
        [True, False, True, False]
    """
    try:
        m = parse_measure(measure_name)
    except MeasureError:
        return False
    if isinstance(m, Sharpness):
        return m.measure == "geodesic" and m.corrected_norm
    if isinstance(m, Curvature):
        return m.of == "geodesic"
    return False


def relative_change(value: float | None, twin: float | None) -> float | None:
    """``|v − v'| / |v|`` (``None`` when either failed; ``inf`` when only ``v`` is 0).

    Example:
        >>> relative_change(2.0, 2.002), relative_change(0.0, 0.0), relative_change(1.0, None)
        (0.0009999999999998899, 0.0, None)
    """
    if value is None or twin is None or not (math.isfinite(value) and math.isfinite(twin)):
        return None
    if value == 0:
        return 0.0 if twin == 0 else math.inf
    return abs(value - twin) / abs(value)


@dataclass(frozen=True)
class TwinRow:
    """One measure at one ρ, on the model and on its twin.

    Attributes:
        measure: Canonical measure name.
        rho: Radius (``None`` for a measure without one).
        value: The model's value (``None``: failed).
        twin_value: The twin's value (``None``: failed).
        flags: The model's cell's flags (:attr:`geosharp.measuring.MeasureRow.flags`).
        twin_flags: The twin's cell's flags.
        error: Why either side failed (``None``: neither did).
    """

    measure: str
    rho: float | None
    value: float | None
    twin_value: float | None
    flags: tuple[str, ...] = ()
    twin_flags: tuple[str, ...] = ()
    error: str | None = None

    @property
    def relative_change(self) -> float | None:
        """``|value − twin_value| / |value|`` (:func:`relative_change`)."""
        return relative_change(self.value, self.twin_value)

    @property
    def promised(self) -> bool:
        """Whether the measure is expected to be invariant (:func:`promised`)."""
        return promised(self.measure)

    @property
    def flagged(self) -> bool:
        """Whether either side's cell is flagged."""
        return bool(self.flags or self.twin_flags)

    def moved(self, tol: float = TWIN_TOL) -> bool:
        """Whether the value moved by more than ``tol`` relative (a failed side: no)."""
        change = self.relative_change
        return change is not None and change > tol

    def reading(self, tol: float = TWIN_TOL) -> str:
        """``held``, ``moved, flagged``, ``MOVED`` (silently), ``not invariant`` or ``failed``."""
        if self.relative_change is None:
            return "failed"
        if not self.promised:
            return "not invariant"
        if not self.moved(tol):
            return "held"
        return "moved, flagged" if self.flagged else "MOVED"

    def to_dict(self, tol: float = TWIN_TOL) -> dict[str, Any]:
        """A JSON-serializable dict (a non-finite change becomes ``None``)."""
        change = self.relative_change
        return {
            "measure": self.measure,
            "rho": self.rho,
            "value": self.value,
            "twin_value": self.twin_value,
            "relative_change": change if change is not None and math.isfinite(change) else None,
            "flags": list(self.flags),
            "twin_flags": list(self.twin_flags),
            "promised": self.promised,
            "reading": self.reading(tol),
            "error": self.error,
        }


@dataclass
class TwinCheck:
    """What :func:`twin_check` found: the model's and its twin's cells side by side.

    Attributes:
        rows: One :class:`TwinRow` per (measure, ρ), in the order measured.
        scale: Scale ``a`` of the group element.
        seed: Seed of the group element (and of both measurements).
        dtype: The model's dtype, which the twin keeps.
        n_blocks: Symmetry blocks re-parametrized.
        output_change: ``‖f_twin − f‖ / ‖f‖`` of the outputs on the first batch (rounding).
        note: The one line that says why nothing was measured (no symmetry block), or ``None``.
        tol: The relative change below which a cell ``held``.
        model_report: The model's :class:`~geosharp.measuring.MeasureReport`.
        twin_report: The twin's.
        time_s: Wall time.
    """

    rows: list[TwinRow]
    scale: float
    seed: int
    dtype: str
    n_blocks: int
    output_change: float | None = None
    note: str | None = None
    tol: float = TWIN_TOL
    model_report: MeasureReport | None = field(default=None, repr=False)
    twin_report: MeasureReport | None = field(default=None, repr=False)
    time_s: float = 0.0

    @property
    def silent(self) -> list[TwinRow]:
        """Geodesic cells that moved by more than :attr:`tol` with no flag on either side."""
        return [r for r in self.rows if r.reading(self.tol) == "MOVED"]

    @property
    def held(self) -> bool:
        """Whether no geodesic cell moved silently (:attr:`silent` is empty)."""
        return not self.silent

    def table(self) -> str:
        """The cells as an aligned plain-text table, with how to read them."""
        if self.note is not None:
            return self.note
        header = (
            "measure",
            "rho",
            "value",
            "twin",
            "rel. change",
            "flags",
            "twin flags",
            "reading",
        )
        body = []
        for r in self.rows:
            change = r.relative_change
            body.append(
                (
                    r.measure,
                    rho_text(r.rho),
                    _g(r.value, 6),
                    _g(r.twin_value, 6),
                    "–" if change is None else f"{change:.1e}",
                    flags_text(r.flags),
                    flags_text(r.twin_flags),
                    r.reading(self.tol),
                )
            )
        widths = [max(len(x[j]) for x in [header, *body]) for j in range(len(header))]
        right = {1, 2, 3, 4}

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(
                c.rjust(w) if j in right else c.ljust(w)
                for j, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        out = [fmt(header), "  ".join("-" * w for w in widths), *(fmt(b) for b in body)]
        out.append(textwrap.fill(self.twin_line(), 92))
        out.append(textwrap.fill(READING.format(tol=self.tol), 92))
        return "\n".join(out)

    def twin_line(self) -> str:
        """What the twin is, in one line."""
        moved = ""
        if self.output_change is not None:
            moved = f"; its outputs differ from the model's by {self.output_change:.1e} relative"
            moved += " (rounding)"
        return (
            f"twin: one random group element of scale {self.scale:g} on each of the "
            f"{self.n_blocks} symmetry blocks (seed {self.seed}), in {self.dtype}{moved}"
        )

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict: the settings of the twin, its rows and how to read them."""
        return {
            "scale": self.scale,
            "seed": self.seed,
            "dtype": self.dtype,
            "n_blocks": self.n_blocks,
            "output_change": self.output_change,
            "tol": self.tol,
            "note": self.note,
            "held": self.held,
            "time_s": self.time_s,
            "reading": READING.format(tol=self.tol),
            "rows": [r.to_dict(self.tol) for r in self.rows],
        }


def make_twin(model: nn.Module, space: ParameterSpace, seed: int, scale: float = 10.0) -> nn.Module:
    """A deep copy of ``model`` with one random group element (seeded) applied to every block.

    The element is drawn in float64 on the CPU from ``torch.Generator().manual_seed(seed)`` and
    applied in the model's own dtype on its device (:func:`geosharp.reparametrize`).
    """
    _check_scale(scale)
    return reparametrize(
        model, generator=torch.Generator().manual_seed(seed), scale=scale, space=space
    )


def _check_scale(scale: Any) -> None:
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not (ok and math.isfinite(scale) and scale > 0):
        raise MeasureError(f"scale must be a finite number > 0, got {scale!r}")


def output_change(model: nn.Module, twin: nn.Module, inputs: Any) -> float:
    """``‖f_twin − f‖ / ‖f‖`` over every floating output of ``inputs`` (eval mode, no grad)."""
    with torch.no_grad(), eval_mode(model), eval_mode(twin):
        a, b = (
            flatten_outputs(call_model(m, dict(m.named_parameters()), inputs))
            for m in (model, twin)
        )
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


def twin_check(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: str | Callable[[Any, Any], Tensor] | None = None,
    *,
    measures: Sequence[str | Measure] = DEFAULT_MEASURES,
    rhos: Sequence[float] | Mapping[str, Sequence[float]] | None = None,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    scale: float = 10.0,
    **measure_kwargs: Any,
) -> TwinCheck:
    """Measure ``model`` and one random equivalent twin the same way; compare cell by cell.

    The twin is a deep copy of ``model`` with one random element of every symmetry block's
    group applied (:func:`make_twin`, scale ``scale``, seeded by ``seed``), in the model's own
    dtype and on its device: the same function, other weights. Both are measured by
    :func:`geosharp.measure` on the same batches with the same measures, radii, steps, seed and
    symmetry blocks (found and proven once, on the model); the model is not written to.

    Geodesic measures are expected to give the same value (within :data:`TWIN_TOL`
    relative); adaptive and Euclidean sharpness are not, and are reported for contrast. A
    geodesic cell that moved while either side is flagged (``rising``, ``unstable``,
    ``saturated``) is no broken promise: the flag says the value cannot be trusted as it is.
    :meth:`TwinCheck.table` says it all in plain words.

    A model without symmetry blocks has no twin other than itself: nothing is measured, and
    the result's :attr:`~TwinCheck.note` (its table) says so in one line (also given to
    ``warn``, or warned as a :class:`~geosharp.measuring.MeasureWarning`).

    Args:
        model: Any ``nn.Module``, on the device and in the dtype to measure in.
        batches: ``(inputs, targets)`` pairs (kept: both measurements use them).
        loss_fn: As :func:`geosharp.measure` takes it.
        measures: The measures (default: adaptive ℓ2, geodesic inv and mix, order 2).
        rhos: The radii, as :func:`geosharp.measure` takes them (default: its defaults, geodesic
            mix's scaled by the head scale, which the group leaves unchanged, so the model and
            its twin get the same grid).
        steps: Auto-PGD steps per batch.
        seed: Seed of the group element and of both measurements (their random starts).
        scale: Scale ``a`` of the group element (the paper sweeps ``a ∈ [1e-2, 1e2]``).
        **measure_kwargs: Any other keyword argument of :func:`geosharp.measure` (``eps``,
            ``check``, ``space``, ``exact_steps``, ``log``, ``warn``, …), given to both calls.

    Returns:
        A :class:`TwinCheck` (``.table()``, ``.to_dict()``, ``.rows``).

    Raises:
        MeasureError: What :func:`geosharp.measure` refuses (before anything is measured), a
            ``scale`` that is not a finite number > 0, or a model sharded by FSDP2 (a twin is
            a deep copy).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import geosharp as gs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
        >>> batches = [(torch.randn(4, 5, 8, dtype=torch.float64),
        ...             torch.randn(4, 5, 8, dtype=torch.float64))]
        >>> tc = gs.twin_check(layer, batches, measures=["geodesic-inv-o2", "adaptive"],
        ...                    rhos=[0.01], steps=3, warn=lambda msg: None)
        >>> [(r.measure, r.reading()) for r in tc.rows]
        [('geodesic-inv-o2 worst l2', 'held'), ('adaptive worst l2', 'not invariant')]
    """
    t0 = time.perf_counter()
    _check_scale(scale)
    if not isinstance(model, nn.Module):
        raise MeasureError(f"model must be an nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise MeasureError(
            "twin_check: a model sharded by FSDP2 cannot be copied into a twin; check an "
            "unsharded copy of it (or a smaller model of the same architecture)"
        )
    for m in measures:  # a bad name in one line, before the blocks are proven
        parse_measure(m)
    batches = list(batches)
    kwargs = dict(measure_kwargs)
    warn: Callable[[str], None] | None = kwargs.get("warn")
    checked = prepare_measurement(  # the blocks, proven once for both; measure() says the rest
        model,
        batches,
        loss_fn,
        space=kwargs.pop("space", None),
        check=False,
        seed=seed,
        warn=lambda _msg: None,
    )
    space = checked.space
    first = next(iter(model.parameters()))
    dtype = str(first.dtype).replace("torch.", "")
    if not space.blocks:
        note = (
            "twin check: the model has no symmetry blocks, so its only twin is itself and "
            "there is nothing to check (geodesic and adaptive sharpness coincide on it)"
        )
        if warn is not None:
            warn(note)
        else:
            warnings.warn(note, MeasureWarning, stacklevel=2)
        return TwinCheck(
            rows=[],
            scale=scale,
            seed=seed,
            dtype=dtype,
            n_blocks=0,
            note=note,
            time_s=time.perf_counter() - t0,
        )
    twin = make_twin(model, space, seed, scale)
    change = output_change(model, twin, checked.batches[0][0])
    settings = dict(measures=measures, rhos=rhos, steps=steps, seed=seed, space=space, **kwargs)
    before = measure(model, batches, loss_fn, **settings)
    if warn is None:  # the twin's warnings say that they are the twin's
        settings["warn"] = lambda msg: warnings.warn(f"twin: {msg}", MeasureWarning, stacklevel=3)
    after = measure(twin, batches, loss_fn, **settings)
    theirs = {(r.measure, r.rho): r for r in after.rows}
    rows = []
    for r in before.rows:
        t = theirs.get((r.measure, r.rho))
        errors = [
            f"{side}: {e}"
            for side, e in (("model", r.error), ("twin", t.error if t else "not measured"))
            if e
        ]
        rows.append(
            TwinRow(
                measure=r.measure,
                rho=r.rho,
                value=r.value,
                twin_value=t.value if t is not None else None,
                flags=tuple(r.flags),
                twin_flags=tuple(t.flags) if t is not None else (),
                error="; ".join(errors) or None,
            )
        )
    return TwinCheck(
        rows,
        scale,
        seed,
        dtype,
        len(space.blocks),
        output_change=change,
        model_report=before,
        twin_report=after,
        time_s=time.perf_counter() - t0,
    )
