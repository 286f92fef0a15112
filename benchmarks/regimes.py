"""Cost regimes of ``gs.sharpness``: per-step time, set-up time and peak memory of each measure.

For every configuration (a model and its batches, selected by name) and every measure
(adaptive ℓ2 worst case, geodesic inv and mix at order 2 worst case, geodesic inv average case)
this reports, relative to one *plain* forward+backward of the same model over the same batches
(``torch.autograd.grad`` of the loss w.r.t. the trainable parameters, eval mode):

(a) **step ratio** — the time of one ascent step (worst case: one Auto-PGD iteration; average
    case: one noise sample) ``(T(N₂) − T(N₁)) / (N₂ − N₁)`` over all batches, divided by the
    plain forward+backward measured right before it; the measures and the plain reference are
    interleaved in one process, repetition after repetition (the order of the measures rotates),
    and the median over repetitions is reported;
(b) **set-up** — ``T(N₁) − N₁·step``: what a call costs besides its steps (symmetry finding,
    θ₀, the base-point factorizations of ``Perturbation``, the clean loss, one extra forward),
    in plain steps, for the first call of each measure in the process and for repeated calls on
    the same weights; plus a breakdown timed by wrapping the functions ``gs.sharpness`` calls;
(c) **memory** — the peak above a plain forward+backward, in parameter-sized buffers
    ``P · itemsize`` (``P``: the perturbed, i.e. trainable, parameters): on CPU one fresh
    subprocess per (configuration, measure, dtype), peak RSS after a baseline of two plain
    steps and after one ``gs.sharpness`` call (``VmHWM``, reset once the model is built, so
    that loading transients do not hide the plain peak; ``ru_maxrss`` kept alongside); on
    CUDA ``max_memory_allocated`` with ``reset_peak_memory_stats`` in the timing process.

See ``benchmarks/PROTOCOL.md`` for the exact commands, the meaning of every JSON field and the
list of parameter-sized buffers a worst-case geodesic measure holds.

Run: ``python benchmarks/regimes.py --configs minilm-small,vit-tiny --repeats 3 --json out.json``
(``--list`` shows the configurations).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import geosharp as gs
from geosharp.estimators.cache import clear_cache

SCHEMA = "geosharp-regimes/1"
CHILD_TAG = "REGIMES-CHILD "
#: Where ``gs.sharpness`` looks up the names the probe wraps (modules, not functions).
_H = importlib.import_module("geosharp.estimators.harness")
_W = importlib.import_module("geosharp.estimators.worst")

#: The measures: name → keyword arguments of ``gs.sharpness`` (without steps/samples). The radii
#: are the centres of Study 3's grids (MiniLM-L6); the cost does not depend on ρ.
MEASURES: dict[str, dict[str, Any]] = {
    "adaptive-l2": dict(measure="adaptive", kind="worst", rho=0.316),
    "geodesic-inv-o2": dict(measure="geodesic", metric="inv", order=2, kind="worst", rho=0.0316),
    "geodesic-mix-o2": dict(measure="geodesic", metric="mix", order=2, kind="worst", rho=0.0316),
    "geodesic-inv-o2-average": dict(
        measure="geodesic", metric="inv", order=2, kind="average", rho=0.01
    ),
    # opt-in: no best-iterate direction kept, recomputed at restarts (``low_memory=True``)
    "adaptive-l2-lowmem": dict(measure="adaptive", kind="worst", rho=0.316, low_memory=True),
    "geodesic-inv-o2-lowmem": dict(
        measure="geodesic", metric="inv", order=2, kind="worst", rho=0.0316, low_memory=True
    ),
}

#: Measured unless ``--measures`` says otherwise (the ``-lowmem`` variants are opt-in).
DEFAULT_MEASURES = tuple(m for m in MEASURES if not m.endswith("-lowmem"))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# -- configurations ------------------------------------------------------------------------------
@dataclass
class Case:
    """A model, its batches and its loss."""

    title: str
    model: nn.Module
    batches: list[tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    #: ``find_symmetries(key_bias=…)`` of the set-up this case copies (None: the library's).
    key_bias: str | None = None


def _logits_ce(out: Any, target: Tensor) -> Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.float(), target)


def _tiny(device: torch.device) -> Case:
    from geosharp.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=8, patch_size=4, num_classes=3, dim=16, depth=1, num_heads=2
    )
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(2)
    ]
    return Case("tiny ViT (d=16, 2 heads, 1 layer), 2 batches of 4", model, batches, _logits_ce)


def _vit_tiny(device: torch.device) -> Case:
    from ascent_step import vit_case

    title, model, x, y, _ = vit_case()
    return Case(title + " (benchmarks/ascent_step.py)", model, [(x, y)], _logits_ce)


def _minilm_small(device: torch.device) -> Case:
    from geosharp.studies.minilm_text import MiniLMTextConfig, MiniLMTextStudy

    study = MiniLMTextStudy(MiniLMTextConfig())
    torch.manual_seed(0)
    model = study.build()  # fresh 2-way head, embeddings frozen (not perturbed)
    batches = study.batches()
    shapes = ", ".join("×".join(map(str, b[0]["input_ids"].shape)) for b in batches)
    title = (
        f"MiniLM-L6, Study 3 set-up: {len(batches)} batches ({shapes} tokens) of Rotten "
        "Tomatoes snippets, embeddings frozen"
    )
    return Case(title, model, batches, _logits_ce, key_bias=study.key_bias)


def _minilm_32x64(device: torch.device) -> Case:
    from ascent_step import minilm_case

    from geosharp.models.hf import quiet_transformers

    with quiet_transformers():
        title, model, x, y, _ = minilm_case()
    return Case(title + ", all weights perturbed", model, [(x, y)], _logits_ce)


def _random_ids_case(
    device: torch.device, cls: type, cfg: Any, what: str, batch: int, seq: int, mask: bool
) -> Case:
    """A Hugging Face classifier ``cls(cfg)`` with random weights, initialised on ``device``
    (fast on GPUs), and one batch of random token ids (with an all-ones attention mask if
    ``mask``); ``what`` opens the title."""
    from geosharp.models.hf import quiet_transformers

    torch.manual_seed(0)
    with quiet_transformers(), torch.device(device):
        model = cls(cfg).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, cfg.vocab_size, (batch, seq), generator=g)
    inputs = (
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if mask else {"input_ids": ids}
    )
    y = torch.randint(0, 2, (batch,), generator=g)
    n = sum(p.numel() for p in model.parameters())
    title = f"{what}, random weights, {n / 1e6:.1f} M parameters), batch {batch} × {seq}"
    return Case(title, model, [(inputs, y)], _logits_ce)


def _bert(device: torch.device, hidden: int, layers: int, heads: int, batch: int, seq: int) -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_labels=2,
        attn_implementation="eager",
    )
    what = f"BERT from a BertConfig (hidden {hidden}, {layers} layers, {heads} heads"
    return _random_ids_case(device, BertForSequenceClassification, cfg, what, batch, seq, True)


def _llama(
    device: torch.device,
    hidden: int,
    layers: int,
    heads: int,
    kv: int,
    batch: int,
    seq: int,
    intermediate: int | None = None,
) -> Case:
    """A Llama-GQA classifier from a ``LlamaConfig`` (rotary Q/K blocks, grouped K/V heads); the
    MLP's width is ``intermediate`` (default ``2.75 · hidden``, TinyLlama's ratio)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=intermediate if intermediate is not None else int(2.75 * hidden),
        max_position_embeddings=2 * seq,
        num_labels=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    what = (
        f"Llama-GQA from a LlamaConfig (hidden {hidden}, {layers} layers, {heads} heads, {kv} "
        "key/value heads"
    )
    return _random_ids_case(device, LlamaForSequenceClassification, cfg, what, batch, seq, False)


