"""What Studies 2 and 3 share: a population of classifiers and one measurement protocol.

Both transformer studies follow the paper's recipe for its real populations (SPEC §7): every
model sees the same training data and differs only in hyperparameters drawn at random; the gap
is an error difference; sharpness is measured on a fixed subset of training points with the
same plan of measures and the same ρ rule. This module holds that common part, so that a study
module only says what is its own (data, model, batches, learning-rate schedule):

* :class:`ClassifierStudy` — the :class:`~geosharp.studies.runner.Study` base: validation of
  the config, the population (``np.random.default_rng(seed + 1)``), the training loop (AdamW,
  gradient-norm clip 1, a per-model schedule, a per-model seed for initialization, data order,
  dropout and augmentation), checkpointing, inclusion rule, loss and plan.
* :func:`standard_plan` — the measures: adaptive ℓ2/ℓ∞ and geodesic inv/mix at order 2; the
  ablations (order 1, no corrected norm); average-case adaptive/inv/mix; relative flatness.
* **The ρ rule** — :data:`RADIUS_FAMILIES`, :func:`half_decade_grid` and
  :func:`calibrate_rhos`: three ρ per radius family, ``{ρ₀/√10, ρ₀, √10·ρ₀}``, the centre
  ``ρ₀ = 10^{k/2}`` being where one pilot model's rise is closest (log scale) to 0.1 (worst
  case) or 0.01 (average case). Only the pilot's sharpness is looked at: no gap, no τ.
* **Curvature, opt-in** — :class:`CurvaturePlan` and :func:`curvature_specs`: the largest
  eigenvalue and the trace of the Hessian on the quotient (:func:`geosharp.curvature`,
  SPEC §9) for geodesic inv and mix, adaptive and Euclidean curvature, no ρ.
  ``study.with_curvature()`` adds them to the plan and records the :class:`CurvaturePlan` in
  the study's config; without it the plan and the config are those of the committed results.
* **Diagnostics** — :meth:`ClassifierStudy.diagnose` and :func:`diagnose_folder`:
  per model, the orbit position of every attention head
  (:func:`geosharp.estimators.diagnostics.balance`) and the Auto-PGD optima of adaptive ℓ2 and
  geodesic inv at the middle ρ of their grids (budget split, order-2 displacement:
  :func:`~geosharp.estimators.diagnostics.ascent_diagnostics`), one row per model in the
  folder's ``diagnostics.csv``, which the study report turns into a section. Study 4
  (:mod:`geosharp.studies.vit_orbit`) computes its rows with the same method.
"""

from __future__ import annotations

import csv
import math
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp._io import torch_save_atomically
from geosharp.estimators.diagnostics import ascent_diagnostics, balance, summary_row
from geosharp.studies.runner import Study, StudyMeasure
from geosharp.studies.store import Store

__all__ = [
    "CALIBRATION_TARGET",
    "CLASSIFIER_CURVATURE",
    "DIAGNOSTICS_FILE",
    "DIAGNOSTIC_FAMILIES",
    "RADIUS_FAMILIES",
    "ClassifierStudy",
    "CurvaturePlan",
    "append_diagnostics",
    "calibrate_rhos",
    "curvature_specs",
    "diagnose_folder",
    "grids_text",
    "half_decade_grid",
    "ladder_grid",
    "read_diagnostics",
    "save_atomically",
    "standard_plan",
]


