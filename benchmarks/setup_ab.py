"""Interleaved A/B of the step and repeated-call set-up of ``regimes.py``, versions side by side.

Each version is a copy of the package imported under its own name (``perparam_ab.py`` explains
how to make one from a commit, e.g. ``geosharp_old``); ``geosharp`` is the working tree. Every
version keeps its own base-point cache, and the calls follow the protocol of ``regimes.py``
(``PROTOCOL.md``): in each repetition the measures come in turn (their order rotating), and for
each measure a plain forward+backward is timed, then ``T(N₁)`` and ``T(N₂)`` of every version
(the order of the versions rotating too), then ``T(N₁)`` once more. So a version's first
``T(N₁)`` of a measure follows its calls of another measure, as in a study that alternates
measures on one model, and its cache decides whether that call rebuilds the base point; the
second one follows ``T(N₂)`` of the same measure and always finds it cached. Step ratio
``(T(N₂) − T(N₁)′) / (N₂ − N₁)`` with the second ``T(N₁)′`` (so a rebuild in the first call
does not lower the step, as it does in ``regimes.py`` when its cache misses), over the plain
step of the same repetition; repeated-call set-up ``T(N₁) − N₁·step`` with the first
``T(N₁)``, in plain steps; medians over repetitions. The values of every version's ``T(N₂)``
calls are printed side by side (the versions should agree to float rounding). The machine's
speed drifts by 20–40 % within a minute on a shared host, so a per-repetition ratio carries the
drift between its plain step and its calls; the *pooled* ratio, the median step time over the
median of every plain step of the configuration (all measures and repetitions), is printed
beside it.

Run:

    PYTHONPATH=/tmp/oldpkg:benchmarks OMP_NUM_THREADS=1 .venv/bin/python benchmarks/setup_ab.py \\
        --versions geosharp_old,geosharp --configs minilm-small --repeats 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import regimes as R
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default="geosharp_old,geosharp")
    ap.add_argument("--configs", default="minilm-small")
    ap.add_argument("--measures", default=",".join(R.DEFAULT_MEASURES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", default="1,5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n1, n2 = (int(s) for s in args.steps.split(","))
    names = args.versions.split(",")
    versions = {v: importlib.import_module(v) for v in names}
    measures = args.measures.split(",")
    out: dict = {"steps": [n1, n2], "repeats": args.repeats, "versions": names, "configs": {}}
    for config in args.configs.split(","):
        case = R.build(config, torch.device("cpu"), torch.float32)
        kb = {"key_bias": case.key_bias} if case.key_bias else {}
        for _ in range(2):
            R.plain_step(case)

        def call(v: str, m: str, n: int, case: R.Case = case, kb: dict = kb) -> tuple:
            kw = dict(R.MEASURES[m], progress=False, **kb)
            kw["samples" if kw["kind"] == "average" else "steps"] = n
            t = time.perf_counter()
            res = versions[v].sharpness(case.model, case.loss_fn, case.batches, **kw)
            return time.perf_counter() - t, res.value

        for m in measures:  # first calls: searches, factorizations, warm-up
            for v in names:
                call(v, m, n1)
        rows: dict = {m: {v: [] for v in names} for m in measures}
        values: dict = {m: {v: None for v in names} for m in measures}
        for r in range(args.repeats):
            k = r % len(measures)
            for m in measures[k:] + measures[:k]:
                plain = R.timed(lambda: R.plain_step(case), torch.device("cpu"))  # noqa: B023
                j = r % len(names)
                for v in names[j:] + names[:j]:
                    t1, _ = call(v, m, n1)
                    t2, values[m][v] = call(v, m, n2)
                    t1_hot, _ = call(v, m, n1)
                    step = (t2 - t1_hot) / (n2 - n1)
                    rows[m][v].append((step / plain, (t1 - n1 * step) / plain, plain))
        res: dict = {}
        # every plain step of the configuration (one per measure and repetition)
        pooled = statistics.median(x[2] for m in measures for x in rows[m][names[0]])
        print(
            f"{config}: {args.repeats} repetitions, steps {n1},{n2}, pooled plain step "
            f"{pooled * 1e3:.0f} ms",
            flush=True,
        )
        for m in measures:
            res[m] = {}
            for v in names:
                vals = rows[m][v]
                step_s = statistics.median(x[0] * x[2] for x in vals)
                res[m][v] = {
                    "step_ratio": statistics.median(x[0] for x in vals),
                    "step_s": step_s,
                    "pooled_step_ratio": step_s / pooled,
                    "repeat_setup_ratio": statistics.median(x[1] for x in vals),
                    "plain_s": statistics.median(x[2] for x in vals),
                    "value": values[m][v],
                    "all": vals,
                }
            cells = "  ".join(
                f"{v}: step {res[m][v]['step_ratio']:.2f} "
                f"(pooled {res[m][v]['pooled_step_ratio']:.2f}) "
                f"set-up {res[m][v]['repeat_setup_ratio']:.2f} value {res[m][v]['value']:.9g}"
                for v in names
            )
            print(f"  {m:24s} {cells}", flush=True)
        out["configs"][config] = res
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
