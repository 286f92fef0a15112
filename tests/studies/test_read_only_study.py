"""A study on a read-only file system is still reported elsewhere: `geosharp report DIR --export`.

Opening an existing study writes nothing; on a folder the process cannot write (a read-only
mount), the store is opened read-only, so `--export DEST` builds the report in DEST. Root
ignores permission bits, so the read-only folder is simulated by making ``os.access`` say it
is not writable (what it says on a read-only mount, even for root).
"""

import os
import shutil
from pathlib import Path

from geosharp.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_a_read_only_study_is_exported(tmp_path, monkeypatch, capsys):
    study = tmp_path / "ro"
    shutil.copytree(ROOT / "results" / "diagonal", study)
    real = os.access

    def access(path, mode, *args, **kwargs):
        inside = Path(path).resolve().is_relative_to(study.resolve())
        return False if inside and mode & os.W_OK else real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    before = sorted(p.name for p in study.iterdir())
    code = main(["report", str(study), "--export", str(tmp_path / "shared")])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "shared" / "report.html").is_file()
    assert (tmp_path / "shared" / "study.sqlite").is_file()
    assert sorted(p.name for p in study.iterdir()) == before  # nothing written beside it
