"""How long a ``gs.measure`` run will take, said before it starts, and what would shorten it.

:func:`estimate_run` times one forward+backward pass of batch 0 (after one untimed pass that
warms up the caches) and multiplies it by the passes the plan needs: a worst-case measure runs
``steps`` Auto-PGD steps on every batch, one forward+backward each, which cost about 1.2
(adaptive, Euclidean) to 1.4 (geodesic) plain passes on models where the passes dominate
(``benchmarks/README.md``). On small models the per-step work of the geometry and of Python
dominates instead, so where ``gs.measure`` hands it a ``probe`` each worst-case measure's step
is timed on batch 0 instead (a 5-step less a 1-step ascent: four steps without the set-up, which
the cache keeps for the real run; twice, the faster kept: about 16 passes per measure, about 1 %
of a default run). A
batch costs in proportion to its size (tokens, or elements of its input). On a machine busy
with other work every timing is rough.
:meth:`RunEstimate.line` says the result in one line, and :meth:`RunEstimate.advice`, for a long
run on a CPU, what each option of ``geosharp measure`` would cut it to. Nothing is changed for
the user: every option that shortens a run also changes what it measures, and the advice says
how.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from geosharp.measuring.estimate import estimate_run
    >>> from geosharp.measures import parse_measure
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    >>> batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(2)]
    >>> est = estimate_run(model, nn.functional.cross_entropy, batches,
    ...                    [parse_measure("adaptive")], [0.01, 0.1], steps=20)
    >>> est.n_cells, est.passes
    (2, 80.0)
    >>> est.line().startswith("time estimate: 2 cells × 20 steps × 2 batches ≈ 80 forward+")
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.measures import Measure
from geosharp.measures.base import FORWARD_COST
from geosharp.measuring.results import _time
from geosharp.symmetry.verify import call_model, eval_mode
from geosharp.symmetry.verify import to_device as _to_device

__all__ = ["LONG_RUN_S", "PROBE_STEPS", "RunEstimate", "batch_sizes", "estimate_run"]

#: A run estimated longer than this on a CPU gets the advice of :meth:`RunEstimate.advice`.
LONG_RUN_S = 300.0
#: The steps a probe times: a (1 + this)-step ascent less a 1-step one, so the set-up cancels.
PROBE_STEPS = 4
#: Times a probe is repeated (the fastest is kept).
PROBE_REPEATS = 2


def _input_size(inputs: Any) -> int:
    """The size a batch's cost grows with: the elements of its token ids, or of its inputs."""
    if isinstance(inputs, Tensor):
        return max(int(inputs.numel()), 1)
    if isinstance(inputs, Mapping):
        if isinstance(inputs.get("input_ids"), Tensor):
            return max(int(inputs["input_ids"].numel()), 1)
        return max(sum(_input_size(v) for v in inputs.values()), 1)
    if isinstance(inputs, (tuple, list)):
        return max(sum(_input_size(v) for v in inputs), 1)
    return 1


def _rows(inputs: Any, targets: Any) -> int | None:
    """Samples in a batch (the first dimension of its targets), if it says."""
    if isinstance(targets, Tensor) and targets.dim() > 0:
        return int(targets.shape[0])
    if isinstance(inputs, Tensor) and inputs.dim() > 0:
        return int(inputs.shape[0])
    return None


def _width(inputs: Any) -> int | None:
    """Tokens per sequence of a batch of token ids (its padded width), else ``None``."""
    if isinstance(inputs, Mapping) and isinstance(inputs.get("input_ids"), Tensor):
        ids = inputs["input_ids"]
        return int(ids.shape[-1]) if ids.dim() == 2 else None
    return None


def batch_sizes(batches: Sequence[Any]) -> dict[str, int]:
    """What the batches show of the sizes a run used (for the result files).

    Returns:
        ``largest_batch`` (samples in the largest batch) and, for batches of token ids,
        ``longest_input`` (tokens of the widest batch, its padded length); a key is left out
        where the batches do not say.

    Example:
        >>> batch_sizes([({"input_ids": torch.zeros(4, 7)}, torch.zeros(4)),
        ...              ({"input_ids": torch.zeros(2, 9)}, torch.zeros(2))])
        {'largest_batch': 4, 'longest_input': 9}
    """
    rows = [_rows(b[0], b[1]) for b in batches if isinstance(b, (tuple, list)) and len(b) == 2]
    widths = [_width(b[0]) for b in batches if isinstance(b, (tuple, list)) and len(b) == 2]
    out = {}
    if rows and all(r is not None for r in rows):
        out["largest_batch"] = max(r for r in rows if r is not None)
    if widths and all(w is not None for w in widths):
        out["longest_input"] = max(w for w in widths if w is not None)
    return out


