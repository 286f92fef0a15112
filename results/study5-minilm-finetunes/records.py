"""What Study 5's training script records: the label noise as applied, and rows appended safely.

Kept apart from ``train.py`` (which imports torch and transformers) so that the correction of
the committed records (``correct_noise.py``) and the tests read the same code without them.
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
from pathlib import Path

import numpy as np


def noisy_labels(
    labels: np.ndarray, noise: float, protect: int, seed: int
) -> tuple[np.ndarray, int]:
    """Flip round(noise · (n − protect)) labels among positions ≥ protect (seeded by the model).

    Returns the labels and how many were flipped: none when the training set is no larger than
    the protected sharpness sample (n_train = 1,024), whatever ``noise`` was drawn.
    """
    out = labels.copy()
    n_flip = int(round(noise * max(len(labels) - protect, 0)))
    if n_flip:
        rng = np.random.default_rng([seed, 1])
        idx = protect + rng.choice(len(labels) - protect, size=n_flip, replace=False)
        out[idx] = 1 - out[idx]
    return out, n_flip


def applied_noise(hp: dict, n_flip: int) -> dict:
    """``hp`` with the noise as applied in place of the drawn rate.

    ``label_noise``: the fraction of the training set's labels flipped (``n_flip / n_train``;
    at most 0.2 · 3,072 / 4,096 = 0.15); ``label_flips``: how many. The drawn rate (of the
    labels outside the sharpness sample) is ``train_log.jsonl``'s ``label_noise_drawn``.
    """
    return {**hp, "label_noise": n_flip / hp["n_train"], "label_flips": n_flip}


def append(path: Path, columns: list[str], row: dict) -> None:
    """Append ``row`` to the CSV ``path``, with the header first when the file is empty.

    Shards append to one file at once: each write holds an exclusive ``flock`` on the file and
    looks at its size under the lock, so exactly one process (the first to lock it) writes the
    header, on line 1, and no row is interleaved with another.
    """
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    header = buf.tell()
    w.writerow(row)
    text = buf.getvalue()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = text if os.fstat(fd).st_size == 0 else text[header:]
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
