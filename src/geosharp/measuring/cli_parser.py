"""The arguments and the help of ``geosharp measure`` (:func:`add_parser`).

Running the command is :mod:`~geosharp.measuring.cli`'s, which re-exports :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from geosharp.estimators.apgd import BUFFER_BUDGET
from geosharp.geometry.base import DEFAULT_RK4_STEPS
from geosharp.measuring.core import (
    DEFAULT_CURVATURE_ITERS,
    DEFAULT_CURVATURE_PROBES,
    DEFAULT_MEASURES,
    DEFAULT_RHOS,
    DEFAULT_STEPS,
)
from geosharp.measuring.lm import SOURCE_COLS, TARGET_COLS, TXT_MODES
from geosharp.measuring.lm_tasks import TASKS

__all__ = ["add_data_arguments", "add_parser"]


def _buffer_budget(text: str) -> float | None:
    """``--buffer-budget``: a positive number of buffers, or ``none`` (no bound)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'none', got {text!r}")
    return value


_EPILOG = """\
examples:
  geosharp measure ./my-bert-folder train.csv --text-col sentence --label-col label
  geosharp measure ./my-bert-folder ./mnli_train_ds --text-col premise,hypothesis --samples 1024
  geosharp measure model.pt data.npz --measures adaptive-linf geodesic-inv-exact --rho 0.05
  geosharp measure mypkg.models:build data.npz --weights ckpt.pt --report --out runs/m1
  geosharp measure mypkg.models:build mypkg.data:batches --weights ckpt.pt --device cuda
  geosharp measure ./my-llama-folder corpus.txt --max-length 256 --batch-size 8
  geosharp measure ./my-gpt2-folder docs.jsonl --text-col body --task causal-lm
  geosharp measure ./my-t5-folder pairs.jsonl --source-col question --target-col answer
  geosharp measure ./my-lora-adapter corpus.txt --base ./my-llama-folder

tasks (--task, default auto: from the folder's config; the chosen task is printed):
  classification  labels from --label-col (integers or the model's label names),
                  cross-entropy; float targets: squared error. Any model kind.
  causal-lm       next-token cross-entropy on a text corpus: a .txt file (one document per
                  line, or --txt-mode chunks: the whole file in blocks of --max-length
                  tokens), or .jsonl/.json/.csv/.parquet/datasets folder with a --text-col
                  column (default text). Tokenized with the folder's tokenizer (or
                  --tokenizer), truncated to --max-length, padded on the right; padding is
                  masked out of the loss; batches keep the corpus's order. Auto for config
                  architectures *ForCausalLM and *LMHeadModel (Llama, Qwen, GPT-2, ...).
  seq2seq         teacher-forced cross-entropy of --target-col given --source-col (defaults:
                  source/src/input/... and target/tgt/output/...) from .jsonl/.json/.csv/
                  .parquet/datasets; target padding masked. Auto for encoder-decoder configs
                  (T5, BART: *ForConditionalGeneration).
  A folder with adapter_config.json is a PEFT adapter, loaded with peft on its base model
  (base_model_name_or_path of the adapter config, a local folder, or --base PATH): the base
  is frozen, so sharpness is measured over the adapter's trainable parameters (LoRA A/B).
  With --loss module:function, causal-lm targets are the inputs shifted by one token
  (-100 on padding and at the end), seq2seq targets the target token ids (-100 on padding).

measures: FAMILY[-OPTION...], FAMILY one of geodesic, adaptive, euclidean, relative-flatness;
options: inv|mix, o1|o2|exact (geodesic), l2|linf (adaptive, euclidean), worst|average,
blocks (geodesic, adaptive l2: attention-only), adaptivenorm (geodesic: no corrected norm).
Curvature (the Hessian on the quotient, SPEC §9; no rho, measured once):
curvature[-geodesic|adaptive|euclidean][-inv|mix]-lmax|lmin|trace, e.g. curvature-inv-lmax,
curvature-mix-trace, curvature-adaptive-lmax, curvature-euclidean-trace (PyHessian's numbers);
Lanczos for lmax/lmin (--iters), Hutchinson for the trace (--probes, with its standard error).
The default is the paper's three measures: adaptive-l2, geodesic-inv-o2, geodesic-mix-o2, worst
case, 20 Auto-PGD steps, at rho 0.01, 0.1 and 1 (the paper reports no rho; one decade apart).
"""


