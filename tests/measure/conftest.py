"""Tiny language models saved from configs (Llama, GPT-2, T5, a LoRA adapter) and corpora.

Every folder holds a word-level tokenizer trained on :data:`CORPUS` (``tokenizers``, saved as a
``PreTrainedTokenizerFast``), so nothing is downloaded.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park and the cat ran after it",
    "the sun is hot today",
    "i saw a bird",
    "the old man and the sea",
    "she reads a book in the park every day",
    "we like the cat",
]
PAIRS = [
    {"question": "where did the cat sit", "answer": "on the mat"},
    {"question": "who ran in the park", "answer": "a dog and the cat"},
    {"question": "is the sun hot", "answer": "the sun is hot today"},
    {"question": "what did i see", "answer": "a bird"},
    {"question": "what does she read", "answer": "a book"},
]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def save_tiny_classifier(folder, tok, seed: int, **config) -> None:
    """A tiny ``BertForSequenceClassification`` over ``tok``'s words (2 labels), seeded, saved.

    ``config``: more ``BertConfig`` fields (e.g. ``initializer_range``).
    """
    import torch
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
        pad_token_id=tok.pad_token_id,
        **config,
    )
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(cfg).save_pretrained(folder)


def save_tiny_manifest(root, rows, header, **config) -> None:
    """A manifest study's folder: a tiny classifier per row, ``data.csv`` and ``m.csv``.

    ``rows``: ``(name, *metrics)``; the model of row ``i`` is :func:`save_tiny_classifier`'s with
    seed ``i`` (``config``: more ``BertConfig`` fields) beside the tokenizer; ``data.csv`` holds
    :data:`CORPUS` labelled alternately 0 and 1; ``m.csv`` the rows under ``header``.
    """
    import csv

    tok = make_tokenizer()
    for i, (name, *_rest) in enumerate(rows):
        save_tiny_classifier(root / name, tok, seed=i, **config)
        tok.save_pretrained(root / name)
    with (root / "data.csv").open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *((t, i % 2) for i, t in enumerate(CORPUS))])
    with (root / "m.csv").open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])


def make_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the words of the corpus and the pairs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    texts = CORPUS + [v for p in PAIRS for v in p.values()] + ["body text with words"]
    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    bos, eos = tk.token_to_id("<s>"), tk.token_to_id("</s>")
    # a BOS in front of every text, as Llama's tokenizer does; an EOS after a seq2seq target
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer):
    """A 2-layer ``LlamaForCausalLM`` (4 heads, 2 key/value heads) with its tokenizer."""
    d = tmp_path_factory.mktemp("tinyllama")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, tokenizer):
    """A 2-layer ``GPT2LMHeadModel`` with its tokenizer."""
    d = tmp_path_factory.mktemp("tinygpt2")
    cfg = transformers.GPT2Config(
        n_embd=32, n_head=4, n_layer=2, n_positions=64, vocab_size=len(tokenizer)
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def t5_dir(tmp_path_factory, tokenizer):
    """A 2+2-layer ``T5ForConditionalGeneration`` and its tokenizer; pad id 0 starts the decoder."""
    d = tmp_path_factory.mktemp("tinyt5")
    cfg = transformers.T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory, llama_dir):
    """A LoRA adapter (r=4 on q_proj, v_proj and down_proj) of the tiny Llama; no tokenizer."""
    peft = pytest.importorskip("peft")
    d = tmp_path_factory.mktemp("tinylora")
    base = transformers.LlamaForCausalLM.from_pretrained(str(llama_dir))
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,  # B != 0: a trained-looking adapter, not the zero update
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(1)
    peft.get_peft_model(base, cfg).save_pretrained(str(d))
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        llama_dir
    )
    return d


@pytest.fixture(scope="session")
def corpus_txt(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = d / "corpus.txt"
    path.write_text("\n".join(CORPUS[:3]) + "\n\n" + "\n".join(CORPUS[3:]) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = d / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(CORPUS)))
    return path


@pytest.fixture(scope="session")
def pairs_jsonl(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    path = d / "qa.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    return path


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out runs/measure lands in the test's folder
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run_cli passes --threads 1


@pytest.fixture
def run_cli(capsys):
    """``run_cli(*ARGS)``: ``geosharp measure ARGS`` on one thread → (code, stdout, stderr)."""
    from geosharp.cli import main

    def run(*args):
        code = main(["measure", *map(str, args), "--no-progress", "--threads", "1"])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return code, out, err

    return run
