"""``gs.measure``: several sharpness measures of one trained model, with a self-check first.

This is the measuring half of ``geosharp measure``; it needs no files. Given a model and a list
of ``(inputs, targets)`` batches it

1. finds the symmetry blocks (:func:`geosharp.find_symmetries`) and explains which coordinates
   use the adaptive geometry and why;
2. runs a self-check a user can trust: the clean loss of every batch must be finite (and, for
   cross-entropy, every label one of the model's classes), and the model's outputs must be
   unchanged under a random re-parametrization of every block found
   (:func:`geosharp.check_invariance`: a wrong adapter is caught instead of being silently
   measured);
3. measures every requested measure at every ρ with :func:`geosharp.sharpness` (Auto-PGD for
   the worst case, SPEC §6), or once with :func:`geosharp.relative_flatness` or
   :func:`geosharp.curvature` (``curvature-inv-lmax``, ``curvature-euclidean-trace``, …: the
   Hessian on the quotient, SPEC §9, no ρ);

and returns a :class:`MeasureReport` that prints as a table and writes JSON, CSV and HTML.

The default plan is the paper's three measures — adaptive ℓ2, geodesic inv and geodesic mix,
worst case, second-order geodesics — at ``ρ ∈ {0.01, 0.1, 1}`` with 20 Auto-PGD steps
(SPEC §6). The paper reports no ρ, and the measures' values scale differently with ρ, so the
default is a grid one decade apart rather than a single radius. It spans the useful range on
the packaged MiniLM (8 sentences, fresh 2-label head, loss 0.69): at ρ = 0.01 the loss rises by
2e-4 (adaptive) to 2e-3 (geodesic), four orders above float32 rounding; at ρ = 1 by 0.03
(adaptive) to 0.5 (geodesic), a large but finite rise.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp._io import atomic_write_text
from geosharp.estimators.checks import InvarianceReport, check_invariance
from geosharp.estimators.curvature import CurvatureResult, curvature
from geosharp.estimators.relative_flatness import relative_flatness
from geosharp.estimators.sharpness import (
    SharpnessResult,
    _to_device,
    call_model,
    eval_mode,
    sharpness,
)
from geosharp.measure.errors import MeasureError, MeasureWarning
from geosharp.measure.names import MeasureSpec, curvature_name
from geosharp.symmetry import ParameterSpace, find_symmetries

__all__ = [
    "DEFAULT_CURVATURE_ITERS",
    "DEFAULT_CURVATURE_PROBES",
    "DEFAULT_MEASURES",
    "DEFAULT_RHOS",
    "DEFAULT_STEPS",
    "MeasureError",
    "MeasureReport",
    "MeasureRow",
    "MeasureSpec",
    "MeasureWarning",
    "curvature_name",
    "default_loss",
    "measure",
    "resolve_loss",
    "still_rising",
]

#: The paper's three measures (SPEC §7): adaptive ℓ2, geodesic inv and mix at order 2.
DEFAULT_MEASURES = ("adaptive-l2", "geodesic-inv-o2", "geodesic-mix-o2")
#: One decade apart: the paper reports no ρ, and the measures scale differently with it.
DEFAULT_RHOS = (0.01, 0.1, 1.0)
#: Auto-PGD iterations, as in the paper (SPEC §6).
DEFAULT_STEPS = 20
#: Lanczos iterations and Hutchinson probes of the curvature measures (``gs.curvature``'s).
DEFAULT_CURVATURE_ITERS = 50
DEFAULT_CURVATURE_PROBES = 100

#: Cross-entropy ignores targets equal to this (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------
# losses


def _logits(outputs: Any) -> Tensor:
    """The predictions in a model output: ``.logits``, ``["logits"]``, ``[0]`` or itself."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise MeasureError(
        f"cannot find the predictions in a model output of type {type(outputs).__name__}: "
        "the default loss reads a tensor, .logits, output['logits'] or output[0]; pass loss_fn"
    )


