"""Time and peak memory of a geodesic call's set-up on a big model, CPU, one thread (issue 27).

``find_symmetries`` and the perturbation's construction (``perturbation_of``: the blocks' base
point, its factorizations, the rest layout, the assembly's plan) of a ``regimes.py``
configuration, in float32, from a fresh process; the peak resident set above the model
(``VmHWM``, reset through ``/proc/self/clear_refs`` after the model is built) in
parameter-sized buffers. Run the code before a change with ``PYTHONPATH=<old checkout>/src``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/setup_scale.py llama-1b
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import regimes as R

from geosharp.estimators.harness import perturbation_of


def _status() -> dict[str, float]:
    """``VmHWM`` and ``VmRSS`` of this process, in GB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1e6
    return out


def _clock() -> tuple[float, float, float, int]:
    """Wall seconds, user and system CPU seconds of this process, and its minor page faults.

    On a loaded machine the CPU time and the page faults (fresh pages: on a VM each can cost
    more than the arithmetic of its 4 kB) vary less than the wall time; the system time is
    mostly those page faults, whose cost varies from run to run on a VM, the user time the
    arithmetic and the copies.
    """
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a regimes.py configuration, e.g. llama-1b or bert-335m")
    ap.add_argument("--metric", default="inv")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    case = R.build(a.config, torch.device("cpu"), torch.float32)
    gc.collect()
    n = sum(p.numel() for p in case.model.parameters())
    start = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = _clock()
    space = R.find_space(case)
    t1 = _clock()
    perturbation_of(
        case.model,
        space,
        measure="geodesic",
        metric=a.metric,
        order=2,
        perturb="all",
        eps=0.0,
        corrected_norm=False,
        exact_steps=10,
        key_bias=case.key_bias or "quotient",
        low_memory=False,
        cache=False,
    )
    t2 = _clock()
    end = _status()
    unit = n * 4 / 1e9

    def took(x: tuple[float, float, float, int], y: tuple[float, float, float, int]) -> str:
        (wa, ua, sa, fa), (wb, ub, sb, fb) = x, y
        return (
            f"{wb - wa:.2f} s (CPU {ub - ua + sb - sa:.2f} s: user {ub - ua:.2f} s, system "
            f"{sb - sa:.2f} s; {(fb - fa) / 1e3:.0f} k page faults)"
        )

    print(
        f"{a.config}: P = {n / 1e6:.0f} M; find_symmetries {took(t0, t1)}, perturbation "
        f"{took(t1, t2)}; peak above the model "
        f"{end['VmHWM'] - start:.2f} GB = {(end['VmHWM'] - start) / unit:.2f} P, held after "
        f"{(end['VmRSS'] - start) / unit:.2f} P"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
