"""The McCoy et al. BERT/MNLI loader: tiny Hugging Face folders and fabricated TF1 checkpoints."""

import json

import numpy as np
import pytest
import torch

import geosharp as gs
from geosharp.zoo import MNLI_LABELS, list_bert_mnli, load_bert_mnli

from . import tf_bundle_writer as w

transformers = pytest.importorskip("transformers")

HIDDEN, LAYERS, HEADS, INTER, VOCAB, POS = 64, 2, 4, 128, 99, 40
DT = torch.float64


def tiny_bert(seed: int, heads: int = HEADS):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        intermediate_size=INTER,
        max_position_embeddings=POS,
        num_labels=3,
        attn_implementation="eager",
    )
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # move LayerNorms and biases off their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def google_variables(model) -> dict[str, np.ndarray]:
    """Google BERT run_classifier.py variable names, from a HF model (an explicit table)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tf = {
        "bert/embeddings/word_embeddings": sd["bert.embeddings.word_embeddings.weight"],
        "bert/embeddings/position_embeddings": sd["bert.embeddings.position_embeddings.weight"],
        "bert/embeddings/token_type_embeddings": sd["bert.embeddings.token_type_embeddings.weight"],
        "bert/embeddings/LayerNorm/gamma": sd["bert.embeddings.LayerNorm.weight"],
        "bert/embeddings/LayerNorm/beta": sd["bert.embeddings.LayerNorm.bias"],
        "bert/pooler/dense/kernel": sd["bert.pooler.dense.weight"].T,
        "bert/pooler/dense/bias": sd["bert.pooler.dense.bias"],
        # run_classifier.py: logits = matmul(pooled, output_weights, transpose_b=True)
        "output_weights": sd["classifier.weight"],
        "output_bias": sd["classifier.bias"],
    }
    for i in range(LAYERS):
        tf_l, hf_l = f"bert/encoder/layer_{i}/", f"bert.encoder.layer.{i}."
        for tf_mod, hf_mod in [
            ("attention/self/query", "attention.self.query"),
            ("attention/self/key", "attention.self.key"),
            ("attention/self/value", "attention.self.value"),
            ("attention/output/dense", "attention.output.dense"),
            ("intermediate/dense", "intermediate.dense"),
            ("output/dense", "output.dense"),
        ]:
            tf[f"{tf_l}{tf_mod}/kernel"] = sd[f"{hf_l}{hf_mod}.weight"].T  # TF kernels: (in, out)
            tf[f"{tf_l}{tf_mod}/bias"] = sd[f"{hf_l}{hf_mod}.bias"]
        for tf_mod, hf_mod in [("attention/output/LayerNorm", "attention.output.LayerNorm"),
                               ("output/LayerNorm", "output.LayerNorm")]:  # fmt: skip
            tf[f"{tf_l}{tf_mod}/gamma"] = sd[f"{hf_l}{hf_mod}.weight"]
            tf[f"{tf_l}{tf_mod}/beta"] = sd[f"{hf_l}{hf_mod}.bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tf.items()}


def with_optimizer_state(tf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a fine-tuning checkpoint also holds: AdamWeightDecayOptimizer moments, global_step."""
    rng = np.random.default_rng(0)
    out = dict(tf)
    for name, v in tf.items():
        out[f"{name}/adam_m"] = rng.standard_normal(v.shape).astype(np.float32)
        out[f"{name}/adam_v"] = rng.random(v.shape).astype(np.float32)
    out["global_step"] = np.array(36815, dtype=np.int64)
    return out


GOOGLE_CONFIG = {  # the fields of uncased_L-12_H-768_A-12/bert_config.json, tiny values
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTER,
    "max_position_embeddings": POS,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "type_vocab_size": 2,
    "vocab_size": VOCAB,
    "directionality": "bidi",
    "pooler_fc_size": HIDDEN,
    "pooler_type": "first_token_transform",
}


