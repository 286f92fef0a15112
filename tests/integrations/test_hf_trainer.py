"""SharpnessCallback with a real transformers.Trainer on tiny models built from configs."""

import math
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from geosharp.integrations.hf_trainer import (  # noqa: E402
    LOG_PREFIX,
    SharpnessCallback,
    causal_lm_loss,
    is_causal_lm,
)

VOCAB = 40
MEASURES = ("geodesic-inv", "adaptive")


def tiny_bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )  # dropout 0.1 left on: training draws from the global RNG
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def tiny_lora_llama():
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B = 0 at init would make every adapter's geodesic ball degenerate
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def classification_data(n=8, length=6):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long),
         "labels": labels[i]}
        for i in range(n)
    ]  # fmt: skip


def lm_data(n=8, length=6):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, VOCAB, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[::3, -2:] = 0  # some padding, masked out of the loss
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def train(model, data, tmp_path, callbacks=(), install=None, max_steps=4):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        logging_steps=1000,  # the Trainer logs on its own only at the end
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=list(callbacks)
    )
    if install is not None:
        install.install(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def sharpness_entries(trainer):
    return [e for e in trainer.state.log_history if any(k.startswith(LOG_PREFIX) for k in e)]


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_classifier_fires_at_expected_steps_and_logs(tmp_path):
    data = classification_data()
    cb = SharpnessCallback([collate(data[:4])], every_n_steps=2, rho=0.05, steps=2)
    trainer = train(tiny_bert(), data, tmp_path, [cb])
    assert [step for step, _ in cb.history] == [2, 4]
    for _, values in cb.history:
        assert set(values) == set(MEASURES)
        assert all(math.isfinite(v) and v > 0 for v in values.values())
    entries = sharpness_entries(trainer)
    assert [e["step"] for e in entries] == [2, 4]
    for (_, values), entry in zip(cb.history, entries, strict=True):
        for m in MEASURES:
            assert entry[LOG_PREFIX + m] == values[m]
        assert "loss" in entry  # the Trainer's own training log of that step
    assert [s for s, _ in cb.results] == [2, 4]
    res = cb.results[0][1]["geodesic-inv"]
    assert res.measure == "geodesic-inv-o2 worst l2" and res.settings["n_gl_blocks"] > 0


def test_training_is_identical_with_and_without_the_callback(tmp_path):
    data = classification_data()
    plain = train(tiny_bert(), data, tmp_path / "a").model
    cb = SharpnessCallback([collate(data[:4])], every_n_steps=1, rho=0.05, steps=2)
    measured = train(tiny_bert(), data, tmp_path / "b", [cb]).model
    assert len(cb.history) == 4
    a, b = state(plain), state(measured)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert measured.training == plain.training


def test_causal_lm_lora_trainer(tmp_path):
    model = tiny_lora_llama()
    assert is_causal_lm(model) and is_causal_lm(model.get_base_model())
    data = lm_data()
    cb = SharpnessCallback([collate(data[:4])], every_n_steps=2, rho=0.05, steps=2)
    trainer = train(model, data, tmp_path, [cb])
    assert [s for s, _ in cb.history] == [2, 4]
    assert all(math.isfinite(v) and v > 0 for _, vals in cb.history for v in vals.values())
    assert [e["step"] for e in sharpness_entries(trainer)] == [2, 4]
    res = cb.results[-1][1]["geodesic-inv"]
    assert res.settings["n_gl_blocks"] == 2  # one GL(2) block per adapted projection
    measured = [n for n, _ in trainer.model.named_parameters() if n not in res.excluded]
    assert measured and all("lora_" in n for n in measured)


def test_causal_lm_default_loss_is_the_models_own_loss():
    model = tiny_llama().eval()
    batch = collate(lm_data()[:4])
    cb = SharpnessCallback([batch], rho=0.05, steps=2)
    (inputs, labels), = cb._prepare(model)[0]  # fmt: skip
    assert "labels" not in inputs and inputs["use_cache"] is False
    with torch.no_grad():
        own = model(**batch).loss
        ours = causal_lm_loss(model(**inputs), labels)
    torch.testing.assert_close(ours, own)
    # without labels: the input ids, padding ignored
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    (_, derived), = SharpnessCallback([no_labels])._prepare(model)[0]  # fmt: skip
    assert torch.equal(derived, batch["labels"])


def test_install_puts_values_before_reporting_integrations(tmp_path):
    class Recorder(transformers.TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    data = classification_data()
    batches = [collate(data[:4])]
    before, cb = Recorder(), SharpnessCallback(batches, every_n_steps=2, rho=0.05, steps=2)
    train(tiny_bert(), data, tmp_path / "a", [before, cb])
    # a callback that runs before this one has read the logs before the values were added
    assert not any(LOG_PREFIX + "adaptive" in logs for logs in before.logs)
    before, cb = Recorder(), SharpnessCallback(batches, every_n_steps=2, rho=0.05, steps=2)
    trainer = train(tiny_bert(), data, tmp_path / "b", [before], install=cb)
    assert trainer.callback_handler.callbacks[0] is cb
    seen = [logs for logs in before.logs if LOG_PREFIX + "adaptive" in logs]
    assert len(seen) == 2 and all(logs[LOG_PREFIX + "geodesic-inv"] > 0 for logs in seen)


def test_measure_leaves_weights_grads_modes_and_rng_alone():
    model = tiny_bert()
    model.train()
    model.bert.embeddings.eval()  # a submodule in eval mode inside a training model
    batch = collate(classification_data()[:4])
    out = model(**batch)
    out.loss.backward()  # grads present, as between backward and optimizer step
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    measures = ["geodesic-inv", "adaptive", "geodesic-mix-average"]
    values = SharpnessCallback([batch], rho=0.05, steps=2, measures=measures).measure(model)
    assert all(math.isfinite(v) for v in values.values())  # an average rise may be < 0
    assert values["geodesic-inv"] > 0 and values["adaptive"] > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert {n: m.training for n, m in model.named_modules()} == modes
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1])