#: name → (short description, builder). Builders get the target device (big models are
#: initialised on it); the model is then cast to the dtype and the batches moved.
CONFIGS: dict[str, tuple[str, Callable[[torch.device], Case]]] = {
    "tiny": ("a tiny ViT, 2 batches of 4 (tests)", _tiny),
    "minilm-small": (
        "MiniLM-L6, Study 3's set-up: 2 batches of 16 snippets, embeddings frozen (10.8 M)",
        _minilm_small,
    ),
    "minilm-32x64": ("MiniLM-L6, random ids, batch 32 × 64, all 22.7 M perturbed", _minilm_32x64),
    "minilm-shape-32x64": (
        "MiniLM-L6's shape with random weights (384, 6 layers, 12 heads; 22.7 M; no weight "
        "package needed), batch 32 × 64",
        lambda d: _bert(d, 384, 6, 12, 32, 64),
    ),
    "vit-tiny": ("the ViT of ascent_step.py (d=64, 4 layers), batch 128", _vit_tiny),
    "bert-41m": (
        "BERT-medium shape (512, 8 layers, 8 heads; 41.4 M), batch 8 × 32",
        lambda d: _bert(d, 512, 8, 8, 8, 32),
    ),
    "bert-335m": (
        "BERT-large shape (1024, 24 layers, 16 heads; 335 M), batch 8 × 64 (GPU)",
        lambda d: _bert(d, 1024, 24, 16, 8, 64),
    ),
    "llama-1b": (
        "TinyLlama shape (2048, 22 layers, 32 heads, 4 KV heads; 1.1 B), batch 8 × 128 (GPU)",
        lambda d: _llama(d, 2048, 22, 32, 4, 8, 128),
    ),
    "llama-7b": (
        "Llama-2-7B shape (4096, 32 layers, 32 heads, MLP 11008; 6.6 B), batch 1 × 128 (GPU, "
        "bfloat16)",
        lambda d: _llama(d, 4096, 32, 32, 32, 1, 128, intermediate=11008),
    ),
}
DEFAULT_CONFIGS = "minilm-small,minilm-32x64,vit-tiny,bert-41m"