def half_decade_grid(centre: float) -> tuple[float, ...]:
    """The half-decade grid ``(ρ₀/√10, ρ₀, √10·ρ₀)`` of the ladder point ``ρ₀ = 10^{k/2}``.

    ``centre`` is snapped to the nearest point of the ladder ``10^{k/2}``; values are rounded
    to 3 significant digits.

    Example:
        >>> half_decade_grid(0.1), half_decade_grid(0.316)
        ((0.0316, 0.1, 0.316), (0.1, 0.316, 1.0))
    """
    k = round(2 * math.log10(centre))
    return tuple(float(f"{10 ** (j / 2):.3g}") for j in (k - 1, k, k + 1))


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename (never a half file)."""
    torch_save_atomically(obj, path)


@dataclass(frozen=True)
class CurvaturePlan:
    """The opt-in curvature part of a study's plan: :func:`geosharp.curvature` per model.

    Every (measure, quantity) pair is one row of the study (no ρ), named as
    :func:`geosharp.measuring.core.curvature_name` spells it, e.g.
    ``"geodesic-inv curvature lambda_max"``. Lanczos starts and trace probes use ``seed``
    (batch ``b``: ``batch_seed(seed, b)``), so the rows do not depend on which others are
    measured.

    Attributes:
        measures: ``(measure, metric)`` pairs: geodesic inv and mix, adaptive and Euclidean
            (the metric is ignored but by geodesic curvature).
        quantities: Any of ``"lambda_max"``, ``"lambda_min"``, ``"trace"``.
        iters: Most Lanczos iterations per batch (λ).
        tol: Lanczos tolerance on the residual of the wanted Ritz pair, relative to it.
        probes: Hutchinson probes per batch (trace; unused by ``trace_method="exact"``).
        trace_method: ``"hutchinson"``, ``"hutch++"`` or ``"exact"``.
        seed: Seed of the Lanczos starts and the probes.
    """

    measures: tuple[tuple[str, str], ...] = (
        ("geodesic", "inv"),
        ("geodesic", "mix"),
        ("adaptive", ""),
        ("euclidean", ""),
    )
    quantities: tuple[str, ...] = ("lambda_max", "trace")
    iters: int = 50
    tol: float = 1e-5
    probes: int = 100
    trace_method: str = "hutchinson"
    seed: int = 0

    def text(self) -> str:
        """One line for a report's settings."""
        which = ", ".join(f"geodesic {m}" if k == "geodesic" else k for k, m in self.measures)
        parts = []
        if any(q.startswith("lambda") for q in self.quantities):
            parts.append(
                f"λ by Lanczos in the metric (≤ {self.iters} iterations, tol {self.tol:g})"
            )
        if "trace" in self.quantities:
            parts.append(
                "exact trace (one product per coordinate)"
                if self.trace_method == "exact"
                else f"trace by {self.trace_method} ({self.probes} probes)"
            )
        return (
            f"{', '.join(self.quantities)} of the Hessian on the quotient (SPEC §9, gs.curvature) "
            f"for {which}, per batch and averaged over the batches; "
            + "; ".join(parts)
            + f"; seed {self.seed}"
        )


#: The curvature part of Studies 2 and 3 (``with_curvature()``), fixed from the cost on the
#: pilot ``vit-000`` before any curvature τ was computed: on one core a product costs 0.1–0.2 s
#: per batch of 128 and Lanczos meets ``tol = 1e-5`` in 10–12 iterations, so λ_max of the four
#: measures costs ≈ 25 s per model; 20 Hutchinson probes per batch (≈ 32 s per model) give the
#: pilot's trace a standard error of ≈ 2 % (5.7 % per batch with 10 probes), 100 would cost
#: 160 s per model.
CLASSIFIER_CURVATURE = CurvaturePlan(probes=20)


def curvature_specs(plan: CurvaturePlan) -> list[StudyMeasure]:
    """The :class:`StudyMeasure` of every (measure, quantity) of ``plan`` (``rhos = (None,)``).

    Raises:
        ValueError: On an unknown measure or quantity.
    """
    specs = []
    for measure, metric in plan.measures:
        if measure not in ("geodesic", "adaptive", "euclidean"):
            raise ValueError(
                f"curvature measure must be geodesic, adaptive or euclidean: {measure}"
            )
        for q in plan.quantities:
            if q not in ("lambda_max", "lambda_min", "trace"):
                raise ValueError(f"curvature quantity must be lambda_max/lambda_min/trace: {q}")
            kw: dict[str, Any] = {"measure": "curvature", "of": measure, "quantity": q}
            if measure == "geodesic":
                kw["metric"] = metric
            if q == "trace":
                kw["trace_method"] = plan.trace_method
                if plan.trace_method != "exact":
                    kw["probes"] = plan.probes
            else:
                kw.update(iters=plan.iters, tol=plan.tol)
            kw["seed"] = plan.seed
            specs.append(StudyMeasure(kw, (None,)))
    return specs


