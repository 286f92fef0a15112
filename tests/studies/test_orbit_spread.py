"""The orbit spread of a population (issue 44, deliverable 1): the statistic against closed
forms on hand-made heads (float64), the per-head rows of a model with known imbalance, the note,
and the report section (present with recorded heads, absent without)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from geosharp.models.transformer import Block
from geosharp.studies.orbit_spread import (
    head_rows,
    model_stats,
    population_spread,
    read_rows,
    spread_level,
    write_rows,
)
from geosharp.studies.orbit_spread_report import (
    LARGE_SPREAD,
    SMALL_SPREAD,
    spread_note,
    spread_sections,
)
from geosharp.studies.report import write_report

DT = torch.float64


def _imb(a: float, b: float) -> float:
    """Imbalance of G = a·I, H = b·I (h × h blocks): |a² − b²| / (a² + b²)."""
    return abs(a * a - b * b) / (a * a + b * b)


def _head(model_id: str, kind: str, head: int, a: float, b: float, h: int = 4) -> dict:
    """The row of a head with G = a·I_h, H = b·I_h: ‖GᵀG ∓ HᵀH‖² = h (a² ∓ b²)²."""
    return {
        "model_id": model_id,
        "block": f"blocks.0.attn[{kind}]",
        "category": kind,
        "head": head,
        "imbalance": _imb(a, b),
        "log_scale": 0.5 * math.log(a / b),
        "excess": 0.0,
        "diff_sq": h * (a * a - b * b) ** 2,
        "sum_sq": h * (a * a + b * b) ** 2,
    }


def test_model_and_population_spread_match_closed_forms():
    # model m: QK heads with (a, b) = (1, 1) and (2, 1); VO heads balanced
    scales = {"m0": (1.0, 2.0), "m1": (1.0, 3.0), "m2": (1.5, 1.5)}
    rows = []
    for mid, (s0, s1) in scales.items():
        rows += [_head(mid, "QK", 0, s0, 1.0), _head(mid, "QK", 1, s1, 1.0)]
        rows += [_head(mid, "VO", 0, 1.0, 1.0), _head(mid, "VO", 1, 2.0, 2.0)]
    stats = model_stats(rows)
    for mid, (s0, s1) in scales.items():
        want = math.sqrt(
            ((s0**2 - 1) ** 2 + (s1**2 - 1) ** 2) / ((s0**2 + 1) ** 2 + (s1**2 + 1) ** 2)
        )
        assert stats[(mid, "QK")]["imbalance"] == pytest.approx(want, rel=1e-14)
        assert stats[(mid, "QK")]["within"] == pytest.approx(
            abs(_imb(s0, 1) - _imb(s1, 1)) / 2, rel=1e-14
        )
        assert stats[(mid, "VO")]["imbalance"] == 0.0
    qk, vo = population_spread(rows)
    model_imb = [stats[(m, "QK")]["imbalance"] for m in scales]
    assert qk.category == "QK" and qk.models == 3 and qk.heads == 2
    assert qk.across == pytest.approx(np.std(model_imb, ddof=1), rel=1e-14)
    assert qk.imbalance == (float(np.median(model_imb)), min(model_imb), max(model_imb))
    head0 = [_imb(s0, 1) for s0, _ in scales.values()]
    head1 = [_imb(s1, 1) for _, s1 in scales.values()]
    assert qk.headwise == pytest.approx(
        np.median([np.std(head0, ddof=1), np.std(head1, ddof=1)]), rel=1e-14
    )
    logs = [0.25 * (math.log(s0) + math.log(s1)) for s0, s1 in scales.values()]
    assert qk.log_scale_sd == pytest.approx(np.std(logs, ddof=1), rel=1e-12)
    assert vo.across == 0.0 and vo.within == 0.0 and vo.headwise == 0.0
    assert spread_level([qk, vo]) == qk.across
    # only the analysed models count; one model has no spread across models
    (one, _) = population_spread(rows, ["m1"])
    assert one.across == 0.0 and math.isnan(one.headwise)


def test_identical_models_have_zero_spread_and_the_small_note():
    rows = [_head(f"m{i}", "QK", j, 1.0 + 0.1 * j, 1.0) for i in range(5) for j in range(3)]
    (qk,) = population_spread(rows)
    assert qk.across == 0.0 and qk.headwise == 0.0 and qk.within > 0
    note = spread_note([qk])
    assert note is not None and note.startswith("Orbit spread 0 (≤ 0.001)")
    assert "cannot differ" in note


def test_note_names_the_committed_study_at_each_level():
    def spread(scales):
        rows = [_head(f"m{i}", "VO", 0, s, 1.0) for i, s in enumerate(scales)]
        return population_spread(rows)

    large = spread([1.0, 2.0, 4.0, 8.0])
    assert spread_level(large) >= LARGE_SPREAD
    assert "Study 4" in spread_note(large) and "−0.06 [−0.12, −0.01]" in spread_note(large)
    mid = spread([1.0, 1.05, 1.1])
    assert SMALL_SPREAD < spread_level(mid) < LARGE_SPREAD
    assert "Study 2" in spread_note(mid)
    tiny = spread([1.0, 1.0 + 1e-5])
    assert spread_level(tiny) <= SMALL_SPREAD and "Study 3" in spread_note(tiny)
    pairs = [
        {**_head(f"m{i}", "pair", 0, s, 1.0), "category": "pair"} for i, s in enumerate((1, 9))
    ]
    assert math.isnan(spread_level(population_spread(pairs)))
    assert "element-wise" in spread_note(population_spread(pairs))
    assert spread_note([]) is None


def _balanced_block(a: float, b: float, c: float, d: float) -> Block:
    """A block whose QK heads have G = a·[I; 0], H = b·[I; 0] and VO heads c and d."""
    model = Block(dim=8, num_heads=2, mlp_dim=12).to(DT).eval()
    attn = model.attn
    h = attn.head_dim
    eye = torch.eye(h, 8, dtype=DT)
    with torch.no_grad():
        for i in range(attn.num_heads):
            r = slice(i * h, (i + 1) * h)
            attn.q.weight[r] = a * eye
            attn.q.bias[r] = 0.0
            attn.k.weight[r] = b * eye
            attn.k.bias[r] = 0.0
            attn.v.weight[r] = c * eye
            attn.v.bias[r] = 0.0
            attn.o.weight[:, r] = d * eye.T
    return model


def test_head_rows_of_a_hand_made_model_have_the_known_imbalance(tmp_path):
    model = _balanced_block(2.0, 0.5, 1.0, 3.0)
    rows = head_rows(model, model_id="m", key_bias="quotient")
    by = {(r["category"], r["head"]): r for r in rows}
    assert set(by) == {("QK", 0), ("QK", 1), ("VO", 0), ("VO", 1)}
    for i in range(2):
        assert by[("QK", i)]["imbalance"] == pytest.approx(_imb(2.0, 0.5), rel=1e-13)
        assert by[("VO", i)]["imbalance"] == pytest.approx(_imb(1.0, 3.0), rel=1e-13)
        assert by[("QK", i)]["log_scale"] == pytest.approx(0.5 * math.log(4.0), rel=1e-13)
    # written and read back exactly
    path = write_rows(tmp_path / "orbit_spread.csv", rows)
    assert read_rows(path) == rows
    assert read_rows(tmp_path / "missing.csv") == []


def _report_inputs(n: int = 6):
    models = [{"model_id": f"m{i}", "gap": 0.1 * i} for i in range(n)]
    meas = []
    for i in range(n):
        for measure, rho, v in (
            ("adaptive worst l2", 0.1, (i * 7) % n),
            ("geodesic-inv-o2 worst l2", 0.01, i),
        ):
            meas.append({"model_id": f"m{i}", "measure": measure, "rho": rho, "value": float(v)})
    return models, meas


def test_report_shows_the_spread_beside_the_paired_delta_tau(tmp_path):
    models, meas = _report_inputs()
    rows = [_head(f"m{i}", "QK", 0, 1.0 + 0.5 * i, 1.0) for i in range(6)]
    write_rows(tmp_path / "orbit_spread.csv", rows)
    paths = write_report(tmp_path, title="t", models=models, measurements=meas, settings={})
    md = paths.tau_table.read_text()
    assert "## Orbit spread of the population" in md
    assert "## Orbit spread and the paired Δτ, beside the committed studies" in md
    assert "| this study |" in md and "Study 4 (results/vit-orbit)" in md
    assert any(line.startswith("Orbit spread ") for line in paths.headline)
    assert "Orbit spread of the population" in paths.html.read_text()
    sections = spread_sections(rows, {f"m{i}": 0.1 * i for i in range(6)})
    assert len(sections) == 2 and sections[0].rows[0][0] == "QK"


def test_report_without_recorded_heads_is_unchanged(tmp_path):
    models, meas = _report_inputs()
    a = write_report(tmp_path / "a", title="t", models=models, measurements=meas, settings={})
    assert "Orbit spread" not in a.tau_table.read_text()
    assert not any("Orbit spread" in line for line in a.headline)
