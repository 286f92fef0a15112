"""gs.sharpness of an FSDP2-sharded model equals the unsharded value (SPEC §10).

``fsdp_worlds.py`` measures a tiny BERT and a Llama with grouped-query attention, fully trained
(rotary Q/K blocks) and with a PEFT LoRA (LoRA GL(r) blocks), built from configs, in one
process, then at world sizes 1, 2 and 4 (gloo on CPU, every layer and the root under
``fully_shard`` with :func:`geosharp.shard_placement`, every batch's rows split over the
ranks), with adaptive and Euclidean (ℓ2, ℓ∞) and geodesic (inv, mix) sharpness;
the geodesic ones run their GL(h) and LoRA GL(r) blocks on each rank's rows with ``h × h``
reductions (SPEC §10.2). Asserted:

- float64: every rank's value within 1e-10 (relative) of the unsharded one;
- float32: the perturbed and clean losses within 1e-5 (relative), and the value within 1e-5 of
  the clean loss (a sharpness is a difference of two losses of order 1: float32 rounding of
  the losses, ~1e-7, is a larger part of it; the unsharded float32 value itself differs from
  the float64 one by up to 1e-4 relative here);
- bfloat16 (BERT, loss in float32, ρ = 0.5): losses within 4e-3, and the value within 2 % of
  the float32 value on the same weights, sharded or not;
- the average case (adaptive, geodesic inv) and random starts (geodesic inv ℓ2, adaptive ℓ∞) of
  the float64 BERT, the BERT under FSDP's default placement (padded heads) and the LoRA Llama:
  every rank draws its part of the unsharded noise (geosharp.estimators.sharded.draws), so the
  values are within 1e-10 (relative) of the unsharded ones with the same seed;
- the exact (RK4) geodesic (mix, and inv attention-only) of the float64 BERT (also under the
  default placement), the rotary Llama and the LoRA Llama: within 1e-10 of the unsharded value;
- geodesic with ``low_memory=True`` and without the corrected norm (the BERT and the LoRA
  Llama, float64): within 1e-10 of the unsharded value;
- ``gs.curvature`` (λ_max, λ_min, Hutchinson trace; adaptive, Euclidean, geodesic inv and mix)
  of the float64 BERT, and geodesic inv of the padded BERT and the LoRA Llama: the values, Ritz
  values, gradient norms and clean losses within 1e-10 (relative) of the unsharded ones, the
  shards bit-identical after each call and FSDP's resharding settings its own again (the
  case's sharpness measures run after it, issue 42);
- every rank gets the same numbers, and its shards are bit-identical after the calls;
- invariance on the sharded model: the BERT with a random group element applied has the
  BERT's geodesic values (float64, 1e-9), while its adaptive value moves.
"""

import json
import math
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


def _gathered_at(base: str, world: str, key: str) -> str:
    """``base``, but θ′ is written over the shards where the blocks' rows are no views of the
    shards (FSDP's default placement, dimension 0, pads the heads a rank does not hold when
    there are several ranks)."""
    written = key.startswith("bert-default") and world != "1"
    return "in place outside the blocks" if base.endswith("gathered)") and written else base


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_values_equal_the_unsharded_ones(worlds, world):
    ref = worlds["reference"]
    ranks = worlds["worlds"][world]
    assert sorted(ranks) == [str(r) for r in range(int(world))]
    for rank, out in ranks.items():
        assert isinstance(out, dict), f"rank {rank} failed:\n{out}"
        assert set(out) == set(ref) - {"bert/float32/0.5"}
        for key, by_measure in out.items():
            assert by_measure["shards_identical"], (world, rank, key)
            dtype = key.split("/")[1]
            for m, got in by_measure["values"].items():
                want = ref[key][m]
                rho = float(key.split("/")[2]) / (10 if m.endswith("linf") else 1)
                base = "copy"  # the base point: in place at ρ ≤ 0.4, outside blocks for geodesic
                if m.endswith("blocks"):  # the coordinates outside the blocks do not move
                    base = "in place outside the blocks"
                elif rho <= 0.4 and m.startswith("adaptive"):
                    base = "in place"
                elif rho <= 0.4 and m.startswith("geodesic"):  # θ′ of the blocks gathered
                    base = _gathered_at("in place (blocks gathered)", world, key)
                default = key.startswith("bert-default")  # FSDP's own placement: dim 0
                assert got["sharded"] == {
                    "world": int(world),
                    "shard_dims": [0] if default else [0, 1],  # shard_placement: Q/K/V, LoRA A
                    "base_point": base,
                }
                assert want["sharded"] is None
                assert got["dtype"] == want["dtype"]
                assert got["n_params"] == want["n_params"]  # the whole model's, not the shard's
                if dtype == "float64":
                    assert _rel(got["value"], want["value"]) <= 1e-10, (world, key, m)
                else:
                    loss_tol = 1e-5 if dtype == "float32" else 4e-3  # bfloat16: 8-bit mantissa
                    for part in ("clean", "perturbed"):
                        for g, w in zip(got[part], want[part], strict=True):
                            assert _rel(g, w) <= loss_tol, (world, key, m, part)
                    diff = abs(got["value"] - want["value"])
                    if dtype == "float32":
                        assert diff <= 1e-5 * want["clean"][0], (world, key, m)
                    else:
                        assert diff <= 0.05 * want["value"], (world, key, m)
                assert got["value"] > 0
        assert out == ranks["0"]  # every rank the same numbers


