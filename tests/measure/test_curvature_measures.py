"""Curvature measures in ``gs.measure`` and ``geosharp measure``: the grammar, values equal to
``gs.curvature`` called directly, and the rows in the table, JSON, CSV and HTML."""

import csv
import io
import json
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import geosharp as gs
from geosharp.cli import main
from geosharp.measures import Sharpness, parse_measure
from geosharp.measuring import MeasureError
from geosharp.measuring.losses import default_loss

# --------------------------------------------------------------------------------------------
# the grammar


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("curvature-inv-lmax", "geodesic-inv curvature lambda_max"),
        ("curvature-mix-trace", "geodesic-mix curvature trace"),
        ("curvature-lmax", "geodesic-inv curvature lambda_max"),
        ("curvature-geodesic-mix-lmin", "geodesic-mix curvature lambda_min"),
        ("curvature-adaptive-lmax", "adaptive curvature lambda_max"),
        ("curvature-ada-tr", "adaptive curvature trace"),
        ("curvature-euclidean-trace", "euclidean curvature trace"),
        ("Curvature Eucl lambda_max", "euclidean curvature lambda_max"),
        ("geodesic-inv curvature lambda_max", "geodesic-inv curvature lambda_max"),
        ("euclidean curvature trace", "euclidean curvature trace"),
    ],
)
def test_parse(text, name):
    spec = parse_measure(text)
    assert spec.name == name and spec.family == "curvature" and not spec.uses_rho
    assert parse_measure(spec.name) == spec  # the printed name reads back


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("curvature", "which curvature quantity"),
        ("curvature-inv", "which curvature quantity"),
        ("curvature-adaptive-inv-lmax", "geodesic curvature only"),
        ("curvature-inv-mix-lmax", "metric twice"),
        ("curvature-lmax-trace", "quantity twice"),
        ("curvature-inv-o2-lmax", "no order, kind or norm"),
        ("curvature-worst-lmax", "no order, kind or norm"),
        ("curvature-l2-trace", "no order, kind or norm"),
        ("curvature-inv-lmax-curvature", "curvature twice"),
        ("curvature-inv-top", "unknown option 'top'"),
    ],
)
def test_parse_rejects(text, match):
    with pytest.raises(MeasureError, match=match):
        parse_measure(text)


def test_sharpness_names_unchanged():
    assert parse_measure("geodesic-inv-o2").name == "geodesic-inv-o2 worst l2"
    assert parse_measure("adaptive-linf") == Sharpness(
        measure="adaptive", metric="", order=1, kind="worst", norm="linf"
    )


# --------------------------------------------------------------------------------------------
# values


class Net(nn.Module):
    """One ``nn.MultiheadAttention`` (2 heads: QK and VO blocks) and a 3-class head."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.head(torch.tanh(h).mean(1))


def tiny():
    torch.manual_seed(0)
    model = Net().double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the init (zero biases are frozen adaptive coordinates)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    batches = [
        (
            torch.randn(6, 5, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (6,), generator=g),
        )
        for _ in range(2)
    ]
    return model, batches


CASES = [
    ("curvature-inv-lmax", "geodesic", "inv", "lambda_max"),
    ("curvature-inv-trace", "geodesic", "inv", "trace"),
    ("curvature-mix-lmax", "geodesic", "mix", "lambda_max"),
    ("curvature-mix-trace", "geodesic", "mix", "trace"),
    ("curvature-adaptive-lmax", "adaptive", "inv", "lambda_max"),
    ("curvature-adaptive-trace", "adaptive", "inv", "trace"),
    ("curvature-euclidean-lmax", "euclidean", "inv", "lambda_max"),
    ("curvature-euclidean-trace", "euclidean", "inv", "trace"),
]


@pytest.fixture(scope="module")
def report():
    model, batches = tiny()
    rep = gs.measure(
        model,
        batches,
        measures=[c[0] for c in CASES] + ["adaptive"],
        rhos=[0.05],
        steps=2,
        iters=30,
        probes=12,
        warn=lambda _msg: None,  # two Auto-PGD steps of the adaptive row: "still rising"
    )
    return model, batches, rep


@pytest.mark.parametrize(("text", "measure", "metric", "quantity"), CASES)
def test_values_equal_gs_curvature(report, text, measure, metric, quantity):
    model, batches, rep = report
    row = rep.row(text)
    ref = gs.curvature(
        model,
        default_loss,
        batches,
        measure=measure,
        metric=metric,
        quantities=(quantity,),
        iters=30,
        probes=12,
        seed=0,
    )
    assert row.rho is None and row.error is None
    assert row.value == ref.values[quantity]
    assert row.per_batch == ref.per_batch[quantity] and len(row.per_batch) == 2
    assert row.clean_losses == ref.clean_losses
    assert row.n_hvp == ref.n_hvp > 0
    assert (row.n_forward, row.n_backward) == (ref.n_forward, ref.n_backward)
    if quantity == "trace":
        assert row.stderr == ref.trace_stderr and row.stderr > 0
    else:
        assert row.stderr is None
    # the same values as one call asking for both quantities (the seeds do not depend on it)
    both = gs.curvature(
        model, default_loss, batches, measure=measure, metric=metric, iters=30, probes=12
    )
    assert both.values[quantity] == row.value


def test_geodesic_curvature_rows_are_invariant(report):
    """The measure rows inherit gs.curvature's invariance: a re-parametrized twin, same value."""
    model, batches, rep = report
    twin = gs.reparametrize(model, generator=torch.Generator().manual_seed(3), scale=10.0)
    again = gs.measure(
        twin, batches, measures=["curvature-inv-lmax", "curvature-euclidean-lmax"], iters=30
    )
    inv = rep.row("curvature-inv-lmax").value
    assert again.row("curvature-inv-lmax").value == pytest.approx(inv, rel=1e-6)
    eucl = rep.row("curvature-euclidean-lmax").value
    assert abs(again.row("curvature-euclidean-lmax").value / eucl - 1) > 0.1


