"""Study 1: diagonal linear networks on sparse regression (SPEC §5, §7; paper Table 1).

Data: ``X ∈ R^{n×d}`` Gaussian with ``d = 200 > n = 100``, a 90 %-sparse ``β*`` with standard
normal non-zeros, ``y = Xβ* (+ noise)``, and a fresh test set of 1000 points. Population:
networks ``y = xᵀ(u ⊙ v)`` trained by full-batch gradient descent on the mean squared error to
a training loss ≤ 1e-5, from ``u₀ = α·1``, ``v₀ = 0``. The initialization scale ``α`` (log-uniform)
sets the implicit bias — small ``α`` gives sparse, well-generalizing solutions, large ``α``
dense ones — and the step size is drawn log-uniformly too. All models are trained together,
vectorized, and each is recorded as soon as it reaches the target. Generalization gap: test loss
− train loss (train loss ≤ 1e-5, so essentially the test loss, as in the paper).

Sharpness is measured on the full training set (one batch, m = n) with the mean squared error:
adaptive ℓ2 worst case, and geodesic worst case with the inv and mix metrics along exact
(closed-form) geodesics and at order 2, each at ρ ∈ {1e-3, 1e-2, 1e-1} — a decade grid fixed
before any τ was seen.

**Second population** (``DiagonalConfig(population="sgd-batch")``, ``geosharp study diagonal
--population sgd-batch``; preregistered in ``results/diagonal-2/PREREGISTRATION.md``): the
implicit bias varies along the stochasticity of the optimizer instead of the init scale. Every
net starts at the same ``u₀ = α·1``, ``v₀ = 0`` (``α = sgd_alpha``) and is trained by mini-batch
SGD (batches drawn without replacement, a fresh permutation every epoch, per-model seed) with
the batch size drawn from ``sgd_batch_sizes`` (``n`` = full-batch GD) and the step size
log-uniformly from ``sgd_lr``, to the same training loss ≤ 1e-5. Smaller batches and larger
steps shrink SGD's effective initialization (Pesme et al. 2021), so sparsity and test loss vary
at a fixed α. The default population (``"alpha"``) is Study 1's, and its recorded config is
unchanged (the new fields are left out of it), so ``make demo`` reproduces ``results/diagonal``.

Curvature is opt-in (``DiagonalStudy(cfg).with_curvature()``, :data:`DIAGONAL_CURVATURE`):
λ_max and the trace of the Hessian on the quotient (SPEC §9) for geodesic inv and mix, adaptive
and Euclidean curvature, on the same batch; the trace exactly (2d products: the nets are tiny).
Without it the plan and the config are those of the committed results.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from geosharp._io import torch_save_atomically
from geosharp.models import DiagonalNet
from geosharp.studies.curvature_plan import CurvaturePlan, curvature_specs
from geosharp.studies.runner import Study, StudyMeasure
from geosharp.studies.store import Store

#: Kendall τ reported by the paper for this population (SPEC §7).
PAPER_TAU = {"adaptive": -0.68, "geodesic inv": -0.83, "geodesic mix": -0.86}

#: The curvature part of Study 1 (``with_curvature()``), fixed before any curvature τ: the
#: exact trace (2d = 400 products per model) and Lanczos to ``tol = 1e-5``.
DIAGONAL_CURVATURE = CurvaturePlan(trace_method="exact")


@dataclass(frozen=True)
class DiagonalConfig:
    """Everything that defines Study 1's results."""

    n_models: int = 50
    d: int = 200
    n_train: int = 100
    n_test: int = 1000
    sparsity: float = 0.9
    noise: float = 0.0
    seed: int = 0
    alpha_min: float = 1e-3
    alpha_max: float = 1.0
    lr_min: float = 0.01
    lr_max: float = 0.04
    target_loss: float = 1e-5
    max_steps: int = 300_000
    rhos: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
    steps: int = 20
    #: ``"alpha"`` (Study 1: α and the GD step size drawn) or ``"sgd-batch"`` (fixed α, SGD
    #: batch size and step size drawn); the fields below are used by ``"sgd-batch"`` only.
    population: str = "alpha"
    sgd_alpha: float = 0.1
    sgd_batch_sizes: tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100)
    sgd_lr: tuple[float, float] = (0.005, 0.04)
    sgd_max_steps: int = 600_000

    @classmethod
    def quick(cls, **overrides: Any) -> DiagonalConfig:
        """A small configuration that runs in seconds (tests, ``--quick``)."""
        base = dict(n_models=8, d=40, n_train=20, n_test=200, max_steps=60_000, rhos=(1e-2,))
        if overrides.get("population", "alpha") != "alpha":
            base.update(sgd_batch_sizes=(1, 5, 20), sgd_max_steps=200_000)
        base.update(overrides)
        return cls(**base)


