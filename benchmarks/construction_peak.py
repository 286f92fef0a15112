"""Peak memory of building a perturbation (the set-up of one gs.sharpness call), in P.

A MiniLM-sized BERT (22.7 M weights, random, its padding row zeroed so that the adaptive metric
has frozen coordinates) in float32; the peak resident memory (VmHWM, reset just before) above
the memory before ``Perturbation(...)``, in units of P = the parameters' bytes. Run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed temporaries leave the resident set.

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/construction_peak.py adaptive
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/construction_peak.py geodesic
"""

from __future__ import annotations

import sys

import torch

import geosharp as gs
from geosharp.estimators.perturbation import Perturbation


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(measure: str) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[0].zero_()
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    space = gs.find_symmetries(model)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    Perturbation(space, dict(model.named_parameters()), measure=measure, metric="inv")
    peak = _status("VmHWM") - before
    mib = P / 2**20
    print(f"{measure}: construction peak {peak / P:.2f} P above its start (P = {mib:.1f} MiB)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "geodesic")