@dataclass
class RunEstimate:
    """The estimated time of a ``gs.measure`` run, from one timed forward+backward pass.

    Attributes:
        n_cells: (measure, ρ) cells (measures without ρ count once).
        steps: Auto-PGD steps per batch.
        n_batches: Batches.
        passes: Forward+backward passes of the plan (steps × batches × cells for worst-case
            measures, each batch weighed by its size against batch 0).
        pass_s: Seconds of one forward+backward pass of batch 0.
        seconds: The estimate: every cell's steps at the timed cost of a step (else
            :meth:`Measure.step_cost` passes), each batch weighed by its size.
        device: Where the model runs (``"cpu"``, ``"cuda:0"``, ...).
        threads: Torch CPU threads.
        worst_only: Every cell is a worst-case measure (the line then shows the product).
        n_rhos: Radii; n_measures: measures (for the advice).
        n_samples: Samples in all batches, if the batches say.
        weights: The size of every batch relative to batch 0.
        widths: The padded width of every batch of token ids (``None`` otherwise).
        rows: Samples of every batch (``None`` where unknown).
        cells: ``(measure, ρ, seconds)`` of every cell, in order.
        step_s: The seconds of one ascent step on batch 0 of every worst-case measure that was
            timed (``probe``).
        busy: ``(load average, CPU cores)`` when other work kept the machine busier than its
            cores while timing (the timings are then rough), else ``None``.
    """

    n_cells: int
    steps: int
    n_batches: int
    passes: float
    pass_s: float
    seconds: float
    device: str
    threads: int
    worst_only: bool
    n_rhos: int
    n_measures: int
    n_samples: int | None
    weights: list[float] = field(default_factory=list)
    widths: list[int | None] = field(default_factory=list)
    rows: list[int | None] = field(default_factory=list)
    cells: list[tuple[str, float | None, float]] = field(default_factory=list)
    step_s: dict[str, float] = field(default_factory=dict)
    busy: tuple[float, int] | None = None

    def line(self) -> str:
        """One line: the cells, the passes and the time, e.g. ``9 cells × 20 steps × 8 ...``."""
        plan = (
            f"{self.n_cells} cell{'s' if self.n_cells != 1 else ''} × {self.steps} steps × "
            f"{self.n_batches} batch{'es' if self.n_batches != 1 else ''}"
            if self.worst_only
            else f"{self.n_cells} cell{'s' if self.n_cells != 1 else ''} on {self.n_batches} "
            f"batch{'es' if self.n_batches != 1 else ''}"
        )
        threads = f", {self.threads} thread{'s' if self.threads != 1 else ''}"
        where = self.device + (threads if self.device == "cpu" else "")
        return (
            f"time estimate: {plan} ≈ {self.passes:,.0f} forward+backward passes ≈ "
            f"{_time(self.seconds)} on this machine ({where}; one forward+backward of batch 0 "
            f"took {_short(self.pass_s)}"
            + (
                f", an ascent step {_span(self.step_s.values())}, timed on batch 0)"
                if self.step_s
                else ", an ascent step costs about 1.2 (adaptive) to 1.4 (geodesic) of them)"
            )
            + (
                f"; rough: the machine is busy with other work (load average {self.busy[0]:.1f} "
                f"on {self.busy[1]} cores)"
                if self.busy
                else ""
            )
        )

    @property
    def long(self) -> bool:
        """On a CPU and longer than :data:`LONG_RUN_S`."""
        return self.device == "cpu" and self.seconds > LONG_RUN_S

    def _scaled(self, weights: Sequence[float], steps_factor: float = 1.0) -> float:
        """The estimate with other batch sizes (relative to batch 0) and a share of the steps."""
        total = sum(self.weights) or 1.0
        return self.seconds * (sum(weights) / total) * steps_factor

    def advice(self) -> list[str]:
        """What each option of ``geosharp measure`` would cut a long CPU run to (estimates).

        Empty unless :attr:`long`. Every option changes what is measured, and each line says
        how; nothing is applied.
        """
        if not self.long:
            return []
        lines = [
            "this run is long for a CPU; estimates of what each option would cut it to "
            "(nothing is changed for you, and each changes what is measured; in Python: fewer "
            "or smaller batches, steps=, rhos=, measures=):"
        ]
        combo, factor = [], 1.0
        n = self.n_samples
        if n is not None and n >= 8:
            keep = _round_down(n // 4)
            cut, seen = [], 0
            for w, r in zip(self.weights, self.rows, strict=True):
                take = min(r or 0, keep - seen)
                if take <= 0:
                    break
                cut.append(w * take / (r or 1))
                seen += take
            t = self._scaled(cut)
            smaller = keep < max(r or 0 for r in self.rows)
            lines.append(
                f"  --samples {keep}: ≈ {_time(t)} (the first {keep:,} of {n:,} samples: "
                + (
                    "one batch of fewer samples, a different m of m-sharpness)"
                    if smaller
                    else "the mean over fewer batches, a noisier estimate of the same measure)"
                )
            )
            combo.append(f"--samples {keep}")
            factor *= t / self.seconds
        widest = max((w for w in self.widths if w is not None), default=None)
        if widest is not None and widest >= 32:
            limit = _round_down(widest // 2)
            cut = [
                wt * min(wd, limit) / wd if wd else wt
                for wt, wd in zip(self.weights, self.widths, strict=True)
            ]
            t = self._scaled(cut)
            lines.append(
                f"  --max-length {limit}: ≈ {_time(t)} (batches are up to {widest} tokens wide; "
                "longer texts are cut, so the loss is that of their first tokens)"
            )
            combo.append(f"--max-length {limit}")
            factor *= t / self.seconds
        if self.worst_only and self.steps > 10:
            lines.append(
                f"  --steps 10: ≈ {_time(self.seconds * 10 / self.steps)} (a shorter ascent finds "
                "less: more values are lower bounds, which the warnings flag)"
            )
        if self.n_rhos > 1:
            per_rho = sum(t for _, rho, t in self.cells if rho is not None) / self.n_rhos
            lines.append(
                f"  fewer --rho: each radius left out of the {self.n_rhos} saves ≈ {_time(per_rho)}"
                " (the other radii's values do not change)"
            )
        if self.n_measures > 1:
            per: dict[str, float] = {}
            for name, _, t in self.cells:
                per[name] = per.get(name, 0.0) + t
            lines.append(
                f"  fewer --measures: each measure left out of the {self.n_measures} saves ≈ "
                f"{_span(per.values())} (the others' values do not change)"
            )
        if len(combo) > 1:
            lines.append(f"  {' '.join(combo)} together: ≈ {_time(self.seconds * factor)}")
        lines.append(
            "  --batch-size alone cuts little (the same samples in more, smaller batches) and "
            "changes the measure: the worst case is taken per batch of m samples (m-sharpness), "
            "so compare runs only at the same --batch-size"
        )
        return lines


def _short(seconds: float) -> str:
    """A duration as :func:`_time` says it, in milliseconds below one second.

    Example:
        >>> _short(0.0123), _short(4.56), _short(150)
        ('12 ms', '4.6 s', '2.5 min')
    """
    if seconds >= 0.9995:
        return _time(seconds)
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def _span(values: Any) -> str:
    """``"1.2 s"`` or ``"1.2 s to 3.4 s"``: the range of some durations, as :func:`_time` says."""
    values = list(values)
    lo, hi = _short(min(values)), _short(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def _busy() -> tuple[float, int] | None:
    """``(load average, cores)`` if the last minute's load exceeds the cores, else ``None``."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # not on every platform
        return None
    return (load, cores) if load > cores else None


def _round_down(n: int) -> int:
    """The largest power of two ≤ ``n`` (at least 1): option values a person would type."""
    return 1 << max(int(n).bit_length() - 1, 0)


def _timed_pass(model: nn.Module, loss_fn: Callable, batch: Any) -> float:
    """Seconds of one forward+backward pass on ``batch`` (gradients not kept)."""
    params = dict(model.named_parameters())
    trainable = [p for p in params.values() if p.requires_grad]
    device = next(iter(params.values())).device
    inputs, targets = _to_device(batch[0], device), _to_device(batch[1], device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with eval_mode(model):
        loss = loss_fn(call_model(model, params, inputs), targets)
        if trainable and loss.requires_grad:
            torch.autograd.grad(loss, trainable, allow_unused=True)
    sync()
    return time.perf_counter() - t0


def estimate_run(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence[Any],
    specs: Sequence[Measure],
    rhos: Sequence[float] | Mapping[str, Sequence[float]],
    steps: int,
    curv: Mapping[str, Any] | None = None,
    probe: Callable[[Measure, int], float] | None = None,
) -> RunEstimate:
    """Time one forward+backward pass of batch 0 and estimate the whole run from it.

    The pass is run three times and the faster of the last two is taken (the first warms up
    allocators and kernels; the faster of two is the less disturbed by other work).
    The model's weights are not written to and no gradient is left in ``.grad``.

    Args:
        model: The model, on its device and in its dtype.
        loss_fn: The loss.
        batches: The ``(inputs, targets)`` batches.
        specs: The measures.
        rhos: The radii, or measure name → its radii.
        steps: Auto-PGD steps per batch.
        curv: ``iters`` and ``probes`` of the curvature measures.
        probe: ``probe(spec, k)``: the seconds of a ``k``-step ascent of the worst-case
            measure ``spec`` on batch 0 (``gs.measure`` passes one); a step is then timed
            (:data:`PROBE_STEPS`), else it is :meth:`Measure.step_cost` forward+backward passes.

    Returns:
        A :class:`RunEstimate`.
    """
    curv = curv or {}
    batches = list(batches)
    _timed_pass(model, loss_fn, batches[0])  # warms up allocators and kernels
    pass_s = min(_timed_pass(model, loss_fn, batches[0]) for _ in range(2))
    sizes = [_input_size(b[0]) for b in batches]
    weights = [s / sizes[0] for s in sizes]

    def radii(s: Measure) -> Sequence[float | None]:
        if not s.uses_rho:
            return [None]
        return rhos[s.name] if isinstance(rhos, Mapping) else rhos

    cells = [(s, r) for s in specs for r in radii(s)]
    step_s: dict[str, float] = {}
    for spec in specs:
        if probe is not None and spec.ascends and spec.name not in step_s:
            # twice, keeping the faster: other work on the machine only ever slows a timing
            diffs = [
                (probe(spec, 1 + PROBE_STEPS) - probe(spec, 1)) / PROBE_STEPS
                for _ in range(PROBE_REPEATS)
            ]
            if min(diffs) > 0:  # else the machine's noise swamped the steps: use the passes
                step_s[spec.name] = min(diffs)

    def cost(spec: Measure) -> float:
        if spec.name in step_s:
            return steps * step_s[spec.name] + FORWARD_COST * pass_s
        return spec.step_cost(steps, curv) * pass_s

    cell_seconds = [cost(s) * sum(weights) for s, _ in cells]
    named = [(s.name, r, t) for (s, r), t in zip(cells, cell_seconds, strict=True)]
    worst_only = all(s.ascends for s, _ in cells)
    passes = (
        float(len(cells) * steps * len(batches))
        if worst_only
        else sum(s.step_cost(steps, curv) for s, _ in cells) * len(batches)
    )
    rows = [_rows(b[0], b[1]) for b in batches]
    first = next(iter(model.parameters()))
    return RunEstimate(
        n_cells=len(cells),
        steps=steps,
        n_batches=len(batches),
        passes=passes,
        pass_s=pass_s,
        seconds=sum(cell_seconds),
        device=str(first.device),
        threads=torch.get_num_threads(),
        worst_only=worst_only,
        n_rhos=max((len(radii(s)) for s in specs if s.uses_rho), default=0),
        n_measures=len(specs),
        n_samples=sum(r for r in rows if r is not None)
        if all(r is not None for r in rows)
        else None,
        weights=weights,
        widths=[_width(b[0]) for b in batches],
        rows=rows,
        cells=named,
        step_s=step_s,
        busy=_busy(),
    )