#: The populations of :class:`DiagonalStudy` (``geosharp study diagonal --population NAME``).
POPULATIONS = ("alpha", "sgd-batch")
#: Config fields of the second population, left out of Study 1's recorded config.
_SGD_FIELDS = ("population", "sgd_alpha", "sgd_batch_sizes", "sgd_lr", "sgd_max_steps")


def make_data(cfg: DiagonalConfig) -> dict[str, np.ndarray]:
    """The regression problem of the study, deterministic in ``cfg.seed``.

    Returns:
        ``X``, ``y``, ``X_test``, ``y_test``, ``beta_star`` as float64 arrays.
    """
    rng = np.random.default_rng(cfg.seed)
    X = rng.standard_normal((cfg.n_train, cfg.d))
    k = max(1, round((1 - cfg.sparsity) * cfg.d))
    beta_star = np.zeros(cfg.d)
    beta_star[rng.choice(cfg.d, size=k, replace=False)] = rng.standard_normal(k)
    X_test = rng.standard_normal((cfg.n_test, cfg.d))
    y = X @ beta_star + cfg.noise * rng.standard_normal(cfg.n_train)
    y_test = X_test @ beta_star + cfg.noise * rng.standard_normal(cfg.n_test)
    return {"X": X, "y": y, "X_test": X_test, "y_test": y_test, "beta_star": beta_star}


def _mse(pred: Tensor, y: Tensor) -> Tensor:
    return ((pred - y) ** 2).mean()


