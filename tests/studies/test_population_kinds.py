"""Populations of other model kinds: torch.save files on an .npz, PEFT adapters on a corpus, mixed.

The same command as for Hugging Face folders: each model is loaded as ``geosharp measure``
loads it, and the report lists the symmetry blocks found per kind of model.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from torch import nn

from geosharp.studies.population import PopulationSettings, parse_rho, run_population

from ..measure.conftest import CORPUS, make_tokenizer


def options(data, **kw):
    from geosharp.measuring.resolve import resolve_device, resolve_dtype

    return {
        "data": str(data),
        "seed": 0,
        "batch_size": 4,
        "samples": 8,
        "max_length": 16,
        "device": resolve_device("cpu"),
        "dtype": resolve_dtype("float64"),
        **kw,
    }


def write_manifest(path, header, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def attention_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return layer.double().eval()


@pytest.mark.parametrize("curvature", [False, True])
def test_torch_save_files_on_an_npz(tmp_path, curvature):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 8, generator=g, dtype=torch.float64)
    import numpy as np

    np.savez(tmp_path / "data.npz", x=x.numpy(), y=torch.randn(8, 5, 8, generator=g).numpy())
    rows = []
    for i in range(3):
        torch.save(attention_model(i), tmp_path / f"m{i}.pt")
        rows.append([f"m{i}.pt", 0.1 * (i + 1), i % 2])
    manifest = write_manifest(tmp_path / "m.csv", ["model", "gap", "wd"], rows)
    s = PopulationSettings(
        manifest=str(manifest),
        options=options(tmp_path / "data.npz"),
        measures=("adaptive", "geodesic-inv-o2"),
        rho=parse_rho(["0.05"]),
        steps=2,
        curvature=curvature,
        curvature_iters=3,
        curvature_probes=2,
    )
    out = tmp_path / "out"
    summary = run_population(s, out, progress=False, log=lambda _: None)
    assert not summary.failures
    cells = json.loads((out / "summary.json").read_text())["cells"]
    curv = [c for c in cells if "curvature" in c["measure"]]
    assert summary.measured == 6 + 3 * len(curv)
    assert bool(curv) == curvature and all(c["rho"] is None for c in curv)
    models = json.loads((out / "models.json").read_text())
    assert set(models) == {"m0.pt", "m1.pt", "m2.pt"}
    assert models["m0.pt"]["blocks"] == "1 QK, 1 VO, 1 b_k"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Models and their symmetry blocks" in html and "gap = the gap column" in html


@pytest.fixture(scope="module")
def lora_population(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-pop")
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=len(tok),
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    rows = []
    for i in range(3):
        model = transformers.LlamaForCausalLM.from_pretrained(str(root / "base"))
        lora = peft.LoraConfig(
            r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
            task_type="CAUSAL_LM",
        )  # fmt: skip
        torch.manual_seed(10 + i)
        peft.get_peft_model(model, lora).save_pretrained(str(root / f"adapter{i}"))
        rows.append([f"adapter{i}", "base", 1.0 + 0.1 * i, 1.5 + 0.05 * i, 2 ** (i + 1)])
    (root / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
    manifest = write_manifest(
        root / "m.csv", ["model", "base", "train_loss", "test_loss", "r"], rows
    )
    return root, manifest


def test_peft_adapters_with_a_base_column(lora_population, tmp_path):
    root, manifest = lora_population
    s = PopulationSettings(
        manifest=str(manifest),
        options=options(root / "corpus.txt"),
        measures=("adaptive", "geodesic-inv-o2"),
        rho=parse_rho(["0.05"]),
        steps=2,
    )
    lines: list[str] = []
    summary = run_population(s, tmp_path / "out", progress=False, log=lines.append)
    assert summary.measured == 6 and not summary.failures
    assert any("gap = test_loss − train_loss" in line for line in lines)
    models = json.loads((tmp_path / "out" / "models.json").read_text())
    assert {m["task"] for m in models.values()} == {"causal-lm"}
    assert {m["blocks"] for m in models.values()} == {"2 LoRA"}
