"""What a user pays per ascent step: whole ``gs.sharpness`` calls at two step counts.

A step's cost is ``(T(N₂) − T(N₁)) / (N₂ − N₁)`` with ``T(N)`` the wall time of one whole
``gs.sharpness(..., steps=N)`` call as a user makes it (a fresh call: the base-point cache
cleared, symmetry finding, restarts, pairings, progress bookkeeping and everything else
included), divided by a plain forward+backward of the same model on the same batches
(``torch.autograd.grad`` of the loss over the trainable weights; the median of three), timed
right before the two calls. The plain step and the calls of every measure are interleaved in
one process, repetition after repetition, the order of the measures rotating; the median over
repetitions is reported. ``--clock process`` times the process's CPU time instead of wall time
(for a one-thread run on a machine shared with other jobs).

Unlike ``regimes.py`` (which wraps the library's internals to break a call into stages and keeps
the cache between the two calls), nothing here reaches inside the library: this script runs
unchanged on any commit, which is what bisecting needs.

    OMP_NUM_THREADS=1 python benchmarks/whole_call.py --configs minilm-small,mha-vit-128 \
        --threads 1 --repeats 5 --json out.json
    # A/B between two checkouts (e.g. git worktrees), alternating child processes:
    python benchmarks/whole_call.py --ab /tmp/old/src src --configs mha-vit-128 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: measure label → keyword arguments of ``gs.sharpness`` (worst case, Auto-PGD).
MEASURES: dict[str, dict[str, Any]] = {
    "adaptive": dict(measure="adaptive", rho=0.316),
    "geodesic-inv": dict(measure="geodesic", metric="inv", order=2, rho=0.0316),
    "geodesic-mix": dict(measure="geodesic", metric="mix", order=2, rho=0.0316),
}

CONFIGS = {
    "minilm-small": "MiniLM-L6, Study 3's set-up: 2 batches of 16 snippets, embeddings frozen",
    "minilm-small-all": "MiniLM-L6, Study 3's 2 batches of 16 snippets, every weight perturbed "
    "(embeddings too)",
    "minilm-short-all": "MiniLM-L6, Study 3's 32 snippets cut at 20 word pieces ([CLS] and [SEP] "
    "included; 20 of 32 reach the cut, 18.1 on average): 2 batches 16 × 20, every weight perturbed",
    "minilm-32x64": "MiniLM-L6, random ids, one batch 32 × 64, every weight perturbed",
    "vit-tiny": "geosharp's ViT (d=64, 4 heads, 4 layers), one batch of 128 32×32 images",
    "mha-vit-128": "a ViT of 4 nn.TransformerEncoderLayer (nn.MultiheadAttention, d=64, "
    "4 heads), one batch of 128 32×32 images",
}


def _ce(out: Any, target: Any) -> Any:
    import torch

    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits, target)


def build(name: str) -> tuple[Any, list, Callable]:
    """The model (eval mode), its batches and its loss."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name in ("minilm-small", "minilm-small-all", "minilm-short-all"):
        from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy

        # Study 3's tokenization truncates at max_len (default 48); its sharpness subset, sorted by
        # length, is the same 32 snippets at either length.
        cfg = MiniLMTextConfig(max_len=20) if name == "minilm-short-all" else MiniLMTextConfig()
        study = MiniLMTextStudy(cfg)
        model = study.build()
        if name != "minilm-small":
            model.requires_grad_(True)
        return model.eval(), study.batches(), _ce
    if name == "minilm-32x64":
        from geosharp.models.hf import load_minilm

        model = load_minilm(num_labels=2)
        ids = torch.randint(1000, 20000, (32, 64))
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return model.eval(), [(x, torch.randint(0, 2, (32,)))], _ce
    if name == "vit-tiny":
        from geosharp.models import VisionTransformer

        model = VisionTransformer(image_size=32, patch_size=4, num_classes=10, dim=64, depth=4)
        x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
        return model.eval(), [(x, y)], _ce
    if name == "mha-vit-128":

        class MHAViT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.patch = nn.Conv2d(3, 64, 4, stride=4)
                self.pos = nn.Parameter(torch.randn(1, 64, 64) * 0.02)
                layer = nn.TransformerEncoderLayer(
                    64, 4, dim_feedforward=128, dropout=0.0, batch_first=True
                )
                self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
                self.head = nn.Linear(64, 10)

            def forward(self, x: Any) -> Any:
                z = self.patch(x).flatten(2).transpose(1, 2) + self.pos
                return self.head(self.encoder(z).mean(1))

        model = MHAViT()
        x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
        return model.eval(), [(x, y)], _ce
    raise SystemExit(f"whole_call.py: unknown configuration {name!r}; one of {', '.join(CONFIGS)}")


