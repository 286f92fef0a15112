"""Study 5's pilot (PREREGISTRATION.md, "Pilot"): the ρ rule, the steps rule and the step time.

On the pilot model ``study5-000`` and the first 256 rows of ``sharpness.csv`` (2 batches of
128), loaded, tokenized and self-checked by the population command's own path
(``PopulationStudy.prepare_row``'s calls on the pilot's folder), for each measure:

1. the ρ rule: :func:`geosharp.studies.rho_rule.ladder_grid` with 20 Auto-PGD steps (the
   grid {ρ₀/√10, ρ₀, √10·ρ₀});
2. the steps rule's values at ρ₀ after 5 and 10 steps (20: from step 1);
3. the time of those two runs per Auto-PGD step and batch.

Writes one JSON per measure into the folder ``--json``. ``--decide`` reads them and applies the steps rule
(S = the smallest of 5, 10 within 3 % of the 20-step value for every measure, else 20) and
the sample rule (the largest N_SHARP of 1024, 512, 256 whose 12 rows per model fit the time
budget; then 6 rows at 256; then 6 rows at 128), and writes the plan.

    python pilot.py --model OUT/models/study5-000 --data D --measures adaptive --json P
    python pilot.py --decide P/*.json --models 64 --budget-s 300 --procs 6 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from geosharp.measures import parse_measure
from geosharp.studies.rho_rule import ladder_grid
from geosharp.studies.population import PopulationStudy

PILOT = "study5-000"
PILOT_SAMPLES = 256
LADDER_STEPS = 20
STEPS_TRIED = (5, 10)
WITHIN = 0.03
SAMPLES = (1024, 512, 256)
BATCH = 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_pilot(args: argparse.Namespace) -> None:
    options = {
        "data": args.data, "text_col": "text", "label_col": "label", "task": "classification",
        "loss": "ce", "max_length": 64, "batch_size": args.batch, "samples": args.samples,
        "device": args.device, "seed": 0,
    }  # fmt: skip
    from geosharp.measuring.core import prepare_measurement
    from geosharp.measuring.pipeline import MeasureOptions, ModelSource, load_for_measure
    from geosharp.measuring.resolve import resolve_device

    options["device"] = resolve_device(args.device)
    # the population command's own loading, tokenizing and self-check of a model
    # (PopulationStudy.prepare_row), on the pilot's folder alone
    ready_in = load_for_measure(ModelSource(args.model), MeasureOptions(**options), say=log,
                                warn=log)
    checked = prepare_measurement(ready_in.model, ready_in.batches, ready_in.loss, check=True,
                                  seed=0, say=log)
    model, loss_fn, batches = checked.model, checked.loss_fn, checked.batches
    run_settings = {"space": checked.space, "key_bias": PopulationStudy.key_bias}
    for name in args.measures:
        m = parse_measure(name)
        cache: dict[tuple[float, int], float] = {}

        def value(rho: float, steps: int, m=m, cache=cache) -> float:
            if (rho, steps) not in cache:
                cache[(rho, steps)] = m.run(
                    model, loss_fn, batches, rho=rho, steps=steps, eps=0.0, seed=0,
                    progress=False, **run_settings,
                ).value
            return cache[(rho, steps)]

        t0 = time.perf_counter()
        ladder: list[list[float]] = []

        def rise(rho: float, value=value, ladder=ladder) -> float:
            v = value(rho, LADDER_STEPS)
            ladder.append([rho, v])
            return v

        grid = ladder_grid(rise, m.kwargs().get("kind", "worst"), m.name, log=log)
        t_ladder = time.perf_counter() - t0
        rho0 = grid[1]
        if args.wait_for:
            while not Path(args.wait_for).exists():
                time.sleep(1)
        t1 = time.perf_counter()
        values = {s: value(rho0, s) for s in STEPS_TRIED}
        t_steps = time.perf_counter() - t1
        values[LADDER_STEPS] = value(rho0, LADDER_STEPS)  # the ladder's 20-step value
        n_batches = len(batches)
        step_batches = sum(n_batches * (s + 1) for s in STEPS_TRIED)
        record = {
            "token": name, "measure": m.name, "pilot": args.pilot, "samples": args.samples, "batch": args.batch,
            "ladder": ladder, "grid": list(grid), "rho0": rho0,
            "values_at_rho0": {str(k): v for k, v in sorted(values.items())},
            "ladder_s": round(t_ladder, 2), "steps_rule_s": round(t_steps, 3),
            "step_batches": step_batches, "t_step_batch_s": t_steps / step_batches,
            "device": str(options["device"]), "pid": os.getpid(),
        }  # fmt: skip
        log(f"{m.name}: grid {grid}, values at rho0 {record['values_at_rho0']}, "
            f"t = {record['t_step_batch_s'] * 1e3:.1f} ms per step and batch")
        Path(args.json).mkdir(parents=True, exist_ok=True)
        (Path(args.json) / f"{m.name}.json").write_text(json.dumps(record, indent=1) + "\n")


def decide(args: argparse.Namespace) -> None:
    records = [json.loads(Path(p).read_text()) for p in args.decide]
    S = 20
    for s in STEPS_TRIED:
        if all(abs(r["values_at_rho0"][str(s)] / r["values_at_rho0"]["20"] - 1) <= WITHIN
               for r in records):
            S = s
            break
    # each pilot process ran its steps-rule runs while the others did (as the study's --procs
    # shards will): a row of B batches costs B·(S + 1)·t of one process, procs run side by side
    t = sum(r["t_step_batch_s"] for r in records) / len(records)  # the mean over the measures
    def cost(n_samples: int, rows: int) -> float:
        return args.models * rows * (n_samples // BATCH) * (S + 1) * t / args.procs

    choice = None
    for n in SAMPLES:
        if cost(n, 12) <= args.budget_s:
            choice = (n, 12)
            break
    if choice is None:
        choice = (256, 6) if cost(256, 6) <= args.budget_s else (128, 6)
    plan = {
        "steps": S, "samples": choice[0], "rows_per_model": choice[1],
        "t_step_batch_s": t, "budget_s": args.budget_s, "procs": args.procs,
        "models": args.models,
        "predicted_s": {f"{n}x{rows}": round(cost(n, rows), 1)
                        for n in (*SAMPLES, 128) for rows in (12, 6)},
        "grids": {r["measure"]: r["grid"] for r in records},
        "rho0": {r["measure"]: r["rho0"] for r in records},
        "values_at_rho0": {r["measure"]: r["values_at_rho0"] for r in records},
        # `geosharp study --rho` clauses: every measure at ρ₀ (H1–H3), the outer ρ of the grids
        "rho_main": [f"{r['token']}={r['rho0']:g}" for r in records],
        "rho_outer": [f"{r['token']}={r['grid'][0]:g},{r['grid'][2]:g}" for r in records
                      if not r["token"].endswith("-blocks")],
    }  # fmt: skip
    Path(args.json).write_text(json.dumps(plan, indent=1) + "\n")
    log(f"plan: S = {S}, N_SHARP = {choice[0]}, {choice[1]} rows per model "
        f"(t = {t * 1e3:.1f} ms, budget {args.budget_s:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the pilot model's folder")
    ap.add_argument("--data")
    ap.add_argument("--pilot", default=PILOT)
    ap.add_argument("--measures", nargs="+")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wait-for", help="a file whose existence starts the timed runs")
    ap.add_argument("--json", required=True, help="pilot: a folder (a JSON per measure); --decide: the plan")
    ap.add_argument("--samples", type=int, default=PILOT_SAMPLES, help="pilot sample (256)")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--decide", nargs="+", help="the pilot JSONs: apply the rules")
    ap.add_argument("--models", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=40 * 3600.0)
    ap.add_argument("--procs", type=int, default=1)
    args = ap.parse_args()
    if args.decide:
        decide(args)
        return
    import torch

    torch.set_num_threads(args.threads)
    run_pilot(args)


if __name__ == "__main__":
    main()