def write_tf_folder(folder, model, *, step=36815, config=True, extra=None, drop=()):
    folder.mkdir(parents=True, exist_ok=True)
    tf = with_optimizer_state(google_variables(model)) | (extra or {})
    for name in drop:
        tf.pop(name)
    w.write_bundle(folder / f"model.ckpt-{step}", tf, block_entries=16, restart_interval=16)
    (folder / "checkpoint").write_text(
        f'model_checkpoint_path: "/gpfs/mccoy/mnli_save/model.ckpt-{step}"\n'
    )
    if config:
        (folder / "bert_config.json").write_text(json.dumps(GOOGLE_CONFIG))
    return folder


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 9), generator=g)
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # premise | hypothesis
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # padding
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# -- Hugging Face folders -------------------------------------------------------------------------
def test_hf_folders(tmp_path):
    originals = [tiny_bert(s) for s in (0, 1)]
    for i, m in enumerate(originals):
        m.save_pretrained(tmp_path / f"bert_{i:02d}")
    (tmp_path / "bert_00.zip").write_bytes(b"")  # leftovers are ignored
    folders = list_bert_mnli(tmp_path)
    assert [f.name for f in folders] == ["bert_00", "bert_01"]
    x = batch()
    for folder, original in zip(folders, originals, strict=True):
        model = load_bert_mnli(folder, dtype=DT)
        assert type(model).__name__ == "BertForSequenceClassification" and not model.training
        assert model.config._attn_implementation == "eager"
        assert model.classifier.weight.dtype == DT
        for name, p in params(original).items():
            assert torch.equal(params(model)[name], p.double()), name
        with torch.no_grad():
            want = original.double()(**x).logits
            torch.testing.assert_close(model(**x).logits, want, rtol=1e-12, atol=1e-12)


def test_hf_symmetries_and_invariance(tmp_path):
    tiny_bert(0).save_pretrained(tmp_path / "m")
    model = load_bert_mnli(tmp_path / "m", dtype=DT)
    space = gs.find_symmetries(model)
    got = [(b.name, b.heads, b.head_dim) for b in space.gl_blocks]
    want = [
        (f"bert.encoder.layer.{i}.attention[{kind}]", HEADS, HIDDEN // HEADS)
        for i in range(LAYERS)
        for kind in ("QK", "VO")
    ]
    assert got == want
    assert gs.check_invariance(model, batch(), space=space).passed


def test_hf_wrong_number_of_labels(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=INTER, max_position_embeddings=POS, num_labels=2,
    )  # fmt: skip
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="has 2 labels, expected 3"):
        load_bert_mnli(tmp_path / "m")
    assert load_bert_mnli(tmp_path / "m", num_labels=None).config.num_labels == 2
    with pytest.raises(ValueError, match="apply to TF checkpoints only"):
        load_bert_mnli(tmp_path / "m", hidden_act="gelu_new")


# -- TensorFlow 1 checkpoints ---------------------------------------------------------------------
def test_tf1_round_trip_to_identical_weights(tmp_path):
    original = tiny_bert(3)
    folder = write_tf_folder(tmp_path / "bert_47", original)
    # an older checkpoint in the same folder, with other weights: 'checkpoint' picks the newest
    w.write_bundle(folder / "model.ckpt-1000", google_variables(tiny_bert(4)))
    model = load_bert_mnli(folder)
    assert type(model).__name__ == "BertForSequenceClassification" and not model.training
    assert model.config._attn_implementation == "eager"
    assert model.config.id2label == dict(enumerate(MNLI_LABELS))
    assert (model.config.num_attention_heads, model.config.hidden_act) == (HEADS, "gelu")
    loaded, want = params(model), params(original)
    assert loaded.keys() == want.keys()
    for name, p in want.items():  # float32 written, float32 read: bit-identical
        assert torch.equal(loaded[name], p), name
    x = batch(1)
    with torch.no_grad():
        assert torch.equal(model(**x).logits, original(**x).logits)
    # converted once to a Hugging Face folder (0.44 GB instead of 1.3 GB for BERT-base)
    model.save_pretrained(tmp_path / "hf_47")
    again = load_bert_mnli(tmp_path / "hf_47")
    assert again.config.id2label == dict(enumerate(MNLI_LABELS))
    assert all(torch.equal(p, want[n]) for n, p in params(again).items())
    # the same checkpoint through its .index file and its prefix
    for path in (folder / "model.ckpt-36815.index", folder / "model.ckpt-36815"):
        assert torch.equal(
            params(load_bert_mnli(path))["classifier.weight"], want["classifier.weight"]
        )


