"""Issue 29, item 1: the tokenizer is checked against the model before any work.

A model folder saved without its tokenizer used to give a number: transformers 5 builds a
5-token ``BertTokenizer`` from ``config.json``, every word becomes ``[UNK]``, and the clean loss
is that of a model reading ``[UNK]``. Now ``geosharp measure`` says which tokenizer it uses
(where from, its size, the model's embedding rows, the unknown tokens of the first batch) and
refuses, in one line, a folder without a tokenizer file, a tokenizer whose size does not fit the
embedding table, and one that turns most of the first batch into the unknown token — for
classification, causal-LM and seq2seq data, ``--tokenizer`` and PEFT adapters alike.
"""

import json
import shutil

import pytest
import torch

from geosharp.measuring import MeasureError
from geosharp.measuring.checkpoint_files import has_tokenizer_files
from geosharp.measuring.data_loading import load_data
from geosharp.measuring.lm import load_lm_data, load_seq2seq_data
from geosharp.measuring.model_loading import load_model
from geosharp.measuring.tokenizer import MIN_VOCAB_COVERAGE

from .conftest import transformers

FAST = ["--measures", "geodesic-inv-o2", "--rho", "0.1", "--steps", "1", "--max-length", "32"]
VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *"the a movie film was great terrible boring good bad i loved it not worth ticket".split(),
    *"abcdefghijklmnopqrstuvwxyz",
    *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"],
]
ROWS = [("the movie was great", 1), ("a terrible boring film", 0), ("i loved it", 1)]


