"""The exact geodesic's RK4 steps: a blow-up says how many are needed, and they can be given.

On the tiny BERT of ``test_measure`` (weights of standard deviation 0.02) with batches of 4
rows, Auto-PGD at ρ = 0.3 drives one value-output head of ``geodesic-mix-exact`` to move about
11 times its size: 10 RK4 steps overflow (the geodesic itself is regular, ``gl_diagnose``), and
the measurement's error names the head and the steps; ``--exact-steps 40`` measures it.
"""

import json

from geosharp.cli import main

from ..test_measure import SENTENCES, save_tiny_bert

ARGS = [
    "--measures", "geodesic-mix-exact", "--rho", "0.3", "--steps", "5", "--batch-size", "4",
    "--max-length", "16", "--no-progress", "--threads", "1", "--dtype", "float64",
]  # fmt: skip


def _run(tmp_path, capsys, *extra):
    model = tmp_path / "bert"
    if not model.exists():
        model.mkdir()
        save_tiny_bert(model)
        rows = "".join(f'"{t}",{y}\n' for t, y in [*SENTENCES, ("the film was good", 2)])
        (tmp_path / "train.csv").write_text("text,label\n" + rows + '"a bad movie",0\n')
    out = tmp_path / f"out{len(extra)}"
    code = main(["measure", str(model), str(tmp_path / "train.csv"), *ARGS, *extra,
                 "--out", str(out)])  # fmt: skip
    capsys.readouterr()
    return code, json.loads((out / "results.json").read_text())


def test_a_coarse_exact_geodesic_says_how_many_steps_and_more_measure_it(tmp_path, capsys):
    code, coarse = _run(tmp_path, capsys)
    (row,) = coarse["results"]
    assert row["value"] is None
    assert "attention[VO] head 3' blew up with 10 RK4 steps" in row["error"]
    assert "use exact_steps >= 40" in row["error"]
    assert coarse["settings"]["exact_steps"] == 10
    code, fine = _run(tmp_path, capsys, "--exact-steps", "40")
    (row,) = fine["results"]
    assert code == 0 and row["error"] is None
    assert fine["settings"]["exact_steps"] == 40
    assert 0 < row["value"] < 1
