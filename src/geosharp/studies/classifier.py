"""What Studies 2 and 3 share: a population of classifiers and one measurement protocol.

Both transformer studies follow the paper's recipe for its real populations (SPEC §7): every
model sees the same training data and differs only in hyperparameters drawn at random; the gap
is an error difference; sharpness is measured on a fixed subset of training points with the
same plan of measures and the same ρ rule. This module holds the study base of that common
part, so that a study module only says what is its own (data, model, batches, learning-rate
schedule):

* :class:`ClassifierStudy` — the :class:`~geosharp.studies.runner.Study` base: validation of
  the config, the population (``np.random.default_rng(seed + 1)``), the training loop (AdamW,
  gradient-norm clip 1, a per-model schedule, a per-model seed for initialization, data order,
  dropout and augmentation), checkpointing, inclusion rule, loss and plan, and
  :meth:`ClassifierStudy.diagnose` (one model's diagnostics row).

The rest of the protocol has its own module (its names are importable from here too):

* **The plan** — :mod:`geosharp.studies.classifier_plan`: :func:`standard_plan` (adaptive
  ℓ2/ℓ∞ and geodesic inv/mix at order 2; the ablations; average-case adaptive/inv/mix;
  relative flatness), :data:`RADIUS_FAMILIES` and :func:`grids_text`.
* **The ρ rule** — :mod:`geosharp.studies.rho_rule`: :data:`CALIBRATION_TARGET`,
  :func:`half_decade_grid`, :func:`ladder_grid` and :func:`calibrate_rhos`: three ρ per radius
  family, ``{ρ₀/√10, ρ₀, √10·ρ₀}``, the centre ``ρ₀ = 10^{k/2}`` being where one pilot model's
  rise is closest (log scale) to 0.1 (worst case) or 0.01 (average case). Only the pilot's
  sharpness is looked at: no gap, no τ.
* **Curvature, opt-in** — :mod:`geosharp.studies.curvature_plan`: :class:`CurvaturePlan` and
  :func:`curvature_specs`: the largest eigenvalue and the trace of the Hessian on the quotient
  (:func:`geosharp.curvature`, SPEC §9) for geodesic inv and mix, adaptive and Euclidean
  curvature, no ρ. ``study.with_curvature()`` adds them to the plan and records the
  :class:`CurvaturePlan` in the study's config; without it the plan and the config are those
  of the committed results.
* **Diagnostics** — :mod:`geosharp.studies.classifier_diagnostics`: :func:`diagnose_folder`
  writes :meth:`ClassifierStudy.diagnose`'s row for every model of a folder in its
  ``diagnostics.csv``, which the study report turns into a section. Study 4
  (:mod:`geosharp.studies.vit_orbit`) computes its rows with the same method.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp._io import torch_save_atomically
from geosharp.estimators.diagnostics import ascent_diagnostics, balance, summary_row
from geosharp.studies.classifier_diagnostics import (
    DIAGNOSTIC_FAMILIES,
    DIAGNOSTICS_FILE,
    append_diagnostics,
    diagnose_folder,
    read_diagnostics,
)
from geosharp.studies.classifier_plan import RADIUS_FAMILIES, grids_text, standard_plan
from geosharp.studies.curvature_plan import CLASSIFIER_CURVATURE, CurvaturePlan, curvature_specs
from geosharp.studies.rho_rule import (
    CALIBRATION_TARGET,
    calibrate_rhos,
    half_decade_grid,
    ladder_grid,
    rho_rule_grid,
)
from geosharp.studies.runner import Study, StudyMeasure
from geosharp.studies.store import Store

#: The study base, and the names of the older import path: the plan, the ρ rule, curvature and
#: diagnostics moved to their own modules, and importing them from here keeps working.
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
    "rho_rule_grid",
    "save_atomically",
    "standard_plan",
]


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename (never a half file)."""
    torch_save_atomically(obj, path)


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
