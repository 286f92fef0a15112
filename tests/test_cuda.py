"""The CUDA paths: every measure on a GPU against the same model on the CPU.

Skipped without CUDA. ``GEOSHARP_TEST_GPU=cpu`` runs the file with the "GPU" replaced by the
CPU (``DEV = cpu``): a dry run of every test on a machine without one (the cross-device
comparisons are then between two CPU runs).

- ``gs.sharpness`` of a tiny float64 BERT (eager attention: its softmax stays in float64) on
  ``DEV`` against the CPU: adaptive ℓ2, geodesic inv and mix (order 2) and the exact geodesic
  (RK4) worst cases within 1e-9 (relative), the parameters bit-identical after every call; the
  average case reproducible on ``DEV`` but not the CPU's numbers (its noise is drawn on ``DEV``);
- ``gs.curvature`` (λ_max) on ``DEV`` against the CPU, float64, within 1e-8;
- bfloat16 on ``DEV`` against float32 on ``DEV`` (the same weights): within the 2 % of
  ``tests/estimators/test_fsdp.py`` at its radius, ρ = 0.5 (``fsdp_worlds.CASES``);
- a model split across ``DEV`` and the CPU by accelerate's ``dispatch_model`` (a BERT and a
  rotary Llama, ``main_device="cpu"``): its values equal the undispatched model's, every
  parameter stays on its device, bit-identical; λ_max too. A model *offloaded* by accelerate
  (its CPU modules' parameters meta tensors) is refused in one line (estimators/materialized.py);
- ``geosharp measure --device cuda`` against ``--device cpu`` (float64).
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import os

import pytest
import torch

import geosharp as gs

from .estimators import fsdp_worlds
from .measure.conftest import CORPUS, make_tokenizer, save_tiny_classifier

transformers = pytest.importorskip("transformers")

DRY = os.environ.get("GEOSHARP_TEST_GPU", "") == "cpu"
#: the device under test: the GPU, or the CPU in the dry run
DEV = torch.device("cpu") if DRY else torch.device("cuda", 0)
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not DRY and not torch.cuda.is_available(),
    reason="CUDA is not available (GEOSHARP_TEST_GPU=cpu: a dry run with the CPU as the GPU)",
)

STEPS = fsdp_worlds.STEPS  # 5 Auto-PGD steps
ce = fsdp_worlds.ce  # cross-entropy of the logits, in float32 for a bfloat16 model


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def _bert(dtype: torch.dtype, device: torch.device, attn: str = "eager") -> torch.nn.Module:
    """fsdp_worlds' tiny BERT (hidden 32, 2 layers of 4 heads, 3 labels), seeded, on ``device``.

    Eager attention by default: its softmax runs in the model's dtype (float64 here) and has
    second derivatives on every device (SDPA's fused CUDA kernels have none).
    """
    return fsdp_worlds.build("bert", dtype, attn=attn).to(device)


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    """fsdp_worlds' 2-layer Llama classifier with grouped-query attention, on the CPU.

    SDPA attention: HF's eager Llama softmax runs in float32 even in a float64 model. Its
    RMSNorm and rotary cos/sin do too, whatever the attention (see :data:`SPLIT_TOL`).
    """
    return fsdp_worlds.build("llama-gqa", dtype, attn="sdpa")


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Every parameter on the device it was on, bit-identical."""
    now = dict(model.named_parameters())
    assert now.keys() == before.keys()
    for n, p in now.items():
        assert p.device == before[n].device, n
        assert torch.equal(p.detach(), before[n]), n


def _on(result_device: str, device: torch.device) -> bool:
    return torch.device(result_device).type == device.type


# -- 1. gs.sharpness on DEV against the CPU, float64 ----------------------------------------------
WORST = {
    "adaptive-l2": dict(measure="adaptive"),
    "geodesic-inv-o2": dict(measure="geodesic", metric="inv"),
    "geodesic-mix-o2": dict(measure="geodesic", metric="mix"),
    "geodesic-inv-exact": dict(measure="geodesic", metric="inv", order="exact", exact_steps=4),
}


@pytest.mark.parametrize("name", sorted(WORST))
def test_worst_case_on_the_device_equals_the_cpu(name):
    kw = dict(rho=0.05, steps=STEPS, progress=False, cache=False) | WORST[name]
    want = gs.sharpness(_bert(torch.float64, CPU), ce, fsdp_worlds.batches(), **kw)
    model = _bert(torch.float64, DEV)
    before = _snapshot(model)
    got = gs.sharpness(model, ce, fsdp_worlds.batches(), **kw)
    _assert_untouched(model, before)
    assert _on(got.settings["device"], DEV) and got.settings["dtype"] == "torch.float64"
    assert got.value > 0 and math.isfinite(got.value)
    assert _rel(got.value, want.value) <= 1e-9, (got.value, want.value)
    for g, w in zip(got.per_batch, want.per_batch, strict=True):
        assert _rel(g, w) <= 1e-9
    for g, w in zip(got.clean_losses, want.clean_losses, strict=True):
        assert _rel(g, w) <= 1e-12


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_average_case_noise_is_drawn_on_the_device(measure):
    """The average case on DEV: finite, reproducible, and its noise drawn on DEV.

    ``geosharp.estimators.harness.objectives`` seeds every batch's generator with
    ``torch.Generator(device=device)`` on the parameters' device, and
    ``Perturbation.random`` draws each piece's noise there (``geometry.draws.generator_for``).
    Only a sharded model draws on the CPU (``estimators/sharded/draws.py``, which also maps a
    CUDA generator to a CPU one). So with the same seed the GPU's value is not the CPU's (CUDA's
    Philox stream is another stream); in the dry run (DEV is the CPU) they are equal.
    """
    kw = dict(measure=measure, kind="average", rho=0.05, samples=3, seed=7, progress=False)
    cpu = gs.sharpness(_bert(torch.float64, CPU), ce, fsdp_worlds.batches(), **kw)
    model = _bert(torch.float64, DEV)
    before = _snapshot(model)
    got = gs.sharpness(model, ce, fsdp_worlds.batches(), **kw)
    again = gs.sharpness(model, ce, fsdp_worlds.batches(), **kw)
    _assert_untouched(model, before)
    assert math.isfinite(got.value) and got.value != 0
    assert _rel(again.value, got.value) <= 1e-12  # the same seed: the same noise on DEV
    for g, w in zip(got.clean_losses, cpu.clean_losses, strict=True):
        assert _rel(g, w) <= 1e-12  # the same model: only the noise differs
    if DEV.type == "cpu":
        assert got.value == cpu.value
    else:
        assert _rel(got.value, cpu.value) > 1e-9, (got.value, cpu.value)


# -- 2. gs.curvature on DEV against the CPU -------------------------------------------------------
CURV = dict(quantities=("lambda_max",), iters=80, tol=1e-7, progress=False)


@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_curvature_on_the_device_equals_the_cpu(measure):
    """λ_max within 1e-8: its Lanczos start is drawn on DEV (another start than the CPU's).

    A converged Lanczos run (``lanczos_iters`` below ``iters``) does not depend on its start
    to 1e-8: the CPU's value with another seed (another start) is checked to agree as well.
    """
    batches = fsdp_worlds.batches()[:1]
    want = gs.curvature(_bert(torch.float64, CPU), ce, batches, measure=measure, **CURV)
    other = gs.curvature(_bert(torch.float64, CPU), ce, batches, measure=measure, seed=5, **CURV)
    model = _bert(torch.float64, DEV)
    before = _snapshot(model)
    got = gs.curvature(model, ce, batches, measure=measure, **CURV)
    _assert_untouched(model, before)
    assert _on(got.settings["device"], DEV) and got.settings["dtype"] == "torch.float64"
    for r in (want, other, got):
        assert all(i < CURV["iters"] for i in r.lanczos_iters), r.lanczos_iters  # converged
    lam = got.values["lambda_max"]
    assert lam > 0 and math.isfinite(lam)
    assert _rel(other.values["lambda_max"], want.values["lambda_max"]) <= 1e-8
    assert _rel(lam, want.values["lambda_max"]) <= 1e-8, (lam, want.values["lambda_max"])


# -- 3. bfloat16 on DEV ---------------------------------------------------------------------------
BF16_RHO = next(rho for name, dt, rho in fsdp_worlds.CASES if dt == "bfloat16")  # 0.5


@pytest.mark.parametrize(
    "name", ["adaptive-l2", "geodesic-mix-o2"], ids=["adaptive", "geodesic-mix"]
)
def test_bfloat16_on_the_device_is_within_two_percent_of_float32(name):
    """The same weights in bfloat16 and float32 on DEV, the loss in float32, ρ = 0.5.

    2 %: the tolerance of ``test_fsdp.py`` (measured there on the CPU: 0.04–1.13 %);
    ``settings["dtype"]`` reports the precision used.
    """
    kw = dict(rho=BF16_RHO, steps=STEPS, progress=False) | WORST[name]
    reference = fsdp_worlds.build("bert", torch.float32).to(DEV)
    full = gs.sharpness(reference, ce, fsdp_worlds.batches(), **kw)
    model = fsdp_worlds.build("bert", torch.bfloat16).to(DEV)
    before = _snapshot(model)
    half = gs.sharpness(model, ce, fsdp_worlds.batches(), **kw)
    _assert_untouched(model, before)
    assert full.settings["dtype"] == "torch.float32"
    assert half.settings["dtype"] == "torch.bfloat16" and _on(half.settings["device"], DEV)
    assert full.value > 0 and math.isfinite(half.value)
    assert _rel(half.value, full.value) <= 0.02, (half.value, full.value)


# -- 4. a model split across two devices ----------------------------------------------------------
def _dispatch(model: torch.nn.Module, device_map: dict, **kw) -> torch.nn.Module:
    """accelerate's dispatch_model, its device hooks attached even when every device is the CPU.

    ``main_device="cpu"``: with a GPU as the main device (accelerate's default, the first
    device that is not the CPU), the modules mapped to ``"cpu"`` are *offloaded*: their
    parameters are replaced by meta tensors and copied to the GPU at every forward (see
    :func:`test_a_model_offloaded_by_accelerate_is_refused_in_one_line`). With the CPU as the
    main device they stay on the CPU and run there: layer 0 on the GPU, layer 1 on the CPU.
    """
    accelerate = pytest.importorskip("accelerate")
    if "force_hooks" in inspect.signature(accelerate.dispatch_model).parameters:
        kw["force_hooks"] = True  # the dry run (one device) runs through the hooks too
    return accelerate.dispatch_model(model, device_map=device_map, **kw)


SPLITS = {  # model → (builder, device map: the embeddings and layer 0 on DEV, the rest on the CPU)
    "bert": (
        lambda: _bert(torch.float64, CPU),
        {
            "bert.embeddings": DEV,
            "bert.encoder.layer.0": DEV,
            "bert.encoder.layer.1": CPU,
            "bert.pooler": CPU,
            "classifier": CPU,
        },
    ),
    "llama": (
        lambda: _llama(torch.float64),
        {
            "model.embed_tokens": DEV,
            "model.rotary_emb": DEV,
            "model.layers.0": DEV,
            "model.layers.1": CPU,
            "model.norm": CPU,
            "score": CPU,
        },
    ),
}


def ce_any_device(out, y):
    """Cross-entropy with the targets moved to the logits' device (the last piece's)."""
    return torch.nn.functional.cross_entropy(out.logits, y.to(out.logits.device))


def _split(which: str) -> tuple[torch.nn.Module, dict[str, torch.device]]:
    build, device_map = SPLITS[which]
    model = _dispatch(build(), {k: str(v) for k, v in device_map.items()}, main_device="cpu")
    where = {}
    for n, p in model.named_parameters():
        prefix = next(k for k in device_map if n.startswith(k + "."))
        where[n] = device_map[prefix]
        assert p.device.type == device_map[prefix].type, n
    return model, where


SPLIT_MEASURES = {
    "adaptive-l2": dict(measure="adaptive"),
    "geodesic-inv-o2": dict(measure="geodesic", metric="inv"),
    "geodesic-mix-o2": dict(measure="geodesic", metric="mix"),
}


#: model → (value tolerance in units of the clean loss, clean-loss tolerance, relative). HF's
#: Llama takes its RMSNorm and its rotary cos/sin in float32 even in a float64 model, so its
#: losses on the GPU and on the CPU differ by float32 rounding: measured on the H200
#: (2026-12-04), clean losses 6e-10 apart (relative), adaptive-l2 7.9e-10 apart (3.8e-7 of its
#: value, 7e-10 of the clean loss). The BERT computes everything in float64.
SPLIT_TOL = {"bert": (1e-12, 1e-12), "llama": (1e-7, 1e-7)}


@pytest.mark.parametrize("which", sorted(SPLITS))
def test_a_model_split_across_devices_measures_as_the_undispatched_one(which):
    build = SPLITS[which][0]
    value_tol, loss_tol = SPLIT_TOL[which]
    model, where = _split(which)
    devices = {d.type for d in where.values()}
    assert devices == {DEV.type, "cpu"}
    before = _snapshot(model)
    for name, m in SPLIT_MEASURES.items():
        kw = dict(rho=0.05, steps=STEPS, progress=False, cache=False) | m
        want = gs.sharpness(build(), ce_any_device, fsdp_worlds.batches(), **kw)
        got = gs.sharpness(model, ce_any_device, fsdp_worlds.batches(), **kw)
        _assert_untouched(model, before)
        assert got.value > 0 and math.isfinite(got.value), name
        scale = want.clean_losses[0]
        assert abs(got.value - want.value) <= value_tol * scale, (name, got.value, want.value)
        for g, w in zip(got.clean_losses, want.clean_losses, strict=True):
            assert _rel(g, w) <= loss_tol, name


def test_curvature_of_a_model_split_across_devices():
    """λ_max of the split BERT (Lanczos vectors per device) equals the undispatched model's."""
    model, _ = _split("bert")
    before = _snapshot(model)
    batches = fsdp_worlds.batches()[:1]
    kw = dict(measure="geodesic", **CURV)
    want = gs.curvature(SPLITS["bert"][0](), ce_any_device, batches, **kw)
    got = gs.curvature(model, ce_any_device, batches, **kw)
    _assert_untouched(model, before)
    for r in (want, got):
        assert all(i < CURV["iters"] for i in r.lanczos_iters), r.lanczos_iters
    lam, ref = got.values["lambda_max"], want.values["lambda_max"]
    assert lam > 0 and _rel(lam, ref) <= 1e-8, (lam, ref)


def test_a_model_offloaded_by_accelerate_is_refused_in_one_line(tmp_path):
    """accelerate's CPU offload (GPU main device, ``"cpu"`` in the map; disk in the dry run).

    The offloaded modules' parameters are meta tensors (their weights are copied to the main
    device at every forward): geosharp cannot read or perturb them, and should say so.
    """
    build, device_map = SPLITS["bert"]
    away = "disk" if DEV.type == "cpu" else "cpu"
    moved = ("bert.encoder.layer.1", "bert.pooler", "classifier")  # the CPU part of the split
    device_map = {k: away if k in moved else str(v) for k, v in device_map.items()}
    model = _dispatch(build(), device_map, offload_dir=str(tmp_path))
    assert any(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ValueError, match=r"^gs\.sharpness: .* is on the meta device \(no values"):
        gs.sharpness(model, ce_any_device, fsdp_worlds.batches(), rho=0.05, steps=2, progress=False)


# -- 5. the CLI -----------------------------------------------------------------------------------
def test_cli_measure_on_the_device_equals_the_cpu(tmp_path, capsys):
    from geosharp.cli import main

    tok = make_tokenizer()
    folder = tmp_path / "bert"
    save_tiny_classifier(folder, tok, seed=0)
    tok.save_pretrained(folder)
    data = tmp_path / "data.csv"
    with data.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i, text in enumerate((CORPUS * 2)[:8]):
            w.writerow([text, i % 2])
    args = [
        "measure", folder, data, "--measures", "adaptive-l2", "geodesic-inv-o2",
        "geodesic-mix-o2", "--rho", "0.1", "--steps", "4", "--batch-size", "4",
        "--max-length", "16", "--dtype", "float64", "--no-progress",
    ]  # fmt: skip
    res = {}
    for name, device in (("cpu", "cpu"), ("dev", str(DEV))):
        code = main([*map(str, args), "--device", device, "--out", str(tmp_path / name)])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "Traceback" not in out + err
        assert "invariance check PASSED" in out
        res[name] = json.loads((tmp_path / name / "results.json").read_text())
    cpu, dev = res["cpu"], res["dev"]
    assert _on(dev["settings"]["device"], DEV) and _on(cpu["settings"]["device"], CPU)
    assert dev["settings"]["dtype"] == cpu["settings"]["dtype"] == "float64"
    assert [(r["measure"], r["rho"]) for r in dev["results"]] == [
        (r["measure"], r["rho"]) for r in cpu["results"]
    ]
    assert len(dev["results"]) == 3
    for g, w in zip(dev["clean_losses"], cpu["clean_losses"], strict=True):
        assert _rel(g, w) <= 1e-12
    for g, w in zip(dev["results"], cpu["results"], strict=True):
        assert g["error"] is None and g["value"] > 0, g["measure"]
        assert _rel(g["value"], w["value"]) <= 1e-9, (g["measure"], g["value"], w["value"])
