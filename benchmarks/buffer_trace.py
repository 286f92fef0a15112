"""Which tensors are alive at the memory peak of one ``gs.sharpness`` call, and who made them.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every tensor an operator creates
(forward, backward and the geometry alike). Each new storage of at least ``--min-mb`` is
recorded with the operator and the innermost geosharp (or model) frame that asked for it, and a
weak reference tells when it dies. The live total of recorded storages (the model's own
parameters excluded, as in a plain fwd+bwd) is followed op by op; at its largest, the storages
alive are listed, biggest first, in parameter-sized units ``P · itemsize``.

The same is done for two plain forward+backward steps, so the figure printed,
``peak above plain``, is the buffer count of ``PROTOCOL.md`` measured from the tensors
themselves instead of from the allocator (no glibc retention, no granularity).

Run: ``python benchmarks/buffer_trace.py --config minilm-small --measure geodesic-inv-o2``
(the configurations and measures of ``regimes.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regimes

TRACK_RSS = False
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _where() -> str:
    """The innermost frame of geosharp (or else the model's code) that led to this op."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "/geosharp/" in f.filename and "_python_dispatch" not in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    for f in reversed(frames):
        if "torch" not in f.filename and "buffer_trace" not in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return "?"


class LiveTensors(TorchDispatchMode):
    """Follows the live bytes of the storages created while it is active."""

    def __init__(self, min_bytes: int, exclude: set[int]) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.exclude = exclude
        self.records: dict[int, tuple[StorageWeakRef, int, str, str]] = {}
        self.live = 0
        self.peak = 0
        self.peak_set: list[tuple[int, str, str]] = []
        #: (largest RSS seen after an op, live bytes then, op, where) with ``--rss``
        self.rss: tuple[int, int, str, str] | None = (0, 0, "", "") if TRACK_RSS else None

    def _sweep(self) -> None:
        dead = [k for k, (ref, *_rest) in self.records.items() if ref.expired()]
        for k in dead:
            self.live -= self.records.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            key = s.data_ptr()
            n = s.nbytes()
            if n < self.min_bytes or key in self.exclude or key in self.records:
                continue
            self.records[key] = (StorageWeakRef(s), n, str(func.__name__), _where())
            self.live += n
        if self.live > self.peak:
            self.peak = self.live
            self.peak_set = [(n, op, w) for (_r, n, op, w) in self.records.values()]
        if self.rss is not None:
            rss = _rss_bytes()
            if rss > self.rss[0]:
                self.rss = (rss, self.live, str(func.__name__), _where())
        return out


def trace(case: regimes.Case, measure: str, steps: int, min_bytes: int) -> dict[str, Any]:
    """Peaks of two plain steps and of one call, with what is alive at the call's peak."""
    params = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in case.model.buffers()}
    regimes.plain_step(case)  # warm-up (lazy initializations)
    with LiveTensors(min_bytes, params) as plain:
        for _ in range(2):
            regimes.plain_step(case)
    probe = regimes.Probe(torch.device("cpu"))
    with LiveTensors(min_bytes, params) as call:
        regimes.sharpness_call(case, measure, steps, probe, 0.0)
    return {
        "plain": plain.peak,
        "call": call.peak,
        "peak_set": call.peak_set,
        "rss_plain": plain.rss,
        "rss_call": call.rss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="minilm-small")
    parser.add_argument("--measure", default="adaptive-l2", help=", ".join(regimes.MEASURES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-mb", type=float, default=0.5, help="smallest storage followed")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--rss",
        action="store_true",
        help="also follow the process's RSS after every op (run with MALLOC_MMAP_THRESHOLD_="
        "65536 so that RSS follows the allocations) and say where it peaked",
    )
    args = parser.parse_args(argv)
    global TRACK_RSS
    TRACK_RSS = args.rss
    torch.set_num_threads(1)
    case = regimes.build(args.config, torch.device("cpu"), regimes.DTYPES[args.dtype])
    trainable = [p for p in case.model.parameters() if p.requires_grad]
    unit = sum(p.numel() for p in trainable) * trainable[0].element_size()
    for measure in args.measure.split(","):
        r = trace(case, measure, args.steps, int(args.min_mb * 2**20))
        print(
            f"{args.config} {measure}: plain peak {r['plain'] / unit:.2f}, call peak "
            f"{r['call'] / unit:.2f}, peak above plain {(r['call'] - r['plain']) / unit:.2f} "
            f"(units of P·itemsize = {unit / 2**20:.1f} MiB)"
        )
        if r["rss_call"] is not None:
            (pr, pl, *_), (cr, cl, op, where) = r["rss_plain"], r["rss_call"]
            print(
                f"  RSS: plain peak {pr / unit:.2f} (traced then {pl / unit:.2f}), call peak "
                f"{cr / unit:.2f} (traced then {cl / unit:.2f}) after {op} at {where}; RSS above "
                f"plain {(cr - pr) / unit:.2f}"
            )
        groups: Counter = Counter()
        for n, op, where in r["peak_set"]:
            groups[(where, op)] += n
        for (where, op), n in groups.most_common(25):
            print(f"  {n / unit:6.3f}  {op:<28} {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
