"""Sharpness of FSDP2-sharded models at world sizes 1, 2 and 4 against one unsharded process.

Run as a script by ``test_fsdp.py`` (``torch.multiprocessing`` spawns the ranks, gloo on CPU):
it measures every model unsharded in this process, then spawns each world size, whose ranks
``fully_shard`` every layer and the root (with :func:`geosharp.shard_placement`: the Q/K/V
projections and LoRA's ``A`` along their dimension 1, so that every rank holds whole rows of
every head), measure the same model on their rows of every batch, and report their values and
whether their shards came back bit-identical. It prints one JSON line.

``bert-twin`` is the BERT with a random element of its symmetry group applied (the same
function, other weights): its geodesic values must equal the BERT's. ``bert-default`` is the
BERT sharded with FSDP's default placement (dimension 0): every head's Q/K/V rows lie whole on
one rank and the others pad them with zero rows (SPEC §10.6). ``gs.curvature`` is measured on
some cases too (:data:`CURVATURE_CASES`), each call's shards compared with the ones before.

    python tests/estimators/fsdp_worlds.py 1,2,4          # gloo on CPU (the test)
    python tests/estimators/fsdp_worlds.py 1,2 cuda       # nccl, one GPU per rank
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import geosharp as gs

#: label → (measure, norm, block metric, perturb)
MEASURES = {
    "adaptive": ("adaptive", "l2", "inv", "all"),
    "euclidean": ("euclidean", "l2", "inv", "all"),
    "adaptive-linf": ("adaptive", "linf", "inv", "all"),
    "geodesic-inv": ("geodesic", "l2", "inv", "all"),
    "geodesic-mix": ("geodesic", "l2", "mix", "all"),
    "adaptive-blocks": ("adaptive", "l2", "inv", "blocks"),  # attention only
}
#: (model, dtype, rho) measured sharded and unsharded; bfloat16 at a radius that its 8-bit
#: mantissa resolves (θ′ = w + ξ rounds ξ to ~1/256 of |w|: at ρ = 0.05 that is ~8 % of ξ)
CASES = [
    ("bert", "float64", 0.05),
    ("bert-twin", "float64", 0.05),
    ("bert-default", "float64", 0.05),
    ("bert", "float32", 0.05),
    ("llama-gqa", "float64", 0.05),
    ("llama-gqa-lora", "float64", 0.05),
    ("llama-gqa-lora", "float32", 0.05),
    ("bert", "bfloat16", 0.5),
]
#: label → the random measures (their noise drawn by every rank as one process draws it):
#: the average case and random starts, ℓ2 (a random point of the horizontal sphere) and ℓ∞
RANDOM = {
    "adaptive-average": {"measure": "adaptive", "kind": "average", "samples": 3},
    "geodesic-inv-average": {"measure": "geodesic", "kind": "average", "samples": 3},
    "geodesic-inv-restarts": {"measure": "geodesic", "restarts": 2, "random_init": True},
    "adaptive-linf-restarts": {"measure": "adaptive", "norm": "linf", "random_init": True},
}
#: case key → the random measures it is measured with too (bert-default: padded heads, whose
#: zero rows must get zero noise: a random start's norm would count them)
RANDOM_CASES = {
    "bert/float64/0.05": tuple(RANDOM),
    "llama-gqa-lora/float64/0.05": tuple(RANDOM),
    "bert-default/float64/0.05": ("geodesic-inv-average", "geodesic-inv-restarts"),
}
RANDOM_STEPS = 2
#: label → the exact (RK4) geodesic: every stage's ``h × h`` contractions summed over the ranks,
#: its gradient through those sums (SPEC §10.6); 4 RK4 steps (every stage's collectives are
#: what is tested, not the integrator's accuracy)
EXACT = {
    "geodesic-mix-exact": {"measure": "geodesic", "metric": "mix", "order": "exact"},
    "geodesic-inv-exact-blocks": {"measure": "geodesic", "order": "exact", "perturb": "blocks"},
}
EXACT = {m: {**kw, "exact_steps": 4} for m, kw in EXACT.items()}
#: label → a geodesic measure with an option that changes where its base point lives: the
#: blocks' products in the model's dtype (``low_memory``: the geometry holds the point it would
#: read from the shards) and the ablation without the corrected norm (its ball is another
#: geometry's: θ′ is written over the shards)
OPTIONS = {
    "geodesic-mix-low-memory": {"measure": "geodesic", "metric": "mix", "low_memory": True},
    "geodesic-inv-uncorrected-norm": {"measure": "geodesic", "corrected_norm": False},
}
OPTION_CASES = {
    "bert/float64/0.05": tuple(OPTIONS),
    "llama-gqa-lora/float64/0.05": tuple(OPTIONS),
}
#: case key → the exact measures it is measured with too (llama-gqa: rotary blocks)
EXACT_CASES = {
    "bert/float64/0.05": tuple(EXACT),
    "bert-default/float64/0.05": ("geodesic-mix-exact",),
    "llama-gqa/float64/0.05": tuple(EXACT),
    "llama-gqa-lora/float64/0.05": ("geodesic-mix-exact",),
}
#: label → ``gs.curvature`` of the sharded model (issue 42): its Hessian-vector products by
#: double backward through FSDP, on the first batch, with few products (what is tested is that
#: they are the unsharded ones, not the spectrum's accuracy)
CURVATURE = {
    "adaptive": {"measure": "adaptive"},
    "euclidean": {"measure": "euclidean"},
    "geodesic-inv": {"measure": "geodesic", "metric": "inv"},
    "geodesic-mix": {"measure": "geodesic", "metric": "mix"},
}
CURVATURE_KW = {"quantities": ("lambda_max", "lambda_min", "trace"), "iters": 4, "probes": 2}
#: case key → the curvature measures it is measured with (bert-default: padded heads; the LoRA
#: Llama: LoRA GL(r) blocks)
CURVATURE_CASES = {
    "bert/float64/0.05": tuple(CURVATURE),
    "bert-default/float64/0.05": ("geodesic-inv",),
    "llama-gqa-lora/float64/0.05": ("geodesic-inv",),
}
#: measured unsharded only: the float32 value on the same weights as the bfloat16 case
REFERENCE_ONLY = [("bert", "float32", 0.5)]
ROWS = 8  # rows of every batch: split evenly over 1, 2 or 4 ranks
STEPS = 5


def build(name: str, dtype: torch.dtype, attn: str | None = None) -> torch.nn.Module:
    """A tiny model from its config, the same on every rank (seeded).

    ``attn``: the attention implementation (``"eager"``, ``"sdpa"``; the library's default if
    None).
    """
    torch.manual_seed(0)
    kw = {} if attn is None else {"attn_implementation": attn}
    if name == "bert-twin":
        from geosharp.symmetry.reparametrize import reparametrize

        return reparametrize(build("bert", dtype), torch.Generator().manual_seed(1), scale=3.0)
    if name in ("bert", "bert-default"):
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(
            vocab_size=50,  # 50 rows: uneven shards over 4 ranks
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,  # 4 heads of 8: b_q's shards hold whole heads at worlds ≤ 4
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **kw,
        )
        return BertForSequenceClassification(cfg).to(dtype).eval()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
        **kw,
    )
    base = LlamaForSequenceClassification(cfg).to(dtype).eval()
    if name == "llama-gqa":  # a full fine-tune: its Q/K blocks are rotary (SPEC §8.5)
        return base
    lora = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,  # B ≠ 0: the LoRA factors are not at a symmetric point
    )
    return get_peft_model(base, lora).eval()


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer layers, each its own FSDP unit."""
    if hasattr(model, "bert"):  # also the twin
        return list(model.bert.encoder.layer)
    if hasattr(model, "base_model") and hasattr(model.base_model, "model"):  # PEFT
        return list(model.base_model.model.model.layers)
    return list(model.model.layers)


