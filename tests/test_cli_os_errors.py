"""Issue 24: an operating system's error ends in one line, never a traceback (``--debug``: it).

Every command that writes a folder (study, measure, symmetry-test, report, report --export,
merge) checks before any work that it can create and write it. We run as root, which may write
to a folder of mode 0o555, so the unwritable folders here are the kernel's: ``/sys`` refuses to
create a folder (EPERM) or a file (EACCES) for root too, and a path under a regular file cannot
be created by anyone (ENOTDIR).
"""

import errno
import functools
import importlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from geosharp import cli
from geosharp._io import (
    OutputFolderError,
    ensure_writable_dir,
    os_error_line,
    os_error_status,
    sqlite_os_error,
)

SYS_NEW = Path("/sys/geosharp-nowhere/x")  # mkdir: Operation not permitted, for root too
SYS_DIR = Path("/sys/kernel")  # an existing folder: creating a file is refused, for root too

ENOSPC = OSError(errno.ENOSPC, "No space left on device", "/x/y")
ENOSPC_LINE = (
    "geosharp: error: No space left on device (ENOSPC): /x/y — free some space or choose "
    "another --out"
)


@functools.cache
def _sys_refuses() -> bool:
    """Whether this machine refuses what the tests need of /sys (a container may not)."""
    try:
        ensure_writable_dir(SYS_NEW)
    except OutputFolderError:
        pass
    else:
        return False
    try:
        ensure_writable_dir(SYS_DIR)
    except OutputFolderError:
        return True
    return False


@pytest.fixture
def under_a_file(tmp_path):
    """A path whose parent is a regular file: no one can create it (Not a directory)."""
    (tmp_path / "afile").write_text("a file, not a folder\n")
    return tmp_path / "afile" / "out"


@pytest.fixture(params=["sys-new", "sys-dir", "under-a-file"])
def bad_out(request, under_a_file):
    """An output folder that cannot be created (two ways) or written to."""
    if request.param != "under-a-file" and not _sys_refuses():
        pytest.skip("/sys is writable here (or missing)")
    return {"sys-new": SYS_NEW, "sys-dir": SYS_DIR, "under-a-file": under_a_file}[request.param]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("geosharp: error: "), err
    return lines[0]