def _cross_entropy(outputs: Any, targets: Tensor) -> Tensor:
    logits = _logits(outputs)
    if logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )
    raise MeasureError(
        f"cross-entropy needs predictions of shape (*, classes) and integer targets of shape (*);"
        f" got predictions {tuple(logits.shape)} and targets {tuple(targets.shape)}"
    )


def _mse(outputs: Any, targets: Tensor) -> Tensor:
    pred = _logits(outputs)
    if pred.shape != targets.shape and pred.shape[-1:] == (1,) and pred.shape[:-1] == targets.shape:
        pred = pred.squeeze(-1)
    if pred.shape != targets.shape:
        raise MeasureError(
            f"the squared error needs predictions shaped like the targets; got predictions "
            f"{tuple(pred.shape)} and targets {tuple(targets.shape)}"
        )
    return nn.functional.mse_loss(pred, targets.to(pred.dtype))


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Cross-entropy for integer targets, mean squared error for floating targets.

    The predictions are ``outputs.logits`` (Hugging Face), ``outputs["logits"]``,
    ``outputs[0]`` or ``outputs`` itself. Cross-entropy takes logits ``(*, C)`` and targets
    ``(*)`` (per sequence or per token) and ignores targets equal to ``-100``.

    Args:
        outputs: The model output.
        targets: Integer class indices, or floating regression targets.

    Returns:
        The mean loss (a scalar tensor).

    Raises:
        MeasureError: If the shapes do not fit.

    Example:
        >>> import torch
        >>> round(float(default_loss(torch.zeros(4, 2), torch.tensor([0, 1, 1, 0]))), 4)  # log 2
        0.6931
    """
    if not isinstance(targets, Tensor):
        raise MeasureError(f"the default loss needs tensor targets, got {type(targets).__name__}")
    if targets.is_floating_point():
        return _mse(outputs, targets)
    return _cross_entropy(outputs, targets)


_NAMED_LOSSES: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "auto": default_loss,
    "ce": _cross_entropy,
    "cross_entropy": _cross_entropy,
    "cross-entropy": _cross_entropy,
    "mse": _mse,
}


def resolve_loss(loss: str | Callable | None) -> tuple[Callable[[Any, Any], Tensor], str]:
    """A loss function and its name from ``None``, ``"auto"``, ``"ce"``, ``"mse"`` or a callable.

    Args:
        loss: The loss, or ``None`` for ``"auto"`` (:func:`default_loss`).

    Returns:
        ``(loss_fn, name)``.

    Raises:
        MeasureError: On an unknown name.
    """
    if loss is None:
        return default_loss, "auto"
    if callable(loss):
        return loss, getattr(loss, "__name__", type(loss).__name__)
    key = str(loss).strip().lower()
    if key not in _NAMED_LOSSES:
        raise MeasureError(
            f"unknown loss {loss!r}: use auto (cross-entropy for integer targets, squared error "
            "for float targets), ce, mse, or a callable loss_fn(outputs, targets)"
        )
    return _NAMED_LOSSES[key], {"cross_entropy": "ce", "cross-entropy": "ce"}.get(key, key)


def _uses_cross_entropy(loss_fn: Callable, targets: Any) -> bool:
    if loss_fn is _cross_entropy:
        return True
    return (
        loss_fn is default_loss and isinstance(targets, Tensor) and not targets.is_floating_point()
    )


# --------------------------------------------------------------------------------------------
# results


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
        return cls(
            measure=res.measure,
            rho=rho,
            value=res.value,
            per_batch=list(res.per_batch),
            clean_losses=list(res.clean_losses),
            perturbed_losses=list(res.perturbed_losses),
            traces=[list(t) for t in res.traces],
            time_s=res.time_s,
            n_forward=res.n_forward,
            n_backward=res.n_backward,
        )

    @classmethod
    def from_curvature(cls, res: CurvatureResult, quantity: str) -> MeasureRow:
        """Build the row of one quantity from a :class:`geosharp.CurvatureResult`."""
        return cls(
            measure=f"{res.measure} {quantity}",
            rho=None,
            value=res.values[quantity],
            per_batch=list(res.per_batch[quantity]),
            clean_losses=list(res.clean_losses),
            time_s=res.time_s,
            n_forward=res.n_forward,
            n_backward=res.n_backward,
            stderr=res.trace_stderr if quantity == "trace" else None,
            n_hvp=res.n_hvp,
        )

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
    "error",
    "per_batch",
)


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
        """The row of one measure (any spelling :meth:`MeasureSpec.parse` accepts) at ``rho``.

        Raises:
            KeyError: If it was not measured.
        """
        name = MeasureSpec.parse(measure).name
        for r in self.rows:
            if r.measure == name and (rho is None or r.rho == rho):
                return r
        raise KeyError(f"{name} at rho={rho} was not measured")

    @property
    def failed(self) -> list[MeasureRow]:
        """The rows whose measurement failed."""
        return [r for r in self.rows if r.error is not None]

    def table(self) -> str:
        """The results as an aligned plain-text table (measure, ρ, value, spread, time).

        A curvature row's spread also gives the trace's standard error (Hutchinson) and the
        number of Hessian-vector products.
        """
        header = ("measure", "rho", "value", "per-batch spread", "time")
        rows = []
        for r in self.rows:
            if r.error is not None:
                spread = "failed: " + (r.error if len(r.error) <= 60 else r.error[:57] + "...")
                rows.append((r.measure, _g(r.rho), "–", spread, _time(r.time_s)))
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
            rows.append((r.measure, _g(r.rho), _g(r.value, 5), spread, _time(r.time_s)))
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

    def to_csv(self) -> str:
        """One CSV line per (measure, ρ); ``per_batch`` is a JSON list."""
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
        writer.writeheader()
        for r in self.rows:
            d = _json_safe(r.to_dict())
            d["per_batch"] = json.dumps(d["per_batch"])
            writer.writerow({k: "" if d[k] is None else d[k] for k in _CSV_FIELDS})
        return buf.getvalue()

    def write_csv(self, path: str | Path) -> Path:
        """Write :meth:`to_csv`; returns the path."""
        return atomic_write_text(path, self.to_csv())

    def write_html(self, path: str | Path, title: str = "geosharp measure") -> Path:
        """Write the self-contained HTML report with the per-batch loss-ascent curves.

        Needs matplotlib. Returns the path.
        """
        from geosharp.measure.html import write_html

        return write_html(self, path, title=title)


# --------------------------------------------------------------------------------------------
# the self-check and the explanations


def adaptive_note(space: ParameterSpace, top: int = 8) -> str:
    """Which coordinates use the adaptive (element-wise) geometry, grouped by layer pattern.

    Args:
        space: The model's parameter space.
        top: How many parameter patterns to list (largest first).

    Returns:
        A few lines of text.
    """
    total = space.numel()
    n_rest = space.adaptive_numel
    if n_rest == 0:
        return "every trainable coordinate belongs to a symmetry block"
    rest = space.rest_index.cpu()
    counts: dict[str, int] = {}
    for name, shape, off in zip(space.param_names, space.shapes, space.offsets, strict=True):
        size = math.prod(shape)
        lo = int(torch.searchsorted(rest, off))
        hi = int(torch.searchsorted(rest, off + size))
        if hi > lo:
            pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
            counts[pattern] = counts.get(pattern, 0) + hi - lo
    why = (
        "no symmetry is known for them (SPEC §3), so geodesic sharpness gives them the "
        "adaptive (element-wise) metric of SPEC §5 and perturbs them along straight lines, as "
        "adaptive sharpness does"
        if space.blocks
        else "no symmetry block was found in this model, so every measure but the Euclidean one "
        "uses the adaptive (element-wise) geometry of SPEC §5: geodesic and adaptive sharpness "
        "coincide here"
    )
    lines = [f"adaptive geometry: {n_rest:,} of {total:,} coordinates — {why}:"]
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    width = max(len(k) for k, _ in items[:top])
    lines += [f"  {k.ljust(width)}  {v:>12,}" for k, v in items[:top]]
    if len(items) > top:
        rest_n = sum(v for _, v in items[top:])
        lines.append(f"  … {len(items) - top} more parameter patterns ({rest_n:,} coordinates)")
    return "\n".join(lines)


def unrepresentable_weights(model: nn.Module) -> dict[str, int]:
    """Trainable weights ``w ≠ 0`` whose ``1/w²`` is not finite in the parameter's dtype.

    The adaptive metric ``Σ ξ_i²/w_i²`` (SPEC §5) cannot be evaluated there (e.g.
    ``|w| < 5e-20`` in float32): the ball's norm becomes NaN and the ascent cannot move.

    Args:
        model: The model.

    Returns:
        Parameter name → number of such weights (only parameters that have some).
    """
    found = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or not p.is_floating_point():
            continue
        w = p.detach()
        # 1/w² is finite iff |w| ≥ max^(-1/2); test exactly only the few weights near that
        near = w.abs() < 2.0 * torch.finfo(w.dtype).max ** -0.5
        if not bool(near.any()):
            continue
        sub = w[near]
        n = int(((sub != 0) & ~torch.isfinite(sub.reciprocal().square())).sum())
        if n:
            found[name] = n
    return found


@torch.no_grad()
def flush_unrepresentable(model: nn.Module) -> dict[str, int]:
    """Set the weights of :func:`unrepresentable_weights` to exactly 0, in place.

    Zero weights are frozen coordinates of the adaptive ball (their radius ``ρ|w_i|`` is 0), and
    a weight of ``|w| < 1e-19`` already has a ball of that size, so measuring is unchanged while
    the metric becomes finite. The model's function changes by less than the weights' size.

    Args:
        model: The model (modified in place).

    Returns:
        Parameter name → number of weights set to 0.
    """
    found = unrepresentable_weights(model)
    params = dict(model.named_parameters())
    for name in found:
        w = params[name]
        bad = (w != 0) & ~torch.isfinite(w.reciprocal().square())
        w.masked_fill_(bad, 0.0)
    return found


def _n_samples(batches: Sequence[tuple[Any, Any]]) -> int | None:
    total = 0
    for _, targets in batches:
        if not isinstance(targets, Tensor) or targets.dim() == 0:
            return None
        total += targets.shape[0]
    return total


def _check_labels(b: int, logits: Tensor, targets: Tensor) -> None:
    n_classes = logits.shape[-1]
    valid = (targets == IGNORE_INDEX) | ((targets >= 0) & (targets < n_classes))
    if not bool(valid.all()):
        bad = sorted({int(t) for t in targets[~valid].reshape(-1).tolist()})
        shown = ", ".join(map(str, bad[:10])) + (", …" if len(bad) > 10 else "")
        raise MeasureError(
            f"batch {b} has labels outside the model's {n_classes} classes (0..{n_classes - 1}): "
            f"{shown}; check the label column, or that the model has the right number of labels"
        )


def _clean_pass(
    model: nn.Module, loss_fn: Callable, batches: Sequence[tuple[Any, Any]]
) -> list[float]:
    """Clean loss of every batch; raises unless every one is finite and every label valid."""
    device = next(iter(model.parameters())).device
    params = dict(model.named_parameters())
    losses = []
    with eval_mode(model), torch.no_grad():
        for b, batch in enumerate(batches):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise MeasureError(
                    f"batch {b} must be a pair (inputs, targets), got {type(batch).__name__}"
                )
            inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
            try:
                out = call_model(model, params, inputs)
            except Exception as err:
                raise MeasureError(
                    f"the model failed on batch {b}: {type(err).__name__}: {err}"
                ) from err
            try:
                if _uses_cross_entropy(loss_fn, targets):
                    _check_labels(b, _logits(out), targets)
                loss = loss_fn(out, targets)
            except MeasureError as err:
                if str(err).startswith(f"batch {b}"):
                    raise
                raise MeasureError(f"batch {b}: {err}") from err
            except Exception as err:
                raise MeasureError(
                    f"the loss failed on batch {b}: {type(err).__name__}: {err}"
                ) from err
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise MeasureError(
                    f"the loss of batch {b} must be a scalar tensor, got {type(loss).__name__}"
                )
            value = float(loss)
            if not math.isfinite(value):
                raise MeasureError(
                    f"the clean loss of batch {b} is {value}: sharpness is undefined. Check the "
                    "data (NaN or inf inputs?), the model's weights and the loss"
                )
            losses.append(value)
    return losses


#: A loss rise within this many units of the dtype's precision (relative to the loss) is
#: rounding: a mean of many float32 terms computed twice along nearby paths differs by a few ulp.
RISE_TOL_ULPS = 16
#: The trend is judged over this many last Auto-PGD steps.
RISE_WINDOW = 3


def _loss_eps(model: nn.Module) -> float:
    """Machine epsilon of the dtype the model computes its loss in (its parameters')."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return float(torch.finfo(dtypes[0] if dtypes else torch.float32).eps)


def still_rising(
    trace: Sequence[float],
    eps: float = float(torch.finfo(torch.float32).eps),
    *,
    ulps: float = RISE_TOL_ULPS,
    window: int = RISE_WINDOW,
) -> bool:
    """Whether an Auto-PGD loss trace was still rising at its last step (beyond rounding).

    A rise counts only above ``tol = ulps · eps · max|loss|``: the loss at the last step must be
    the trace's best (within ``tol``), higher than at the step before by more than ``tol``, and
    higher than ``window`` steps before by more than ``window · tol`` — a trend, not a one-ulp
    wobble of a flat trace.

    Args:
        trace: The loss at every iterate (the clean loss first).
        eps: Machine epsilon of the dtype the loss was computed in (float32 by default).
        ulps: The tolerance in units of ``eps`` relative to the loss.
        window: The number of last steps the trend is judged over.

    Returns:
        ``True`` if more steps would likely raise the loss further.

    Example:
        >>> still_rising([0.5, 0.6899, 0.689989447593689, 0.6899895071983337])  # one ulp
        False
        >>> still_rising([0.5, 0.6, 0.65, 0.68])
        True
    """
    values = [float(v) for v in trace]
    if len(values) < 3 or not all(math.isfinite(v) for v in values):
        return False
    tol = ulps * eps * max(max(abs(v) for v in values), 1e-30)
    last = values[-1]
    k = min(window, len(values) - 1)
    return last >= max(values) - tol and last - values[-2] > tol and last - values[-1 - k] > k * tol


def _invariance_tol(model: nn.Module) -> float:
    dtype = next(iter(model.parameters())).dtype
    # A wrong block changes the outputs by O(1); correct blocks only by rounding, which after a
    # product of up to three re-parametrized factors is ≲ 1e3 ulp of the dtype.
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, leave=False)


