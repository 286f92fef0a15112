"""Data files as ordinary tools write them: a byte-order mark, and rows whose text is empty."""

from __future__ import annotations

import pytest
import torch

from geosharp.measuring.data_files import read_table
from geosharp.measuring.data_loading import tokenize_rows
from geosharp.measuring.errors import MeasureError
from geosharp.measuring.lm import _read_txt, _texts

from .conftest import make_tokenizer

BOM = "\ufeff".encode()


@pytest.mark.parametrize(
    "name, text",
    [
        ("d.csv", 'text,label\n"the cat sat",0\n"a dog ran",1\n'),
        ("d.tsv", "text\tlabel\nthe cat sat\t0\na dog ran\t1\n"),
        ("d.jsonl", '{"text": "the cat sat", "label": 0}\n{"text": "a dog ran", "label": 1}\n'),
        ("d.json", '[{"text": "the cat sat", "label": 0}, {"text": "a dog ran", "label": 1}]'),
    ],
)
def test_a_data_file_saved_with_a_byte_order_mark(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(BOM + text.encode())
    rows, _ = read_table(str(path))
    assert rows == [{"text": "the cat sat", "label": rows[0]["label"]}, rows[1]]
    assert list(rows[0]) == ["text", "label"] and str(rows[1]["label"]) == "1"


def test_a_corpus_saved_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(BOM + b"the cat sat\n")
    assert _read_txt(path) == "the cat sat\n"


@pytest.mark.parametrize("blank", ["", "   "])
def test_rows_with_empty_text_are_refused_in_one_line_naming_them(blank):
    rows = [{"text": t, "label": 0} for t in ("the cat sat", blank, "a dog ran", blank)]
    with pytest.raises(MeasureError) as err:
        tokenize_rows(rows, tokenizer=make_tokenizer(), text_cols=["text"],
                      targets=torch.zeros(4, dtype=torch.long), batch_size=2, max_length=16,
                      where="d.csv")  # fmt: skip
    text = str(err.value)
    assert "\n" not in text and text.startswith("d.csv: the text column 'text' is empty")
    assert "rows 2, 4 of 4" in text
    with pytest.raises(MeasureError, match="rows 2, 4 of 4"):
        _texts(rows, "text", "d.csv", "text")
