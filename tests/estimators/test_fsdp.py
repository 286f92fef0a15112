"""gs.sharpness of an FSDP2-sharded model equals the unsharded value (SPEC §10).

``fsdp_worlds.py`` measures a tiny BERT and a Llama with grouped-query attention and a PEFT LoRA
(built from configs) in one process, then at world sizes 1, 2 and 4 (gloo on CPU, every layer
and the root under ``fully_shard``, every batch's rows split over the ranks). Asserted:

- float64: every rank's value within 1e-10 (relative) of the unsharded one;
- float32: the perturbed and clean losses within 1e-5 (relative), and the value within 1e-5 of
  the clean loss (a sharpness is a difference of two losses of order 1: float32 rounding of
  the losses, ~1e-7, is a larger part of it; the unsharded float32 value itself differs from
  the float64 one by up to 1e-4 relative here);
- every rank gets the same numbers, and its shards are bit-identical after the calls.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
pytest.importorskip("peft")

SCRIPT = Path(__file__).with_name("fsdp_worlds.py")


@pytest.fixture(scope="module")
def worlds():
    if not dist.is_available():
        pytest.skip("torch without distributed")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "1,2,4"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_values_equal_the_unsharded_ones(worlds, world):
    ref = worlds["reference"]
    ranks = worlds["worlds"][world]
    assert sorted(ranks) == [str(r) for r in range(int(world))]
    for rank, out in ranks.items():
        assert isinstance(out, dict), f"rank {rank} failed:\n{out}"
        assert out.keys() == ref.keys()
        for key, by_measure in out.items():
            assert by_measure["shards_identical"], (world, rank, key)
            for m, got in by_measure["values"].items():
                want = ref[key][m]
                assert got["sharded"] == {"world": int(world), "shard_dims": [0]}
                assert want["sharded"] is None
                if key.endswith("float64"):
                    assert _rel(got["value"], want["value"]) <= 1e-10, (world, key, m)
                else:
                    for part in ("clean", "perturbed"):
                        for g, w in zip(got[part], want[part], strict=True):
                            assert _rel(g, w) <= 1e-5, (world, key, m, part)
                    assert abs(got["value"] - want["value"]) <= 1e-5 * want["clean"][0]
                assert got["value"] > 0
        assert out == ranks["0"]  # every rank the same numbers