def _move(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device, dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, dtype) for v in obj)
    return obj


def find_space(case: Case) -> Any:
    """``gs.find_symmetries`` of the case's model, with its ``key_bias``."""
    if case.key_bias is None:
        return gs.find_symmetries(case.model)
    return gs.find_symmetries(case.model, key_bias=case.key_bias)


def build(name: str, device: torch.device, dtype: torch.dtype, key_bias: str | None = None) -> Case:
    """The configuration ``name`` on ``device`` in ``dtype``, in eval mode.

    ``key_bias`` overrides the configuration's ``find_symmetries(key_bias=…)``.
    """
    case = CONFIGS[name][1](device)
    if key_bias is not None:
        case.key_bias = key_bias
    case.model.to(device=device, dtype=dtype).eval()
    case.batches = [(_move(x, device, dtype), y.to(device)) for x, y in case.batches]
    return case


def _batch_shape(x: Any) -> list[int]:
    if isinstance(x, dict):
        x = x.get("input_ids", next(iter(x.values())))
    return list(x.shape)


# -- timing ----------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(model: nn.Module, x: Any) -> Any:
    """``model(x)``: a dict as keyword arguments, a tuple as positional ones (as gs.sharpness)."""
    if isinstance(x, dict):
        return model(**x)
    return model(*x) if isinstance(x, tuple) else model(x)


def plain_step(case: Case) -> None:
    """One plain forward+backward of the loss over every batch (grads of trainable weights)."""
    trainable = [p for p in case.model.parameters() if p.requires_grad]
    for x, y in case.batches:
        loss = case.loss_fn(_forward(case.model, x), y)
        torch.autograd.grad(loss, trainable, allow_unused=True)


