"""The causal-lm and seq2seq tasks of ``geosharp measure`` and PEFT adapter folders, on tiny
Llama, GPT-2, T5 and LoRA folders saved from configs (see ``conftest.py``)."""

import json
import shutil

import pytest
import torch
from torch import nn

from geosharp.measuring import MeasureError
from geosharp.measuring.lm import load_lm_data, load_seq2seq_data, next_token_targets
from geosharp.measuring.lm_tasks import detect_task
from geosharp.measuring.losses import default_loss
from geosharp.measuring.model_loading import load_model

from .conftest import CORPUS, PAIRS

FAST = ["--measures", "geodesic-inv-o2", "--rho", "0.1", "--steps", "2", "--max-length", "32"]


def hand_next_token_loss(logits, input_ids, attention_mask):
    """Mean over every real (unpadded) position t < T-1 of -log p(token t+1 | tokens ≤ t)."""
    total, count = 0.0, 0
    logp = torch.log_softmax(logits.double(), dim=-1)
    for i in range(input_ids.shape[0]):
        n = int(attention_mask[i].sum())
        for t in range(n - 1):
            total -= float(logp[i, t, input_ids[i, t + 1]])
            count += 1
    return total / count, count


def per_sequence_loss(model, ids):
    """The next-token loss of one sequence, alone in its batch (no padding)."""
    ids = torch.tensor([ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return float(default_loss(out, next_token_targets(ids, mask)))


# --------------------------------------------------------------------------------------------
# choosing the task


def test_detect_task(llama_dir, gpt2_dir, t5_dir, adapter_dir):
    assert detect_task(str(llama_dir)) == (
        "causal-lm",
        "config architectures LlamaForCausalLM, a causal language model",
    )
    assert detect_task(str(gpt2_dir))[0] == "causal-lm"
    assert "GPT2LMHeadModel" in detect_task(str(gpt2_dir))[1]
    task, why = detect_task(str(t5_dir))
    assert task == "seq2seq" and "T5ForConditionalGeneration" in why and "encoder-decoder" in why
    assert detect_task(str(adapter_dir)) == ("causal-lm", "the adapter's task_type CAUSAL_LM")
    assert detect_task(str(llama_dir), forced="seq2seq") == ("seq2seq", "--task seq2seq")
    assert detect_task("pkg.mod:build")[0] == "classification"
    with pytest.raises(MeasureError, match="unknown --task"):
        detect_task(str(llama_dir), forced="lm")


# --------------------------------------------------------------------------------------------
# the causal-lm loss


def test_causal_lm_loss_is_masked_next_token_cross_entropy(llama_dir, corpus_jsonl):
    loaded = load_model(str(llama_dir), task="causal-lm")
    assert loaded.task == "causal-lm" and loaded.model.config.use_cache is False
    data = load_lm_data(
        str(corpus_jsonl), loaded, batch_size=4, samples=None, text_col="body", max_length=32
    )
    assert len(data.batches) == 2 and data.n_samples == len(CORPUS)
    inputs, targets = data.batches[0]
    assert set(inputs) == {"input_ids", "attention_mask"}
    mask = inputs["attention_mask"]
    assert not bool(mask.all())  # the batch is padded ...
    assert bool((mask[:, 1:] <= mask[:, :-1]).all())  # ... on the right
    tok = loaded.tokenizer
    assert inputs["input_ids"][0, : int(mask[0].sum())].tolist() == tok(CORPUS[0])["input_ids"]
    with torch.no_grad():
        out = loaded.model(**inputs)
    loss = float(default_loss(out, targets))
    hand, count = hand_next_token_loss(out.logits, inputs["input_ids"], mask)
    assert count == int((targets != -100).sum())
    assert loss == pytest.approx(hand, rel=1e-5)
    # the model's own loss from labels = input_ids with padding -100 agrees
    labels = inputs["input_ids"].masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = loaded.model(**inputs, labels=labels).loss
    assert loss == pytest.approx(float(ref), rel=1e-5)
    assert data.n_tokens == sum(int((t != -100).sum()) for _, t in data.batches)


def test_padding_does_not_change_the_loss(llama_dir, tokenizer):
    loaded = load_model(str(llama_dir), task="causal-lm")
    model = loaded.model
    short, long = tokenizer(CORPUS[3])["input_ids"], tokenizer(CORPUS[1])["input_ids"]
    alone = per_sequence_loss(model, short)
    # padded to the longer sequence, and further still with another pad id (masked, so any id)
    for pad_to, pad_id in ((len(long), tokenizer.pad_token_id), (len(long) + 7, 5)):
        seqs = [short, long]
        ids = torch.tensor([s + [pad_id] * (pad_to - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (pad_to - len(s)) for s in seqs])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        targets = next_token_targets(ids, mask)
        padded = float(nn.functional.cross_entropy(logits[0], targets[0], ignore_index=-100))
        assert padded == pytest.approx(alone, rel=1e-5, abs=1e-6)


def test_txt_corpus_lines_and_chunks(llama_dir, corpus_txt):
    loaded = load_model(str(llama_dir), task="causal-lm")
    lines = load_lm_data(str(corpus_txt), loaded, batch_size=3, samples=None, max_length=32)
    # one document per non-empty line, in the file's order: the same batches on every run
    assert lines.n_samples == len(CORPUS) and len(lines.batches) == 3
    again = load_lm_data(str(corpus_txt), loaded, batch_size=3, samples=None, max_length=32)
    for (a, ta), (b, tb) in zip(lines.batches, again.batches, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(ta, tb)
    first = lines.batches[0][0]
    assert (
        first["input_ids"][0, : int(first["attention_mask"][0].sum())].tolist()
        == (loaded.tokenizer(CORPUS[0])["input_ids"])
    )
    # --max-length truncates, with a warning
    cut = load_lm_data(str(corpus_txt), loaded, batch_size=8, samples=None, max_length=5)
    assert cut.batches[0][0]["input_ids"].shape[1] == 5
    assert any("longer than --max-length 5" in w for w in cut.warnings)
    # --samples keeps the first documents
    assert load_lm_data(str(corpus_txt), loaded, samples=2, max_length=32).n_samples == 2
    # chunks: the whole file in blocks of max_length tokens, one BOS at the start
    chunks = load_lm_data(
        str(corpus_txt), loaded, batch_size=2, samples=None, max_length=8, txt_mode="chunks"
    )
    ids = torch.cat([b["input_ids"][b["attention_mask"].bool()] for b, _ in chunks.batches])
    words = sum(len(t.split()) for t in CORPUS)
    assert ids.numel() == words + 1 and int((ids == loaded.tokenizer.bos_token_id).sum()) == 1
    assert all(b["input_ids"].shape[1] == 8 for b, _ in chunks.batches[:-1])


def test_cli_llama_txt(llama_dir, corpus_txt, tmp_path, run_cli):
    code, out, err = run_cli(
        llama_dir, corpus_txt, *FAST, "--batch-size", "3", "--out", tmp_path / "o"
    )
    assert code == 0, err
    assert "invariance check PASSED" in out  # the rotary Q/K, GQA V/O blocks of Llama
    assert "task: causal-lm (config architectures LlamaForCausalLM, a causal language model)" in out
    assert out.index("task: causal-lm") < out.index("model: ") < out.index("data: ")
    assert "one document per line" in out and "padded on the right" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["settings"]["task"] == "causal-lm" and res["settings"]["samples"] == len(CORPUS)
    assert res["settings"]["loss"] == "auto: cross-entropy"
    assert res["settings"]["n_tokens"] == sum(len(t.split()) for t in CORPUS)  # BOS + words - 1
    assert res["n_batches"] == 3 and res["results"][0]["value"] > 0


def test_cli_llama_jsonl_clean_loss_is_the_models_lm_loss(
    llama_dir, corpus_jsonl, tokenizer, tmp_path, run_cli
):
    code, out, err = run_cli(
        llama_dir, corpus_jsonl, "--text-col", "body", *FAST, "--batch-size", "4",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "text column 'body'" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    # batch 0, rebuilt here: the model's own loss on labels = input_ids, padding -100
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(llama_dir)).eval()
    enc = tokenizer(CORPUS[:4], padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    with torch.no_grad():
        ref = model(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels
        ).loss
    assert res["clean_losses"][0] == pytest.approx(float(ref), rel=1e-5)


def test_cli_gpt2_chunks(gpt2_dir, corpus_txt, tmp_path, run_cli):
    code, out, err = run_cli(
        gpt2_dir, corpus_txt, "--txt-mode", "chunks", *FAST, "--max-length", "10",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "task: causal-lm (config architectures GPT2LMHeadModel" in out
    assert "the whole file in chunks of ≤ 10 tokens" in out
    assert "invariance check PASSED" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["results"][0]["value"] > 0 and res["results"][0]["error"] is None


def test_causal_lm_bad_input(llama_dir, corpus_txt, corpus_jsonl, tmp_path, run_cli):
    bare = tmp_path / "no_tokenizer"
    shutil.copytree(llama_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    code, _, err = run_cli(bare, corpus_txt, *FAST)
    assert code == 2 and "comes with no tokenizer (its folder has none:" in err
    assert "--tokenizer" in err
    code, _, err = run_cli(bare, corpus_txt, *FAST, "--tokenizer", llama_dir)
    assert code == 0, err
    code, _, err = run_cli(llama_dir, corpus_jsonl, *FAST)
    assert code == 2 and "no text column 'text'" in err and "body" in err
    code, _, err = run_cli(llama_dir, corpus_txt, *FAST, "--loss", "mse")
    assert code == 2 and "does not fit the causal-lm task" in err
    np = pytest.importorskip("numpy")
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 3)), y=np.zeros(2))
    code, _, err = run_cli(llama_dir, tmp_path / "x.npz", *FAST)
    assert code == 2 and "reads a text corpus" in err


def test_datasets_folder_and_parquet_corpus(llama_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    loaded = load_model(str(llama_dir), task="causal-lm")
    ds = datasets.Dataset.from_dict({"text": CORPUS})
    ds.save_to_disk(str(tmp_path / "ds"))
    ds.to_parquet(str(tmp_path / "c.parquet"))
    a = load_lm_data(str(tmp_path / "ds"), loaded, batch_size=4, samples=None, max_length=32)
    b = load_lm_data(str(tmp_path / "c.parquet"), loaded, batch_size=4, samples=5, max_length=32)
    assert a.n_samples == len(CORPUS) and b.n_samples == 5
    assert torch.equal(a.batches[0][0]["input_ids"], b.batches[0][0]["input_ids"])


# --------------------------------------------------------------------------------------------
# seq2seq


def test_seq2seq_loss_is_the_models_labels_loss(t5_dir, pairs_jsonl):
    loaded = load_model(str(t5_dir), task="seq2seq")
    data = load_seq2seq_data(str(pairs_jsonl), loaded, batch_size=3, samples=None, max_length=32)
    assert "source 'question' → target 'answer'" in data.description
    assert len(data.batches) == 2 and data.n_samples == len(PAIRS)
    inputs, labels = data.batches[0]
    assert set(inputs) == {"input_ids", "attention_mask", "decoder_input_ids"}
    assert bool((labels == -100).any())  # target padding is masked
    with torch.no_grad():
        out = loaded.model(**inputs)
        ref = loaded.model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels
        ).loss
    assert float(default_loss(out, labels)) == pytest.approx(float(ref), rel=1e-6)
    # the decoder starts with decoder_start_token_id and is teacher-forced on the target
    assert inputs["decoder_input_ids"][:, 0].tolist() == [0] * 3
    target = loaded.tokenizer(text_target=PAIRS[0]["answer"])["input_ids"]
    assert labels[0, : len(target)].tolist() == target


def test_cli_t5(t5_dir, pairs_jsonl, tmp_path, run_cli):
    code, out, err = run_cli(
        t5_dir, pairs_jsonl, "--source-col", "question", "--target-col", "answer", *FAST,
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "task: seq2seq (config architectures T5ForConditionalGeneration, an encoder" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["settings"]["task"] == "seq2seq" and res["results"][0]["value"] > 0
    code, _, err = run_cli(t5_dir, pairs_jsonl, "--target-col", "nosuch", *FAST)
    assert code == 2 and "no target column 'nosuch'" in err and "question, answer" in err


# --------------------------------------------------------------------------------------------
# PEFT adapters


def test_cli_lora_adapter(adapter_dir, llama_dir, corpus_txt, tmp_path, run_cli):
    code, out, err = run_cli(adapter_dir, corpus_txt, *FAST, "--out", tmp_path / "o")
    assert code == 0, err
    assert "task: causal-lm (the adapter's task_type CAUSAL_LM)" in out
    assert "PEFT LORA adapter (r=4, on down_proj, q_proj, v_proj)" in out
    assert "sharpness is measured over the adapter's 1,664 trainable parameters (LoRA A/B)" in out
    assert "the base model's 21,536 parameters are frozen" in out
    assert "invariance check PASSED" in out or "nothing to re-parametrize" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    # 2 layers x (q: 4x32 + 32x4, v: 4x32 + 16x4, down: 4x64 + 32x4)
    assert res["settings"]["n_params"] == 2 * (256 + 192 + 384) == 1664
    assert res["settings"]["model_kind"] == "peft" and res["results"][0]["value"] > 0


def test_cli_lora_adapter_self_check_covers_the_lora_blocks(
    adapter_dir, corpus_txt, tmp_path, run_cli
):
    """Assumes the symmetry finder's LoRA GL(r) blocks: one per adapted module."""
    code, out, err = run_cli(adapter_dir, corpus_txt, *FAST, "--out", tmp_path / "o")
    assert code == 0, err
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["invariance_check"]["passed"] and res["invariance_check"]["n_blocks"] == 6
    assert "every trainable coordinate belongs to a symmetry block" in out


def test_lora_adapter_loading(adapter_dir, llama_dir, tmp_path, run_cli, corpus_txt):
    loaded = load_model(str(adapter_dir))
    names = [n for n, p in loaded.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert loaded.tokenizer is not None  # the base folder's
    # the adapter is applied: its output differs from the base model's
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(str(llama_dir)).eval()
    ids = torch.tensor([[2, 5, 6, 7]])
    with torch.no_grad():
        assert not torch.allclose(loaded.model(input_ids=ids).logits, base(input_ids=ids).logits)
    # a base model that is not here: a clear error, and --base fixes it
    moved = tmp_path / "adapter"
    shutil.copytree(adapter_dir, moved)
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "meta-llama/Llama-3.2-1B"
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(moved, corpus_txt, *FAST)
    assert code == 2 and "'meta-llama/Llama-3.2-1B'" in err and "--base PATH" in err
    code, out, err = run_cli(moved, corpus_txt, *FAST, "--base", llama_dir, "--out", tmp_path / "o")
    assert code == 0, err
    assert f"on the base model {llama_dir}" in out


def test_task_classification_on_a_causal_lm_folder(llama_dir, tmp_path, run_cli):
    """--task classification puts a fresh classification head on a causal LM's body."""
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f'"{t}",{i % 2}\n' for i, t in enumerate(CORPUS)))
    code, out, err = run_cli(
        llama_dir, data, "--task", "classification", *FAST, "--out", tmp_path / "o"
    )
    assert code == 0, err
    assert "task: classification (--task classification)" in out
    assert "(LlamaForSequenceClassification)" in out and "fresh head with 2 labels" in err


def test_large_logits_are_announced(llama_dir, corpus_txt, monkeypatch):
    from geosharp.measuring import lm

    loaded = load_model(str(llama_dir), task="causal-lm")
    assert not [w for w in load_lm_data(str(corpus_txt), loaded).warnings if "logits" in w]
    monkeypatch.setattr(lm, "LOGITS_WARN_BYTES", 1000)
    data = load_lm_data(str(corpus_txt), loaded, batch_size=4)
    assert [w for w in data.warnings if "the logits of one batch take" in w and "--batch-size" in w]
