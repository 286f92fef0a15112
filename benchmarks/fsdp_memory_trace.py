"""What is live at the peak of one sharded ``gs.sharpness`` call, by allocation site (issue 27).

The same BERT, rows and call as ``fsdp_memory.py`` (every layer and the root ``fully_shard``\\ ed
with :func:`geosharp.shard_placement`), at one world size (gloo on CPU). Rank 0 runs one plain
sharded step and the call under ``torch.profiler`` with ``profile_memory=True`` and Python
stacks; the CPU allocator's events (FSDP's gathered parameters and reduce-scattered gradients
included) are replayed in time order, and the tensors live at each peak are summed by their
innermost geosharp / FSDP frames. It prints, in units of ``P · 4 / world``:

- the peak above the start of the plain step and of the call, and their difference;
- at each peak, the live allocations of 200 KB or more by site (smaller ones summed);
- what the call left allocated when the profiler stopped (freed later by the garbage collector,
  or kept).

The differences of the profiler's peaks agree with ``fsdp_memory.py``'s resident-set peaks to a
few hundredths of a unit at world 1 (the allocator's figures have no page or heap slack).

    OMP_NUM_THREADS=1 python benchmarks/fsdp_memory_trace.py --measure geodesic-inv --world 1
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_memory import run_world, sharded_call, sharded_setup


def _allocations(prof) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """``(time, address, size, stack)`` of every allocation (size > 0) and free (size < 0)."""
    out = []

    def walk(node, stack: list[str]) -> None:
        ef = node.extra_fields
        if type(ef).__name__ == "_ExtraFields_Allocation":
            out.append((node.start_time_ns, ef.ptr, ef.alloc_size, tuple(stack)))
        inner = stack if node.name.startswith("[memory]") else [*stack, node.name]
        for c in node.children:
            walk(c, inner)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    out.sort(key=lambda e: e[0])
    return out


def _site(stack: tuple[str, ...], depth: int) -> str:
    frames = [s for s in stack if ".py(" in s and ("geosharp/" in s or "fsdp/" in s)]
    return " > ".join(f.split("site-packages/")[-1] for f in frames[-depth:]) or "(other)"


def _report(prof, label: str, unit: float, depth: int) -> int:
    live: dict[int, tuple[int, tuple[str, ...]]] = {}
    cur = peak = 0
    at_peak: dict = {}
    for _, ptr, size, stack in _allocations(prof):
        if size > 0:
            live[ptr] = (size, stack)
        else:
            live.pop(ptr, None)
        cur += size
        if cur > peak:
            peak, at_peak = cur, dict(live)
    print(f"{label}: peak above its start {peak / unit:.3f} units ({peak / 1e6:.1f} MB)")
    for name, table in (("live at the peak", at_peak), ("left at the end", live)):
        sites: collections.Counter = collections.Counter()
        for size, stack in table.values():
            sites["(allocations < 200 KB)" if size < 2e5 else _site(stack, depth)] += size
        total = sum(sites.values())
        print(f"  {name}: {total / unit:.3f} units")
        for site, size in sites.most_common(20):
            print(f"    {size / unit:7.3f}  {size / 1e6:7.1f} MB  {site}")
    return peak


def rank_main(rank: int, world: int, store: str, args: dict, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        from torch.profiler import ProfilerActivity, profile

        model, n_params, mine, ce, plain = sharded_setup(rank, world, args)

        def call() -> None:
            sharded_call(model, ce, mine, args)

        plain()  # warm-up
        if args.get("warm_call"):  # the library's first-call set-up done before the profile
            call()
        unit = n_params * 4 / world
        peaks = []
        for label, fn in (("plain step", plain), ("gs.sharpness", call)):
            if rank != 0:
                fn()
                continue
            with profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True
            ) as prof:
                fn()
            peaks.append(_report(prof, f"world {world} rank 0, {label}", unit, args["depth"]))
        if rank == 0:
            print(
                f"world {world} rank 0, {args['measure']}: call peak above the plain step's "
                f"{(peaks[1] - peaks[0]) / unit:.3f} units (unit P·4/world = {unit / 1e6:.2f} MB)"
            )
        dist.barrier()
        queue.put((rank, "ok"))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--measure", default="geodesic-inv")
    ap.add_argument("--model", default="bert", choices=("bert", "llama"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--depth", type=int, default=3, help="frames shown per allocation site")
    ap.add_argument("--warm-call", action="store_true", help="one call before the profiled one")
    a = ap.parse_args(argv)
    ranks = run_world(rank_main, a.world, vars(a))
    failed = [(rank, tb) for rank, tb in sorted(ranks.items()) if tb != "ok"]
    for rank, tb in failed:
        print(f"rank {rank} failed:\n{tb}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
