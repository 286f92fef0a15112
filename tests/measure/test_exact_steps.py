"""The exact geodesic's RK4 steps: a blow-up says how many are needed, and they can be given.

On the tiny BERT of ``test_measure`` (weights of standard deviation 0.02) with batches of 4
rows, Auto-PGD at ρ = 0.3 drives one value-output head of ``geodesic-mix-exact`` to move about
11 times its size: 10 RK4 steps overflow (the geodesic itself is regular, ``gl_diagnose``), and
the measurement's error names the head and the steps; ``--exact-steps 40`` measures it.

At ρ = 0.2 the 10-step RK4 stays finite but the fastest head moves κ ≈ 7.5 times its size:
the value (0.008144 against 0.008085 with 20 steps and 0.008082 with 40) comes with a warning
that RK4 needs about 2κ = 15 steps, and ``max_relative_speed`` in the row. A small-κ exact
measurement neither warns nor changes its value by a bit.
"""

import json
import warnings

import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.cli import main
from geosharp.estimators.worst import ExactStepsWarning

from ..test_measure import SENTENCES, save_tiny_bert

ARGS = [
    "--measures", "geodesic-mix-exact", "--rho", "0.3", "--steps", "5", "--batch-size", "4",
    "--max-length", "16", "--no-progress", "--threads", "1", "--dtype", "float64",
]  # fmt: skip


def _run(tmp_path, capsys, *extra, rho="0.3"):
    model = tmp_path / "bert"
    if not model.exists():
        model.mkdir()
        save_tiny_bert(model)
        rows = "".join(f'"{t}",{y}\n' for t, y in [*SENTENCES, ("the film was good", 2)])
        (tmp_path / "train.csv").write_text("text,label\n" + rows + '"a bad movie",0\n')
    out = tmp_path / f"out{len(extra)}_{rho}"
    args = [*ARGS, *extra, "--out", str(out)]
    args[args.index("--rho") + 1] = rho
    code = main(["measure", str(model), str(tmp_path / "train.csv"), *args])
    err = capsys.readouterr().err
    return code, json.loads((out / "results.json").read_text()), err


def test_a_coarse_exact_geodesic_says_how_many_steps_and_more_measure_it(tmp_path, capsys):
    code, coarse, _ = _run(tmp_path, capsys)
    (row,) = coarse["results"]
    assert row["value"] is None
    assert "attention[VO] head 3' blew up with 10 RK4 steps" in row["error"]
    assert "use exact_steps >= 40" in row["error"]
    assert coarse["settings"]["exact_steps"] == 10
    code, fine, _ = _run(tmp_path, capsys, "--exact-steps", "40")
    (row,) = fine["results"]
    assert code == 0 and row["error"] is None
    assert fine["settings"]["exact_steps"] == 40
    assert 0 < row["value"] < 1


def test_a_finite_value_from_too_few_steps_warns_with_the_relative_speed(tmp_path, capsys):
    code, coarse, err = _run(tmp_path, capsys, rho="0.2")
    (row,) = coarse["results"]
    assert code == 0 and row["error"] is None and 0 < row["value"] < 1
    kappa = row["max_relative_speed"]
    assert 5 < kappa < 10  # 7.5: 2κ > 10 steps
    line = (
        f"geodesic-mix-oexact worst l2 at rho=0.2: the exact geodesic moved a head κ ≈ "
        f"{kappa:.3g} times its size with 10 RK4 steps; RK4 needs about 2κ = "
    )
    assert f"geosharp: warning: {line}" in err and err.count("RK4 needs") == 1
    (warned,) = [w for w in coarse["warnings"] if "RK4 needs" in w]
    assert warned.startswith(line) and "may be inaccurate" in warned
    assert warned.endswith("use exact_steps >= 15")
    assert "max_relative_speed" in (tmp_path / "out0_0.2" / "results.csv").read_text()
    code, fine, err = _run(tmp_path, capsys, "--exact-steps", "20", rho="0.2")
    (row,) = fine["results"]
    assert code == 0 and 2 * row["max_relative_speed"] < 20
    assert "RK4" not in err and not any("RK4" in w for w in fine["warnings"])


def test_a_small_relative_speed_does_not_warn_and_keeps_the_value():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0).double()
    x, y = torch.randn(4, 5, 8).double(), torch.randn(4, 5, 8).double()
    kw = dict(measure="geodesic", metric="mix", order="exact", steps=5, cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExactStepsWarning)
        res = gs.sharpness(model, nn.functional.mse_loss, [(x, y), (y, x)], rho=0.01, **kw)
    assert 0 < res.settings["max_relative_speed"] < 0.1  # 0.024
    # the value before the guard (51dc5ab: 0x1.2e046241f5500p-7); the last bits of a float64 sum
    # depend on the CPU's kernels (this machine gives ...f5600p-7), so it is held to 1e-13
    assert res.value == pytest.approx(float.fromhex("0x1.2e046241f5500p-7"), rel=1e-13, abs=0)
    res = gs.sharpness(model, nn.functional.mse_loss, [(x, y)], rho=0.01, order=2)
    assert res.settings["max_relative_speed"] is None  # no exact RK4 heads


def test_the_average_case_records_the_relative_speed_of_its_samples():
    """The RK4 guard over the noise samples of the average case, as at the worst case's optimum."""
    import warnings

    import torch
    from torch import nn

    import geosharp as gs

    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    batches = [(x, torch.randn(3, 4, 8, dtype=torch.float64))]
    mse = nn.functional.mse_loss
    kw = {"measure": "geodesic", "metric": "mix", "order": "exact", "kind": "average"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.errors.MeasureWarning)
        small = gs.sharpness(model, mse, batches, rho=0.01, samples=3, progress=False, **kw)
    assert 0 < small.settings["max_relative_speed"] < 1  # nothing to warn about
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        big = gs.sharpness(
            model, mse, batches, rho=0.1, samples=3, exact_steps=2, progress=False, **kw
        )
    kappa = big.settings["max_relative_speed"]
    assert kappa > 1
    assert any("RK4 needs about 2κ" in str(w.message) for w in seen)
    o2 = gs.sharpness(model, mse, batches, rho=0.01, samples=3, progress=False,
                      **{**kw, "order": 2})  # fmt: skip
    assert o2.settings["max_relative_speed"] is None