class Probe:
    """Times the stages of ``gs.sharpness`` by wrapping the names its module looks up.

    Stages: ``find_symmetries``, ``perturbation`` (the ``Perturbation`` constructor: base-point
    gathers and factorizations), ``clean_loss`` (the loss at ξ = 0: forward+backward in the
    worst case, forward in the average case), ``ascent`` (``autopgd``, all batches), the loss
    evaluations ``fwd_bwd`` / ``fwd`` at perturbed points (inside the ascent or sampling), and
    ``noise`` (``Perturbation.random``: the average case's samples).
    """

    #: The names wrapped, in the modules ``gs.sharpness`` looks them up in (absent ones are
    #: listed in :attr:`missing` and their stages read 0): the set-up and the objective in
    #: :mod:`geosharp.estimators.harness`, the ascent in :mod:`geosharp.estimators.worst`.
    NAMES: ClassVar[dict[str, Any]] = {
        "find_symmetries": _H,
        "Perturbation": _H,
        "Objective": _H,
        "autopgd": _W,
    }

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.missing = [k for k, m in self.NAMES.items() if not hasattr(m, k)]

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.t[name] += time.perf_counter() - t0
            self.n[name] += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probe]:
        probe = self
        names = ("find_symmetries", "Perturbation", "autopgd")
        saved = {k: getattr(self.NAMES[k], k) for k in names if hasattr(self.NAMES[k], k)}
        objective_cls = getattr(_H, "Objective", None)
        objective_call = objective_cls.__call__ if objective_cls is not None else None
        objective_clean = objective_cls.clean if objective_cls is not None else None

        def wrap(name: str, fn: Callable) -> Callable:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                with probe.stage(name):
                    return fn(*args, **kwargs)

            return wrapped

        def objective(self, xi, need_grad, check=True):
            name = "clean_loss" if not check else ("fwd_bwd" if need_grad else "fwd")
            with probe.stage(name):
                return objective_call(self, xi, need_grad, check)

        stages = {
            "find_symmetries": "find_symmetries",
            "Perturbation": "perturbation",
            "autopgd": "ascent",
        }
        for k, fn in saved.items():
            setattr(self.NAMES[k], k, wrap(stages[k], fn))
        if objective_cls is not None:
            objective_cls.__call__ = objective
            objective_cls.clean = wrap("clean_loss", objective_clean)
        pert_cls = saved.get("Perturbation")
        random_noise = getattr(pert_cls, "random", None)
        if random_noise is not None:
            pert_cls.random = wrap("noise", random_noise)
        try:
            yield self
        finally:
            for k, v in saved.items():
                setattr(self.NAMES[k], k, v)
            if objective_cls is not None:
                objective_cls.__call__ = objective_call
                objective_cls.clean = objective_clean
            if random_noise is not None:
                pert_cls.random = random_noise

    def breakdown(self, total: float) -> dict[str, float | int]:
        """The stage times of the calls since the last reset, and the rest of ``total``."""
        t = self.t
        out: dict[str, float | int] = {
            "total_s": total,
            "find_symmetries_s": t["find_symmetries"],
            "perturbation_s": t["perturbation"],
            "clean_loss_s": t["clean_loss"],
            "ascent_s": t["ascent"],
            "fwd_bwd_s": t["fwd_bwd"],
            "fwd_s": t["fwd"],
            "noise_s": t["noise"],
            "n_fwd_bwd": self.n["fwd_bwd"],
            "n_fwd": self.n["fwd"],
        }
        # Inside the ascent but not a loss evaluation: Riemannian gradients, projections, norms,
        # momentum, the endpoint's geodesic is part of fwd_bwd (it is built inside the call).
        out["ascent_geometry_s"] = t["ascent"] - t["fwd_bwd"] - (t["fwd"] if t["ascent"] else 0)
        staged = t["find_symmetries"] + t["perturbation"] + t["clean_loss"]
        loop = t["ascent"] if t["ascent"] else t["fwd"] + t["noise"]
        out["other_s"] = total - staged - loop
        return out

    def reset(self) -> None:
        self.t.clear()
        self.n.clear()


def sharpness_call(
    case: Case, measure: str, n: int, probe: Probe, eps: float, space: Any = None
) -> dict[str, Any]:
    """One ``gs.sharpness`` call with ``n`` steps (worst case) or samples (average case)."""
    kw = dict(MEASURES[measure])
    kw["samples" if kw["kind"] == "average" else "steps"] = n
    if space is not None:
        kw["space"] = space
    elif case.key_bias is not None:
        kw["key_bias"] = case.key_bias
    device = probe.device
    probe.reset()
    _sync(device)
    t0 = time.perf_counter()
    res = gs.sharpness(case.model, case.loss_fn, case.batches, progress=False, eps=eps, **kw)
    _sync(device)
    total = time.perf_counter() - t0
    out = probe.breakdown(total)
    out.update(name=res.measure, n_forward=res.n_forward, n_backward=res.n_backward, n_steps=n)
    out["value"] = res.value
    return out


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _median_breakdown(items: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in items[0].items() if isinstance(v, (int, float)) and k != "value"]
    return {k: _median([float(d[k]) for d in items]) for k in keys}