def test_only_curvature_needs_no_rho():
    model, batches = tiny()
    rep = gs.measure(model, batches, measures=["curvature-inv-lmax"], rhos=[], iters=5)
    assert [(r.measure, r.rho) for r in rep.rows] == [("geodesic-inv curvature lambda_max", None)]
    assert rep.settings["curvature"] == {"iters": 5, "probes": 100, "trace_method": "hutchinson"}
    with pytest.raises(MeasureError, match="iters"):
        gs.measure(model, batches, measures=["curvature-inv-lmax"], iters=0)
    with pytest.raises(MeasureError, match="trace_method"):
        gs.measure(model, batches, measures=["curvature-inv-trace"], trace_method="dense")


def test_exact_trace_has_zero_stderr():
    model, batches = tiny()
    rep = gs.measure(model, batches, measures=["curvature-euclidean-trace"], trace_method="exact")
    ref = gs.curvature(
        model, default_loss, batches, measure="euclidean", quantities="trace", trace_method="exact"
    )
    assert rep.rows[0].value == ref.trace and rep.rows[0].stderr == 0.0


# --------------------------------------------------------------------------------------------
# outputs


def test_table_json_csv_html(report, tmp_path):
    _, _, rep = report
    table = rep.table()
    trace = rep.row("curvature-mix-trace")
    for text, *_ in CASES:
        assert parse_measure(text).name in table
    assert "HVPs" in table and "s.e." in table
    data = json.loads(rep.write_json(tmp_path / "r.json").read_text())
    by_name = {r["measure"]: r for r in data["results"]}
    got = by_name["geodesic-mix curvature trace"]
    assert got["value"] == trace.value and got["rho"] is None
    assert got["stderr"] == trace.stderr and got["n_hvp"] == trace.n_hvp
    assert got["per_batch"] == trace.per_batch
    assert (
        by_name["adaptive worst l2"]["n_hvp"] == 0
        and by_name["adaptive worst l2"]["stderr"] is None
    )
    rows = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert len(rows) == len(rep.rows)
    line = next(r for r in rows if r["measure"] == "geodesic-mix curvature trace")
    assert float(line["value"]) == trace.value and float(line["stderr"]) == trace.stderr
    assert int(line["n_hvp"]) == trace.n_hvp and line["rho"] == ""
    assert json.loads(line["per_batch"]) == trace.per_batch
    pytest.importorskip("matplotlib")
    page = rep.write_html(tmp_path / "r.html").read_text()
    assert "geodesic-mix curvature trace" in page and "HVPs" in page


NET_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h, _ = self.attn(x, x, x, need_weights=False)
            return self.head(torch.tanh(h).mean(1))


    def build():
        torch.manual_seed(0)
        return Net()
    """
)


def test_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "curvnets.py").write_text(NET_SOURCE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 5, 8, generator=g)
    y = torch.randint(0, 3, (12,), generator=g)
    np.savez(tmp_path / "data.npz", x=x.numpy(), y=y.numpy())
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                "measure",
                f"{tmp_path / 'curvnets.py'}:build",
                str(tmp_path / "data.npz"),
                "--measures",
                "curvature-inv-lmax",
                "curvature-euclidean-trace",
                "--iters",
                "10",
                "--probes",
                "5",
                "--batch-size",
                "6",
                "--out",
                str(tmp_path / "o"),
                "--report",
                "--no-progress",
                "--threads",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "geodesic-inv curvature lambda_max" in out and "HVPs" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    rows = {r["measure"]: r for r in res["results"]}
    assert set(rows) == {"geodesic-inv curvature lambda_max", "euclidean curvature trace"}
    assert rows["euclidean curvature trace"]["n_batches"] == 2
    assert rows["euclidean curvature trace"]["n_hvp"] == 2 * 5
    assert res["settings"]["curvature"]["iters"] == 10
    assert (tmp_path / "o" / "report.html").is_file()

    import importlib.util

    spec = importlib.util.spec_from_file_location("curvnets", tmp_path / "curvnets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    ref = gs.curvature(
        mod.build(), default_loss, batches, quantities="trace", measure="euclidean", probes=5
    )
    assert rows["euclidean curvature trace"]["value"] == pytest.approx(ref.trace, rel=1e-6)
