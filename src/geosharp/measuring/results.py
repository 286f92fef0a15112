"""What ``gs.measure`` returns, and how it is printed and written.

:class:`MeasureRow` is one measure at one ρ; :class:`MeasureReport` holds every row, the
symmetry summary, the self-check and the settings, and prints as a plain-text table and writes
JSON and CSV (and the HTML page of :mod:`~geosharp.measuring.html`).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geosharp._io import atomic_write_text
from geosharp.estimators.checks import InvarianceReport
from geosharp.estimators.sharpness import SharpnessResult
from geosharp.measures import Measure, parse_measure
from geosharp.measures.base import sharpness_row_fields

__all__ = ["SIZE_FIELDS", "MeasureReport", "MeasureRow", "rho_text"]


@dataclass
class MeasureRow:
    """One measure at one ρ.

    Attributes:
        measure: Canonical measure name (e.g. ``"geodesic-inv-o2 worst l2"``).
        rho: Radius (``None`` for relative flatness).
        value: Mean over batches (``None`` if the measurement failed).
        per_batch: The value of every batch.
        clean_losses: ``L_S(w)`` of every batch.
        perturbed_losses: Largest loss found (worst case) or mean perturbed loss, per batch.
        traces: Loss at every Auto-PGD iterate of every batch (worst case).
        time_s: Wall time.
        n_forward: Forward passes.
        n_backward: Backward passes.
        error: Why the measurement failed (``None`` if it did not).
        stderr: Curvature trace only: the Hutchinson standard error of :attr:`value` (``0``
            for the exact trace; ``None`` for every other measure).
        n_hvp: Curvature only: Hessian-vector products (double-backward passes).
        max_relative_speed: ``-exact`` measures only: the largest relative speed ``κ`` of a
            GL(h) head at a reported perturbation or noise sample (RK4 needs about ``2κ`` steps;
            :attr:`geosharp.SharpnessResult.settings`); ``None`` otherwise.
        flags: Why the value cannot be trusted, a subset of ``("rising", "unstable",
            "saturated")`` (:mod:`geosharp.measuring.flags`); empty when the cell is sound.
        instability: How far the ascent's last iterates fell back, relative to the loss rise,
            the largest over the batches (:func:`geosharp.measuring.flags.instability`; above
            ``1e-3`` the cell is ``unstable``); ``None`` without traces.
        carried: Batches whose value is that of a smaller ball of the same measure, which held
            a better point than this ball's ascent found (:func:`geosharp.measuring.flags.nest`).
    """

    measure: str
    rho: float | None
    value: float | None
    per_batch: list[float] = field(default_factory=list)
    clean_losses: list[float] = field(default_factory=list)
    perturbed_losses: list[float] = field(default_factory=list)
    traces: list[list[float]] = field(default_factory=list)
    time_s: float = 0.0
    n_forward: int = 0
    n_backward: int = 0
    error: str | None = None
    stderr: float | None = None
    n_hvp: int = 0
    max_relative_speed: float | None = None
    flags: tuple[str, ...] = ()
    instability: float | None = None
    carried: int = 0

    @property
    def sound(self) -> bool:
        """Measured and not flagged."""
        return self.error is None and not self.flags

    @property
    def std(self) -> float | None:
        """Standard deviation of the per-batch values (0 for one batch)."""
        if self.value is None:
            return None
        n = len(self.per_batch)
        if n < 2:
            return 0.0
        return math.sqrt(sum((v - self.value) ** 2 for v in self.per_batch) / (n - 1))

    @property
    def min(self) -> float | None:
        """Smallest per-batch value."""
        return min(self.per_batch) if self.per_batch and self.value is not None else None

    @property
    def max(self) -> float | None:
        """Largest per-batch value."""
        return max(self.per_batch) if self.per_batch and self.value is not None else None

    @classmethod
    def from_result(cls, res: SharpnessResult, rho: float | None) -> MeasureRow:
        """Build a row from a :class:`geosharp.SharpnessResult`."""
        return cls(**sharpness_row_fields(res, rho))

    @classmethod
    def of(cls, measure: Measure, res: Any, rho: float | None) -> MeasureRow:
        """The row of a measure's result, as the measure says (:meth:`Measure.row_fields`)."""
        return cls(**measure.row_fields(res, rho))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (spread statistics included)."""
        return {
            "measure": self.measure,
            "rho": self.rho,
            "value": self.value,
            "std": self.std,
            "min": self.min,
            "max": self.max,
            "n_batches": len(self.per_batch),
            "time_s": self.time_s,
            "n_forward": self.n_forward,
            "n_backward": self.n_backward,
            "n_hvp": self.n_hvp,
            "stderr": self.stderr,
            "max_relative_speed": self.max_relative_speed,
            "flags": list(self.flags),
            "instability": self.instability,
            "carried": self.carried,
            "error": self.error,
            "per_batch": self.per_batch,
            "clean_losses": self.clean_losses,
            "perturbed_losses": self.perturbed_losses,
            "traces": self.traces,
        }


_CSV_FIELDS = (
    "measure",
    "rho",
    "value",
    "std",
    "min",
    "max",
    "n_batches",
    "time_s",
    "n_forward",
    "n_backward",
    "n_hvp",
    "stderr",
    "max_relative_speed",
    "flags",
    "instability",
    "carried",
    "error",
    "per_batch",
    "steps",
    "samples",
    "batch_size",
    "max_length",
)
#: The sizes a run used, in every line of results.csv (after the columns of one row): Auto-PGD
#: steps, samples, batch size and maximum length in tokens, as ``settings`` holds them (the
#: command line's options; ``gs.measure`` alone: what the batches show, see
#: :func:`~geosharp.measuring.estimate.batch_sizes`). Empty where a run has none (no text).
SIZE_FIELDS = ("steps", "samples", "batch_size", "max_length")


def flags_text(flags: Sequence[str] | None) -> str:
    """A cell's flags as a table or a CSV cell writes them (:mod:`geosharp.measuring.flags`).

    ``"rising unstable"``; ``""`` when sound; ``"not recorded"`` for ``None`` (a study's row
    measured before flags existed).
    """
    return "not recorded" if flags is None else " ".join(flags)


def rho_text(rho: float | None) -> str:
    """ρ as the table prints it: ``1``, not ``1.0``; every other value exactly (shortest repr).

    Example:
        >>> [rho_text(r) for r in (1.0, 0.1, 0.01, 2, 1e-05, 0.123456789, None)]
        ['1', '0.1', '0.01', '2', '1e-05', '0.123456789', '']
    """
    if rho is None:
        return ""
    rho = float(rho)
    if rho.is_integer() and abs(rho) < 1e15:
        return str(int(rho))
    return repr(rho)


def _g(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)


def _time(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


@dataclass
class MeasureReport:
    """What :func:`measure` found: the symmetry summary, the self-check and every measurement.

    Attributes:
        rows: One :class:`MeasureRow` per (measure, ρ), in the order measured.
        symmetry_summary: :meth:`geosharp.ParameterSpace.summary` of the model.
        adaptive_note: Which coordinates use the adaptive geometry, and why.
        invariance: The re-parametrization check (``None`` if it was skipped).
        clean_losses: ``L_S(w)`` of every batch, from the self-check.
        n_batches: Number of batches.
        n_samples: Number of samples (first dimension of the targets, summed), if known.
        settings: Every setting of the call (plus what the caller added, e.g. file names).
        warnings: Everything the user should know that did not stop the measurement.
        time_s: Total wall time.
    """

    rows: list[MeasureRow]
    symmetry_summary: str
    adaptive_note: str
    invariance: InvarianceReport | None
    clean_losses: list[float]
    n_batches: int
    n_samples: int | None
    settings: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    time_s: float = 0.0

    def row(self, measure: str, rho: float | None = None) -> MeasureRow:
        """The row of one measure at ``rho`` (any spelling that ``parse_measure`` reads).

        Raises:
            KeyError: If it was not measured.
        """
        name = parse_measure(measure).name
        for r in self.rows:
            if r.measure == name and (rho is None or r.rho == rho):
                return r
        raise KeyError(f"{name} at rho={rho} was not measured")

    @property
    def failed(self) -> list[MeasureRow]:
        """The rows whose measurement failed."""
        return [r for r in self.rows if r.error is not None]

    def table(self) -> str:
        """The results as an aligned plain-text table (measure, ρ, value, spread, time, flags).

        A curvature row's spread also gives the trace's standard error (Hutchinson) and the
        number of Hessian-vector products.
        """
        header = ("measure", "rho", "value", "per-batch spread", "time", "flags")
        rows = []
        for r in self.rows:
            if r.error is not None:
                spread = "failed: " + (r.error if len(r.error) <= 60 else r.error[:57] + "...")
                rows.append((r.measure, _g(r.rho), "–", spread, _time(r.time_s), ""))
                continue
            n = len(r.per_batch)
            spread = (
                f"± {_g(r.std, 2)} [{_g(r.min, 3)}, {_g(r.max, 3)}] over {n} batches"
                if n > 1
                else "(1 batch)"
            )
            if r.stderr is not None:
                spread += f"; s.e. {_g(r.stderr, 2)}"
            if r.n_hvp:
                spread += f"; {r.n_hvp} HVPs"
            flags = flags_text(r.flags)
            rows.append((r.measure, _g(r.rho), _g(r.value, 5), spread, _time(r.time_s), flags))
        widths = [max(len(x[j]) for x in [header, *rows]) for j in range(len(header))]
        right = {1, 2, 4}

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(
                c.rjust(w) if j in right else c.ljust(w)
                for j, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([fmt(header), rule, *(fmt(r) for r in rows)])

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of everything (non-finite numbers become ``None``)."""
        inv = None
        if self.invariance is not None:
            inv = {
                "passed": self.invariance.passed,
                "rel_changes": self.invariance.rel_changes,
                "scales": self.invariance.scales,
                "tol": self.invariance.tol,
                "n_blocks": self.invariance.n_blocks,
                "n_factors": self.invariance.n_factors,
                "random_changes": self.invariance.random_changes,
                "nothing_to_check": self.invariance.n_blocks == 0,
            }
        return _json_safe(
            {
                "settings": self.settings,
                "n_batches": self.n_batches,
                "n_samples": self.n_samples,
                "clean_losses": self.clean_losses,
                "invariance_check": inv,
                "symmetry_summary": self.symmetry_summary,
                "adaptive_note": self.adaptive_note,
                "warnings": self.warnings,
                "time_s": self.time_s,
                "results": [r.to_dict() for r in self.rows],
            }
        )

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON; returns the path."""
        text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False, allow_nan=False)
        return atomic_write_text(path, text + "\n")

    def sizes(self) -> dict[str, int | None]:
        """The sizes the run used (:data:`SIZE_FIELDS`), from :attr:`settings`.

        ``samples`` falls back on :attr:`n_samples`, ``batch_size`` on the largest batch and
        ``max_length`` on the longest input in tokens (what ``gs.measure`` records of its
        batches); ``None`` where nothing says.
        """
        st = self.settings
        pick = {
            "steps": st.get("steps"),
            "samples": st.get("samples", self.n_samples),
            "batch_size": st.get("batch_size", st.get("largest_batch")),
            "max_length": st.get("max_length", st.get("longest_input")),
        }
        return {
            k: v if isinstance(v, int) and not isinstance(v, bool) else None
            for k, v in pick.items()
        }

    def to_csv(self) -> str:
        """One CSV line per (measure, ρ); ``per_batch`` is a JSON list.

        ρ is written as the table prints it (:func:`rho_text`: ``1``, not ``1.0``), and every
        line ends with the run's sizes (:data:`SIZE_FIELDS`).
        """
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
        writer.writeheader()
        sizes = self.sizes()
        for r in self.rows:
            d = _json_safe(r.to_dict())
            d["per_batch"] = json.dumps(d["per_batch"])
            d["flags"] = flags_text(r.flags)
            d["rho"] = rho_text(r.rho)
            d.update(sizes)
            writer.writerow({k: "" if d[k] is None else d[k] for k in _CSV_FIELDS})
        return buf.getvalue()

    def write_csv(self, path: str | Path) -> Path:
        """Write :meth:`to_csv`; returns the path."""
        return atomic_write_text(path, self.to_csv())

    def write_html(self, path: str | Path, title: str = "geosharp measure") -> Path:
        """Write the self-contained HTML report with the per-batch loss-ascent curves.

        Needs matplotlib. Returns the path.
        """
        from geosharp.measuring.html import write_html

        return write_html(self, path, title=title)
