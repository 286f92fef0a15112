"""Study 6's pilot: the orbit spread of each candidate recipe, and nothing else.

Rule (fixed in this file before it ran; PREREGISTRATION.md repeats it): for each recipe of
``train.RECIPES``, train ``--per`` pilot models (the pilot stream ``[6, 1000 + recipe, i]``:
none of them is a study model), then record **only where their heads sit on their orbits**:
per model and block kind (QK, VO) the model imbalance ``√Σ‖GᵀG−HᵀH‖² / √Σ‖GᵀG+HᵀH‖²``
(``geosharp.studies.orbit_spread``, key biases quotiented as the population command does), and
per recipe the orbit spread = the largest over the kinds of the standard deviation over its
models of the model imbalance. No sharpness is measured, no gap or test error is computed or
looked at (a model that did not learn — train error above 0.5, the study's exclusion rule —
is dropped from the spread and counted; nothing else of its errors is kept).

Choosing the levels (applied by :func:`choose`, written before the pilot ran): sort the
recipes by pilot spread; the **low** level is the recipe with the smallest spread, the **high**
level the one with the largest, the **middle** level the recipe whose log spread is nearest the
mean of the low and high log spreads. The levels must be separated: high/middle ≥ 2 and
middle/low ≥ 2 in pilot spread; if the middle recipe fails that, the study says so and keeps the
three chosen (the trend test uses each level's spread measured on the study's own models, not
the pilot's).

    OMP_NUM_THREADS=1 python results/study6-orbit-dose/pilot.py --per 3 [--threads 1]

Writes ``pilot.csv`` (one line per pilot model and kind: recipe, model, kind, imbalance,
mean log scale) and ``pilot.md`` (per recipe: models, median imbalance per kind, spread; the
levels chosen) beside this file; ``--out`` elsewhere.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train  # noqa: E402

from geosharp.studies.orbit_spread import head_rows, model_stats, population_spread  # noqa: E402
from geosharp.studies.orbit_spread import spread_level  # noqa: E402


def choose(spreads: dict[str, float]) -> dict[str, object]:
    """The three levels from the recipes' pilot spreads (the rule of the module docstring)."""
    order = sorted(spreads, key=lambda r: spreads[r])
    low, high = order[0], order[-1]
    target = 0.5 * (math.log(spreads[low]) + math.log(spreads[high]))
    middle = min(order[1:-1], key=lambda r: abs(math.log(spreads[r]) - target))
    separated = spreads[high] / spreads[middle] >= 2 and spreads[middle] / spreads[low] >= 2
    return {"low": low, "middle": middle, "high": high, "separated": separated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per", type=int, default=3, help="pilot models per recipe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    d = train.data()
    lines = ["recipe,model,kind,imbalance,log_scale,train_time_s"]
    spreads: dict[str, float] = {}
    table = []
    dropped: dict[str, int] = {}
    t0 = time.perf_counter()
    for recipe in train.RECIPES:
        rows = []
        dropped[recipe] = 0
        for i in range(args.per):
            hp = train.draw(recipe, i, pilot=True)
            model, metrics = train.train(hp, d)
            name = f"pilot-{recipe}-{i}"
            if train.excluded_because(metrics) is not None:
                dropped[recipe] += 1
                print(f"{name}: dropped (did not learn or diverged)", flush=True)
                continue
            heads = head_rows(model, model_id=name, key_bias="quotient")
            rows += heads
            for (mid, kind), s in model_stats(heads).items():
                lines.append(f"{recipe},{mid},{kind},{s['imbalance']!r},{s['log_scale']!r},"
                             f"{metrics['train_time_s']}")  # fmt: skip
            print(f"{name}: {metrics['train_time_s']} s", flush=True)
        kinds = population_spread(rows)
        spreads[recipe] = spread_level(kinds)
        table.append((recipe, kinds))
        (out / "pilot.csv").write_text("\n".join(lines) + "\n")
    levels = choose(spreads)
    md = ["# Study 6 pilot: orbit spread per recipe (output of pilot.py)", ""]
    md.append(f"{args.per} pilot models per recipe (pilot stream), {time.perf_counter() - t0:.0f} s "
              f"on one thread; no sharpness, gap or test error looked at.")  # fmt: skip
    md += ["", "| recipe | models | QK imbalance median | VO imbalance median | QK spread | "
           "VO spread | orbit spread |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for recipe, kinds in table:
        by = {k.category: k for k in kinds}
        cells = [
            f"{by[k].imbalance[0]:.3f}" if k in by else "–" for k in ("QK", "VO")
        ] + [f"{by[k].across:.3g}" if k in by else "–" for k in ("QK", "VO")]
        n = max((k.models for k in kinds), default=0)
        md.append(f"| {recipe} | {n} (dropped {dropped[recipe]}) | " + " | ".join(cells)
                  + f" | {spreads[recipe]:.3g} |")  # fmt: skip
    md += ["", f"Levels (the rule of pilot.py): low = {levels['low']}, middle = "
           f"{levels['middle']}, high = {levels['high']}; separated by ≥ 2× in spread: "
           f"{levels['separated']}.", ""]  # fmt: skip
    (out / "pilot.md").write_text("\n".join(md))
    print("\n".join(md))
    _ = np  # numpy is train's


if __name__ == "__main__":
    main()
