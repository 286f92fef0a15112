"""The HTML page of a study report: the models table fits the page (issue 13)."""

import re

from geosharp.studies.report import write_report

FAST = {"n_boot": 50, "n_perm": 50}


def test_models_table_is_compact_with_wrapping_headers_and_right_aligned_numbers(tmp_path):
    hp = {
        "label_smoothing": 0.1,
        "weight_decay": 1e-4,
        "batch_size": 64,
        "optimizer": "adamw",
        "augmentation_strength": 0.25,
    }
    models = [
        {"model_id": f"vit-{i:03d}", "gap": 0.01 * i, "train_loss": 0.1, "hparams": hp}
        for i in range(4)
    ]
    meas = [
        {"model_id": f"vit-{i:03d}", "measure": "adaptive worst l2", "rho": r, "value": r * i}
        for i in range(4)
        for r in (0.1, 1.0)
    ]
    page = write_report(
        tmp_path, title="t", models=models, measurements=meas, settings={}, **FAST
    ).html.read_text()
    assert '<table class="models">' in page
    assert "table.models { font-size: .8em; }" in page
    assert "table.models td:first-child { white-space: nowrap; }" in page
    head = re.search(r'<table class="models">\s*<tr>(.*?)</tr>', page, re.S).group(1)
    assert "<th>label smoothing</th>" in head and "<th>augmentation strength</th>" in head
    assert "_" not in head
    row = re.search(r"<tr><td>vit-001</td>(.*?)</tr>", page).group(1)
    assert '<td class="num">0.1</td>' in row and '<td class="num">64</td>' in row
    assert "<td>adamw</td>" in row
    # one figure per measure, panels per ρ explained once
    assert page.count("<figure>") == 1 and "One panel per ρ" in page
    assert "<h2>Sharpness against generalization gap</h2>" in page
