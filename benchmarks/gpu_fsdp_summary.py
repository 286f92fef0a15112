"""One line per case and world size from the JSON that ``tests/estimators/fsdp_worlds.py`` prints.

    python tests/estimators/fsdp_worlds.py 1 cuda > fsdp.json
    python benchmarks/gpu_fsdp_summary.py fsdp.json

For every case (model/dtype/ρ) and world size: the largest relative difference between a rank's
sharded value and the unsharded value of the same measure (the worst case's values, the random
measures' and the exact geodesic's), whether every rank's shards came back bit-identical, and for
the bfloat16 case the relative difference from the float32 value on the same weights. It exits
with 1 when a float64 case differs by more than 1e-10, a float32 case by more than 1e-5, or a
model's shards changed: the tolerances of issue 27's tests (``tests/estimators/test_fsdp.py``).
"""

from __future__ import annotations

import json
import sys

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def summary(result: dict) -> tuple[list[str], bool]:
    """The lines to print, and whether every case is within its tolerance."""
    lines, ok = [], True
    refs = {**result["reference"]}
    groups = {k: result[k] for k in ("random", "exact") if k in result}
    for world, ranks in sorted(result["worlds"].items(), key=lambda kv: int(kv[0])):
        for rank, out in sorted(ranks.items(), key=lambda kv: int(kv[0])):
            if isinstance(out, str):  # the rank's traceback
                lines.append(f"world {world} rank {rank}: FAILED\n{out}")
                ok = False
                continue
            for case, got in out.items():
                dtype = case.split("/")[1]
                worst = 0.0
                for m, v in got["values"].items():
                    worst = max(worst, rel(v["value"], refs[case][m]["value"]))
                for g, table in groups.items():
                    for m, v in got.get(g, {}).items():
                        worst = max(worst, rel(v["value"], table[case][m]["value"]))
                line = (
                    f"world {world} rank {rank} {case:<28} max rel diff {worst:.2e}, "
                    f"shards identical {got['shards_identical']}"
                )
                tol = TOLERANCE.get(dtype)
                if (tol is not None and worst > tol) or not got["shards_identical"]:
                    ok = False
                    line += "  <-- OUT OF TOLERANCE"
                if dtype == "bfloat16":  # against the float32 value on the same weights
                    f32 = case.replace("bfloat16", "float32")
                    if f32 in refs:
                        diffs = ", ".join(
                            f"{m} {v['value'] / refs[f32][m]['value'] - 1:+.2%}"
                            for m, v in got["values"].items()
                        )
                        line += f"; vs float32: {diffs}"
                lines.append(line)
    return lines, ok


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        text = f.read().strip().splitlines()
    lines, ok = summary(json.loads(text[-1]))
    print("\n".join(lines))
    sys.exit(0 if ok else 1)
