"""Per-rank memory and collectives of ``gs.sharpness`` on an FSDP2-sharded model (issue 27).

Every rank (gloo on CPU, ``torch.multiprocessing``) builds the same BERT (``--model llama``: a
Llama-GQA) from a config, ``fully_shard``\\ s every layer and the root, and then, under the
peak resident set:

- two plain sharded steps (the model's own forward on the rank's rows, ``loss.backward()``:
  FSDP gathers each layer and reduce-scatters its gradient), the reference peak;
- one ``gs.sharpness`` call (``--measure``, ℓ2, ``--rho``, ``--steps`` Auto-PGD steps): adaptive
  at ρ ≤ 0.4 keeps the base point in the shards ("in place"), Euclidean (or a larger ρ) copies it;
  ``geodesic-inv`` / ``geodesic-mix`` (order 2) run the attention blocks on the rank's rows with
  ``h × h`` all-reduces (SPEC §10.2). The layers are sharded with
  :func:`geosharp.shard_placement` (``--placement rows``, the default: Q/K/V along dimension 1)
  or FSDP's default (``--placement default``, element-wise measures only). ``--low-memory``
  passes ``low_memory=True``: Auto-PGD keeps the best iterate's direction only while it costs
  no buffer, and the blocks' geometry runs its per-step products in the model's dtype.

The peaks are the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
before each), with glibc told to return every buffer of 64 KiB or more to the system
(``MALLOC_MMAP_THRESHOLD_=65536``, set for the ranks): a tensor tracer cannot follow FSDP's
gathered parameters, whose storages are resized to 0 and back instead of freed.

The resident set counts the pages of shared libraries a process touches for the first time:
a geodesic call brings about 6 MB more of ``libtorch_cpu.so``'s code into memory than an
adaptive one (presumably the kernels of the float64 ``h × h`` algebra, which the float32 plain
step never runs), once per process and shared between the processes of a node. The growth of
``RssFile`` over the call is printed beside the peak; ``--warm-call`` makes one call before the
plain steps and the measured call, so that both peaks hold that code and the figure is what a
second call costs.

It prints, per world size, the call's peak above the plain step's in units of the rank's share
of a parameter-sized buffer (``P · itemsize / world``), and the collectives per ascent step:
the calls of ``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` counted
during the call and during one plain step, per forward pass.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_memory.py --worlds 1,2,4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def build(hidden: int, layers: int, model: str = "bert") -> torch.nn.Module:
    """BERT (attention biases: padded bias rows at worlds > 1) or Llama-GQA (none)."""
    torch.manual_seed(0)
    if model == "llama":
        from transformers import LlamaConfig, LlamaForSequenceClassification

        cfg = LlamaConfig(
            vocab_size=30000,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=4 * hidden,
            max_position_embeddings=64,
            num_labels=2,
            pad_token_id=0,
            attn_implementation="eager",
        )
        return LlamaForSequenceClassification(cfg).eval()
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=30000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg).eval()


def sharded_setup(rank: int, world: int, args: dict) -> tuple:
    """The rank's sharded model (``args["model"]``), its size, its rows, the loss and a plain step.

    Every layer and the root under ``fully_shard`` (``args["placement"]``: ``"rows"`` for
    :func:`geosharp.shard_placement`, else FSDP's default), the process group already made.
    """
    from torch.distributed.fsdp import fully_shard

    import geosharp as gs

    model = build(args["hidden"], args["layers"], args.get("model", "bert"))
    n_params = sum(p.numel() for p in model.parameters())
    place = gs.shard_placement(model) if args.get("placement", "rows") == "rows" else None
    layers = model.bert.encoder.layer if hasattr(model, "bert") else model.model.layers
    for layer in layers:
        fully_shard(layer, shard_placement_fn=place)
    fully_shard(model, shard_placement_fn=place)
    g = torch.Generator().manual_seed(1)
    rows = args["rows"] // world
    ids = torch.randint(1, 30000, (args["rows"], args["seq"]), generator=g)
    y = torch.randint(0, 2, (args["rows"],), generator=g)
    mine = [
        (
            {"input_ids": ids[rank * rows : (rank + 1) * rows]},
            y[rank * rows : (rank + 1) * rows],
        )
    ]

    def ce(out, t):
        return torch.nn.functional.cross_entropy(out.logits, t)

    def plain() -> None:
        for x, t in mine:
            ce(model(**x), t).backward()
        for p in model.parameters():
            p.grad = None

    return model, n_params, mine, ce, plain


def sharded_call(model: torch.nn.Module, ce, mine: list, args: dict):
    """The measured call: ``gs.sharpness`` with ``args["measure"]`` (e.g. ``geodesic-inv``)."""
    import geosharp as gs

    measure, _, metric = args["measure"].partition("-")
    return gs.sharpness(
        model,
        ce,
        mine,
        measure=measure,
        metric=metric or "inv",
        rho=args["rho"],
        steps=args["steps"],
        low_memory=args.get("low_memory", False),
        progress=False,
    )


def reset_peak() -> None:
    """Reset the process's peak resident set (``VmHWM``) to its current size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_field(name: str) -> int:
    """A field of ``/proc/self/status`` given in kB (``VmHWM``, ``RssFile``, …), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/self/status")


def peak_rss() -> int:
    """The process's peak resident set since :func:`reset_peak`, in bytes."""
    return rss_field("VmHWM")


class Count:
    """Counts the calls of the collectives (by patching ``torch.distributed``)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.saved = {n: getattr(dist, n) for n in COLLECTIVES}

    def __enter__(self) -> Count:
        for n, f in self.saved.items():

            def counted(*a, _f=f, _n=n, **k):
                self.counts[_n] += 1
                return _f(*a, **k)

            setattr(dist, n, counted)
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self.saved.items():
            setattr(dist, n, f)


def rank_main(rank: int, world: int, store: str, args: dict, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

        model, n_params, mine, ce, plain = sharded_setup(rank, world, args)
        plain()  # warm-up
        if args.get("warm_call"):  # the library code the call runs is resident in both peaks
            sharded_call(model, ce, mine, args)
            gc.collect()
        reset_peak()
        plain()
        plain()
        plain_peak = peak_rss()
        with Count() as cp:
            plain()
        file_before = rss_field("RssFile")
        reset_peak()
        with Count() as cc:
            res = sharded_call(model, ce, mine, args)
        call_peak = peak_rss()
        file_pages = rss_field("RssFile") - file_before
        unit = n_params * 4 / world
        queue.put(
            (
                rank,
                {
                    "params": n_params,
                    "base_point": res.settings["sharded"]["base_point"],
                    "above_plain_units": (call_peak - plain_peak) / unit,
                    "file_pages_mb": file_pages / 1e6,
                    "file_pages_units": file_pages / unit,
                    "plain_collectives": dict(cp.counts),
                    "call_collectives": dict(cc.counts),
                    "forward": res.n_forward,
                    "backward": res.n_backward,
                    "value": res.value,
                },
            )
        )
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def run_world(target, world: int, args: dict) -> dict:
    """Spawn ``world`` ranks of ``target(rank, world, store, args, queue)`` (gloo, a file store).

    Returns what each rank put on the queue as ``(rank, report)``, by rank (a traceback string
    where it failed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.NamedTemporaryFile(delete=False).name
    os.unlink(store)
    procs = [ctx.Process(target=target, args=(r, world, store, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return ranks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--measure",
        default="adaptive",
        help="adaptive, euclidean, geodesic-inv or geodesic-mix",
    )
    ap.add_argument("--model", default="bert", choices=("bert", "llama"))
    ap.add_argument("--placement", default="rows", choices=("rows", "default"))
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument(
        "--low-memory",
        action="store_true",
        help="gs.sharpness(low_memory=True): best direction kept only while free, float32 factors",
    )
    ap.add_argument(
        "--warm-call",
        action="store_true",
        help="one gs.sharpness call before the measured one (library code already resident)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    args = vars(a)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    out = {}
    for world in (int(w) for w in a.worlds.split(",")):
        ranks = run_world(rank_main, world, args)
        out[world] = ranks
        for rank, r in sorted(ranks.items()):
            if isinstance(r, str):
                print(f"world {world} rank {rank} failed:\n{r}")
                continue
            print(
                f"world {world} rank {rank}: P = {r['params']:,}; peak above a plain sharded step "
                f"{r['above_plain_units']:.2f} × P/world (base point {r['base_point']}; "
                f"library pages first mapped {r['file_pages_mb']:.1f} MB = "
                f"{r['file_pages_units']:.2f}); "
                f"passes {r['forward']} fwd / "
                f"{r['backward']} bwd; collectives: plain step {r['plain_collectives']}, call "
                f"{r['call_collectives']}; value {r['value']:.6g}"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
