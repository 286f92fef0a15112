"""The ``h × h`` factors a sharded geodesic call holds per rank, in units of ``P · 4 / world``.

The peak of a sharded geodesic call (``fsdp_memory.py``) should be 3 ξ-sized buffers plus these
(issue 27): the base point's factors (``M_G``, ``M_H``, their inverses, the Sylvester factors,
the endpoint's inverses) and the step's (``I + s B`` and ``C`` of every head, made before each
loss, :mod:`geosharp.estimators.sharded.gather`); the blocks' base point is printed beside
them (held between losses, given back while a loss runs). Same models and placement as
``fsdp_memory.py``; one spawned world per configuration.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_factors.py --worlds 1,2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_memory as FM

#: the model shape and placement of ``fsdp_memory.py``'s defaults
SHAPE = {"hidden": 256, "layers": 4, "rows": 8, "seq": 32, "placement": "rows"}


def _nbytes(obj: object, seen: set[int]) -> int:
    """Bytes of the distinct tensor storages in ``obj`` (a tensor, dataclass or sequence)."""
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen or not st.nbytes():
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if dataclasses.is_dataclass(obj):
        return sum(_nbytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o, seen) for o in obj)
    return 0


def rank_main(rank: int, world: int, store: str, args: dict, queue) -> None:
    try:
        queue.put((rank, _factors(rank, world, store, args)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def _factors(rank: int, world: int, store: str, args: dict) -> dict[str, float]:
    """The rank's factor and base-point bytes, in units of ``P · 4 / world``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from geosharp.estimators.harness import PerturbationSettings
    from geosharp.estimators.sharded.run import prepare

    model, n_params, *_ = FM.sharded_setup(rank, world, args)
    settings = PerturbationSettings(
        measure="geodesic",
        metric=args["measure"].split("-")[1],
        order=2,
        perturb="all",
        eps=0.0,
        corrected_norm=False,
        exact_steps=10,
        key_bias="quotient",
        low_memory=False,
    )
    run = prepare(model, settings, kind="worst", rho=0.1)  # in place outside the blocks
    setup = run.setup
    pert, seen, base, point = setup.pert, set(), 0, 0
    for k in pert.assembly.sym_pieces:
        g = pert.pieces[k].geometry
        if hasattr(g, "factors"):
            for t in g.point:
                point += t.untyped_storage().nbytes()
                seen.add(t.untyped_storage().data_ptr())
            base += _nbytes(g.factors, seen) + _nbytes(g._endpoint_inv, seen)
    step = 0
    if run.gather is not None:
        run.gather.step(pert.zeros())
        step = sum(_nbytes(v, set()) for v in run.gather._factors.values())
        run.gather.step(None)
    dist.destroy_process_group()
    unit = n_params * 4 / world
    return {"base": base, "step": step, "point": point, "unit": unit}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--models", default="bert,llama")
    ap.add_argument("--measures", default="geodesic-inv,geodesic-mix")
    a = ap.parse_args(argv)
    for model in a.models.split(","):
        for measure in a.measures.split(","):
            for world in (int(w) for w in a.worlds.split(",")):
                args = {**SHAPE, "model": model, "measure": measure}
                r = FM.run_world(rank_main, world, args)[0]
                if isinstance(r, str):
                    print(f"{model} {measure} world {world}: rank 0 failed:\n{r}")
                    continue
                base, step, unit = r["base"], r["step"], r["unit"]
                print(
                    f"{model} {measure} world {world}: base-point factors {base / 1e6:.2f} MB = "
                    f"{base / unit:.3f}, step factors {step / 1e6:.2f} MB = {step / unit:.3f}, "
                    f"together {(base + step) / unit:.3f} units; the blocks' base point "
                    f"{r['point'] / unit:.3f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