#: the base point of the random measures at ρ = 0.05: Gaussian noise has no bound
#: ``|ξ_i| ≤ |w_i| / 2``, so the average case copies the shards; a random start lies in the ball
RANDOM_BASE = {
    "adaptive-average": "copy",
    "geodesic-inv-average": "copy",
    "geodesic-inv-restarts": "in place (blocks gathered)",
    "adaptive-linf-restarts": "in place",
}


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_random_measures_draw_the_unsharded_noise(worlds, world):
    """The average case and random starts: every rank draws its part of the unsharded noise.

    float64, so the sharded value equals the unsharded one with the same seed to rounding
    (measured 2026-12-04: at most 5.6e-13 relative at worlds 2 and 4, 0 at world 1; a rank
    drawing its own shard's noise from the generator instead misses by 1e-4 to 190 %).
    """
    want = worlds["random"]
    labels = {m for by_measure in want.values() for m in by_measure}
    assert labels == {
        "adaptive-average",
        "geodesic-inv-average",
        "geodesic-inv-restarts",
        "adaptive-linf-restarts",
    }
    for key, m, g, w in _pairs(worlds, world, "random"):
        assert w["sharded"] is None
        assert g["sharded"] == {
            "world": int(world),
            "shard_dims": [0] if key.startswith("bert-default") else [0, 1],
            "base_point": _gathered_at(RANDOM_BASE[m], world, key),
        }
        assert w["value"] != 0 and math.isfinite(w["value"])
        _assert_equal(g, w, (world, key, m))
    measured = {k for k, v in want.items() if v}
    assert measured == {
        "bert/float64/0.05",
        "llama-gqa-lora/float64/0.05",
        "bert-default/float64/0.05",
    }


def test_bfloat16_is_within_its_tolerance_of_float32_on_the_same_weights(worlds):
    """The bfloat16 BERT (loss in float32) at ρ = 0.5 against float32 on the same weights.

    Tolerance 2 % of the value (measured 2026-12-04: 0.04–1.13 % for every measure at worlds
    1, 2 and 4, geodesic-mix 0.79–0.99 % with its order-2 endpoint in float32, 3.6 % at world 4
    with it in bfloat16; at ρ = 0.05 bfloat16 cannot
    resolve ``w + ξ`` and differs by ~30 %, see ``docs/cluster.md``). Not the attention-only
    measure: its value, 3e-5 of a loss of 1.1 here, is below what a bfloat16 forward resolves
    (1.4e-5 in bfloat16, unsharded).
    """
    ref = worlds["reference"]
    half, full = ref["bert/bfloat16/0.5"], ref["bert/float32/0.5"]
    assert half["adaptive"]["dtype"] == "torch.bfloat16"
    resolved = [m for m in half if not m.endswith("blocks")]
    for m in resolved:
        assert _rel(half[m]["value"], full[m]["value"]) <= 0.02, m
    for world, ranks in worlds["worlds"].items():
        for rank, out in ranks.items():
            for m in resolved:
                got = out["bert/bfloat16/0.5"]["values"][m]
                assert _rel(got["value"], full[m]["value"]) <= 0.02, (world, rank, m)


def test_geodesic_sharpness_is_invariant_on_the_sharded_model(worlds):
    """A random group element applied to the BERT: the geodesic values do not move, sharded."""
    ref = worlds["reference"]
    base = ref["bert/float64/0.05"]
    for world, ranks in worlds["worlds"].items():
        for rank, out in ranks.items():
            twin = out["bert-twin/float64/0.05"]["values"]
            for m in ("geodesic-inv", "geodesic-mix"):
                assert _rel(twin[m]["value"], base[m]["value"]) <= 1e-9, (world, rank, m)
            assert _rel(twin["adaptive"]["value"], base["adaptive"]["value"]) > 1e-3


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_exact_geodesic_equals_the_unsharded_one(worlds, world):
    """The exact (RK4) geodesic: every stage's contractions summed over the ranks.

    float64 (measured 2026-12-04 before this test: at most 6e-14 relative at worlds 2 and 4).
    """
    want = worlds["exact"]
    assert {k for k, v in want.items() if v} == {
        "bert/float64/0.05",
        "bert-default/float64/0.05",
        "llama-gqa/float64/0.05",
        "llama-gqa-lora/float64/0.05",
    }
    for key, m, g, w in _pairs(worlds, world, "exact"):
        assert g["sharded"]["base_point"] == "in place outside the blocks"
        assert w["value"] > 0 and math.isfinite(w["value"])
        _assert_equal(g, w, (world, key, m))
        # the RK4 guard's relative speed: the same on every rank as unsharded
        assert w["kappa"] > 0 and _rel(g["kappa"], w["kappa"]) <= 1e-9, (world, key, m)


