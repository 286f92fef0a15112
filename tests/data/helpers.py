"""Shared helpers of the data tests: skip where a data wheel is not installed."""

from importlib import metadata

import pytest


def needs_wheel(distribution: str, version: str) -> pytest.MarkDecorator:
    """Skip unless ``distribution`` is installed (``pip install --no-deps NAME==VERSION``)."""
    try:
        metadata.distribution(distribution)
        missing = False
    except metadata.PackageNotFoundError:
        missing = True
    return pytest.mark.skipif(
        missing, reason=f"needs `pip install --no-deps {distribution}=={version}`"
    )
