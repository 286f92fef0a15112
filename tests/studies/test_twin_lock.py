"""``twin_check.csv``'s lock: held by one writer at a time, and gone from the folder after."""

from __future__ import annotations

import threading
import time

import pytest

from geosharp.studies import twin_section
from geosharp.studies.twin_section import TWIN_FILE, add_rows, merge_twin_files, read_rows

pytest.importorskip("fcntl")


def _line(model_id: str) -> dict[str, object]:
    return {"model_id": model_id, "measure": "adaptive worst l2", "rho": 0.01, "value": 1.0}


def test_no_lock_file_is_left_after_writing_or_merging(tmp_path):
    add_rows(tmp_path / "a", [_line("m1")])
    add_rows(tmp_path / "b", [_line("m2")])
    assert merge_twin_files(tmp_path / "a", [tmp_path / "b"]) == 1
    assert [r["model_id"] for r in read_rows(tmp_path / "a" / TWIN_FILE)] == ["m1", "m2"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [TWIN_FILE]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [TWIN_FILE]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_no_lock_file_is_left_after_an_error_or_ctrl_c(tmp_path, error):
    with pytest.raises(error), twin_section._locked(tmp_path):
        assert (tmp_path / twin_section._LOCK).is_file()
        raise error("stop")
    assert not (tmp_path / twin_section._LOCK).exists()
    with twin_section._locked(tmp_path):  # and the lock can be taken again at once
        pass


def test_one_writer_at_a_time_and_every_line_kept(tmp_path):
    """Writers (separate opens: flock excludes them as it does processes) never overlap, even
    when each removes the file it locked, and no model's lines are lost."""
    inside, most, errors = [0], [0], []
    guard = threading.Lock()

    def write(k: int) -> None:
        try:
            for j in range(5):
                with twin_section._locked(tmp_path):
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.001)
                    with guard:
                        inside[0] -= 1
                add_rows(tmp_path, [_line(f"m{k}-{j}")])
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and most[0] == 1
    ids = {r["model_id"] for r in read_rows(tmp_path / TWIN_FILE)}
    assert ids == {f"m{k}-{j}" for k in range(6) for j in range(5)}
    assert not (tmp_path / twin_section._LOCK).exists()