def batches() -> list[tuple[dict, torch.Tensor]]:
    """Two batches of ROWS sequences (ids ≥ 1: no padding)."""
    g = torch.Generator().manual_seed(1)
    return [
        (
            {"input_ids": torch.randint(1, 50, (ROWS, 6), generator=g)},
            torch.randint(0, 3, (ROWS,), generator=g),
        )
        for _ in range(2)
    ]


def ce(out, y):
    """Cross-entropy, accumulated in float32 for a half-precision model."""
    logits = out.logits
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, y)


def key(name: str, dt: str, rho: float) -> str:
    return f"{name}/{dt}/{rho}"


def measure_all(model: torch.nn.Module, data: list, rho: float) -> dict[str, dict]:
    """Per measure: the value, the clean and the perturbed loss of every batch."""
    out = {}
    for m, (measure, norm, metric, perturb) in MEASURES.items():
        r = rho / 10 if norm == "linf" else rho  # a box of side ρ|w| holds a far larger move
        res = gs.sharpness(
            model,
            ce,
            data,
            measure=measure,
            norm=norm,
            metric=metric,
            perturb=perturb,
            rho=r,
            steps=STEPS,
            progress=False,
        )
        out[m] = {
            "value": res.value,
            "clean": res.clean_losses,
            "perturbed": res.perturbed_losses,
            "sharded": res.settings["sharded"],
            "dtype": res.settings["dtype"],
            "n_params": res.settings["n_params"],
        }
    return out