def add_data_arguments(m: argparse.ArgumentParser) -> None:
    """The options of how a model's data are read: ``geosharp measure``'s and a population's.

    ``--task``, the batching (``--batch-size``, ``--samples``, ``--max-length``), the columns,
    the tokenizer, the PEFT base, the frozen parameters, a fresh head's classes, the loss, the
    device and the dtype (read by :func:`geosharp.measuring.pipeline.options_from_args`).
    """
    m.add_argument(
        "--task",
        default="auto",
        choices=("auto", *TASKS),
        help="what the loss is (default auto: causal-lm for *ForCausalLM/*LMHeadModel "
        "configs, seq2seq for encoder-decoder configs, else classification); see below",
    )
    m.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="samples per batch, the m of m-sharpness (default 128, the paper's for BERT)",
    )
    m.add_argument(
        "--samples",
        type=int,
        default=1024,
        help="use the first N samples (default 1024, the paper's for BERT); 0: all",
    )
    m.add_argument(
        "--text-col",
        default="text",
        help="text column (default text); classification: a,b for sentence pairs",
    )
    m.add_argument(
        "--label-col", default=None, help="label column or .npz array (label; npz: y, targets, ...)"
    )
    m.add_argument(
        "--source-col",
        default=None,
        help="seq2seq: source text column (default: the first of "
        f"{', '.join(SOURCE_COLS)} present)",
    )
    m.add_argument(
        "--target-col",
        default=None,
        help="seq2seq: target text column (default: the first of "
        f"{', '.join(TARGET_COLS)} present)",
    )
    m.add_argument(
        "--txt-mode",
        default="lines",
        choices=TXT_MODES,
        help="causal-lm on a .txt file: one document per non-empty line (lines, the default) "
        "or the whole file cut into blocks of --max-length tokens (chunks)",
    )
    m.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="longest tokenized text (causal-lm: document or chunk; seq2seq: source and "
        "target); longer is truncated (128)",
    )
    m.add_argument("--split", default=None, help="split of a datasets folder (default train)")
    m.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the model's)")
    m.add_argument(
        "--base",
        default=None,
        help="the base model folder of a PEFT adapter (default: the adapter config's "
        "base_model_name_or_path)",
    )
    m.add_argument(
        "--freeze",
        action="append",
        default=None,
        metavar="PATTERN",
        help="leave the parameters whose names match this glob out of the measurement, as a "
        "frozen part of a fine-tune (e.g. '*embeddings*'); repeatable",
    )
    m.add_argument(
        "--num-labels",
        type=int,
        default=None,
        help="classes of the fresh head of a checkpoint without one (default: from the labels)",
    )
    m.add_argument(
        "--loss",
        default="auto",
        help="auto (cross-entropy for integer labels, squared error for float targets), ce, "
        "mse, or module:function(outputs, targets)",
    )
    m.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (auto)")
    m.add_argument(
        "--dtype", default="float32", help="float32, float64 or bfloat16 (default float32)"
    )


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``measure`` to the subparsers ``sub`` of the ``geosharp`` command.

    Returns:
        The new parser.
    """
    m = sub.add_parser(
        "measure",
        help="measure the sharpness of one trained model (HF folder, saved model, or builder)",
        description=textwrap.fill(
            "Measure the sharpness of one trained model on its data under several measures and "
            "radii. Before measuring, the symmetry blocks found are printed and a self-check "
            "runs: the clean loss must be finite and the model's outputs unchanged under a "
            "random re-parametrization of the blocks (else a wrong adapter would be measured). "
            "Results: a table here, results.json and results.csv in --out, and with --report "
            "an HTML page with the per-batch loss-ascent curves.",
            width=92,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "model",
        help="a Hugging Face model folder (config.json), a PEFT adapter folder "
        "(adapter_config.json), a torch.save(model) or torch.jit.save file, or module:function "
        "building the model (with --weights)",
    )
    m.add_argument(
        "data",
        help="a Hugging Face datasets folder, a .csv/.tsv/.jsonl/.json/.parquet file of text "
        "and labels (causal-lm: of text; seq2seq: of source and target texts), a .txt corpus "
        "(causal-lm), an .npz of arrays, or module:function returning (inputs, targets) batches",
    )
    m.add_argument("--weights", default=None, help="a state dict to load into the model")
    m.add_argument(
        "--measures",
        nargs="+",
        default=None,
        metavar="MEASURE",
        help=f"measures (default: {' '.join(DEFAULT_MEASURES)})",
    )
    m.add_argument(
        "--rho",
        type=float,
        nargs="+",
        default=None,
        help=f"radii (default: {' '.join(f'{r:g}' for r in DEFAULT_RHOS)}; geodesic mix's scaled "
        "by the model's head scale so that its heads move as far as inv's, and said)",
    )
    m.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="Auto-PGD steps per batch (default 20)"
    )
    m.add_argument(
        "--eps",
        type=float,
        default=0.0,
        help="damping ε of the symmetry blocks' metrics: the geodesic measures invert the Gram "
        "matrices GᵀG + εI of every GL(h) block (one per attention head's query-key and "
        "value-output factors; also the diagonal-pair metrics). Default 0: exactly invariant. "
        "Set it only if a measure fails because a block's Gram matrix is singular (a head "
        "with rank-deficient weights, e.g. pruned or zero-initialized), to about 1e-6 times "
        "the block's typical squared weight; the invariance then holds up to about that much",
    )
    m.add_argument(
        "--low-memory",
        action="store_true",
        help="trade time and float32 precision for memory (gs.sharpness(low_memory=True)): "
        "Auto-PGD keeps the best iterate's direction only while it costs no buffer "
        "(recomputed at a restart from an older one: a few extra forward+backward passes, "
        "the same iterates) and the symmetry blocks' geometry runs its products in the "
        "model's dtype instead of float64 (values move by ~1e-5 relative in float32): one "
        "parameter-sized buffer less (benchmarks/README.md)",
    )
    m.add_argument(
        "--buffer-budget",
        type=_buffer_budget,
        default=BUFFER_BUDGET,
        metavar="N|none",
        help="parameter-sized buffers a worst-case ascent may hold above a plain "
        "forward+backward to keep its best iterate's direction for restarts (default "
        f"{BUFFER_BUDGET}; 'none': always kept, the fewest passes, e.g. on a GPU with "
        "memory to spare; the values do not change)",
    )
    m.add_argument(
        "--exact-steps",
        type=int,
        default=DEFAULT_RK4_STEPS,
        metavar="N",
        help=f"RK4 steps of the exact geodesic (the -exact measures; default {DEFAULT_RK4_STEPS}). "
        "A head that the perturbation moves k times its size needs about 2k; a loss that "
        "becomes NaN says how many",
    )
    m.add_argument(
        "--iters",
        type=int,
        default=DEFAULT_CURVATURE_ITERS,
        help=f"curvature lmax/lmin: most Lanczos iterations per batch ({DEFAULT_CURVATURE_ITERS})",
    )
    m.add_argument(
        "--probes",
        type=int,
        default=DEFAULT_CURVATURE_PROBES,
        help=f"curvature trace: Hutchinson probes per batch ({DEFAULT_CURVATURE_PROBES})",
    )
    m.add_argument(
        "--trace-method",
        default="hutchinson",
        choices=("hutchinson", "hutch++", "exact"),
        help="curvature trace: hutchinson (with its standard error), hutch++ or exact (one "
        "product per coordinate: small models only)",
    )
    add_data_arguments(m)
    m.add_argument("--seed", type=int, default=0, help="seed of the check, starts and fresh heads")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    m.add_argument(
        "--out", type=Path, default=Path("runs/measure"), help="output folder (runs/measure)"
    )
    m.add_argument("--report", action="store_true", help="also write OUT/report.html")
    m.add_argument(
        "--no-check",
        action="store_true",
        help="measure even if the invariance self-check fails (not recommended)",
    )
    m.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun (one process per rank: torchrun --standalone --nproc-per-node N "
        "-m geosharp measure ... --fsdp), shard the model with FSDP2's fully_shard (every "
        "transformer layer and the root; nccl on GPUs, gloo on CPUs) and split the rows of "
        "every batch evenly over the ranks; rank 0 prints and writes the results. Every "
        "sharpness and curvature measure; relative flatness and --trace-method exact are "
        "refused in one line (docs/cluster.md)",
    )
    m.add_argument("--no-progress", action="store_true", help="no progress bars")
    m.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,  # not given: the value of geosharp --debug measure ...
        help="show the full traceback of an error instead of its one line (also before the "
        "command: geosharp --debug measure ...)",
    )
    return m
