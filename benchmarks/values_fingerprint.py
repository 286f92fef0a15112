"""Every number a refactor must keep: exact values of the public estimators on small models.

A redesign that claims "every number unchanged" runs this before and after and compares the two
JSON files bit for bit (``float.hex``): ``gs.sharpness`` for every measure (worst and average
case, restarts, random starts, low memory, ℓ∞), ``gs.curvature``, ``gs.relative_flatness``,
``ascent_diagnostics`` and ``gs.measure``, on a tiny ViT (float32 and float64), a rotary Llama
and a LoRA (PEFT) fine-tune, each built from a seed in seconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/values_fingerprint.py --out before.json
    ... change the code ...
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/values_fingerprint.py --out after.json \
        --compare before.json        # exit 1 and list every value that moved
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import geosharp as gs
from geosharp.estimators.cache import clear_cache


def _ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits, target)


def _vit(dtype: torch.dtype) -> tuple[nn.Module, list]:
    from geosharp.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=8, patch_size=4, num_classes=3, dim=16, depth=2, num_heads=2
    ).to(dtype)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(6, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 3, (6,), generator=g))
        for _ in range(2)
    ]
    return model, batches


def _llama() -> tuple[nn.Module, list]:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = LlamaForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            {"input_ids": torch.randint(1, 64, (4, 7), generator=g)},
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(2)
    ]
    return model, batches


def _lora() -> tuple[nn.Module, list]:
    from peft import LoraConfig, get_peft_model

    model, batches = _llama()
    torch.manual_seed(2)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    return peft_model, batches


def _hex(x: Any) -> Any:
    if isinstance(x, float):
        return float.hex(x) if math.isfinite(x) else str(x)
    if isinstance(x, torch.Tensor):
        return [_hex(float(v)) for v in x.detach().double().flatten()]
    if isinstance(x, dict):
        return {str(k): _hex(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_hex(v) for v in x]
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    return x


def _sharp(res: Any) -> dict[str, Any]:
    return _hex(
        {
            "value": res.value,
            "per_batch": res.per_batch,
            "clean": res.clean_losses,
            "perturbed": res.perturbed_losses,
            "traces": res.traces,
            "passes": [res.n_forward, res.n_backward],
        }
    )


def cases() -> dict[str, Callable[[], Any]]:
    S = gs.sharpness
    out: dict[str, Callable[[], Any]] = {}
    for dtype_name, dtype in (("f32", torch.float32), ("f64", torch.float64)):

        def vit(dtype=dtype):
            return _vit(dtype)

        for label, kw in {
            "geo-inv-o2": dict(measure="geodesic", metric="inv", order=2),
            "geo-mix-o2": dict(measure="geodesic", metric="mix", order=2),
            "geo-inv-o1": dict(measure="geodesic", metric="inv", order=1),
            "geo-inv-exact": dict(measure="geodesic", metric="inv", order="exact", exact_steps=4),
            "adaptive-l2": dict(measure="adaptive"),
            "adaptive-linf": dict(measure="adaptive", norm="linf"),
            "euclidean": dict(measure="euclidean"),
            "geo-inv-avg": dict(measure="geodesic", metric="inv", kind="average", samples=4),
            "geo-mix-avg": dict(measure="geodesic", metric="mix", kind="average", samples=4),
            "adaptive-avg": dict(measure="adaptive", kind="average", samples=4),
            "geo-inv-restarts": dict(measure="geodesic", restarts=2, random_init=True),
            "geo-mix-lowmem": dict(measure="geodesic", metric="mix", low_memory=True),
            "geo-inv-keep": dict(measure="geodesic", key_bias="keep"),
        }.items():

            def run(vit=vit, kw=kw):
                m, b = vit()
                return _sharp(S(m, _ce, b, rho=0.05, steps=6, progress=False, **kw))

            out[f"vit-{dtype_name}/{label}"] = run

    def curv(measure: str, metric: str = "inv"):
        def run():
            m, b = _vit(torch.float64)
            r = gs.curvature(
                m, _ce, b, measure=measure, metric=metric, iters=8, probes=4, progress=False
            )
            return _hex({k: getattr(r, k) for k in ("lambda_max", "trace") if hasattr(r, k)})

        return run

    out["vit-f64/curvature-geo-inv"] = curv("geodesic")
    out["vit-f64/curvature-geo-mix"] = curv("geodesic", "mix")
    out["vit-f64/curvature-adaptive"] = curv("adaptive")

    def relflat():
        m, b = _vit(torch.float64)
        r = gs.relative_flatness(m, _ce, b)
        return _hex(getattr(r, "value", r))

    out["vit-f64/relative-flatness"] = relflat

    def diag():
        from geosharp.estimators.diagnostics import ascent_diagnostics

        m, b = _vit(torch.float64)
        r = ascent_diagnostics(m, _ce, b, rho=0.05, steps=4)
        d = r if isinstance(r, dict) else getattr(r, "__dict__", {"r": repr(r)})
        return _hex(
            {k: v for k, v in d.items() if isinstance(v, (float, int, list, dict, torch.Tensor))}
        )

    out["vit-f64/ascent-diagnostics"] = diag

    def measure_all():
        m, b = _vit(torch.float32)
        r = gs.measure(
            m,
            b,
            _ce,
            measures=[
                "adaptive",
                "geodesic-inv",
                "geodesic-mix",
                "curvature-geodesic-inv-lambda_max",
            ],
            rhos=[0.01, 0.05],
            steps=4,
            iters=5,
            probes=3,
            progress=False,
            log=lambda s: None,
        )
        keep = ("measure", "rho", "value", "per_batch", "traces", "n_forward", "n_backward")
        return _hex([{k: getattr(row, k, None) for k in keep} for row in r.rows])

    out["vit-f32/gs.measure"] = measure_all

    for label, kw in {
        "geo-inv": dict(measure="geodesic"),
        "geo-mix": dict(measure="geodesic", metric="mix"),
        "adaptive": dict(measure="adaptive"),
        "geo-inv-avg": dict(measure="geodesic", kind="average", samples=3),
    }.items():

        def llama(kw=kw):
            m, b = _llama()
            return _sharp(S(m, _ce, b, rho=0.05, steps=5, progress=False, **kw))

        def lora(kw=kw):
            m, b = _lora()
            return _sharp(S(m, _ce, b, rho=0.05, steps=5, progress=False, **kw))

        out[f"llama/{label}"] = llama
        out[f"lora/{label}"] = lora
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None, help="an earlier --out: exit 1 if a value moved")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this text")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from geosharp.models.hf import quiet_transformers

    result: dict[str, Any] = {}
    with quiet_transformers():
        for name, fn in cases().items():
            if args.only and args.only not in name:
                continue
            clear_cache()
            t = time.perf_counter()
            try:
                result[name] = fn()
            except Exception as e:  # a case that fails is a value that moved
                result[name] = f"error: {type(e).__name__}: {e}"
            print(f"{name:32s} {time.perf_counter() - t:6.2f} s", file=sys.stderr)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        moved = [k for k in result if k in before and before[k] != result[k]]
        missing = [k for k in before if k not in result and not args.only]
        for k in moved:
            print(
                f"MOVED {k}:\n  before {json.dumps(before[k])[:300]}\n  after  "
                f"{json.dumps(result[k])[:300]}"
            )
        for k in missing:
            print(f"MISSING {k}")
        print(f"{len(result) - len(moved)}/{len(result)} cases bit-identical")
        return 1 if moved or missing else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