def measure_random(
    model: torch.nn.Module, data: list, rho: float, labels: tuple, table: dict = RANDOM
) -> dict:
    """Per measure of ``labels`` (in ``table``): the value, the losses and the base point's kind."""
    out = {}
    for m in labels:
        kw = table[m]
        r = rho / 10 if kw.get("norm") == "linf" else rho
        res = gs.sharpness(model, ce, data, rho=r, steps=RANDOM_STEPS, progress=False, **kw)
        out[m] = {
            "value": res.value,
            "clean": res.clean_losses,
            "perturbed": res.perturbed_losses,
            "sharded": res.settings["sharded"],
            "kappa": res.settings["max_relative_speed"],
        }
    return out


def measure_curvature(
    model: torch.nn.Module, data: list, labels: tuple, shards: list | None = None
) -> dict:
    """Per curvature measure of ``labels``: its values, Ritz values, gradient norm, clean loss.

    ``shards``: the rank's shards of the model's parameters before the calls (sharded): whether
    they are bit-identical after each call is recorded.
    """
    out = {}
    for m in labels:
        res = gs.curvature(model, ce, data[:1], progress=False, **CURVATURE_KW, **CURVATURE[m])
        out[m] = {
            "values": res.values,
            "eigenvalues": res.eigenvalues,
            "grad_norms": res.grad_norms,
            "clean": res.clean_losses,
            "lanczos_iters": res.lanczos_iters,
            "n_hvp": res.n_hvp,
            "n_params": res.settings["n_params"],
            "sharded": res.settings["sharded"],
            "shards_identical": None
            if shards is None
            else all(
                torch.equal(a, p._local_tensor)
                for a, p in zip(shards, model.parameters(), strict=True)
            ),
        }
    return out


def fsdp_settings(model: torch.nn.Module) -> list:
    """Every FSDP module's resharding settings (FSDP's state: it has no getter for them).

    ``gs.curvature`` keeps every layer gathered for its call and must put them back.
    """
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = [
                (g.post_forward_mesh_info is not None, g.reshard_after_backward)
                for g in state._fsdp_param_groups
            ]
            out.append((state._auto_reshard_after_forward, groups))
    return out