def _interval(r: tuple[float, float]) -> str:
    return f"[{r[0]:g}, {r[1]:g}]"


class ClassifierStudy(Study):
    """A population of classifiers trained on the same data with random hyperparameters.

    Subclasses set the class attributes, hold a frozen dataclass config in ``self.cfg`` (fields
    ``n_models``, ``seed``, ``n_train``, ``n_sharp``, ``sharp_batch``, ``max_train_error``, the
    ranges ``lr``, ``weight_decay``, ``batch_sizes``, ``epochs``, ``label_smoothing``,
    ``dropout``, one range per name in :attr:`extra_uniform`, and what :func:`standard_plan`
    needs), and implement the data hooks.

    The population draws, per model and in this order: learning rate and weight decay
    (log-uniform in their ranges), batch size and epochs (uniform choices), label smoothing and
    dropout (uniform), the :attr:`extra_uniform` hyperparameters (uniform) and a seed. Training
    is AdamW on the parameters that require gradients, the schedule :meth:`lr_factor`, gradient
    norm clipped at 1, cross-entropy with the model's label smoothing; a model whose loss turns
    non-finite or whose train error exceeds ``max_train_error`` is kept on record but excluded.
    """

    #: Model ids are ``f"{prefix}-{i:03d}"``.
    prefix: str = "model"
    #: The held-out split: metrics ``{split}_error`` and ``{split}_loss``; gap is its error
    #: minus the train error.
    eval_split: str = "test"
    #: Verb of the progress bar and of the exclusion note ("training", "fine-tuning").
    activity: str = "training"
    #: Module path of the classification head (relative flatness).
    head: str = "head"
    #: Hyperparameters drawn uniformly from the config range of the same name, after dropout.
    extra_uniform: tuple[str, ...] = ()
    #: The curvature plan of :meth:`with_curvature` without an argument.
    default_curvature: CurvaturePlan = CLASSIFIER_CURVATURE
    #: The opt-in curvature part of the plan (:meth:`with_curvature`); ``None``: none.
    curvature: CurvaturePlan | None = None

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        if cfg.n_sharp > cfg.n_train or cfg.n_sharp % cfg.sharp_batch:
            raise ValueError(
                f"n_sharp={cfg.n_sharp} must be ≤ n_train={cfg.n_train} and a multiple of "
                f"sharp_batch={cfg.sharp_batch}"
            )
        if cfg.n_models < 2:
            raise ValueError(f"n_models must be at least 2 (τ needs pairs), got {cfg.n_models}")
        self._data: dict[str, Any] | None = None
        self._batches: list[tuple[Any, Any]] | None = None

    # -- hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def build(self, dropout: float | None = None) -> nn.Module:
        """A freshly initialized model with dropout rate ``dropout`` (seed torch first)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str) -> tuple[float, float]:
        """Error rate and mean cross-entropy on ``"train"`` or :attr:`eval_split` (eval mode)."""

    @abstractmethod
    def n_train_examples(self) -> int:
        """Size of the training set (the training loop permutes ``range`` of it)."""

    @abstractmethod
    def training_batch(
        self, index: Tensor, hp: dict[str, Any], generator: torch.Generator
    ) -> tuple[Any, Tensor]:
        """Inputs and labels of the training examples ``index`` (augmented with ``generator``)."""

    @abstractmethod
    def lr_factor(self, total: int) -> Callable[[int], float]:
        """The learning-rate multiplier of step ``t`` of ``total`` (a ``LambdaLR`` lambda)."""

    def logits(self, model: nn.Module, inputs: Any) -> Tensor:
        """The logits of ``inputs``: ``model(inputs)``, or ``model(**inputs).logits`` for dicts."""
        if isinstance(inputs, dict):
            return model(**inputs).logits
        return model(inputs)

    def checkpoint_state(self, model: nn.Module) -> dict[str, Tensor]:
        """What is saved of a trained model (default: the whole ``state_dict``)."""
        return model.state_dict()

    def hyperparameter_text(self, labels: dict[str, str] | None = None) -> str:
        """The hyperparameter distribution, for the report's settings.

        Args:
            labels: Words for the :attr:`extra_uniform` names (default: the name).
        """
        c = self.cfg
        labels = labels or {}
        extra = "".join(
            f", {labels.get(name, name)} ~ U{_interval(getattr(c, name))}"
            for name in self.extra_uniform
        )
        return (
            f"lr ~ logU{_interval(c.lr)}, weight decay ~ logU{_interval(c.weight_decay)} "
            f"(AdamW), batch size ∈ {list(c.batch_sizes)}, epochs ∈ {list(c.epochs)}, label "
            f"smoothing ~ U{_interval(c.label_smoothing)}, dropout ~ U{_interval(c.dropout)}"
            + extra
        )

    def with_curvature(self, plan: CurvaturePlan | None = None) -> ClassifierStudy:
        """Add the curvature rows to the plan (default :attr:`default_curvature`).

        The plan is recorded in :meth:`config` under ``"curvature"``, so a folder measured
        without curvature is refused unless reused with ``force`` (its rows are kept, and
        only the curvature rows are measured).

        Returns:
            The study itself.
        """
        self.curvature = plan or self.default_curvature
        return self

    # -- Study interface -----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The config dataclass as a dict (with ``"curvature"`` only when it is measured)."""
        out = asdict(self.cfg)
        if self.curvature is not None:
            out["curvature"] = asdict(self.curvature)
        return out

    def notes(self) -> list[str]:
        """The curvature settings, when curvature is measured."""
        if self.curvature is None:
            return []
        return [f"Curvature (no ρ): {self.curvature.text()}."]

    def population(self) -> list[tuple[str, dict[str, Any]]]:
        """``{prefix}-000 …`` with hyperparameters drawn from ``default_rng(seed + 1)``."""
        c = self.cfg
        rng = np.random.default_rng(c.seed + 1)

        def log_uniform(r: tuple[float, float]) -> float:
            return float(math.exp(rng.uniform(math.log(r[0]), math.log(r[1]))))

        out = []
        for i in range(c.n_models):
            hp: dict[str, Any] = {
                "lr": log_uniform(c.lr),
                "weight_decay": log_uniform(c.weight_decay),
                "batch_size": int(rng.choice(c.batch_sizes)),
                "epochs": int(rng.choice(c.epochs)),
                "label_smoothing": float(rng.uniform(*c.label_smoothing)),
                "dropout": float(rng.uniform(*c.dropout)),
            }
            for name in self.extra_uniform:
                hp[name] = float(rng.uniform(*getattr(c, name)))
            hp["seed"] = int(rng.integers(2**31 - 1))
            out.append((f"{self.prefix}-{i:03d}", hp))
        return out

    def train(
        self, todo: list[tuple[str, dict[str, Any]]], out_dir: Path, store: Store, progress: bool
    ) -> None:
        """Train the models one at a time; each is saved and recorded as soon as it is done."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc=f"{self.activity} {self.prefix} models")
        for mid, hp in todo:
            t0 = time.perf_counter()
            state, metrics = self.fit(hp)
            path = out_dir / "checkpoints" / f"{mid}.pt"
            save_atomically(state, path)
            store.put_model(
                mid,
                hparams=hp,
                metrics=metrics,
                gap=metrics[f"{self.eval_split}_error"] - metrics["train_error"],
                checkpoint=str(path.relative_to(out_dir)),
                seed=hp["seed"],
                train_time_s=time.perf_counter() - t0,
            )
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def fit(self, hp: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Train one model with hyperparameters ``hp`` (deterministic in ``hp["seed"]``).

        Returns:
            What :meth:`checkpoint_state` keeps of the trained model, and its metrics
            (train and held-out error and loss, steps; ``excluded``/``note`` if it diverged or
            did not learn).
        """
        c = self.cfg
        n = self.n_train_examples()
        gen = torch.Generator().manual_seed(hp["seed"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp["seed"])  # initialization and dropout
            model = self.build(dropout=hp["dropout"])
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"])
            bs = hp["batch_size"]
            per_epoch = math.ceil(n / bs)
            total = per_epoch * hp["epochs"]
            sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor(total))
            finite = True
            model.train()
            for _ in range(hp["epochs"]):
                perm = torch.randperm(n, generator=gen)
                for i in range(per_epoch):
                    inputs, y = self.training_batch(perm[i * bs : (i + 1) * bs], hp, gen)
                    loss = F.cross_entropy(
                        self.logits(model, inputs), y, label_smoothing=hp["label_smoothing"]
                    )
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    sched.step()
                if not finite:
                    break
        model.eval()
        split = self.eval_split
        train_error, train_loss = self.evaluate(model, "train")
        eval_error, eval_loss = self.evaluate(model, split)
        metrics: dict[str, Any] = {
            "train_error": train_error,
            f"{split}_error": eval_error,
            "train_loss": train_loss,
            f"{split}_loss": eval_loss,
            "steps": total,
        }
        if not finite or not math.isfinite(train_loss):
            metrics.update(
                excluded=True, note=f"{self.activity} diverged (non-finite loss); left out"
            )
        elif train_error > c.max_train_error:
            metrics.update(
                excluded=True,
                note=f"did not learn (train error {train_error:.3f} > {c.max_train_error:g}); "
                "left out",
            )
        return self.checkpoint_state(model), metrics

    def included(self, row: dict[str, Any]) -> bool:
        """Diverged models and models that did not learn are left out (and noted)."""
        return not row.get("excluded", False)

    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """Cross-entropy of the logits (mean over the batch, no label smoothing)."""
        logits = outputs.logits if hasattr(outputs, "logits") else outputs
        return F.cross_entropy(logits, targets)

    def diagnose(
        self,
        model: nn.Module,
        *,
        key_bias: str | None = None,
        batches: list[tuple[Any, Any]] | None = None,
    ) -> dict[str, float]:
        """The diagnostics row of one model: orbit position, ascent optima at the middle ρ.

        For every family of :data:`DIAGNOSTIC_FAMILIES` (adaptive ℓ2, geodesic inv at order 2)
        the worst-case ℓ2 ascent of the plan is re-run at the middle ρ of the config's grid
        ``rhos_<key>`` with the config's ``steps`` (the same Auto-PGD as the study's row, so
        ``<key>_value`` is that sharpness) and its optimum inspected; with the orbit position
        of every head (:func:`~geosharp.estimators.diagnostics.balance`) it makes one row
        (:func:`~geosharp.estimators.diagnostics.summary_row`).

        Args:
            model: The trained model (never written).
            key_bias: ``"quotient"`` or ``"keep"`` (default: the study's ``key_bias``).
            batches: Sharpness batches (default: :meth:`batches`).

        Returns:
            Column → value.
        """
        c = self.cfg
        kb = self.key_bias if key_bias is None else key_bias
        data = self.batches() if batches is None else batches
        ascents = {}
        for key, family in DIAGNOSTIC_FAMILIES.items():
            grid = getattr(c, f"rhos_{key}")
            ascents[key] = ascent_diagnostics(
                model,
                self.loss_fn,
                data,
                rho=grid[len(grid) // 2],
                steps=c.steps,
                key_bias=kb,
                **family,
            )
        return summary_row(balance(model, key_bias=kb), ascents)

    def plan(self) -> list[StudyMeasure]:
        """Every measure of the study at its three ρ (:func:`standard_plan`), then curvature."""
        specs = standard_plan(self.cfg, head=self.head)
        if self.curvature is not None:
            specs += curvature_specs(self.curvature)
        return specs


#: Worst-case ℓ2 measures whose Auto-PGD optimum :meth:`ClassifierStudy.diagnose` inspects, at
#: the middle ρ of the config's grid ``rhos_<key>`` (key → measure keywords).
DIAGNOSTIC_FAMILIES: dict[str, dict[str, Any]] = {
    "adaptive_l2": {"measure": "adaptive"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
}

#: Name of the per-model diagnostics file in a study folder (the study report shows it).
DIAGNOSTICS_FILE = "diagnostics.csv"


def read_diagnostics(path: str | Path) -> dict[str, dict[str, float]]:
    """``model_id`` → its diagnostics (complete rows only; a missing file is empty)."""
    p = Path(path)
    if not p.is_file():
        return {}
    out: dict[str, dict[str, float]] = {}
    with p.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            if None in row or any(v is None for v in row.values()):
                continue  # a torn last line
            try:
                out[row["model_id"]] = {
                    k: float(v) for k, v in row.items() if k != "model_id" and v != ""
                }
            except ValueError:
                continue
    return out


def append_diagnostics(path: str | Path, model_id: str, values: dict[str, float]) -> None:
    """Append one model's row (the header is written with the first row)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.is_file() or p.stat().st_size == 0
    if new:
        header = ["model_id", *values]
    else:
        with p.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh))
    with p.open("a", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=header, extrasaction="ignore", restval="")
        if new:
            w.writeheader()
        w.writerow({"model_id": model_id, **{k: repr(float(v)) for k, v in values.items()}})
        fh.flush()


def diagnose_folder(
    study: ClassifierStudy,
    out_dir: str | Path,
    *,
    key_bias: str | None = None,
    path: str | Path | None = None,
    extra: Callable[[dict[str, Any]], dict[str, float]] | None = None,
    log: Callable[[str], None] | None = None,
) -> int:
    """The diagnostics row of every analysed model of a study folder (resumable).

    Every stored model that the study includes and whose checkpoint is in ``out_dir`` and
    that has no row yet is loaded (:meth:`ClassifierStudy.load`), diagnosed
    (:meth:`ClassifierStudy.diagnose`) and appended to ``path`` with its
    ``diagnostics_time_s`` and the columns of ``extra(model_row)``.

    Args:
        study: The study of the folder.
        out_dir: The folder (``study.sqlite`` and the checkpoints).
        key_bias: Passed to :meth:`ClassifierStudy.diagnose`.
        path: The CSV (default ``out_dir / "diagnostics.csv"``).
        extra: More columns of a model's row (e.g. its weight decay).
        log: Called with one line per model.

    Returns:
        The number of rows written.
    """
    out = Path(out_dir)
    target = Path(path) if path is not None else out / DIAGNOSTICS_FILE
    with Store(out / "study.sqlite", None, None) as store:
        rows = sorted(store.models(), key=lambda r: r["model_id"])
    written = 0
    for row in rows:
        if not study.included(row) or not row.get("checkpoint"):
            continue
        if row["model_id"] in read_diagnostics(target):
            continue
        row = {**row, "checkpoint_path": str(out / row["checkpoint"])}
        t0 = time.perf_counter()
        values = study.diagnose(study.load(row), key_bias=key_bias)
        if extra is not None:
            values.update(extra(row))
        values["diagnostics_time_s"] = time.perf_counter() - t0
        append_diagnostics(target, row["model_id"], values)
        written += 1
        if log is not None:
            log(f"{row['model_id']} diagnosed in {values['diagnostics_time_s']:.1f} s")
    return written


#: The radius families of the plan: config field ``rhos_<key>`` → the measure that calibrates
#: it. The order-1 ablation of a metric is measured on the grid of its order-2 measure (same
#: ball, only the path differs); every other family has its own grid.
RADIUS_FAMILIES: dict[str, dict[str, Any]] = {
    "adaptive_l2": {"measure": "adaptive", "norm": "l2"},
    "adaptive_linf": {"measure": "adaptive", "norm": "linf"},
    "inv": {"measure": "geodesic", "metric": "inv", "order": 2},
    "mix": {"measure": "geodesic", "metric": "mix", "order": 2},
    "inv_adaptivenorm": {
        "measure": "geodesic",
        "metric": "inv",
        "order": 2,
        "corrected_norm": False,
    },
    "mix_adaptivenorm": {
        "measure": "geodesic",
        "metric": "mix",
        "order": 2,
        "corrected_norm": False,
    },
    "average_adaptive": {"measure": "adaptive", "kind": "average"},
    "average_inv": {"measure": "geodesic", "metric": "inv", "order": 2, "kind": "average"},
    "average_mix": {"measure": "geodesic", "metric": "mix", "order": 2, "kind": "average"},
}

#: Loss rise at the centre ρ₀ of a grid (the ρ rule; worst case and average case).
CALIBRATION_TARGET = {"worst": 0.1, "average": 0.01}


def _families(cfg: Any) -> list[str]:
    keys = ["adaptive_l2", "adaptive_linf", "inv", "mix"]
    keys += [f"{m}_adaptivenorm" for m in cfg.ablations]
    return [*keys, "average_adaptive", "average_inv", "average_mix"]


def _with_budget(cfg: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs.get("kind") == "average":
        return {**kwargs, "samples": cfg.samples}
    return {**kwargs, "steps": cfg.steps}


def standard_plan(cfg: Any, head: str) -> list[StudyMeasure]:
    """The measurement plan shared by Studies 2 and 3.

    Args:
        cfg: A config with ``steps``, ``samples``, ``ablations`` (metrics, a subset of
            ``("inv", "mix")``) and a grid ``rhos_<key>`` for every key of
            :data:`RADIUS_FAMILIES` it uses.
        head: Module path of the classification head (relative flatness).

    Returns:
        The :class:`StudyMeasure` list: adaptive ℓ2/ℓ∞ and geodesic inv/mix at order 2 (worst
        case); the ablations for ``cfg.ablations`` — order 1 (on the grid of the same metric at
        order 2) and no corrected norm; average-case adaptive, inv and mix; relative flatness.

    Raises:
        ValueError: If ``cfg.ablations`` names a metric other than ``"inv"`` and ``"mix"``.
    """
    if not set(cfg.ablations) <= {"inv", "mix"}:
        raise ValueError(f"ablations must be a subset of ('inv', 'mix'), got {cfg.ablations!r}")

    def spec(key: str, **change: Any) -> StudyMeasure:
        kwargs = _with_budget(cfg, {**RADIUS_FAMILIES[key], **change})
        return StudyMeasure(kwargs, getattr(cfg, f"rhos_{key}"))

    specs = [spec(key) for key in ["adaptive_l2", "adaptive_linf", "inv", "mix"]]
    specs += [spec(metric, order=1) for metric in cfg.ablations]
    specs += [spec(f"{metric}_adaptivenorm") for metric in cfg.ablations]
    specs += [spec(key) for key in ["average_adaptive", "average_inv", "average_mix"]]
    specs.append(StudyMeasure({"measure": "relative_flatness", "layer": head}, (None,)))
    return specs


def grids_text(cfg: Any) -> str:
    """The ρ grids of a config, one family per clause, for the report's settings."""
    labels = {
        "adaptive_l2": "adaptive ℓ2",
        "adaptive_linf": "adaptive ℓ∞",
        "inv": "geodesic inv",
        "mix": "geodesic mix",
        "inv_adaptivenorm": "inv, no corrected norm",
        "mix_adaptivenorm": "mix, no corrected norm",
        "average_adaptive": "average adaptive",
        "average_inv": "average inv",
        "average_mix": "average mix",
    }
    return "; ".join(
        f"{labels[k]} " + ", ".join(f"{r:g}" for r in getattr(cfg, f"rhos_{k}"))
        for k in _families(cfg)
    )


def _log_distance(value: float, target: float) -> float:
    return abs(math.log(value / target)) if 0 < value < math.inf else math.inf


def calibrate_rhos(
    study: Study,
    model: nn.Module,
    start: float = 0.01,
    max_evals: int = 12,
    log: Any = None,
) -> dict[str, tuple[float, ...]]:
    """Apply the ρ rule to a pilot model: one half-decade grid per radius family.

    For every family of the study's plan, sharpness of ``model`` on ``study.batches()`` (with
    the study's loss, Auto-PGD steps and samples) is evaluated on the half-decade ladder
    ``ρ = 10^{k/2}``, walking from ``start`` towards :data:`CALIBRATION_TARGET` (0.1 worst case,
    0.01 average case) until the target is bracketed; the centre ``ρ₀`` is the ladder point
    whose rise is closest to the target in log scale, and the grid is
    :func:`half_decade_grid` of ``ρ₀``. Only sharpness values of the pilot are looked at —
    no gap, no τ.

    Args:
        study: A study whose config has ``steps``, ``samples`` and ``ablations``.
        model: The pilot model (eval mode).
        start: First ρ of every walk (rounded to the ladder).
        max_evals: Most evaluations per family.
        log: Called with one line per evaluation (default: silent).

    Returns:
        ``{"rhos_<key>": grid}`` for every family of the plan; pass it to the config.
    """
    cfg = study.cfg  # type: ignore[attr-defined]
    return {
        f"rhos_{key}": rho_rule_grid(
            study, model, _with_budget(cfg, RADIUS_FAMILIES[key]), key, start, max_evals, log
        )
        for key in _families(cfg)
    }


def rho_rule_grid(
    study: Study,
    model: nn.Module,
    kwargs: dict[str, Any],
    key: str,
    start: float = 0.01,
    max_evals: int = 12,
    log: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """The ρ rule for one measure family: its half-decade grid on the pilot ``model``.

    The pilot's sharpness (``gs.sharpness(**kwargs)``, budget included) is evaluated on the
    ladder ``ρ = 10^{k/2}`` walking from ``start`` towards :data:`CALIBRATION_TARGET` until it
    is bracketed; the grid is :func:`half_decade_grid` of the ladder point closest to the target
    in log scale.

    Args:
        study: The study (loss, batches, ``key_bias``).
        model: The pilot model.
        kwargs: Settings of the measure, e.g. ``{"measure": "adaptive", "steps": 20}``.
        key: Name of the family, for the log.
        start: First radius of the ladder.
        max_evals: Most sharpness evaluations.
        log: Where each evaluation is reported, or ``None``.

    Returns:
        The three radii.
    """
    from geosharp.estimators import sharpness

    batches = study.batches()

    def rise(rho: float) -> float:
        return sharpness(
            model,
            study.loss_fn,
            batches,
            rho=rho,
            progress=False,
            key_bias=study.key_bias,
            **kwargs,
        ).value

    return ladder_grid(rise, kwargs.get("kind", "worst"), key, start, max_evals, log)


def ladder_grid(
    rise: Callable[[float], float],
    kind: str,
    key: str,
    start: float = 0.01,
    max_evals: int = 12,
    log: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """The ρ rule on any measurement: walk the ladder ``ρ = 10^{k/2}`` to the target, then grid.

    Args:
        rise: ρ → the pilot's sharpness at ρ (a failure to measure counts as ``inf``).
        kind: ``"worst"`` or ``"average"`` (the target of :data:`CALIBRATION_TARGET`).
        key: Name of the family, for the log.
        start: First radius of the ladder.
        max_evals: Most evaluations.
        log: Where each evaluation is reported, or ``None``.

    Returns:
        :func:`half_decade_grid` of the ladder point whose rise is closest to the target in log
        scale.
    """
    target = CALIBRATION_TARGET[kind]
    k = round(2 * math.log10(start))
    seen: dict[int, float] = {}
    direction = 0
    for _ in range(max_evals):
        try:
            value = rise(10 ** (k / 2))
        except (FloatingPointError, ValueError):
            value = math.inf
        seen[k] = value
        if log is not None:
            log(f"{key}: rho={10 ** (k / 2):.3g} rise={value:.4g}")
        step = 1 if value < target else -1
        if direction and step != direction:
            break
        direction = step
        k += step
    best = min(seen, key=lambda j: _log_distance(seen[j], target))
    return half_decade_grid(10 ** (best / 2))