def test_tf1_without_config_reads_shapes(tmp_path):
    # Zenodo folders hold no bert_config.json: sizes from the shapes, heads = hidden // 64
    original = tiny_bert(5, heads=HIDDEN // 64)
    folder = write_tf_folder(tmp_path / "bert_00", original, config=False)
    model = load_bert_mnli(folder, dtype=DT)
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (
        VOCAB, HIDDEN, LAYERS, INTER,
    )  # fmt: skip
    assert (c.num_attention_heads, c.max_position_embeddings, c.type_vocab_size) == (1, POS, 2)
    space = gs.find_symmetries(model)
    assert [(b.heads, b.head_dim) for b in space.gl_blocks] == [(1, 64)] * 4
    assert gs.check_invariance(model, batch(), space=space).passed
    with torch.no_grad():
        torch.testing.assert_close(
            model(**batch()).logits, original.double()(**batch()).logits, rtol=1e-12, atol=1e-12
        )
    # config= overrides, as a dict (or a path); hidden_act too
    model = load_bert_mnli(folder, config={"num_attention_heads": 4}, hidden_act="gelu_new")
    assert (model.config.num_attention_heads, model.config.hidden_act) == (4, "gelu_new")


def test_tf1_population_listing(tmp_path):
    for i in (0, 2, 10):
        write_tf_folder(tmp_path / f"bert_{i:02d}", tiny_bert(i))
    (tmp_path / "notes").mkdir()
    assert [p.name for p in list_bert_mnli(tmp_path)] == ["bert_00", "bert_02", "bert_10"]
    with pytest.raises(FileNotFoundError, match="holds 3 checkpoint folders, expected 100"):
        list_bert_mnli(tmp_path, expected=100)


def test_tf1_errors(tmp_path):
    model = tiny_bert(0)
    extra = {"bert/encoder/layer_0/attention/self/rel/kernel": np.ones((2, 2), np.float32)}
    folder = write_tf_folder(tmp_path / "extra", model, extra=extra)
    with pytest.raises(ValueError, match=r"with no place in BERT \['bert/encoder/layer_0/attent"):
        load_bert_mnli(folder)
    folder = write_tf_folder(tmp_path / "missing", model, drop=["bert/pooler/dense/bias"])
    with pytest.raises(ValueError, match=r"no TF variable for \['bert.pooler.dense.bias'\]"):
        load_bert_mnli(folder)
    folder = write_tf_folder(tmp_path / "nohead", model, drop=["output_weights", "output_bias"])
    with pytest.raises(ValueError, match="not a fine-tuned sequence classifier"):
        load_bert_mnli(folder)
    folder = write_tf_folder(tmp_path / "badcfg", model)
    with pytest.raises(ValueError, match="shapes do not match the BERT config"):
        load_bert_mnli(folder, config=GOOGLE_CONFIG | {"intermediate_size": 2 * INTER})
    zips = tmp_path / "zips"
    zips.mkdir()
    (zips / "bert_47.zip").write_bytes(b"PK")
    with pytest.raises(FileNotFoundError, match="unzip the Zenodo archives first"):
        load_bert_mnli(zips)
    with pytest.raises(FileNotFoundError, match="unzip them first"):
        list_bert_mnli(zips)
    with pytest.raises(FileNotFoundError, match="it does not exist"):
        load_bert_mnli(tmp_path / "nowhere")
