"""Cost of one sharpness-ascent step relative to one plain forward+backward of the same batch.

For each model and measure we time ``gs.sharpness`` on one batch with ``N₁`` and ``N₂`` Auto-PGD
steps; ``(T(N₂) − T(N₁)) / (N₂ − N₁)`` is the cost of one ascent step (set-up — symmetry finding,
base-point factorization, the clean loss — cancels). The reference is the median of plain
``loss.backward()`` calls on the same batch. Both are medians over ``--repeats`` runs, measured in
one process, so the ratios are comparable on a noisy machine; absolute times are not the point.

Run: ``python benchmarks/ascent_step.py [--repeats 5] [--models vit,minilm]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

import geosharp as gs
from geosharp.models import VisionTransformer

MEASURES = [
    ("adaptive", dict(measure="adaptive")),
    ("geodesic inv o2", dict(measure="geodesic", metric="inv", order=2)),
    ("geodesic mix o2", dict(measure="geodesic", metric="mix", order=2)),
]


def vit_case():
    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=4, num_classes=10, dim=64, depth=4)
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    return "ViT-tiny (d=64, 4 heads, 4 layers, batch 128)", model, x, y, nn.functional.cross_entropy


def minilm_case():
    from geosharp.models.hf import load_minilm

    torch.manual_seed(0)
    model = load_minilm(num_labels=2)
    ids = torch.randint(1000, 20000, (32, 64))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    y = torch.randint(0, 2, (32,))

    def loss(out, target):
        return nn.functional.cross_entropy(out.logits, target)

    return "MiniLM-L6 (batch 32, seq 64)", model, inputs, y, loss


def plain_step(model, x, y, loss_fn) -> float:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    out = model(**x) if isinstance(x, dict) else model(x)
    loss_fn(out, y).backward()
    return time.perf_counter() - t


def sharpness_time(model, x, y, loss_fn, steps, kw) -> float:
    t = time.perf_counter()
    gs.sharpness(model, loss_fn, [(x, y)], rho=0.01, steps=steps, progress=False, **kw)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="vit,minilm")
    parser.add_argument("--steps", default="3,8", help="N1,N2")
    args = parser.parse_args()
    n1, n2 = (int(s) for s in args.steps.split(","))
    cases = {"vit": vit_case, "minilm": minilm_case}
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}; medians of {args.repeats} runs"
    )
    for key in args.models.split(","):
        title, model, x, y, loss_fn = cases[key]()
        model.eval()
        for _ in range(2):
            plain_step(model, x, y, loss_fn)  # warm-up
        base = statistics.median(plain_step(model, x, y, loss_fn) for _ in range(args.repeats))
        print(f"\n{title}: plain forward+backward {1e3 * base:.1f} ms")
        for name, kw in MEASURES:
            sharpness_time(model, x, y, loss_fn, n1, kw)  # warm-up
            per_step = []
            for _ in range(args.repeats):
                t1 = sharpness_time(model, x, y, loss_fn, n1, kw)
                t2 = sharpness_time(model, x, y, loss_fn, n2, kw)
                per_step.append((t2 - t1) / (n2 - n1))
            step = statistics.median(per_step)
            print(f"  {name:<16} ascent step {1e3 * step:7.1f} ms   ratio {step / base:5.2f}")


if __name__ == "__main__":
    main()
