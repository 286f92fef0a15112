"""Atomic writes: no half files, no leftover temporary files, concurrent writers don't collide."""

import threading

import pytest
import torch

from geosharp._io import atomic_write, atomic_write_text, torch_save_atomically


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = atomic_write_text(tmp_path / "r.txt", "old")

    def boom(fh):
        fh.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(path, boom)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.txt"]


def test_concurrent_writers_of_one_file_never_leave_a_mixed_file(tmp_path):
    # The old writers shared one "results.csv.tmp": two writers at once could rename the other's
    # half-written file into place, or fail when it had already been moved.
    path = tmp_path / "results.csv"
    texts = [str(k) * 200_000 for k in range(4)]
    errors = []

    def writer(text):
        try:
            for _ in range(20):
                atomic_write_text(path, text)
                assert path.read_text() in texts
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]


def test_torch_save_atomically_round_trips_and_creates_the_folder(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    path = torch_save_atomically(state, tmp_path / "ckpt" / "m.pt")
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])


def test_written_files_get_the_usual_permissions(tmp_path):
    import os

    mask = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "report.html", "<html></html>")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o644