def test_seq2seq_batches_get_decoder_inputs():
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(5)
    batch = {
        "input_ids": torch.randint(1, VOCAB, (2, 5), generator=g),
        "labels": torch.randint(1, VOCAB, (2, 4), generator=g),
    }
    cb = SharpnessCallback([batch], rho=0.05, steps=2)
    values = cb.measure(model)
    (inputs, _), = cb._prepare(model)[0]  # fmt: skip
    assert inputs["decoder_input_ids"].shape == (2, 4)
    assert all(math.isfinite(v) and v > 0 for v in values.values())


def test_a_plain_module_with_pairs_and_a_loss():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(3, 4, 8)
    cb = SharpnessCallback([(x, x)], nn.functional.mse_loss, measures=["geodesic-mix", "adaptive"],
                           rho={"geodesic-mix": 0.01, "adaptive": 0.1}, steps=2)  # fmt: skip
    assert cb.log_keys == ["sharpness/geodesic-mix", "sharpness/adaptive"]
    assert cb.rhos == {"geodesic-mix": 0.01, "adaptive": 0.1}
    values = cb.measure(layer)
    assert all(v > 0 for v in values.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batches": []}, "batches is empty"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"measures": ["curvature-inv-lmax"]}, "sharpness"),
        ({"measures": ["nonsense"]}, "unknown measure"),
        ({"measures": ["geodesic-inv", "geodesic-inv-o2"]}, "same measure twice"),
        ({"rho": {"adaptive": 0.1}}, "no radius for measure 'geodesic-inv'"),
        ({"rho": -1.0}, "finite number > 0"),
        ({"steps": 0}, "steps"),
        ({"kind": "average"}, "set by the callback"),
    ],
)
def test_bad_settings(kwargs, match):
    kwargs = {"batches": [(torch.zeros(1), torch.zeros(1))], **kwargs}
    with pytest.raises(ValueError, match=match):
        SharpnessCallback(**kwargs)


def test_causal_batch_that_predicts_nothing_fails_before_training():
    batch = collate(lm_data()[:2])
    batch["labels"][:] = -100
    with pytest.raises(ValueError, match="predicts no token"):
        SharpnessCallback([batch])._prepare(tiny_llama())
