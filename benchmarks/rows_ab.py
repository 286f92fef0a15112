"""A/B in one process: the ascent with embedding tables cut to the rows reached, and without.

``geosharp.estimators.rows`` leaves out of an ascent from ξ = 0 the embedding rows a batch
never looks up (their gradient is zero at every point). This times both ways on the same model,
batches and weights, alternating in every repetition: a plain forward+backward, then
``T(N1)`` and ``T(N2)`` of each measure cut (``MAX_ROW_SHARE`` at its default) and whole
(``MAX_ROW_SHARE = -1``), in alternating order, caches on (as several radii on one model). The
per-step time is ``(T(N2) − T(N1)) / (N2 − N1)``, reported over the plain step of the same
repetition (medians over repetitions), with the values of both ways.

Run: ``python benchmarks/rows_ab.py --config minilm-32x64 --repeats 3``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regimes

from geosharp.estimators import rows

WAYS = {"cut": rows.MAX_ROW_SHARE, "whole": -1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="minilm-32x64")
    parser.add_argument("--measures", default="adaptive-l2,geodesic-inv-o2,geodesic-mix-o2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", default="1,5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n1, n2 = (int(s) for s in args.steps.split(","))
    device = torch.device("cpu")
    case = regimes.build(args.config, device, torch.float32)
    probe = regimes.Probe(device)
    measures = args.measures.split(",")
    regimes.plain_step(case)  # warm-up
    for m in measures:  # warm-up, and the caches filled for both ways
        for share in WAYS.values():
            rows.MAX_ROW_SHARE = share
            regimes.sharpness_call(case, m, n1, probe, 0.0)
    out: dict[str, dict[str, list[float]]] = {
        m: {f"{w}_{k}": [] for w in WAYS for k in ("ratio", "value")} for m in measures
    }
    for rep in range(args.repeats):
        for m in measures:
            plain = regimes.timed(lambda: regimes.plain_step(case), device)
            ways = list(WAYS.items()) if rep % 2 == 0 else list(WAYS.items())[::-1]
            for way, share in ways:
                rows.MAX_ROW_SHARE = share
                t1 = regimes.timed(
                    lambda m=m: regimes.sharpness_call(case, m, n1, probe, 0.0), device
                )
                res: dict = {}
                t2 = regimes.timed(
                    lambda m=m, res=res: res.update(
                        regimes.sharpness_call(case, m, n2, probe, 0.0)
                    ),
                    device,
                )
                out[m][f"{way}_ratio"].append((t2 - t1) / (n2 - n1) / plain)
                out[m][f"{way}_value"].append(res["value"])
            print(
                f"rep {rep} {m:<18} plain {plain * 1e3:7.1f} ms  step/plain cut "
                f"{out[m]['cut_ratio'][-1]:.2f}  whole {out[m]['whole_ratio'][-1]:.2f}",
                flush=True,
            )
    rows.MAX_ROW_SHARE = WAYS["cut"]
    print(f"\n{args.config}: medians over {args.repeats} repetitions (step / plain fwd+bwd)")
    summary = {}
    for m in measures:
        cut = statistics.median(out[m]["cut_ratio"])
        whole = statistics.median(out[m]["whole_ratio"])
        a, b = out[m]["cut_value"][-1], out[m]["whole_value"][-1]
        rel = abs(a - b) / abs(b) if b else float("nan")
        summary[m] = {"cut": cut, "whole": whole, "value_cut": a, "value_whole": b, "rel": rel}
        print(f"  {m:<18} whole {whole:.2f} → cut {cut:.2f}   values rel. diff {rel:.1e}")
    if args.json:
        args.json.write_text(json.dumps({"runs": out, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