def time_config(
    case: Case,
    measures: list[str],
    n1: int,
    n2: int,
    repeats: int,
    eps: float,
    device: torch.device,
    cuda_memory: bool = False,
    reuse_space: bool = False,
    found_space: tuple[Any, list[float]] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Figures (a) and (b) of every measure, interleaved in this process.

    With ``cuda_memory`` the last repetition also gives figure (c): the peak of its ``N₂`` call
    above the peak of its plain step (``max_memory_allocated``, reset before each). With
    ``reuse_space`` the symmetries are found twice here (timed: the first and a repeated
    search) and the space is passed to every call; its time is added to the set-up figures.
    ``found_space`` — ``(space, [first search s, repeated search s])`` found by the caller —
    does the same without searching again (one search for several calls of this function).
    """
    probe = Probe(device)
    for _ in range(2):
        plain_step(case)  # warm-up (allocator, kernels, lazy init)
    space, find_s = None, [0.0, 0.0]
    if found_space is not None:
        space, find_s = found_space[0], list(found_space[1])
        reuse_space = True
    elif reuse_space:
        for i in range(2):
            t0 = time.perf_counter()
            space = find_space(case)
            find_s[i] = time.perf_counter() - t0
    call = functools.partial(sharpness_call, probe=probe, eps=eps, space=space)
    plains: list[float] = []
    figures: dict[str, dict[str, Any]] = {m: {"first": None, "reps": []} for m in measures}
    errors: dict[str, str] = {}
    memory: dict[str, dict[str, Any]] = {}
    with probe.installed():
        for m in measures:  # the first call of each measure in this process
            try:
                clear_cache()  # cold: no base-point work kept from the previous measure
                figures[m]["first"] = call(case, m, n1)
            except Exception as err:  # reported per measure; the run goes on
                errors[m] = f"{type(err).__name__}: {err}"
        for r in range(repeats):
            live = [m for m in measures if m not in errors]
            k = r % len(live) if live else 0
            for m in live[k:] + live[:k]:  # the order rotates from one repetition to the next
                last = cuda_memory and r == repeats - 1
                try:
                    if last:
                        gc.collect()
                        before = torch.cuda.memory_allocated(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    p = timed(lambda: plain_step(case), device)
                    if last:
                        peak_plain = torch.cuda.max_memory_allocated(device)
                    c1 = call(case, m, n1)
                    if last:
                        gc.collect()
                        torch.cuda.reset_peak_memory_stats(device)
                    c2 = call(case, m, n2)
                    if last:
                        peak = torch.cuda.max_memory_allocated(device)
                        memory[m] = _memory_result(
                            case, "cuda_max_memory_allocated", False, before, peak_plain, peak, c2
                        )
                except Exception as err:  # e.g. a non-finite loss: reported, the run goes on
                    errors[m] = f"{type(err).__name__}: {err}"
                    continue
                plains.append(p)
                figures[m]["reps"].append((p, c1, c2))
    plain_s = _median(plains)
    out: dict[str, dict[str, Any]] = {}
    for m in measures:
        if m in errors:
            out[m] = {"error": errors[m], "settings": MEASURES[m]}
            continue
        reps = figures[m]["reps"]
        steps = [(c2["total_s"] - c1["total_s"]) / (n2 - n1) for _, c1, c2 in reps]
        first = figures[m]["first"]
        if reuse_space:  # the search the calls skipped, added as if each call had made it
            first = dict(first, find_symmetries_s=find_s[0], total_s=first["total_s"] + find_s[0])
            reps = [
                (p, dict(c1, find_symmetries_s=find_s[1], total_s=c1["total_s"] + find_s[1]), c2)
                for p, c1, c2 in reps
            ]
        ratios = [s / p for s, (p, _, _) in zip(steps, reps, strict=True)]
        setups = [c1["total_s"] - n1 * s for s, (_, c1, _) in zip(steps, reps, strict=True)]
        setup_ratios = [u / p for u, (p, _, _) in zip(setups, reps, strict=True)]
        step_s = _median(steps)
        first_setup = first["total_s"] - n1 * step_s if step_s is not None else None
        out[m] = {
            "name": first["name"],
            "settings": MEASURES[m],
            "step": {
                "per_step_s": step_s,
                "ratio": _median(ratios),
                "ratio_per_rep": ratios,
                "per_step_s_per_rep": steps,
                "plain_s_per_rep": [p for p, _, _ in reps],
            },
            "setup": {
                "first_call_s": first["total_s"],
                "first_s": first_setup,
                "first_ratio": (first_setup / plain_s) if first_setup is not None else None,
                "repeat_s": _median(setups),
                "repeat_ratio": _median(setup_ratios),
                "repeat_ratio_per_rep": setup_ratios,
                "first_breakdown": {k: v for k, v in first.items() if k != "name"},
                "repeat_breakdown": _median_breakdown([c1 for _, c1, _ in reps]),
                "find_symmetries_separate": reuse_space,
            },
        }
        if m in memory:
            out[m]["memory"] = memory[m]
    plain = {"fwd_bwd_s": plain_s, "samples_s": plains}
    return plain, out


# -- memory ----------------------------------------------------------------------------------
def _maxrss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else 1024 * kb


def _status_bytes(key: str) -> int | None:
    """``VmHWM`` / ``VmRSS`` of /proc/self/status (Linux), in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return 1024 * int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Reset the peak-RSS mark (Linux ≥ 4.0: ``5`` into /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def memory_figures(
    case: Case, measure: str, steps: int, eps: float, device: torch.device, fresh: bool
) -> dict[str, Any]:
    """Figure (c) in this process: the peak of one call above the peak of two plain steps.

    CPU: peak RSS. ``ru_maxrss`` is the high-water mark of the whole process life, so it is
    meaningful in a fresh process only (hence one subprocess per configuration), and even there
    the transients of loading a model (``from_pretrained``, the corpus) can exceed the plain
    step's peak and hide it. So the mark is reset once the model is built (``5`` into
    ``/proc/self/clear_refs``, Linux ≥ 4.0) and the peak read from ``VmHWM``; both figures are
    kept (``*_maxrss``), and without the reset the ``ru_maxrss`` ones are the result.
    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    """
    probe = Probe(device)
    out: dict[str, Any] = {}
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.empty_cache()
        out["method"] = "cuda_max_memory_allocated"
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            plain_step(case)
        _sync(device)
        peak_plain = torch.cuda.max_memory_allocated(device)
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
        with probe.installed():
            call = sharpness_call(case, measure, steps, probe, eps)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        maxrss_build = _maxrss_bytes()
        before = _status_bytes("VmRSS")
        reset = _reset_hwm()  # forget the loading transients (VmHWM only)
        for _ in range(2):
            plain_step(case)
        gc.collect()
        maxrss_plain, hwm_plain = _maxrss_bytes(), _status_bytes("VmHWM")
        with probe.installed():
            call = sharpness_call(case, measure, steps, probe, eps)
        maxrss, hwm = _maxrss_bytes(), _status_bytes("VmHWM")
        out["maxrss_after_build_bytes"] = maxrss_build
        out["peak_plain_maxrss_bytes"] = maxrss_plain
        out["peak_measure_maxrss_bytes"] = maxrss
        unit = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
        unit *= next(case.model.parameters()).element_size()
        out["extra_param_buffers_maxrss"] = (maxrss - maxrss_plain) / unit
        # Whether loading hid the plain step's peak in ru_maxrss (its figures are then too low).
        out["build_peak_masks_plain"] = maxrss_build >= maxrss_plain
        out["hwm_reset"] = reset
        if reset and hwm is not None and hwm_plain is not None:
            out["method"] = "vmhwm_after_clear_refs"
            peak_plain, peak = hwm_plain, hwm
        elif fresh:
            out["method"] = "ru_maxrss"
            peak_plain, peak = maxrss_plain, maxrss
        else:  # ru_maxrss holds the peaks of everything done before in this process
            raise RuntimeError("in-process CPU memory needs /proc/self/clear_refs (Linux)")
    out.update(_memory_result(case, out.pop("method"), fresh, before, peak_plain, peak, call))
    return out


def _memory_result(
    case: Case,
    method: str,
    fresh: bool,
    before: int | None,
    peak_plain: int,
    peak: int,
    call: dict[str, Any],
) -> dict[str, Any]:
    """Figure (c) from the peaks, in units of parameter-sized buffers ``P · itemsize``."""
    n_params = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
    unit = n_params * next(case.model.parameters()).element_size()
    return {
        "method": method,
        "fresh_process": fresh,
        "param_buffer_bytes": unit,
        "rss_or_allocated_after_build_bytes": before,
        "peak_plain_bytes": peak_plain,
        "peak_measure_bytes": peak,
        "extra_bytes": peak - peak_plain,
        "extra_param_buffers": (peak - peak_plain) / unit,
        "plain_above_model_param_buffers": (
            (peak_plain - before) / unit if before is not None else None
        ),
        "steps": call["n_steps"],
        "call_s": call["total_s"],
        "call_breakdown": {k: v for k, v in call.items() if k != "name"},
    }


def _child(spec: dict[str, Any]) -> None:
    """``--child``: figure (c) of one (configuration, measure) in this fresh process."""
    torch.set_num_threads(spec["threads"])
    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    case = build(spec["config"], device, dtype, spec.get("key_bias"))
    mem = memory_figures(case, spec["measure"], spec["steps"], spec["eps"], device, fresh=True)
    print(CHILD_TAG + json.dumps(mem), flush=True)


def memory_subprocess(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """Run :func:`_child` in a fresh interpreter and return its figures (or the error)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


# -- machine and report ----------------------------------------------------------------------
def cpu_and_memory() -> tuple[str, int | None]:
    """The CPU's model name and the machine's memory in bytes (None where unknown)."""
    cpu = platform.processor() or platform.machine()
    mem_total = None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo", encoding="ascii") as fh:
            mem_total = 1024 * int(fh.readline().split()[1])
    return cpu, mem_total


def machine(device: torch.device) -> dict[str, Any]:
    """What ran the benchmark (for the JSON): CPU, cores, memory, versions, threads, load."""
    cpu, mem_total = cpu_and_memory()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    info: dict[str, Any] = {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_bytes": mem_total,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "geosharp": gs.__version__,
        "git_commit": commit or None,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "env_threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device),
        "cuda_device": None,
        "cuda_version": torch.version.cuda,
    }
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
        info["cuda_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        info["cuda_matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def _fmt(x: float | None, spec: str = "5.2f") -> str:
    """``format(x, spec)``, or a dash as wide as ``spec`` asks when ``x`` is missing."""
    if x is None:
        width = spec.split(".")[0]
        return "—".rjust(int(width)) if width.isdigit() else "—"
    return format(x, spec)


def print_run(run: dict[str, Any]) -> None:
    plain = run["plain"]["fwd_bwd_s"]
    print(
        f"\n{run['config']} [{run['dtype']}, {run['device']}, {run['threads']} thread(s)]: "
        f"{run['title']}\n  P = {run['n_params_perturbed']:,} perturbed of "
        f"{run['n_params_total']:,} parameters; plain fwd+bwd over {run['n_batches']} batch(es) "
        f"{_fmt(None if plain is None else 1e3 * plain, '.1f')} ms"
    )
    head = f"  {'measure':<25}{'step':>7}{'set-up 1st':>12}{'set-up rep':>12}{'memory':>9}"
    print(head + "   (step, set-up: plain fwd+bwd; memory: P-sized buffers above plain)")
    errors = []
    for m, f in run["measures"].items():
        step, setup, mem = f.get("step") or {}, f.get("setup") or {}, f.get("memory") or {}
        mem_s = "error" if "error" in mem else _fmt(mem.get("extra_param_buffers"), "9.2f")
        step_s = "error" if "error" in f else _fmt(step.get("ratio"), "7.2f")
        first, repeat = _fmt(setup.get("first_ratio"), "12.2f"), _fmt(setup.get("repeat_ratio"))
        print(f"  {m:<25}{step_s:>7}{first:>12}{repeat:>12}{mem_s:>9}")
        errors += [f"  {m}: {d['error']}" for d in (f, mem) if "error" in d]
    for line in errors:
        print(line)


def run_config(name: str, dtype_name: str, args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), DTYPES[dtype_name]
    eps = args.eps if args.eps is not None else (1e-6 if dtype == torch.bfloat16 else 0.0)
    case = build(name, device, dtype, args.key_bias)
    space = find_space(case)
    run: dict[str, Any] = {
        "config": name,
        "title": case.title,
        "dtype": dtype_name,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "eps": eps,
        "key_bias": case.key_bias,
        "n_params_total": sum(p.numel() for p in case.model.parameters()),
        "n_params_perturbed": space.numel(),
        "n_params_gl": getattr(space, "gl_numel", None),
        "n_params_diagonal": getattr(space, "diagonal_numel", None),
        "n_params_rest": getattr(space, "adaptive_numel", None),
        "itemsize": dtype.itemsize,
        "n_batches": len(case.batches),
        "batch_shapes": [_batch_shape(x) for x, _ in case.batches],
        "probe_missing": Probe(device).missing,
    }
    del space
    measures = args.measures
    mode = args.memory
    if mode == "auto":
        mode = "inprocess" if device.type == "cuda" else "subprocess"
    mem_steps = max(args.n2, 3)  # ξ_k, ξ_{k−1}, z and the best iterate all exist from step 2
    run["memory_mode"] = mode
    if args.no_timing:
        run["plain"] = {"fwd_bwd_s": None, "samples_s": []}
        run["measures"] = {m: {"name": None, "settings": MEASURES[m]} for m in measures}
    else:
        # On CUDA the last repetition's N₂ calls give the memory figures (no extra calls).
        in_timing = device.type == "cuda" and mode == "inprocess" and args.n2 >= 3
        plain, figures = time_config(
            case,
            measures,
            args.n1,
            args.n2,
            args.repeats,
            eps,
            device,
            cuda_memory=in_timing,
            reuse_space=args.reuse_space,
        )
        run["plain"], run["measures"] = plain, figures
    if mode == "inprocess":
        for m in measures:
            if run["measures"][m].get("memory") is not None:
                continue
            try:
                mem = memory_figures(case, m, mem_steps, eps, device, fresh=False)
                run["measures"][m]["memory"] = mem
            except Exception as err:  # reported per measure; the run goes on
                run["measures"][m]["memory"] = {"error": f"{type(err).__name__}: {err}"}
    case_key_bias = case.key_bias
    del case
    gc.collect()
    if mode == "subprocess":
        specs = [
            {
                "config": name,
                "measure": m,
                "dtype": dtype_name,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "steps": mem_steps,
                "eps": eps,
                "key_bias": case_key_bias,
            }
            for m in measures
        ]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda s: memory_subprocess(s, args.child_timeout), specs))
        for m, mem in zip(measures, results, strict=True):
            run["measures"][m]["memory"] = mem
    if mode == "off":
        for m in measures:
            run["measures"][m]["memory"] = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"(default {DEFAULT_CONFIGS})")
    parser.add_argument(
        "--measures",
        default=",".join(DEFAULT_MEASURES),
        help=f"subset of {','.join(MEASURES)} (default: the first four)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument(
        "--dtype", default="float32", help="float32, bfloat16 or a list: float32,bfloat16"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (3)")
    parser.add_argument("--steps", default="1,5", help="N1,N2 steps (samples) of a call (1,5)")
    parser.add_argument(
        "--eps",
        type=float,
        default=None,
        help="GL Gram damping (default 0; 1e-6 in bfloat16, whose rank check refuses blocks of "
        "condition > 1/(h·eps_bf16) at eps=0; the cost does not depend on it)",
    )
    parser.add_argument(
        "--memory",
        choices=("auto", "subprocess", "inprocess", "off"),
        default="auto",
        help="auto: one subprocess per (config, measure) on CPU (peak RSS: VmHWM after a "
        "reset, ru_maxrss alongside), in-process max_memory_allocated on CUDA",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="memory subprocesses run at once (1; >1 for tests)"
    )
    parser.add_argument("--child-timeout", type=float, default=None, help="seconds per child")
    parser.add_argument("--no-timing", action="store_true", help="memory figures only")
    parser.add_argument(
        "--key-bias",
        choices=("quotient", "keep"),
        default=None,
        help="find_symmetries(key_bias=...) for every configuration (default: the library's, "
        "'keep' for minilm-small as in Study 3)",
    )
    parser.add_argument(
        "--reuse-space",
        action="store_true",
        help="find the symmetries twice per configuration (timed, added to the set-up figures) "
        "and pass the space to every timed call: saves its search per call on big models",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--list", action="store_true", help="list the configurations")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    if args.list:
        for k, (text, _) in CONFIGS.items():
            print(f"{k:<14}{text}")
        return 0
    args.n1, args.n2 = (int(s) for s in args.steps.split(","))
    if not 1 <= args.n1 < args.n2:
        parser.error("--steps needs 1 <= N1 < N2")
    if args.repeats < 1 or args.threads < 1 or args.jobs < 1:
        parser.error("--repeats, --threads and --jobs must be at least 1")
    configs = args.configs.split(",")
    args.measures = args.measures.split(",")
    dtypes = args.dtype.split(",")
    for bad, known, what in (
        (set(configs) - set(CONFIGS), CONFIGS, "configuration"),
        (set(args.measures) - set(MEASURES), MEASURES, "measure"),
        (set(dtypes) - set(DTYPES), DTYPES, "dtype"),
    ):
        if bad:
            parser.error(f"unknown {what}(s) {sorted(bad)}; known: {', '.join(known)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": machine(device),
        "settings": {
            "configs": configs,
            "measures": args.measures,
            "dtypes": dtypes,
            "device": str(device),
            "threads": args.threads,
            "repeats": args.repeats,
            "steps": [args.n1, args.n2],
            "memory": args.memory,
            "jobs": args.jobs,
            "reuse_space": args.reuse_space,
            "key_bias": args.key_bias,
            "eps": args.eps,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "runs": [],
    }
    m = report["machine"]
    print(
        f"machine: {m['cpu_model']}, {m['usable_cpus']} usable CPUs, {m['threads']} torch "
        f"thread(s), torch {m['torch']}, device {m['cuda_device'] or m['device']}; steps "
        f"{args.n1},{args.n2}, {args.repeats} repetition(s)"
    )
    for name in configs:
        for dtype_name in dtypes:
            try:
                run = run_config(name, dtype_name, args)
            except Exception as err:  # one broken configuration must not lose the rest
                run = {"config": name, "dtype": dtype_name, "error": f"{type(err).__name__}: {err}"}
                print(f"\n{name} [{dtype_name}]: error: {run['error']}")
            else:
                print_run(run)
            report["runs"].append(run)
            report["machine"]["load_average_end"] = (
                list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            )
            if args.json is not None:  # after every run: a crash later keeps what was measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.json is not None:
        print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
