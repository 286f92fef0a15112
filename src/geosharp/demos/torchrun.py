"""A check of a cluster setup: data-parallel sharpness of a tiny ViT under ``torchrun``.

Every rank builds the same tiny vision transformer and batches (:func:`demo_problem`), measures
:func:`geosharp.sharpness` with the batches split across ranks
(:mod:`geosharp.estimators.distributed`), and writes its result as JSON; with ``--check`` rank 0
also measures in one process and prints the largest per-batch difference::

    torchrun --nproc_per_node 2 -m geosharp.demos.torchrun --out runs/dp --check
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geosharp.estimators.distributed import init_distributed
from geosharp.estimators.sharpness import sharpness

__all__ = ["demo_problem", "main"]


def demo_problem(
    n_batches: int = 4,
    batch_size: int = 6,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, Any, list[tuple[Tensor, Tensor]]]:
    """A tiny vision transformer with random weights and data, identical on every rank.

    Built from ``seed`` alone (the global random state is left untouched).

    Args:
        n_batches: Number of batches.
        batch_size: Images per batch.
        dtype: Floating-point type of weights and images.
        device: Device of weights and images.
        seed: Seed of weights and data.

    Returns:
        ``(model, loss_fn, batches)`` for :func:`geosharp.sharpness`.
    """
    from geosharp.models import VisionTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VisionTransformer(
            image_size=8, patch_size=4, num_classes=3, dim=16, depth=2, num_heads=2
        )
    model = model.to(dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n_batches, batch_size, 3, 8, 8, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n_batches, batch_size), generator=g)
    batches = [(x[i].to(device), y[i].to(device)) for i in range(n_batches)]
    return model, nn.functional.cross_entropy, batches


def _measure_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    order: int | str = args.order if args.order == "exact" else int(args.order)
    return {
        "measure": args.measure,
        "metric": args.metric,
        "order": order,
        "kind": args.kind,
        "rho": args.rho,
        "steps": args.steps,
        "seed": args.seed,
        "random_init": args.random_init,
        "restarts": args.restarts,
        "progress": False,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measure :func:`demo_problem` data-parallel and write every rank's result as JSON.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    p = argparse.ArgumentParser(
        prog="python -m geosharp.demos.torchrun",
        description="Data-parallel sharpness of a tiny ViT; run under torchrun.",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--measure", default="geodesic", choices=("geodesic", "adaptive", "euclidean"))
    p.add_argument("--metric", default="inv")
    p.add_argument("--order", default="2", choices=("1", "2", "exact"))
    p.add_argument("--kind", default="worst", choices=("worst", "average"))
    p.add_argument("--rho", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--restarts", type=int, default=1)
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl on GPUs)")
    p.add_argument(
        "--check", action="store_true", help="rank 0 also measures in one process and compares"
    )
    args = p.parse_args(argv)
    rank, world_size = init_distributed(args.backend)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    model, loss_fn, batches = demo_problem(
        args.batches, args.batch_size, getattr(torch, args.dtype), device, args.seed
    )
    kw = _measure_kwargs(args)
    res = sharpness(model, loss_fn, batches, distributed=True, **kw)
    record = {"rank": rank, "world_size": world_size, "result": res.to_dict()}
    if args.check and rank == 0:
        ref = sharpness(model, loss_fn, batches, distributed=False, **kw)
        diff = max(abs(a - b) for a, b in zip(res.per_batch, ref.per_batch, strict=True))
        record["single_process"] = ref.to_dict()
        record["max_abs_diff"] = diff
        print(f"single process vs {world_size} ranks: max |Δ per-batch| = {diff:.3g}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)
    if rank == 0:
        print(f"{res}\n{world_size} rank(s); results in {args.out}/rank*.json")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0 if math.isfinite(res.value) else 1


if __name__ == "__main__":
    sys.exit(main())