def _forward(model: Any, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def plain_step(model: Any, batches: list, loss_fn: Callable) -> None:
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    for x, y in batches:
        torch.autograd.grad(loss_fn(_forward(model, x), y), trainable, allow_unused=True)


def time_config(
    name: str, measures: list[str], n1: int, n2: int, repeats: int, clock: str = "wall"
) -> dict:
    """Per-repetition plain step, T(N₁), T(N₂) and their step ratio, for every measure.

    ``clock="process"`` times the process's CPU time (``time.process_time``, every thread of
    it) instead of wall time: on a machine shared with other jobs a one-thread run's CPU time
    does not count the time it waited for a core.
    """
    import geosharp as gs

    now = time.process_time if clock == "process" else time.perf_counter

    try:
        from geosharp.estimators.cache import clear_cache
    except ImportError:  # an old checkout without a cache

        def clear_cache() -> None:
            return None

    model, batches, loss_fn = build(name)
    for _ in range(2):
        plain_step(model, batches, loss_fn)  # warm-up

    def call(m: str, n: int) -> float:
        clear_cache()
        t = now()
        gs.sharpness(model, loss_fn, batches, steps=n, progress=False, **MEASURES[m])
        return now() - t

    for m in measures:
        call(m, n1)  # the first call of each measure in the process (lazy imports, kernels)
    reps: dict[str, list[dict[str, float]]] = {m: [] for m in measures}
    for r in range(repeats):
        k = r % len(measures)
        for m in measures[k:] + measures[:k]:
            plains = []
            for _ in range(3):  # the median of three: one plain step alone is too noisy
                t = now()
                plain_step(model, batches, loss_fn)
                plains.append(now() - t)
            p = statistics.median(plains)
            t1, t2 = call(m, n1), call(m, n2)
            step = (t2 - t1) / (n2 - n1)
            reps[m].append(
                {"plain_s": p, "t1_s": t1, "t2_s": t2, "step_s": step, "ratio": step / p}
            )
    return {
        m: {
            "ratio": statistics.median(d["ratio"] for d in reps[m]),
            "step_s": statistics.median(d["step_s"] for d in reps[m]),
            "plain_s": statistics.median(d["plain_s"] for d in reps[m]),
            "reps": reps[m],
        }
        for m in measures
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from geosharp.models.hf import quiet_transformers

    out = {
        "schema": "geosharp-whole-call/1",
        "n1": args.n1,
        "n2": args.n2,
        "threads": args.threads,
        "clock": args.clock,
        "torch": torch.__version__,
        "src": str(Path(sys.modules["geosharp"].__file__).parent),
        "configs": {},
    }
    with quiet_transformers():
        for name in args.configs.split(","):
            out["configs"][name] = time_config(
                name, args.measures.split(","), args.n1, args.n2, args.repeats, args.clock
            )
    return out


def ab(args: argparse.Namespace) -> dict:
    """Alternate child processes on two source trees, one repetition each, A first then B first."""
    sides = {"A": args.ab[0], "B": args.ab[1]}
    per: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in sides}
    plain: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in sides}
    children: list[dict] = []  # every child's own figures (T(N₁), T(N₂), plain), in run order
    for r in range(args.repeats):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        for side in order:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--src",
                sides[side],
                "--configs",
                args.configs,
                "--measures",
                args.measures,
                "--repeats",
                "1",
                "--n1",
                str(args.n1),
                "--n2",
                str(args.n2),
                "--threads",
                str(args.threads),
                "--clock",
                args.clock,
                "--json",
                "-",
            ]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            got = json.loads(
                subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            )
            children.append({"side": side, "repetition": r + 1, **got})
            for c, ms in got["configs"].items():
                for m, fig in ms.items():
                    per[side].setdefault(c, {}).setdefault(m, []).append(fig["ratio"])
                    plain[side].setdefault(c, {}).setdefault(m, []).append(fig["plain_s"])
            print(f"rep {r + 1}/{args.repeats} {side} done", file=sys.stderr)
    table = {}
    for c in per["A"]:
        for m in per["A"][c]:
            a, b = per["A"][c][m], per["B"][c][m]
            table[f"{c} {m}"] = {
                "A": statistics.median(a),
                "B": statistics.median(b),
                "A_reps": a,
                "B_reps": b,
                "A_plain_s": statistics.median(plain["A"][c][m]),
                "B_plain_s": statistics.median(plain["B"][c][m]),
            }
    return {
        "schema": "geosharp-whole-call-ab/1",
        "A": sides["A"],
        "B": sides["B"],
        "ratios": table,
        "children": children,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="minilm-small,vit-tiny,minilm-32x64,mha-vit-128")
    ap.add_argument("--measures", default=",".join(MEASURES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n1", type=int, default=3)
    ap.add_argument("--n2", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall time, or the process's CPU time (a machine shared with other jobs)",
    )
    ap.add_argument("--src", default=None, help="import geosharp from this src folder")
    ap.add_argument("--ab", nargs=2, metavar=("SRC_A", "SRC_B"), default=None)
    ap.add_argument("--json", default=None, help="write the figures here ('-': stdout only)")
    args = ap.parse_args(argv)
    for m in args.measures.split(","):
        if m not in MEASURES:
            ap.error(f"unknown measure {m!r}; one of {', '.join(MEASURES)}")
    if args.src:
        sys.path.insert(0, str(Path(args.src).resolve()))
    out = ab(args) if args.ab else run(args)
    if args.json == "-":
        print(json.dumps(out))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.ab:
        print(f"A = {out['A']}\nB = {out['B']}")
        print(f"{'config measure':32s}  A      B      B/A    plain_s A  B")
        for k, v in out["ratios"].items():
            print(
                f"{k:32s}  {v['A']:.3f}  {v['B']:.3f}  {v['B'] / v['A']:.3f}"
                f"  {v['A_plain_s']:.3f}  {v['B_plain_s']:.3f}"
            )
    else:
        print(f"{'config':14s} {'measure':14s} ratio  step_s  plain_s  (median of {args.repeats})")
        for c, ms in out["configs"].items():
            for m, f in ms.items():
                print(f"{c:14s} {m:14s} {f['ratio']:.3f}  {f['step_s']:.4f}  {f['plain_s']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