#: where the options' base point lives (at ρ = 0.05)
OPTION_BASE = {
    "geodesic-mix-low-memory": "in place (blocks gathered)",
    "geodesic-inv-uncorrected-norm": "in place outside the blocks",
}


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_geodesic_options_equal_the_unsharded_ones(worlds, world):
    """``low_memory`` (the blocks' products in float64 off a point read from the shards: the
    geometry's held copy is not kept) and the ablation without the corrected norm (θ′ written
    over the shards), float64, within 1e-10 (measured 2026-12-04 at world 1 in float32: both
    bit-identical to one process on the BERT and the LoRA Llama)."""
    want = worlds["options"]
    assert {k for k, v in want.items() if v} == {
        "bert/float64/0.05",
        "llama-gqa-lora/float64/0.05",
    }
    for key, m, g, w in _pairs(worlds, world, "options"):
        assert g["sharded"]["base_point"] == OPTION_BASE[m], (world, key, m)
        assert w["value"] > 0 and math.isfinite(w["value"])
        _assert_equal(g, w, (world, key, m))


def _pairs(worlds: dict, world: str, part: str):
    """``(case, measure, sharded, unsharded)`` of ``part`` on every rank of ``world``.

    Every rank measured every case it was given, and its shards came back bit-identical.
    """
    want = worlds[part]
    for rank, out in worlds["worlds"][world].items():
        assert isinstance(out, dict), f"rank {rank} failed:\n{out}"
        for key, by_measure in want.items():
            if key not in out:  # measured unsharded only
                continue
            got = out[key][part]
            assert set(got) == set(by_measure), (world, rank, key)
            assert out[key]["shards_identical"], (world, rank, key)  # after every call
            for m, w in by_measure.items():
                yield key, m, got[m], w


def _assert_equal(g: dict, w: dict, where: tuple) -> None:
    """The value and every batch's clean and perturbed loss within 1e-10 (float64)."""
    assert _rel(g["value"], w["value"]) <= 1e-10, where
    for part in ("clean", "perturbed"):
        for a, b in zip(g[part], w[part], strict=True):
            assert _rel(a, b) <= 1e-10, (*where, part)


@pytest.mark.parametrize("world", ["1", "2", "4"])
def test_sharded_curvature_equals_the_unsharded_one(worlds, world):
    """``gs.curvature`` on the sharded model: Hessian-vector products by double backward through
    FSDP (every layer kept gathered), the endpoint's derivatives on the rank's shards.

    float64 within 1e-10 relative (measured 2026-12-07 before this test, 4 Lanczos iterations
    and 2 probes on one batch: bit-identical at world 1, at most 8.7e-14 at worlds 2 and 4, the
    BERT's geodesic λ_max; the padded BERT and the LoRA Llama alike at world 2).
    """
    want = worlds["curvature"]
    assert {k: tuple(v) for k, v in want.items() if v} == {
        "bert/float64/0.05": ("adaptive", "euclidean", "geodesic-inv", "geodesic-mix"),
        "bert-default/float64/0.05": ("geodesic-inv",),
        "llama-gqa-lora/float64/0.05": ("geodesic-inv",),
    }
    for key, m, g, w in _pairs(worlds, world, "curvature"):
        where = (world, key, m)
        assert w["sharded"] is None and w["shards_identical"] is None
        assert g["shards_identical"], where  # after this very call
        rank_out = [o for o in worlds["worlds"][world].values()]
        assert all(o[key]["fsdp_settings_kept"] for o in rank_out), where  # FSDP's own again
        assert g["sharded"]["world"] == int(world), where
        assert g["n_params"] == w["n_params"], where  # the whole model's
        assert g["n_hvp"] == w["n_hvp"] and g["lanczos_iters"] == w["lanczos_iters"], where
        assert set(g["values"]) == {"lambda_max", "lambda_min", "trace"}, where
        assert w["values"]["lambda_max"] > w["values"]["lambda_min"], where
        for q, v in w["values"].items():
            assert _rel(g["values"][q], v) <= 1e-10, (*where, q)
        pairs = [
            (g["eigenvalues"][0], w["eigenvalues"][0]),
            (g["grad_norms"], w["grad_norms"]),
            (g["clean"], w["clean"]),
        ]
        for got, exp in pairs:
            for a, b in zip(got, exp, strict=True):
                assert _rel(a, b) <= 1e-10, where