def rank_main(rank: int, world: int, store: str, queue, device: str = "cpu") -> None:
    try:
        torch.set_num_threads(1)
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")

        out = {}
        n = ROWS // world
        for name, dt, rho in CASES:
            model = build(name, getattr(torch, dt)).to(dev)
            # whole rows of every head on every rank, or FSDP's default (whole heads)
            place = None if name == "bert-default" else gs.shard_placement(model)
            for layer in layers(model):
                fully_shard(layer, mesh=mesh, shard_placement_fn=place)
            fully_shard(model, mesh=mesh, shard_placement_fn=place)
            before = [p._local_tensor.clone() for p in model.parameters()]
            mine = [
                (
                    {"input_ids": x["input_ids"][rank * n : (rank + 1) * n].to(dev)},
                    y[rank * n : (rank + 1) * n].to(dev),
                )
                for x, y in batches()
            ]
            k = key(name, dt, rho)
            # curvature first: every sharpness measure of the case then runs after it
            fsdp_before = fsdp_settings(model)
            curvature = measure_curvature(model, mine, CURVATURE_CASES.get(k, ()), before)
            fsdp_kept = fsdp_settings(model) == fsdp_before
            values = measure_all(model, mine, rho)
            random = measure_random(model, mine, rho, RANDOM_CASES.get(k, ()))
            exact = measure_random(model, mine, rho, EXACT_CASES.get(k, ()), EXACT)
            options = measure_random(model, mine, rho, OPTION_CASES.get(k, ()), OPTIONS)
            same = all(
                torch.equal(a, p._local_tensor)
                for a, p in zip(before, model.parameters(), strict=True)
            )
            out[k] = {
                "values": values,
                "random": random,
                "exact": exact,
                "options": options,
                "curvature": curvature,
                "fsdp_settings_kept": fsdp_kept,
                "shards_identical": same,
            }
            del model
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def _start(ctx, world: int, device: str) -> tuple:
    """Spawn the ranks of one world size; :func:`_collect` gathers what they report."""
    queue = ctx.Queue()
    store = tempfile.NamedTemporaryFile(delete=False).name
    os.unlink(store)
    procs = [
        ctx.Process(target=rank_main, args=(r, world, store, queue, device)) for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, queue


def _collect(procs: list, queue) -> dict:
    ranks = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return ranks


def main(worlds: list[int], device: str = "cpu") -> dict:
    """The unsharded values (on ``device``'s first device) and every world size's.

    The first world size's ranks run while this process measures the unsharded models (world 1
    on two cores: one each), the others one world size after another.
    """
    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    ctx = mp.get_context("spawn")
    first = _start(ctx, worlds[0], device) if worlds else None

    def on(data: list) -> list:
        return [({"input_ids": x["input_ids"].to(dev)}, y.to(dev)) for x, y in data]

    ref, random, exact, options, curvature = {}, {}, {}, {}, {}
    for name, dt, rho in CASES + REFERENCE_ONLY:
        model, k = build(name, getattr(torch, dt)).to(dev), key(name, dt, rho)
        ref[k] = measure_all(model, on(batches()), rho)
        # A sharded rank draws its part of the noise from the CPU stream that one process on the
        # CPU draws (estimators/sharded/draws.py); an unsharded model on a GPU draws CUDA's
        # numbers: the random measures' reference is the same model on the CPU.
        cpu = model if device == "cpu" else build(name, getattr(torch, dt))
        random[k] = measure_random(cpu, batches(), rho, RANDOM_CASES.get(k, ()))
        exact[k] = measure_random(model, on(batches()), rho, EXACT_CASES.get(k, ()), EXACT)
        options[k] = measure_random(model, on(batches()), rho, OPTION_CASES.get(k, ()), OPTIONS)
        # the trace probes and the Lanczos start: the CPU stream, as for the random measures
        curvature[k] = measure_curvature(cpu, batches(), CURVATURE_CASES.get(k, ()))
    result = {
        "reference": ref,
        "random": random,
        "exact": exact,
        "options": options,
        "curvature": curvature,
        "worlds": {},
        "device": device,
    }
    for i, world in enumerate(worlds):
        procs, queue = first if i == 0 else _start(ctx, world, device)
        result["worlds"][world] = _collect(procs, queue)
    return result


if __name__ == "__main__":
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"  # "cuda": nccl, one GPU per rank
    print(json.dumps(main([int(w) for w in sys.argv[1].split(",")], device)))