# --------------------------------------------------------------------------------------------
# the measuring function


def measure(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: str | Callable[[Any, Any], Tensor] | None = None,
    *,
    measures: Sequence[str | MeasureSpec] = DEFAULT_MEASURES,
    rhos: Sequence[float] = DEFAULT_RHOS,
    steps: int = DEFAULT_STEPS,
    eps: float = 0.0,
    seed: int = 0,
    iters: int = DEFAULT_CURVATURE_ITERS,
    probes: int = DEFAULT_CURVATURE_PROBES,
    trace_method: str = "hutchinson",
    check: bool = True,
    space: ParameterSpace | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> MeasureReport:
    """Measure the sharpness of ``model`` under several measures and radii, self-check first.

    Steps: find the symmetry blocks; check that a random re-parametrization of them leaves the
    outputs unchanged and that the clean loss of every batch is finite (cross-entropy: labels
    within the model's classes); then every measure at every ρ (relative flatness and the
    curvature measures once: :func:`geosharp.curvature` with one quantity each). A
    measurement that fails (e.g. the loss becomes infinite inside a large ball) is recorded
    with its error and the others go on. The model's weights are not written to; if some
    weights are so small that ``1/w²`` overflows (:func:`unrepresentable_weights`), a copy with
    them set to 0 is measured and a warning says so.

    Args:
        model: Any ``nn.Module``, on the device and in the dtype to measure in.
        batches: ``(inputs, targets)`` pairs (iterated once and kept: every measure uses the
            same batches); ``inputs`` may be a tensor, a tuple or a dict of keyword arguments.
        loss_fn: ``None``/``"auto"`` (:func:`default_loss`), ``"ce"``, ``"mse"`` or a callable
            ``loss_fn(outputs, targets)`` → scalar.
        measures: Measures as :meth:`MeasureSpec.parse` reads them (default: adaptive ℓ2,
            geodesic inv and geodesic mix, worst case, order 2).
        rhos: Radii (default ``0.01, 0.1, 1``, see the module docstring).
        steps: Auto-PGD iterations per batch (worst case).
        eps: Gram-matrix damping of GL(h) blocks.
        seed: Seed of the invariance check, of random starts / samples and of the curvature
            measures' Lanczos starts and trace probes.
        iters: Most Lanczos iterations per batch of a curvature λ measure.
        probes: Hutchinson probes per batch of a curvature trace.
        trace_method: ``"hutchinson"``, ``"hutch++"`` or ``"exact"`` (curvature trace).
        check: Run the invariance self-check and refuse to measure if it fails.
        space: Precomputed :func:`geosharp.find_symmetries` result.
        progress: Progress bars (default: when stderr is a terminal).
        log: Called with each informational message (summary, check) as it happens.
        warn: Called with each warning (default: :func:`warnings.warn` with
            :class:`MeasureWarning`).

    Returns:
        A :class:`MeasureReport`.

    Raises:
        MeasureError: On no batches, a bad measure or ρ, a non-finite clean loss, labels outside
            the model's classes, a model or loss that fails on the data, or a failed invariance
            check (the message explains what to do).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import geosharp as gs
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(2)]
        >>> rep = gs.measure(model, batches, measures=["adaptive", "euclidean"], rhos=[0.1],
        ...                  steps=5)
        >>> [r.measure for r in rep.rows], rep.row("adaptive", 0.1).value > 0
        (['adaptive worst l2', 'euclidean worst l2'], True)
    """
    t_start = time.perf_counter()
    say = log or (lambda _msg: None)
    notes: list[str] = []

    def _warn(msg: str) -> None:
        notes.append(msg)
        if warn is not None:
            warn(msg)
        else:
            warnings.warn(msg, MeasureWarning, stacklevel=3)

    if not isinstance(model, nn.Module):
        raise MeasureError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise MeasureError("the model has no parameters: there is nothing to perturb")
    specs = [MeasureSpec.parse(m) for m in measures]
    if not specs:
        raise MeasureError("no measures given: pass at least one (e.g. geodesic-inv-o2)")
    rhos = list(rhos)
    if any(s.uses_rho for s in specs):
        if not rhos:
            raise MeasureError("no radii given: pass at least one rho > 0")
        for r in rhos:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
                raise MeasureError(f"every rho must be a number > 0, got {r!r}")
            if not math.isfinite(r):
                raise MeasureError(f"every rho must be finite, got {r!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise MeasureError(f"steps must be an int >= 1, got {steps!r}")
    curv = {"iters": iters, "probes": probes, "trace_method": trace_method}
    if any(s.measure == "curvature" for s in specs):
        for key in ("iters", "probes"):
            n = curv[key]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise MeasureError(f"{key} must be an int >= 1, got {n!r}")
        if trace_method not in ("hutchinson", "hutch++", "exact"):
            raise MeasureError(
                f"trace_method must be hutchinson, hutch++ or exact, got {trace_method!r}"
            )
        if trace_method == "hutch++" and probes < 3:
            raise MeasureError(f"hutch++ needs at least 3 probes, got {probes}")
    loss_fn, loss_name = resolve_loss(loss_fn)
    batches = list(batches)
    if not batches:
        raise MeasureError("there are no batches: the data set is empty")
    device = next(iter(model.parameters())).device
    batches = [_to_device(b, device) if isinstance(b, (tuple, list)) else b for b in batches]
    if loss_fn is default_loss and isinstance(batches[0], (tuple, list)):
        floating = isinstance(batches[0][1], Tensor) and batches[0][1].is_floating_point()
        loss_name = "auto: squared error" if floating else "auto: cross-entropy"
    if progress is None:
        progress = sys.stderr.isatty()

    tiny = unrepresentable_weights(model)
    if tiny:
        model = copy.deepcopy(model)
        flush_unrepresentable(model)
        space = None  # the copy has other parameter objects
        where = ", ".join(f"{k} ({v})" for k, v in list(tiny.items())[:4])
        _warn(
            f"{sum(tiny.values())} weight(s) are so small that 1/w² overflows "
            f"{next(iter(model.parameters())).dtype} ({where}); a copy of the model with them "
            "set to 0 is measured (zero weights are frozen in the adaptive ball, whose radius "
            "ρ|w| is below 1e-19 there anyway)"
        )

    inputs0 = batches[0][0] if isinstance(batches[0], (tuple, list)) else None
    if space is None:
        say("finding symmetry blocks (and proving each on batch 0) ...")
        try:
            space = find_symmetries(
                model,
                example_inputs=inputs0 if check else None,
                verify_tol=_invariance_tol(model),
            )
        except Exception as err:
            raise MeasureError(
                f"the symmetry finder could not run the model on batch 0: "
                f"{type(err).__name__}: {err}"
            ) from err
    summary = space.summary()
    note = adaptive_note(space)
    say(summary)
    say(note)
    if space.numel() == 0:
        raise MeasureError("the model has no trainable parameters (all have requires_grad=False)")

    clean = _clean_pass(model, loss_fn, batches)
    say(f"clean loss: {sum(clean) / len(clean):.6g} (mean over {len(clean)} batch(es), all finite)")
    invariance = None
    if check:
        say("self-check: random re-parametrization of every block found ...")
        try:
            invariance = check_invariance(
                model, inputs0, space=space, seed=seed, tol=_invariance_tol(model)
            )
        except Exception as err:
            raise MeasureError(
                f"the invariance self-check could not run the model on batch 0: "
                f"{type(err).__name__}: {err}"
            ) from err
        if invariance.n_blocks == 0:
            say("self-check: no symmetry blocks, so there is nothing to re-parametrize")
        else:
            say(f"self-check: {invariance}")
        # without blocks there is nothing to check (check_invariance then reports passed=False)
        checked = invariance.n_blocks > 0
        if (
            checked
            and not invariance.passed
            and not all(map(math.isfinite, invariance.rel_changes))
        ):
            raise MeasureError(
                "self-check failed: the model's outputs on batch 0 are not finite (NaN or inf), "
                "so the invariance under re-parametrization cannot be checked; check the data "
                "and the model's weights"
            )
        if checked and not invariance.passed:
            worst = max(invariance.rel_changes)
            raise MeasureError(
                f"self-check failed: the model's outputs changed by up to {worst:.2g} (relative; "
                f"tolerance {invariance.tol:g}) under a random re-parametrization of the "
                f"{invariance.n_blocks} symmetry block(s) found, so at least one block is not a "
                "symmetry of this model (a wrong adapter, or a module whose forward differs from "
                "the layout the adapter expects). Measuring geodesic sharpness on it would be "
                "wrong. Fix or narrow the adapter (find_symmetries(adapters=...)), declare the "
                "blocks by hand (declare_block), or skip the check with --no-check / check=False "
                "if you know better"
            )
    n_cells = sum(len(rhos) if s.uses_rho else 1 for s in specs)
    say(f"measuring {n_cells} (measure, rho) cell(s) on {len(batches)} batch(es) ...")

    rows: list[MeasureRow] = []
    loss_eps = _loss_eps(model)
    bar = _progress(n_cells, progress, "measures")
    try:
        for spec in specs:
            for rho in rhos if spec.uses_rho else [None]:
                if bar is not None:
                    bar.set_postfix_str(f"{spec.name} rho={rho}")
                rows.append(
                    _measure_one(
                        model, loss_fn, batches, spec, rho, steps, eps, seed, space, progress, curv
                    )
                )
                row = rows[-1]
                rising = sum(still_rising(t, loss_eps) for t in row.traces)
                if row.error is not None:
                    _warn(f"{row.measure} at rho={row.rho} failed: {row.error}")
                elif 2 * rising > len(row.traces) > 0:
                    _warn(
                        f"{row.measure} at rho={row.rho}: on {rising} of {len(row.traces)} "
                        f"batch(es) the loss was still rising at the last of {steps} Auto-PGD "
                        "steps, so the value is a lower bound; more --steps may find more"
                    )
                elif (
                    spec.kind == "worst"
                    and spec.uses_rho
                    and row.value == 0.0
                    and all(len(t) > 1 and max(t) <= t[0] for t in row.traces)
                ):
                    _warn(
                        f"{row.measure} at rho={row.rho}: the ascent never raised the loss on any "
                        "batch; the value 0 is suspicious (a vanishing gradient, or a metric that "
                        "is not finite at these weights)"
                    )
                done = len(rows)
                left = sum(r.time_s for r in rows) / done * (n_cells - done)
                say(
                    f"  [{done}/{n_cells}] {row.measure}, rho={_g(row.rho)}: "
                    + ("failed" if row.value is None else f"{row.value:.5g}")
                    + f" in {_time(row.time_s)}"
                    + (f"; ≈ {_time(left)} left" if done < n_cells else "")
                )
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    dtype = next(iter(model.parameters())).dtype
    settings = {
        "measures": [s.name for s in specs],
        "rhos": rhos,
        "steps": steps,
        "eps": eps,
        "seed": seed,
        "loss": loss_name,
        "check": check,
        **({"curvature": curv} if any(s.measure == "curvature" for s in specs) else {}),
        "n_params": space.numel(),
        "n_gl_heads": sum(b.heads for b in space.gl_blocks),
        "n_diagonal_pairs": len(space.diagonal_pairs),
        "n_symmetry_blocks": len(space.blocks),
        "n_group_factors": space.n_group_factors,
        "device": str(next(iter(model.parameters())).device),
        "dtype": str(dtype).replace("torch.", ""),
    }
    return MeasureReport(
        rows=rows,
        symmetry_summary=summary,
        adaptive_note=note,
        invariance=invariance,
        clean_losses=clean,
        n_batches=len(batches),
        n_samples=_n_samples(batches),
        settings=settings,
        warnings=notes,
        time_s=time.perf_counter() - t_start,
    )


def _measure_one(
    model: nn.Module,
    loss_fn: Callable,
    batches: list,
    spec: MeasureSpec,
    rho: float | None,
    steps: int,
    eps: float,
    seed: int,
    space: ParameterSpace,
    progress: bool,
    curv: Mapping[str, Any],
) -> MeasureRow:
    t0 = time.perf_counter()
    try:
        if spec.measure == "relative_flatness":
            res = relative_flatness(model, loss_fn, batches)
        elif spec.measure == "curvature":
            cres = curvature(
                model,
                loss_fn,
                batches,
                measure=spec.of,
                metric=spec.metric or "inv",
                quantities=(spec.quantity,),
                iters=curv["iters"],
                probes=curv["probes"],
                trace_method=curv["trace_method"],
                seed=seed,
                eps=eps,
                space=space,
                progress=progress,
            )
            return MeasureRow.from_curvature(cres, spec.quantity)
        else:
            res = sharpness(
                model,
                loss_fn,
                batches,
                measure=spec.measure,
                metric=spec.metric or "inv",
                order=spec.order,
                kind=spec.kind,
                rho=rho,
                steps=steps,
                norm=spec.norm,
                corrected_norm=spec.corrected_norm,
                perturb=spec.perturb,
                eps=eps,
                seed=seed,
                space=space,
                progress=progress,
            )
    except (ValueError, FloatingPointError, RuntimeError, torch.linalg.LinAlgError) as err:
        return MeasureRow(
            measure=spec.name, rho=rho, value=None, time_s=time.perf_counter() - t0, error=str(err)
        )
    return MeasureRow.from_result(res, rho)
