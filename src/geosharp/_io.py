"""Atomic file writes: a reader (or a second writer) never sees a half-written file.

Every writer goes through a temporary file of its own in the target's folder — its name is
unique to the process and the call, so two processes writing the same report at the same time
cannot clobber each other's temporary file — and :func:`os.replace` moves it into place. The
last complete write wins.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "torch_save_atomically"]


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write`` on a fresh binary file, then move it to ``path`` in one step.

    Args:
        path: Destination; its folder is created if missing.
        write: Writes the content to the open binary file it is given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> atomic_write(d / "a.bin", lambda f: f.write(b"hi")).read_bytes()
        b'hi'
        >>> sorted(p.name for p in d.iterdir())  # no temporary file left behind
        ['a.bin']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file private (0600); give it the mode open() would have.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; restore at once
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode(encoding))


def torch_save_atomically(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write`)."""
    import torch

    return atomic_write(path, lambda fh: torch.save(obj, fh))