def _says_why(line: str, out: Path, option: str = "--out") -> None:
    verb = "write to" if out == SYS_DIR else "create"  # the others cannot be created
    assert line.startswith(f"geosharp: error: cannot {verb} the output folder {out} ({option}): ")
    assert " — " in line  # then what to do


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a study would be built, trained or measured, or a report written."""

    def work(*args, **kwargs):
        raise AssertionError("work started")

    # merge binds study_report.report_from_folder at import: imported under the patch, it would keep
    # the stub for every later test
    importlib.import_module("geosharp.studies.merge")
    for name in cli.STUDIES:
        monkeypatch.setitem(cli.STUDIES, name, (cli.STUDIES[name][0], work))
    for target in (
        "geosharp.studies.runner.run_study",
        "geosharp.studies.study_report.report_from_folder",
        "geosharp.studies.study_report.export_study",
        "geosharp.studies.merge.merge_shards",
        "geosharp.studies.symmetry_test.symmetry_test",
    ):
        monkeypatch.setattr(target, work)


# --------------------------------------------------------------------------------------------
# the check before any work, command by command


def test_study_refuses_an_unwritable_out_before_any_work(bad_out, capsys):
    # the real pipeline: had the check not run first, it would print "training ..." and fail
    # later (a traceback before the fix, exit 1 after it)
    code = cli.main(["study", "diagonal", "--quick", "--no-progress", "--out", str(bad_out)])
    err = capsys.readouterr().err
    assert code == 2
    line = _one_error_line(err)
    _says_why(line, bad_out)
    assert line.endswith("choose another --out")
    assert "training" not in err and "measuring" not in err


def test_study_from_the_shell_prints_one_line(under_a_file):
    """The issue's command as a user runs it: a new process, its stderr, its exit status."""
    argv = ["study", "diagonal", "--quick", "--out", str(under_a_file)]
    run = subprocess.run(
        [sys.executable, "-m", "geosharp.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2, run.stderr
    line = _one_error_line(run.stderr)
    assert line == (
        f"geosharp: error: cannot create the output folder {under_a_file} (--out): "
        "Not a directory — choose another --out"
    )
    assert run.stdout == ""
    debug = subprocess.run(
        [sys.executable, "-m", "geosharp.cli", "--debug", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug.stderr
    assert "OutputFolderError: cannot create the output folder" in debug.stderr


TINY_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    """
)
FAST = ["--measures", "adaptive", "--rho", "0.1", "--steps", "2", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """``(MODEL, DATA)``: ``tiny.py:build`` (a 4-6-3 MLP), ``data.npz`` (8 samples, 3 classes)."""
    d = tmp_path_factory.mktemp("tinymlp")
    (d / "tiny.py").write_text(TINY_SOURCE)
    g = np.random.default_rng(0)
    np.savez(d / "data.npz", x=g.standard_normal((8, 4)).astype("float32"), y=g.integers(0, 3, 8))
    return f"{d / 'tiny.py'}:build", str(d / "data.npz")


def test_measure_refuses_an_unwritable_out_before_any_work(bad_out, tiny_model, capsys):
    code = cli.main(["measure", *tiny_model, *FAST, "--out", str(bad_out)])
    out, err = capsys.readouterr()
    assert code == 2
    _says_why(_one_error_line(err), bad_out)
    assert "task:" not in out and "model:" not in out  # nothing was loaded


def test_measure_writes_where_it_can(tiny_model, tmp_path, capsys):
    """The check lets a writable folder through, and leaves no probe file behind."""
    code = cli.main(["measure", *tiny_model, *FAST, "--out", str(tmp_path / "a" / "m")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "a" / "m").iterdir()) == [
        "results.csv",
        "results.json",
    ]


def test_symmetry_test_refuses_an_unwritable_study_folder(bad_out, capsys):
    # the real test: had the check not come first, it would say "holds no study.sqlite" for
    # /sys/kernel too
    code = cli.main(["symmetry-test", "diagonal", "--quick", "--out", str(bad_out)])
    err = capsys.readouterr().err
    assert code == 2
    line = _one_error_line(err)
    if bad_out.is_dir():  # a folder it may not write in
        _says_why(line, bad_out)
        assert line.endswith("copy the study's folder somewhere writable and give that as --out")
    else:  # a folder that does not exist is not created: it holds no study
        assert line.endswith(f"{bad_out} holds no study.sqlite; run `geosharp study ...` first")
        assert not bad_out.exists()


def test_symmetry_test_on_a_read_only_study_folder(tmp_path, monkeypatch, no_work, capsys):
    """A finished study on a read-only file system: the probe file fails (EROFS), no work."""
    (tmp_path / "study.sqlite").write_bytes(b"")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    code = cli.main(["symmetry-test", "diagonal", "--quick", "--out", str(tmp_path)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line == (
        f"geosharp: error: cannot write to the output folder {tmp_path} (--out): Read-only "
        "file system — copy the study's folder somewhere writable and give that as --out"
    )


def test_report_in_place_refuses_an_unwritable_folder(bad_out, capsys):
    code = cli.main(["report", str(bad_out)])
    err = capsys.readouterr().err
    assert code == 2
    line = _one_error_line(err)
    if bad_out.is_dir():
        _says_why(line, bad_out, "OUT")
        assert line.endswith("write the report elsewhere: --export DEST")
    else:  # not created: the report says there is no study there
        assert line.endswith(f"{bad_out} holds no study.sqlite; run `geosharp study ...` first")
        assert not bad_out.exists()


def test_report_in_place_of_a_missing_folder_names_it(tmp_path, capsys):
    code = cli.main(["report", str(tmp_path / "nope")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and line == (
        f"geosharp: error: {tmp_path / 'nope'} holds no study.sqlite; run `geosharp study ...` "
        "first"
    )
    assert not (tmp_path / "nope").exists()


def test_report_export_refuses_an_unwritable_destination(bad_out, tmp_path, no_work, capsys):
    code = cli.main(["report", str(tmp_path), "--export", str(bad_out)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2
    _says_why(line, bad_out, "--export")
    assert line.endswith("choose another --export")


def test_merge_refuses_an_unwritable_out(bad_out, tmp_path, no_work, capsys):
    code = cli.main(["merge", str(bad_out), str(tmp_path / "shard1")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2
    _says_why(line, bad_out, "OUT")


def test_every_writing_command_is_covered():
    """A new subcommand must come with its output-folder check and a test here."""
    sub = next(a for a in cli._parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"study", "symmetry-test", "report", "merge", "measure"}


# --------------------------------------------------------------------------------------------
# an OSError during the work: one line, exit 1; --debug: the traceback


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "/x/y")


def test_disk_full_during_a_study_is_one_line(monkeypatch, tmp_path, capsys):
    # the first trained model is stored: the work has started
    monkeypatch.setattr("geosharp.studies.store.Store.put_model", _enospc)
    argv = ["study", "diagonal", "--quick", "--no-progress", "--out", str(tmp_path / "d")]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1
    assert "training" in err  # it did start
    assert err.strip().splitlines()[-1] == ENOSPC_LINE and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("geosharp: error")]) == 1


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("geosharp.studies.store.Store.put_model", _enospc)
    argv = ["study", "diagonal", "--quick", "--no-progress", "--out", str(tmp_path / "d")]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(OSError) as info:  # uncaught: Python prints the traceback
        cli.main(argv)
    assert info.value.errno == errno.ENOSPC
    assert "geosharp: error" not in capsys.readouterr().err


def test_a_full_study_database_is_one_line(monkeypatch, tmp_path, capsys):
    """SQLite reports a full disk as its own error, not an OSError: the same one line."""

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr("geosharp.studies.store.Store.put_model", full)
    code = cli.main(["study", "diagonal", "--quick", "--no-progress", "--out", str(tmp_path)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert line == (
        "geosharp: error: the study database: database or disk is full (ENOSPC) — free some "
        "space or choose another --out"
    )


def test_another_database_error_is_still_a_traceback(monkeypatch, tmp_path):
    """A SQLite error that is not the system's is a bug: its traceback is kept."""

    def bug(*args, **kwargs):
        raise sqlite3.OperationalError("no such table: models")

    monkeypatch.setattr("geosharp.studies.store.Store.put_model", bug)
    with pytest.raises(sqlite3.OperationalError):
        cli.main(["study", "diagonal", "--quick", "--no-progress", "--out", str(tmp_path)])


def test_disk_full_during_a_measurement_is_one_line(tiny_model, monkeypatch, tmp_path, capsys):
    # every result file is written atomically through geosharp._io.atomic_write
    monkeypatch.setattr("geosharp._io.atomic_write", _enospc)
    code = cli.main(["measure", *tiny_model, *FAST, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "model:" in out and "adaptive worst l2" in out  # it measured, then failed to write
    assert "Traceback" not in err and err.strip().splitlines()[-1] == ENOSPC_LINE
    assert len([line for line in err.splitlines() if line.startswith("geosharp: error")]) == 1
    with pytest.raises(OSError):
        cli.main(["--debug", "measure", *tiny_model, *FAST, "--out", str(tmp_path)])
    with pytest.raises(OSError):
        cli.main(["measure", *tiny_model, *FAST, "--out", str(tmp_path), "--debug"])


def test_ctrl_c_is_unchanged_by_debug(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("geosharp.studies.runner.run_study", interrupted)
    code = cli.main(["--debug", "study", "diagonal", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130 and "Resume with:" in err and "Traceback" not in err


def test_help_mentions_debug(capsys):
    for argv in (["--help"], ["study", "--help"], ["measure", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "--debug" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# the helpers


def test_ensure_writable_dir_creates_the_folder_and_leaves_no_probe(tmp_path):
    out = ensure_writable_dir(tmp_path / "a" / "b")
    assert out == tmp_path / "a" / "b" and out.is_dir() and not list(out.iterdir())
    assert ensure_writable_dir(out) == out  # an existing, empty or not, folder is fine


def test_ensure_writable_dir_on_a_full_disk_says_free_some_space(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", full)
    with pytest.raises(OutputFolderError) as info:
        ensure_writable_dir(tmp_path / "a" / "b", "--out")
    assert str(info.value) == (
        f"cannot write to the output folder {tmp_path / 'a' / 'b'} (--out): No space left on "
        "device — free some space, or choose another --out"
    )
    assert not list(tmp_path.iterdir())  # the folders it created are gone again


def test_ensure_writable_dir_without_keep_leaves_nothing(tmp_path):
    assert ensure_writable_dir(tmp_path / "a" / "b", keep=False) == tmp_path / "a" / "b"
    assert not list(tmp_path.iterdir())
    (tmp_path / "c").mkdir()
    ensure_writable_dir(tmp_path / "c", keep=False)  # an existing folder stays
    assert (tmp_path / "c").is_dir()


def test_a_refused_export_or_merge_leaves_no_folder(tmp_path, capsys):
    """They create their folder once their inputs are checked: the check leaves none before."""
    code = cli.main(["report", str(tmp_path / "nope"), "--export", str(tmp_path / "dest")])
    assert code == 2 and "holds no study.sqlite" in _one_error_line(capsys.readouterr().err)
    code = cli.main(["merge", str(tmp_path / "merged"), str(tmp_path / "nope")])
    assert code == 2 and "holds no study.sqlite" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "dest").exists() and not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.ENOSPC, "free some space or choose another --out"),
        (errno.EROFS, "the file system is read-only: choose a writable --out"),
        (errno.EACCES, "check its permissions, or choose a writable --out"),
        (errno.EPERM, "check its permissions, or choose a writable --out"),
        (errno.ENOENT, "check the path"),
        (errno.ENOTDIR, "check the path: a part of it is a file, not a folder"),
    ],
)
def test_os_error_line_says_what_where_and_what_to_do(code, fix):
    err = OSError(code, os.strerror(code), "/x/y")
    line = os_error_line(err)
    assert line == f"{os.strerror(code)} ({errno.errorcode[code]}): /x/y — {fix}"
    assert os_error_status(err) == 1
    assert os_error_line(OSError(code, os.strerror(code))) == (
        f"{os.strerror(code)} ({errno.errorcode[code]}) — {fix}"
    )


def test_os_error_line_keeps_our_own_messages():
    err = FileNotFoundError("runs/x holds no study.sqlite; run `geosharp study ...` first")
    assert os_error_line(err) == str(err) and os_error_status(err) == 2


def test_a_failed_atomic_write_names_its_file(tmp_path):
    from geosharp._io import atomic_write

    def full(fh):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "r.csv", full)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "r.csv")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("database or disk is full", errno.ENOSPC),
        ("attempt to write a readonly database", errno.EROFS),
        ("unable to open database file", errno.EACCES),
        ("disk I/O error", errno.EIO),
        ("no such table: models", None),
    ],
)
def test_sqlite_os_error(message, code):
    err = sqlite_os_error(sqlite3.OperationalError(message))
    assert (err and err.errno) == code