def one_error_line(err: str) -> str:
    """The single ``geosharp: error: ...`` line that stderr must be."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geosharp: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory):
    """A tiny BERT classifier saved twice: with its WordPiece tokenizer, and without one."""
    d = tmp_path_factory.mktemp("tokcheck")
    with_tok, without = d / "bert", d / "bert_no_tokenizer"
    with_tok.mkdir()
    (with_tok / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok = transformers.BertTokenizer.from_pretrained(str(with_tok))
    cfg = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    model.save_pretrained(with_tok)
    tok.save_pretrained(with_tok)
    model.save_pretrained(without)
    csv = d / "train.csv"
    csv.write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in ROWS))
    return with_tok, without, csv


def test_transformers_would_build_a_tokenizer_of_special_tokens(bert_dirs):
    """The silent failure the check guards against (kept as a test of the premise)."""
    _, without, _ = bert_dirs
    assert not has_tokenizer_files(without)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(without), local_files_only=True)
    except Exception:  # transformers 4 refuses by itself: nothing silent to guard against
        return
    assert len(tok) < MIN_VOCAB_COVERAGE * len(VOCAB)  # the 5 special tokens of BERT


# --------------------------------------------------------------------------------------------
# classification (the command line)


def test_folder_without_tokenizer_is_refused_in_one_line(bert_dirs, run_cli):
    _, without, csv = bert_dirs
    code, out, err = run_cli(without, csv, *FAST)
    line = one_error_line(err)
    assert code == 2 and "measuring" not in out
    assert "train.csv holds text, but the model comes with no tokenizer" in line
    assert "its folder has none: no tokenizer.json" in line and str(without) in line
    assert "tokenizer.save_pretrained" in line and "--tokenizer" in line


def test_the_right_tokenizer_is_named_with_its_size(bert_dirs, run_cli, tmp_path):
    with_tok, without, csv = bert_dirs
    rows = len(VOCAB)
    code, out, err = run_cli(with_tok, csv, *FAST, "--out", tmp_path / "a")
    assert code == 0, err
    n = len(transformers.AutoTokenizer.from_pretrained(str(with_tok)))
    assert (
        f"tokenizer: the model folder {with_tok} (BertTokenizer, {n} tokens; the model's "
        f"embedding table: {rows} rows); unknown token [UNK]: 0 of " in out
    )
    assert out.index("tokenizer: ") < out.index("measuring ")  # before any work
    # the folder without a tokenizer, given the right one with --tokenizer
    code, out, err = run_cli(without, csv, *FAST, "--tokenizer", with_tok, "--out", tmp_path / "b")
    assert code == 0, err
    assert f"tokenizer: --tokenizer {with_tok} (BertTokenizer, {n} tokens" in out
    a = json.loads((tmp_path / "a" / "results.json").read_text())["results"][0]["value"]
    b = json.loads((tmp_path / "b" / "results.json").read_text())["results"][0]["value"]
    assert a == b  # the same model, the same tokens: the same number


def test_a_tokenizer_that_turns_the_text_into_unknown_tokens_is_refused(
    bert_dirs, llama_dir, run_cli
):
    # the word-level tokenizer of the tiny Llama (46 tokens for BERT's 68 rows: it fits by
    # size) knows none of the movie-review words
    _, without, csv = bert_dirs
    code, _, err = run_cli(without, csv, *FAST, "--tokenizer", llama_dir)
    line = one_error_line(err)
    assert code == 2 and "of the first batch of train.csv" in line
    assert "are the unknown token <unk>" in line and f"--tokenizer {llama_dir}" in line
    assert "does not know the text's words" in line and "--tokenizer FOLDER" in line


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(
    bert_dirs, llama_dir, corpus_txt, run_cli
):
    with_tok, _, _ = bert_dirs
    code, _, err = run_cli(llama_dir, corpus_txt, *FAST, "--tokenizer", with_tok)
    line = one_error_line(err)
    assert code == 2 and "does not fit the model" in line
    assert "embedding table has 46 rows (ids 0..45)" in line and "--tokenizer FOLDER" in line


def test_a_tokenizer_far_smaller_than_the_embedding_table_is_refused(
    tokenizer, corpus_txt, tmp_path, run_cli, capsys
):
    # a Llama with 200 embedding rows and the 46-token tokenizer: under half of the table
    d = tmp_path / "wide_llama"
    cfg = transformers.LlamaConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=32, vocab_size=200, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    capsys.readouterr()  # the progress bar of save_pretrained
    code, _, err = run_cli(d, corpus_txt, *FAST)
    line = one_error_line(err)
    assert code == 2 and f"covers {len(tokenizer)} of the model's 200 embedding rows" in line
    assert "less than half" in line and f"the tokenizer of the model folder {d}" in line


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(bert_dirs, run_cli):
    _, without, csv = bert_dirs
    code, _, err = run_cli(without, csv, *FAST, "--tokenizer", without)
    line = one_error_line(err)
    assert code == 2 and f"--tokenizer {without} holds no tokenizer file" in line


# --------------------------------------------------------------------------------------------
# causal-lm, seq2seq, PEFT


def test_causal_lm_text_of_unknown_words_is_refused(llama_dir, tmp_path, run_cli):
    corpus = tmp_path / "other.txt"
    corpus.write_text("zebras quietly juggle purple violins\nquantum ferrets dislike tuesdays\n")
    code, _, err = run_cli(llama_dir, corpus, *FAST)
    line = one_error_line(err)
    assert code == 2 and "are the unknown token <unk>" in line
    assert f"the tokenizer of the model folder {llama_dir}" in line


def test_seq2seq_checks_its_tokenizer(t5_dir, bert_dirs, pairs_jsonl, tmp_path, run_cli):
    code, out, err = run_cli(t5_dir, pairs_jsonl, *FAST, "--out", tmp_path / "o")
    assert code == 0, err
    assert f"tokenizer: the model folder {t5_dir} (" in out and "unknown token <unk>: 0 of" in out
    with_tok, _, _ = bert_dirs
    code, _, err = run_cli(t5_dir, pairs_jsonl, *FAST, "--tokenizer", with_tok)
    assert code == 2 and "does not fit the model" in one_error_line(err)
    strange = tmp_path / "strange.jsonl"
    strange.write_text(json.dumps({"question": "zebras juggle violins", "answer": "ferrets"}))
    code, _, err = run_cli(t5_dir, strange, *FAST)
    assert code == 2 and "are the unknown token" in one_error_line(err)


def test_peft_adapter_uses_its_base_models_tokenizer_and_says_so(
    adapter_dir, llama_dir, corpus_txt, tmp_path, run_cli
):
    code, out, err = run_cli(adapter_dir, corpus_txt, *FAST, "--out", tmp_path / "o")
    assert code == 0, err
    assert f"tokenizer: the base model folder {llama_dir} (" in out
    # the same adapter on a copy of its base saved without the tokenizer
    bare = tmp_path / "bare_base"
    shutil.copytree(llama_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    code, _, err = run_cli(adapter_dir, corpus_txt, *FAST, "--base", bare)
    line = one_error_line(err)
    assert code == 2 and "comes with no tokenizer" in line
    assert f"in the adapter folder {adapter_dir} nor in the base model folder {bare}" in line
    code, out, err = run_cli(
        adapter_dir, corpus_txt, *FAST, "--base", bare, "--tokenizer", llama_dir,
        "--out", tmp_path / "p",
    )  # fmt: skip
    assert code == 0, err
    assert f"tokenizer: --tokenizer {llama_dir}" in out


# --------------------------------------------------------------------------------------------
# the Python loaders (gs.measure takes batches and loads no tokenizer)


def test_python_loaders_check_the_tokenizer_too(
    bert_dirs, llama_dir, t5_dir, pairs_jsonl, corpus_txt
):
    with_tok, without, csv = bert_dirs
    with pytest.raises(MeasureError, match="comes with no tokenizer"):
        load_data(str(csv), load_model(str(without)), max_length=32)
    data = load_data(str(csv), load_model(str(with_tok)), max_length=32)
    assert data.info[0].startswith(f"tokenizer: the model folder {with_tok} (BertTokenizer")
    data = load_data(str(csv), load_model(str(without)), max_length=32, tokenizer=str(with_tok))
    assert data.info[0].startswith(f"tokenizer: --tokenizer {with_tok}")
    llama = load_model(str(llama_dir), task="causal-lm")
    with pytest.raises(MeasureError, match="does not fit the model"):
        load_lm_data(str(corpus_txt), llama, max_length=32, tokenizer=str(with_tok))
    assert "unknown token <unk>: 0 of" in load_lm_data(str(corpus_txt), llama).info[0]
    t5 = load_model(str(t5_dir), task="seq2seq")
    assert "tokenizer: the model folder" in load_seq2seq_data(str(pairs_jsonl), t5).info[0]