class DiagonalStudy(Study):
    """Study 1 of the paper: 50 diagonal linear networks, sharpness vs test loss."""

    name = "diagonal"
    title = "Study 1 — diagonal linear networks on sparse regression"
    gap_label = "test loss − train loss"
    paper = PAPER_TAU

    def __init__(self, cfg: DiagonalConfig | None = None) -> None:
        self.cfg = cfg or DiagonalConfig()
        if self.cfg.population not in POPULATIONS:
            raise ValueError(
                f"population must be one of {POPULATIONS}, got {self.cfg.population!r}"
            )
        if self.cfg.population == "sgd-batch":
            if any(not 1 <= b <= self.cfg.n_train for b in self.cfg.sgd_batch_sizes):
                raise ValueError(f"sgd_batch_sizes must lie in [1, n_train={self.cfg.n_train}]")
            self.title = (
                "Study 1, second population — diagonal nets trained by SGD with drawn batch "
                "size and step size at a fixed α"
            )
            self.paper = None
        self.data = make_data(self.cfg)
        self._batches = [
            (torch.from_numpy(self.data["X"]), torch.from_numpy(self.data["y"])),
        ]

    #: The opt-in curvature part of the plan (:meth:`with_curvature`); ``None``: none.
    curvature: CurvaturePlan | None = None

    def with_curvature(self, plan: CurvaturePlan | None = None) -> DiagonalStudy:
        """Add the curvature rows to the plan (default :data:`DIAGONAL_CURVATURE`).

        Returns:
            The study itself; its :meth:`config` then records the plan under ``"curvature"``.
        """
        self.curvature = plan or DIAGONAL_CURVATURE
        return self

    def config(self) -> dict[str, Any]:
        """The :class:`DiagonalConfig` as a dict (with ``"curvature"`` only when measured)."""
        out = asdict(self.cfg)
        if self.cfg.population == "alpha":  # Study 1's recorded config, as committed
            for key in _SGD_FIELDS:
                out.pop(key)
        if self.curvature is not None:
            out["curvature"] = asdict(self.curvature)
        return out

    def settings(self) -> dict[str, Any]:
        """Settings shown in the report."""
        c = self.cfg
        return {
            "models": c.n_models,
            "data": f"d={c.d}, n_train={c.n_train}, n_test={c.n_test}, "
            f"{round(100 * c.sparsity)} % sparse β*, noise {c.noise}",
            "training": (
                f"full-batch GD on MSE from u=α·1, v=0 to loss ≤ {c.target_loss:g} "
                f"(≤ {c.max_steps} steps); α ~ logU[{c.alpha_min:g}, {c.alpha_max:g}], "
                f"lr ~ logU[{c.lr_min:g}, {c.lr_max:g}]"
                if c.population == "alpha"
                else f"mini-batch SGD on MSE (batches without replacement, a new permutation "
                f"per epoch, per-model seed) from u=α·1, v=0 with α = {c.sgd_alpha:g} for every "
                f"model, to loss ≤ {c.target_loss:g} (≤ {c.sgd_max_steps} steps); batch size ∈ "
                f"{list(c.sgd_batch_sizes)} (uniform), lr ~ logU[{c.sgd_lr[0]:g}, "
                f"{c.sgd_lr[1]:g}]"
            ),
            **({"population name": c.population} if c.population != "alpha" else {}),
            "sharpness data": f"the full training set, one batch of {c.n_train}, MSE",
            "Auto-PGD": f"{c.steps} steps, start at 0, no restarts",
            "ρ rule": "decade grid fixed before looking at τ: "
            + ", ".join(f"{r:g}" for r in c.rhos),
            **({"curvature": self.curvature.text()} if self.curvature is not None else {}),
            "seed": c.seed,
        }

    def population(self) -> list[tuple[str, dict[str, Any]]]:
        """``diag-000 …``: α and lr drawn log-uniformly (seed ``cfg.seed + 1``)."""
        rng = np.random.default_rng(self.cfg.seed + 1)
        c = self.cfg
        out = []
        if c.population == "sgd-batch":
            for i in range(c.n_models):
                batch = int(rng.choice(c.sgd_batch_sizes))
                lr = math.exp(rng.uniform(math.log(c.sgd_lr[0]), math.log(c.sgd_lr[1])))
                seed = int(rng.integers(2**31 - 1))
                hp = {"alpha": c.sgd_alpha, "lr": lr, "batch_size": batch, "seed": seed}
                out.append((f"diag-{i:03d}", hp))
            return out
        for i in range(c.n_models):
            alpha = math.exp(rng.uniform(math.log(c.alpha_min), math.log(c.alpha_max)))
            lr = math.exp(rng.uniform(math.log(c.lr_min), math.log(c.lr_max)))
            out.append((f"diag-{i:03d}", {"alpha": alpha, "lr": lr}))
        return out

    def train(
        self, todo: list[tuple[str, dict[str, Any]]], out_dir: Path, store: Store, progress: bool
    ) -> None:
        """Full-batch GD of all models at once; each is stored as soon as it converges."""
        c = self.cfg
        if c.population == "sgd-batch":
            return self._train_sgd(todo, out_dir, store, progress)
        X, y = self.data["X"], self.data["y"]
        ckpt_dir = out_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        alphas = np.array([hp["alpha"] for _, hp in todo])
        lrs = np.array([hp["lr"] for _, hp in todo])[:, None]
        U = np.tile(alphas[:, None], (1, c.d))
        V = np.zeros_like(U)
        active = np.ones(len(todo), dtype=bool)
        t0 = time.perf_counter()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc="training diagonal nets")
        for step in range(c.max_steps + 1):
            R = (U * V) @ X.T - y
            loss = (R**2).mean(axis=1)
            done = active & ((loss <= c.target_loss) | ~np.isfinite(loss) | (step == c.max_steps))
            for i in np.flatnonzero(done):
                self._record(
                    todo[i],
                    U[i],
                    V[i],
                    float(loss[i]),
                    steps=step,
                    ckpt_dir=ckpt_dir,
                    store=store,
                    t0=t0,
                )
                if bar is not None:
                    bar.update(1)
            active &= ~done
            if not active.any():
                break
            G = (2.0 / c.n_train) * (R @ X)
            gu, gv = G * V, G * U
            U[active] -= (lrs * gu)[active]
            V[active] -= (lrs * gv)[active]
        if bar is not None:
            bar.close()

    def _train_sgd(
        self, todo: list[tuple[str, dict[str, Any]]], out_dir: Path, store: Store, progress: bool
    ) -> None:
        """Mini-batch SGD of all models at once (second population); vectorized over models.

        Model i draws its batches from its own generator (``hp["seed"]``): a permutation of the
        training set per epoch, cut into ``n // B`` batches of ``B`` (the remainder dropped), so
        its trajectory does not depend on which other models are trained with it. The batch
        masks are built for chunks of steps; the gradient of model i at step t is
        ``(2/B) Σ_{j ∈ S_t} r_j x_j`` and its loss is checked on the full training set.
        """
        c = self.cfg
        X, y = self.data["X"], self.data["y"]
        n = c.n_train
        ckpt_dir = out_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        m = len(todo)
        B = np.array([hp["batch_size"] for _, hp in todo])
        lrs = np.array([hp["lr"] for _, hp in todo])[:, None]
        gens = [np.random.default_rng(hp["seed"]) for _, hp in todo]
        U = np.tile(np.array([hp["alpha"] for _, hp in todo])[:, None], (1, c.d))
        V = np.zeros_like(U)
        active = np.ones(m, dtype=bool)
        chunk = 1000
        t0 = time.perf_counter()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=m, desc="training diagonal nets (SGD)")
        masks = np.zeros((chunk, m, n), dtype=bool)
        for step in range(c.sgd_max_steps + 1):
            k = step % chunk
            if k == 0:  # the batches of the next `chunk` steps of every model
                masks[:] = False
                rows = np.arange(chunk)
                for i, (g, b) in enumerate(zip(gens, B, strict=True)):
                    per_epoch = n // b
                    epochs = -(-chunk // per_epoch)
                    idx = np.concatenate([g.permutation(n)[: per_epoch * b] for _ in range(epochs)])
                    idx = idx[: chunk * b].reshape(chunk, b)
                    masks[rows[:, None], i, idx] = True
            R = (U * V) @ X.T - y
            loss = (R**2).mean(axis=1)
            done = active & (
                (loss <= c.target_loss) | ~np.isfinite(loss) | (step == c.sgd_max_steps)
            )
            for i in np.flatnonzero(done):
                self._record(
                    todo[i],
                    U[i],
                    V[i],
                    float(loss[i]),
                    steps=step,
                    ckpt_dir=ckpt_dir,
                    store=store,
                    t0=t0,
                )
                if bar is not None:
                    bar.update(1)
            active &= ~done
            if not active.any():
                break
            G = ((2.0 / B)[:, None] * np.where(masks[k], R, 0.0)) @ X
            gu, gv = G * V, G * U
            U[active] -= (lrs * gu)[active]
            V[active] -= (lrs * gv)[active]
        if bar is not None:
            bar.close()

    def _record(
        self,
        item: tuple[str, dict[str, Any]],
        u: np.ndarray,
        v: np.ndarray,
        train_loss: float,
        steps: int,
        ckpt_dir: Path,
        store: Store,
        t0: float,
    ) -> None:
        mid, hp = item
        beta = u * v
        test_loss = float(((self.data["X_test"] @ beta - self.data["y_test"]) ** 2).mean())
        converged = bool(train_loss <= self.cfg.target_loss)
        path = ckpt_dir / f"{mid}.pt"
        torch_save_atomically(
            {"u": torch.from_numpy(u.copy()), "v": torch.from_numpy(v.copy())}, path
        )
        metrics = {
            "train_loss": train_loss,
            "test_loss": test_loss,
            "steps": steps,
            "converged": converged,
            "l1_norm": float(np.abs(beta).sum()),
            "distance_to_beta_star": float(np.linalg.norm(beta - self.data["beta_star"])),
        }
        if not converged:
            metrics["excluded"] = True
            metrics["note"] = (
                f"did not reach training loss {self.cfg.target_loss:g} in {steps} steps "
                f"(final {train_loss:.2e}); left out of the analysis"
            )
        store.put_model(
            mid,
            hparams=hp,
            metrics=metrics,
            gap=test_loss - train_loss,
            checkpoint=str(path.relative_to(ckpt_dir.parent)),
            seed=self.cfg.seed,
            train_time_s=time.perf_counter() - t0,
        )

    def included(self, row: dict[str, Any]) -> bool:
        """Models that did not reach the target training loss are left out (and noted)."""
        return not row.get("excluded", False)

    def load(self, row: dict[str, Any]) -> nn.Module:
        """A float64 :class:`~geosharp.models.DiagonalNet` with the stored ``u``, ``v``."""
        state = torch.load(row["checkpoint_path"], map_location="cpu")
        net = DiagonalNet(self.cfg.d).to(torch.float64)
        with torch.no_grad():
            net.u.copy_(state["u"])
            net.v.copy_(state["v"])
        return net

    def batches(self) -> list[tuple[Any, Any]]:
        """The full training set as one batch."""
        return self._batches

    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """Mean squared error."""
        return _mse(outputs, targets)

    def plan(self) -> list[StudyMeasure]:
        """Adaptive ℓ2, geodesic inv/mix (exact and order-2 geodesics) at every ρ; curvature."""
        rhos = tuple(self.cfg.rhos)
        steps = self.cfg.steps
        specs = [StudyMeasure({"measure": "adaptive", "steps": steps}, rhos)]
        for order in ("exact", 2):
            for metric in ("inv", "mix"):
                kw = {"measure": "geodesic", "metric": metric, "order": order, "steps": steps}
                specs.append(StudyMeasure(kw, rhos))
        if self.curvature is not None:
            specs += curvature_specs(self.curvature)
        return specs
