"""Atomic file writes, the output-folder check of the commands, and one-line OS errors.

Atomic writes: a reader (or a second writer) never sees a half-written file.

Every writer goes through a temporary file of its own in the target's folder — its name is
unique to the process and the call, so two processes writing the same report at the same time
cannot clobber each other's temporary file — and :func:`os.replace` moves it into place. The
last complete write wins.

Every command that writes a folder calls :func:`ensure_writable_dir` before any work, and the
command line prints an :class:`OSError` that reaches it as :func:`os_error_line` (one line: what
failed, where, what to do) instead of a traceback.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "OutputFolderError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "ensure_writable_dir",
    "os_error_line",
    "os_error_status",
    "sqlite_os_error",
    "torch_save_atomically",
]


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
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno and err.filename is None:
            # a failed write (disk full) names no file: name the one being written
            raise OSError(err.errno, _reason(err), os.fspath(path)) from err
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


class OutputFolderError(ValueError):
    """An output folder that cannot be created or written to, found before any work.

    A :class:`ValueError`: bad input the user fixes by choosing another folder (exit status 2
    on the command line). The :class:`OSError` that revealed it is its ``__cause__``.
    """


def ensure_writable_dir(
    path: str | Path, option: str = "--out", fix: str | None = None, *, keep: bool = True
) -> Path:
    """Create the folder ``path`` (with its parents) and prove that a file can be written in it.

    Writes a small probe file in the folder and removes it, so that a command fails here, before
    any work, rather than after minutes of training or measuring. On failure, the folders it
    created are removed again.

    Args:
        path: The output folder.
        option: The option that named it, for the message (``--out``, ``--export``, ``OUT``).
        fix: What to do, for the message (default: choose another ``option``).
        keep: Keep the folders it created (the command writes there next); ``False``: remove
            them, for a command that creates the folder itself once its inputs are checked.

    Returns:
        ``path`` as a :class:`~pathlib.Path` (``~`` expanded).

    Raises:
        OutputFolderError: In one line: the folder, the operating system's reason, what to do.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> ensure_writable_dir(d / "a" / "b").is_dir()
        True
        >>> list((d / "a" / "b").iterdir())  # the probe file is gone
        []
        >>> (d / "f").write_text("")
        0
        >>> try:
        ...     ensure_writable_dir(d / "f" / "out")
        ... except OutputFolderError as err:
        ...     print(str(err).replace(str(d), "D"))
        cannot create the output folder D/f/out (--out): Not a directory — choose another --out
    """
    out = Path(path).expanduser()
    fix = fix or f"choose another {option}"
    created = [p for p in (out, *out.parents) if not os.path.lexists(p)]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _remove_empty(created)
        raise OutputFolderError(
            f"cannot create the output folder {out} ({option}): {_reason(err)} — {_space(err)}{fix}"
        ) from err
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".geosharp-write-probe-") as fh:
            fh.write(b"geosharp")
            fh.flush()
    except OSError as err:
        _remove_empty(created)
        raise OutputFolderError(
            f"cannot write to the output folder {out} ({option}): {_reason(err)} — "
            f"{_space(err)}{fix}"
        ) from err
    if not keep:
        _remove_empty(created)
    return out


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _reason(err: OSError) -> str:
    return err.strerror or (os.strerror(err.errno) if err.errno else str(err))


def _space(err: OSError) -> str:
    """``"free some space, or "`` for a full disk or quota, else nothing."""
    full = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    return "free some space, or " if err.errno in full else ""


#: What to do about an :class:`OSError`, by its ``errno`` (:func:`os_error_line`).
_OS_ERROR_FIXES: dict[int, str] = {
    getattr(errno, name): fix
    for name, fix in {
        "ENOSPC": "free some space or choose another --out",
        "EDQUOT": "free some space (a disk quota is full) or choose another --out",
        "EFBIG": "choose another --out, on a file system that takes larger files",
        "EROFS": "the file system is read-only: choose a writable --out",
        "EACCES": "check its permissions, or choose a writable --out",
        "EPERM": "check its permissions, or choose a writable --out",
        "ENOENT": "check the path",
        "ENOTDIR": "check the path: a part of it is a file, not a folder",
        "EISDIR": "check the path: it is a folder where a file was expected",
        "EEXIST": "remove it or choose another --out",
        "EMFILE": "too many open files: raise the limit (ulimit -n) and run again",
        "ENFILE": "too many open files on this system: close some and run again",
        "EIO": "the disk or the file system failed: check it, then run again",
        "ENOMEM": "out of memory: free some, or use a smaller configuration",
    }.items()
    if hasattr(errno, name)  # EDQUOT is not on every platform
}


def os_error_line(err: OSError) -> str:
    """One line for an :class:`OSError`: what failed, the path(s), what to do.

    Errors that a program raised with its own message (no ``errno``, such as
    ``FileNotFoundError("runs/x holds no study.sqlite; ...")``) keep their message.

    Example:
        >>> os_error_line(OSError(errno.ENOSPC, "No space left on device", "/x/y"))
        'No space left on device (ENOSPC): /x/y — free some space or choose another --out'
        >>> os_error_line(FileNotFoundError("runs/x holds no study.sqlite"))
        'runs/x holds no study.sqlite'
    """
    if not err.errno:
        return str(err)
    name = errno.errorcode.get(err.errno, f"errno {err.errno}")
    line = f"{_reason(err)} ({name})"
    paths = [os.fsdecode(p) for p in (err.filename, err.filename2) if p is not None]
    if paths:
        line += ": " + " → ".join(paths)
    fix = _OS_ERROR_FIXES.get(err.errno)
    return f"{line} — {fix}" if fix else line


def os_error_status(err: OSError) -> int:
    """Exit status of an :class:`OSError` at the top of a command.

    2 for an error raised with the program's own message (bad input found before work, as
    the command line always did), 1 for an operating system's failure during the work.
    """
    return 1 if err.errno else 2


#: SQLite's errors that are the operating system's: (SQLite's name, its message, errno).
_SQLITE_OS_ERRORS = (
    ("SQLITE_FULL", "database or disk is full", errno.ENOSPC),
    ("SQLITE_READONLY", "attempt to write a readonly database", errno.EROFS),
    ("SQLITE_CANTOPEN", "unable to open database file", errno.EACCES),
    ("SQLITE_PERM", "access permission denied", errno.EPERM),
    ("SQLITE_IOERR", "disk I/O error", errno.EIO),
)


def sqlite_os_error(err: sqlite3.Error) -> OSError | None:
    """The :class:`OSError` a SQLite error stands for (disk full, read-only, ...), or ``None``.

    A study's database on a full disk fails as ``sqlite3.OperationalError: database or disk
    is full``, not as an :class:`OSError`; the command line shows it as one.

    Example:
        >>> err = sqlite_os_error(sqlite3.OperationalError("database or disk is full"))
        >>> err.errno == errno.ENOSPC, err.strerror
        (True, 'the study database: database or disk is full')
        >>> sqlite_os_error(sqlite3.OperationalError("no such table: models")) is None
        True
    """
    name = getattr(err, "sqlite_errorname", None)  # Python >= 3.11
    for code_name, text, code in _SQLITE_OS_ERRORS:
        if (name or "").startswith(code_name) or str(err).startswith(text):
            return OSError(code, f"the study database: {err}")
    return None
