"""geosharp.studies.report on fabricated populations: files, numbers, HTML and verdicts."""

import base64
import json
import math
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from geosharp.stats import kendall_tau_a
from geosharp.studies import plots
from geosharp.studies.report import default_paper_match, write_report

RHOS = (0.01, 0.1)
MEASURES = ("geodesic-inv-o2 worst l2", "adaptive worst l2", "euclidean worst l2")
FAST = {"n_boot": 300, "n_perm": 300}


def population(m=12, seed=0, gaps=None):
    """m models on a 3 × 4 grid; three measures × two ρ.

    - geodesic-inv: a noisy *decreasing* function of the gap (τ strongly negative);
    - adaptive: a weak, noisy *increasing* function of the gap (τ positive);
    - euclidean: pure noise spanning four decades (log x-axis).
    """
    rng = np.random.default_rng(seed)
    gap = np.sort(rng.uniform(0.05, 0.3, size=m)) if gaps is None else np.asarray(gaps)
    models = [
        {
            "model_id": f"m{i:02d}",
            "gap": float(gap[i]),
            "train_err": 0.01,
            "test_err": 0.01 + float(gap[i]),
            "hparams": {"lr": [1e-3, 3e-3, 1e-2][i % 3], "width": [16, 32, 64, 128][i // 3 % 4]},
        }
        for i in range(m)
    ]
    measurements = []
    for rho in RHOS:
        geo = np.exp(-10 * gap) * rho * (1 + 0.05 * rng.normal(size=m))
        ada = rho * (gap + 0.15 * rng.normal(size=m)) + 1.0
        euc = 10 ** rng.uniform(-3, 1, size=m)
        for name, values in zip(MEASURES, (geo, ada, euc), strict=True):
            measurements += [
                {
                    "model_id": models[i]["model_id"],
                    "measure": name,
                    "rho": rho,
                    "value": float(values[i]),
                    "per_batch": [float(values[i])] * 2,
                    "time_s": 0.5,
                }
                for i in range(m)
            ]
    return models, measurements


def cell_values(measurements, models, measure, rho):
    gaps = {m["model_id"]: m["gap"] for m in models}
    rows = [x for x in measurements if x["measure"] == measure and x["rho"] == rho]
    return [gaps[x["model_id"]] for x in rows], [x["value"] for x in rows]


VOID = frozenset({"meta", "img", "br", "hr", "link", "input", "col", "source", "wbr"})


class Balance(HTMLParser):
    """Records unbalanced tags: a stack of open non-void elements."""

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.imgs = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def parse(text):
    parser = Balance()
    parser.feed(text)
    parser.close()
    return parser


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    models, measurements = population()
    paper = {"adaptive": -0.41, "geodesic inv": -0.71, "geodesic mix": -0.70}
    out = tmp_path_factory.mktemp("report")
    paths = write_report(
        out,
        title="Fabricated <study> & co",
        models=models,
        measurements=measurements,
        settings={"batch size": 128, "rhos": list(RHOS), "device": "cpu"},
        paper=paper,
        notes=["a note with <b>markup</b>"],
        gap_label="test − train error",
        **FAST,
    )
    return paths, models, measurements


def test_files_exist(written):
    paths, _, _ = written
    for path in (paths.html, paths.tau_table, paths.summary_json):
        assert path.is_file() and path.stat().st_size > 0
    assert set(paths.plots) == set(MEASURES)
    for png in paths.plots.values():
        assert png.parent.name == "plots" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_json_tau_matches_recomputation(written):
    paths, models, measurements = written
    summary = json.loads(paths.summary_json.read_text())
    assert "NaN" not in paths.summary_json.read_text()
    assert len(summary["cells"]) == len(MEASURES) * len(RHOS)
    for cell in summary["cells"]:
        t, s = cell_values(measurements, models, cell["measure"], cell["rho"])
        assert cell["tau_a"] == kendall_tau_a(t, s)  # same code path: exact
        assert cell["ci_low"] <= cell["ci_high"]
        assert 1 / 301 <= cell["p_value"] <= 1
        assert cell["n_models"] == 12 and cell["defined"]
        assert cell["median_time_s"] == 0.5
    by = {(c["measure"], c["rho"]): c for c in summary["cells"]}
    # the designed signs, so the verdicts tested below are the intended ones
    for rho in RHOS:
        assert by[("geodesic-inv-o2 worst l2", rho)]["tau_a"] < -0.7
        assert by[("adaptive worst l2", rho)]["tau_a"] > 0
        assert by[("geodesic-inv-o2 worst l2", rho)]["paper_tau"] == -0.71
        assert by[("euclidean worst l2", rho)]["paper_family"] is None


def test_markdown_table_one_row_per_measure(written):
    paths, models, measurements = written
    text = paths.tau_table.read_text().split("\n## ")[0]  # the τ table, not the paired one
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header, sep, body = rows[0], rows[1], rows[2:]
    assert header == "| measure | ρ = 0.01 | ρ = 0.1 | paper τ |"
    assert set(sep) <= {"|", "-"}
    assert [r.split("|")[1].strip() for r in body] == list(MEASURES)
    assert all(r.count("|") == header.count("|") for r in body)
    assert "M = 12 models" in text and "percentile bootstrap" in text
    t, s = cell_values(measurements, models, MEASURES[0], 0.01)
    assert f"{kendall_tau_a(t, s):.2f} [" in body[0]
    assert body[0].endswith("| -0.71 (geodesic inv) |")
    assert body[2].endswith("| – |")


def test_html_is_self_contained_balanced_and_has_the_numbers(written):
    paths, models, measurements = written
    text = paths.html.read_text()
    parser = parse(text)
    assert parser.errors == [] and parser.stack == []
    # escaped user text, no raw markup from inputs
    assert "Fabricated &lt;study&gt; &amp; co" in text and "<study>" not in text
    assert "&lt;b&gt;markup&lt;/b&gt;" in text
    # one embedded PNG per measure, no external assets
    assert len(parser.imgs) == len(MEASURES)
    for img in parser.imgs:
        src = img["src"]
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    assert not re.search(r'(src|href)="(http|//)', text)
    for measure in MEASURES:
        for rho in RHOS:
            t, s = cell_values(measurements, models, measure, rho)
            assert f"τ-a = {kendall_tau_a(t, s):.2f}" in text
    assert "test − train error" in text and "Generated by geosharp" in text
    assert "m11" in text and "width" in text  # per-model table with hparams


def test_paper_comparison_verdicts(written):
    paths, _, _ = written
    summary = json.loads(paths.summary_json.read_text())
    comp = summary["paper_comparison"]
    assert comp["families"]["geodesic inv"]["sign_verdict"] == "same"
    assert comp["families"]["adaptive"]["sign_verdict"] == "opposite"
    assert comp["ordering_by"] == "|τ|" and comp["ordering_holds"] is True
    assert comp["unmatched_paper_families"] == ["geodesic mix"]
    text = paths.html.read_text()
    assert "geodesic inv: our τ-a has the same sign as the paper&#x27;s" in text
    assert "adaptive: our τ-a has the opposite sign to the paper&#x27;s" in text
    assert "Ordering of families by |τ|" in text
    assert "The paper&#x27;s ordering holds in our results." in text


def test_paper_ordering_violation_and_custom_match(tmp_path):
    models, measurements = population()
    # Paper claims adaptive is the stronger one; ours has geodesic far stronger.
    paths = write_report(
        tmp_path,
        title="t",
        models=models,
        measurements=measurements,
        settings={},
        paper={"adaptive": -0.9, "geodesic inv": -0.1, "euclid": 0.5},
        paper_match=lambda m: "euclid" if m.startswith("euclidean") else default_paper_match(m),
        **FAST,
    )
    comp = json.loads(paths.summary_json.read_text())["paper_comparison"]
    assert comp["ordering_holds"] is False
    assert set(comp["families"]) == {"adaptive", "geodesic inv", "euclid"}
    assert "does not hold in our results: adaptive is not stronger than geodesic inv" in (
        paths.html.read_text().replace("&#x27;", "'")
    )


def test_all_equal_gaps_are_undefined(tmp_path):
    models, measurements = population(gaps=[0.1] * 12)
    paths = write_report(
        tmp_path,
        title="flat",
        models=models,
        measurements=measurements,
        settings={"x": 1},
        paper={"adaptive": -0.41},
        **FAST,
    )
    md = paths.tau_table.read_text().split("\n## ")[0]
    body = [line for line in md.splitlines() if line.startswith("|")][2:]
    assert len(body) == 3
    assert all("undefined (all gaps equal)" in row for row in body)
    text = paths.html.read_text()
    assert "undefined (all gaps equal)" in text and "nan" not in text.lower().split("base64")[0]
    assert parse(text).errors == []
    summary = json.loads(paths.summary_json.read_text())
    assert all(c["tau_a"] is None and not c["defined"] for c in summary["cells"])
    assert summary["paper_comparison"]["families"]["adaptive"]["sign_verdict"] == "undefined"
    assert summary["paper_comparison"]["ordering_holds"] is None


def test_too_few_finite_values_and_missing_cells(tmp_path):
    models, _ = population(m=5)
    measurements = [
        {"model_id": "m00", "measure": "broken", "rho": 0.1, "value": 1.0},
        {"model_id": "m01", "measure": "broken", "rho": 0.1, "value": math.nan},
        {"model_id": "m02", "measure": "broken", "rho": 0.1, "value": None},
        {"model_id": "m03", "measure": "broken", "rho": 0.1, "value": 2.0},
    ] + [
        {"model_id": m["model_id"], "measure": "relative flatness", "rho": None, "value": i + 1.0}
        for i, m in enumerate(models)
    ]
    paths = write_report(
        tmp_path, title="t", models=models, measurements=measurements, settings={}, **FAST
    )
    md = paths.tau_table.read_text()
    assert "| measure | no ρ | ρ = 0.1 |" in md  # no paper column without a paper
    assert "undefined (only 2 model(s) with finite values (need ≥ 3); 2 model(s) dropped" in md
    broken_row = next(r for r in md.splitlines() if r.startswith("| broken"))
    assert broken_row.split("|")[2].strip() == "–"  # not measured without ρ
    text = paths.html.read_text()
    assert parse(text).errors == [] and "Comparison with the paper" not in text
    summary = json.loads(paths.summary_json.read_text())
    assert summary["paper_comparison"] is None
    flat = next(c for c in summary["cells"] if c["measure"] == "relative flatness")
    assert flat["rho"] is None and flat["defined"] and flat["n_models"] == 5


def test_log_axis_rule():
    assert plots.log_x(np.array([1e-3, 1.0]))
    assert not plots.log_x(np.array([1.0, 50.0]))  # under two decades
    assert not plots.log_x(np.array([-1.0, 1e3]))  # not all positive
    assert not plots.log_x(np.array([]))


def test_default_paper_match():
    assert default_paper_match("adaptive worst linf") == "adaptive"
    assert default_paper_match("elementwise-adaptive avg") == "adaptive"
    assert default_paper_match("geodesic-inv-o2 worst l2") == "geodesic inv"
    assert default_paper_match("Geodesic_mix avg") == "geodesic mix"
    assert default_paper_match("euclidean worst l2") is None


@pytest.mark.parametrize(
    ("models", "measurements", "match"),
    [
        ([], [], "models is empty"),
        ([{"model_id": "a"}], [], "models\\[0\\] has no 'gap'"),
        ([{"model_id": "a", "gap": 0.1}] * 2, [], "appears twice"),
        ([{"model_id": "a", "gap": "x"}], [], r"models\[0\]\['gap'\] must be a number"),
        (
            [{"model_id": "a", "gap": 0.1}],
            [{"model_id": "b", "measure": "m", "rho": 0.1, "value": 1.0}],
            "model_id 'b', which is not in models",
        ),
        (
            [{"model_id": "a", "gap": 0.1}],
            [{"model_id": "a", "measure": "m", "rho": 0.1, "value": 1.0}] * 2,
            "repeats model 'a'",
        ),
    ],
)
def test_bad_input_errors(tmp_path, models, measurements, match):
    with pytest.raises(ValueError, match=match):
        write_report(tmp_path, title="t", models=models, measurements=measurements, settings={})


def test_no_corrected_norm_ablation_is_not_filed_under_the_papers_adaptive_family():
    from geosharp.studies.report import default_paper_match

    assert default_paper_match("geodesic-inv-o2-adaptivenorm worst l2") is None
    assert default_paper_match("adaptive worst l2") == "adaptive"
    assert default_paper_match("geodesic-mix-o2 worst l2") == "geodesic mix"


def test_measures_with_their_own_rho_grids_get_one_column_per_grid_position(tmp_path):
    """Radii of different balls differ: columns are grid positions and cells name their ρ."""
    models, measurements = population()
    shifted = [dict(r, rho=r["rho"] * 100) for r in measurements if r["measure"] == MEASURES[1]]
    kept = [r for r in measurements if r["measure"] != MEASURES[1]]
    flat = [
        {"model_id": m["model_id"], "measure": "relative_flatness", "rho": None, "value": i}
        | {"per_batch": [float(i)], "time_s": 0.1}
        for i, m in enumerate(models)
    ]
    paths = write_report(
        tmp_path, title="t", models=models, measurements=kept + shifted + flat, settings={}, **FAST
    )
    lines = paths.tau_table.read_text().splitlines()
    assert lines[2] == f"**{' '.join(paths.headline)}**"  # the headline, then the table
    assert lines[4] == "| measure | smallest ρ | largest ρ |"
    (row,) = [x for x in lines if x.startswith(f"| {MEASURES[1]} |")]
    cells = row.split(" | ")[1:]
    assert cells[0].startswith("ρ = 1: ") and cells[1].startswith("ρ = 10: ")
    (row,) = [x for x in lines if x.startswith("| relative_flatness |")]
    assert row.split(" | ")[1][0] in "-0123456789" and row.endswith("| – |")
    page = paths.html.read_text()
    assert "<th>smallest ρ</th><th>largest ρ</th>" in page and "ρ = 10<br>τ-a = " in page
    assert not parse(page).errors
    # One shared grid keeps one column per ρ.
    same = write_report(
        tmp_path / "same", title="t", models=models, measurements=kept, settings={}, **FAST
    )
    assert same.tau_table.read_text().splitlines()[4] == "| measure | ρ = 0.01 | ρ = 0.1 |"


def test_geodesic_is_compared_with_adaptive_model_by_model(written):
    paths, models, measurements = written
    summary = json.loads(paths.summary_json.read_text())
    paired = summary["geodesic_vs_adaptive"]
    assert [(p["geodesic"], p["adaptive"], p["position"]) for p in paired] == [
        (MEASURES[0], MEASURES[1], 0),
        (MEASURES[0], MEASURES[1], 1),
    ]
    for p, rho in zip(paired, RHOS, strict=True):
        gaps, geo = cell_values(measurements, models, MEASURES[0], rho)
        _, ada = cell_values(measurements, models, MEASURES[1], rho)
        assert p["diff"] == pytest.approx(kendall_tau_a(gaps, geo) - kendall_tau_a(gaps, ada))
        # geodesic: strongly negative like the paper's −0.71; adaptive: positive
        assert p["ci_high"] < 0 and p["verdict"] == "geodesic stronger"
        assert p["direction"] == "negative" and p["n_models"] == len(models)
    assert "## Geodesic against adaptive sharpness, model by model" in paths.tau_table.read_text()
    assert "geodesic stronger" in paths.html.read_text()
